// Portable build of the element-wise kernels and their run-time dispatch.
#include "tessera/sdk/kernels/fp_contract_off.h"

#include <array>
#include <cmath>

#include "elementwise_impl.h"
#include "tessera/sdk/kernels/ggml_types.h"

namespace tessera {

namespace kernels {
void silu_mul_avx2(float* gate, const float* up, int64_t begin, int64_t end);
void rope_rows_avx2(const RopeRowsArgs& a, int64_t begin, int64_t end);
void fp32_to_fp16_row_f16c(const float* src, uint16_t* dst, int64_t n);
double sum_exp_shifted_avx2(const float* x, int64_t n, float shift);
double exp_shifted_row_avx2(const float* x, float* out, int64_t n, float shift, float divisor);
int64_t argmax_row_avx2(const float* x, int64_t n);
}  // namespace kernels

void silu_mul_range_scalar(float* gate, const float* up, int64_t begin, int64_t end) {
  kernels::silu_mul_impl(gate, up, begin, end);
}

void rope_rows_scalar(const RopeRowsArgs& a, int64_t begin, int64_t end) {
  kernels::rope_rows_impl(a, begin, end);
}

uint16_t gelu_f16_table_entry(uint16_t half_bits) {
  // ggml_gelu_f32: 0.5f*x*(1.0f + tanhf(SQRT_2_OVER_PI*x*(1.0f + GELU_COEF_A*x*x))), as GCC
  // compiles it for ggml's -march=native build: the inner 1 + (a*x)*x contracted into an FMA.
  constexpr float kCoefA = 0.044715f;
  constexpr float kSqrt2OverPi = 0.79788456080286535587989211986876f;
  const float x = fp16_to_fp32(half_bits);
  const float inner = std::fma(kCoefA * x, x, 1.0f);
  return fp32_to_fp16(0.5f * x * (1.0f + std::tanh(kSqrt2OverPi * x * inner)));
}

namespace {
const std::array<uint16_t, 65536>& gelu_table() {
  static const std::array<uint16_t, 65536> table = [] {
    std::array<uint16_t, 65536> t{};
    for (uint32_t i = 0; i < t.size(); ++i) t[i] = gelu_f16_table_entry(static_cast<uint16_t>(i));
    return t;
  }();
  return table;
}
}  // namespace

void gelu_mul_range(float* gate, const float* up, int64_t begin, int64_t end) {
  const std::array<uint16_t, 65536>& table = gelu_table();
  for (int64_t i = begin; i < end; ++i) {
    const float x = gate[i];
    if (x <= -10.0f) {
      gate[i] = 0.0f;
    } else if (x >= 10.0f) {
      gate[i] = x * up[i];
    } else {
      gate[i] = fp16_to_fp32(table[fp32_to_fp16(x)]) * up[i];
    }
  }
}

void silu_mul_range(float* gate, const float* up, int64_t begin, int64_t end) {
#if defined(__x86_64__) || defined(__i386__)
  if (cpu_has_avx2()) return kernels::silu_mul_avx2(gate, up, begin, end);
#endif
  silu_mul_range_scalar(gate, up, begin, end);
}

void rope_rows(const RopeRowsArgs& a, int64_t begin, int64_t end) {
#if defined(__x86_64__) || defined(__i386__)
  if (cpu_has_avx2()) return kernels::rope_rows_avx2(a, begin, end);
#endif
  rope_rows_scalar(a, begin, end);
}

double sum_exp_shifted_scalar(const float* x, int64_t n, float shift) {
  return kernels::sum_exp_shifted_impl(x, n, shift);
}

double sum_exp_shifted(const float* x, int64_t n, float shift) {
#if defined(__x86_64__) || defined(__i386__)
  if (cpu_has_avx2()) return kernels::sum_exp_shifted_avx2(x, n, shift);
#endif
  return sum_exp_shifted_scalar(x, n, shift);
}

double exp_shifted_row_scalar(const float* x, float* out, int64_t n, float shift, float divisor) {
  return kernels::exp_shifted_row_impl(x, out, n, shift, divisor);
}

double exp_shifted_row(const float* x, float* out, int64_t n, float shift, float divisor) {
#if defined(__x86_64__) || defined(__i386__)
  if (cpu_has_avx2()) return kernels::exp_shifted_row_avx2(x, out, n, shift, divisor);
#endif
  return exp_shifted_row_scalar(x, out, n, shift, divisor);
}

int64_t argmax_row_scalar(const float* x, int64_t n) { return kernels::argmax_impl(x, n); }

int64_t argmax_row(const float* x, int64_t n) {
#if defined(__x86_64__) || defined(__i386__)
  if (cpu_has_avx2()) return kernels::argmax_row_avx2(x, n);
#endif
  return argmax_row_scalar(x, n);
}

void fp32_to_fp16_row(const float* src, uint16_t* dst, int64_t n) {
#if defined(__x86_64__) || defined(__i386__)
  if (cpu_has_avx2()) return kernels::fp32_to_fp16_row_f16c(src, dst, n);
#endif
  for (int64_t i = 0; i < n; ++i) dst[i] = fp32_to_fp16(src[i]);
}

}  // namespace tessera
