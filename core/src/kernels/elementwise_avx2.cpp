// AVX2/FMA build of the element-wise kernels (see elementwise_impl.h). Only called after
// cpu_has_avx2(). Contraction stays off: every FMA here is one the portable build also does.
#if defined(__x86_64__) || defined(__i386__)
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include "elementwise_impl.h"

namespace tessera::kernels {

void silu_mul_avx2(float* gate, const float* up, int64_t begin, int64_t end) {
  silu_mul_impl(gate, up, begin, end);
}

void rope_rows_avx2(const RopeRowsArgs& a, int64_t begin, int64_t end) {
  rope_rows_impl(a, begin, end);
}

}  // namespace tessera::kernels
#endif
