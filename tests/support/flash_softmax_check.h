// Entry points into attention.flash's inner-kernel helpers for tests/unit/test_flash_softmax.cpp.
// Included by that test (portable build) and by flash_softmax_avx2.cpp (compiled with the
// kernel's -mavx2 -mfma -mf16c), each with its own FLASH_CHECK_NS, so one test binary holds
// both builds of flash_kernel_impl.h (whose helpers have internal linkage) and can compare
// their bits.
#pragma once

#include <cstdint>
#include <cstring>

#include "flash_kernel_impl.h"

#ifndef FLASH_CHECK_NS
#error "define FLASH_CHECK_NS before including flash_softmax_check.h"
#endif

namespace FLASH_CHECK_NS {

bool built_for_avx2() {
#if TESSERA_FLASH_AVX2
  return true;
#else
  return false;
#endif
}

// flash's scalar exp (the one alpha uses, and the vector tail's).
float exp_one(float x) { return tessera::flash::exp1(x); }

// out[c] = exp(in[c] - max) through flash's row function (vector lanes + scalar tail); returns
// the row's double sum.
double exp_row(const float* in, float* out, int32_t n, float max) {
  std::memcpy(out, in, sizeof(float) * n);
  return tessera::flash::exp_sum_row(out, n, max);
}

float max_row(const float* in, int32_t n) { return tessera::flash::row_max(in, n); }

}  // namespace FLASH_CHECK_NS
