// `tessera config check [FILE] [--plugin-path DIR]...`: validates a stack file (with its
// `extends:` chain) against the plugins found, and prints the resolved stack or every problem.
#include <CLI/CLI.hpp>

#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "commands.h"
#include "tessera/config.h"
#include "tessera/plugin_registry.h"

namespace tessera::cli {

namespace {

struct ConfigCheckOptions {
  std::string file;
  std::vector<std::string> plugin_paths;
};

// "name=value name=value" in schema order, values in their YAML syntax.
std::string format_params(const PluginRegistry& registry, PluginKind kind, const PluginSlot& slot) {
  const PluginInfo* info = registry.find(kind, slot.plugin);
  if (!info) return {};
  const PluginManifest& m = *info->manifest;
  std::string out;
  for (size_t i = 0; i < m.num_params; ++i) {
    const ParamSpec spec = manifest_param(m, i);
    auto it = slot.config.values().find(spec.name);
    if (it == slot.config.values().end()) continue;
    if (!out.empty()) out += " ";
    out += std::string(spec.name) + "=" + format_param_value(spec, it->second);
  }
  return out;
}

void print_slot(const PluginRegistry& registry, PluginKind kind, const std::string& key,
                const PluginSlot& slot) {
  std::string params = format_params(registry, kind, slot);
  const PluginInfo* info = registry.find(kind, slot.plugin);
  std::string origin = info && !info->library_path.empty()
                           ? info->library_path
                           : std::string("the core (built in)");
  std::printf("  %-18s %s%s%s\n", (key + ":").c_str(), slot.plugin.c_str(),
              params.empty() ? "" : "  ", params.c_str());
  std::printf("  %-18s   from %s\n", "", origin.c_str());
}

void run_config_check(const ConfigCheckOptions& options) {
  const std::string file = options.file.empty() ? default_config_path() : options.file;
  PluginRegistry registry;
  std::vector<std::filesystem::path> extra(options.plugin_paths.begin(), options.plugin_paths.end());
  registry.scan_default_paths(extra);

  StackConfig config;
  try {
    config = load_stack_config(file, registry);
  } catch (const ConfigError& e) {
    for (const auto& issue : e.issues()) std::fprintf(stderr, "%s\n", issue.to_string().c_str());
    size_t n = e.issues().size();
    throw CommandError(file + ": " + std::to_string(n) + (n == 1 ? " problem" : " problems") +
                       " found");
  }

  std::printf("%s: ok\n", file.c_str());
  // A single stack prints as `model:` / `engine.*`; several deployments under their key paths.
  const bool several = config.deployments.size() > 1;
  for (const DeploymentConfig& d : config.deployments) {
    const std::string prefix = several ? "deployments." + d.name + "." : "";
    const ModelConfig& model = d.model;
    std::printf("  %-18s %s (served as '%s', threads %s, context %s)\n", (prefix + "model:").c_str(),
                model.path.c_str(), model.name.c_str(),
                model.threads ? std::to_string(model.threads).c_str() : "all",
                model.context_length ? std::to_string(model.context_length).c_str() : "model's");
    // Not an error: the stack is valid, the weights may just not be fetched yet.
    try {
      std::string path = resolve_model_path(model.path,
                                            std::filesystem::path(file).parent_path().string());
      std::printf("  %-18s   file %s\n", "", path.c_str());
    } catch (const std::exception& e) {
      std::printf("  %-18s   note: %s\n", "", e.what());
    }
    if (&d == &config.deployments.front())
      for (const auto& dir : config.plugin_paths) std::printf("  %-18s %s\n", "plugin_path:", dir.c_str());

    static constexpr PluginKind kOrder[] = {
        PluginKind::kBackend,   PluginKind::kScheduler, PluginKind::kKvCache, PluginKind::kAttention,
        PluginKind::kQuantizer, PluginKind::kSampler,   PluginKind::kDrafter, PluginKind::kConstraint};
    for (PluginKind kind : kOrder) {
      const std::string key = prefix + "engine." + plugin_kind_name(kind);
      auto it = d.engine.find(kind);
      if (it == d.engine.end()) {
        std::printf("  %-18s off\n", (key + ":").c_str());
        continue;
      }
      print_slot(registry, kind, key, it->second);
    }
  }
  for (size_t i = 0; i < config.cache_layers.size(); ++i)
    print_slot(registry, PluginKind::kCacheLayer, "gateway.cache[" + std::to_string(i) + "]",
               config.cache_layers[i]);
  if (config.router)
    print_slot(registry, PluginKind::kRouter, "gateway.router (model '" + config.router_name + "')", *config.router);
  std::printf("  %-18s %s:%d (%zu API key%s)\n", "server:", config.server.host.c_str(),
              config.server.port, config.server.api_keys.size(),
              config.server.api_keys.size() == 1 ? "" : "s");
}

}  // namespace

void add_config_command(CLI::App& app) {
  CLI::App* config = app.add_subcommand("config", "Work with stack config files");
  config->require_subcommand(1);
  // Owned by the callback: CLI11 fills it during parse, the callback runs after.
  auto options = std::make_shared<ConfigCheckOptions>();
  CLI::App* check = config->add_subcommand(
      "check", "Validate a stack file against the plugins found; print the resolved stack");
  check->add_option("file", options->file,
                    "Stack YAML file (default: configs/smollm2-cpu.yaml)");
  check->add_option("--plugin-path", options->plugin_paths,
                    "Another folder to scan for libtessera-*.so (repeatable; also "
                    "TESSERA_PLUGIN_PATH)");
  check->callback([options] { run_config_check(*options); });
}

}  // namespace tessera::cli
