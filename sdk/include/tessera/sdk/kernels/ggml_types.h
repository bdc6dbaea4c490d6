// GGML tensor types: their block layouts, reference (scalar) quantize/dequantize, and the
// dot products the matmul kernels are built from. The numerics follow ggml's reference
// implementation so that logits match llama.cpp: activations are quantized to the weight
// type's "vec dot type" (Q8_0 for Q4_0/Q8_0, Q8_1 for Q4_1, F16 for F16) before the dot.
#pragma once

#include "tessera/sdk/kernels/version.h"

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace tessera {

enum class GgmlType : uint32_t {
  F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q8_1 = 9,
  Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14, Q8_K = 15, BF16 = 30,
};

struct GgmlTypeTraits {
  const char* name;
  int64_t block_size;   // elements per block
  size_t type_size;     // bytes per block
  bool is_known;        // false for ids this build has no layout for
};

// Traits for any id; unknown ids return {"unknown", 0, 0, false}.
GgmlTypeTraits ggml_type_traits(GgmlType type);
const char* ggml_type_name(GgmlType type);
bool ggml_type_is_known(uint32_t raw_type);
// Bytes of one row of n elements; n must be a multiple of the block size.
size_t ggml_row_size(GgmlType type, int64_t n);

// IEEE half <-> float, round-to-nearest-even like ggml's.
float fp16_to_fp32(uint16_t h);
uint16_t fp32_to_fp16(float f);

// Reference conversions. Supported: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q8_1, Q8_K,
// Q4_K, Q5_K, Q6_K. Return false for a type they do not support. n is a multiple of the block size.
// Each writes the bytes of ggml's quantize_row_*_ref (what llama-quantize writes without an
// importance matrix).
bool dequantize_row(GgmlType type, const void* src, float* dst, int64_t n);
bool quantize_row(GgmlType type, const float* src, void* dst, int64_t n);
// One weight row as llama-quantize's ggml_quantize_chunk writes it: `importance` is null or
// n values (an imatrix row: per column, the mean squared activation it multiplies) that weight
// each element's error in the scale search of ggml's quantize_row_*_impl (Q4_0, Q4_1, Q5_0,
// Q5_1, Q4_K, Q5_K, Q6_K; Q8_0 and the float types ignore it). With null it equals quantize_row.
bool quantize_weight_row(GgmlType type, const float* src, void* dst, int64_t n,
                         const float* importance);

// Converts an activation row to a dot type (Q8_0, Q8_1, Q8_K, F16, F32) the way llama.cpp's CPU
// backend does at run time on x86 (its SIMD from_float): for Q8_x the inverse scale is
// 127/amax and values round half to even, which differs from quantize_row's reference
// rounding in the last bit of some elements. Matching it keeps logits close to llama.cpp's.
bool quantize_activation_row(GgmlType type, const float* src, void* dst, int64_t n);
// The portable version the AVX2 one (used by quantize_activation_row when the CPU has it) is
// tested against; both write the same bytes.
bool quantize_activation_row_scalar(GgmlType type, const float* src, void* dst, int64_t n);

// exp(x) as llama.cpp's x86 CPU backend computes it in softmax and SiLU (a vectorized
// polynomial within 1.5 ulp + 0.5 of expf), evaluated per element. See ggml_math.cpp.
float ggml_expf(float x);

// The type activations are converted to before a dot product with a weight row of `type`.
GgmlType vec_dot_type(GgmlType weight_type);
// True when vec_dot supports this weight type.
bool has_vec_dot(GgmlType weight_type);
// dot(weight_row, x) over n elements, where x is already in vec_dot_type(weight_type).
// Dispatches at run time to the fastest implementation for this CPU (AVX2/FMA or scalar).
float vec_dot(GgmlType weight_type, int64_t n, const void* weight_row, const void* x);
// The scalar reference the SIMD paths are tested against.
float vec_dot_scalar(GgmlType weight_type, int64_t n, const void* weight_row, const void* x);
// A tile of dots: y[t * y_stride + r] = vec_dot(weight row r, activation row t) for
// r < w_rows, t < x_rows, rows w_stride / x_stride bytes apart. Each element is bit-identical
// to vec_dot of the same pair (the tile only shares loads and scale conversions between
// elements), so a matmul may use any tiling without changing its results.
void vec_dot_tile(GgmlType weight_type, int64_t n, const void* w, size_t w_stride, int64_t w_rows,
                  const void* x, size_t x_stride, int64_t x_rows, float* y, int64_t y_stride);
// The same over vec_dot_scalar, element by element.
void vec_dot_tile_scalar(GgmlType weight_type, int64_t n, const void* w, size_t w_stride,
                         int64_t w_rows, const void* x, size_t x_stride, int64_t x_rows, float* y,
                         int64_t y_stride);
// True when the running CPU has AVX2+FMA+F16C and the SIMD kernels are compiled in.
bool cpu_has_avx2();
// True when cpu_has_avx2() and the CPU also has AVX-VNNI (vpdpbusd on 256-bit vectors), unless
// the environment sets TESSERA_NO_AVX_VNNI (kernels 1.3).
bool cpu_has_avx_vnni();
// True when cpu_has_avx2() and the CPU has AVX-512 F, BW and VL with the OS saving the 512-bit
// and opmask registers, unless the environment sets TESSERA_NO_AVX512 (kernels 1.7; the
// attention.flash plugin picks its AVX-512 build with it).
bool cpu_has_avx512();

}  // namespace tessera
