// AVX2/FMA build of the element-wise kernels (see elementwise_impl.h). Only called after
// cpu_has_avx2(). Contraction stays off: every FMA here is one the portable build also does.
#if defined(__x86_64__) || defined(__i386__)
#include "tessera/sdk/kernels/fp_contract_off.h"

#include <immintrin.h>

#include "elementwise_impl.h"
#include "tessera/sdk/kernels/ggml_types.h"

namespace tessera::kernels {

void silu_mul_avx2(float* gate, const float* up, int64_t begin, int64_t end) {
  silu_mul_impl(gate, up, begin, end);
}

void rope_rows_avx2(const RopeRowsArgs& a, int64_t begin, int64_t end) {
  rope_rows_impl(a, begin, end);
}

double sum_exp_shifted_avx2(const float* x, int64_t n, float shift) {
  return sum_exp_shifted_impl(x, n, shift);
}

double exp_shifted_row_avx2(const float* x, float* out, int64_t n, float shift, float divisor) {
  return exp_shifted_row_impl(x, out, n, shift, divisor);
}

int64_t argmax_row_avx2(const float* x, int64_t n) { return argmax_impl(x, n); }

// vcvtps2ph with round-to-nearest-even gives fp32_to_fp16's bits for every non-NaN float
// (overflow to inf, subnormal halves, ties to even); a NaN keeps part of its payload there,
// where fp32_to_fp16 returns the canonical quiet NaN, so groups holding a NaN go the scalar way.
void fp32_to_fp16_row_f16c(const float* src, uint16_t* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(src + i);
    if (_mm256_movemask_ps(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)) != 0) {
      for (int k = 0; k < 8; ++k) dst[i + k] = fp32_to_fp16(src[i + k]);
      continue;
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  for (; i < n; ++i) dst[i] = fp32_to_fp16(src[i]);
}

}  // namespace tessera::kernels
#endif
