// attention.naive: the textbook algorithm, kept as the oracle every other attention kernel is
// tested against. For each sequence and head it materializes the full score matrix
// [num_queries][context_len], applies a causal mask and a softmax, then multiplies by V.
#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <vector>

#include "naive_kernel.h"
#include "tessera/sdk/kernels/ggml_types.h"
#include "tessera/sdk.h"
#include "tessera/sdk/kv_rows.h"

namespace tessera {
namespace {

const ParamSpec kParams[] = {
    {"simd", ParamType::kEnum, "auto",
     "auto: the AVX2/FMA/F16C build of the per-head kernel when the CPU has it (same bits); "
     "off: the portable one",
     -INFINITY, INFINITY, "auto|off"},
};

class NaiveAttention final : public AttentionKernel {
 public:
  explicit NaiveAttention(bool use_simd) : use_simd_(use_simd && cpu_has_avx2()) {}

  size_t scratch_bytes(const AttentionShape& shape, int32_t max_rows,
                       int32_t max_context) const override {
    // Per thread: the score matrix, 8 accumulator lanes per output element, a widened K/V
    // row and a rounded query row.
    return (static_cast<size_t>(max_rows) * max_context +
            static_cast<size_t>(max_rows) * shape.head_dim * 8 + 2 * static_cast<size_t>(shape.head_dim)) *
           sizeof(float);
  }

  Status forward(const AttentionShape& shape, const AttentionBatch& batch,
                 Executor& executor) override {
    for (KvDtype t : {shape.k_dtype, shape.v_dtype})
      if (!kv_dtype_fits(t, shape.head_dim))
        return invalid_argument(std::string("attention.naive: KV dtype ") + kv_dtype_name(t) +
                                " needs head_dim % 32 == 0, got " + std::to_string(shape.head_dim));
    const int32_t num_threads = executor.num_threads();
    if (static_cast<int32_t>(scratch_.size()) < num_threads) scratch_.resize(num_threads);
    const int32_t heads = shape.num_heads;
    if (use_simd_ && shape.head_dim % 32 == 0) {
      // The vectorized kernel computes any range of query rows of a head on its own (rows are
      // independent), so long prompts split into row chunks that balance across threads.
      tasks_.clear();
      for (size_t i = 0; i < batch.sequences.size(); ++i) {
        const AttentionSequence& seq = batch.sequences[i];
        for (int32_t q = 0; q < seq.num_queries; q += kQueryChunk)
          for (int32_t h = 0; h < heads; ++h)
            tasks_.push_back({static_cast<int32_t>(i), h, q, std::min(seq.num_queries, q + kQueryChunk)});
      }
      executor.run(static_cast<int64_t>(tasks_.size()), [&](int64_t begin, int64_t end, int thread) {
        for (int64_t t = begin; t < end; ++t) {
          const RowTask& task = tasks_[t];
          naive::run_rows_avx2(shape, batch, batch.sequences[task.seq], task.head, task.q_begin,
                               task.q_end, scratch_[thread]);
        }
      });
      return Status::ok();
    }
    const int64_t num_tasks = static_cast<int64_t>(batch.sequences.size()) * heads;
    executor.run(num_tasks, [&](int64_t begin, int64_t end, int thread) {
      for (int64_t task = begin; task < end; ++task)
        run_head(shape, batch, batch.sequences[task / heads], static_cast<int32_t>(task % heads),
                 scratch_[thread]);
    });
    return Status::ok();
  }

  static Status create(const PluginConfig& config, const PluginContext&,
                       std::unique_ptr<AttentionKernel>* out) {
    *out = std::make_unique<NaiveAttention>(config.get_string("simd", "auto") != "off");
    return Status::ok();
  }

 private:
  // Reads element row `position` of KV head `kv_head` from a pool of `dtype`, widened to
  // float (exactly, tessera/sdk/kv_rows.h).
  static void load_row(const AttentionShape& s, const void* pool, KvDtype dtype, const AttentionSequence& seq,
                       int32_t position, int32_t kv_head, float* out) {
    const int64_t slot = static_cast<int64_t>(seq.block_table[position / s.block_size]) *
                             s.block_size + position % s.block_size;
    widen_kv_row(dtype, static_cast<const uint8_t*>(pool) + kv_row_offset(dtype, slot, s.num_kv_heads, kv_head, s.head_dim),
                 out, s.head_dim);
  }

  // The reduction orders below are those of llama.cpp's x86 CPU path, so that logits match
  // it to the last bit (activations are re-quantized to 8 bits after attention, which turns
  // last-bit differences into different tokens now and then):
  //  - Q.K: ggml_vec_dot_f32 / _f16 — four 8-lane FMA accumulators over 32-element steps,
  //    folded (0+2, 1+3, then 0+1) and summed across lanes pairwise;
  //  - softmax: exp by ggml's vectorized polynomial (ggml_expf) in groups of 8 positions,
  //    each group summed pairwise across lanes into a double;
  //  - P.V: llamafile's tinyBLAS — one 8-lane FMA accumulator per output over the positions,
  //    then summed across lanes pairwise.
  static float dot_four_accumulators(const float* x, const float* y, int32_t n) {
    float acc[4][8] = {};
    const int32_t np = n & ~31;
    for (int32_t i = 0; i < np; i += 32)
      for (int j = 0; j < 4; ++j)
        for (int l = 0; l < 8; ++l) acc[j][l] = std::fma(x[i + 8 * j + l], y[i + 8 * j + l], acc[j][l]);
    for (int l = 0; l < 8; ++l) {
      acc[0][l] += acc[2][l];
      acc[1][l] += acc[3][l];
    }
    for (int l = 0; l < 8; ++l) acc[0][l] += acc[1][l];
    float t[4];
    for (int l = 0; l < 4; ++l) t[l] = acc[0][l] + acc[0][l + 4];
    float sum = (t[0] + t[1]) + (t[2] + t[3]);
    for (int32_t i = np; i < n; ++i) sum += x[i] * y[i];
    return sum;
  }

  // Sum of 8 lanes in the order _mm256 -> _mm128 (hi + lo), movehl, movehdup.
  static float sum_lanes(const float* v) {
    float t[4];
    for (int l = 0; l < 4; ++l) t[l] = v[l + 4] + v[l];
    return (t[0] + t[2]) + (t[1] + t[3]);
  }

  static void run_head(const AttentionShape& s, const AttentionBatch& batch,
                       const AttentionSequence& seq, int32_t head, std::vector<float>& scratch) {
    const int32_t d = s.head_dim;
    const int32_t nq = seq.num_queries;
    const int32_t ctx = seq.context_len;
    const int32_t kv_head = head / (s.num_heads / s.num_kv_heads);
    const size_t score_floats = static_cast<size_t>(nq) * ctx;
    const size_t lane_floats = static_cast<size_t>(nq) * d * 8;
    const size_t needed = score_floats + lane_floats + 2 * static_cast<size_t>(d);
    naive::ensure_scratch(scratch, needed);
    float* scores = scratch.data();
    float* lanes = scores + score_floats;  // [query][dim][8] P.V accumulators
    float* row = lanes + lane_floats;
    float* q_rounded = row + d;
    const int64_t q_stride = static_cast<int64_t>(s.num_heads) * d;

    // With an f16 cache the products are taken at the cache's precision: Q is rounded to f16
    // before it meets an f16 K, the softmax probabilities before they meet an f16 V (what
    // llama.cpp's CPU path and half-precision GPU kernels do). A Q8_0 pool is read as the
    // floats it holds (exact), against f32 Q and probabilities.
    const bool q_half = s.k_dtype == KvDtype::kF16;
    const bool p_half = s.v_dtype == KvDtype::kF16;
    auto to_half = [](float v) { return fp16_to_fp32(fp32_to_fp16(v)); };
    // S = scale * Q K^T, causally masked (and outside a sliding window: the same -inf, so
    // the sums and P.V lanes are those of llama.cpp's masked rows).
    for (int32_t j = 0; j < ctx; ++j) {
      load_row(s, batch.k_pool, s.k_dtype, seq, j, kv_head, row);
      for (int32_t i = 0; i < nq; ++i) {
        const int32_t last_visible = ctx - nq + i;
        float* out = scores + static_cast<size_t>(i) * ctx + j;
        if (j > last_visible || j < attention_window_begin(s, last_visible)) {
          *out = -std::numeric_limits<float>::infinity();
          continue;
        }
        const float* q = batch.q + (seq.query_start + i) * q_stride + head * d;
        for (int32_t k = 0; k < d; ++k) q_rounded[k] = q_half ? to_half(q[k]) : q[k];
        *out = dot_four_accumulators(row, q_rounded, d) * s.scale;
      }
    }
    // Row-wise softmax; masked positions give exp(-inf) = 0.
    for (int32_t i = 0; i < nq; ++i) {
      float* srow = scores + static_cast<size_t>(i) * ctx;
      const float max = *std::max_element(srow, srow + ctx);
      double sum = 0.0;
      float group[8];
      for (int32_t j0 = 0; j0 < ctx; j0 += 8) {
        for (int l = 0; l < 8; ++l) {
          group[l] = j0 + l < ctx ? ggml_expf(srow[j0 + l] - max) : 0.0f;
          if (j0 + l < ctx) srow[j0 + l] = group[l];
        }
        sum += static_cast<double>(sum_lanes(group));
      }
      const float inv = static_cast<float>(1.0 / sum);
      for (int32_t j = 0; j < ctx; ++j) srow[j] = p_half ? to_half(srow[j] * inv) : srow[j] * inv;
    }
    // O = P V with one 8-lane accumulator per output element (lane = position mod 8).
    std::fill(lanes, lanes + lane_floats, 0.0f);
    for (int32_t j = 0; j < ctx; ++j) {
      load_row(s, batch.v_pool, s.v_dtype, seq, j, kv_head, row);
      for (int32_t i = 0; i < nq; ++i) {
        const float p = scores[static_cast<size_t>(i) * ctx + j];
        if (p == 0.0f) continue;
        float* acc = lanes + static_cast<size_t>(i) * d * 8;
        for (int32_t k = 0; k < d; ++k) acc[k * 8 + j % 8] = std::fma(p, row[k], acc[k * 8 + j % 8]);
      }
    }
    for (int32_t i = 0; i < nq; ++i) {
      float* o = batch.out + (seq.query_start + i) * q_stride + head * d;
      const float* acc = lanes + static_cast<size_t>(i) * d * 8;
      for (int32_t k = 0; k < d; ++k) o[k] = sum_lanes(acc + k * 8);
    }
  }

  struct RowTask {
    int32_t seq, head, q_begin, q_end;
  };
  static constexpr int32_t kQueryChunk = 64;
  bool use_simd_;  // the AVX2 build (the CPU was checked)
  std::vector<RowTask> tasks_;
  std::vector<std::vector<float>> scratch_;  // per thread
};

}  // namespace
}  // namespace tessera

TESSERA_REGISTER_PLUGIN(tessera::NaiveAttention, tessera::AttentionKernel, "naive", "0.1.0",
                        "full score matrix per head; the reference other kernels are tested against",
                        tessera::kParams)
