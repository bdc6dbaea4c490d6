// AVX2 build of the logit mask (logit_mask.h): eight tokens per blend. Only called after
// cpu_has_avx2().
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#include "logit_mask.h"

namespace tessera::kernels {

bool apply_logit_mask_avx2(const uint32_t* allowed, float* row, int32_t vocab) {
  const __m256i lane_bits = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const __m256 negative_infinity = _mm256_set1_ps(-__builtin_inff());
  uint32_t seen = 0;
  const int32_t full = vocab / 32 * 32;
  for (int32_t base = 0; base < full; base += 32) {
    const uint32_t word = allowed[static_cast<size_t>(base) >> 5];
    seen |= word;
    if (word == ~0u) continue;
    for (int g = 0; g < 4; ++g) {
      // Lane l keeps its logit when bit 8g + l is set.
      const __m256i byte = _mm256_set1_epi32(static_cast<int>((word >> (8 * g)) & 0xffu));
      const __m256 keep = _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(byte, lane_bits), lane_bits));
      float* x = row + base + 8 * g;
      _mm256_storeu_ps(x, _mm256_blendv_ps(negative_infinity, _mm256_loadu_ps(x), keep));
    }
  }
  bool any = seen != 0;
  if (full < vocab) any |= apply_logit_mask_scalar(allowed + full / 32, row + full, vocab - full);
  return any;
}

}  // namespace tessera::kernels
#endif
