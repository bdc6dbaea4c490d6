// drafter.layer-skip: self-speculative decoding from the target's own weights (Draft & Verify,
// Zhang et al. 2024; SWIFT, Xia et al. 2025, zero-shot): the draft is the target run through
// a configured subset of its layers, then its final norm and output head. No second model is
// loaded: the host (tessera/sdk/model_host.h, SDK 2.8 load_target_layers) runs the target's
// prepared weights with a KV pool holding only the kept layers, whose blocks this plugin
// allocates. The drafting loop is the SDK's HostModelDrafter, shared with drafter.draft-model.
// Engine thread only.
#include <charconv>
#include <cmath>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "tessera/sdk.h"
#include "tessera/sdk/host_model_drafter.h"

namespace tessera {
namespace {

const ParamSpec kParams[] = {
    {"layers", ParamType::kString, nullptr,
     "the target's layers the draft runs, ascending: indices and ranges, e.g. \"0-11,26-29\""},
    {"num_draft_tokens", ParamType::kInt, "4", "most draft tokens proposed per sequence and step", 1, 32},
    {"memory", ParamType::kBytes, "128MiB", "bytes of the draft's KV pool (its layers only, K and V)", 1,
     INFINITY},
    {"block_size", ParamType::kInt, "16", "tokens per block of the draft's KV pool", 1, 1024},
    {"dtype", ParamType::kEnum, "f16", "storage of the draft's K and V rows", -INFINITY, INFINITY, "f16|f32"},
    {"max_batch_tokens", ParamType::kInt, "512",
     "most tokens per draft forward (longer catch-ups, e.g. prompts, are split into chunks)", 16, 65536},
    kDraftVocabularyParam,
    kDraftVocabularyRankingParam,
    {"adaptive", ParamType::kBool, "true",
     "the engine fits each sequence's draft count to its acceptance and the measured step cost, "
     "down to none when verification costs more than it saves"},
};

// "0-11,26-29" → 0..11, 26..29. Order and range against the model are the host's to check;
// here only the syntax, with the offending piece named.
Status parse_layers(std::string_view text, const std::string& key, std::vector<int32_t>* out) {
  auto number = [](std::string_view s, int32_t* v) {
    while (!s.empty() && s.front() == ' ') s.remove_prefix(1);
    while (!s.empty() && s.back() == ' ') s.remove_suffix(1);
    if (s.empty()) return false;
    const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), *v);
    return ec == std::errc() && end == s.data() + s.size();
  };
  out->clear();
  while (!text.empty()) {
    const size_t comma = text.find(',');
    const std::string_view piece = text.substr(0, comma);
    text = comma == std::string_view::npos ? std::string_view() : text.substr(comma + 1);
    const size_t dash = piece.find('-', piece.find_first_not_of(' '));
    int32_t first = 0, last = 0;
    const bool ok = dash == std::string_view::npos
                        ? number(piece, &first) && (last = first, true)
                        : number(piece.substr(0, dash), &first) && number(piece.substr(dash + 1), &last);
    if (!ok || first < 0 || last < first || last - first > 65536)
      return invalid_argument(key + ".layers: '" + std::string(piece) +
                              "' is not a layer index or an ascending range like 0-11");
    for (int32_t l = first; l <= last; ++l) out->push_back(l);
  }
  if (out->empty()) return invalid_argument(key + ".layers: empty; list the layers the draft runs, e.g. \"0-11\"");
  return Status::ok();
}

class LayerSkipDrafter final : public HostModelDrafter {
 public:
  using HostModelDrafter::HostModelDrafter;

  static Status create(const PluginConfig& config, const PluginContext& context, std::unique_ptr<Drafter>* out) {
    const std::string key = config.key_path();
    if (context.models == nullptr)
      return invalid_argument(key + ": needs the stack's model host (SDK 2.8) to run the target's layers; "
                                       "this host provides none");
    TargetLayersRequest request;
    if (Status st = parse_layers(config.get_string("layers"), key, &request.layers); !st.is_ok()) return st;
    request.block_size = static_cast<int32_t>(config.get_int("block_size"));
    request.kv_memory_bytes = config.get_int("memory");
    parse_kv_dtype(config.get_string("dtype"), &request.kv_dtype);
    request.max_batch_tokens = static_cast<int32_t>(config.get_int("max_batch_tokens"));
    std::unique_ptr<HostModel> model;
    Status st = context.models->load_target_layers(request, &model);
    if (!st.is_ok())  // the host names the layer ("layers: 31 is not ...") or the pool
      return Status(st.code(), key + (st.message().rfind("layers:", 0) == 0 ? "." : ": ") + st.message());
    context.logger->log(LogLevel::kInfo, "drafter.layer-skip: " + std::to_string(request.layers.size()) +
                                             " layers of " + model->name() + " (" + config.get_string("layers") +
                                             "), " + std::to_string(model->kv_layout().num_blocks) +
                                             " KV blocks of " + std::to_string(model->kv_layout().block_size) +
                                             " tokens");
    auto drafter = std::make_unique<LayerSkipDrafter>(std::move(model));
    if (Status v = drafter->restrict_vocabulary(config, context, "layer-skip"); !v.is_ok()) return v;
    *out = std::move(drafter);
    return Status::ok();
  }
};

}  // namespace
}  // namespace tessera

TESSERA_REGISTER_PLUGIN(tessera::LayerSkipDrafter, tessera::Drafter, "layer-skip", "0.1.0",
                        "the target through a subset of its layers proposes k tokens per sequence (self-speculation)",
                        tessera::kParams)
