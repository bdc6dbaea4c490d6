// Scalar reference kernels for the GGML block formats, plus the run-time dispatch of vec_dot.
// Every quantizer here reproduces ggml's quantize_row_*_ref operation by operation (same scale
// formula, same rounding, fp16 storage of the scales) because llama.cpp quantizes activations
// this way and a one-ulp difference in a scale changes every product in the block.
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <limits>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

#include "quant_blocks.h"
#include "tessera/sdk/kernels/ggml_types.h"

// ggml is C compiled in ISO mode, where GCC does not fuse a*b+c into an FMA; GCC's C++ default
// would, changing the rounding of e.g. the Q4_1 min term. Keep every float operation separate.
#include "tessera/sdk/kernels/fp_contract_off.h"

namespace tessera {

namespace {

using kernels::BlockQ4_0;
using kernels::BlockQ4_1;
using kernels::BlockQ4_K;
using kernels::BlockQ5_0;
using kernels::BlockQ5_1;
using kernels::BlockQ5_K;
using kernels::BlockQ6_K;
using kernels::BlockQ8_0;
using kernels::BlockQ8_1;
using kernels::BlockQ8_K;
using kernels::get_scale_min_k4;
using kernels::nearest_int;
using kernels::kQK4_0;
using kernels::kQK4_1;
using kernels::kQK5_0;
using kernels::kQK5_1;
using kernels::kQK8_0;
using kernels::kQK8_1;
using kernels::kQK_K;

// ---- dequantize -------------------------------------------------------------------------

// The 32-element formats with 4-bit nibbles (Q4_0, Q4_1, Q5_0, Q5_1) store element j in the
// low nibble of qs[j] and element j + 16 in the high nibble; the Q5 formats add bit 4 of every
// element in a 32-bit mask qh (element k at bit k, read little-endian). Each *_quants function
// yields the integer quants of elements j and j + 16 as the dots and dequantizers use them
// (with Q4_0's -8 / Q5_0's -16 offset applied).
struct QuantPair {
  int lo;  // element j
  int hi;  // element j + 16
};

inline uint32_t q5_high_bits(const uint8_t* qh) {
  uint32_t bits;
  std::memcpy(&bits, qh, sizeof bits);
  return bits;
}
// Bit 4 (0x10 or 0) of element k.
inline int q5_fifth_bit(uint32_t bits, int k) { return static_cast<int>((bits >> k) & 1u) << 4; }

inline QuantPair q4_0_quants(const BlockQ4_0& b, int j) {
  return {(b.qs[j] & 0x0F) - 8, (b.qs[j] >> 4) - 8};
}
inline QuantPair q4_1_quants(const BlockQ4_1& b, int j) { return {b.qs[j] & 0x0F, b.qs[j] >> 4}; }
inline QuantPair q5_0_quants(const BlockQ5_0& b, int j) {
  const uint32_t qh = q5_high_bits(b.qh);
  return {((b.qs[j] & 0x0F) | q5_fifth_bit(qh, j)) - 16,
          ((b.qs[j] >> 4) | q5_fifth_bit(qh, j + 16)) - 16};
}
inline QuantPair q5_1_quants(const BlockQ5_1& b, int j) {
  const uint32_t qh = q5_high_bits(b.qh);
  return {(b.qs[j] & 0x0F) | q5_fifth_bit(qh, j), (b.qs[j] >> 4) | q5_fifth_bit(qh, j + 16)};
}

// y = q * d (Q4_0, Q5_0) or q * d + m (Q4_1, Q5_1, the blocks with a min), as ggml computes.
template <class Block>
void dequantize_row_nibbles(const Block* x, float* y, int64_t n,
                            QuantPair (*quants)(const Block&, int)) {
  constexpr bool kHasMin = requires(const Block& b) { b.m; };
  const int64_t nb = n / 32;
  for (int64_t i = 0; i < nb; ++i) {
    const float d = fp16_to_fp32(x[i].d);
    for (int j = 0; j < 16; ++j) {
      const QuantPair q = quants(x[i], j);
      if constexpr (kHasMin) {
        const float m = fp16_to_fp32(x[i].m);
        y[i * 32 + j] = q.lo * d + m;
        y[i * 32 + j + 16] = q.hi * d + m;
      } else {
        y[i * 32 + j] = q.lo * d;
        y[i * 32 + j + 16] = q.hi * d;
      }
    }
  }
}

void dequantize_row_q8_0(const BlockQ8_0* x, float* y, int64_t n) {
  const int64_t nb = n / kQK8_0;
  for (int64_t i = 0; i < nb; ++i) {
    const float d = fp16_to_fp32(x[i].d);
    for (int j = 0; j < kQK8_0; ++j) y[i * kQK8_0 + j] = x[i].qs[j] * d;
  }
}

// ggml has no Q8_1 dequantizer (it is an activation-only format); the obvious one is provided
// so round-trip tests and debugging can look at Q8_1 data. s is redundant and ignored.
void dequantize_row_q8_1(const BlockQ8_1* x, float* y, int64_t n) {
  const int64_t nb = n / kQK8_1;
  for (int64_t i = 0; i < nb; ++i) {
    const float d = fp16_to_fp32(x[i].d);
    for (int j = 0; j < kQK8_1; ++j) y[i * kQK8_1 + j] = x[i].qs[j] * d;
  }
}

// ggml's dequantize_row_q4_K and dequantize_row_q5_K: w = d * sc * q - dmin * m per
// 32-element sub-block. Q5_K adds 16 to a quant whose fifth bit is set (bit s of qh[l] for
// element 32 s + l).
template <typename Block>
void dequantize_row_k4(const Block* x, float* y, int64_t n) {
  const int64_t nb = n / kQK_K;
  for (int64_t i = 0; i < nb; ++i) {
    const uint8_t* q = x[i].qs;
    const float d = fp16_to_fp32(x[i].d);
    const float min = fp16_to_fp32(x[i].dmin);
    int is = 0;
    uint8_t sc = 0;
    uint8_t m = 0;
    // Each 64 elements share 32 bytes: the low nibbles are sub-block `is`, the high
    // nibbles sub-block `is + 1`.
    for (int j = 0; j < kQK_K; j += 64) {
      get_scale_min_k4(is + 0, x[i].scales, &sc, &m);
      const float d1 = d * sc;
      const float m1 = min * m;
      get_scale_min_k4(is + 1, x[i].scales, &sc, &m);
      const float d2 = d * sc;
      const float m2 = min * m;
      for (int l = 0; l < 32; ++l) {
        int lo = q[l] & 0xF, hi = q[l] >> 4;
        if constexpr (std::is_same_v<Block, BlockQ5_K>) {
          lo += (x[i].qh[l] >> is) & 1 ? 16 : 0;
          hi += (x[i].qh[l] >> (is + 1)) & 1 ? 16 : 0;
        }
        y[l] = d1 * lo - m1;
        y[32 + l] = d2 * hi - m2;
      }
      y += 64;
      q += 32;
      is += 2;
    }
  }
}

void dequantize_row_q6_k(const BlockQ6_K* x, float* y, int64_t n) {
  const int64_t nb = n / kQK_K;
  for (int64_t i = 0; i < nb; ++i) {
    const float d = fp16_to_fp32(x[i].d);
    const uint8_t* ql = x[i].ql;
    const uint8_t* qh = x[i].qh;
    const int8_t* sc = x[i].scales;
    // Each 128 elements use 64 ql bytes (two nibbles each) and 32 qh bytes (four 2-bit
    // fields each); element groups l, l+32, l+64, l+96 share a qh byte.
    for (int base = 0; base < kQK_K; base += 128) {
      for (int l = 0; l < 32; ++l) {
        const int is = l / 16;
        const int q1 = static_cast<int8_t>((ql[l + 0] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
        const int q2 = static_cast<int8_t>((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
        const int q3 = static_cast<int8_t>((ql[l + 0] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
        const int q4 = static_cast<int8_t>((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
        y[l + 0] = d * sc[is + 0] * q1;
        y[l + 32] = d * sc[is + 2] * q2;
        y[l + 64] = d * sc[is + 4] * q3;
        y[l + 96] = d * sc[is + 6] * q4;
      }
      y += 128;
      ql += 64;
      qh += 32;
      sc += 8;
    }
  }
}

// ggml's dequantize_row_q8_K: the float scale times each quant (bsums are redundant).
void dequantize_row_q8_k(const BlockQ8_K* x, float* y, int64_t n) {
  const int64_t nb = n / kQK_K;
  for (int64_t i = 0; i < nb; ++i) {
    for (int j = 0; j < kQK_K; ++j) *y++ = x[i].d * x[i].qs[j];
  }
}

// ---- quantize (ggml's *_ref) --------------------------------------------------------------

// The value of largest magnitude in x[0..n), with its sign (the first one on ties).
float signed_max(const float* x, int n) {
  float amax = 0.0f;
  float max = 0.0f;
  for (int j = 0; j < n; ++j) {
    if (amax < std::fabs(x[j])) {
      amax = std::fabs(x[j]);
      max = x[j];
    }
  }
  return max;
}

void min_max(const float* x, int n, float* min, float* max) {
  *min = FLT_MAX;
  *max = -FLT_MAX;
  for (int j = 0; j < n; ++j) {
    if (x[j] < *min) *min = x[j];
    if (x[j] > *max) *max = x[j];
  }
}

// Block header of Q4_0 / Q5_0 (levels = 16 / 32): the signed extreme maps to -levels/2, so
// the full range is used on the side where it matters. Stores fp16(d), returns 1/d (0 for d = 0).
template <class Block>
float set_signed_scale(const float* x, int levels, Block* b) {
  const float d = signed_max(x, 32) / -(levels / 2);
  b->d = fp32_to_fp16(d);
  return d != 0.0f ? 1.0f / d : 0.0f;
}

// Block header of Q4_1 / Q5_1: d = (max - min) / (levels - 1), m = min. Stores fp16(d) and
// fp16(m), returns 1/d (0 for d = 0) and the unrounded min.
template <class Block>
float set_scale_and_min(const float* x, int levels, Block* b, float* min) {
  float max;
  min_max(x, 32, min, &max);
  const float d = (max - *min) / (levels - 1);
  b->d = fp32_to_fp16(d);
  b->m = fp32_to_fp16(*min);
  return d != 0.0f ? 1.0f / d : 0.0f;
}

void quantize_row_q4_0(const float* x, BlockQ4_0* y, int64_t n) {
  const int64_t nb = n / kQK4_0;
  for (int64_t i = 0; i < nb; ++i) {
    const float id = set_signed_scale(x + i * kQK4_0, 16, &y[i]);
    for (int j = 0; j < kQK4_0 / 2; ++j) {
      const float x0 = x[i * kQK4_0 + j] * id;
      const float x1 = x[i * kQK4_0 + kQK4_0 / 2 + j] * id;
      // Truncation of x + 8.5 is ggml's rounding here (not roundf); keep it.
      const uint8_t xi0 = static_cast<uint8_t>(std::min<int8_t>(15, static_cast<int8_t>(x0 + 8.5f)));
      const uint8_t xi1 = static_cast<uint8_t>(std::min<int8_t>(15, static_cast<int8_t>(x1 + 8.5f)));
      y[i].qs[j] = static_cast<uint8_t>(xi0 | (xi1 << 4));
    }
  }
}

void quantize_row_q4_1(const float* x, BlockQ4_1* y, int64_t n) {
  const int64_t nb = n / kQK4_1;
  for (int64_t i = 0; i < nb; ++i) {
    float min;
    const float id = set_scale_and_min(x + i * kQK4_1, 16, &y[i], &min);
    for (int j = 0; j < kQK4_1 / 2; ++j) {
      const float x0 = (x[i * kQK4_1 + j] - min) * id;
      const float x1 = (x[i * kQK4_1 + kQK4_1 / 2 + j] - min) * id;
      const uint8_t xi0 = static_cast<uint8_t>(std::min<int8_t>(15, static_cast<int8_t>(x0 + 0.5f)));
      const uint8_t xi1 = static_cast<uint8_t>(std::min<int8_t>(15, static_cast<int8_t>(x1 + 0.5f)));
      y[i].qs[j] = static_cast<uint8_t>(xi0 | (xi1 << 4));
    }
  }
}

// Stores 5-bit quants q0 (element j) and q1 (element j + 16) of a Q5 block: low 4 bits as
// nibbles, bit 4 into the qh mask.
inline void q5_store_pair(uint8_t* qs, uint32_t* qh, int j, uint8_t q0, uint8_t q1) {
  qs[j] = static_cast<uint8_t>((q0 & 0x0F) | ((q1 & 0x0F) << 4));
  *qh |= static_cast<uint32_t>((q0 >> 4) & 1u) << j;
  *qh |= static_cast<uint32_t>((q1 >> 4) & 1u) << (j + 16);
}

// As Q4_0 with 32 levels: d = max / -16.
void quantize_row_q5_0(const float* x, BlockQ5_0* y, int64_t n) {
  const int64_t nb = n / kQK5_0;
  for (int64_t i = 0; i < nb; ++i) {
    const float id = set_signed_scale(x + i * kQK5_0, 32, &y[i]);
    uint32_t qh = 0;
    for (int j = 0; j < kQK5_0 / 2; ++j) {
      // ggml's rounding: truncate x + 16.5 toward zero through int8, clamp to 31.
      const float x0 = x[i * kQK5_0 + j] * id;
      const float x1 = x[i * kQK5_0 + kQK5_0 / 2 + j] * id;
      const auto xi0 = static_cast<uint8_t>(std::min<int8_t>(31, static_cast<int8_t>(x0 + 16.5f)));
      const auto xi1 = static_cast<uint8_t>(std::min<int8_t>(31, static_cast<int8_t>(x1 + 16.5f)));
      q5_store_pair(y[i].qs, &qh, j, xi0, xi1);
    }
    std::memcpy(y[i].qh, &qh, sizeof qh);
  }
}

// As Q4_1 with 32 levels. Unlike Q4_1, ggml does not clamp the rounded quants here; neither
// do we.
void quantize_row_q5_1(const float* x, BlockQ5_1* y, int64_t n) {
  const int64_t nb = n / kQK5_1;
  for (int64_t i = 0; i < nb; ++i) {
    float min;
    const float id = set_scale_and_min(x + i * kQK5_1, 32, &y[i], &min);
    uint32_t qh = 0;
    for (int j = 0; j < kQK5_1 / 2; ++j) {
      const auto xi0 = static_cast<uint8_t>((x[i * kQK5_1 + j] - min) * id + 0.5f);
      const auto xi1 = static_cast<uint8_t>((x[i * kQK5_1 + kQK5_1 / 2 + j] - min) * id + 0.5f);
      q5_store_pair(y[i].qs, &qh, j, xi0, xi1);
    }
    std::memcpy(y[i].qh, &qh, sizeof qh);
  }
}

void quantize_row_q8_0(const float* x, BlockQ8_0* y, int64_t n) {
  const int64_t nb = n / kQK8_0;
  for (int64_t i = 0; i < nb; ++i) {
    float amax = 0.0f;
    for (int j = 0; j < kQK8_0; ++j) amax = std::max(amax, std::fabs(x[i * kQK8_0 + j]));
    const float d = amax / ((1 << 7) - 1);
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    y[i].d = fp32_to_fp16(d);
    for (int j = 0; j < kQK8_0; ++j) {
      // roundf rounds halves away from zero, as ggml's reference does.
      y[i].qs[j] = static_cast<int8_t>(std::roundf(x[i * kQK8_0 + j] * id));
    }
  }
}

// llama.cpp's run-time activation quantizers (ggml-cpu's x86 quantize_row_q8_0/q8_1):
// id = 127/amax (not 1/d) and round half to even (_mm256_round_ps with _MM_ROUND_NEAREST).
template <class Block>
void quantize_activations_q8(const float* x, Block* y, int64_t n, bool with_sum) {
  const int64_t nb = n / 32;
  for (int64_t i = 0; i < nb; ++i) {
    const float* xb = x + i * 32;
    float amax = 0.0f;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(xb[j]));
    const float d = amax / 127.0f;
    const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
    y[i].d = fp32_to_fp16(d);
    int32_t sum = 0;
    for (int j = 0; j < 32; ++j) {
      const auto q = static_cast<int8_t>(std::nearbyint(xb[j] * id));
      y[i].qs[j] = q;
      sum += q;
    }
    if constexpr (requires { y[i].s; }) {
      if (with_sum) y[i].s = fp32_to_fp16(d * static_cast<float>(sum));
    }
  }
}

void quantize_row_q8_1(const float* x, BlockQ8_1* y, int64_t n) {
  const int64_t nb = n / kQK8_1;
  for (int64_t i = 0; i < nb; ++i) {
    float amax = 0.0f;
    for (int j = 0; j < kQK8_1; ++j) amax = std::max(amax, std::fabs(x[i * kQK8_1 + j]));
    const float d = amax / ((1 << 7) - 1);
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    y[i].d = fp32_to_fp16(d);
    int sum = 0;
    for (int j = 0; j < kQK8_1 / 2; ++j) {
      const float v0 = x[i * kQK8_1 + j] * id;
      const float v1 = x[i * kQK8_1 + kQK8_1 / 2 + j] * id;
      y[i].qs[j] = static_cast<int8_t>(std::roundf(v0));
      y[i].qs[kQK8_1 / 2 + j] = static_cast<int8_t>(std::roundf(v1));
      sum += y[i].qs[j];
      sum += y[i].qs[kQK8_1 / 2 + j];
    }
    // ggml multiplies by the unrounded float d, not by the stored fp16 d.
    y[i].s = fp32_to_fp16(static_cast<float>(sum) * d);
  }
}

// Q8_K, the activation format of the K-quant dots. On x86 ggml-cpu's quantize_row_q8_K is the
// reference (quantize_row_q8_K_ref), so this one function serves both quantize_row and
// quantize_activation_row. Per super-block of 256:
//  - max is the first value of largest magnitude, kept with its sign;
//  - iscale = -127 / max, q = min(127, nearest_int(iscale * x)) — so max itself maps to -127
//    and values of the other sign may reach +127;
//  - bsums[j] = sum of the 16 quants of group j; d = 1 / iscale (the float, not fp16).
// An all-zero block (amax == 0) gets d = 0 and zero quants. ggml leaves its bsums as they
// were; they are written as zeros here, which changes no dot product (every bsums term is
// multiplied by d = 0) and keeps the output deterministic.
void quantize_row_q8_k(const float* x, BlockQ8_K* y, int64_t n) {
  const int64_t nb = n / kQK_K;
  for (int64_t i = 0; i < nb; ++i, x += kQK_K) {
    float max = 0.0f;
    float amax = 0.0f;
    for (int j = 0; j < kQK_K; ++j) {
      const float ax = std::fabs(x[j]);
      if (ax > amax) {
        amax = ax;
        max = x[j];
      }
    }
    if (amax == 0.0f) {
      y[i].d = 0.0f;
      std::memset(y[i].qs, 0, sizeof y[i].qs);
      std::memset(y[i].bsums, 0, sizeof y[i].bsums);
      continue;
    }
    const float iscale = -127.0f / max;
    for (int j = 0; j < kQK_K; ++j) {
      y[i].qs[j] = static_cast<int8_t>(std::min(127, nearest_int(iscale * x[j])));
    }
    for (int j = 0; j < kQK_K / 16; ++j) {
      int sum = 0;
      for (int l = 0; l < 16; ++l) sum += y[i].qs[16 * j + l];
      y[i].bsums[j] = static_cast<int16_t>(sum);
    }
    y[i].d = 1 / iscale;
  }
}

float bf16_to_fp32(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// ggml_compute_fp32_to_bf16: round to nearest even; NaNs are kept NaN (quieted) instead of
// letting the rounding carry turn them into infinities.
uint16_t fp32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 64);
  return static_cast<uint16_t>((u + (0x7fffu + ((u >> 16) & 1u))) >> 16);
}

// ---- scalar dot products (ggml's generic paths) ---------------------------------------------

// Integer dot of one 32-element nibble block with 32 int8 activations, as ggml's generic C
// forms it: elements j and j + 16 in two running sums, added at the end.
template <class Block>
int block_sumi(const Block& x, const int8_t* y, QuantPair (*quants)(const Block&, int)) {
  int sumi0 = 0;
  int sumi1 = 0;
  for (int j = 0; j < 16; ++j) {
    const QuantPair q = quants(x, j);
    sumi0 += q.lo * y[j];
    sumi1 += q.hi * y[j + 16];
  }
  return sumi0 + sumi1;
}

float vec_dot_q4_0_q8_0_ref(int64_t n, const BlockQ4_0* x, const BlockQ8_0* y) {
  const int64_t nb = n / kQK8_0;
  float sumf = 0.0f;
  for (int64_t ib = 0; ib < nb; ++ib) {
    const int sumi = block_sumi(x[ib], y[ib].qs, q4_0_quants);
    sumf += sumi * fp16_to_fp32(x[ib].d) * fp16_to_fp32(y[ib].d);
  }
  return sumf;
}

// ggml's generic Q5_0 dot: unlike Q4_0's sumi * d_w * d_x, the scale product is formed first.
float vec_dot_q5_0_q8_0_ref(int64_t n, const BlockQ5_0* x, const BlockQ8_0* y) {
  const int64_t nb = n / kQK8_0;
  float sumf = 0.0f;
  for (int64_t ib = 0; ib < nb; ++ib) {
    const int sumi = block_sumi(x[ib], y[ib].qs, q5_0_quants);
    sumf += (fp16_to_fp32(x[ib].d) * fp16_to_fp32(y[ib].d)) * sumi;
  }
  return sumf;
}

// Q4_1 and Q5_1: sum_j (q_w*d_w + m)(q_x*d_x) = d_w*d_x*sum(q_w*q_x) + m*(d_x*sum(q_x)), and
// the second factor is exactly what Q8_1 stores in s.
template <class Block>
float vec_dot_with_min_ref(int64_t n, const Block* x, const BlockQ8_1* y,
                           QuantPair (*quants)(const Block&, int)) {
  const int64_t nb = n / kQK8_1;
  float sumf = 0.0f;
  for (int64_t ib = 0; ib < nb; ++ib) {
    const int sumi = block_sumi(x[ib], y[ib].qs, quants);
    sumf += (fp16_to_fp32(x[ib].d) * fp16_to_fp32(y[ib].d)) * sumi +
            fp16_to_fp32(x[ib].m) * fp16_to_fp32(y[ib].s);
  }
  return sumf;
}

float vec_dot_q8_0_q8_0_ref(int64_t n, const BlockQ8_0* x, const BlockQ8_0* y) {
  const int64_t nb = n / kQK8_0;
  float sumf = 0.0f;
  for (int64_t ib = 0; ib < nb; ++ib) {
    int sumi = 0;
    for (int j = 0; j < kQK8_0; ++j) sumi += x[ib].qs[j] * y[ib].qs[j];
    sumf += sumi * (fp16_to_fp32(x[ib].d) * fp16_to_fp32(y[ib].d));
  }
  return sumf;
}

// The K-quant dots follow ggml's *_generic C: the integer products of each super-block go
// into 8 int32 lanes (lane l takes the elements at index l mod 8, each product times its
// sub-block scale), each lane is scaled by d_w * d_x into its own float running sum, and the
// 8 float sums are added to the scalar total in lane order at the very end.

// Q4_K: w = d * sc * q - dmin * m per 32-element sub-block, so the dot is
// d_w d_x sum(sc * q * q8) - dmin_w d_x sum(m * q8), and sum(q8) over a sub-block is the two
// bsums of its 16-element halves. Q5_K the same with 5-bit quants (its fifth bit of element
// 32 s + l at bit s of qh[l]).
template <typename Block>
float vec_dot_k4_q8_k_ref(int64_t n, const Block* x, const BlockQ8_K* y) {
  const int64_t nb = n / kQK_K;
  float sums[8] = {};
  float sumf = 0.0f;
  for (int64_t i = 0; i < nb; ++i) {
    uint8_t sc[8];
    uint8_t mn[8];
    for (int j = 0; j < 8; ++j) get_scale_min_k4(j, x[i].scales, &sc[j], &mn[j]);
    int8_t q[kQK_K];  // the quants in element order
    for (int j = 0; j < kQK_K / 64; ++j) {
      for (int l = 0; l < 32; ++l) {
        int lo = x[i].qs[32 * j + l] & 0xF, hi = x[i].qs[32 * j + l] >> 4;
        if constexpr (std::is_same_v<Block, BlockQ5_K>) {
          lo |= ((x[i].qh[l] >> (2 * j)) & 1) << 4;
          hi |= ((x[i].qh[l] >> (2 * j + 1)) & 1) << 4;
        }
        q[64 * j + l] = static_cast<int8_t>(lo);
        q[64 * j + 32 + l] = static_cast<int8_t>(hi);
      }
    }
    int sumi = 0;
    for (int j = 0; j < kQK_K / 16; ++j) sumi += y[i].bsums[j] * mn[j / 2];
    int32_t lanes[8] = {};
    for (int e = 0; e < kQK_K; ++e) lanes[e % 8] += sc[e / 32] * (y[i].qs[e] * q[e]);
    const float d = fp16_to_fp32(x[i].d) * y[i].d;
    for (int l = 0; l < 8; ++l) sums[l] += d * static_cast<float>(lanes[l]);
    const float dmin = fp16_to_fp32(x[i].dmin) * y[i].d;
    sumf -= dmin * static_cast<float>(sumi);
  }
  for (int l = 0; l < 8; ++l) sumf += sums[l];
  return sumf;
}

// Q6_K: w = d * sc * (q - 32) with a signed 8-bit scale per 16 elements.
float vec_dot_q6_k_q8_k_ref(int64_t n, const BlockQ6_K* x, const BlockQ8_K* y) {
  const int64_t nb = n / kQK_K;
  float sums[8] = {};
  for (int64_t i = 0; i < nb; ++i) {
    int8_t q[kQK_K];  // the 6-bit quants minus 32, in element order (as dequantize_row_q6_k)
    const uint8_t* ql = x[i].ql;
    const uint8_t* qh = x[i].qh;
    for (int base = 0; base < kQK_K; base += 128, ql += 64, qh += 32) {
      for (int l = 0; l < 32; ++l) {
        q[base + l] = static_cast<int8_t>((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
        q[base + l + 32] = static_cast<int8_t>((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
        q[base + l + 64] = static_cast<int8_t>((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
        q[base + l + 96] = static_cast<int8_t>((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
      }
    }
    int32_t lanes[8] = {};
    for (int e = 0; e < kQK_K; ++e) lanes[e % 8] += x[i].scales[e / 16] * (y[i].qs[e] * q[e]);
    const float d = fp16_to_fp32(x[i].d) * y[i].d;
    for (int l = 0; l < 8; ++l) sums[l] += d * static_cast<float>(lanes[l]);
  }
  float sumf = 0.0f;
  for (int l = 0; l < 8; ++l) sumf += sums[l];
  return sumf;
}

// Float products accumulated in double, as ggml's non-SIMD ggml_vec_dot_f16/f32 do.
float vec_dot_f16_ref(int64_t n, const uint16_t* x, const uint16_t* y) {
  double sumf = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    sumf += static_cast<double>(fp16_to_fp32(x[i]) * fp16_to_fp32(y[i]));
  }
  return static_cast<float>(sumf);
}

float vec_dot_f32_ref(int64_t n, const float* x, const float* y) {
  double sumf = 0.0;
  for (int64_t i = 0; i < n; ++i) sumf += static_cast<double>(x[i] * y[i]);
  return static_cast<float>(sumf);
}

#if defined(__x86_64__) || defined(__i386__)
constexpr bool kAvx2KernelsCompiled = true;
#else
constexpr bool kAvx2KernelsCompiled = false;
#endif

}  // namespace

bool dequantize_row(GgmlType type, const void* src, float* dst, int64_t n) {
  switch (type) {
    case GgmlType::F32:
      std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float));
      return true;
    case GgmlType::F16: {
      const auto* h = static_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < n; ++i) dst[i] = fp16_to_fp32(h[i]);
      return true;
    }
    case GgmlType::BF16: {
      const auto* h = static_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_fp32(h[i]);
      return true;
    }
    case GgmlType::Q4_0:
      dequantize_row_nibbles(static_cast<const BlockQ4_0*>(src), dst, n, q4_0_quants);
      return true;
    case GgmlType::Q4_1:
      dequantize_row_nibbles(static_cast<const BlockQ4_1*>(src), dst, n, q4_1_quants);
      return true;
    case GgmlType::Q5_0:
      dequantize_row_nibbles(static_cast<const BlockQ5_0*>(src), dst, n, q5_0_quants);
      return true;
    case GgmlType::Q5_1:
      dequantize_row_nibbles(static_cast<const BlockQ5_1*>(src), dst, n, q5_1_quants);
      return true;
    case GgmlType::Q8_0:
      dequantize_row_q8_0(static_cast<const BlockQ8_0*>(src), dst, n);
      return true;
    case GgmlType::Q8_1:
      dequantize_row_q8_1(static_cast<const BlockQ8_1*>(src), dst, n);
      return true;
    case GgmlType::Q4_K:
      dequantize_row_k4(static_cast<const BlockQ4_K*>(src), dst, n);
      return true;
    case GgmlType::Q5_K:
      dequantize_row_k4(static_cast<const BlockQ5_K*>(src), dst, n);
      return true;
    case GgmlType::Q6_K:
      dequantize_row_q6_k(static_cast<const BlockQ6_K*>(src), dst, n);
      return true;
    case GgmlType::Q8_K:
      dequantize_row_q8_k(static_cast<const BlockQ8_K*>(src), dst, n);
      return true;
    default:
      return false;
  }
}

bool quantize_row(GgmlType type, const float* src, void* dst, int64_t n) {
  switch (type) {
    case GgmlType::F32:
      std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float));
      return true;
    case GgmlType::F16: {
      auto* h = static_cast<uint16_t*>(dst);
      for (int64_t i = 0; i < n; ++i) h[i] = fp32_to_fp16(src[i]);
      return true;
    }
    case GgmlType::BF16: {
      auto* h = static_cast<uint16_t*>(dst);
      for (int64_t i = 0; i < n; ++i) h[i] = fp32_to_bf16(src[i]);
      return true;
    }
    case GgmlType::Q4_0:
      quantize_row_q4_0(src, static_cast<BlockQ4_0*>(dst), n);
      return true;
    case GgmlType::Q4_1:
      quantize_row_q4_1(src, static_cast<BlockQ4_1*>(dst), n);
      return true;
    case GgmlType::Q5_0:
      quantize_row_q5_0(src, static_cast<BlockQ5_0*>(dst), n);
      return true;
    case GgmlType::Q5_1:
      quantize_row_q5_1(src, static_cast<BlockQ5_1*>(dst), n);
      return true;
    case GgmlType::Q8_0:
      quantize_row_q8_0(src, static_cast<BlockQ8_0*>(dst), n);
      return true;
    case GgmlType::Q8_1:
      quantize_row_q8_1(src, static_cast<BlockQ8_1*>(dst), n);
      return true;
    case GgmlType::Q8_K:
      quantize_row_q8_k(src, static_cast<BlockQ8_K*>(dst), n);
      return true;
    case GgmlType::Q4_K:
    case GgmlType::Q5_K:
    case GgmlType::Q6_K:
      return quantize_weight_row(type, src, dst, n, nullptr);  // quant_search.cpp
    default:
      return false;
  }
}

GgmlType vec_dot_type(GgmlType weight_type) {
  switch (weight_type) {
    case GgmlType::F16:
      return GgmlType::F16;
    case GgmlType::Q4_0:
    case GgmlType::Q5_0:
    case GgmlType::Q8_0:
      return GgmlType::Q8_0;
    case GgmlType::Q4_1:
    case GgmlType::Q5_1:
      return GgmlType::Q8_1;
    case GgmlType::Q4_K:
    case GgmlType::Q5_K:
    case GgmlType::Q6_K:
      return GgmlType::Q8_K;
    default:
      // Everything else (F32, BF16, and weights without a vec dot here, e.g. Q3_K, which a
      // caller dequantizes first) takes F32 activations.
      return GgmlType::F32;
  }
}

bool has_vec_dot(GgmlType weight_type) {
  switch (weight_type) {
    case GgmlType::F32:
    case GgmlType::F16:
    case GgmlType::Q4_0:
    case GgmlType::Q4_1:
    case GgmlType::Q5_0:
    case GgmlType::Q5_1:
    case GgmlType::Q8_0:
    case GgmlType::Q4_K:
    case GgmlType::Q5_K:
    case GgmlType::Q6_K:
      return true;
    default:
      return false;
  }
}

bool cpu_has_avx2() {
#if defined(__x86_64__) || defined(__i386__)
  // F16C is required too: the F16 kernel and the scale conversions use it. Clang's
  // __builtin_cpu_supports does not know "f16c", so that bit is read from CPUID leaf 1
  // directly (the avx2 check has already confirmed the OS saves YMM state).
  static const bool supported = [] {
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) return false;
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return false;
    return (ecx & bit_F16C) != 0;
  }();
  return kAvx2KernelsCompiled && supported;
#else
  return false;
#endif
}

float vec_dot_scalar(GgmlType weight_type, int64_t n, const void* weight_row, const void* x) {
  switch (weight_type) {
    case GgmlType::F32:
      return vec_dot_f32_ref(n, static_cast<const float*>(weight_row), static_cast<const float*>(x));
    case GgmlType::F16:
      return vec_dot_f16_ref(n, static_cast<const uint16_t*>(weight_row),
                             static_cast<const uint16_t*>(x));
    case GgmlType::Q4_0:
      return vec_dot_q4_0_q8_0_ref(n, static_cast<const BlockQ4_0*>(weight_row),
                                   static_cast<const BlockQ8_0*>(x));
    case GgmlType::Q4_1:
      return vec_dot_with_min_ref(n, static_cast<const BlockQ4_1*>(weight_row),
                                  static_cast<const BlockQ8_1*>(x), q4_1_quants);
    case GgmlType::Q5_0:
      return vec_dot_q5_0_q8_0_ref(n, static_cast<const BlockQ5_0*>(weight_row),
                                   static_cast<const BlockQ8_0*>(x));
    case GgmlType::Q5_1:
      return vec_dot_with_min_ref(n, static_cast<const BlockQ5_1*>(weight_row),
                                  static_cast<const BlockQ8_1*>(x), q5_1_quants);
    case GgmlType::Q8_0:
      return vec_dot_q8_0_q8_0_ref(n, static_cast<const BlockQ8_0*>(weight_row),
                                   static_cast<const BlockQ8_0*>(x));
    case GgmlType::Q4_K:
      return vec_dot_k4_q8_k_ref(n, static_cast<const BlockQ4_K*>(weight_row),
                                   static_cast<const BlockQ8_K*>(x));
    case GgmlType::Q5_K:
      return vec_dot_k4_q8_k_ref(n, static_cast<const BlockQ5_K*>(weight_row),
                                   static_cast<const BlockQ8_K*>(x));
    case GgmlType::Q6_K:
      return vec_dot_q6_k_q8_k_ref(n, static_cast<const BlockQ6_K*>(weight_row),
                                   static_cast<const BlockQ8_K*>(x));
    default:
      // NaN rather than 0 so a caller that skipped has_vec_dot() gets visibly wrong logits.
      return std::numeric_limits<float>::quiet_NaN();
  }
}

float vec_dot(GgmlType weight_type, int64_t n, const void* weight_row, const void* x) {
#if defined(__x86_64__) || defined(__i386__)
  if (cpu_has_avx2()) {
    switch (weight_type) {
      case GgmlType::F32:
        return kernels::vec_dot_f32_avx2(n, weight_row, x);
      case GgmlType::F16:
        return kernels::vec_dot_f16_avx2(n, weight_row, x);
      case GgmlType::Q4_0:
        return kernels::vec_dot_q4_0_q8_0_avx2(n, weight_row, x);
      case GgmlType::Q4_1:
        return kernels::vec_dot_q4_1_q8_1_avx2(n, weight_row, x);
      case GgmlType::Q5_0:
        return kernels::vec_dot_q5_0_q8_0_avx2(n, weight_row, x);
      case GgmlType::Q5_1:
        return kernels::vec_dot_q5_1_q8_1_avx2(n, weight_row, x);
      case GgmlType::Q8_0:
        return kernels::vec_dot_q8_0_q8_0_avx2(n, weight_row, x);
      case GgmlType::Q4_K:
        return kernels::vec_dot_q4_k_q8_k_avx2(n, weight_row, x);
      case GgmlType::Q5_K:
        return kernels::vec_dot_q5_k_q8_k_avx2(n, weight_row, x);
      case GgmlType::Q6_K:
        return kernels::vec_dot_q6_k_q8_k_avx2(n, weight_row, x);
      default:
        break;
    }
  }
#endif
  return vec_dot_scalar(weight_type, n, weight_row, x);
}

void vec_dot_tile_scalar(GgmlType weight_type, int64_t n, const void* w, size_t w_stride,
                         int64_t w_rows, const void* x, size_t x_stride, int64_t x_rows, float* y,
                         int64_t y_stride) {
  const auto* wb = static_cast<const uint8_t*>(w);
  const auto* xb = static_cast<const uint8_t*>(x);
  for (int64_t r = 0; r < w_rows; ++r)
    for (int64_t t = 0; t < x_rows; ++t)
      y[t * y_stride + r] = vec_dot_scalar(weight_type, n, wb + r * w_stride, xb + t * x_stride);
}

void vec_dot_tile(GgmlType weight_type, int64_t n, const void* w, size_t w_stride, int64_t w_rows,
                  const void* x, size_t x_stride, int64_t x_rows, float* y, int64_t y_stride) {
#if defined(__x86_64__) || defined(__i386__)
  if (cpu_has_avx2()) {
    if (kernels::vec_dot_tile_avx2(static_cast<int>(weight_type), n, w, w_stride, w_rows, x,
                                   x_stride, x_rows, y, y_stride))
      return;
    const auto* wb = static_cast<const uint8_t*>(w);
    const auto* xb = static_cast<const uint8_t*>(x);
    for (int64_t r = 0; r < w_rows; ++r)
      for (int64_t t = 0; t < x_rows; ++t)
        y[t * y_stride + r] = vec_dot(weight_type, n, wb + r * w_stride, xb + t * x_stride);
    return;
  }
#endif
  vec_dot_tile_scalar(weight_type, n, w, w_stride, w_rows, x, x_stride, x_rows, y, y_stride);
}

bool quantize_activation_row_scalar(GgmlType type, const float* src, void* dst, int64_t n) {
  switch (type) {
    case GgmlType::Q8_0:
      quantize_activations_q8(src, static_cast<BlockQ8_0*>(dst), n, false);
      return true;
    case GgmlType::Q8_1:
      quantize_activations_q8(src, static_cast<BlockQ8_1*>(dst), n, true);
      return true;
    default:
      return quantize_row(type, src, dst, n);
  }
}

bool quantize_activation_row(GgmlType type, const float* src, void* dst, int64_t n) {
  switch (type) {
    case GgmlType::Q8_0:
    case GgmlType::Q8_1:
#if defined(__x86_64__) || defined(__i386__)
      if (cpu_has_avx2()) {
        kernels::quantize_activations_q8_avx2(src, dst, n, type == GgmlType::Q8_1, &fp32_to_fp16);
        return true;
      }
#endif
      return quantize_activation_row_scalar(type, src, dst, n);
    case GgmlType::Q8_K:
      // ggml's x86 build calls its reference quantizer at run time: the same bytes, on 8 lanes.
#if defined(__x86_64__) || defined(__i386__)
      if (cpu_has_avx2()) {
        kernels::quantize_row_q8_k_avx2(src, dst, n);
        return true;
      }
#endif
      return quantize_row(type, src, dst, n);
    default:
      // F16/F32 conversions already match.
      return quantize_row(type, src, dst, n);
  }
}

}  // namespace tessera
