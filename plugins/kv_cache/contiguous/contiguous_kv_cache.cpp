// kv_cache.contiguous: every running sequence reserves one region of max_context token slots,
// as in the serving systems before PagedAttention. In block terms: block_size = max_context
// and one block per sequence. Simple and fragmentation-free inside a sequence, but the unused
// tail of each region is wasted, which limits how many sequences fit in a byte budget.
#include <algorithm>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "tessera/sdk.h"

namespace tessera {
namespace {

const ParamSpec kParams[] = {
    {"memory", ParamType::kBytes, "256MiB", "bytes of KV memory (all layers, K and V)", 1,
     INFINITY},
    TESSERA_KV_DTYPE_PARAMS,
};

class ContiguousKvCache final : public KvCacheManager {
 public:
  ContiguousKvCache(int64_t budget, KvDtypes dtype) : budget_(budget), dtype_(dtype) {}

  Status configure(const KvModelShape& shape, KvLayout* layout) override {
    if (Status st = check_kv_dtypes("kv_cache.contiguous", shape, dtype_); !st.is_ok()) return st;
    const size_t region = KvLayout::block_bytes(shape, shape.max_context, dtype_.k, dtype_.v);
    const int64_t regions = budget_ / static_cast<int64_t>(region);
    if (regions < 1)
      return resource_exhausted(
          "kv_cache.contiguous: memory " + std::to_string(budget_) + " bytes holds no sequence: one " +
          std::to_string(shape.max_context) + "-token region needs " + std::to_string(region) +
          " bytes; raise engine.kv_cache.memory or lower model.context_length");
    layout->block_size = shape.max_context;
    layout->num_blocks = static_cast<int32_t>(regions);
    layout->k_dtype = dtype_.k;
    layout->v_dtype = dtype_.v;
    block_size_ = shape.max_context;
    free_blocks_.clear();
    for (int32_t b = layout->num_blocks - 1; b >= 0; --b) free_blocks_.push_back(b);
    num_blocks_ = layout->num_blocks;
    return Status::ok();
  }

  int32_t attach_cached_prefix(const SequenceInfo&) override { return 0; }

  bool allocate_slots(const SequenceInfo& seq, int32_t num_new_tokens) override {
    if (seq.num_computed_tokens + num_new_tokens > block_size_) return false;
    auto it = sequences_.find(seq.id);
    if (it != sequences_.end()) return true;  // the region already covers max_context
    if (free_blocks_.empty()) return false;
    sequences_[seq.id] = {free_blocks_.back(), 0};
    free_blocks_.pop_back();
    return true;
  }

  void mark_computed(const SequenceInfo& seq, int32_t num_computed) override {
    auto it = sequences_.find(seq.id);
    if (it != sequences_.end()) it->second.num_filled = num_computed;
  }

  // The region covers max_context whatever happens: only the filled count goes back.
  void truncate(const SequenceInfo& seq, int32_t num_tokens) override {
    auto it = sequences_.find(seq.id);
    if (it != sequences_.end()) it->second.num_filled = std::min(it->second.num_filled, num_tokens);
  }

  void free(SeqId id) override {
    auto it = sequences_.find(id);
    if (it == sequences_.end()) return;
    free_blocks_.push_back(it->second.block[0]);
    sequences_.erase(it);
  }

  Status fork(SeqId parent, SeqId child) override {
    auto it = sequences_.find(parent);
    if (it == sequences_.end()) return invalid_argument("kv_cache.contiguous: fork of unknown sequence");
    if (free_blocks_.empty()) return resource_exhausted("kv_cache.contiguous: no free region to fork into");
    // Regions cannot be shared: the child gets its own copy.
    const int32_t dst = free_blocks_.back();
    free_blocks_.pop_back();
    copies_.push_back({it->second.block[0], dst});
    sequences_[child] = {dst, it->second.num_filled};
    return Status::ok();
  }

  std::span<const int32_t> block_table(SeqId id) const override {
    auto it = sequences_.find(id);
    if (it == sequences_.end()) return {};
    return {it->second.block, 1};
  }

  void take_block_copies(std::vector<BlockCopy>* copies) override {
    copies->insert(copies->end(), copies_.begin(), copies_.end());
    copies_.clear();
  }

  int32_t num_free_blocks() const override { return static_cast<int32_t>(free_blocks_.size()); }

  KvStats stats() const override {
    KvStats s;
    s.num_blocks = num_blocks_;
    s.num_used_blocks = static_cast<int32_t>(sequences_.size());
    s.num_slots_reserved = static_cast<int64_t>(sequences_.size()) * block_size_;
    for (const auto& [id, r] : sequences_) s.num_slots_filled += r.num_filled;
    return s;
  }

  static Status create(const PluginConfig& config, const PluginContext&,
                       std::unique_ptr<KvCacheManager>* out) {
    const KvDtypes dtype = kv_dtypes_from_config(config);
    *out = std::make_unique<ContiguousKvCache>(config.get_int("memory"), dtype);
    return Status::ok();
  }

 private:
  struct Region {
    int32_t block[1];
    int32_t num_filled;
  };
  int64_t budget_;
  KvDtypes dtype_;
  int32_t block_size_ = 0;
  int32_t num_blocks_ = 0;
  std::vector<int32_t> free_blocks_;
  std::map<SeqId, Region> sequences_;
  std::vector<BlockCopy> copies_;
};

}  // namespace
}  // namespace tessera

TESSERA_REGISTER_PLUGIN(tessera::ContiguousKvCache, tessera::KvCacheManager, "contiguous", "0.1.0",
                        "one max-context region per sequence (the pre-PagedAttention baseline)",
                        tessera::kParams)
