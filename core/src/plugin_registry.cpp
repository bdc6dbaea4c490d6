// Plugin registry: Boost.DLL loading, manifest checks, and objects that keep their library
// loaded. See tessera/plugin_registry.h for the contract.
#include "text_util.h"
#include "tessera/plugin_registry.h"

#include <dlfcn.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <boost/dll/shared_library.hpp>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <set>
#include <system_error>

#include "tessera/cpu_backend.h"

namespace tessera {

namespace fs = std::filesystem;

namespace {

constexpr std::string_view kLibraryPrefix = "libtessera-";
constexpr std::string_view kLibrarySuffix = ".so";

bool is_plugin_library_name(const std::string& file_name) {
  return file_name.size() > kLibraryPrefix.size() + kLibrarySuffix.size() &&
         file_name.starts_with(kLibraryPrefix) && file_name.ends_with(kLibrarySuffix);
}

// "libtessera-foo.so" -> "foo": the best guess at the plugin's name when its manifest cannot
// be trusted (so that a config asking for "foo" can be told why it is missing).
std::string plugin_name_from_file(const std::string& file_name) {
  if (!is_plugin_library_name(file_name)) return file_name;
  return file_name.substr(kLibraryPrefix.size(),
                          file_name.size() - kLibraryPrefix.size() - kLibrarySuffix.size());
}

// Whether a load error recorded under `error_name` (a library stem or manifest name) is the
// likely reason why `name` is missing. Library stems may carry a kind prefix
// ("sampler-typical"), so a "-name" suffix also matches.
bool load_error_matches(const std::string& error_name, std::string_view name) {
  if (error_name == name) return true;
  return error_name.size() > name.size() + 1 && error_name.ends_with(name) &&
         error_name[error_name.size() - name.size() - 1] == '-';
}

using detail::join;

const char* article_for(const char* word) {
  return std::strchr("aeiou", word[0]) ? "an" : "a";
}

// capabilities and needs exist only in manifests of SDK 2.6 and later; reading them from an
// older library would read past its manifest.
bool manifest_has_capabilities(const PluginManifest& m) {
  return manifest_has_field(m, offsetof(PluginManifest, needs), sizeof(m.needs));
}

// Checks the parts of a manifest beyond the header that the host relies on. Returns an empty
// string when usable.
std::string check_manifest_body(const PluginManifest& m) {
  if (static_cast<uint32_t>(m.kind) >= static_cast<uint32_t>(kNumPluginKinds))
    return "manifest has an unknown plugin kind " + std::to_string(static_cast<uint32_t>(m.kind));
  if (!m.name || !*m.name) return "manifest has no plugin name";
  if (!m.version) return "manifest has no version";
  if (!m.create || !m.destroy) return "manifest has no create/destroy functions";
  if (m.num_params > 0 && !m.params) return "manifest declares parameters but has no table";
  const bool sized = m.header.abi_major > 2 || (m.header.abi_major == 2 && m.header.abi_minor >= 10);
  if (sized) {
    // From 2.10 the manifest says how big it and its ParamSpec entries are (the registration
    // macro writes both); the host reads appended fields and the table by those sizes.
    if (m.header.manifest_size < offsetof(PluginManifest, param_spec_size) + sizeof(m.param_spec_size))
      return "manifest_size " + std::to_string(m.header.manifest_size) + " is smaller than a " +
             std::to_string(m.header.abi_major) + "." + std::to_string(m.header.abi_minor) +
             " manifest (expected sizeof(PluginManifest), as TESSERA_REGISTER_PLUGIN writes)";
    if (m.num_params > 0 && (m.param_spec_size < offsetof(ParamSpec, min_value) ||
                             m.param_spec_size > sizeof(ParamSpec)))
      return "param_spec_size " + std::to_string(m.param_spec_size) + " is not in [" +
             std::to_string(offsetof(ParamSpec, min_value)) + ", " + std::to_string(sizeof(ParamSpec)) +
             "] (expected sizeof(ParamSpec), as TESSERA_REGISTER_PLUGIN writes)";
  }
  std::set<std::string> seen;
  for (size_t i = 0; i < m.num_params; ++i) {
    const ParamSpec p = manifest_param(m, i);
    if (!p.name || !*p.name) return "parameter #" + std::to_string(i) + " has no name";
    if (std::strcmp(p.name, "plugin") == 0)
      return "parameter name 'plugin' is reserved for the slot's plugin name";
    if (!seen.insert(p.name).second) return std::string("parameter '") + p.name + "' declared twice";
    if (static_cast<int>(p.type) < 0 || static_cast<int>(p.type) > static_cast<int>(ParamType::kStringMap))
      return std::string("parameter '") + p.name + "' has an unknown type";
    if (p.type == ParamType::kEnum && (!p.choices || !*p.choices))
      return std::string("enum parameter '") + p.name + "' declares no choices";
  }
  if (manifest_has_capabilities(m)) {
    // A capability is a lowercase identifier; a need names an engine kind and one.
    auto is_identifier = [](std::string_view s) {
      return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) {
        return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_';
      });
    };
    for (const std::string& c : split_capability_list(m.capabilities))
      if (!is_identifier(c))
        return "capability '" + c + "' is not a lowercase identifier (expected e.g. grouped_matmul)";
    for (const std::string& n : split_capability_list(m.needs)) {
      size_t dot = n.find('.');
      PluginKind kind;
      if (dot == std::string::npos || !parse_plugin_kind(n.substr(0, dot), &kind) ||
          !is_identifier(n.substr(dot + 1)))
        return "need '" + n + "' is not <kind>.<capability> (expected e.g. backend.forward_runner)";
    }
  }
  return {};
}

class SpdlogLogger final : public Logger {
 public:
  void log(LogLevel level, std::string_view message) override {
    // Looked up per call, so a default logger installed after startup (main sets one) is used.
    spdlog::default_logger_raw()->log(to_spdlog(level), "{}", message);
  }
  bool enabled(LogLevel level) const override {
    return spdlog::default_logger_raw()->should_log(to_spdlog(level));
  }

 private:
  static spdlog::level::level_enum to_spdlog(LogLevel level) {
    switch (level) {
      case LogLevel::kTrace: return spdlog::level::trace;
      case LogLevel::kDebug: return spdlog::level::debug;
      case LogLevel::kInfo: return spdlog::level::info;
      case LogLevel::kWarn: return spdlog::level::warn;
      case LogLevel::kError: return spdlog::level::err;
    }
    return spdlog::level::info;
  }
};

}  // namespace

struct PluginRegistry::Library {
  boost::dll::shared_library handle;
  std::string path;
  const PluginManifest* manifest = nullptr;
};

bool parse_plugin_kind(std::string_view name, PluginKind* kind) {
  for (int i = 0; i < kNumPluginKinds; ++i) {
    auto k = static_cast<PluginKind>(i);
    if (name == plugin_kind_name(k)) {
      if (kind) *kind = k;
      return true;
    }
  }
  return false;
}

std::string PluginInfo::qualified_name() const {
  return std::string(plugin_kind_name(kind())) + "." + manifest->name;
}

std::vector<std::string> split_capability_list(const char* list) {
  std::vector<std::string> out;
  if (!list) return out;
  std::string_view rest(list);
  while (!rest.empty()) {
    size_t start = rest.find_first_not_of(' ');
    if (start == std::string_view::npos) break;
    rest.remove_prefix(start);
    size_t end = std::min(rest.find(' '), rest.size());
    out.emplace_back(rest.substr(0, end));
    rest.remove_prefix(end);
  }
  return out;
}


std::vector<std::string> PluginInfo::capabilities() const {
  return manifest_has_capabilities(*manifest) ? split_capability_list(manifest->capabilities)
                                              : std::vector<std::string>{};
}

std::vector<std::string> PluginInfo::needs() const {
  return manifest_has_capabilities(*manifest) ? split_capability_list(manifest->needs)
                                              : std::vector<std::string>{};
}

bool PluginInfo::has_capability(std::string_view capability) const {
  for (const std::string& c : capabilities())
    if (c == capability) return true;
  return false;
}

Logger& host_logger() {
  static SpdlogLogger logger;
  return logger;
}

// The core's own plugins are always there, so a stack needs no plugin folder to name them.
PluginRegistry::PluginRegistry() { add_builtin(cpu_backend_manifest()); }

// Members go in reverse order: plugin tables first, then our references to the libraries.
// Libraries stay loaded after this while objects created from them are alive.
PluginRegistry::~PluginRegistry() = default;

void PluginRegistry::add_builtin(const PluginManifest* manifest) {
  if (!manifest) throw PluginError("add_builtin: null manifest");
  std::string problem = check_manifest_body(*manifest);
  if (!problem.empty()) throw PluginError(std::string("built-in plugin: ") + problem);
  auto key = std::make_pair(manifest->kind, std::string(manifest->name));
  if (plugins_.count(key)) {
    throw PluginError("plugin " + std::string(plugin_kind_name(manifest->kind)) + "." +
                      manifest->name + " is already registered");
  }
  PluginInfo info;
  info.manifest = manifest;
  plugins_.emplace(std::move(key), std::move(info));
}

void PluginRegistry::scan_directory(const fs::path& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) {
    spdlog::debug("plugin directory {} does not exist; skipped", dir.string());
    return;
  }
  scanned_dirs_.push_back(dir.string());
  std::vector<fs::path> candidates;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    if (!entry.is_regular_file(ec) && !entry.is_symlink(ec)) continue;
    if (is_plugin_library_name(entry.path().filename().string()))
      candidates.push_back(entry.path());
  }
  // Sorted so that which of two same-named libraries wins does not depend on the file system.
  std::sort(candidates.begin(), candidates.end());
  for (const auto& path : candidates) load_library(path);
}

void PluginRegistry::scan_default_paths(const std::vector<fs::path>& extra) {
#ifdef TESSERA_BUILD_PLUGIN_DIR
  scan_directory(TESSERA_BUILD_PLUGIN_DIR);
#endif
#ifdef TESSERA_INSTALL_PLUGIN_DIR
  scan_directory(TESSERA_INSTALL_PLUGIN_DIR);
#endif
  if (const char* env = std::getenv("TESSERA_PLUGIN_PATH")) {
    std::string_view rest(env);
    while (!rest.empty()) {
      size_t colon = rest.find(':');
      std::string_view item = rest.substr(0, colon);
      if (!item.empty()) scan_directory(fs::path(std::string(item)));
      if (colon == std::string_view::npos) break;
      rest.remove_prefix(colon + 1);
    }
  }
  for (const auto& dir : extra) scan_directory(dir);
}

void PluginRegistry::load_library(const fs::path& path) {
  std::error_code fs_ec;
  fs::path canonical = fs::weakly_canonical(path, fs_ec);
  if (fs_ec) canonical = path;
  // The same folder may be reached twice (build dir and TESSERA_PLUGIN_PATH); loading a file
  // once keeps that from looking like a duplicate plugin.
  if (!loaded_paths_.insert(canonical.string()).second) return;

  const std::string file_name = path.filename().string();
  auto refuse = [&](std::string plugin_name, std::string message) {
    // Info, not warn: a refused library matters only when a config asks for it, and then
    // the error is reported in full (and `tessera plugins` lists all of them).
    spdlog::info("plugin library refused: {}", message);
    load_errors_.push_back({path.string(), std::move(plugin_name), std::move(message)});
  };

  auto library = std::make_shared<Library>();
  library->path = path.string();
  boost::dll::fs::error_code ec;
  dlerror();  // clear any stale message so the one read below belongs to this load
  // RTLD_NOW: an unresolved symbol is a load error here instead of a crash mid-request.
  // RTLD_LOCAL: plugins do not see each other's symbols.
  library->handle.load(boost::dll::fs::path(path.string()), ec,
                       boost::dll::load_mode::rtld_now | boost::dll::load_mode::rtld_local);
  if (ec || !library->handle.is_loaded()) {
    const char* why = dlerror();
    refuse(plugin_name_from_file(file_name),
           file_name + ": cannot load library: " + (why ? why : ec.message()));
    return;
  }
  if (!library->handle.has(TESSERA_PLUGIN_MANIFEST_SYMBOL)) {
    refuse(plugin_name_from_file(file_name),
           file_name + ": not a Tessera plugin (no '" TESSERA_PLUGIN_MANIFEST_SYMBOL "' symbol)");
    return;
  }
  auto manifest_fn = library->handle.get<const PluginManifest*()>(TESSERA_PLUGIN_MANIFEST_SYMBOL);
  const PluginManifest* manifest = manifest_fn();
  if (!manifest) {
    refuse(plugin_name_from_file(file_name), file_name + ": manifest function returned null");
    return;
  }
  // Only the header's layout is stable across SDK versions: check it before reading on.
  const PluginManifestHeader& header = manifest->header;
  if (header.magic != kPluginMagic) {
    char buf[16];
    std::snprintf(buf, sizeof buf, "0x%08x", header.magic);
    refuse(plugin_name_from_file(file_name),
           file_name + ": not a Tessera plugin manifest (magic " + buf + ")");
    return;
  }
  if (header.abi_major != kSdkAbiMajor || header.abi_minor > kSdkAbiMinor) {
    refuse(plugin_name_from_file(file_name),
           file_name + ": built for Tessera SDK ABI " + std::to_string(header.abi_major) + "." +
               std::to_string(header.abi_minor) + ", this host implements ABI " +
               std::to_string(kSdkAbiMajor) + "." + std::to_string(kSdkAbiMinor) +
               (header.abi_major != kSdkAbiMajor
                    ? " (the major versions must match)"
                    : " (a plugin cannot be newer than its host)"));
    return;
  }
  const char* toolchain = header.toolchain ? header.toolchain : "(none)";
  if (std::strcmp(toolchain, kSdkToolchain) != 0) {
    refuse(plugin_name_from_file(file_name),
           file_name + ": built with toolchain " + toolchain + ", this host was built with " +
               kSdkToolchain + " (plugins must use the host's compiler and standard library)");
    return;
  }
  std::string problem = check_manifest_body(*manifest);
  if (!problem.empty()) {
    refuse(plugin_name_from_file(file_name), file_name + ": " + problem);
    return;
  }
  auto key = std::make_pair(manifest->kind, std::string(manifest->name));
  if (auto it = plugins_.find(key); it != plugins_.end()) {
    const std::string& first = it->second.library_path;
    refuse(manifest->name, file_name + ": plugin " + it->second.qualified_name() +
                               " is already registered (from " +
                               (first.empty() ? std::string("the host") : first) +
                               "); this copy is ignored");
    return;
  }
  library->manifest = manifest;
  PluginInfo info;
  info.manifest = manifest;
  info.library_path = path.string();
  plugins_.emplace(key, std::move(info));
  plugin_libraries_.emplace(key, library);
  // Accepted libraries are never unloaded while the process runs: objects they created
  // (prepared weights, per-sequence state) may outlive the registry and every handle to
  // them, and code or vtables of an unloaded library would crash their destructors.
  static auto* const never_unloaded = new std::vector<std::shared_ptr<Library>>();
  never_unloaded->push_back(library);
  libraries_.push_back(std::move(library));
  spdlog::debug("loaded plugin {}.{} {} from {}", plugin_kind_name(manifest->kind),
                manifest->name, manifest->version, path.string());
}

const PluginInfo* PluginRegistry::find(PluginKind kind, std::string_view name) const {
  auto it = plugins_.find(std::make_pair(kind, std::string(name)));
  return it == plugins_.end() ? nullptr : &it->second;
}

std::vector<const PluginInfo*> PluginRegistry::list(PluginKind kind) const {
  std::vector<const PluginInfo*> out;
  for (const auto& [key, info] : plugins_)
    if (key.first == kind) out.push_back(&info);
  return out;
}

std::vector<const PluginInfo*> PluginRegistry::all() const {
  std::vector<const PluginInfo*> out;
  for (const auto& [key, info] : plugins_) out.push_back(&info);
  return out;
}

std::string PluginRegistry::names_of(PluginKind kind) const {
  std::vector<std::string> names;
  for (const auto* info : list(kind)) names.push_back(info->name());
  return join(names, ", ");
}

std::string PluginRegistry::describe_missing(PluginKind kind, std::string_view name) const {
  const char* kind_name = plugin_kind_name(kind);
  // A library that should have provided it but was refused explains the absence best.
  for (const auto& error : load_errors_) {
    if (load_error_matches(error.plugin_name, name))
      return "plugin '" + std::string(name) + "' could not be loaded: " + error.message;
  }
  for (int i = 0; i < kNumPluginKinds; ++i) {
    auto other = static_cast<PluginKind>(i);
    if (other != kind && find(other, name)) {
      const char* other_name = plugin_kind_name(other);
      return "plugin '" + std::string(name) + "' is " + article_for(other_name) + " " +
             other_name + ", not " + article_for(kind_name) + " " + kind_name;
    }
  }
  std::string names = names_of(kind);
  std::string message = "unknown " + std::string(kind_name) + " plugin '" + std::string(name) + "'";
  if (!names.empty()) return message + "; registered " + kind_name + " plugins: " + names;
  message += std::string("; no ") + kind_name + " plugins are registered";
  if (!scanned_dirs_.empty()) message += " (searched " + join(scanned_dirs_, ", ") + ")";
  return message;
}

std::shared_ptr<void> PluginRegistry::create_raw(PluginKind kind, std::string_view name,
                                                 const PluginConfig& config,
                                                 const PluginContext& context) {
  const std::string where = config.key_path().empty() ? std::string() : config.key_path() + ": ";
  const PluginInfo* info = find(kind, name);
  if (!info) throw PluginError(where + describe_missing(kind, name));

  std::shared_ptr<Library> library;
  if (auto it = plugin_libraries_.find(std::make_pair(kind, std::string(name)));
      it != plugin_libraries_.end())
    library = it->second;

  PluginContext plugin_context = context;
  if (!plugin_context.logger) plugin_context.logger = &host_logger();

  const PluginManifest* manifest = info->manifest;
  void* object = nullptr;
  Status status = manifest->create(config, plugin_context, &object);
  if (!status.is_ok())
    throw PluginError(where + "plugin '" + std::string(name) + "': " + status.message());
  if (!object)
    throw PluginError(where + "plugin '" + std::string(name) + "': create returned no object");
  // The deleter owns a reference to the library: the code that destroys the object (and the
  // object's vtable) stays mapped until the object is gone, even after the registry is.
  auto destroy = manifest->destroy;
  return std::shared_ptr<void>(object, [library = std::move(library), destroy](void* p) {
    destroy(p);
  });
}

}  // namespace tessera
