// Weights interleaved 8 rows at a time (Q4_1, and Q4_0, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K below), and the
// matmul kernels over that layout.
//
// GGML's row-major Q4_1 blocks are dotted one (row, token) pair at a time: every block pair
// costs an integer dot, its horizontal reduction, a float conversion and an FMA (ggml's
// vec_dot order, which quantizer.gguf keeps so logits equal llama.cpp's bit for bit). With the
// blocks of 8 rows interleaved 4 bytes at a time, one 256-bit integer dot against a broadcast
// activation word yields partial sums for 8 rows in 8 lanes, so a block's integer sum is
// accumulated vertically, exactly, and converted and scaled once per 8 rows: about half the
// vector instructions per block pair.
//
// The result of each output element is fixed by this order, whatever the batch or tiling:
//   acc = 0
//   for each block b:  isum = sum of q_w * q_x over the 32 elements (exact, int32)
//                      acc  = fma(d_w * d_x, float(isum), acc)
//                      acc  = fma(m_w, s_x, acc)
// where d_w, m_w are the weight block's fp16 scale and min, d_x, s_x the Q8_1 activation
// block's fp16 scale and scaled sum. It differs from ggml's order only in rounding (the block
// sums are exact rather than summed in 8 float lanes), so logits stay within rounding noise
// of llama.cpp's rather than equal to them.
#pragma once

#include <cstddef>
#include <cstdint>

#include "tessera/sdk/kernels/ggml_types.h"

namespace tessera {

// Rows per interleaved group; a matrix is padded with zero rows up to a multiple of this.
inline constexpr int64_t kInterleaveRows = 8;

// Bytes of a rows x cols Q4_1 matrix in the interleaved layout (cols a multiple of 32).
size_t interleaved_q4_1_size(int64_t rows, int64_t cols);
// Bytes of one group of 8 rows.
size_t interleaved_q4_1_group_size(int64_t cols);

// GGUF Q4_1 rows (src, row-major blocks) -> the interleaved layout (dst, interleaved_q4_1_size
// bytes). The layout of one group, per block index b: the 8 rows' fp16 scales, their 8 fp16
// mins, then 128 bytes of quants in 4 chunks of 32, where byte 4*j + i of chunk k is byte
// 4*k + i of row j's qs (element 4k+i in the low nibble, element 16+4k+i in the high one).
void interleave_q4_1(const void* src, int64_t rows, int64_t cols, void* dst);
// Row `row` of an interleaved matrix back in GGUF Q4_1 blocks (ggml_row_size(Q4_1, cols)
// bytes): embedding lookups and tests.
void deinterleave_q4_1_row(const void* packed, int64_t cols, int64_t row, void* dst);

// y[t * y_stride + r] for r < w_rows and t < x_rows: weight rows [0, w_rows) of an interleaved
// matrix starting at `packed` (a group boundary) against Q8_1 activation rows x, x_stride
// bytes apart, in the order above. Dispatches to AVX2 when the CPU has it.
void matmul_q4_1_interleaved(const void* packed, int64_t cols, int64_t w_rows, const void* x,
                             size_t x_stride, int64_t x_rows, float* y, int64_t y_stride);
// The portable version the AVX2 one is tested against; bit-identical results.
void matmul_q4_1_interleaved_scalar(const void* packed, int64_t cols, int64_t w_rows,
                                    const void* x, size_t x_stride, int64_t x_rows, float* y,
                                    int64_t y_stride);

// ---- Q4_0, Q5_0, Q8_0 (against Q8_0 activations), Q4_K, Q5_K, Q6_K (against Q8_K), and Q4_1
// and Q5_1 (against Q8_1, in the order above with 5-bit quants for Q5_1)
// through the same entry points.
//
// The same idea and the same 8-row groups: a group's block b holds the 8 rows' fp16 scales,
// then their quants 4 bytes per row at a time (Q5_0 also its fifth bits, reordered; see
// kernels/quant_blocks.h). The result of each output element is fixed by this order:
//   acc = 0
//   for each block b:  isum = sum of v_w * q_x over the 32 elements (exact, int32), v_w the
//                             weight's signed value (q - 8 for Q4_0, q - 16 for Q5_0, q for Q8_0)
//                      acc  = fma(d_w * d_x, float(isum), acc)
// d_x the Q8_0 activation block's fp16 scale. Q6_K the same per 256-element super-block, with
// isum = sum over its 16 sub-blocks of scale * sum((q - 32) * q_x) (exact) and d_x the Q8_K
// block's float scale. Q4_K per super-block: isum = sum over its 8 sub-blocks of
// scale * sum(q * q_x), imin = sum of min * (the sub-block's Q8_K bsums), both exact, and
//   acc = fma(d_w * d_x, float(isum), acc);  acc = fma(-(dmin_w * d_x), float(imin), acc).
// Q5_K as Q4_K with its 5-bit quants.
// ggml sums the same products in the same blocks; only the float rounding differs.

// Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K have an interleaved layout.
bool has_interleaved_layout(GgmlType type);
// Bytes of one group of 8 rows / of a rows x cols matrix (cols a multiple of the block size).
size_t interleaved_group_size(GgmlType type, int64_t cols);
size_t interleaved_size(GgmlType type, int64_t rows, int64_t cols);
// GGUF rows of `type` -> the interleaved layout (interleaved_size bytes), rows past the end
// zero; and one row back in GGUF blocks (ggml_row_size(type, cols) bytes).
void interleave_rows(GgmlType type, const void* src, int64_t rows, int64_t cols, void* dst);
void deinterleave_row(GgmlType type, const void* packed, int64_t cols, int64_t row, void* dst);
// As matmul_q4_1_interleaved, for any type with a layout; x holds rows of the type's dot type
// (vec_dot_type: Q8_1 for Q4_1 and Q5_1, Q8_K for the K-quants, Q8_0 for the others). Dispatches to AVX2
// when the CPU has it.
void matmul_interleaved(GgmlType type, const void* packed, int64_t cols, int64_t w_rows,
                        const void* x, size_t x_stride, int64_t x_rows, float* y,
                        int64_t y_stride);
// The portable version; bit-identical results.
void matmul_interleaved_scalar(GgmlType type, const void* packed, int64_t cols, int64_t w_rows,
                               const void* x, size_t x_stride, int64_t x_rows, float* y,
                               int64_t y_stride);

}  // namespace tessera
