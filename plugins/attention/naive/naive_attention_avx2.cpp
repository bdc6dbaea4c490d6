// attention.naive's per-head kernel compiled with -mavx2 -mfma -mf16c (see CMakeLists.txt),
// reached only after cpu_has_avx2(). It keeps every reduction order of the portable kernel:
//  - Q.K: four 8-lane FMA accumulators over 32-element steps, folded (0+2, 1+3, 0+1), then
//    lanes summed pairwise — the portable dot_four_accumulators, one vector per accumulator;
//  - softmax: ggml's exp 8 positions at a time (simd::ggml_v_expf, the same per-lane
//    operations as ggml_expf), each group summed across lanes in sum_lanes order into a double;
//  - P.V: one 8-lane accumulator per output element with lane = position mod 8, positions in
//    increasing order. V is transposed into groups of 8 positions so one FMA advances all 8
//    lanes. Positions a query cannot see have probability 0 and add nothing (fma(0, v, acc)
//    returns acc), so they are skipped group-wise as the portable kernel skips them one by one.
#if defined(__x86_64__) || defined(__i386__)
#include "tessera/sdk/kernels/fp_contract_off.h"

#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <limits>

#include "naive_kernel.h"
#include "tessera/sdk/kernels/ggml_simd.h"
#include "tessera/sdk/kv_rows.h"

namespace tessera::naive {

namespace {

inline float dot_four_accumulators(const float* x, const float* y, int32_t n) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(),
         a3 = _mm256_setzero_ps();
  for (int32_t i = 0; i < n; i += 32) {
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i), a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 8), _mm256_loadu_ps(y + i + 8), a1);
    a2 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 16), _mm256_loadu_ps(y + i + 16), a2);
    a3 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 24), _mm256_loadu_ps(y + i + 24), a3);
  }
  a0 = _mm256_add_ps(a0, a2);
  a1 = _mm256_add_ps(a1, a3);
  a0 = _mm256_add_ps(a0, a1);
  const __m128 t = _mm_add_ps(_mm256_castps256_ps128(a0), _mm256_extractf128_ps(a0, 1));
  const __m128 h = _mm_hadd_ps(t, t);
  return _mm_cvtss_f32(_mm_hadd_ps(h, h));
}

// Rounds 8 floats to the f16 cache precision and back (round to nearest even, as fp32_to_fp16).
inline __m256 round_to_half(__m256 v) {
  return _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}

}  // namespace

void run_rows_avx2(const AttentionShape& s, const AttentionBatch& batch,
                   const AttentionSequence& seq, int32_t head, int32_t q_begin, int32_t q_end,
                   std::vector<float>& scratch) {
  const int32_t d = s.head_dim;
  const int32_t nq = seq.num_queries;
  const int32_t ctx = seq.context_len;
  const int32_t kv_head = head / (s.num_heads / s.num_kv_heads);
  const int32_t rows = q_end - q_begin;
  // Positions [0, visible) are seen by at least one of these rows; the rest are masked.
  const int32_t visible = ctx - nq + q_end;
  const int32_t padded = (visible + 7) & ~7;
  const size_t needed = 2 * static_cast<size_t>(padded) * d + static_cast<size_t>(rows) * padded + d;
  ensure_scratch(scratch, needed);
  float* keys = scratch.data();                                   // [visible][d]
  float* vt = keys + static_cast<size_t>(padded) * d;             // [padded/8][d][8]
  float* scores = vt + static_cast<size_t>(padded) * d;           // [rows][padded]
  float* qr = scores + static_cast<size_t>(rows) * padded;        // [d]
  const bool q_half = s.k_dtype == KvDtype::kF16;  // Q meets K at K's precision
  const bool p_half = s.v_dtype == KvDtype::kF16;  // P meets V at V's precision
  const int64_t q_stride = static_cast<int64_t>(s.num_heads) * d;

  // Gather this KV head's K rows and V (transposed in groups of 8 positions), widened to float
  // (exactly, whatever the pools' dtypes: tessera/sdk/kv_rows.h).
  float* vtmp = qr;  // a widened V row; qr is free until the queries are rounded
  for (int32_t j = 0; j < visible; ++j) {
    const int64_t slot = static_cast<int64_t>(seq.block_table[j / s.block_size]) * s.block_size +
                         j % s.block_size;
    float* krow = keys + static_cast<size_t>(j) * d;
    float* vcol = vt + (static_cast<size_t>(j / 8) * d) * 8 + j % 8;
    widen_kv_row(s.k_dtype,
                 static_cast<const uint8_t*>(batch.k_pool) + kv_row_offset(s.k_dtype, slot, s.num_kv_heads, kv_head, d),
                 krow, d);
    widen_kv_row(s.v_dtype,
                 static_cast<const uint8_t*>(batch.v_pool) + kv_row_offset(s.v_dtype, slot, s.num_kv_heads, kv_head, d),
                 vtmp, d);
    for (int32_t k = 0; k < d; ++k) vcol[k * 8] = vtmp[k];
  }
  for (int32_t j = visible; j < padded; ++j) {
    float* vcol = vt + (static_cast<size_t>(j / 8) * d) * 8 + j % 8;
    for (int32_t k = 0; k < d; ++k) vcol[k * 8] = 0.0f;
  }

  const __m256 neg_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int32_t i = 0; i < rows; ++i) {
    const int32_t qi = q_begin + i;
    const int32_t last = ctx - nq + qi;  // last visible position of this row
    const int32_t groups = last / 8 + 1;
    float* srow = scores + static_cast<size_t>(i) * padded;
    const float* q = batch.q + (seq.query_start + qi) * q_stride + head * d;
    for (int32_t k = 0; k < d; k += 8) {
      const __m256 v = _mm256_loadu_ps(q + k);
      _mm256_storeu_ps(qr + k, q_half ? round_to_half(v) : v);
    }
    // S = scale * Q K^T over the visible positions; those before a sliding window are masked
    // like the future ones (-inf, so exactly 0 after the softmax).
    float max = -std::numeric_limits<float>::infinity();
    const int32_t first = attention_window_begin(s, last);
    for (int32_t j = 0; j < first; ++j) srow[j] = -std::numeric_limits<float>::infinity();
    for (int32_t j = first; j <= last; ++j) {
      const float v = dot_four_accumulators(keys + static_cast<size_t>(j) * d, qr, d) * s.scale;
      srow[j] = v;
      max = std::max(max, v);
    }
    // Softmax in groups of 8 positions; masked positions (and the padding) are exactly 0.
    double sum = 0.0;
    for (int32_t g = 0; g < groups; ++g) {
      const int32_t j0 = g * 8;
      const int32_t valid = std::min(8, last + 1 - j0);
      __m256 x = _mm256_loadu_ps(srow + j0);
      if (valid < 8) {
        const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        const __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(valid), lane));
        x = _mm256_blendv_ps(neg_inf, x, keep);
      }
      const __m256 e = simd::ggml_v_expf(_mm256_sub_ps(x, _mm256_set1_ps(max)));
      _mm256_storeu_ps(srow + j0, e);
      sum += static_cast<double>(simd::hsum_float_8(e));
    }
    const __m256 inv = _mm256_set1_ps(static_cast<float>(1.0 / sum));
    for (int32_t g = 0; g < groups; ++g) {
      const __m256 p = _mm256_mul_ps(_mm256_loadu_ps(srow + g * 8), inv);
      _mm256_storeu_ps(srow + g * 8, p_half ? round_to_half(p) : p);
    }
    // O = P V: 8 output elements at a time, each with its own 8-lane accumulator.
    float* o = batch.out + (seq.query_start + qi) * q_stride + head * d;
    for (int32_t k0 = 0; k0 < d; k0 += 8) {
      __m256 acc[8];
      for (int m = 0; m < 8; ++m) acc[m] = _mm256_setzero_ps();
      for (int32_t g = 0; g < groups; ++g) {
        const __m256 p = _mm256_loadu_ps(srow + g * 8);
        const float* vg = vt + (static_cast<size_t>(g) * d + k0) * 8;
        for (int m = 0; m < 8; ++m) acc[m] = _mm256_fmadd_ps(p, _mm256_loadu_ps(vg + m * 8), acc[m]);
      }
      for (int m = 0; m < 8; ++m) o[k0 + m] = simd::hsum_float_8(acc[m]);
    }
  }
}

}  // namespace tessera::naive
#endif
