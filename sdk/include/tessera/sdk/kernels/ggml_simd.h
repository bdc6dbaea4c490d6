// Inline forms of ggml's element-wise numerics for kernels that want them without a call:
// the scalar exp of ggml_math.cpp (so a TU compiled with -mfma gets hardware FMAs instead of
// libm's fma()), and, in TUs compiled with AVX2+FMA, its 8-lane form. Both perform per lane
// exactly the operations of ggml_expf, so they return the same bits for every input.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace tessera::simd {

inline float ggml_expf_inline(float x) {
  auto bits_of = [](float f) {
    uint32_t u;
    std::memcpy(&u, &f, sizeof u);
    return u;
  };
  auto float_of = [](uint32_t u) {
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
  };
  const float shift = 0x1.8p23f;                     // rounds x / ln 2 to an integer n
  const float z = std::fma(x, 0x1.715476p+0f, shift);
  const float n = z - shift;
  // b = x - n ln 2, with ln 2 split in two parts for accuracy.
  const float b = std::fma(-n, 0x1.7f7d1cp-20f, std::fma(-n, 0x1.62e4p-1f, x));
  const uint32_t e = bits_of(z) << 23;               // n in the exponent field
  const float k = float_of(e + bits_of(1.0f));       // 2^n
  const float u = b * b;
  const float j = std::fma(std::fma(std::fma(0x1.0e4020p-7f, b, 0x1.573e2ep-5f), u,
                                    std::fma(0x1.555e66p-3f, b, 0x1.fffdb6p-2f)),
                           u, 0x1.ffffecp-1f * b);   // 2^(b / ln 2) - 1
  if (!(std::fabs(n) > 126.0f)) return std::fma(k, j, k);
  // Large |n|: scale in two steps so 2^n does not overflow or flush early.
  const uint32_t g = n <= 0.0f ? 0x82000000u : 0u;
  const float s1 = float_of(g + 0x7f000000u);
  const float s2 = float_of(e - g);
  if (std::fabs(n) > 192.0f) return s1 * s1;
  return std::fma(s2, j, s2) * s1;
}

#if defined(__AVX2__) && defined(__FMA__)

// ggml_expf on 8 lanes (the same operations as ggml's ggml_v_expf on AVX2).
inline __m256 ggml_v_expf(__m256 x) {
  const __m256 shift = _mm256_set1_ps(0x1.8p23f);
  const __m256 z = _mm256_fmadd_ps(x, _mm256_set1_ps(0x1.715476p+0f), shift);
  const __m256 n = _mm256_sub_ps(z, shift);
  const __m256 neg_n = _mm256_xor_ps(n, _mm256_set1_ps(-0.0f));
  const __m256 b = _mm256_fmadd_ps(neg_n, _mm256_set1_ps(0x1.7f7d1cp-20f),
                                   _mm256_fmadd_ps(neg_n, _mm256_set1_ps(0x1.62e4p-1f), x));
  const __m256i e = _mm256_slli_epi32(_mm256_castps_si256(z), 23);
  const __m256 k = _mm256_castsi256_ps(_mm256_add_epi32(e, _mm256_castps_si256(_mm256_set1_ps(1.0f))));
  const __m256 u = _mm256_mul_ps(b, b);
  const __m256 j = _mm256_fmadd_ps(
      _mm256_fmadd_ps(_mm256_fmadd_ps(_mm256_set1_ps(0x1.0e4020p-7f), b, _mm256_set1_ps(0x1.573e2ep-5f)), u,
                      _mm256_fmadd_ps(_mm256_set1_ps(0x1.555e66p-3f), b, _mm256_set1_ps(0x1.fffdb6p-2f))),
      u, _mm256_mul_ps(_mm256_set1_ps(0x1.ffffecp-1f), b));
  const __m256 abs_n = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), n);
  const __m256 big = _mm256_cmp_ps(abs_n, _mm256_set1_ps(126.0f), _CMP_GT_OQ);
  const __m256 normal = _mm256_fmadd_ps(k, j, k);
  if (_mm256_movemask_ps(big) == 0) return normal;
  const __m256i g = _mm256_and_si256(
      _mm256_castps_si256(_mm256_cmp_ps(n, _mm256_setzero_ps(), _CMP_LE_OQ)),
      _mm256_set1_epi32(static_cast<int>(0x82000000u)));
  const __m256 s1 = _mm256_castsi256_ps(_mm256_add_epi32(g, _mm256_set1_epi32(0x7f000000)));
  const __m256 s2 = _mm256_castsi256_ps(_mm256_sub_epi32(e, g));
  const __m256 huge = _mm256_cmp_ps(abs_n, _mm256_set1_ps(192.0f), _CMP_GT_OQ);
  const __m256 scaled = _mm256_blendv_ps(_mm256_mul_ps(_mm256_fmadd_ps(s2, j, s2), s1),
                                         _mm256_mul_ps(s1, s1), huge);
  return _mm256_blendv_ps(normal, scaled, big);
}

// Sum of 8 lanes in ggml's hsum_float_8 order: high + low lane, then movehl, then movehdup.
inline float hsum_float_8(__m256 x) {
  __m128 res = _mm256_extractf128_ps(x, 1);
  res = _mm_add_ps(res, _mm256_castps256_ps128(x));
  res = _mm_add_ps(res, _mm_movehl_ps(res, res));
  res = _mm_add_ss(res, _mm_movehdup_ps(res));
  return _mm_cvtss_f32(res);
}

#endif

}  // namespace tessera::simd
