// attention.flash's online-softmax helpers (plugins/attention/flash/flash_kernel_impl.h):
// its exp (ggml's) against libm, the portable build against the AVX2 build bit for bit, and the
// grouped-query tile step (K/V read once for a group of heads) against per-head steps bit for
// bit. The kernel-level conformance tests only see d = 64 and whole outputs; these reach the
// odd head sizes and tails directly.
#include <doctest/doctest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "tessera/ggml_types.h"  // cpu_has_avx2

#define FLASH_CHECK_NS flash_check_portable
#include "support/flash_softmax_check.h"

namespace flash_check_avx2 {  // tests/support/flash_softmax_avx2.cpp
bool built_for_avx2();
float exp_one(float x);
double exp_row(const float* in, float* out, int32_t n, float max);
float max_row(const float* in, int32_t n);
void round_to_half(const float* in, float* out, int32_t n);
bool grouped_matches_per_head(int32_t group, int32_t d, int32_t cols, int32_t tiles, bool f16,
                              uint32_t seed);
}  // namespace flash_check_avx2

namespace {

// Distance in units in the last place between two positive finite floats.
int64_t ulp_distance(float a, float b) {
  int32_t ia, ib;
  std::memcpy(&ia, &a, sizeof a);
  std::memcpy(&ib, &b, sizeof b);
  return std::abs(static_cast<int64_t>(ia) - ib);
}

}  // namespace

TEST_CASE("attention.flash exp: within 2 ulp of libm on the softmax's domain") {
  CHECK(flash_check_portable::exp_one(0.0f) == 1.0f);  // a row's maximum contributes exactly 1
  CHECK(flash_check_portable::exp_one(-0.0f) == 1.0f);
  CHECK(flash_check_portable::exp_one(-std::numeric_limits<float>::infinity()) == 0.0f);
  CHECK(flash_check_portable::exp_one(-200.0f) == 0.0f);
  int64_t worst = 0;
  float worst_x = 0.0f;
  // Every 97th float in [-87.3, 0) (about 11 million values across the reduction's range).
  for (uint32_t mag = std::bit_cast<uint32_t>(87.3f); mag > 0; mag = mag > 97 ? mag - 97 : 0) {
    const float x = -std::bit_cast<float>(mag);
    const int64_t u = ulp_distance(flash_check_portable::exp_one(x), std::exp(x));
    if (u > worst) {
      worst = u;
      worst_x = x;
    }
  }
  MESSAGE("largest error vs std::exp: ", worst, " ulp at x = ", worst_x);
  CHECK(worst <= 2);
}

TEST_CASE("attention.flash exp, max and sum: the AVX2 build gives the portable build's bits") {
  if (!tessera::cpu_has_avx2()) {
    MESSAGE("CPU lacks AVX2/FMA/F16C: only the portable build exists here");
    return;
  }
  REQUIRE(flash_check_avx2::built_for_avx2());
  REQUIRE(!flash_check_portable::built_for_avx2());
  std::mt19937 rng(99);
  std::uniform_real_distribution<float> wide(-120.0f, 0.0f), narrow(-3.0f, 3.0f);
  for (float x : {0.0f, -0.0f, -1e-30f, -87.33654f, -87.3366f, -88.0f, -103.0f,
                  -std::numeric_limits<float>::infinity()})
    CHECK(std::bit_cast<uint32_t>(flash_check_avx2::exp_one(x)) ==
          std::bit_cast<uint32_t>(flash_check_portable::exp_one(x)));
  for (int32_t n = 1; n <= 70; ++n) {
    for (int trial = 0; trial < 20; ++trial) {
      std::vector<float> in(n), a(n), b(n);
      for (float& x : in) x = trial % 2 ? wide(rng) : narrow(rng);
      const float max_a = flash_check_avx2::max_row(in.data(), n);
      const float max_b = flash_check_portable::max_row(in.data(), n);
      CHECK(max_a == max_b);
      const double sa = flash_check_avx2::exp_row(in.data(), a.data(), n, max_a);
      const double sb = flash_check_portable::exp_row(in.data(), b.data(), n, max_b);
      CAPTURE(n);
      CHECK(std::memcmp(&sa, &sb, sizeof sa) == 0);
      CHECK(std::memcmp(a.data(), b.data(), n * sizeof(float)) == 0);
      // Lane vs tail: each probability is exp_one of its own argument, wherever it sits.
      for (int32_t c = 0; c < n; ++c)
        CHECK(std::bit_cast<uint32_t>(a[c]) ==
              std::bit_cast<uint32_t>(flash_check_portable::exp_one(in[c] - max_a)));
    }
  }
}

TEST_CASE("attention.flash: the grouped tile step (K/V read once per GQA group) gives per-head bits") {
  uint32_t seed = 1;
  for (int32_t group : {1, 2, 3, 4, 5, 7}) {
    for (int32_t d : {64, 72, 128, 20, 8}) {  // 72: an 8-wide tail; 20: not a multiple of 8
      for (bool f16 : {false, true}) {
        CAPTURE(group);
        CAPTURE(d);
        CAPTURE(f16);
        CHECK(flash_check_portable::grouped_matches_per_head(group, d, 19, 3, f16, seed));
        if (tessera::cpu_has_avx2())
          CHECK(flash_check_avx2::grouped_matches_per_head(group, d, 19, 3, f16, seed));
        ++seed;
      }
    }
  }
}

TEST_CASE("attention.flash: Q rounded to f16 by F16C gives the library conversion's bits") {
  if (!tessera::cpu_has_avx2()) {
    MESSAGE("CPU lacks AVX2/FMA/F16C: only the portable build exists here");
    return;
  }
  // Every 1021st non-NaN float of either sign: normal and subnormal halves, ties, overflow to
  // inf, underflow to zero. Run through both builds in blocks (the AVX2 build's vector lanes).
  std::vector<float> in, a, b;
  for (uint64_t bits = 0; bits < 0x7F800001u; bits += 1021) {
    const float x = std::bit_cast<float>(static_cast<uint32_t>(bits));
    in.push_back(x);
    in.push_back(-x);
  }
  in.push_back(std::numeric_limits<float>::infinity());
  in.push_back(65520.0f);  // rounds up to inf
  in.push_back(65519.996f);
  a.resize(in.size());
  b.resize(in.size());
  flash_check_avx2::round_to_half(in.data(), a.data(), static_cast<int32_t>(in.size()));
  flash_check_portable::round_to_half(in.data(), b.data(), static_cast<int32_t>(in.size()));
  size_t mismatches = 0;
  for (size_t i = 0; i < in.size(); ++i)
    mismatches += std::bit_cast<uint32_t>(a[i]) != std::bit_cast<uint32_t>(b[i]);
  CHECK(mismatches == 0);
}
