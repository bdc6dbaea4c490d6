// Shared by the commands that run a model: registry scan, config validation, model load with
// a progress bar on stderr, engine construction.
#pragma once

#include <memory>
#include <string>

#include "tessera/config.h"
#include "tessera/engine.h"
#include "tessera/gateway/gateway.h"
#include "tessera/plugin_registry.h"

namespace tessera::cli {

struct LoadedStack {
  std::unique_ptr<PluginRegistry> registry;
  StackConfig config;
  std::unique_ptr<Engine> engine;
};

// `config_path` empty: the default stack. Throws CommandError / ConfigError with the reason.
LoadedStack load_stack(const std::string& config_path, bool quiet);

// The whole of a text file named by command-line option `option` (e.g. "--corpus"); throws
// CommandError "OPTION 'PATH': no such file / cannot read the file / the file is empty".
std::string read_text_file(const std::string& path, const char* option);
// Every deployment of the stack (an engine each), its cache layers and router: `tessera serve`.
struct LoadedGateway {
  std::unique_ptr<PluginRegistry> registry;
  StackConfig config;
  std::unique_ptr<Gateway> gateway;
};
LoadedGateway load_gateway(const std::string& config_path, bool quiet);

// Prints "\r<label> [#####     ] done/total" to stderr.
void print_progress(const char* label, size_t done, size_t total);

}  // namespace tessera::cli
