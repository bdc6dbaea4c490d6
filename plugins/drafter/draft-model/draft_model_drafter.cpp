// drafter.draft-model: classic speculative decoding (Leviathan et al. 2023; Chen et al. 2023):
// a smaller or lower-precision model with the target's vocabulary proposes k tokens, the
// target verifies them in one forward. The draft model is loaded and run through the host
// (tessera/sdk/model_host.h) with its own paged KV pool, whose blocks this plugin allocates.
//
// The drafting loop (one batched catch-up forward, then k - 1 batched one-token forwards per
// step, rollback by comparing the cache's tokens with the committed ones, one-hot q) is the
// SDK's HostModelDrafter (tessera/sdk/host_model_drafter.h), shared with drafter.layer-skip;
// this plugin adds what is particular to a second model: loading it and checking that its
// vocabulary is the target's. Engine thread only.
#include <cmath>
#include <memory>
#include <string>

#include "tessera/sdk.h"
#include "tessera/sdk/host_model_drafter.h"

namespace tessera {
namespace {

const ParamSpec kParams[] = {
    {"model", ParamType::kString, nullptr,
     "the draft model: a GGUF path or model name (resolved like model.path) with the target's vocabulary"},
    {"num_draft_tokens", ParamType::kInt, "4", "most draft tokens proposed per sequence and step", 1, 32},
    {"memory", ParamType::kBytes, "128MiB", "bytes of the draft model's KV pool (all layers, K and V)", 1,
     INFINITY},
    {"block_size", ParamType::kInt, "16", "tokens per block of the draft model's KV pool", 1, 1024},
    {"dtype", ParamType::kEnum, "f16", "storage of the draft model's K and V rows", -INFINITY, INFINITY,
     "f16|f32"},
    {"max_batch_tokens", ParamType::kInt, "512",
     "most tokens per draft forward (longer catch-ups, e.g. prompts, are split into chunks)", 16, 65536},
    kDraftVocabularyParam,
    kDraftVocabularyRankingParam,
    {"adaptive", ParamType::kBool, "true",
     "the engine fits each sequence's draft count to its acceptance and the measured step cost, "
     "down to none when verification costs more than it saves"},
};

class DraftModelDrafter final : public HostModelDrafter {
 public:
  using HostModelDrafter::HostModelDrafter;

  static Status create(const PluginConfig& config, const PluginContext& context, std::unique_ptr<Drafter>* out) {
    const std::string key = config.key_path();
    if (context.models == nullptr)
      return invalid_argument(key + ": needs the stack's model host (SDK 2.3) to load its model; "
                                       "this host provides none");
    HostModelRequest request;
    request.path = config.get_string("model");
    request.block_size = static_cast<int32_t>(config.get_int("block_size"));
    request.kv_memory_bytes = config.get_int("memory");
    parse_kv_dtype(config.get_string("dtype"), &request.kv_dtype);
    request.max_batch_tokens = static_cast<int32_t>(config.get_int("max_batch_tokens"));
    std::unique_ptr<HostModel> model;
    Status st = context.models->load(request, &model);
    if (!st.is_ok()) return Status(st.code(), key + ".model: " + st.message());
    if (Status v = check_vocabulary(context.models->target(), *model, key); !v.is_ok()) return v;
    context.logger->log(LogLevel::kInfo, "drafter.draft-model: " + model->name() + " (" + model->path() +
                                             ") drafting for " + context.models->target().name() + ", " +
                                             std::to_string(model->kv_layout().num_blocks) + " KV blocks of " +
                                             std::to_string(model->kv_layout().block_size) + " tokens");
    auto drafter = std::make_unique<DraftModelDrafter>(std::move(model));
    if (Status v = drafter->restrict_vocabulary(config, context, "draft-model"); !v.is_ok()) return v;
    *out = std::move(drafter);
    return Status::ok();
  }

 private:
  // Same size and the same text for every token, or the drafts would mean other tokens.
  static Status check_vocabulary(const ModelInfo& target, const ModelInfo& draft, const std::string& key) {
    const std::string both = " (target " + target.name() + ": " + target.path() + ", draft " + draft.name() +
                             ": " + draft.path() + ")";
    if (target.vocab_size() != draft.vocab_size())
      return invalid_argument(key + ".model: the draft model's vocabulary has " + std::to_string(draft.vocab_size()) +
                              " tokens, the target's " + std::to_string(target.vocab_size()) + both);
    for (TokenId t = 0; t < target.vocab_size(); ++t)
      if (target.token_text(t) != draft.token_text(t))
        return invalid_argument(key + ".model: token " + std::to_string(t) + " is '" + draft.token_text(t) +
                                "' in the draft model and '" + target.token_text(t) + "' in the target" + both);
    return Status::ok();
  }

};

}  // namespace
}  // namespace tessera
TESSERA_REGISTER_PLUGIN(tessera::DraftModelDrafter, tessera::Drafter, "draft-model", "0.1.0",
                        "a draft model with the target's vocabulary proposes k tokens per sequence, batched",
                        tessera::kParams)
