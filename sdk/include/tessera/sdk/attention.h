// attention plugins compute causal multi-head attention for a flattened batch of query rows
// against K/V read through block tables (see kv_cache.h for the pool layout). Grouped-query
// attention: query head h reads KV head h / (num_heads / num_kv_heads). With a sliding window
// (AttentionShape::sliding_window, SDK ABI 2.5) a query also ignores keys that are window or
// more positions behind it (Gemma's local layers; llama.cpp's LLAMA_SWA_TYPE_STANDARD).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>

#include "tessera/sdk/executor.h"
#include "tessera/sdk/plugin.h"
#include "tessera/sdk/types.h"

namespace tessera {

struct AttentionShape {
  int32_t num_heads = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  float scale = 1.0f;        // usually 1/sqrt(head_dim)
  int32_t block_size = 0;    // tokens per KV block
  KvDtype k_dtype = KvDtype::kF16;  // how the K pool stores rows (tessera/sdk/types.h)
  KvDtype v_dtype = KvDtype::kF16;  // how the V pool stores rows
  // 0: causal attention over the whole context. W > 0: the query at position p sees keys at
  // positions [max(0, p - W + 1), p] only (ABI 2.5). The K/V of older positions stay in the
  // pool (other layers, prefix caching); the kernel just does not read them.
  int32_t sliding_window = 0;
};

// First key position the query at `position` sees (0 without a sliding window).
inline int32_t attention_window_begin(const AttentionShape& shape, int32_t position) {
  return shape.sliding_window > 0 ? std::max(0, position - shape.sliding_window + 1) : 0;
}

// One sequence's share of the batch. Its query rows are q[query_start .. query_start +
// num_queries); they are the last num_queries of its context_len tokens, whose K/V are
// already in the pool. Query i (at position p = context_len - num_queries + i) attends to
// positions [attention_window_begin(shape, p), p].
struct AttentionSequence {
  int32_t query_start = 0;
  int32_t num_queries = 0;
  int32_t context_len = 0;
  const int32_t* block_table = nullptr;  // ceil(context_len / block_size) entries
};

struct AttentionBatch {
  std::span<const AttentionSequence> sequences;
  const float* q = nullptr;     // [num_rows][num_heads][head_dim]
  // This layer's K: [num_blocks][block_size][num_kv_heads] rows of head_dim elements stored
  // as shape.k_dtype (a row is kv_row_bytes(k_dtype, head_dim) bytes).
  const void* k_pool = nullptr;
  const void* v_pool = nullptr; // this layer's V, same layout in shape.v_dtype
  float* out = nullptr;         // [num_rows][num_heads][head_dim]
};

class AttentionKernel {
 public:
  virtual ~AttentionKernel() = default;
  // Bytes of scratch memory the kernel needs for a batch with these limits (reported by
  // benchmarks; allocated by the kernel itself, once, not per call).
  virtual size_t scratch_bytes(const AttentionShape& shape, int32_t max_rows,
                               int32_t max_context) const = 0;
  // Computes batch.out. Called from the engine thread; splits work over `executor`. A kernel
  // returns kInvalidArgument for a KV dtype it does not read.
  virtual Status forward(const AttentionShape& shape, const AttentionBatch& batch,
                         Executor& executor) = 0;
};

template <> struct PluginKindOf<AttentionKernel> {
  static constexpr PluginKind value = PluginKind::kAttention;
};

}  // namespace tessera
