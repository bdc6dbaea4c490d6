// The portable parts of quantizer.int8's kernels: packing, the scalar reference matmul and
// activation quantizer. The SIMD builds are in int8_kernels_x86.inl.
#include "int8_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstring>


namespace tessera::int8_w8a8 {

void pack_rows(const float* src, int64_t rows, int64_t cols, int8_t* groups, float* scale,
               int32_t* row_sum) {
  const int64_t kp = padded_cols(cols);
  const int64_t total_rows = num_groups(rows) * kGroupRows;
  std::memset(groups, 0, static_cast<size_t>(total_rows * kp));
  for (int64_t r = 0; r < total_rows; ++r) {
    scale[r] = 0.0f;
    row_sum[r] = 0;
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = src + r * cols;
    float amax = 0.0f;
    for (int64_t c = 0; c < cols; ++c) amax = std::max(amax, std::fabs(row[c]));
    const float s = amax / 127.0f;
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    int8_t* group = groups + (r / kGroupRows) * kGroupRows * kp;
    const int64_t lane = r % kGroupRows;
    int32_t sum = 0;
    for (int64_t c = 0; c < cols; ++c) {
      const int32_t q = round_clamp(row[c] * inv);
      group[(c / 4) * 32 + lane * 4 + c % 4] = static_cast<int8_t>(q);
      sum += q;
    }
    scale[r] = s;
    row_sum[r] = sum;
  }
}

void unpack_row(const PackedWeight& w, int64_t row, float* out) {
  const int8_t* group = w.groups + (row / kGroupRows) * kGroupRows * w.padded_cols;
  const int64_t lane = row % kGroupRows;
  for (int64_t c = 0; c < w.cols; ++c)
    out[c] = static_cast<float>(group[(c / 4) * 32 + lane * 4 + c % 4]) * w.scale[row];
}

float quantize_token_scalar(const float* x, int64_t cols, int64_t padded, bool offset_128,
                            uint8_t* out) {
  float amax = 0.0f;
  for (int64_t c = 0; c < cols; ++c) amax = std::max(amax, std::fabs(x[c]));
  const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
  const int32_t offset = offset_128 ? 128 : 0;
  for (int64_t c = 0; c < cols; ++c) out[c] = static_cast<uint8_t>(round_clamp(x[c] * inv) + offset);
  for (int64_t c = cols; c < padded; ++c) out[c] = static_cast<uint8_t>(offset);
  return amax / 127.0f;
}

void gemm_scalar(const PackedWeight& w, int64_t row_begin, int64_t row_end, const Activations& x,
                 int64_t num_tokens, float* y, int64_t y_stride) {
  const int64_t kp = w.padded_cols;
  for (int64_t r = row_begin; r < row_end; ++r) {
    const int8_t* group = w.groups + (r / kGroupRows) * kGroupRows * kp;
    const int64_t lane = r % kGroupRows;
    for (int64_t t = 0; t < num_tokens; ++t) {
      const uint8_t* q = x.q + t * x.stride;
      int32_t sum = 0;
      for (int64_t c = 0; c < kp; ++c) {
        const int32_t a = x.offset_128 ? static_cast<int32_t>(q[c]) - 128
                                       : static_cast<int32_t>(static_cast<int8_t>(q[c]));
        sum += a * group[(c / 4) * 32 + lane * 4 + c % 4];
      }
      y[t * y_stride + r] = (static_cast<float>(sum) * w.scale[r]) * x.scale[t];
    }
  }
}

}  // namespace tessera::int8_w8a8
