// kv_cache plugins decide which KV blocks each sequence uses: allocation, sharing (forks and
// prefix reuse), eviction. They never touch KV memory itself: the backend owns the pool,
// laid out as [num_blocks][block_size][num_kv_heads] rows of head_dim elements per layer for K
// and for V (each in its KvLayout dtype: f32, f16 or ggml Q8_0 blocks),
// and the runner writes token t of a sequence into block block_table[t / block_size] at
// row t % block_size. A contiguous cache is the special case of one block per sequence.
#pragma once

#include <cstdint>
#include <cmath>
#include <span>
#include <string>
#include <vector>

#include "tessera/sdk/plugin.h"
#include "tessera/sdk/types.h"

namespace tessera {

// What the model needs stored per token.
struct KvModelShape {
  int32_t num_layers = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  int32_t max_context = 0;   // the longest sequence the engine will admit
  int32_t max_num_seqs = 0;  // from the scheduler, for caches that reserve per sequence
};

// The pool the backend must allocate, as decided by the plugin.
struct KvLayout {
  int32_t block_size = 0;  // tokens per block
  int32_t num_blocks = 0;
  KvDtype k_dtype = KvDtype::kF16;  // storage of K rows
  KvDtype v_dtype = KvDtype::kF16;  // storage of V rows (may differ: e.g. q8_0 K, f16 V)

  // Bytes of one block of one layer's K (or V) pool.
  static size_t pool_block_bytes(const KvModelShape& s, int32_t block_size, KvDtype dtype) {
    return static_cast<size_t>(block_size) * s.num_kv_heads * kv_row_bytes(dtype, s.head_dim);
  }
  // Bytes of one block across all layers, K and V.
  static size_t block_bytes(const KvModelShape& s, int32_t block_size, KvDtype k_dtype, KvDtype v_dtype) {
    return static_cast<size_t>(s.num_layers) *
           (pool_block_bytes(s, block_size, k_dtype) + pool_block_bytes(s, block_size, v_dtype));
  }
};

// The KV storage types a kv_cache plugin was configured with. In-tree caches take three
// parameters: `dtype` (f16|f32|q8_0, both pools) and `k_dtype` / `v_dtype` (auto|f16|f32|
// q8_0; auto = dtype), so K and V can be A/B-tested separately.
struct KvDtypes {
  KvDtype k = KvDtype::kF16;
  KvDtype v = KvDtype::kF16;
};

// The three ParamSpec entries of those parameters, for a plugin's parameter table:
//   const ParamSpec kParams[] = {{"memory", ...}, TESSERA_KV_DTYPE_PARAMS};
#define TESSERA_KV_DTYPE_PARAMS                                                             \
  ::tessera::ParamSpec{"dtype", ::tessera::ParamType::kEnum, "f16",                         \
                       "storage of cached K and V: f16, f32, or q8_0 (ggml Q8_0: 32 int8 "  \
                       "+ one f16 scale per 32 values, 8.5 bits per value)",                \
                       -INFINITY, INFINITY, "f16|f32|q8_0"},                                \
  ::tessera::ParamSpec{"k_dtype", ::tessera::ParamType::kEnum, "auto",                      \
                       "storage of K only (auto: dtype)", -INFINITY, INFINITY,              \
                       "auto|f16|f32|q8_0"},                                                \
  ::tessera::ParamSpec{"v_dtype", ::tessera::ParamType::kEnum, "auto",                      \
                       "storage of V only (auto: dtype)", -INFINITY, INFINITY,              \
                       "auto|f16|f32|q8_0"}

inline bool parse_kv_dtype(const std::string& name, KvDtype* out) {
  if (name == "f16") *out = KvDtype::kF16;
  else if (name == "f32") *out = KvDtype::kF32;
  else if (name == "q8_0") *out = KvDtype::kQ8_0;
  else return false;
  return true;
}

// Reads dtype / k_dtype / v_dtype (unknown names fall back to f16: the config loader has
// already checked them against the enum choices).
inline KvDtypes kv_dtypes_from_config(const PluginConfig& config) {
  KvDtype base = KvDtype::kF16;
  parse_kv_dtype(config.get_string("dtype", "f16"), &base);
  KvDtypes d{base, base};
  parse_kv_dtype(config.get_string("k_dtype", "auto"), &d.k);
  parse_kv_dtype(config.get_string("v_dtype", "auto"), &d.v);
  return d;
}

// Fails, naming the plugin, when a row of head_dim elements cannot be stored in a dtype.
inline Status check_kv_dtypes(const char* plugin, const KvModelShape& shape, KvDtypes d) {
  for (KvDtype t : {d.k, d.v})
    if (!kv_dtype_fits(t, shape.head_dim))
      return invalid_argument(std::string(plugin) + ": dtype " + kv_dtype_name(t) +
                              " stores blocks of 32 elements, but the model's head_dim is " +
                              std::to_string(shape.head_dim));
  return Status::ok();
}

// A block copy the runner must perform before the step's forward (copy-on-write after a fork).
struct BlockCopy {
  int32_t src = 0;
  int32_t dst = 0;
};

struct KvStats {
  int32_t num_blocks = 0;
  int32_t num_used_blocks = 0;     // referenced by at least one live sequence
  int32_t num_cached_blocks = 0;   // unreferenced but kept for prefix reuse (evictable)
  int64_t num_slots_reserved = 0;  // token slots held by live sequences
  int64_t num_slots_filled = 0;    // of those, slots holding a computed token
  int64_t prefix_query_tokens = 0; // prompt tokens looked up in the prefix cache
  int64_t prefix_hit_tokens = 0;   // of those, found cached
};

class KvCacheManager {
 public:
  virtual ~KvCacheManager() = default;

  // Called once before use with the model's shape and the byte budget from config; decides
  // the layout. Fails when not even one sequence of max_context tokens fits.
  virtual Status configure(const KvModelShape& shape, KvLayout* layout) = 0;

  // Prefix caching: when a waiting sequence is first scheduled, returns how many of its
  // leading tokens already have K/V in the cache (a multiple of block_size, less than
  // num_prompt_tokens) and attaches those blocks to it. Caches without prefix reuse return 0.
  virtual int32_t attach_cached_prefix(const SequenceInfo& seq) = 0;

  // Makes room so that tokens [0, seq.num_computed_tokens + num_new_tokens) have slots.
  // In the step that attached a cached prefix, num_computed_tokens is still 0 (the engine
  // applies the plan afterwards), so schedulers pass cached + new tokens then. Returns false
  // and changes nothing when there is not enough free memory (the scheduler then preempts).
  virtual bool allocate_slots(const SequenceInfo& seq, int32_t num_new_tokens) = 0;

  // The first `num_computed` tokens of seq now hold valid K/V; full blocks among them may be
  // published for prefix reuse.
  virtual void mark_computed(const SequenceInfo& seq, int32_t num_computed) = 0;

  // Speculative rollback: only tokens [0, num_tokens) of seq are kept (the drafts after them
  // were rejected). Returns the slots past them, e.g. whole blocks, to the pool; the next
  // allocate_slots grows again from there. num_tokens >= seq.num_computed_tokens.
  virtual void truncate(const SequenceInfo& seq, int32_t num_tokens) = 0;

  // Releases every block reference of the sequence (finish, cancel, preemption).
  virtual void free(SeqId seq) = 0;

  // `child` shares all of `parent`'s blocks (n > 1 samples of one prompt). A shared block is
  // copied on the next write through allocate_slots (see take_block_copies).
  virtual Status fork(SeqId parent, SeqId child) = 0;

  // Block table of a live sequence: block ids in token order. Valid until the next call that
  // changes this sequence's blocks.
  virtual std::span<const int32_t> block_table(SeqId seq) const = 0;

  // Moves out the block copies decided since the last call; the runner performs them first.
  virtual void take_block_copies(std::vector<BlockCopy>* copies) = 0;

  virtual int32_t num_free_blocks() const = 0;
  virtual KvStats stats() const = 0;
};

template <> struct PluginKindOf<KvCacheManager> {
  static constexpr PluginKind value = PluginKind::kKvCache;
};

}  // namespace tessera
