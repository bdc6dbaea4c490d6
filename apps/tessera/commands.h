// Subcommands of the `tessera` tool. Each adds itself to the CLI11 app; a failing command
// throws CommandError (message printed as "error: ...", exit status 1).
#pragma once

#include <stdexcept>
#include <string>

namespace CLI { class App; }

namespace tessera::cli {

class CommandError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

void add_serve_command(CLI::App& app);
void add_generate_command(CLI::App& app);
void add_chat_command(CLI::App& app);
void add_tokenize_command(CLI::App& app);
void add_tokenizer_command(CLI::App& app);  // tessera tokenizer export
void add_plugins_command(CLI::App& app);
void add_config_command(CLI::App& app);
void add_bench_command(CLI::App& app);
void add_eval_command(CLI::App& app);
void add_quantize_command(CLI::App& app);

// The default stack when --config is not given: configs/smollm2-cpu.yaml from the source
// tree or the install prefix.
std::string default_config_path();

}  // namespace tessera::cli
