// tessera tokenizer export: writes the GGUF file's tokenizer as a Hugging Face tokenizer.json
// (plus tokenizer_config.json beside it), so clients that count tokens themselves (lm-eval,
// AIPerf, guidellm) get exactly the ids Tessera feeds the model, without a hub download.
//
// Byte-level BPE vocabularies ("gpt2" GGUF models: SmolLM2, Qwen2, Llama 3, GPT-2) are
// exported: the pre-tokenizer's splitters as Split(Isolated) regex steps then ByteLevel, the
// vocabulary and merges in rank order, control / user-defined tokens as added tokens (so they
// are recognized in text, as /v1/completions does by default), BOS through a post-processor
// when the model adds one. SentencePiece vocabularies are refused with a message.
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include "commands.h"
#include "tessera/config.h"
#include "tessera/gguf.h"
#include "tessera/tokenizer.h"

namespace tessera::cli {
namespace {

using nlohmann::json;
using nlohmann::ordered_json;

struct ExportOptions {
  std::string model;
  std::string out;
};

std::optional<std::string> token_or_null(const Tokenizer& tok, int32_t id) {
  if (id < 0 || id >= tok.vocab_size()) return std::nullopt;
  return tok.token_text(id);
}

ordered_json special_or_null(const Tokenizer& tok, int32_t id) {
  auto t = token_or_null(tok, id);
  return t ? ordered_json(*t) : ordered_json(nullptr);
}

ordered_json tokenizer_json(const gguf::GgufFile& file, const Tokenizer& tok) {
  if (tok.kind() != Tokenizer::Kind::kBpe)
    throw CommandError("tokenizer export: only byte-level BPE vocabularies (tokenizer.ggml.model \"gpt2\") can be "
                       "exported; this one is \"" + tok.model_name() + "\"");
  ordered_json added = ordered_json::array();
  ordered_json vocab = ordered_json::object();
  int num_duplicates = 0;
  for (int32_t id = 0; id < tok.vocab_size(); ++id) {
    const std::string& text = tok.token_text(id);
    if (vocab.contains(text)) {
      ++num_duplicates;  // a map cannot hold it; the first id keeps the text, as Tessera's lookup does
    } else {
      vocab[text] = id;
    }
    const uint32_t attr = tok.token_attr(id);
    const bool control = attr & (Tokenizer::kAttrControl | Tokenizer::kAttrUnknown);
    if (!control && !(attr & Tokenizer::kAttrUserDefined)) continue;
    added.push_back({{"id", id},
                     {"content", text},
                     {"single_word", false},
                     {"lstrip", (attr & Tokenizer::kAttrLstrip) != 0},
                     {"rstrip", (attr & Tokenizer::kAttrRstrip) != 0},
                     {"normalized", false},
                     {"special", control}});
  }
  if (num_duplicates > 0)
    std::fprintf(stderr, "tokenizer export: %d duplicate token texts kept at their first id\n", num_duplicates);

  ordered_json merges = ordered_json::array();
  if (const auto* list = file.opt_string_array("tokenizer.ggml.merges")) {
    for (const std::string& m : *list) {
      const size_t pos = m.find(' ', 1);  // a merge may start with a space, as the tokenizer reads them
      if (pos == std::string::npos) continue;
      merges.push_back({m.substr(0, pos), m.substr(pos + 1)});
    }
  }

  ordered_json steps = ordered_json::array();
  for (const std::string& regex : tok.pre_tokenizer_regexes())
    steps.push_back({{"type", "Split"}, {"pattern", {{"Regex", regex}}}, {"behavior", "Isolated"}, {"invert", false}});
  steps.push_back({{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", false}});

  ordered_json post = nullptr;
  if (tok.add_bos() && token_or_null(tok, tok.bos_id())) {
    const std::string bos = tok.token_text(tok.bos_id());
    const ordered_json special = {{"SpecialToken", {{"id", bos}, {"type_id", 0}}}};
    post = {{"type", "TemplateProcessing"},
            {"single", {special, {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}}},
            {"pair", {special, {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}, special,
                      {{"Sequence", {{"id", "B"}, {"type_id", 1}}}}}},
            {"special_tokens", {{bos, {{"id", bos}, {"ids", {tok.bos_id()}}, {"tokens", {bos}}}}}}};
  }

  ordered_json out;
  out["version"] = "1.0";
  out["truncation"] = nullptr;
  out["padding"] = nullptr;
  out["added_tokens"] = std::move(added);
  out["normalizer"] = nullptr;
  out["pre_tokenizer"] = {{"type", "Sequence"}, {"pretokenizers", std::move(steps)}};
  out["post_processor"] = std::move(post);
  out["decoder"] = {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", true}, {"use_regex", true}};
  out["model"] = {{"type", "BPE"},
                  {"dropout", nullptr},
                  {"unk_token", special_or_null(tok, tok.unk_id())},
                  {"continuing_subword_prefix", nullptr},
                  {"end_of_word_suffix", nullptr},
                  {"fuse_unk", false},
                  {"byte_fallback", false},
                  {"ignore_merges", tok.ignore_merges()},
                  {"vocab", std::move(vocab)},
                  {"merges", std::move(merges)}};
  return out;
}

ordered_json tokenizer_config_json(const gguf::GgufFile& file, const Tokenizer& tok) {
  ordered_json c;
  c["tokenizer_class"] = "PreTrainedTokenizerFast";
  c["bos_token"] = special_or_null(tok, tok.bos_id());
  c["eos_token"] = special_or_null(tok, tok.eos_id());
  c["unk_token"] = special_or_null(tok, tok.unk_id());
  c["pad_token"] = special_or_null(tok, tok.pad_id());
  c["add_bos_token"] = tok.add_bos();
  c["add_eos_token"] = tok.add_eos();
  c["clean_up_tokenization_spaces"] = tok.clean_spaces();
  if (auto arch = file.opt_string("general.architecture"))
    if (auto ctx = file.opt_uint(*arch + ".context_length")) c["model_max_length"] = *ctx;
  if (!tok.chat_template().empty()) c["chat_template"] = tok.chat_template();
  return c;
}

void write_json(const std::filesystem::path& path, const ordered_json& j) {
  std::ofstream out(path, std::ios::binary);
  if (!out) throw CommandError("tokenizer export: cannot write " + path.string());
  out << j.dump(1, ' ', false, json::error_handler_t::replace) << '\n';
  if (!out) throw CommandError("tokenizer export: writing " + path.string() + " failed");
}

void run_export(const ExportOptions& opt) {
  auto file = gguf::GgufFile::open(resolve_model_path(opt.model));
  auto tok = Tokenizer::from_gguf(*file);
  std::filesystem::path out(opt.out);
  if (std::filesystem::is_directory(out) || (!opt.out.empty() && opt.out.back() == '/')) out /= "tokenizer.json";
  if (out.has_parent_path()) std::filesystem::create_directories(out.parent_path());
  write_json(out, tokenizer_json(*file, *tok));
  const auto config_path = out.parent_path() / "tokenizer_config.json";
  write_json(config_path, tokenizer_config_json(*file, *tok));
  std::fprintf(stderr, "wrote %s and %s (%d tokens)\n", out.string().c_str(), config_path.string().c_str(),
               tok->vocab_size());
}

}  // namespace

void add_tokenizer_command(CLI::App& app) {
  CLI::App* cmd = app.add_subcommand("tokenizer", "tokenizer tools (export to Hugging Face format)");
  cmd->require_subcommand(1);
  auto opt = std::make_shared<ExportOptions>();
  CLI::App* exp = cmd->add_subcommand(
      "export", "write the model's tokenizer as a Hugging Face tokenizer.json (+ tokenizer_config.json beside it)");
  exp->add_option("model", opt->model, "GGUF file (or cached model name)")->required();
  exp->add_option("out", opt->out, "output tokenizer.json path (or a directory)")->required();
  exp->callback([opt] { run_export(*opt); });
}

}  // namespace tessera::cli
