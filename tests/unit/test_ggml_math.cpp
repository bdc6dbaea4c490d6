// ggml_expf: llama.cpp's vectorized exp evaluated per element. It must stay within its stated
// error of expf over the range softmax and SiLU use, and handle the edges like the vector code.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>

#include "tessera/ggml_types.h"

namespace {
// Distance in units in the last place between two finite floats of the same sign.
int64_t ulp_distance(float a, float b) {
  int32_t ia, ib;
  std::memcpy(&ia, &a, 4);
  std::memcpy(&ib, &b, 4);
  return std::llabs(static_cast<int64_t>(ia) - ib);
}
}  // namespace

TEST_CASE("ggml_expf stays within 2 ulp of expf on [-87, 88]") {
  int64_t worst = 0;
  for (float x = -87.0f; x <= 88.0f; x += 0.001953125f) {
    const float ref = std::exp(x);
    const float got = tessera::ggml_expf(x);
    REQUIRE(std::isfinite(got));
    worst = std::max(worst, ulp_distance(ref, got));
  }
  MESSAGE("worst distance to expf: " << worst << " ulp");
  CHECK(worst <= 2);
  CHECK(tessera::ggml_expf(0.0f) == 1.0f);
}

TEST_CASE("ggml_expf edges: -inf and very negative flush to zero, large overflow to inf") {
  CHECK(tessera::ggml_expf(-std::numeric_limits<float>::infinity()) == 0.0f);
  CHECK(tessera::ggml_expf(-200.0f) == 0.0f);
  CHECK(std::isinf(tessera::ggml_expf(200.0f)));
  // Subnormal results between the two flush points are still produced.
  CHECK(tessera::ggml_expf(-95.0f) > 0.0f);
  CHECK(tessera::ggml_expf(-95.0f) == doctest::Approx(std::exp(-95.0f)).epsilon(1e-3));
}

#include <random>
#include <vector>

#include "tessera/cpu_kernels.h"

TEST_CASE("dispatched SiLU*up and RoPE equal the portable build bit for bit") {
  // The AVX2 builds evaluate the same per-element operations (ggml's exp 8 lanes at a time,
  // hardware FMA instead of libm's fma), so they must agree to the bit — including the exp
  // polynomial's large-|n| branches and a tail that is not a multiple of 8.
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> wide(-120.0f, 120.0f);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  const int64_t n = 1536 + 5;
  std::vector<float> gate(n), up(n);
  for (int64_t i = 0; i < n; ++i) {
    gate[i] = i % 7 == 0 ? wide(rng) : normal(rng);
    up[i] = normal(rng);
  }
  std::vector<float> a = gate, b = gate;
  tessera::silu_mul_range(a.data(), up.data(), 0, n);
  tessera::silu_mul_range_scalar(b.data(), up.data(), 0, n);
  CHECK(std::memcmp(a.data(), b.data(), sizeof(float) * n) == 0);
  // Partial ranges (as thread pool splits produce) give the same elements.
  std::vector<float> c = gate;
  tessera::silu_mul_range(c.data(), up.data(), 0, 3);
  tessera::silu_mul_range(c.data(), up.data(), 3, n);
  CHECK(std::memcmp(c.data(), b.data(), sizeof(float) * n) == 0);

  const int32_t heads = 9, head_dim = 64, rows = 37;
  std::vector<float> x(static_cast<size_t>(rows) * heads * head_dim);
  for (auto& v : x) v = normal(rng);
  std::vector<int32_t> pos(rows);
  for (int32_t r = 0; r < rows; ++r) pos[r] = r * 53;
  for (bool neox : {false, true}) {
    std::vector<float> xa = x, xb = x;
    tessera::RopeRowsArgs args{xa.data(), pos.data(), heads, head_dim, head_dim, neox, 1.0f,
                               std::pow(10000.0f, -2.0f / head_dim)};
    tessera::rope_rows(args, 0, rows);
    args.x = xb.data();
    tessera::rope_rows_scalar(args, 0, rows);
    CHECK(std::memcmp(xa.data(), xb.data(), sizeof(float) * xa.size()) == 0);
  }
}

TEST_CASE("fp32_to_fp16_row (F16C where available) equals fp32_to_fp16 bit for bit") {
  // Every float whose upper 16 bits take each of the 65536 values, with low bits that make
  // ties (exactly half an fp16 step), just-above/below ties and random tails: covers the
  // fp16 normal and subnormal ranges, overflow to inf, zeros, infs and NaNs (a NaN in a group
  // of 8 sends that group the scalar way, so the NaN cases also test the fallback).
  std::mt19937 rng(17);
  std::vector<float> src;
  for (uint32_t hi = 0; hi < 65536; ++hi) {
    for (uint32_t lo : {0u, 0x1000u, 0x0FFFu, 0x1001u, 0x2000u, static_cast<uint32_t>(rng() & 0xFFFF)}) {
      const uint32_t bits = (hi << 16) | lo;
      float f;
      std::memcpy(&f, &bits, sizeof f);
      src.push_back(f);
    }
  }
  src.push_back(1.0f);  // a tail shorter than 8
  src.push_back(-0.0f);
  src.push_back(65520.0f);  // rounds to inf in fp16
  std::vector<uint16_t> got(src.size());
  tessera::fp32_to_fp16_row(src.data(), got.data(), static_cast<int64_t>(src.size()));
  size_t mismatches = 0;
  for (size_t i = 0; i < src.size(); ++i) mismatches += got[i] != tessera::fp32_to_fp16(src[i]);
  CHECK(mismatches == 0);
  CHECK(got[src.size() - 1] == 0x7C00);
}

TEST_CASE("sum_exp_shifted: both builds give the same bits, close to the double-precision sum") {
  std::mt19937 rng(3);
  std::normal_distribution<float> dist(0.0f, 4.0f);
  for (int64_t n : {0, 1, 7, 8, 9, 64, 1000, 49152}) {
    CAPTURE(n);
    std::vector<float> x(static_cast<size_t>(n));
    for (auto& v : x) v = dist(rng);
    const float shift = n > 0 ? *std::max_element(x.begin(), x.end()) : 0.0f;
    const double fast = tessera::sum_exp_shifted(x.data(), n, shift);
    const double portable = tessera::sum_exp_shifted_scalar(x.data(), n, shift);
    CHECK(std::memcmp(&fast, &portable, sizeof fast) == 0);
    double exact = 0.0;
    for (float v : x) exact += std::exp(static_cast<double>(v) - shift);
    // Each term within 1.5 ulp of float; the double sum adds nothing that size.
    CHECK(std::fabs(fast - exact) <= 2e-7 * exact);
  }
  // exp(-inf) terms (masked logits) add nothing.
  std::vector<float> masked(16, -std::numeric_limits<float>::infinity());
  masked[5] = 0.0f;
  CHECK(tessera::sum_exp_shifted(masked.data(), 16, 0.0f) == 1.0);
}

TEST_CASE("exp_shifted_row: both builds give the same bits; the sum is sum_exp_shifted's at divisor 1") {
  std::mt19937 rng(5);
  std::normal_distribution<float> dist(0.0f, 4.0f);
  for (int64_t n : {0, 1, 7, 8, 9, 64, 1000, 49152}) {
    for (float divisor : {1.0f, 0.7f, 1e-6f}) {
      CAPTURE(n);
      CAPTURE(divisor);
      std::vector<float> x(static_cast<size_t>(n));
      for (auto& v : x) v = dist(rng);
      const float shift = n > 0 ? *std::max_element(x.begin(), x.end()) : 0.0f;
      std::vector<float> fast(x.size(), -1.0f), portable(x.size(), -2.0f);
      const double fast_sum = tessera::exp_shifted_row(x.data(), fast.data(), n, shift, divisor);
      const double portable_sum =
          tessera::exp_shifted_row_scalar(x.data(), portable.data(), n, shift, divisor);
      CHECK(std::memcmp(&fast_sum, &portable_sum, sizeof fast_sum) == 0);
      CHECK(fast == portable);  // the same bits: no NaN here, and -0 does not arise from exp
      double exact = 0.0, written = 0.0;
      size_t far = 0;
      for (size_t i = 0; i < x.size(); ++i) {
        // The argument as both builds round it (float subtract, IEEE divide), then each
        // value within ggml's exp's 1.5 ulp of the exact exponential of that argument.
        const float arg = (x[i] - shift) / divisor;
        const double e = std::exp(static_cast<double>(arg));
        exact += e;
        written += fast[i];
        far += std::fabs(fast[i] - e) > 2e-7 * e + 1e-38;
      }
      CHECK(far == 0);
      CHECK(std::fabs(fast_sum - exact) <= 2e-7 * exact);
      CHECK(std::fabs(fast_sum - written) <= 1e-12 * exact);
      if (divisor == 1.0f) {
        const double plain = tessera::sum_exp_shifted(x.data(), n, shift);
        CHECK(std::memcmp(&plain, &fast_sum, sizeof plain) == 0);
      }
    }
  }
}

TEST_CASE("gelu_mul_range: ggml's f16-table GELU (tanh form) times up") {
  // The table holds f16(gelu(x)) for every half x (checked against libggml-cpu's
  // ggml_table_gelu_f16: all 65,536 entries equal); here against the formula in double.
  const auto gelu = [](double x) {
    return 0.5 * x * (1.0 + std::tanh(0.79788456080286535587989211986876 * x * (1.0 + 0.044715 * x * x)));
  };
  std::vector<float> gate, up;
  for (float x = -12.0f; x <= 12.0f; x += 0.01953125f) {
    gate.push_back(x);
    up.push_back(1.5f);
  }
  std::vector<float> out = gate;
  tessera::gelu_mul_range(out.data(), up.data(), 0, static_cast<int64_t>(out.size()));
  for (size_t i = 0; i < gate.size(); ++i) {
    const float x = gate[i];
    CAPTURE(x);
    if (x <= -10.0f) {
      CHECK(out[i] == 0.0f);
    } else if (x >= 10.0f) {
      CHECK(out[i] == x * 1.5f);
    } else {
      // x is rounded to f16 (relative 2^-11) and so is gelu(x): within a few f16 ulps.
      const double want = gelu(tessera::fp16_to_fp32(tessera::fp32_to_fp16(x))) * 1.5;
      CHECK(std::fabs(out[i] - want) <= 2e-3 * std::max(1.0, std::fabs(want)));
      CHECK(out[i] == tessera::fp16_to_fp32(tessera::gelu_f16_table_entry(tessera::fp32_to_fp16(x))) * 1.5f);
    }
  }
}

TEST_CASE("argmax_row: std::max_element's index in both builds, ties, signed zeros and NaNs included") {
  std::mt19937 rng(11);
  std::normal_distribution<float> dist(0.0f, 4.0f);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  const auto reference = [](const std::vector<float>& x) {
    return static_cast<int64_t>(std::max_element(x.begin(), x.end()) - x.begin());
  };
  const auto check = [&](const std::vector<float>& x) {
    const auto n = static_cast<int64_t>(x.size());
    CHECK(tessera::argmax_row(x.data(), n) == reference(x));
    CHECK(tessera::argmax_row_scalar(x.data(), n) == reference(x));
  };
  for (int64_t n : {1, 2, 7, 8, 31, 32, 33, 63, 64, 100, 1000, 49152}) {
    CAPTURE(n);
    std::vector<float> x(static_cast<size_t>(n));
    for (auto& v : x) v = dist(rng);
    check(x);
    // The greatest at every position class: first, in the 32-lane body, in the tail, last.
    for (int64_t at : {int64_t{0}, n / 2, n - 1}) {
      std::vector<float> y = x;
      y[static_cast<size_t>(at)] = 100.0f;
      check(y);
      // A tie later keeps the first; an equal value earlier becomes the answer.
      if (at + 1 < n) {
        y[static_cast<size_t>(n - 1)] = 100.0f;
        check(y);
      }
      if (at > 0) {
        y[0] = 100.0f;
        check(y);
      }
    }
    // Signed zeros: -0 and +0 compare equal, so the first of them wins.
    std::vector<float> zeros(static_cast<size_t>(n), -1.0f);
    zeros[static_cast<size_t>(n / 3)] = -0.0f;
    zeros[static_cast<size_t>(n - 1)] = 0.0f;
    check(zeros);
    // All -inf: index 0. NaNs after x[0] are passed over; a NaN at x[0] is the answer.
    check(std::vector<float>(static_cast<size_t>(n), -inf));
    std::vector<float> with_nan = x;
    with_nan[static_cast<size_t>(n - 1)] = nan;
    if (n > 2) with_nan[static_cast<size_t>(n / 2)] = nan;
    check(with_nan);
    with_nan[0] = nan;
    check(with_nan);
  }
}
