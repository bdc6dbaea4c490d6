// Activation-side helpers shared by the x86 interleaved kernels (interleaved_x86.inl, built
// for AVX2 and AVX-VNNI, and interleaved_avx512.cpp): the per-block scales of the quantized
// activation rows, computed once per call. Everything here has internal linkage on purpose:
// each including translation unit is compiled for a different instruction set, and one shared
// (inline, external) definition could let the linker hand an AVX-512 build to an AVX2 caller.
// Needs F16C and AVX2 (the least of those units' flags).
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <vector>

#include "quant_blocks.h"

namespace tessera::kernels {
namespace {

inline float x_scale(const BlockQ8_0& x) { return _cvtsh_ss(x.d); }
inline float x_scale(const BlockQ8_1& x) { return _cvtsh_ss(x.d); }
inline float x_scale(const BlockQ8_K& x) { return x.d; }

// Sum of the 32 quants of an activation block.
inline int32_t block_sum(const int8_t* qs) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs));
  const __m256i s32 = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), v),
                                        _mm256_set1_epi16(1));
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(s32), _mm256_extracti128_si256(s32, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

// Per activation block of one row, converted once per call: d_x; s_x (formats with a min) or
// the offset's whole term, offset * sum(x) (formats with an offset), so the block loop
// broadcasts it straight from memory.
struct XScales {
  const float* d;
  const float* s;
  const int32_t* sum;
};

// The scales of every block of x_rows activation rows, [row][block], reused across calls by
// the thread that owns it.
struct XScaleTables {
  std::vector<float> d, s;
  std::vector<int32_t> sums;

  template <class F>
  void fill(int64_t nb, const uint8_t* x, size_t x_stride, int64_t x_rows) {
    using XBlock = typename F::XBlock;
    const size_t n = static_cast<size_t>(nb * x_rows);
    if (d.size() < n) d.resize(n);
    if (F::kHasMin && s.size() < n) s.resize(n);
    if (F::kOffset != 0 && sums.size() < n) sums.resize(n);
    for (int64_t t = 0; t < x_rows; ++t) {
      const auto* xb = reinterpret_cast<const XBlock*>(x + t * x_stride);
      for (int64_t ib = 0; ib < nb; ++ib) {
        d[t * nb + ib] = x_scale(xb[ib]);
        if constexpr (F::kHasMin) s[t * nb + ib] = _cvtsh_ss(xb[ib].s);
        if constexpr (F::kOffset != 0) sums[t * nb + ib] = F::kOffset * block_sum(xb[ib].qs);
      }
    }
  }

  template <class F>
  XScales row(int64_t nb, int64_t t) const {
    const size_t at = static_cast<size_t>(t * nb);
    return {d.data() + at, F::kHasMin ? s.data() + at : nullptr,
            F::kOffset != 0 ? sums.data() + at : nullptr};
  }
};

}  // namespace
}  // namespace tessera::kernels
