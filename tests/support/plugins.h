// The in-tree plugins as the conformance suites see them: one registry for the process
// (plugins stay loaded), and creation by name from YAML parameters validated against the
// plugin's schema, exactly as a stack file would configure them.
#pragma once

#include <doctest/doctest.h>

#include <memory>
#include <string>
#include <vector>

#include "support/test_env.h"
#include "tessera/config.h"
#include "tessera/plugin_registry.h"

namespace tessera::test {

inline PluginRegistry& plugin_registry() {
  static PluginRegistry* registry = [] {
    auto* r = new PluginRegistry();  // lives for the process, like the libraries it loads
    r->scan_directory(plugin_dir());
    return r;
  }();
  return *registry;
}

// Validates `yaml` (a flow mapping of parameters) as slot engine.<kind> and creates the plugin.
template <class Interface>
std::shared_ptr<Interface> create_plugin(const std::string& name, const std::string& yaml) {
  const PluginKind kind = PluginKindOf<Interface>::value;
  const PluginInfo* info = plugin_registry().find(kind, name);
  REQUIRE_MESSAGE(info != nullptr, plugin_kind_name(kind) << " plugin '" << name << "' not found in "
                                                          << plugin_dir().string());
  const PluginConfig config =
      validate_plugin_params(*info->manifest, std::string("engine.") + plugin_kind_name(kind), yaml);
  return plugin_registry().create<Interface>(name, config, PluginContext{&host_logger(), ""});
}

inline std::vector<std::string> plugin_names(PluginKind kind) {
  std::vector<std::string> names;
  for (const PluginInfo* info : plugin_registry().list(kind)) names.push_back(info->name());
  return names;
}

}  // namespace tessera::test
