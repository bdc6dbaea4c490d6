#include "tessera/stack.h"

#include <new>
#include <stdexcept>

namespace tessera {
namespace {

template <class Interface>
std::shared_ptr<Interface> create_slot(const StackConfig& config, PluginRegistry& registry,
                                       PluginKind kind, const PluginConfig* override_config = nullptr) {
  auto it = config.engine.find(kind);
  if (it == config.engine.end())
    throw std::runtime_error(std::string("engine.") + plugin_kind_name(kind) + ": slot is not configured");
  PluginContext context{&host_logger(), it->second.file};
  return registry.create<Interface>(it->second.plugin, override_config ? *override_config : it->second.config,
                                    context);
}

}  // namespace

EngineComponents build_engine_components(const StackConfig& config, PluginRegistry& registry,
                                         const Model::ProgressFn& progress) {
  EngineComponents c;
  // model.threads fills in a CPU backend left at threads: 0.
  const PluginSlot& backend_slot = config.engine.at(PluginKind::kBackend);
  PluginConfig backend_config = backend_slot.config;
  if (backend_config.get_int("threads", -1) == 0 && config.model.threads > 0) {
    auto values = backend_config.values();
    values["threads"] = static_cast<int64_t>(config.model.threads);
    backend_config = PluginConfig(backend_config.plugin_name(), backend_config.key_path(), values);
  }
  c.backend = create_slot<Backend>(config, registry, PluginKind::kBackend, &backend_config);
  c.quantizer = create_slot<Quantizer>(config, registry, PluginKind::kQuantizer);
  c.scheduler = create_slot<Scheduler>(config, registry, PluginKind::kScheduler);
  c.kv_cache = create_slot<KvCacheManager>(config, registry, PluginKind::kKvCache);
  c.attention = create_slot<AttentionKernel>(config, registry, PluginKind::kAttention);
  c.sampler = create_slot<Sampler>(config, registry, PluginKind::kSampler);
  if (config.engine.count(PluginKind::kDrafter)) {
    c.drafter = create_slot<Drafter>(config, registry, PluginKind::kDrafter);
    c.num_draft_tokens = static_cast<int32_t>(
        config.engine.at(PluginKind::kDrafter).config.get_int("num_draft_tokens", 4));
    c.adaptive_drafts = config.engine.at(PluginKind::kDrafter).config.get_bool("adaptive", false);
  }
  if (config.engine.count(PluginKind::kConstraint))
    c.constraint = create_slot<Constraint>(config, registry, PluginKind::kConstraint);
  c.model = Model::load(resolve_model_path(config.model.path), *c.quantizer, progress);
  c.max_context = config.model.context_length;
  return c;
}

std::unique_ptr<Engine> build_engine(const StackConfig& config, PluginRegistry& registry,
                                     const Model::ProgressFn& progress) {
  EngineComponents components = build_engine_components(config, registry, progress);
  try {
    return std::make_unique<Engine>(std::move(components));
  } catch (const std::bad_alloc&) {
    // The engine's big allocations are the KV cache's: its block table and pools, sized by
    // the byte budget. Say which setting asked for too much instead of a bare bad_alloc.
    const PluginConfig& kv = config.engine.at(PluginKind::kKvCache).config;
    static const ParamSpec kMemory{"memory", ParamType::kBytes, nullptr, ""};
    const std::string memory =
        kv.has("memory") ? format_param_value(kMemory, kv.get_int("memory", 0))
                         : std::string("its default size");
    throw std::runtime_error("engine.kv_cache.memory: out of memory while allocating a KV cache "
                             "of " + memory + "; lower engine.kv_cache.memory");
  }
}

}  // namespace tessera
