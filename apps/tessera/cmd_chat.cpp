// tessera chat: an interactive conversation through the model's chat template (read from the
// GGUF metadata). Each turn re-renders the whole conversation; the reply streams as it is
// generated. Commands: /reset clears the history, /exit (or end of input) quits.
#include <CLI/CLI.hpp>

#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

#include "commands.h"
#include "sampling_options.h"
#include "stack_loader.h"
#include "tessera/chat_template.h"
#include "tessera/tokenizer.h"

namespace tessera::cli {
namespace {

struct ChatOptions {
  std::string config;
  std::string system;
  SamplingOptions sampling;
};

void run_chat(const ChatOptions& opt) {
  LoadedStack stack = load_stack(opt.config, /*quiet=*/false);
  Engine& engine = *stack.engine;
  const Model& model = engine.model();
  const Tokenizer& tok = model.tokenizer();
  if (model.chat_template().empty())
    throw CommandError("chat: the model has no tokenizer.chat_template in its metadata");
  std::vector<ChatMessage> history;
  if (!opt.system.empty()) history.push_back({"system", opt.system});
  std::fprintf(stderr, "chatting with %s; /reset clears the conversation, /exit quits\n",
               model.name().c_str());
  std::string line;
  for (;;) {
    std::fprintf(stderr, "> ");
    std::fflush(stderr);
    if (!std::getline(std::cin, line) || line == "/exit" || line == "/quit") break;
    if (line == "/reset") {
      history.resize(opt.system.empty() ? 0 : 1);
      continue;
    }
    if (line.empty()) continue;
    history.push_back({"user", line});
    const std::string prompt = apply_chat_template(model.chat_template(), history, true);
    GenerationRequest req;
    req.prompt = tok.encode(prompt, /*add_special=*/true, /*parse_special=*/true);
    req.params = opt.sampling.to_params();
    std::string reply;
    StreamingDetokenizer detok(tok);
    Status error;
    req.on_event = [&](const GenerationEvent& ev) {
      for (const SampledToken& t : ev.tokens) {
        std::string piece = detok.push(t.token);
        reply += piece;
        std::fwrite(piece.data(), 1, piece.size(), stdout);
      }
      if (ev.finished) {
        std::string rest = detok.flush();
        reply += rest;
        std::fwrite(rest.data(), 1, rest.size(), stdout);
        error = ev.error;
      }
      std::fflush(stdout);
    };
    uint64_t id = 0;
    Status st = engine.submit(std::move(req), &id);
    if (!st.is_ok()) {
      // Most likely the conversation outgrew the context: say so and start over.
      std::fprintf(stderr, "error: %s (history cleared)\n", st.message().c_str());
      history.resize(opt.system.empty() ? 0 : 1);
      continue;
    }
    engine.run_until_idle();
    std::fputc('\n', stdout);
    std::fflush(stdout);
    if (!error.is_ok()) std::fprintf(stderr, "error: %s\n", error.message().c_str());
    history.push_back({"assistant", reply});
  }
}

}  // namespace

void add_chat_command(CLI::App& app) {
  auto opt = std::make_shared<ChatOptions>();
  CLI::App* cmd = app.add_subcommand("chat", "interactive chat using the model's chat template");
  cmd->add_option("-c,--config", opt->config, "stack YAML (default: configs/smollm2-cpu.yaml)");
  cmd->add_option("--system", opt->system, "system message (default: the template's own, if any)");
  opt->sampling.max_tokens = 256;
  opt->sampling.add_to(*cmd);
  cmd->callback([opt] { run_chat(*opt); });
}

}  // namespace tessera::cli
