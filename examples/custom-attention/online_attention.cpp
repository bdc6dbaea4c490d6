// attention.online: causal, grouped-query attention over the paged KV pool in one pass per
// query row with an online softmax (running max and sum, rescaled as larger scores arrive),
// so no score row of context length is ever stored. Work items are (sequence, query row, KV
// head): the query heads that share a KV head are computed together, so each K and V row is
// widened to floats (tessera/sdk/kv_rows.h: f32, f16 and q8_0 pools) once per item rather than
// once per query head. Everything it uses is in the installed SDK.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <vector>

#include "tessera/sdk.h"
#include "tessera/sdk/kernels/ggml_types.h"
#include "tessera/sdk/kv_rows.h"

namespace {

using namespace tessera;

struct WorkItem {
  int32_t sequence;
  int32_t query;    // index within the sequence's query rows
  int32_t kv_head;
};

// One thread's buffers, sized for the largest shape seen.
struct Scratch {
  std::vector<float> q;       // [group][head_dim] the item's query heads, at the K pool's precision
  std::vector<float> k, v;    // one widened row each
  std::vector<float> acc;     // [group][head_dim] running sums of weight * V
  std::vector<float> max, sum;  // [group] running max score and sum of weights
};

class OnlineAttention final : public AttentionKernel {
 public:
  static Status create(const PluginConfig&, const PluginContext&, std::unique_ptr<AttentionKernel>* out) {
    *out = std::make_unique<OnlineAttention>();
    return Status::ok();
  }

  // The work list plus one thread's buffers (each executor thread holds one such set); none
  // grows with the context length.
  size_t scratch_bytes(const AttentionShape& shape, int32_t max_rows, int32_t) const override {
    const size_t group = shape.num_kv_heads > 0 ? static_cast<size_t>(shape.num_heads / shape.num_kv_heads) : 0;
    const size_t per_thread = (2 + 2 * group) * shape.head_dim * sizeof(float) + 2 * group * sizeof(float);
    return per_thread + static_cast<size_t>(max_rows) * shape.num_kv_heads * sizeof(WorkItem);
  }

  Status forward(const AttentionShape& shape, const AttentionBatch& batch, Executor& executor) override {
    if (shape.num_kv_heads <= 0 || shape.num_heads % shape.num_kv_heads != 0)
      return invalid_argument("attention.online: num_heads (" + std::to_string(shape.num_heads) +
                              ") must be a positive multiple of num_kv_heads (" +
                              std::to_string(shape.num_kv_heads) + ")");
    for (KvDtype d : {shape.k_dtype, shape.v_dtype})
      if (d == KvDtype::kQ8_0 && shape.head_dim % 32 != 0)
        return invalid_argument("attention.online: a q8_0 pool needs head_dim a multiple of 32, got " +
                                std::to_string(shape.head_dim));
    items_.clear();
    for (int32_t s = 0; s < static_cast<int32_t>(batch.sequences.size()); ++s)
      for (int32_t i = 0; i < batch.sequences[s].num_queries; ++i)
        for (int32_t h = 0; h < shape.num_kv_heads; ++h) items_.push_back({s, i, h});
    if (items_.empty()) return Status::ok();
    const int32_t group = shape.num_heads / shape.num_kv_heads;
    if (scratch_.size() < static_cast<size_t>(executor.num_threads())) scratch_.resize(executor.num_threads());
    for (Scratch& s : scratch_) {
      s.q.resize(static_cast<size_t>(group) * shape.head_dim);
      s.k.resize(shape.head_dim);
      s.v.resize(shape.head_dim);
      s.acc.resize(static_cast<size_t>(group) * shape.head_dim);
      s.max.resize(group);
      s.sum.resize(group);
    }
    executor.run(static_cast<int64_t>(items_.size()), [&](int64_t begin, int64_t end, int thread) {
      for (int64_t w = begin; w < end; ++w) compute(shape, batch, items_[w], group, scratch_[thread]);
    });
    return Status::ok();
  }

 private:
  static void compute(const AttentionShape& shape, const AttentionBatch& batch, const WorkItem& item,
                      int32_t group, Scratch& s) {
    const AttentionSequence& seq = batch.sequences[item.sequence];
    const int32_t d = shape.head_dim;
    const int64_t row = seq.query_start + item.query;
    const int32_t position = seq.context_len - seq.num_queries + item.query;
    const float* q_row = batch.q + (row * shape.num_heads + static_cast<int64_t>(item.kv_head) * group) * d;
    // Against an f16 K cache, Q is taken at f16 precision too, as the in-tree kernels do (the
    // cache's precision is part of the attention's semantics; the conformance reference
    // rounds Q the same way). f32 and q8_0 caches keep Q in f32.
    for (int64_t e = 0; e < static_cast<int64_t>(group) * d; ++e)
      s.q[e] = shape.k_dtype == KvDtype::kF16 ? fp16_to_fp32(fp32_to_fp16(q_row[e])) : q_row[e];
    const float* q = s.q.data();
    std::fill(s.acc.begin(), s.acc.end(), 0.0f);
    std::fill(s.max.begin(), s.max.end(), -std::numeric_limits<float>::infinity());
    std::fill(s.sum.begin(), s.sum.end(), 0.0f);
    const auto* k_pool = static_cast<const uint8_t*>(batch.k_pool);
    const auto* v_pool = static_cast<const uint8_t*>(batch.v_pool);
    for (int32_t pos = attention_window_begin(shape, position); pos <= position; ++pos) {
      const int64_t slot = static_cast<int64_t>(seq.block_table[pos / shape.block_size]) * shape.block_size +
                           pos % shape.block_size;
      widen_kv_row(shape.k_dtype, k_pool + kv_row_offset(shape.k_dtype, slot, shape.num_kv_heads, item.kv_head, d),
                   s.k.data(), d);
      widen_kv_row(shape.v_dtype, v_pool + kv_row_offset(shape.v_dtype, slot, shape.num_kv_heads, item.kv_head, d),
                   s.v.data(), d);
      for (int32_t g = 0; g < group; ++g) {
        const float* qg = q + static_cast<int64_t>(g) * d;
        float score = 0.0f;
        for (int32_t e = 0; e < d; ++e) score += qg[e] * s.k[e];
        score *= shape.scale;
        float* acc = s.acc.data() + static_cast<int64_t>(g) * d;
        if (score > s.max[g]) {
          // A new maximum: earlier weights were relative to the old one, so scale them down.
          const float correction = ggml_expf(s.max[g] - score);
          s.sum[g] *= correction;
          for (int32_t e = 0; e < d; ++e) acc[e] *= correction;
          s.max[g] = score;
        }
        const float weight = ggml_expf(score - s.max[g]);
        s.sum[g] += weight;
        for (int32_t e = 0; e < d; ++e) acc[e] += weight * s.v[e];
      }
    }
    float* out = batch.out + (row * shape.num_heads + static_cast<int64_t>(item.kv_head) * group) * d;
    for (int32_t g = 0; g < group; ++g) {
      // The query's own position is always in range, so sum >= 1 (its weight at the max).
      const float inv = 1.0f / s.sum[g];
      for (int32_t e = 0; e < d; ++e) out[static_cast<int64_t>(g) * d + e] = s.acc[static_cast<int64_t>(g) * d + e] * inv;
    }
  }

  std::vector<WorkItem> items_;   // grown, never shrunk: no allocation per call at steady state
  std::vector<Scratch> scratch_;
};

}  // namespace

TESSERA_REGISTER_PLUGIN(OnlineAttention, tessera::AttentionKernel, "online", "0.1.0",
                        "example out-of-tree kernel: one-pass online-softmax GQA attention over the paged "
                        "KV pool (f32, f16, q8_0)",
                        TESSERA_NO_PARAMS)
