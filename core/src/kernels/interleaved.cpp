// Interleaved Q4_1: the repacking, the scalar kernel (the reference and the fallback on CPUs
// without AVX2) and the run-time dispatch. See tessera/interleaved.h for the layout and order.
#include "tessera/interleaved.h"

#include <cmath>
#include <cstring>

#include "quant_blocks.h"
#include "tessera/ggml_types.h"

// Every float operation as written: the order is the contract the AVX2 kernel matches.
#include "tessera/fp_contract_off.h"

namespace tessera {

using kernels::BlockQ4_1;
using kernels::BlockQ4_1x8;
using kernels::BlockQ8_1;

namespace {

int64_t num_groups(int64_t rows) { return (rows + kInterleaveRows - 1) / kInterleaveRows; }

}  // namespace

size_t interleaved_q4_1_group_size(int64_t cols) {
  return static_cast<size_t>(cols / kernels::kQK4_1) * sizeof(BlockQ4_1x8);
}

size_t interleaved_q4_1_size(int64_t rows, int64_t cols) {
  return static_cast<size_t>(num_groups(rows)) * interleaved_q4_1_group_size(cols);
}

void interleave_q4_1(const void* src, int64_t rows, int64_t cols, void* dst) {
  const int64_t nb = cols / kernels::kQK4_1;
  const auto* in = static_cast<const BlockQ4_1*>(src);
  auto* out = static_cast<BlockQ4_1x8*>(dst);
  for (int64_t g = 0; g < num_groups(rows); ++g) {
    for (int64_t b = 0; b < nb; ++b) {
      BlockQ4_1x8& o = out[g * nb + b];
      std::memset(&o, 0, sizeof o);  // rows past the end: d = m = 0, quants 0
      for (int j = 0; j < kInterleaveRows; ++j) {
        const int64_t r = g * kInterleaveRows + j;
        if (r >= rows) break;
        const BlockQ4_1& blk = in[r * nb + b];
        o.d[j] = blk.d;
        o.m[j] = blk.m;
        for (int k = 0; k < 4; ++k)
          std::memcpy(o.qs + 32 * k + 4 * j, blk.qs + 4 * k, 4);
      }
    }
  }
}

void deinterleave_q4_1_row(const void* packed, int64_t cols, int64_t row, void* dst) {
  const int64_t nb = cols / kernels::kQK4_1;
  const int64_t g = row / kInterleaveRows;
  const int j = static_cast<int>(row % kInterleaveRows);
  const auto* in = static_cast<const BlockQ4_1x8*>(packed) + g * nb;
  auto* out = static_cast<BlockQ4_1*>(dst);
  for (int64_t b = 0; b < nb; ++b) {
    out[b].d = in[b].d[j];
    out[b].m = in[b].m[j];
    for (int k = 0; k < 4; ++k) std::memcpy(out[b].qs + 4 * k, in[b].qs + 32 * k + 4 * j, 4);
  }
}

void matmul_q4_1_interleaved_scalar(const void* packed, int64_t cols, int64_t w_rows,
                                    const void* x, size_t x_stride, int64_t x_rows, float* y,
                                    int64_t y_stride) {
  const int64_t nb = cols / kernels::kQK4_1;
  const auto* groups = static_cast<const BlockQ4_1x8*>(packed);
  const auto* xb = static_cast<const uint8_t*>(x);
  for (int64_t r = 0; r < w_rows; ++r) {
    const BlockQ4_1x8* w = groups + (r / kInterleaveRows) * nb;
    const int j = static_cast<int>(r % kInterleaveRows);
    for (int64_t t = 0; t < x_rows; ++t) {
      const auto* a = reinterpret_cast<const BlockQ8_1*>(xb + t * x_stride);
      float acc = 0.0f;
      for (int64_t b = 0; b < nb; ++b) {
        int32_t isum = 0;
        for (int k = 0; k < 4; ++k) {
          for (int i = 0; i < 4; ++i) {
            const uint8_t q = w[b].qs[32 * k + 4 * j + i];
            isum += (q & 0x0F) * a[b].qs[4 * k + i] + (q >> 4) * a[b].qs[16 + 4 * k + i];
          }
        }
        const float dd = fp16_to_fp32(w[b].d[j]) * fp16_to_fp32(a[b].d);
        acc = std::fma(dd, static_cast<float>(isum), acc);
        acc = std::fma(fp16_to_fp32(w[b].m[j]), fp16_to_fp32(a[b].s), acc);
      }
      y[t * y_stride + r] = acc;
    }
  }
}

void matmul_q4_1_interleaved(const void* packed, int64_t cols, int64_t w_rows, const void* x,
                             size_t x_stride, int64_t x_rows, float* y, int64_t y_stride) {
#if defined(__x86_64__) || defined(__i386__)
  if (cpu_has_avx2()) {
    kernels::matmul_q4_1x8_avx2(cols / kernels::kQK4_1, static_cast<const BlockQ4_1x8*>(packed),
                                w_rows, static_cast<const uint8_t*>(x), x_stride, x_rows, y,
                                y_stride);
    return;
  }
#endif
  matmul_q4_1_interleaved_scalar(packed, cols, w_rows, x, x_stride, x_rows, y, y_stride);
}

}  // namespace tessera
