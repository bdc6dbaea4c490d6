// Element-wise CPU kernels of the forward pass with run-time dispatch: an AVX2/FMA build when
// the CPU has it (cpu_has_avx2()), else the portable build. Both builds give the same bits for
// every element (the AVX2 one only evaluates the same per-element operations 8 lanes at a
// time, with hardware FMA instead of libm's fma()), which tests/unit/test_ggml_math.cpp checks.
#pragma once

#include "tessera/sdk/kernels/version.h"

#include <cstdint>

namespace tessera {

// gate[i] = silu(gate[i]) * up[i] for i in [begin, end), with ggml's exp.
void silu_mul_range(float* gate, const float* up, int64_t begin, int64_t end);
void silu_mul_range_scalar(float* gate, const float* up, int64_t begin, int64_t end);

// gate[i] = gelu(gate[i]) * up[i] for i in [begin, end), GELU in its tanh form evaluated as
// ggml's CPU build does (GGML_GELU_FP16): gate rounded to f16 and looked up in a table of
// f16(gelu(x)) over all 65,536 halves; gelu(x) = 0 for x <= -10 and x for x >= 10.
void gelu_mul_range(float* gate, const float* up, int64_t begin, int64_t end);
// The table entry for one f16 input (bits): what ggml_table_gelu_f16 holds.
uint16_t gelu_f16_table_entry(uint16_t half_bits);

// Rotary embedding of rows [begin, end) of x (each num_heads * head_dim floats), as
// CpuBackend::rope describes.
struct RopeRowsArgs {
  float* x;
  const int32_t* positions;
  int32_t num_heads;
  int32_t head_dim;
  int32_t rotary_dim;
  bool neox;
  float freq_scale;
  float theta_scale;
};
// dst[i] = fp32_to_fp16(src[i]) for i < n (round to nearest even, NaN -> canonical quiet
// NaN): the F16C instruction where the CPU has it, bit-identical to the scalar conversion.
void fp32_to_fp16_row(const float* src, uint16_t* dst, int64_t n);
// Sum over i < n of exp(x[i] - shift), with ggml's exp (within 1.5 ulp of expf), summed in
// double: a softmax normalizer, e.g. over a whole vocabulary of logits. Both builds give the
// same bits.
double sum_exp_shifted(const float* x, int64_t n, float shift);
double sum_exp_shifted_scalar(const float* x, int64_t n, float shift);
// out[i] = exp((x[i] - shift) / divisor) for i < n, with ggml's exp, and their sum in double
// in sum_exp_shifted's order: the unnormalized softmax of a row at temperature `divisor`
// (kernels 1.5). Both builds give the same bits.
double exp_shifted_row(const float* x, float* out, int64_t n, float shift, float divisor);
double exp_shifted_row_scalar(const float* x, float* out, int64_t n, float shift, float divisor);
// The index of the first greatest of x[0..n) (n > 0), exactly what std::max_element returns
// (a NaN at x[0] is returned, NaNs after it are passed over): a greedy token without a scalar
// pass over the vocabulary (kernels 1.6). Both builds return the same index.
int64_t argmax_row(const float* x, int64_t n);
int64_t argmax_row_scalar(const float* x, int64_t n);
void rope_rows(const RopeRowsArgs& a, int64_t begin, int64_t end);
void rope_rows_scalar(const RopeRowsArgs& a, int64_t begin, int64_t end);

}  // namespace tessera
