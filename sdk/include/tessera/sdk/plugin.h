// The plugin seam: a manifest of plain data exported under one extern "C" symbol, and the
// registration macro that builds it.
//
// Ownership across the seam: `create` hands the caller a new object that the caller must
// release with the same manifest's `destroy`; the host wraps it so that the library stays
// loaded while the object lives. Entry points never throw: failures come back as Status.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <string>
#include <type_traits>

#include "tessera/sdk/abi.h"
#include "tessera/sdk/capabilities.h"
#include "tessera/sdk/logger.h"
#include "tessera/sdk/params.h"
#include "tessera/sdk/status.h"

namespace tessera {

enum class PluginKind : uint32_t {
  kScheduler = 0, kKvCache, kAttention, kQuantizer, kSampler, kCacheLayer, kRouter, kDrafter,
  kBackend, kConstraint, kKvConnector,
};
inline constexpr int kNumPluginKinds = 11;

// The YAML key of each kind ("kv_cache", "cache_layer", ...).
inline const char* plugin_kind_name(PluginKind kind) {
  switch (kind) {
    case PluginKind::kScheduler: return "scheduler";
    case PluginKind::kKvCache: return "kv_cache";
    case PluginKind::kAttention: return "attention";
    case PluginKind::kQuantizer: return "quantizer";
    case PluginKind::kSampler: return "sampler";
    case PluginKind::kCacheLayer: return "cache_layer";
    case PluginKind::kRouter: return "router";
    case PluginKind::kDrafter: return "drafter";
    case PluginKind::kBackend: return "backend";
    case PluginKind::kConstraint: return "constraint";
    case PluginKind::kKvConnector: return "kv_connector";
  }
  return "unknown";
}

enum class PluginStatus : uint32_t { kStable = 0, kAlpha, kWip };

class ModelHost;  // tessera/sdk/model_host.h

// What the host gives every plugin it creates.
struct PluginContext {
  Logger* logger = nullptr;     // never null when created by the host; outlives the object
  std::string config_file;      // the YAML file the slot came from ("" when built in code)
  // The stack's model services (load and run another model; the target's vocabulary), for
  // drafters; null where no stack is being built (tests, the gateway's layers). SDK 2.3.
  ModelHost* models = nullptr;
};

// The first fields of every manifest. Their layout never changes, so the host can read the
// ABI version and toolchain of a library built against any SDK before trusting the rest.
struct PluginManifestHeader {
  uint32_t magic;        // kPluginMagic
  uint32_t abi_major;
  uint32_t abi_minor;
  // SDK 2.10 (the field was `reserved`, always 0, before): sizeof(PluginManifest) in the
  // plugin's build. The host reads a field appended to the manifest only when it lies inside
  // this size (manifest_has_field), so the manifest grows at its end in a minor version and an
  // older library's is never read past its end. 0 in libraries before 2.10, whose size follows
  // from abi_minor.
  uint32_t manifest_size;
  const char* toolchain; // TESSERA_SDK_TOOLCHAIN of the plugin's build
};
inline constexpr uint32_t kPluginMagic = 0x41525354;  // "TSRA"

struct PluginManifest {
  PluginManifestHeader header;
  PluginKind kind;
  const char* name;         // unique within its kind, e.g. "chunked-prefill"
  const char* version;      // the plugin's own semantic version
  const char* description;  // one line
  PluginStatus status;
  const ParamSpec* params;  // schema of the slot's parameters (static storage)
  size_t num_params;
  // Creates an object implementing the kind's interface (Scheduler, Sampler, ...) from a
  // validated config. On success stores it in *out as a pointer to that interface type.
  Status (*create)(const PluginConfig& config, const PluginContext& context, void** out);
  // Destroys an object returned by create.
  void (*destroy)(void* object);
  // SDK 2.6, appended: the host reads these two only when header.abi_minor >= 6 (an older
  // library's manifest ends above). Both are space-separated lists in static storage, "" for
  // none. `capabilities`: the optional interfaces (tessera/sdk/capabilities.h) every object
  // `create` returns implements, e.g. "grouped_matmul". `needs`: capabilities this plugin
  // needs from the stack's other slots, as "<kind>.<capability>", e.g.
  // "backend.forward_runner"; a stack whose slot lacks one is refused before the model loads.
  const char* capabilities;
  const char* needs;
  // SDK 2.10, appended: sizeof(ParamSpec) in the plugin's build, the stride of `params`. The
  // host reads the table only through manifest_param(), so ParamSpec can grow at its end in a
  // minor version too.
  uint32_t param_spec_size;
};

// The header of a manifest built against this SDK (what TESSERA_REGISTER_PLUGIN writes; for
// manifests written out by hand, such as the host's built-in plugins and tests).
#define TESSERA_PLUGIN_MANIFEST_HEADER                                                \
  {::tessera::kPluginMagic, TESSERA_SDK_ABI_MAJOR, TESSERA_SDK_ABI_MINOR,             \
   static_cast<uint32_t>(sizeof(::tessera::PluginManifest)), TESSERA_SDK_TOOLCHAIN}

// The bytes of `m` the host may read: the header's manifest_size from 2.10 on; before it, the
// fields that existed at the library's ABI minor (2.6 appended capabilities and needs).
inline size_t manifest_size(const PluginManifest& m) {
  if (m.header.manifest_size != 0) return m.header.manifest_size;
  if (m.header.abi_major == 2 && m.header.abi_minor >= 6) return offsetof(PluginManifest, param_spec_size);
  return offsetof(PluginManifest, capabilities);
}
// Whether `m` holds the field that starts at `offset` and is `size` bytes, e.g.
// manifest_has_field(m, offsetof(PluginManifest, needs), sizeof(m.needs)).
inline bool manifest_has_field(const PluginManifest& m, size_t offset, size_t size) {
  return manifest_size(m) >= offset + size;
}

// Entry `i` of m.params, read with the plugin's stride: an older library's shorter ParamSpec
// leaves the fields it lacks at their defaults. Libraries before 2.10 share this ParamSpec.
inline ParamSpec manifest_param(const PluginManifest& m, size_t i) {
  static_assert(std::is_trivially_copyable_v<ParamSpec>, "manifest_param copies ParamSpec bytes");
  size_t stride = sizeof(ParamSpec);
  if (manifest_has_field(m, offsetof(PluginManifest, param_spec_size), sizeof(m.param_spec_size)) &&
      m.param_spec_size != 0)
    stride = m.param_spec_size;
  ParamSpec spec{};
  std::memcpy(static_cast<void*>(&spec), reinterpret_cast<const char*>(m.params) + i * stride,
              stride < sizeof(ParamSpec) ? stride : sizeof(ParamSpec));
  return spec;
}

// The symbol every plugin library exports.
#define TESSERA_PLUGIN_MANIFEST_SYMBOL "tessera_plugin_manifest"
using PluginManifestFn = const PluginManifest* (*)();

template <class Interface> struct PluginKindOf;  // specialized by each interface header

namespace detail {
// Create an `Impl` through `Impl::create(config, context, &unique_ptr<Interface>)` and turn
// exceptions into a Status so none cross the seam.
template <class Impl, class Interface>
Status create_plugin(const PluginConfig& config, const PluginContext& context, void** out) {
  try {
    std::unique_ptr<Interface> object;
    Status status = Impl::create(config, context, &object);
    if (!status.is_ok()) return status;
    if (!object) return internal_error("create returned no object");
    *out = static_cast<void*>(object.release());
    return Status::ok();
  } catch (const std::exception& e) {
    return internal_error(std::string("exception while creating plugin: ") + e.what());
  } catch (...) {
    return internal_error("unknown exception while creating plugin");
  }
}
template <class Interface>
void destroy_plugin(void* object) {
  delete static_cast<Interface*>(object);
}
}  // namespace detail

}  // namespace tessera

#if defined(_WIN32)
#define TESSERA_PLUGIN_EXPORT extern "C" __declspec(dllexport)
#else
#define TESSERA_PLUGIN_EXPORT extern "C" __attribute__((visibility("default")))
#endif

// Registers a plugin library's one plugin. Use once, in one source file of the library.
//   Impl:      a class deriving from Interface, with
//              static Status create(const PluginConfig&, const PluginContext&,
//                                   std::unique_ptr<Interface>* out);
//   Interface: the kind's interface (tessera::Sampler, tessera::Scheduler, ...)
//   NAME, VERSION, DESCRIPTION: string literals; PARAMS: a static array of ParamSpec.
// The plugin declares no capabilities and needs none; see TESSERA_REGISTER_PLUGIN_WITH.
#define TESSERA_REGISTER_PLUGIN(Impl, Interface, NAME, VERSION, DESCRIPTION, PARAMS) \
  TESSERA_REGISTER_PLUGIN_WITH(Impl, Interface, NAME, VERSION, DESCRIPTION, PARAMS, "", "")

// As TESSERA_REGISTER_PLUGIN, declaring CAPABILITIES (space-separated names from
// tessera/sdk/capabilities.h that Impl implements) and NEEDS (space-separated
// "<kind>.<capability>" the stack's other slots must offer). String literals; "" for none.
#define TESSERA_REGISTER_PLUGIN_WITH(Impl, Interface, NAME, VERSION, DESCRIPTION, PARAMS,    \
                                     CAPABILITIES, NEEDS)                                  \
  TESSERA_PLUGIN_EXPORT const ::tessera::PluginManifest* tessera_plugin_manifest() {       \
    static const ::tessera::PluginManifest manifest = {                                    \
        TESSERA_PLUGIN_MANIFEST_HEADER,                                                    \
        ::tessera::PluginKindOf<Interface>::value,                                         \
        NAME,                                                                              \
        VERSION,                                                                           \
        DESCRIPTION,                                                                       \
        ::tessera::PluginStatus::kStable,                                                  \
        PARAMS,                                                                            \
        ::tessera::detail::param_count(PARAMS),                                            \
        &::tessera::detail::create_plugin<Impl, Interface>,                                \
        &::tessera::detail::destroy_plugin<Interface>,                                     \
        CAPABILITIES,                                                                      \
        NEEDS,                                                                             \
        static_cast<uint32_t>(sizeof(::tessera::ParamSpec))};                              \
    return &manifest;                                                                      \
  }

// For plugins without parameters, pass TESSERA_NO_PARAMS as PARAMS.
namespace tessera::detail {
inline constexpr ParamSpec kNoParams[1] = {{"", ParamType::kBool, nullptr, "", -INFINITY, INFINITY, nullptr, true}};
// The number of entries of a schema array; the empty-name sentinel of kNoParams counts as 0.
template <size_t N>
constexpr size_t param_count(const ParamSpec (&specs)[N]) {
  return (N == 1 && specs[0].name[0] == '\0') ? 0 : N;
}
}  // namespace tessera::detail
#define TESSERA_NO_PARAMS ::tessera::detail::kNoParams
