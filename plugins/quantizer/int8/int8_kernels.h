// W8A8 kernels of quantizer.int8: int8 weights with one f32 scale per output row, int8
// activations with one f32 scale per token, products summed exactly in int32.
//
// Weight layout ("int8x8"): rows in groups of 8 (the last group zero-padded), each group
// `padded_cols / 4` chunks of 32 bytes = 4 consecutive columns of each of the 8 rows, row-major
// inside the chunk. One 256-bit load thus holds 4 columns of 8 rows, and one broadcast of a
// token's 4 activation bytes multiplies all 8 rows: the 8 int32 lanes are the 8 rows' sums, so
// no horizontal reduction is needed. padded_cols is a multiple of 32 (zeros after cols).
//
// Activations: per token int8 q[c] = round(x[c] / a), a = max|x| / 127, padded with zeros.
// The AVX-VNNI kernel wants them unsigned (vpdpbusd multiplies u8 by s8): q + 128, with the
// surplus 128 * sum(w_row) taken back out from the precomputed row sums.
//
// Every kernel computes the same exact int32 sum s and then y = (float(s) * w_scale) * a, so
// scalar, AVX2 and AVX-VNNI outputs are equal bit for bit (tests/unit/test_int8_w8a8.cpp).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>

namespace tessera::int8_w8a8 {

inline constexpr int64_t kGroupRows = 8;
inline constexpr int64_t kColAlign = 32;

inline int64_t padded_cols(int64_t cols) { return (cols + kColAlign - 1) / kColAlign * kColAlign; }
inline int64_t num_groups(int64_t rows) { return (rows + kGroupRows - 1) / kGroupRows; }

// v rounded to nearest, ties to even (the default FP mode, as _mm256_cvtps_epi32 rounds), then
// clamped to [-127, 127]: every int8 value of weights and activations.
inline int32_t round_clamp(float v) {
  return static_cast<int32_t>(std::clamp(std::nearbyint(v), -127.0f, 127.0f));
}

// One prepared weight's arrays. `groups` holds num_groups(rows) * 8 * padded_cols bytes;
// `scale` and `row_sum` num_groups(rows) * 8 entries (0 for the padding rows).
struct PackedWeight {
  const int8_t* groups = nullptr;
  const float* scale = nullptr;
  const int32_t* row_sum = nullptr;
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t padded_cols = 0;
};

// A batch of quantized activations: token t's bytes at q + t * stride (padded_cols of them,
// signed, or offset by 128 when `offset_128`), its scale at scale[t].
struct Activations {
  const uint8_t* q = nullptr;
  size_t stride = 0;
  const float* scale = nullptr;
  bool offset_128 = false;
};

// Packs float rows (rows x cols, row-major) into `w`'s arrays (sized as above), the per-row
// scale max|row| / 127 and round-to-nearest-even into [-127, 127].
void pack_rows(const float* src, int64_t rows, int64_t cols, int8_t* groups, float* scale,
               int32_t* row_sum);
// Row `row` of a packed weight back to floats (q * scale).
void unpack_row(const PackedWeight& w, int64_t row, float* out);

// Quantizes one token's cols floats into padded_cols bytes (zeros after cols) and returns its
// scale. Scalar and AVX2 builds give the same bytes.
float quantize_token_scalar(const float* x, int64_t cols, int64_t padded_cols, bool offset_128,
                            uint8_t* out);
float quantize_token_avx2(const float* x, int64_t cols, int64_t padded_cols, bool offset_128,
                          uint8_t* out);

// y[t * y_stride + r] for rows [row_begin, row_end) (row_begin a multiple of 8) and tokens
// [0, num_tokens). The AVX2 kernel needs signed activations, the AVX-VNNI one offset ones;
// the scalar one takes either.
void gemm_scalar(const PackedWeight& w, int64_t row_begin, int64_t row_end, const Activations& x,
                 int64_t num_tokens, float* y, int64_t y_stride);
void gemm_avx2(const PackedWeight& w, int64_t row_begin, int64_t row_end, const Activations& x,
               int64_t num_tokens, float* y, int64_t y_stride);
void gemm_avxvnni(const PackedWeight& w, int64_t row_begin, int64_t row_end, const Activations& x,
                  int64_t num_tokens, float* y, int64_t y_stride);

}  // namespace tessera::int8_w8a8
