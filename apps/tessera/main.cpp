// tessera: serve, generate, chat, tokenize, bench, eval, quantize, inspect plugins and configs.
#include <CLI/CLI.hpp>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <cstdio>
#include <exception>

#include "cmd_router.h"
#include "commands.h"

int main(int argc, char** argv) {
  CLI::App app{"tessera: an LLM serving stack assembled from plugins"};
  app.require_subcommand(1);
  app.set_help_all_flag("--help-all", "Show help for every subcommand");
  std::string log_level = "warn";
  app.add_option("--log-level", log_level, "trace, debug, info, warn, error")
      ->capture_default_str();
  app.parse_complete_callback([&] { spdlog::set_level(spdlog::level::from_str(log_level)); });
  // Logs go to stderr: stdout carries results (token ids, JSON lines).
  spdlog::set_default_logger(spdlog::stderr_color_mt("tessera"));
  tessera::cli::add_serve_command(app);
  tessera::cli::add_generate_command(app);
  tessera::cli::add_chat_command(app);
  tessera::cli::add_tokenize_command(app);
  tessera::cli::add_tokenizer_command(app);
  tessera::cli::add_plugins_command(app);
  tessera::cli::add_config_command(app);
  tessera::cli::add_bench_command(app);
  tessera::cli::add_eval_command(app);
  tessera::cli::add_quantize_command(app);
  tessera::cli::add_router_command(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
