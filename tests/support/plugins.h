// The plugins as the conformance suites see them: one registry for the process (plugins stay
// loaded) holding the build's plugin folder and every folder on TESSERA_PLUGIN_PATH (so a third
// party runs the suites on its own library), and creation by name from YAML parameters
// validated against the plugin's schema, exactly as a stack file would configure them.
#pragma once

#include <doctest/doctest.h>

#include <yaml-cpp/yaml.h>

#include <cstdlib>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "support/test_env.h"
#include "tessera/config.h"
#include "tessera/plugin_registry.h"

namespace tessera::test {

inline PluginRegistry& plugin_registry() {
  static PluginRegistry* registry = [] {
    auto* r = new PluginRegistry();  // lives for the process, like the libraries it loads
    r->scan_directory(plugin_dir());
    if (const char* path = std::getenv("TESSERA_PLUGIN_PATH")) {
      std::stringstream entries(path);
      for (std::string dir; std::getline(entries, dir, ':');)
        if (!dir.empty()) r->scan_directory(dir);
    }
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

// Parameters the suites configure plugin `kind.name` with: the entry `kind.name: {...}` of the
// YAML file named by TESSERA_CONFORMANCE_PARAMS (how a third party passes the required
// parameters of its own plugin), else `fallback` (what the suite uses for in-tree plugins).
inline std::string conformance_params(PluginKind kind, const std::string& name, const std::string& fallback) {
  const char* file = std::getenv("TESSERA_CONFORMANCE_PARAMS");
  if (!file || !*file) return fallback;
  const YAML::Node root = YAML::LoadFile(file);
  const YAML::Node entry = root[std::string(plugin_kind_name(kind)) + "." + name];
  if (!entry) return fallback;
  YAML::Emitter out;
  out << YAML::Flow << entry;
  return out.c_str();
}

// The registry's load errors (a refused library on TESSERA_PLUGIN_PATH, a duplicate name):
// a suite fails on them, or a third party's plugin would silently not be tested.
inline void check_no_load_errors() {
  for (const PluginLoadError& e : plugin_registry().load_errors())
    FAIL_CHECK("plugin library refused, so it is not tested: " << e.message);
}

// Whether plugin kind.name declares `capability` (its manifest, SDK 2.6).
inline bool declares(PluginKind kind, const std::string& name, const char* capability) {
  const PluginInfo* info = plugin_registry().find(kind, name);
  return info && info->has_capability(capability);
}

// Parameter `param` of plugin kind.name's schema (read with the plugin's ParamSpec stride), if
// it declares one.
inline std::optional<ParamSpec> find_param(PluginKind kind, const std::string& name, std::string_view param) {
  const PluginInfo* info = plugin_registry().find(kind, name);
  for (size_t i = 0; info && i < info->manifest->num_params; ++i) {
    ParamSpec spec = manifest_param(*info->manifest, i);
    if (param == spec.name) return spec;
  }
  return std::nullopt;
}

// Whether plugin kind.name declares a parameter called `param` in its schema.
inline bool has_param(PluginKind kind, const std::string& name, std::string_view param) {
  return find_param(kind, name, param).has_value();
}

inline std::vector<std::string> plugin_names(PluginKind kind) {
  std::vector<std::string> names;
  for (const PluginInfo* info : plugin_registry().list(kind)) names.push_back(info->name());
  return names;
}

}  // namespace tessera::test
