#include "tessera/stack.h"

#include <new>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>

#include "tessera/model_runner.h"
#include "tessera/sdk/model_host.h"

namespace tessera {
namespace {

// A model as ModelInfo: its resolved path, name and vocabulary.
class LoadedModelInfo : public ModelInfo {
 public:
  LoadedModelInfo(std::shared_ptr<Model> model, std::string path) : model_(std::move(model)), path_(std::move(path)) {}
  const std::string& name() const override { return model_->name(); }
  const std::string& path() const override { return path_; }
  int32_t vocab_size() const override { return model_->hparams().vocab_size; }
  const std::string& token_text(TokenId id) const override { return model_->tokenizer().token_text(id); }

 protected:
  std::shared_ptr<Model> model_;
  std::string path_;
};

// A second model for a plugin: its weights prepared by the stack's quantizer, run by the
// stack's backend with its own attention instance and KV pool. Holds what it uses, so it
// outlives nothing it needs whatever order the stack is torn down in.
class StackHostModel final : public HostModel {
 public:
  StackHostModel(std::shared_ptr<Model> model, std::string path, std::shared_ptr<Backend> backend,
                 std::shared_ptr<Quantizer> quantizer, std::shared_ptr<AttentionKernel> attention,
                 const KvLayout& layout, int32_t max_batch_tokens, int32_t max_context,
                 std::vector<int32_t> layers = {})
      : info_(model, std::move(path)), model_(std::move(model)), backend_(std::move(backend)),
        quantizer_(std::move(quantizer)), attention_(std::move(attention)), layout_(layout),
        max_batch_tokens_(max_batch_tokens), max_context_(max_context),
        runner_(*model_, *backend_, *quantizer_, *attention_, layout_, max_batch_tokens, std::move(layers)) {}

  const std::string& name() const override { return info_.name(); }
  const std::string& path() const override { return info_.path(); }
  int32_t vocab_size() const override { return info_.vocab_size(); }
  const std::string& token_text(TokenId id) const override { return info_.token_text(id); }
  const KvLayout& kv_layout() const override { return layout_; }
  int32_t max_batch_tokens() const override { return max_batch_tokens_; }
  int32_t max_context() const override { return max_context_; }
  Status forward(std::span<const ForwardSequence> sequences, std::vector<float>* logits) override {
    return runner_.forward(sequences, logits);
  }

  Status restrict_logits(std::span<const TokenId> tokens, std::vector<TokenId>* columns) override {
    const int32_t vocab = info_.vocab_size();
    if (tokens.empty()) {
      runner_.set_output(nullptr);
      head_.reset();
      head_rows_.clear();
      columns->resize(static_cast<size_t>(vocab));
      for (TokenId t = 0; t < vocab; ++t) (*columns)[static_cast<size_t>(t)] = t;
      return Status::ok();
    }
    std::vector<TokenId> list;
    std::vector<bool> listed(static_cast<size_t>(vocab), false);
    for (TokenId t : tokens) {
      if (t < 0 || t >= vocab)
        return invalid_argument("token " + std::to_string(t) + " is outside " + info_.name() + "'s vocabulary (0.." +
                                std::to_string(vocab - 1) + ")");
      if (!listed[static_cast<size_t>(t)]) list.push_back(t);
      listed[static_cast<size_t>(t)] = true;
    }
    // Drafts must be able to end where the target ends, and to write the chat markers.
    const Tokenizer& tokenizer = model_->tokenizer();
    for (TokenId t = 0; t < vocab; ++t)
      if (!listed[static_cast<size_t>(t)] &&
          (tokenizer.is_end_of_generation(t) || (tokenizer.token_attr(t) & Tokenizer::kAttrControl) != 0))
        list.push_back(t);
    try {
      std::vector<uint8_t> rows;
      std::unique_ptr<PreparedWeight> head = model_->prepare_output_rows(list, *quantizer_, &rows);
      runner_.set_output(head.get());
      head_ = std::move(head);
      head_rows_ = std::move(rows);  // moves the buffer the head may point into, not its bytes
    } catch (const std::bad_alloc&) {
      return resource_exhausted(info_.name() + ": out of memory while copying the output head's rows");
    } catch (const std::exception& e) {
      return invalid_argument(e.what());
    }
    *columns = std::move(list);
    return Status::ok();
  }

 private:
  LoadedModelInfo info_;
  std::shared_ptr<Model> model_;
  std::shared_ptr<Backend> backend_;
  std::shared_ptr<Quantizer> quantizer_;
  std::shared_ptr<AttentionKernel> attention_;
  KvLayout layout_;
  int32_t max_batch_tokens_, max_context_;
  ModelRunner runner_;
  // restrict_logits' head and the GGUF rows it was prepared from (null/empty: the model's).
  std::unique_ptr<PreparedWeight> head_;
  std::vector<uint8_t> head_rows_;
};

// The stack's ModelHost while its plugins are created (PluginContext::models).
class StackModelHost final : public ModelHost {
 public:
  StackModelHost(const StackConfig& config, PluginRegistry& registry, const EngineComponents& c,
                 std::string target_path)
      : config_(config), registry_(registry), c_(c), target_(c.model, std::move(target_path)) {}

  const ModelInfo& target() const override { return target_; }

  Status load(const HostModelRequest& r, std::unique_ptr<HostModel>* out) override {
    try {
      const std::string path = resolve_model_path(r.path);
      auto model = Model::load(path, *c_.quantizer);
      return make(std::move(model), path, {}, {r.block_size, r.kv_memory_bytes, r.kv_dtype, r.max_batch_tokens}, out);
    } catch (const std::bad_alloc&) {
      return resource_exhausted(r.path + ": out of memory while loading the model or its KV pool");
    } catch (const std::exception& e) {
      return invalid_argument(e.what());
    }
  }

  Status load_target_layers(const TargetLayersRequest& r, std::unique_ptr<HostModel>* out) override {
    // Each layer's range and order are the runner's to check (its errors name them).
    if (r.layers.empty()) {
      const int32_t num_layers = c_.model->hparams().num_layers;
      return invalid_argument("layers: empty; name at least one of the target's " + std::to_string(num_layers) +
                              " layers (0.." + std::to_string(num_layers - 1) + ")");
    }
    try {
      return make(c_.model, target_.path(), r.layers, {r.block_size, r.kv_memory_bytes, r.kv_dtype, r.max_batch_tokens},
                  out);
    } catch (const std::bad_alloc&) {
      return resource_exhausted("out of memory while allocating the layer-skip KV pool");
    } catch (const std::exception& e) {
      return invalid_argument(e.what());
    }
  }

 private:
  struct PoolRequest {
    int32_t block_size;
    int64_t kv_memory_bytes;
    KvDtype kv_dtype;
    int32_t max_batch_tokens;
  };

  // A HostModel over `model` (its `layers`, or all of them) with a KV pool sized by `r`.
  Status make(std::shared_ptr<Model> model, const std::string& path, std::vector<int32_t> layers,
              const PoolRequest& r, std::unique_ptr<HostModel>* out) {
    const ModelHparams& hp = model->hparams();
    if (r.block_size <= 0 || r.max_batch_tokens <= 0)
      return invalid_argument("block_size and max_batch_tokens must be positive");
    const int32_t max_context = std::min(config_.model.context_length > 0 ? config_.model.context_length
                                                                          : std::min(hp.context_length, 4096),
                                         hp.context_length);
    const int32_t pooled_layers = layers.empty() ? hp.num_layers : static_cast<int32_t>(layers.size());
    KvModelShape shape{pooled_layers, hp.num_kv_heads, hp.head_dim, max_context, 1};
    KvLayout layout;
    layout.block_size = r.block_size;
    layout.k_dtype = layout.v_dtype = r.kv_dtype;
    const size_t block_bytes = KvLayout::block_bytes(shape, r.block_size, r.kv_dtype, r.kv_dtype);
    layout.num_blocks = static_cast<int32_t>(static_cast<size_t>(std::max<int64_t>(r.kv_memory_bytes, 0)) / block_bytes);
    const int32_t blocks_per_context = (max_context + r.block_size - 1) / r.block_size;
    if (layout.num_blocks < blocks_per_context)
      return invalid_argument(path + ": a KV pool of " + std::to_string(r.kv_memory_bytes) + " bytes holds " +
                              std::to_string(layout.num_blocks) + " blocks of " + std::to_string(block_bytes) +
                              " bytes, fewer than one context of " + std::to_string(max_context) +
                              " tokens needs (" + std::to_string(blocks_per_context) + ")");
    // A fresh attention instance of the stack's kernel: kernels keep per-runner scratch.
    const PluginSlot& slot = config_.engine.at(PluginKind::kAttention);
    PluginContext context{&host_logger(), slot.file};
    auto attention = registry_.create<AttentionKernel>(slot.plugin, slot.config, context);
    *out = std::make_unique<StackHostModel>(std::move(model), path, c_.backend, c_.quantizer, std::move(attention),
                                            layout, r.max_batch_tokens, max_context, std::move(layers));
    return Status::ok();
  }

  const StackConfig& config_;
  PluginRegistry& registry_;
  const EngineComponents& c_;
  LoadedModelInfo target_;
};

template <class Interface>
std::shared_ptr<Interface> create_slot(const StackConfig& config, PluginRegistry& registry,
                                       PluginKind kind, const PluginConfig* override_config = nullptr,
                                       ModelHost* models = nullptr) {
  auto it = config.engine.find(kind);
  if (it == config.engine.end())
    throw std::runtime_error(std::string("engine.") + plugin_kind_name(kind) + ": slot is not configured");
  PluginContext context{&host_logger(), it->second.file, models};
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
  if (config.engine.count(PluginKind::kConstraint)) {
    c.constraint = create_slot<Constraint>(config, registry, PluginKind::kConstraint);
    // prepare_masks auto: a helper thread beside the forward only when the forward leaves a
    // core free (measured on 2 vCPUs with both running the forward: the helper cost 1-2% of
    // batch-16 throughput instead of saving it).
    const std::string prepare = config.engine.at(PluginKind::kConstraint).config.get_string("prepare_masks", "auto");
    const int64_t cpu_threads = backend_config.get_int("threads", 0);
    const unsigned cores = std::thread::hardware_concurrency();
    c.prepare_masks = prepare == "on" ||
                      (prepare == "auto" && (std::string_view(c.backend->device_name()) != "cpu" ||
                                             (cpu_threads > 0 && cores > 0 && cpu_threads < static_cast<int64_t>(cores))));
  }
  const std::string model_path = resolve_model_path(config.model.path);
  c.model = Model::load(model_path, *c.quantizer, progress);
  c.max_context = config.model.context_length;
  // The drafter last: a draft-model drafter loads its model through the host, which checks
  // the vocabulary against the target loaded above.
  if (config.engine.count(PluginKind::kDrafter)) {
    StackModelHost host(config, registry, c, model_path);
    c.drafter = create_slot<Drafter>(config, registry, PluginKind::kDrafter, nullptr, &host);
    c.num_draft_tokens = static_cast<int32_t>(
        config.engine.at(PluginKind::kDrafter).config.get_int("num_draft_tokens", 4));
    c.adaptive_drafts = config.engine.at(PluginKind::kDrafter).config.get_bool("adaptive", false);
  }
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
