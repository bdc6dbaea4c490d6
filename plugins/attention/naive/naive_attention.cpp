// attention.naive: the textbook algorithm, kept as the oracle every other attention kernel is
// tested against. For each sequence and head it materializes the full score matrix
// [num_queries][context_len], applies a causal mask and a softmax, then multiplies by V.
#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <vector>

#include "tessera/ggml_types.h"
#include "tessera/sdk.h"

namespace tessera {
namespace {

class NaiveAttention final : public AttentionKernel {
 public:
  size_t scratch_bytes(const AttentionShape& shape, int32_t max_rows,
                       int32_t max_context) const override {
    // One score matrix per thread, plus a widened K/V row and a rounded query row.
    return static_cast<size_t>(max_rows) * max_context * sizeof(float) +
           2 * static_cast<size_t>(shape.head_dim) * sizeof(float);
  }

  Status forward(const AttentionShape& shape, const AttentionBatch& batch,
                 Executor& executor) override {
    const int32_t num_threads = executor.num_threads();
    if (static_cast<int32_t>(scratch_.size()) < num_threads) scratch_.resize(num_threads);
    const int32_t heads = shape.num_heads;
    const int64_t num_tasks = static_cast<int64_t>(batch.sequences.size()) * heads;
    executor.run(num_tasks, [&](int64_t begin, int64_t end, int thread) {
      for (int64_t task = begin; task < end; ++task)
        run_head(shape, batch, batch.sequences[task / heads], static_cast<int32_t>(task % heads),
                 scratch_[thread]);
    });
    return Status::ok();
  }

  static Status create(const PluginConfig&, const PluginContext&,
                       std::unique_ptr<AttentionKernel>* out) {
    *out = std::make_unique<NaiveAttention>();
    return Status::ok();
  }

 private:
  // Reads element row `position` of KV head `kv_head` from a pool, widened to float.
  static void load_row(const AttentionShape& s, const void* pool, const AttentionSequence& seq,
                       int32_t position, int32_t kv_head, float* out) {
    const int64_t slot = static_cast<int64_t>(seq.block_table[position / s.block_size]) *
                             s.block_size + position % s.block_size;
    const int64_t index = (slot * s.num_kv_heads + kv_head) * s.head_dim;
    if (s.kv_dtype == KvDtype::kF32) {
      const float* src = static_cast<const float*>(pool) + index;
      std::copy(src, src + s.head_dim, out);
    } else {
      const uint16_t* src = static_cast<const uint16_t*>(pool) + index;
      for (int32_t i = 0; i < s.head_dim; ++i) out[i] = fp16_to_fp32(src[i]);
    }
  }

  static void run_head(const AttentionShape& s, const AttentionBatch& batch,
                       const AttentionSequence& seq, int32_t head, std::vector<float>& scratch) {
    const int32_t d = s.head_dim;
    const int32_t nq = seq.num_queries;
    const int32_t ctx = seq.context_len;
    const int32_t kv_head = head / (s.num_heads / s.num_kv_heads);
    const size_t needed = static_cast<size_t>(nq) * ctx + 2 * static_cast<size_t>(d);
    if (scratch.size() < needed) scratch.resize(needed);
    float* scores = scratch.data();
    float* row = scratch.data() + static_cast<size_t>(nq) * ctx;
    const int64_t q_stride = static_cast<int64_t>(s.num_heads) * d;

    // With an f16 cache the products are taken at the cache's precision: Q and the softmax
    // probabilities are rounded to f16 before they meet K and V (what llama.cpp's CPU path and
    // half-precision GPU kernels do), so logits match the reference closely.
    const bool half = s.kv_dtype == KvDtype::kF16;
    auto at_cache_precision = [half](float v) { return half ? fp16_to_fp32(fp32_to_fp16(v)) : v; };
    float* q_rounded = row + d;
    // S = scale * Q K^T, causally masked.
    for (int32_t j = 0; j < ctx; ++j) {
      load_row(s, batch.k_pool, seq, j, kv_head, row);
      for (int32_t i = 0; i < nq; ++i) {
        const int32_t last_visible = ctx - nq + i;
        float* out = scores + static_cast<size_t>(i) * ctx + j;
        if (j > last_visible) {
          *out = -std::numeric_limits<float>::infinity();
          continue;
        }
        const float* q = batch.q + (seq.query_start + i) * q_stride + head * d;
        for (int32_t k = 0; k < d; ++k) q_rounded[k] = at_cache_precision(q[k]);
        float dot = 0.0f;
        for (int32_t k = 0; k < d; ++k) dot += q_rounded[k] * row[k];
        *out = dot * s.scale;
      }
    }
    // Row-wise softmax.
    for (int32_t i = 0; i < nq; ++i) {
      float* srow = scores + static_cast<size_t>(i) * ctx;
      const float max = *std::max_element(srow, srow + ctx);
      double sum = 0.0;
      for (int32_t j = 0; j < ctx; ++j) {
        srow[j] = std::exp(srow[j] - max);
        sum += srow[j];
      }
      const float inv = static_cast<float>(1.0 / sum);
      for (int32_t j = 0; j < ctx; ++j) srow[j] = at_cache_precision(srow[j] * inv);
    }
    // O = P V.
    for (int32_t i = 0; i < nq; ++i) {
      float* o = batch.out + (seq.query_start + i) * q_stride + head * d;
      std::fill(o, o + d, 0.0f);
    }
    for (int32_t j = 0; j < ctx; ++j) {
      load_row(s, batch.v_pool, seq, j, kv_head, row);
      for (int32_t i = 0; i < nq; ++i) {
        const float p = scores[static_cast<size_t>(i) * ctx + j];
        if (p == 0.0f) continue;
        float* o = batch.out + (seq.query_start + i) * q_stride + head * d;
        for (int32_t k = 0; k < d; ++k) o[k] += p * row[k];
      }
    }
  }

  std::vector<std::vector<float>> scratch_;  // per thread
};

}  // namespace
}  // namespace tessera

TESSERA_REGISTER_PLUGIN(tessera::NaiveAttention, tessera::AttentionKernel, "naive", "0.1.0",
                        "full score matrix per head; the reference other kernels are tested against",
                        TESSERA_NO_PARAMS)
