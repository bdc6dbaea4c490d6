// The plugin registry: built-in plugins plus libraries found on the plugin path, loaded with
// Boost.DLL. A library is checked (magic, SDK ABI version, toolchain) before anything else
// of it is used; a mismatch is recorded as a load error naming both values and reported
// when a config asks for that plugin. Objects created through the registry keep their
// library loaded for as long as they live.
#pragma once

#include <filesystem>
#include <map>
#include <memory>
#include <set>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "tessera/sdk/plugin.h"

namespace tessera {

class PluginError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Parses "scheduler", "kv_cache", ... ; returns false for an unknown name.
bool parse_plugin_kind(std::string_view name, PluginKind* kind);

struct PluginInfo {
  const PluginManifest* manifest = nullptr;  // valid while the registry lives
  std::string library_path;                   // empty for built-in plugins

  PluginKind kind() const { return manifest->kind; }
  std::string name() const { return manifest->name; }
  std::string qualified_name() const;         // "kind.name", e.g. "sampler.standard"
  // The manifest's declared capabilities ("grouped_matmul", ...) and needs
  // ("backend.forward_runner", ...); empty for a library built against SDK < 2.6.
  std::vector<std::string> capabilities() const;
  std::vector<std::string> needs() const;
  bool has_capability(std::string_view capability) const;
};

// Splits a manifest's space-separated capability list (null: none).
std::vector<std::string> split_capability_list(const char* list);

// A library that was found but refused (bad ABI, missing symbol, dlopen failure).
struct PluginLoadError {
  std::string library_path;
  std::string plugin_name;  // from the library file name when the manifest was unreadable
  std::string message;
};

class PluginRegistry {
 public:
  // Starts with the core's built-in plugins (backend.cpu) registered.
  PluginRegistry();
  ~PluginRegistry();
  PluginRegistry(const PluginRegistry&) = delete;
  PluginRegistry& operator=(const PluginRegistry&) = delete;

  // Registers a plugin compiled into the host (e.g. backend.cpu). Throws PluginError on a
  // duplicate kind+name.
  void add_builtin(const PluginManifest* manifest);

  // Loads every libtessera-*.so in `dir` (not recursive). A missing directory is ignored.
  // Refused libraries go to load_errors(); a duplicate kind+name is a load error too.
  void scan_directory(const std::filesystem::path& dir);
  // The build's plugin folder, the installed plugin folder, each entry of
  // TESSERA_PLUGIN_PATH (':'-separated), then `extra` (from YAML plugin_paths).
  void scan_default_paths(const std::vector<std::filesystem::path>& extra = {});

  const PluginInfo* find(PluginKind kind, std::string_view name) const;
  std::vector<const PluginInfo*> list(PluginKind kind) const;
  std::vector<const PluginInfo*> all() const;
  const std::vector<PluginLoadError>& load_errors() const { return load_errors_; }
  // Registered names of a kind joined with ", " (for "unknown plugin" messages).
  std::string names_of(PluginKind kind) const;
  // Why kind+name is not available, without a key path: the load error of a refused library
  // of that name, "plugin 'static' is a scheduler, not a sampler", or "unknown sampler plugin
  // 'x'; registered sampler plugins: a, b". Used by create_raw and config validation.
  std::string describe_missing(PluginKind kind, std::string_view name) const;
  // Directories scanned so far (existing ones only), in scan order.
  const std::vector<std::string>& scanned_dirs() const { return scanned_dirs_; }

  // Creates an object of plugin kind+name. Throws PluginError with "<key_path>: plugin
  // '<name>': <message>" on failure (unknown name lists the registered ones; a refused
  // library gives its load error). The returned pointer keeps the library loaded.
  std::shared_ptr<void> create_raw(PluginKind kind, std::string_view name,
                                   const PluginConfig& config, const PluginContext& context);
  template <class Interface>
  std::shared_ptr<Interface> create(std::string_view name, const PluginConfig& config,
                                    const PluginContext& context) {
    auto raw = create_raw(PluginKindOf<Interface>::value, name, config, context);
    return std::shared_ptr<Interface>(raw, static_cast<Interface*>(raw.get()));
  }

 private:
  struct Library;
  void load_library(const std::filesystem::path& path);

  std::vector<std::shared_ptr<Library>> libraries_;
  std::map<std::pair<PluginKind, std::string>, PluginInfo, std::less<>> plugins_;
  std::map<std::pair<PluginKind, std::string>, std::shared_ptr<Library>> plugin_libraries_;
  std::vector<PluginLoadError> load_errors_;
  std::vector<std::string> scanned_dirs_;
  std::set<std::string> loaded_paths_;  // canonical paths, so a file is loaded once
};

// The host logger handed to plugins (spdlog's default logger behind the SDK's interface).
Logger& host_logger();

}  // namespace tessera
