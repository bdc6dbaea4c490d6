// Entry points into attention.flash's inner-kernel helpers for tests/unit/test_flash_softmax.cpp.
// Included by that test (portable build) and by flash_softmax_avx2.cpp (compiled with the
// kernel's -mavx2 -mfma -mf16c), each with its own FLASH_CHECK_NS, so one test binary holds
// both builds of flash_kernel_impl.h (whose helpers have internal linkage) and can compare
// their bits.
#pragma once

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

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

// flash's scalar exp (the one alpha uses, and the vector tail's: ggml's).
float exp_one(float x) { return tessera::flash::ggml_expf_inline(x); }

// out[c] = exp(in[c] - max) through flash's row function (vector lanes + scalar tail); returns
// the row's double sum.
double exp_row(const float* in, float* out, int32_t n, float max) {
  std::memcpy(out, in, sizeof(float) * n);
  return tessera::flash::exp_sum_row(out, n, max);
}

float max_row(const float* in, int32_t n) { return tessera::flash::row_max(in, n); }

// flash's rounding of Q to f16 precision (an f16 cache).
void round_to_half(const float* in, float* out, int32_t n) {
  tessera::flash::round_queries(in, out, n, true);
}

// Runs `tiles` online-softmax tile steps of `group` query heads sharing one K/V head (random
// q, K, V; f16 or f32 K/V elements) twice: all heads together through tile_step_group (K/V
// read once per group) and each head alone through softmax_tile_step. True when the outputs,
// maxima and sums agree bit for bit.
bool grouped_matches_per_head(int32_t group, int32_t d, int32_t cols, int32_t tiles, bool f16,
                              uint32_t seed) {
  using namespace tessera::flash;
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  const size_t kv_n = static_cast<size_t>(tiles) * cols * d;
  std::vector<float> kf(kv_n), vf(kv_n), q(static_cast<size_t>(group) * d);
  std::vector<uint16_t> kh(kv_n), vh(kv_n);
  for (size_t i = 0; i < kv_n; ++i) {
    kh[i] = tessera::fp32_to_fp16(unit(rng));
    vh[i] = tessera::fp32_to_fp16(unit(rng));
    kf[i] = unit(rng);
    vf[i] = unit(rng);
  }
  for (float& x : q) x = 3.0f * unit(rng);
  const auto run = [&](bool grouped, auto* k, auto* v) {
    std::vector<float> o(static_cast<size_t>(group) * d, 0.0f), srow(static_cast<size_t>(group) * cols);
    std::vector<float> m(group, -std::numeric_limits<float>::infinity());
    std::vector<double> l(group, 0.0);
    for (int32_t t = 0; t < tiles; ++t) {
      // Tiles of decreasing width: the last one exercises the scalar tails.
      const int32_t w = t + 1 == tiles ? cols - 3 : cols;
      const size_t base = static_cast<size_t>(t) * cols * d;
      const auto k_at = [&](int32_t c) { return k + base + static_cast<size_t>(c) * d; };
      const auto v_at = [&](int32_t c) { return v + base + static_cast<size_t>(c) * d; };
      if (grouped) {
        tile_step_group(q.data(), k_at, v_at, w, d, 0.125f, srow.data(), o.data(), m.data(),
                        l.data(), group);
      } else {
        for (int32_t g = 0; g < group; ++g)
          softmax_tile_step(q.data() + g * d, k_at, v_at, w, d, 0.125f, srow.data(),
                            o.data() + g * d, &m[g], &l[g]);
      }
    }
    std::vector<float> all = o;
    all.insert(all.end(), m.begin(), m.end());
    for (double x : l) {
      float parts[2];
      std::memcpy(parts, &x, sizeof x);
      all.insert(all.end(), parts, parts + 2);
    }
    return all;
  };
  const std::vector<float> a = f16 ? run(true, kh.data(), vh.data()) : run(true, kf.data(), vf.data());
  const std::vector<float> b = f16 ? run(false, kh.data(), vh.data()) : run(false, kf.data(), vf.data());
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

}  // namespace FLASH_CHECK_NS
