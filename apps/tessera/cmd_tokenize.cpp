// tessera tokenize: text -> token ids (or ids -> text with --detokenize) using only the
// tokenizer stored in a GGUF file; no weights are loaded.
#include <CLI/CLI.hpp>

#include <cstdio>
#include <iostream>
#include <iterator>
#include <sstream>
#include <string>
#include <vector>

#include "commands.h"
#include "tessera/config.h"
#include "tessera/gguf.h"
#include "tessera/tokenizer.h"

namespace tessera::cli {
namespace {

struct TokenizeOptions {
  std::string model;
  std::string text;
  bool has_text = false;
  bool add_special = false;
  bool parse_special = false;
  bool detokenize = false;
  bool render_special = true;
};

std::string read_stdin() {
  return std::string(std::istreambuf_iterator<char>(std::cin), std::istreambuf_iterator<char>());
}

void run_tokenize(const TokenizeOptions& opt) {
  auto file = gguf::GgufFile::open(resolve_model_path(opt.model));
  auto tok = Tokenizer::from_gguf(*file);
  const std::string input = opt.has_text ? opt.text : read_stdin();
  if (opt.detokenize) {
    std::vector<int32_t> ids;
    std::istringstream in(input);
    std::string word;
    while (in >> word) {
      size_t used = 0;
      long v = 0;
      try {
        v = std::stol(word, &used);
      } catch (const std::exception&) {
        used = 0;
      }
      if (used != word.size()) throw CommandError("--detokenize: '" + word + "' is not a token id");
      if (v < 0 || v >= tok->vocab_size())
        throw CommandError("--detokenize: token id " + word + " is outside the vocabulary (0.." +
                           std::to_string(tok->vocab_size() - 1) + ")");
      ids.push_back(static_cast<int32_t>(v));
    }
    const std::string text = tok->decode(ids, opt.render_special);
    std::fwrite(text.data(), 1, text.size(), stdout);
    return;
  }
  const std::vector<int32_t> ids = tok->encode(input, opt.add_special, opt.parse_special);
  for (size_t i = 0; i < ids.size(); ++i) std::printf("%s%d", i ? " " : "", ids[i]);
  std::printf("\n");
}

}  // namespace

void add_tokenize_command(CLI::App& app) {
  auto opt = std::make_shared<TokenizeOptions>();
  CLI::App* cmd = app.add_subcommand(
      "tokenize", "print the token ids of text (stdin or --text), or the text of ids with --detokenize");
  cmd->add_option("-m,--model", opt->model, "GGUF file (or cached model name) whose tokenizer to use")
      ->required();
  cmd->add_option("-t,--text", opt->text, "text to tokenize (default: read stdin)")
      ->each([opt](const std::string&) { opt->has_text = true; });
  cmd->add_flag("--add-special", opt->add_special, "add BOS/EOS as the model's metadata asks");
  cmd->add_flag("--parse-special", opt->parse_special,
                "map special-token text such as <|im_start|> to its token (default: plain text)");
  cmd->add_flag("--detokenize", opt->detokenize, "read token ids, print their text");
  cmd->callback([opt] { run_tokenize(*opt); });
}

}  // namespace tessera::cli
