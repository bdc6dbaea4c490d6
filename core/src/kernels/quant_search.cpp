// Weight quantizers that search for their scales, as llama-quantize runs them (ggml-quants.c,
// MIT licence, transcribed operation by operation so the bytes are the same):
//  - Q4_K, Q5_K and Q6_K without an importance matrix: quantize_row_q{4,5}_K_ref (make_qkx2_quants per
//    32 elements, 6-bit scales/mins by rounding) and quantize_row_q6_K_ref (make_qx_quants per
//    16 elements, 8-bit scales);
//  - every format with an importance matrix (llama.cpp's imatrix: per column, the mean squared
//    activation that multiplies it): quantize_row_q{4_0,4_1,5_0,5_1,4_K,5_K,6_K}_impl, which weight
//    each element's squared error by importance[c] * sqrt(sigma2 + x[c]^2) while searching the
//    block scale (Q8_0 ignores the importance, as in ggml).
// Without importance the legacy formats use quantize_row's *_ref versions (quant_ref.cpp).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "quant_blocks.h"
#include "tessera/sdk/kernels/ggml_types.h"

// ggml-quants.c is C compiled in ISO mode (no FMA contraction); keep every float op separate.
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
using kernels::get_scale_min_k4;
using kernels::kQK_K;
using kernels::nearest_int;

constexpr float kGroupMaxEps = 1e-15f;  // ggml's GROUP_MAX_EPS

// Symmetric quants in [-nmax, nmax) searched over 19 scales; weights qw (or, without them, a
// function of x chosen by rmse_type). L receives quant + nmax. Returns the scale.
float make_qx_quants(int n, int nmax, const float* x, int8_t* L, int rmse_type, const float* qw) {
  float max = 0;
  float amax = 0;
  for (int i = 0; i < n; ++i) {
    const float ax = std::fabs(x[i]);
    if (ax > amax) {
      amax = ax;
      max = x[i];
    }
  }
  if (amax < kGroupMaxEps) {
    for (int i = 0; i < n; ++i) L[i] = 0;
    return 0.f;
  }
  float iscale = -nmax / max;
  if (rmse_type == 0) {
    for (int i = 0; i < n; ++i) {
      const int l = nearest_int(iscale * x[i]);
      L[i] = static_cast<int8_t>(nmax + std::max(-nmax, std::min(nmax - 1, l)));
    }
    return 1 / iscale;
  }
  bool return_early = false;
  if (rmse_type < 0) {
    rmse_type = -rmse_type;
    return_early = true;
  }
  auto weight = [&](int i) {
    return qw ? qw[i]
              : rmse_type == 1 ? x[i] * x[i]
              : rmse_type == 2 ? 1
              : rmse_type == 3 ? std::fabs(x[i])
                               : std::sqrt(std::fabs(x[i]));
  };
  float sumlx = 0;
  float suml2 = 0;
  for (int i = 0; i < n; ++i) {
    int l = nearest_int(iscale * x[i]);
    l = std::max(-nmax, std::min(nmax - 1, l));
    L[i] = static_cast<int8_t>(l + nmax);
    const float w = weight(i);
    sumlx += w * x[i] * l;
    suml2 += w * l * l;
  }
  float scale = suml2 ? sumlx / suml2 : 0.0f;
  if (return_early) return suml2 > 0 ? 0.5f * (scale + 1 / iscale) : 1 / iscale;
  float best = scale * sumlx;
  for (int is = -9; is <= 9; ++is) {
    if (is == 0) continue;
    iscale = -(nmax + 0.1f * is) / max;
    sumlx = suml2 = 0;
    for (int i = 0; i < n; ++i) {
      int l = nearest_int(iscale * x[i]);
      l = std::max(-nmax, std::min(nmax - 1, l));
      const float w = weight(i);
      sumlx += w * x[i] * l;
      suml2 += w * l * l;
    }
    if (suml2 > 0 && sumlx * sumlx > best * suml2) {
      for (int i = 0; i < n; ++i) {
        const int l = nearest_int(iscale * x[i]);
        L[i] = static_cast<int8_t>(nmax + std::max(-nmax, std::min(nmax - 1, l)));
      }
      scale = sumlx / suml2;
      best = scale * sumlx;
    }
  }
  return scale;
}

// Asymmetric quants in [0, nmax] with a min <= 0, searched over nstep + 1 scales; the weighted
// squared (or absolute, use_mad) error decides. make_qkx2_quants (weights required) and
// make_qkx3_quants (weights may be null: x^2) differ only in that default and in qkx3
// treating max <= min, not max == min, as the degenerate case, so one function serves both.
// Returns the scale; *the_min receives -min.
float make_qkx_quants(int n, int nmax, const float* x, const float* weights, uint8_t* L,
                      float* the_min, uint8_t* Laux, float rmin, float rdelta, int nstep,
                      bool use_mad, bool qkx3) {
  auto weight = [&](int i) { return weights ? weights[i] : x[i] * x[i]; };
  float min = x[0];
  float max = x[0];
  float sum_w = weight(0);
  float sum_x = sum_w * x[0];
  for (int i = 1; i < n; ++i) {
    if (x[i] < min) min = x[i];
    if (x[i] > max) max = x[i];
    const float w = weight(i);
    sum_w += w;
    sum_x += w * x[i];
  }
  if (min > 0) min = 0;
  if (qkx3 ? max <= min : max == min) {
    for (int i = 0; i < n; ++i) L[i] = 0;
    *the_min = -min;
    return 0.f;
  }
  float iscale = nmax / (max - min);
  float scale = 1 / iscale;
  float best_error = 0;
  for (int i = 0; i < n; ++i) {
    const int l = nearest_int(iscale * (x[i] - min));
    L[i] = static_cast<uint8_t>(std::max(0, std::min(nmax, l)));
    float diff = scale * L[i] + min - x[i];
    diff = use_mad ? std::fabs(diff) : diff * diff;
    best_error += weight(i) * diff;
  }
  if (nstep < 1) {
    *the_min = -min;
    return scale;
  }
  for (int is = 0; is <= nstep; ++is) {
    iscale = (rmin + rdelta * is + nmax) / (max - min);
    float sum_l = 0, sum_l2 = 0, sum_xl = 0;
    for (int i = 0; i < n; ++i) {
      int l = nearest_int(iscale * (x[i] - min));
      l = std::max(0, std::min(nmax, l));
      Laux[i] = static_cast<uint8_t>(l);
      const float w = weight(i);
      sum_l += w * l;
      sum_l2 += w * l * l;
      sum_xl += w * l * x[i];
    }
    const float D = sum_w * sum_l2 - sum_l * sum_l;
    if (D > 0) {
      float this_scale = (sum_w * sum_xl - sum_x * sum_l) / D;
      float this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D;
      if (this_min > 0) {
        this_min = 0;
        this_scale = sum_xl / sum_l2;
      }
      float cur_error = 0;
      for (int i = 0; i < n; ++i) {
        float diff = this_scale * Laux[i] + this_min - x[i];
        diff = use_mad ? std::fabs(diff) : diff * diff;
        cur_error += weight(i) * diff;
      }
      if (cur_error < best_error) {
        for (int i = 0; i < n; ++i) L[i] = Laux[i];
        best_error = cur_error;
        scale = this_scale;
        min = this_min;
      }
    }
  }
  *the_min = -min;
  return scale;
}

// Non-negative quants in [0, nmax] of the sub-block scales (or mins), weighted by quant_weights.
float make_qp_quants(int n, int nmax, const float* x, uint8_t* L, const float* quant_weights) {
  float max = 0;
  for (int i = 0; i < n; ++i) max = std::max(max, x[i]);
  if (max < kGroupMaxEps) {
    for (int i = 0; i < n; ++i) L[i] = 0;
    return 0.f;
  }
  float iscale = nmax / max;
  for (int i = 0; i < n; ++i) L[i] = static_cast<uint8_t>(nearest_int(iscale * x[i]));
  const float scale = 1 / iscale;
  float best_mse = 0;
  for (int i = 0; i < n; ++i) {
    const float diff = x[i] - scale * L[i];
    const float w = quant_weights[i];
    best_mse += w * diff * diff;
  }
  for (int is = -4; is <= 4; ++is) {
    if (is == 0) continue;
    const float iscale_is = (0.1f * is + nmax) / max;
    const float scale_is = 1 / iscale_is;
    float mse = 0;
    for (int i = 0; i < n; ++i) {
      int l = nearest_int(iscale_is * x[i]);
      l = std::min(nmax, l);
      const float diff = x[i] - scale_is * l;
      const float w = quant_weights[i];
      mse += w * diff * diff;
    }
    if (mse < best_mse) {
      best_mse = mse;
      iscale = iscale_is;
    }
  }
  float sumlx = 0;
  float suml2 = 0;
  for (int i = 0; i < n; ++i) {
    int l = nearest_int(iscale * x[i]);
    l = std::min(nmax, l);
    L[i] = static_cast<uint8_t>(l);
    const float w = quant_weights[i];
    sumlx += w * x[i] * l;
    suml2 += w * l * l;
  }
  for (int itry = 0; itry < 5; ++itry) {
    int n_changed = 0;
    for (int i = 0; i < n; ++i) {
      const float w = quant_weights[i];
      float slx = sumlx - w * x[i] * L[i];
      float sl2 = suml2 - w * L[i] * L[i];
      if (slx > 0 && sl2 > 0) {
        int new_l = nearest_int(x[i] * sl2 / slx);
        new_l = std::min(nmax, new_l);
        if (new_l != L[i]) {
          slx += w * x[i] * new_l;
          sl2 += w * new_l * new_l;
          if (slx * slx * suml2 > sumlx * sumlx * sl2) {
            L[i] = static_cast<uint8_t>(new_l);
            sumlx = slx;
            suml2 = sl2;
            ++n_changed;
          }
        }
      }
    }
    if (!n_changed) break;
  }
  return suml2 > 0.0f ? sumlx / suml2 : 0.0f;
}

// Packs 8 six-bit scales and mins into Q4_K's 12 bytes (the inverse of get_scale_min_k4).
void pack_scales_k4(const uint8_t* ls, const uint8_t* lm, uint8_t* scales) {
  for (int j = 0; j < kQK_K / 32; ++j) {
    if (j < 4) {
      scales[j] = ls[j];
      scales[j + 4] = lm[j];
    } else {
      scales[j + 4] = static_cast<uint8_t>((ls[j] & 0xF) | ((lm[j] & 0xF) << 4));
      scales[j - 4] |= static_cast<uint8_t>((ls[j] >> 4) << 6);
      scales[j - 0] |= static_cast<uint8_t>((lm[j] >> 4) << 6);
    }
  }
}

// Quants per K-quant type with 6-bit scales and mins: Q4_K (nibbles) and Q5_K (nibbles plus
// a fifth bit per quant in qh).
template <typename Block>
constexpr int kKQuantMax = std::is_same_v<Block, BlockQ5_K> ? 31 : 15;

// The common tail of the Q4_K / Q5_K quantizers: requantize every element with the stored
// (fp16, 6-bit) scales and mins, then pack the nibbles (and Q5_K's fifth bits).
template <typename Block>
void finish_k4(const float* x, Block* y, uint8_t* L) {
  constexpr int nmax = kKQuantMax<Block>;
  uint8_t sc, m;
  for (int j = 0; j < kQK_K / 32; ++j) {
    get_scale_min_k4(j, y->scales, &sc, &m);
    const float d = fp16_to_fp32(y->d) * sc;
    if (!d) continue;
    const float dm = fp16_to_fp32(y->dmin) * m;
    for (int ii = 0; ii < 32; ++ii) {
      int l = nearest_int((x[32 * j + ii] + dm) / d);
      l = std::max(0, std::min(nmax, l));
      L[32 * j + ii] = static_cast<uint8_t>(l);
    }
  }
  uint8_t* q = y->qs;
  if constexpr (std::is_same_v<Block, BlockQ5_K>) {
    std::memset(y->qh, 0, sizeof y->qh);
    uint8_t m1 = 1, m2 = 2;
    for (int j = 0; j < kQK_K; j += 64) {
      for (int l = 0; l < 32; ++l) {
        int l1 = L[j + l], l2 = L[j + l + 32];
        if (l1 > 15) {
          l1 -= 16;
          y->qh[l] |= m1;
        }
        if (l2 > 15) {
          l2 -= 16;
          y->qh[l] |= m2;
        }
        q[l] = static_cast<uint8_t>(l1 | (l2 << 4));
      }
      m1 = static_cast<uint8_t>(m1 << 2);
      m2 = static_cast<uint8_t>(m2 << 2);
      q += 32;
    }
  } else {
    for (int j = 0; j < kQK_K; j += 64) {
      for (int l = 0; l < 32; ++l) q[l] = static_cast<uint8_t>(L[j + l] | (L[j + l + 32] << 4));
      q += 32;
    }
  }
}

// quantize_row_q4_K_ref / quantize_row_q5_K_ref: they differ only in the quant range and the
// scale search's grid (Q4_K: rmin -1, 20 steps; Q5_K: rmin -0.5, 15 steps).
template <typename Block>
void quantize_row_k4_ref(const float* x, Block* y, int64_t k) {
  constexpr bool kQ5 = std::is_same_v<Block, BlockQ5_K>;
  const int64_t nb = k / kQK_K;
  uint8_t L[kQK_K];
  uint8_t Laux[32];
  float weights[32];
  float mins[kQK_K / 32];
  float scales[kQK_K / 32];
  for (int64_t i = 0; i < nb; i++) {
    float max_scale = 0;
    float max_min = 0;
    for (int j = 0; j < kQK_K / 32; ++j) {
      float sum_x2 = 0;
      for (int l = 0; l < 32; ++l) sum_x2 += x[32 * j + l] * x[32 * j + l];
      const float av_x = std::sqrt(sum_x2 / 32);
      for (int l = 0; l < 32; ++l) weights[l] = av_x + std::fabs(x[32 * j + l]);
      scales[j] = make_qkx_quants(32, kKQuantMax<Block>, x + 32 * j, weights, L + 32 * j, &mins[j],
                                  Laux, kQ5 ? -0.5f : -1.f, 0.1f, kQ5 ? 15 : 20, false,
                                  /*qkx3=*/false);
      max_scale = std::max(max_scale, scales[j]);
      max_min = std::max(max_min, mins[j]);
    }
    const float inv_scale = max_scale > 0 ? 63.f / max_scale : 0.f;
    const float inv_min = max_min > 0 ? 63.f / max_min : 0.f;
    uint8_t ls[kQK_K / 32], lm[kQK_K / 32];
    for (int j = 0; j < kQK_K / 32; ++j) {
      ls[j] = std::min<uint8_t>(63, static_cast<uint8_t>(nearest_int(inv_scale * scales[j])));
      lm[j] = std::min<uint8_t>(63, static_cast<uint8_t>(nearest_int(inv_min * mins[j])));
    }
    std::memset(y[i].scales, 0, sizeof y[i].scales);
    pack_scales_k4(ls, lm, y[i].scales);
    y[i].d = fp32_to_fp16(max_scale / 63.f);
    y[i].dmin = fp32_to_fp16(max_min / 63.f);
    finish_k4(x, &y[i], L);
    x += kQK_K;
  }
}

// quantize_row_q4_K_impl / quantize_row_q5_K_impl (with an importance matrix).
template <typename Block>
void quantize_row_k4_impl(const float* x, Block* y, int64_t n_per_row, const float* qw_row) {
  const int64_t nb = n_per_row / kQK_K;
  uint8_t L[kQK_K];
  uint8_t Laux[32];
  uint8_t Ls[kQK_K / 32];
  uint8_t Lm[kQK_K / 32];
  float weights[32];
  float sw[kQK_K / 32];
  float mins[kQK_K / 32];
  float scales[kQK_K / 32];
  for (int64_t i = 0; i < nb; i++) {
    float sum_x2 = 0;
    for (int l = 0; l < kQK_K; ++l) sum_x2 += x[l] * x[l];
    const float sigma2 = 2 * sum_x2 / kQK_K;
    for (int j = 0; j < kQK_K / 32; ++j) {
      const float* qw = qw_row + kQK_K * i + 32 * j;
      for (int l = 0; l < 32; ++l) weights[l] = qw[l] * std::sqrt(sigma2 + x[32 * j + l] * x[32 * j + l]);
      float sumw = 0;
      for (int l = 0; l < 32; ++l) sumw += weights[l];
      sw[j] = sumw;
      scales[j] = make_qkx_quants(32, kKQuantMax<Block>, x + 32 * j, weights, L + 32 * j, &mins[j],
                                  Laux, -0.9f, 0.05f, 36, false, /*qkx3=*/true);
    }
    const float d_block = make_qp_quants(kQK_K / 32, 63, scales, Ls, sw);
    const float m_block = make_qp_quants(kQK_K / 32, 63, mins, Lm, sw);
    std::memset(y[i].scales, 0, sizeof y[i].scales);
    pack_scales_k4(Ls, Lm, y[i].scales);
    y[i].d = fp32_to_fp16(d_block);
    y[i].dmin = fp32_to_fp16(m_block);
    finish_k4(x, &y[i], L);
    x += kQK_K;
  }
}

// Both Q6_K quantizers; qw_row null is quantize_row_q6_K_ref.
void quantize_row_q6_k(const float* x, BlockQ6_K* y, int64_t n_per_row, const float* qw_row) {
  const int64_t nb = n_per_row / kQK_K;
  int8_t L[kQK_K];
  float scales[kQK_K / 16];
  for (int64_t i = 0; i < nb; i++) {
    float max_scale = 0;
    float max_abs_scale = 0;
    for (int ib = 0; ib < kQK_K / 16; ++ib) {
      const float* qw = qw_row ? qw_row + kQK_K * i + 16 * ib : nullptr;
      const float scale = make_qx_quants(16, 32, x + 16 * ib, L + 16 * ib, 1, qw);
      scales[ib] = scale;
      const float abs_scale = std::fabs(scale);
      if (abs_scale > max_abs_scale) {
        max_abs_scale = abs_scale;
        max_scale = scale;
      }
    }
    if (max_abs_scale < kGroupMaxEps) {
      std::memset(&y[i], 0, sizeof(BlockQ6_K));
      y[i].d = fp32_to_fp16(0.f);
      x += kQK_K;
      continue;
    }
    const float iscale = -128.f / max_scale;
    y[i].d = fp32_to_fp16(1 / iscale);
    for (int ib = 0; ib < kQK_K / 16; ++ib)
      y[i].scales[ib] = static_cast<int8_t>(std::min(127, nearest_int(iscale * scales[ib])));
    for (int j = 0; j < kQK_K / 16; ++j) {
      const float d = fp16_to_fp32(y[i].d) * y[i].scales[j];
      if (!d) continue;
      for (int ii = 0; ii < 16; ++ii) {
        int l = nearest_int(x[16 * j + ii] / d);
        l = std::max(-32, std::min(31, l));
        L[16 * j + ii] = static_cast<int8_t>(l + 32);
      }
    }
    uint8_t* ql = y[i].ql;
    uint8_t* qh = y[i].qh;
    for (int j = 0; j < kQK_K; j += 128) {
      for (int l = 0; l < 32; ++l) {
        const uint8_t q1 = L[j + l + 0] & 0xF;
        const uint8_t q2 = L[j + l + 32] & 0xF;
        const uint8_t q3 = L[j + l + 64] & 0xF;
        const uint8_t q4 = L[j + l + 96] & 0xF;
        ql[l + 0] = static_cast<uint8_t>(q1 | (q3 << 4));
        ql[l + 32] = static_cast<uint8_t>(q2 | (q4 << 4));
        qh[l] = static_cast<uint8_t>((L[j + l] >> 4) | ((L[j + l + 32] >> 4) << 2) |
                                     ((L[j + l + 64] >> 4) << 4) | ((L[j + l + 96] >> 4) << 6));
      }
      ql += 64;
      qh += 32;
    }
    x += kQK_K;
  }
}

// sigma2 of the legacy *_impl quantizers: the mean square of the whole row.
float row_sigma2(const float* x, int64_t n) {
  float sum_x2 = 0;
  for (int64_t j = 0; j < n; ++j) sum_x2 += x[j] * x[j];
  return sum_x2 / n;
}

void block_weights(const float* xb, const float* qw, float sigma2, float* weight) {
  for (int j = 0; j < 32; ++j) weight[j] = qw[j] * std::sqrt(sigma2 + xb[j] * xb[j]);
}

// Stores 32 quants of a legacy block (L[j] for element j, up to 5 bits): the low 4 bits as
// nibbles (element j low, j + 16 high), bit 4 into the qh mask when the format has one.
template <class Block>
void pack_block_quants(const uint8_t* L, Block* y) {
  uint32_t qh = 0;
  for (int j = 0; j < 16; ++j) {
    const uint8_t xi0 = L[j];
    const uint8_t xi1 = L[j + 16];
    y->qs[j] = static_cast<uint8_t>((xi0 & 0x0F) | ((xi1 & 0x0F) << 4));
    qh |= ((xi0 & 0x10u) >> 4) << (j + 0);
    qh |= ((xi1 & 0x10u) >> 4) << (j + 16);
  }
  if constexpr (requires { y->qh; }) std::memcpy(y->qh, &qh, sizeof qh);
}

// Q4_0 / Q5_0 with importance: symmetric make_qx_quants with 2^(bits-1) levels a side.
template <class Block>
void quantize_row_signed_impl(const float* x, Block* y, int64_t n, const float* qw, int nmax) {
  const float sigma2 = row_sigma2(x, n);
  float weight[32];
  int8_t L[32];
  for (int64_t ib = 0; ib < n / 32; ++ib) {
    const float* xb = x + 32 * ib;
    block_weights(xb, qw + 32 * ib, sigma2, weight);
    const float d = make_qx_quants(32, nmax, xb, L, 1, weight);
    y[ib].d = fp32_to_fp16(d);
    pack_block_quants(reinterpret_cast<const uint8_t*>(L), &y[ib]);
  }
}

// Q4_1 / Q5_1 with importance: make_qkx3_quants with 2^bits - 1 levels.
template <class Block>
void quantize_row_min_impl(const float* x, Block* y, int64_t n, const float* qw, int nmax) {
  const float sigma2 = row_sigma2(x, n);
  float weight[32];
  uint8_t L[32], Laux[32];
  for (int64_t ib = 0; ib < n / 32; ++ib) {
    const float* xb = x + 32 * ib;
    block_weights(xb, qw + 32 * ib, sigma2, weight);
    float min;
    const float d = make_qkx_quants(32, nmax, xb, weight, L, &min, Laux, -0.9f, 0.05f, 36, false,
                                    /*qkx3=*/true);
    y[ib].d = fp32_to_fp16(d);
    y[ib].m = fp32_to_fp16(-min);
    pack_block_quants(L, &y[ib]);
  }
}

}  // namespace

bool quantize_weight_row(GgmlType type, const float* src, void* dst, int64_t n,
                         const float* importance) {
  switch (type) {
    case GgmlType::Q4_K:
      if (importance == nullptr) {
        quantize_row_k4_ref(src, static_cast<BlockQ4_K*>(dst), n);
      } else {
        quantize_row_k4_impl(src, static_cast<BlockQ4_K*>(dst), n, importance);
      }
      return true;
    case GgmlType::Q5_K:
      if (importance == nullptr) {
        quantize_row_k4_ref(src, static_cast<BlockQ5_K*>(dst), n);
      } else {
        quantize_row_k4_impl(src, static_cast<BlockQ5_K*>(dst), n, importance);
      }
      return true;
    case GgmlType::Q6_K:
      quantize_row_q6_k(src, static_cast<BlockQ6_K*>(dst), n, importance);
      return true;
    default:
      break;
  }
  if (importance == nullptr) return quantize_row(type, src, dst, n);
  switch (type) {
    case GgmlType::Q4_0:
      quantize_row_signed_impl(src, static_cast<BlockQ4_0*>(dst), n, importance, 8);
      return true;
    case GgmlType::Q5_0:
      quantize_row_signed_impl(src, static_cast<BlockQ5_0*>(dst), n, importance, 16);
      return true;
    case GgmlType::Q4_1:
      quantize_row_min_impl(src, static_cast<BlockQ4_1*>(dst), n, importance, 15);
      return true;
    case GgmlType::Q5_1:
      quantize_row_min_impl(src, static_cast<BlockQ5_1*>(dst), n, importance, 31);
      return true;
    default:
      // Q8_0 (ggml ignores the importance there), F16, F32, BF16: the plain conversion.
      return quantize_row(type, src, dst, n);
  }
}

}  // namespace tessera
