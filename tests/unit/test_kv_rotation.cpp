// tessera/kv_rotation.h: the Hadamard rotation a q8_0 KV cache stores its rows in. It is
// Sylvester's matrix over sqrt(n) (checked against the matrix built as llama.cpp builds it),
// orthonormal (dot products kept, applying it twice gives the row back), spans the blocks
// llama.cpp uses, and it does what it is for: a K row with outliers loses less to Q8_0 rounding
// when it is rotated first.
#include <doctest/doctest.h>

#include <cmath>
#include <random>
#include <vector>

#include "tessera/ggml_types.h"
#include "tessera/kv_rotation.h"
#include "tessera/sdk/kv_rows.h"

using namespace tessera;

namespace {

// Sylvester's H_n / sqrt(n), built by doubling as llama.cpp's ggml_gen_hadamard does.
std::vector<double> sylvester(int32_t n) {
  std::vector<double> h(static_cast<size_t>(n) * n, 0.0);
  h[0] = 1.0 / std::sqrt(static_cast<double>(n));
  for (int32_t s = 1; s < n; s *= 2)
    for (int32_t i = 0; i < s; ++i)
      for (int32_t j = 0; j < s; ++j) {
        const double v = h[static_cast<size_t>(i) * n + j];
        h[static_cast<size_t>(i + s) * n + j] = v;
        h[static_cast<size_t>(i) * n + j + s] = v;
        h[static_cast<size_t>(i + s) * n + j + s] = -v;
      }
  return h;
}

std::vector<float> random_row(std::mt19937& rng, size_t n) {
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> x(n);
  for (float& v : x) v = dist(rng);
  return x;
}

double dot(const float* a, const float* b, int32_t n) {
  double s = 0.0;
  for (int32_t i = 0; i < n; ++i) s += static_cast<double>(a[i]) * b[i];
  return s;
}

}  // namespace

TEST_CASE("kv rotation blocks: the largest power of two dividing the head for K, 64 for V") {
  CHECK(kv_k_rotation_block(64) == 64);
  CHECK(kv_k_rotation_block(128) == 128);
  CHECK(kv_k_rotation_block(256) == 256);  // Gemma 3
  CHECK(kv_k_rotation_block(192) == 64);
  CHECK(kv_k_rotation_block(320) == 64);
  CHECK(kv_k_rotation_block(96) == 0);  // not a multiple of 64: stored unrotated
  CHECK(kv_k_rotation_block(32) == 0);
  CHECK(kv_k_rotation_block(0) == 0);
  CHECK(kv_v_rotation_block(64) == 64);
  CHECK(kv_v_rotation_block(256) == 64);
  CHECK(kv_v_rotation_block(96) == 0);
}

TEST_CASE("hadamard_rotate is Sylvester's H / sqrt(n), orthonormal and its own inverse") {
  std::mt19937 rng(2026);
  for (int32_t n : {64, 128, 256}) {
    CAPTURE(n);
    const std::vector<double> h = sylvester(n);
    const int64_t blocks = 3;
    std::vector<float> x = random_row(rng, static_cast<size_t>(n) * blocks);
    std::vector<float> y = random_row(rng, x.size());
    std::vector<float> rx = x, ry = y;
    hadamard_rotate(rx.data(), blocks, n);
    hadamard_rotate(ry.data(), blocks, n);
    for (int64_t b = 0; b < blocks; ++b) {
      const float* xb = x.data() + b * n;
      for (int32_t i = 0; i < n; ++i) {
        double want = 0.0;
        for (int32_t j = 0; j < n; ++j) want += h[static_cast<size_t>(i) * n + j] * xb[j];
        REQUIRE(std::abs(rx[b * n + i] - want) <= 1e-5 * (1.0 + std::abs(want)));
      }
      // Orthonormal: a score computed from rotated Q and K is the score.
      const double before = dot(xb, y.data() + b * n, n);
      const double after = dot(rx.data() + b * n, ry.data() + b * n, n);
      CHECK(std::abs(after - before) <= 1e-4 * (1.0 + std::abs(before)));
    }
    std::vector<float> back = rx;
    hadamard_rotate(back.data(), blocks, n);
    for (size_t i = 0; i < x.size(); ++i) REQUIRE(std::abs(back[i] - x[i]) <= 1e-5f * (1.0f + std::abs(x[i])));
  }
}

TEST_CASE("a K row with outliers loses less to Q8_0 rounding rotated than as computed") {
  // K rows of real models carry a few channels far larger than the rest; one Q8_0 scale per
  // 32 elements then follows the outlier. Measured on the score error q . k_quantized - q . k
  // over many queries, rotated (both sides, as the runner does) against not.
  std::mt19937 rng(7);
  constexpr int32_t n = 64;
  double err_plain = 0.0, err_rotated = 0.0;
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<float> k = random_row(rng, n);
    k[trial % n] *= 30.0f;  // an outlier channel
    k[(trial * 7 + 3) % n] *= 12.0f;
    const std::vector<float> q = random_row(rng, n);
    const double exact = dot(q.data(), k.data(), n);
    const auto q8_roundtrip = [](const std::vector<float>& row) {
      std::vector<KvBlockQ8_0> blocks(n / kKvQ8BlockElems);
      REQUIRE(quantize_activation_row(GgmlType::Q8_0, row.data(), blocks.data(), n));
      std::vector<float> out(n);
      widen_kv_row(KvDtype::kQ8_0, blocks.data(), out.data(), n);
      return out;
    };
    const std::vector<float> kq = q8_roundtrip(k);
    err_plain += std::pow(dot(q.data(), kq.data(), n) - exact, 2);
    std::vector<float> rk = k, rq = q;
    hadamard_rotate(rk.data(), 1, n);
    hadamard_rotate(rq.data(), 1, n);
    const std::vector<float> rkq = q8_roundtrip(rk);
    err_rotated += std::pow(dot(rq.data(), rkq.data(), n) - exact, 2);
  }
  MESSAGE("RMS score error over 200 rows: as computed ", std::sqrt(err_plain / 200), ", rotated ",
          std::sqrt(err_rotated / 200));
  CHECK(err_rotated * 4.0 < err_plain);  // at least 2x smaller RMS error
}
