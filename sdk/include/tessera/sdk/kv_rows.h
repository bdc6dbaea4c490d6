// Reading KV pools in every KvDtype (tessera/sdk/types.h): where a row lies and how it widens
// to floats. Header-only, for attention kernels in and out of tree.
//
// Widening is exact for every dtype: an f16 element is a float, and a Q8_0 element d * q (an
// 11-bit half significand times a 7-bit integer) needs at most 18 significand bits, so the
// one float multiply never rounds. The portable and the AVX2/F16C versions (chosen by the
// including file's target flags) therefore write the same bits, and a kernel over a Q8_0 pool
// computes exactly what it computes over an f32 pool holding the dequantized values.
//
// The two versions live in differently named inline namespaces, so a plugin may include this
// header both from portable files and from files built with -mavx2 -mf16c without the linker
// merging the two (an ODR clash that could run AVX2 code on a CPU without it).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "tessera/sdk/types.h"

#if defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
#define TESSERA_KV_ROWS_AVX2 1
#else
#define TESSERA_KV_ROWS_AVX2 0
#endif

namespace tessera {
#if TESSERA_KV_ROWS_AVX2
inline namespace kv_rows_avx2 {
#else
inline namespace kv_rows_portable {
#endif

// IEEE half -> float (exact; subnormals, infinities and NaNs included).
inline float kv_half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal half: a normal float
      uint32_t e = 113;  // 127 - 15 + 1, decremented per shift
      do {
        --e;
        mant <<= 1;
      } while ((mant & 0x400u) == 0);
      bits = sign | (e << 23) | ((mant & 0x3ffu) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Byte offset of the row of KV head `kv_head` at token slot `slot` (block * block_size +
// offset in block) in a pool of `dtype` rows of head_dim elements.
inline size_t kv_row_offset(KvDtype dtype, int64_t slot, int32_t num_kv_heads, int32_t kv_head,
                            int32_t head_dim) {
  return (static_cast<size_t>(slot) * static_cast<size_t>(num_kv_heads) + static_cast<size_t>(kv_head)) *
         kv_row_bytes(dtype, head_dim);
}

// out[0..n) = the n elements at `row` (one head's row, or several heads' rows back to back:
// n a multiple of 32 for kQ8_0) as floats.
inline void widen_kv_row(KvDtype dtype, const void* row, float* out, int32_t n) {
  int32_t i = 0;
  switch (dtype) {
    case KvDtype::kF32:
      std::memcpy(out, row, static_cast<size_t>(n) * sizeof(float));
      return;
    case KvDtype::kF16: {
      const auto* h = static_cast<const uint16_t*>(row);
#if TESSERA_KV_ROWS_AVX2
      for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i))));
#endif
      for (; i < n; ++i) out[i] = kv_half_to_float(h[i]);
      return;
    }
    case KvDtype::kQ8_0: {
      const auto* b = static_cast<const KvBlockQ8_0*>(row);
      for (; i < n; i += kKvQ8BlockElems, ++b) {
        const float d = kv_half_to_float(b->d);
#if TESSERA_KV_ROWS_AVX2
        const __m256 vd = _mm256_set1_ps(d);
        for (int j = 0; j < kKvQ8BlockElems; j += 8) {
          const __m128i q8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b->qs + j));
          _mm256_storeu_ps(out + i + j, _mm256_mul_ps(vd, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8))));
        }
#else
        for (int j = 0; j < kKvQ8BlockElems; ++j) out[i + j] = d * static_cast<float>(b->qs[j]);
#endif
      }
      return;
    }
  }
}

}  // namespace kv_rows_*
}  // namespace tessera
