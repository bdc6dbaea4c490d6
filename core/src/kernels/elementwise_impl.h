// The element-wise kernels' bodies, compiled twice: by elementwise.cpp (portable) and by
// elementwise_avx2.cpp (-mavx2 -mfma -mf16c). Each element sees the same operations in both.
#pragma once

#include <cmath>
#include <cstdint>

#include "tessera/sdk/kernels/cpu_kernels.h"
#include "tessera/sdk/kernels/ggml_simd.h"

namespace tessera::kernels {

inline void silu_mul_impl(float* gate, const float* up, int64_t begin, int64_t end) {
  int64_t i = begin;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (; i + 8 <= end; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 e = simd::ggml_v_expf(_mm256_xor_ps(g, sign));
    _mm256_storeu_ps(gate + i,
                     _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), _mm256_loadu_ps(up + i)));
  }
#endif
  for (; i < end; ++i) {
    const float g = gate[i];
    gate[i] = g / (1.0f + simd::ggml_expf_inline(-g)) * up[i];
  }
}

// Sum over i < n of exp((x[i] - shift) / divisor), and with kRow each term written to out[i]
// (without it, out is unused and there is no division: sum_exp_shifted).
template <bool kRow>
inline double exp_shifted_impl(const float* x, float* out, int64_t n, float shift, float divisor) {
  // Eight partial sums, lane l taking elements i with i % 8 == l, combined in a fixed tree:
  // the AVX2 build keeps them in two 4-wide double vectors, the portable one in an array.
  // The division is IEEE in both.
  double lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  auto term = [&](int64_t i) {
    const float e = simd::ggml_expf_inline(kRow ? (x[i] - shift) / divisor : x[i] - shift);
    if constexpr (kRow) out[i] = e;
    return static_cast<double>(e);
  };
  int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
  __m256d lo = _mm256_setzero_pd(), hi = _mm256_setzero_pd();
  const __m256 s = _mm256_set1_ps(shift), d = _mm256_set1_ps(divisor);
  for (; i + 8 <= n; i += 8) {
    __m256 arg = _mm256_sub_ps(_mm256_loadu_ps(x + i), s);
    if constexpr (kRow) arg = _mm256_div_ps(arg, d);
    const __m256 e = simd::ggml_v_expf(arg);
    if constexpr (kRow) _mm256_storeu_ps(out + i, e);
    lo = _mm256_add_pd(lo, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
    hi = _mm256_add_pd(hi, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
  }
  _mm256_storeu_pd(lanes, lo);
  _mm256_storeu_pd(lanes + 4, hi);
#else
  for (; i + 8 <= n; i += 8)
    for (int l = 0; l < 8; ++l) lanes[l] += term(i + l);
#endif
  double sum = ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
  for (; i < n; ++i) sum += term(i);
  return sum;
}

inline double sum_exp_shifted_impl(const float* x, int64_t n, float shift) {
  return exp_shifted_impl<false>(x, nullptr, n, shift, 1.0f);
}

inline double exp_shifted_row_impl(const float* x, float* out, int64_t n, float shift,
                                   float divisor) {
  return exp_shifted_impl<true>(x, out, n, shift, divisor);
}

// The index of the first greatest of x[0..n) (n > 0) under `<`, as std::max_element finds
// it: a NaN at x[0] is returned, NaNs after it are passed over. The AVX2 build takes the
// maximum 32 lanes at a time (max(x, acc) keeps acc where x is a NaN), then finds its first
// occurrence; equality treats -0 and +0 alike, as `<` does, so both builds pick the same index.
inline int64_t argmax_impl(const float* x, int64_t n) {
  if (n <= 1 || std::isnan(x[0])) return 0;
#if defined(__AVX2__) && defined(__FMA__)
  if (n >= 32) {
    __m256 acc[4];
    for (auto& a : acc) a = _mm256_set1_ps(x[0]);
    int64_t i = 0;
    for (; i + 32 <= n; i += 32)
      for (int k = 0; k < 4; ++k) acc[k] = _mm256_max_ps(_mm256_loadu_ps(x + i + 8 * k), acc[k]);
    const __m256 m8 = _mm256_max_ps(_mm256_max_ps(acc[0], acc[1]), _mm256_max_ps(acc[2], acc[3]));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    float best = _mm_cvtss_f32(m4);
    for (; i < n; ++i)
      if (best < x[i]) best = x[i];
    const __m256 b = _mm256_set1_ps(best);
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
      const int mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + j), b, _CMP_EQ_OQ));
      if (mask != 0) return j + __builtin_ctz(static_cast<unsigned>(mask));
    }
    for (; j < n; ++j)
      if (x[j] == best) return j;
  }
#endif
  int64_t best = 0;
  for (int64_t i = 1; i < n; ++i)
    if (x[best] < x[i]) best = i;
  return best;
}

inline void rope_rows_impl(const RopeRowsArgs& p, int64_t begin, int64_t end) {
  const int32_t head_dim = p.head_dim;
  const int32_t rot = p.rotary_dim;
  for (int64_t r = begin; r < end; ++r) {
    float* row = p.x + r * p.num_heads * head_dim;
    float theta = static_cast<float>(p.positions[r]) * p.freq_scale;
    for (int32_t i0 = 0; i0 < rot; i0 += 2) {
      const float c = std::cos(theta);
      const float s = std::sin(theta);
      theta *= p.theta_scale;
      // Adjacent pairs (GGUF Llama) or the two halves (NeoX/Qwen2 style).
      const int32_t a = p.neox ? i0 / 2 : i0;
      const int32_t b = p.neox ? i0 / 2 + rot / 2 : i0 + 1;
      for (int32_t h = 0; h < p.num_heads; ++h) {
        float* v = row + h * head_dim;
        const float x0 = v[a];
        const float x1 = v[b];
        // Contracted exactly as GCC compiles ggml's rotate_pairs (x0*c - x1*s becomes
        // fma(x0, c, -(x1*s))), so rotated values match llama.cpp's to the last bit.
        v[a] = std::fma(x0, c, -(x1 * s));
        v[b] = std::fma(x0, s, x1 * c);
      }
    }
  }
}

}  // namespace tessera::kernels
