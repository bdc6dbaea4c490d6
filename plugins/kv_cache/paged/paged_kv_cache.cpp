// kv_cache.paged: vLLM's PagedAttention block manager with automatic prefix caching.
// KV memory is a pool of fixed-size blocks; each sequence holds a table of block ids, so
// memory is reserved block_size tokens at a time instead of max_context at a time. Blocks are
// reference counted: forks (n > 1) share them and copy on write, and full computed blocks are
// published under a chained hash of their tokens so that later prompts with the same prefix
// reuse their K/V instead of recomputing it. See README.md for the parameters and the
// contract with the engine. Not thread-safe: the engine calls it from its step thread only.
#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "block_pool.h"
#include "tessera/sdk.h"

namespace tessera {
namespace {

const ParamSpec kParams[] = {
    {"block_size", ParamType::kInt, "16", "tokens per KV block", 1, 1024},
    {"memory", ParamType::kBytes, "256MiB", "bytes of KV memory (all layers, K and V)", 1,
     INFINITY},
    TESSERA_KV_DTYPE_PARAMS,
    {"prefix_caching", ParamType::kBool, "true",
     "reuse the K/V of full blocks whose whole token prefix matches an earlier sequence"},
};

int32_t ceil_div(int64_t a, int64_t b) { return static_cast<int32_t>((a + b - 1) / b); }

class PagedKvCache final : public KvCacheManager {
 public:
  PagedKvCache(int32_t block_size, int64_t budget, KvDtypes dtype, bool prefix_caching,
               Logger* logger)
      : block_size_(block_size), budget_(budget), dtype_(dtype),
        prefix_caching_(prefix_caching), logger_(logger) {}

  Status configure(const KvModelShape& shape, KvLayout* layout) override {
    if (Status st = check_kv_dtypes("kv_cache.paged", shape, dtype_); !st.is_ok()) return st;
    const size_t block_bytes = KvLayout::block_bytes(shape, block_size_, dtype_.k, dtype_.v);
    if (block_bytes == 0)
      return invalid_argument("kv_cache.paged: the model shape has no K/V (num_layers " +
                              std::to_string(shape.num_layers) + ", num_kv_heads " +
                              std::to_string(shape.num_kv_heads) + ", head_dim " +
                              std::to_string(shape.head_dim) + ")");
    const int64_t blocks = std::min<int64_t>(budget_ / static_cast<int64_t>(block_bytes),
                                             std::numeric_limits<int32_t>::max());
    const int32_t blocks_per_seq = std::max(1, ceil_div(shape.max_context, block_size_));
    if (blocks < blocks_per_seq)
      return resource_exhausted(
          "kv_cache.paged: memory " + std::to_string(budget_) + " bytes holds " +
          std::to_string(blocks) + " blocks of " + std::to_string(block_size_) + " tokens (" +
          std::to_string(block_bytes) + " bytes each), but one sequence of max_context " +
          std::to_string(shape.max_context) + " tokens needs " + std::to_string(blocks_per_seq) +
          " blocks (" + std::to_string(static_cast<int64_t>(blocks_per_seq) * block_bytes) +
          " bytes); raise engine.kv_cache.memory or lower model.context_length");
    blocks_per_seq_ = blocks_per_seq;
    layout->block_size = block_size_;
    layout->num_blocks = static_cast<int32_t>(blocks);
    layout->k_dtype = dtype_.k;
    layout->v_dtype = dtype_.v;
    pool_.reset(layout->num_blocks, block_size_);
    sequences_.clear();
    copies_.clear();
    prefix_query_tokens_ = prefix_hit_tokens_ = 0;
    if (logger_ && logger_->enabled(LogLevel::kInfo))
      logger_->log(LogLevel::kInfo,
                   "kv_cache.paged: " + std::to_string(blocks) + " blocks of " +
                       std::to_string(block_size_) + " tokens (K " + kv_dtype_name(dtype_.k) + ", V " +
                       kv_dtype_name(dtype_.v) + "), prefix caching " + (prefix_caching_ ? "on" : "off"));
    return Status::ok();
  }

  int32_t attach_cached_prefix(const SequenceInfo& seq) override {
    if (!prefix_caching_ || seq.num_computed_tokens != 0) return 0;
    // Asked twice before the first chunk ran: the blocks are already attached.
    if (auto it = sequences_.find(seq.id); it != sequences_.end()) return it->second.num_attached;

    // At least one prompt token stays uncomputed so that the step feeding it yields logits.
    const int32_t num_prompt = std::min(seq.num_prompt_tokens, seq.num_tokens());
    const int32_t max_blocks = num_prompt > 0 ? (num_prompt - 1) / block_size_ : 0;
    prefix_query_tokens_ += std::max(0, num_prompt);
    if (max_blocks == 0) return 0;

    // Host memory for the table is taken before any block reference: if it is not there,
    // the sequence simply gets no prefix reuse (bad_alloc changes nothing).
    SeqBlocks blocks;
    try {
      blocks = new_seq_blocks();
      blocks.hashes.reserve(max_blocks);
      sequences_.reserve(sequences_.size() + 1);
    } catch (const std::bad_alloc&) {
      return 0;
    }
    uint64_t parent = paged::kRootHash;
    for (int32_t i = 0; i < max_blocks; ++i) {
      const auto tokens = seq.tokens.subspan(static_cast<size_t>(i) * block_size_, block_size_);
      const uint64_t hash = paged::chain_hash(parent, tokens);
      const int32_t b = pool_.find(hash, parent, tokens);
      if (b < 0) break;
      pool_.add_ref(b);
      blocks.table.push_back(b);
      blocks.hashes.push_back(hash);
      parent = hash;
    }
    if (blocks.table.empty()) return 0;
    blocks.num_attached = static_cast<int32_t>(blocks.table.size()) * block_size_;
    prefix_hit_tokens_ += blocks.num_attached;
    const int32_t attached = blocks.num_attached;
    sequences_.emplace(seq.id, std::move(blocks));  // no rehash: reserved above
    return attached;
  }

  // Host memory (a new sequence's table, the copy list) is taken before any block changes
  // hands, and running out of it answers "no room" like a full pool: the scheduler then
  // waits, preempts or rejects this one sequence, and nothing leaks.
  bool allocate_slots(const SequenceInfo& seq, int32_t num_new_tokens) override {
    if (num_new_tokens < 0) return false;
    auto it = sequences_.find(seq.id);
    const bool is_new = it == sequences_.end();
    SeqBlocks empty;
    try {
      if (is_new) {
        empty = new_seq_blocks();
        sequences_.reserve(sequences_.size() + 1);
      }
    } catch (const std::bad_alloc&) {
      return false;
    }
    SeqBlocks& s = is_new ? empty : it->second;

    // Counted from num_computed_tokens, as the SDK says: in the step that attached a prefix
    // the scheduler asks for `cached + n` while num_computed_tokens is still 0. The attached
    // blocks themselves are never written (the engine starts after them), so copy-on-write
    // looks only at blocks from the attached prefix on.
    const int64_t end = static_cast<int64_t>(seq.num_computed_tokens) + num_new_tokens;
    const int32_t start = std::max(seq.num_computed_tokens, s.num_attached);
    const int32_t num_needed = ceil_div(end, block_size_);
    const int32_t num_held = static_cast<int32_t>(s.table.size());

    // Shared blocks that will be written must be replaced by private ones first.
    int32_t num_shared = 0;
    const int32_t first_written = start / block_size_;
    if (end > start)
      for (int32_t i = first_written; i < std::min(num_held, num_needed); ++i)
        if (pool_.ref_count(s.table[i]) > 1) ++num_shared;
    const int32_t num_grow = std::max(0, num_needed - num_held);
    if (num_grow + num_shared > pool_.num_free()) return false;  // all or nothing
    if (num_grow + num_shared == 0 && !is_new) return true;

    try {  // the last host allocations, before any block changes hands
      if (num_shared > 0) copies_.reserve(copies_.size() + num_shared);
      if (static_cast<int32_t>(s.table.capacity()) < num_needed) s.table.reserve(num_needed);
    } catch (const std::bad_alloc&) {
      return false;
    }
    if (num_shared > 0)
      for (int32_t i = first_written; i < std::min(num_held, num_needed); ++i) {
        const int32_t old_block = s.table[i];
        if (pool_.ref_count(old_block) <= 1) continue;
        const int32_t new_block = pool_.allocate();
        // Only a block holding computed tokens before `start` needs its contents; later
        // blocks hold nothing this sequence has computed.
        if (static_cast<int64_t>(i) * block_size_ < start) copies_.push_back({old_block, new_block});
        pool_.release(old_block);
        s.table[i] = new_block;
      }
    for (int32_t i = num_held; i < num_needed; ++i) s.table.push_back(pool_.allocate());
    if (is_new) sequences_.emplace(seq.id, std::move(empty));  // no rehash: reserved above
    return true;
  }

  void mark_computed(const SequenceInfo& seq, int32_t num_computed) override {
    auto it = sequences_.find(seq.id);
    if (it == sequences_.end()) return;
    SeqBlocks& s = it->second;
    s.num_computed = num_computed;
    if (num_computed >= s.num_attached) s.num_attached = 0;  // the engine has caught up
    if (!prefix_caching_) return;
    // Only blocks whose tokens are all computed AND present: after speculative verification
    // the accepted tokens are counted as computed before the engine appends them.
    const int64_t known = std::min<int64_t>({num_computed, seq.num_tokens(),
                                            static_cast<int64_t>(s.table.size()) * block_size_});
    const int32_t num_full = static_cast<int32_t>(known / block_size_);
    for (int32_t i = static_cast<int32_t>(s.hashes.size()); i < num_full; ++i) {
      const uint64_t parent = i == 0 ? paged::kRootHash : s.hashes[i - 1];
      const auto tokens = seq.tokens.subspan(static_cast<size_t>(i) * block_size_, block_size_);
      const uint64_t hash = paged::chain_hash(parent, tokens);
      s.hashes.push_back(hash);
      pool_.publish(s.table[i], hash, parent, tokens);  // no-op when already published
    }
  }

  void truncate(const SequenceInfo& seq, int32_t num_tokens) override {
    auto it = sequences_.find(seq.id);
    if (it == sequences_.end()) return;
    SeqBlocks& s = it->second;
    // Blocks wholly past the kept tokens held only rejected drafts: allocated for them this
    // step, never published (only computed tokens are), so they go back plain.
    const size_t keep = static_cast<size_t>(
        std::max<int32_t>(ceil_div(std::max(num_tokens, s.num_attached), block_size_), s.hashes.size()));
    while (s.table.size() > keep) {
      pool_.release(s.table.back());
      s.table.pop_back();
    }
    s.num_computed = std::min(s.num_computed, num_tokens);
  }

  void free(SeqId id) override {
    auto it = sequences_.find(id);
    if (it == sequences_.end()) return;
    // Released tail first: the LRU then evicts a chain's last blocks before its first ones,
    // which are the ones more prompts share (a chain is useless past its first missing block).
    const std::vector<int32_t>& table = it->second.table;
    for (auto b = table.rbegin(); b != table.rend(); ++b) pool_.release(*b);
    sequences_.erase(it);
  }

  Status fork(SeqId parent, SeqId child) override {
    auto it = sequences_.find(parent);
    if (it == sequences_.end())
      return invalid_argument("kv_cache.paged: fork of unknown sequence " + std::to_string(parent));
    if (sequences_.count(child))
      return invalid_argument("kv_cache.paged: fork into existing sequence " + std::to_string(child));
    // Every allocation before the first add_ref: out of host memory fails the child alone.
    try {
      SeqBlocks copy = new_seq_blocks();  // copied before emplace may rehash and move `it`
      copy.table = it->second.table;
      copy.hashes = it->second.hashes;
      copy.num_computed = it->second.num_computed;
      copy.num_attached = it->second.num_attached;
      auto [child_it, inserted] = sequences_.emplace(child, std::move(copy));
      for (int32_t b : child_it->second.table) pool_.add_ref(b);
    } catch (const std::bad_alloc&) {
      return resource_exhausted("kv_cache.paged: out of host memory forking sequence " + std::to_string(parent));
    }
    return Status::ok();
  }

  std::span<const int32_t> block_table(SeqId id) const override {
    auto it = sequences_.find(id);
    if (it == sequences_.end()) return {};
    return it->second.table;
  }

  void take_block_copies(std::vector<BlockCopy>* copies) override {
    copies->insert(copies->end(), copies_.begin(), copies_.end());
    copies_.clear();
  }

  int32_t num_free_blocks() const override { return pool_.num_free(); }

  KvStats stats() const override {
    KvStats s;
    s.num_blocks = pool_.num_blocks();
    s.num_used_blocks = pool_.num_used();
    s.num_cached_blocks = pool_.num_cached();
    for (const auto& [id, seq] : sequences_) {
      s.num_slots_reserved += static_cast<int64_t>(seq.table.size()) * block_size_;
      s.num_slots_filled += std::max(seq.num_computed, seq.num_attached);
    }
    s.prefix_query_tokens = prefix_query_tokens_;
    s.prefix_hit_tokens = prefix_hit_tokens_;
    return s;
  }

  static Status create(const PluginConfig& config, const PluginContext& context,
                       std::unique_ptr<KvCacheManager>* out) {
    const KvDtypes dtype = kv_dtypes_from_config(config);
    *out = std::make_unique<PagedKvCache>(static_cast<int32_t>(config.get_int("block_size", 16)),
                                          config.get_int("memory", 256ll << 20), dtype,
                                          config.get_bool("prefix_caching", true), context.logger);
    return Status::ok();
  }

 private:
  struct SeqBlocks {
    std::vector<int32_t> table;    // block ids in token order
    std::vector<uint64_t> hashes;  // chain hash of each leading full block already published
    int32_t num_computed = 0;      // last count from mark_computed
    // Tokens attached from the prefix cache that the engine has not yet reported computed:
    // until it does, new tokens start after them.
    int32_t num_attached = 0;
  };

  // Tables sized for a whole context up front: a decode step that crosses into a new block
  // then appends without touching the heap.
  SeqBlocks new_seq_blocks() const {
    SeqBlocks s;
    s.table.reserve(blocks_per_seq_);
    s.hashes.reserve(blocks_per_seq_);
    return s;
  }

  int32_t block_size_;
  int32_t blocks_per_seq_ = 1;
  int64_t budget_;
  KvDtypes dtype_;
  bool prefix_caching_;
  Logger* logger_;
  paged::BlockPool pool_;
  std::unordered_map<SeqId, SeqBlocks> sequences_;
  std::vector<BlockCopy> copies_;
  int64_t prefix_query_tokens_ = 0;
  int64_t prefix_hit_tokens_ = 0;
};

}  // namespace
}  // namespace tessera

TESSERA_REGISTER_PLUGIN(tessera::PagedKvCache, tessera::KvCacheManager, "paged", "0.1.0",
                        "PagedAttention block pool with copy-on-write forks and prefix caching",
                        tessera::kParams)
