// Tests of the GGML block kernels: reference quantize/dequantize (bit-level checks on hand-built
// blocks, round-trip error bounds), the scalar dot products against a float dot of the
// dequantized rows, and the AVX2 kernels against the scalar ones.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <utility>
#include <vector>

#include "tessera/ggml_types.h"

using tessera::GgmlType;

namespace {

// Block layouts as ggml defines them, restated here so the tests do not depend on the
// implementation's internal header.
struct Q4_0Block {
  uint16_t d;
  uint8_t qs[16];
};
struct Q4_1Block {
  uint16_t d, m;
  uint8_t qs[16];
};
struct Q5_0Block {
  uint16_t d;
  uint8_t qh[4];  // bit j (little-endian uint32) = bit 4 of element j
  uint8_t qs[16];
};
struct Q5_1Block {
  uint16_t d, m;
  uint8_t qh[4];
  uint8_t qs[16];
};
struct Q8_0Block {
  uint16_t d;
  int8_t qs[32];
};
struct Q8_1Block {
  uint16_t d, s;
  int8_t qs[32];
};
struct Q4_KBlock {
  uint16_t d, dmin;
  uint8_t scales[12];
  uint8_t qs[128];
};
struct Q5_KBlock {
  uint16_t d, dmin;
  uint8_t scales[12];
  uint8_t qh[32];
  uint8_t qs[128];
};
struct Q6_KBlock {
  uint8_t ql[128];
  uint8_t qh[64];
  int8_t scales[16];
  uint16_t d;
};
struct Q8_KBlock {
  float d;
  int8_t qs[256];
  int16_t bsums[16];
};
static_assert(sizeof(Q4_0Block) == 18 && sizeof(Q4_1Block) == 20 && sizeof(Q8_0Block) == 34 &&
              sizeof(Q8_1Block) == 36 && sizeof(Q4_KBlock) == 144 && sizeof(Q6_KBlock) == 210 &&
              sizeof(Q5_KBlock) == 176 &&
              sizeof(Q8_KBlock) == 292 && sizeof(Q5_0Block) == 22 && sizeof(Q5_1Block) == 24);

std::vector<float> random_floats(int64_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& x : v) x = dist(rng);
  return v;
}

std::vector<uint8_t> quantize(GgmlType type, const std::vector<float>& x) {
  const int64_t n = static_cast<int64_t>(x.size());
  std::vector<uint8_t> out(tessera::ggml_row_size(type, n));
  REQUIRE(tessera::quantize_row(type, x.data(), out.data(), n));
  return out;
}

std::vector<float> dequantize(GgmlType type, const void* data, int64_t n) {
  std::vector<float> out(static_cast<size_t>(n));
  REQUIRE(tessera::dequantize_row(type, data, out.data(), n));
  return out;
}

bool is_k_quant(GgmlType t) {
  return t == GgmlType::Q4_K || t == GgmlType::Q5_K || t == GgmlType::Q6_K;
}

// Whether a row of n elements is whole blocks of t (the K-quants need multiples of 256).
bool fits(GgmlType t, int64_t n) { return n % tessera::ggml_type_traits(t).block_size == 0; }

// A weight row of type t. The K-quants have no quantizer here (GGUF files bring them already
// quantized), so their rows are random bytes — every bit pattern is a valid block — with the
// fp16 super-block scales set to values that keep the weights in a model-like range.
std::vector<uint8_t> weight_row(GgmlType t, int64_t n, uint32_t seed, float scale, float offset) {
  if (!is_k_quant(t)) {
    std::vector<float> f = random_floats(n, seed, scale);
    for (auto& v : f) v += offset;
    return quantize(t, f);
  }
  std::mt19937 rng(seed);
  std::vector<uint8_t> w(tessera::ggml_row_size(t, n));
  for (auto& b : w) b = static_cast<uint8_t>(rng());
  std::uniform_real_distribution<float> u(0.5f, 1.5f);
  for (int64_t ib = 0; ib < n / 256; ++ib) {
    if (t == GgmlType::Q4_K) {
      auto* b = reinterpret_cast<Q4_KBlock*>(w.data()) + ib;
      b->d = tessera::fp32_to_fp16(scale * 0.002f * u(rng));     // d * 63 * 15 ~ 2 * scale
      b->dmin = tessera::fp32_to_fp16(scale * 0.001f * u(rng));
    } else if (t == GgmlType::Q5_K) {
      auto* b = reinterpret_cast<Q5_KBlock*>(w.data()) + ib;
      b->d = tessera::fp32_to_fp16(scale * 0.001f * u(rng));     // d * 63 * 31 ~ 2 * scale
      b->dmin = tessera::fp32_to_fp16(scale * 0.001f * u(rng));
    } else {
      auto* b = reinterpret_cast<Q6_KBlock*>(w.data()) + ib;
      b->d = tessera::fp32_to_fp16(scale * 0.0005f * u(rng));    // d * 128 * 32 ~ 2 * scale
    }
  }
  return w;
}

// ggml's packing of 8 (scale, min) pairs of 6 bits into Q4_K's / Q5_K's 12 bytes: the upper
// four pairs keep their 2-bit high parts in bytes 0-7.
void pack_k4_scales(const uint8_t* ls, const uint8_t* lm, uint8_t* scales) {
  for (int j = 0; j < 8; ++j) {
    if (j < 4) {
      scales[j] = ls[j];
      scales[j + 4] = lm[j];
    } else {
      scales[j + 4] = static_cast<uint8_t>((ls[j] & 0xF) | ((lm[j] & 0xF) << 4));
      scales[j - 4] |= static_cast<uint8_t>((ls[j] >> 4) << 6);
      scales[j] |= static_cast<uint8_t>((lm[j] >> 4) << 6);
    }
  }
}

float max_abs(const float* x, int n) {
  float m = 0.0f;
  for (int i = 0; i < n; ++i) m = std::max(m, std::fabs(x[i]));
  return m;
}

// A weight row and an activation row already converted to the weight's vec-dot type, plus
// what an exact dot of their dequantized values looks like.
struct DotCase {
  GgmlType type;
  int64_t n;
  std::vector<uint8_t> w;
  std::vector<uint8_t> x;
  double exact = 0.0;     // dot of the dequantized rows in double
  double abs_sum = 0.0;   // sum of |products|: the scale any float summation error is relative to
};

DotCase make_dot_case(GgmlType type, int64_t n, uint32_t seed) {
  DotCase c{type, n, {}, {}};
  // Weights with an offset so Q4_1's min term is not trivially small.
  c.w = weight_row(type, n, seed, 0.5f, 0.1f);
  const std::vector<float> xf = random_floats(n, seed + 1000, 2.0f);
  c.x = quantize(tessera::vec_dot_type(type), xf);
  const std::vector<float> wd = dequantize(type, c.w.data(), n);
  const std::vector<float> xd = dequantize(tessera::vec_dot_type(type), c.x.data(), n);
  for (int64_t i = 0; i < n; ++i) {
    const double p = static_cast<double>(wd[i]) * xd[i];
    c.exact += p;
    c.abs_sum += std::fabs(p);
  }
  return c;
}

const GgmlType kDotTypes[] = {GgmlType::F32,  GgmlType::F16,  GgmlType::Q4_0,
                              GgmlType::Q4_1, GgmlType::Q5_0, GgmlType::Q5_1,
                              GgmlType::Q8_0, GgmlType::Q4_K, GgmlType::Q5_K,
                              GgmlType::Q6_K};

// Sum over blocks of |m_w * s_x| for the types with a min term taken from Q8_1's s (Q4_1,
// Q5_1; 0 for the others). s = fp16(d * sum q) is not fp16(d) * sum q, so the dots of these
// types are only as close to the dequantized dot as this term's fp16 roundings allow.
double min_term_scale(const DotCase& c) {
  if (c.type != GgmlType::Q4_1 && c.type != GgmlType::Q5_1) return 0.0;
  const size_t w_bytes = tessera::ggml_type_traits(c.type).type_size;
  const auto* x = reinterpret_cast<const Q8_1Block*>(c.x.data());
  double sum = 0.0;
  for (int64_t ib = 0; ib < c.n / 32; ++ib) {
    uint16_t m;  // Q4_1 and Q5_1 both store m right after d
    std::memcpy(&m, c.w.data() + ib * w_bytes + 2, sizeof m);
    sum += std::fabs(tessera::fp16_to_fp32(m) * tessera::fp16_to_fp32(x[ib].s));
  }
  return sum;
}

}  // namespace

TEST_CASE("dispatch tables: vec_dot_type, has_vec_dot, unsupported types") {
  CHECK(tessera::vec_dot_type(GgmlType::F32) == GgmlType::F32);
  CHECK(tessera::vec_dot_type(GgmlType::F16) == GgmlType::F16);
  CHECK(tessera::vec_dot_type(GgmlType::Q4_0) == GgmlType::Q8_0);
  CHECK(tessera::vec_dot_type(GgmlType::Q4_1) == GgmlType::Q8_1);
  CHECK(tessera::vec_dot_type(GgmlType::Q5_0) == GgmlType::Q8_0);
  CHECK(tessera::vec_dot_type(GgmlType::Q5_1) == GgmlType::Q8_1);
  CHECK(tessera::vec_dot_type(GgmlType::Q8_0) == GgmlType::Q8_0);
  CHECK(tessera::vec_dot_type(GgmlType::Q4_K) == GgmlType::Q8_K);
  CHECK(tessera::vec_dot_type(GgmlType::Q6_K) == GgmlType::Q8_K);
  CHECK(tessera::vec_dot_type(GgmlType::BF16) == GgmlType::F32);
  CHECK(tessera::vec_dot_type(GgmlType::Q5_K) == GgmlType::Q8_K);
  CHECK(tessera::vec_dot_type(GgmlType::Q3_K) == GgmlType::F32);
  for (GgmlType t : kDotTypes) CHECK(tessera::has_vec_dot(t));
  CHECK_FALSE(tessera::has_vec_dot(GgmlType::BF16));
  CHECK_FALSE(tessera::has_vec_dot(GgmlType::Q3_K));
  CHECK_FALSE(tessera::has_vec_dot(GgmlType::Q8_K));  // an activation format only
  CHECK(tessera::ggml_row_size(GgmlType::Q8_K, 1024) == 4 * 292);

  std::vector<float> f(256, 1.0f);
  std::vector<uint8_t> buf(4096);
  CHECK_FALSE(tessera::quantize_row(GgmlType::Q3_K, f.data(), buf.data(), 256));
  CHECK_FALSE(tessera::dequantize_row(GgmlType::Q3_K, buf.data(), f.data(), 256));
  CHECK_FALSE(tessera::quantize_weight_row(GgmlType::Q3_K, f.data(), buf.data(), 256, nullptr));
  // Misuse is loud, not a silent zero.
  CHECK(std::isnan(tessera::vec_dot_scalar(GgmlType::Q3_K, 256, buf.data(), buf.data())));
  CHECK(std::isnan(tessera::vec_dot(GgmlType::Q3_K, 256, buf.data(), buf.data())));
}

TEST_CASE("Q8_0 known block: d = amax/127, roundf rounds halves away from zero") {
  // amax = 127 makes d = 1 and id = 1 exactly, so q = roundf(x) and every tie is visible.
  float x[32];
  for (int j = 0; j < 31; ++j) x[j] = static_cast<float>(j - 16) + 0.5f;  // -15.5 .. 14.5
  x[31] = 127.0f;
  Q8_0Block b{};
  REQUIRE(tessera::quantize_row(GgmlType::Q8_0, x, &b, 32));
  CHECK(b.d == 0x3C00);  // fp16 1.0
  for (int j = 0; j < 31; ++j) {
    const int expected = (x[j] < 0) ? -(16 - j) : (j - 16 + 1);  // away from zero
    CHECK(b.qs[j] == expected);
  }
  CHECK(b.qs[31] == 127);
  CHECK(b.qs[0] == -16);   // -15.5 -> -16 (nearest-even would also give -16)
  CHECK(b.qs[17] == 2);    // 1.5 -> 2
  CHECK(b.qs[18] == 3);    // 2.5 -> 3 (nearest-even would give 2)
  CHECK(b.qs[15] == -1);   // -0.5 -> -1 (nearest-even would give 0)

  float y[32];
  REQUIRE(tessera::dequantize_row(GgmlType::Q8_0, &b, y, 32));
  for (int j = 0; j < 32; ++j) CHECK(y[j] == static_cast<float>(b.qs[j]));

  // A ramp with a non-trivial scale: d is stored as fp16 of amax/127.
  float r[32];
  for (int j = 0; j < 32; ++j) r[j] = 0.25f * static_cast<float>(j - 16);  // amax = 4
  REQUIRE(tessera::quantize_row(GgmlType::Q8_0, r, &b, 32));
  CHECK(b.d == tessera::fp32_to_fp16(4.0f / 127.0f));
  CHECK(b.qs[0] == -127);
  CHECK(b.qs[16] == 0);
  CHECK(b.qs[24] == 64);   // 2.0 * 31.75 = 63.5 (in float arithmetic) -> 64
}

TEST_CASE("Q8_0 of an all-zero block has d = 0 and zero quants") {
  float x[32] = {};
  Q8_0Block b;
  std::memset(&b, 0x55, sizeof b);
  REQUIRE(tessera::quantize_row(GgmlType::Q8_0, x, &b, 32));
  CHECK(b.d == 0);
  for (int j = 0; j < 32; ++j) CHECK(b.qs[j] == 0);
}

TEST_CASE("Q8_1 stores s = fp16(d * sum(q)) with the unrounded float d") {
  float x[32];
  for (int j = 0; j < 31; ++j) x[j] = static_cast<float>(j - 16) + 0.5f;
  x[31] = 127.0f;
  Q8_1Block b{};
  REQUIRE(tessera::quantize_row(GgmlType::Q8_1, x, &b, 32));
  CHECK(b.d == 0x3C00);
  int sum = 0;
  for (int j = 0; j < 32; ++j) sum += b.qs[j];
  // Quants are the same as Q8_0's (-16..-1, 1..15, 127): sum = -136 + 120 + 127 = 111.
  CHECK(sum == 111);
  CHECK(b.s == tessera::fp32_to_fp16(111.0f));

  // Random blocks: s uses d = amax/127 before fp16 rounding, as ggml's quantize_row_q8_1_ref.
  const std::vector<float> v = random_floats(32 * 64, 7, 3.0f);
  const std::vector<uint8_t> q = quantize(GgmlType::Q8_1, v);
  const auto* blocks = reinterpret_cast<const Q8_1Block*>(q.data());
  for (int ib = 0; ib < 64; ++ib) {
    const float d = max_abs(&v[ib * 32], 32) / 127.0f;
    int s = 0;
    for (int j = 0; j < 32; ++j) {
      s += blocks[ib].qs[j];
      CHECK(blocks[ib].qs[j] == static_cast<int8_t>(std::roundf(v[ib * 32 + j] * (1.0f / d))));
    }
    CHECK(blocks[ib].d == tessera::fp32_to_fp16(d));
    CHECK(blocks[ib].s == tessera::fp32_to_fp16(static_cast<float>(s) * d));
  }

  // Q8_1 quants equal Q8_0 quants of the same data; only the header differs.
  const std::vector<uint8_t> q0 = quantize(GgmlType::Q8_0, v);
  const auto* b0 = reinterpret_cast<const Q8_0Block*>(q0.data());
  for (int ib = 0; ib < 64; ++ib) {
    CHECK(b0[ib].d == blocks[ib].d);
    CHECK(std::memcmp(b0[ib].qs, blocks[ib].qs, 32) == 0);
  }
}

TEST_CASE("Q4_0 known blocks: d = max/-8, nibble order, clipping at 15") {
  // Signed max is -8 -> d = 1, id = 1; q = trunc(x + 8.5).
  float x[32];
  for (int j = 0; j < 16; ++j) x[j] = static_cast<float>(j - 8);       // q = j
  for (int j = 0; j < 16; ++j) x[16 + j] = static_cast<float>(7 - j);  // q = 15 - j
  Q4_0Block b{};
  REQUIRE(tessera::quantize_row(GgmlType::Q4_0, x, &b, 32));
  CHECK(b.d == 0x3C00);
  for (int j = 0; j < 16; ++j) {
    CHECK((b.qs[j] & 0xF) == j);          // element j in the low nibble
    CHECK((b.qs[j] >> 4) == 15 - j);      // element j + 16 in the high nibble
  }
  float y[32];
  REQUIRE(tessera::dequantize_row(GgmlType::Q4_0, &b, y, 32));
  for (int j = 0; j < 32; ++j) CHECK(y[j] == x[j]);

  // Positive max 8 -> d = -1; -8 maps to 16.5 -> 16, clipped to 15, i.e. -7 after dequant.
  float z[32] = {};
  z[0] = 8.0f;
  z[1] = -8.0f;
  REQUIRE(tessera::quantize_row(GgmlType::Q4_0, z, &b, 32));
  CHECK(b.d == 0xBC00);  // fp16 -1.0
  CHECK((b.qs[0] & 0xF) == 0);
  CHECK((b.qs[1] & 0xF) == 15);
  CHECK((b.qs[2] & 0xF) == 8);
  REQUIRE(tessera::dequantize_row(GgmlType::Q4_0, &b, y, 32));
  CHECK(y[0] == 8.0f);
  CHECK(y[1] == -7.0f);
  for (int j = 2; j < 32; ++j) CHECK(y[j] == 0.0f);
}

TEST_CASE("Q4_1 known block: d = (max-min)/15, m = min, q = trunc((x-min)/d + 0.5)") {
  float x[32];
  for (int j = 0; j < 16; ++j) x[j] = static_cast<float>(j - 2);       // min -2 .. 13
  for (int j = 0; j < 16; ++j) x[16 + j] = static_cast<float>(13 - j);
  x[3] = -0.5f;  // (x - min) = 1.5 -> +0.5 = 2.0 -> q = 2 (a tie rounds up)
  x[4] = 0.49f;  // 2.49 + 0.5 = 2.99 -> q = 2 (truncation, not round-half-even)
  Q4_1Block b{};
  REQUIRE(tessera::quantize_row(GgmlType::Q4_1, x, &b, 32));
  CHECK(b.d == 0x3C00);  // 15 / 15 = 1
  CHECK(b.m == 0xC000);  // fp16 -2.0
  for (int j = 0; j < 16; ++j) {
    const int lo = (j == 3) ? 2 : (j == 4 ? 2 : j);
    CHECK((b.qs[j] & 0xF) == lo);
    CHECK((b.qs[j] >> 4) == 15 - j);
  }
  float y[32];
  REQUIRE(tessera::dequantize_row(GgmlType::Q4_1, &b, y, 32));
  for (int j = 0; j < 32; ++j) {
    const float expected = (j == 3 || j == 4) ? 0.0f : x[j];
    CHECK(y[j] == expected);
  }

  // A constant block: d = 0, so id = 0 and every q is 0; dequant gives m back.
  float c[32];
  for (auto& v : c) v = 1.5f;
  REQUIRE(tessera::quantize_row(GgmlType::Q4_1, c, &b, 32));
  CHECK(b.d == 0);
  CHECK(b.m == tessera::fp32_to_fp16(1.5f));
  REQUIRE(tessera::dequantize_row(GgmlType::Q4_1, &b, y, 32));
  for (int j = 0; j < 32; ++j) CHECK(y[j] == 1.5f);
}

// The 5-bit quant of element j in the known-block tests below: a permutation of 0..31 (7 is
// odd), so every value appears once and the fifth bits are set in an irregular pattern.
int q5_pattern(int j) { return (7 * j + 3) % 32; }

// Checks the low nibbles and the fifth-bit mask of a Q5 block against the quants q5_pattern
// gives: element j < 16 in the low nibble of qs[j], element j + 16 in the high nibble, and bit
// 4 of element j at bit j % 8 of qh[j / 8].
void check_q5_layout(const uint8_t* qs, const uint8_t* qh) {
  for (int j = 0; j < 16; ++j) {
    CAPTURE(j);
    CHECK((qs[j] & 0xF) == (q5_pattern(j) & 0xF));
    CHECK((qs[j] >> 4) == (q5_pattern(j + 16) & 0xF));
  }
  for (int j = 0; j < 32; ++j) {
    CAPTURE(j);
    CHECK(((qh[j / 8] >> (j % 8)) & 1) == (q5_pattern(j) >> 4));
  }
}

TEST_CASE("Q5_0 known block: d = max/-16, nibbles plus a 32-bit mask of fifth bits") {
  // Values q - 16 with the signed extreme -16 (q = 0): d = 1, id = 1, q = trunc(x + 16.5).
  float x[32];
  for (int j = 0; j < 32; ++j) x[j] = static_cast<float>(q5_pattern(j) - 16);
  Q5_0Block b{};
  REQUIRE(tessera::quantize_row(GgmlType::Q5_0, x, &b, 32));
  CHECK(b.d == 0x3C00);
  check_q5_layout(b.qs, b.qh);
  float y[32];
  REQUIRE(tessera::dequantize_row(GgmlType::Q5_0, &b, y, 32));
  for (int j = 0; j < 32; ++j) CHECK(y[j] == x[j]);

  // Positive max 16 -> d = -1; -16 maps to 32.5 -> 32, clipped to 31, i.e. -15 after dequant.
  float z[32] = {};
  z[0] = 16.0f;
  z[17] = -16.0f;
  REQUIRE(tessera::quantize_row(GgmlType::Q5_0, z, &b, 32));
  CHECK(b.d == 0xBC00);  // fp16 -1.0
  CHECK((b.qs[0] & 0xF) == 0);        // q = 0: nibble 0, fifth bit clear
  CHECK((b.qs[1] >> 4) == 15);        // element 17: q = 31
  CHECK((b.qs[2] & 0xF) == 0);        // zeros are q = 16: nibble 0, fifth bit set
  uint32_t qh;
  std::memcpy(&qh, b.qh, sizeof qh);  // little-endian, as ggml reads it
  CHECK(qh == 0xFFFFFFFEu);           // every element but element 0 has q >= 16
  REQUIRE(tessera::dequantize_row(GgmlType::Q5_0, &b, y, 32));
  CHECK(y[0] == 16.0f);
  CHECK(y[17] == -15.0f);
  for (int j = 1; j < 32; ++j) {
    if (j != 17) CHECK(y[j] == 0.0f);
  }
}

TEST_CASE("Q5_1 known block: d = (max-min)/31, m = min, fifth bits in qh") {
  float x[32];
  for (int j = 0; j < 32; ++j) x[j] = static_cast<float>(q5_pattern(j) - 3);  // min -3, max 28
  Q5_1Block b{};
  REQUIRE(tessera::quantize_row(GgmlType::Q5_1, x, &b, 32));
  CHECK(b.d == 0x3C00);  // 31 / 31 = 1
  CHECK(b.m == 0xC200);  // fp16 -3.0
  check_q5_layout(b.qs, b.qh);
  float y[32];
  REQUIRE(tessera::dequantize_row(GgmlType::Q5_1, &b, y, 32));
  for (int j = 0; j < 32; ++j) CHECK(y[j] == x[j]);

  // A constant block: d = 0, every q is 0 (no fifth bits); dequant gives m back.
  float c[32];
  for (auto& v : c) v = -2.25f;
  REQUIRE(tessera::quantize_row(GgmlType::Q5_1, c, &b, 32));
  CHECK(b.d == 0);
  CHECK(b.m == tessera::fp32_to_fp16(-2.25f));
  for (int k = 0; k < 4; ++k) CHECK(b.qh[k] == 0);
  REQUIRE(tessera::dequantize_row(GgmlType::Q5_1, &b, y, 32));
  for (int j = 0; j < 32; ++j) CHECK(y[j] == -2.25f);
}

TEST_CASE("Q5 dots on hand-built blocks are exact in every implementation") {
  // Unit scales: every integer and float partial sum is exactly representable, so scalar and
  // AVX2 must both give the exact dot. The weights walk through all 32 quants (fifth bit set
  // and clear in both nibble halves); the activations are +-127 with an irregular sign.
  const int64_t n = 128;
  std::vector<Q5_0Block> w0(n / 32);
  std::vector<Q5_1Block> w1(n / 32);
  std::vector<Q8_0Block> x0(n / 32);
  std::vector<Q8_1Block> x1(n / 32);
  double want0 = 0.0;
  double want1 = 0.0;
  for (int64_t ib = 0; ib < n / 32; ++ib) {
    w0[ib].d = w1[ib].d = x0[ib].d = x1[ib].d = 0x3C00;
    w1[ib].m = 0xBC00;  // -1
    uint32_t qh = 0;
    int sum_x = 0;
    for (int j = 0; j < 32; ++j) {
      const int q = q5_pattern((j + 5 * static_cast<int>(ib)) % 32);
      const int8_t xq = static_cast<int8_t>((j * 5 + ib) % 3 ? -127 : 127);
      x0[ib].qs[j] = x1[ib].qs[j] = xq;
      sum_x += xq;
      qh |= static_cast<uint32_t>(q >> 4) << j;
      uint8_t& byte = j < 16 ? w0[ib].qs[j] : w0[ib].qs[j - 16];
      byte = static_cast<uint8_t>(byte | ((q & 0xF) << (j < 16 ? 0 : 4)));
      want0 += static_cast<double>(q - 16) * xq;
      want1 += static_cast<double>(q) * xq - xq;  // (q * 1 + m) * xq with m = -1
    }
    std::memcpy(w0[ib].qh, &qh, 4);
    std::memcpy(w1[ib].qh, &qh, 4);
    std::memcpy(w1[ib].qs, w0[ib].qs, 16);
    x1[ib].s = tessera::fp32_to_fp16(static_cast<float>(sum_x));
  }
  const auto f0 = static_cast<float>(want0);
  const auto f1 = static_cast<float>(want1);
  CHECK(tessera::vec_dot_scalar(GgmlType::Q5_0, n, w0.data(), x0.data()) == f0);
  CHECK(tessera::vec_dot(GgmlType::Q5_0, n, w0.data(), x0.data()) == f0);
  CHECK(tessera::vec_dot_scalar(GgmlType::Q5_1, n, w1.data(), x1.data()) == f1);
  CHECK(tessera::vec_dot(GgmlType::Q5_1, n, w1.data(), x1.data()) == f1);
}

TEST_CASE("round trips stay within each format's error bound") {
  const int64_t n = 32 * 128;
  const std::vector<float> x = random_floats(n, 42, 1.5f);
  const float h = std::ldexp(1.0f, -11);  // fp16 relative rounding (half an ulp at 11 bits)

  SUBCASE("F32 is exact") {
    const std::vector<uint8_t> q = quantize(GgmlType::F32, x);
    const std::vector<float> y = dequantize(GgmlType::F32, q.data(), n);
    CHECK(std::memcmp(x.data(), y.data(), n * sizeof(float)) == 0);
  }
  SUBCASE("F16: relative error <= 2^-11") {
    const std::vector<uint8_t> q = quantize(GgmlType::F16, x);
    const std::vector<float> y = dequantize(GgmlType::F16, q.data(), n);
    for (int64_t i = 0; i < n; ++i) CHECK(std::fabs(y[i] - x[i]) <= std::fabs(x[i]) * h + 1e-7f);
  }
  SUBCASE("BF16: relative error <= 2^-8, ties to even, NaN stays NaN") {
    const std::vector<uint8_t> q = quantize(GgmlType::BF16, x);
    const std::vector<float> y = dequantize(GgmlType::BF16, q.data(), n);
    for (int64_t i = 0; i < n; ++i) CHECK(std::fabs(y[i] - x[i]) <= std::fabs(x[i]) * 0x1p-8f);
    // 1 + 2^-8 is exactly halfway between bf16 1.0 and 1.0078125: ties to even -> 1.0.
    // 1 + 3*2^-8 is halfway between 1.0078125 (odd) and 1.015625: -> 1.015625.
    const float special[4] = {1.0f + 0x1p-8f, 1.0f + 3 * 0x1p-8f, NAN, -INFINITY};
    uint16_t b[4];
    REQUIRE(tessera::quantize_row(GgmlType::BF16, special, b, 4));
    CHECK(b[0] == 0x3F80);
    CHECK(b[1] == 0x3F82);
    float back[4];
    REQUIRE(tessera::dequantize_row(GgmlType::BF16, b, back, 4));
    CHECK(std::isnan(back[2]));
    CHECK(back[3] == -INFINITY);
  }
  SUBCASE("Q8_0 / Q8_1: |err| <= amax/127/2 plus the fp16 error of d") {
    for (GgmlType t : {GgmlType::Q8_0, GgmlType::Q8_1}) {
      const std::vector<uint8_t> q = quantize(t, x);
      const std::vector<float> y = dequantize(t, q.data(), n);
      for (int64_t ib = 0; ib < n / 32; ++ib) {
        const float amax = max_abs(&x[ib * 32], 32);
        const float bound = amax * (0.5f / 127.0f + h) * 1.001f;
        for (int j = 0; j < 32; ++j) {
          CHECK(std::fabs(y[ib * 32 + j] - x[ib * 32 + j]) <= bound);
        }
      }
    }
  }
  // Q4_0 / Q5_0 (levels = 16 / 32): d = max / -(levels / 2), and the clipped end of the range
  // is off by one step; Q4_1 / Q5_1: d = (max - min) / (levels - 1), error within half a step.
  struct Signed {
    GgmlType type;
    int levels;
    double rms;  // bound on the relative RMS error of Gaussian data
  };
  SUBCASE("Q4_0 / Q5_0: |err| <= one step (at the clipped end) plus fp16 error") {
    for (const Signed f :
         {Signed{GgmlType::Q4_0, 16, 0.15}, Signed{GgmlType::Q5_0, 32, 0.08}}) {
      CAPTURE(tessera::ggml_type_name(f.type));
      const std::vector<uint8_t> q = quantize(f.type, x);
      const std::vector<float> y = dequantize(f.type, q.data(), n);
      const float half = static_cast<float>(f.levels / 2);
      double sq = 0.0;
      double ref = 0.0;
      for (int64_t ib = 0; ib < n / 32; ++ib) {
        const float d = max_abs(&x[ib * 32], 32) / half;
        for (int j = 0; j < 32; ++j) {
          const float e = std::fabs(y[ib * 32 + j] - x[ib * 32 + j]);
          CHECK(e <= d * (1.0f + half * h) * 1.001f);
          sq += static_cast<double>(e) * e;
          ref += static_cast<double>(x[ib * 32 + j]) * x[ib * 32 + j];
        }
      }
      // Typical error is much smaller than the worst case: a 4-bit code of Gaussian data keeps
      // the relative RMS error near 10%, a 5-bit one near half that.
      CHECK(std::sqrt(sq / ref) < f.rms);
    }
  }
  SUBCASE("Q4_1 / Q5_1: |err| <= d/2 plus fp16 errors of d and m") {
    for (const auto& [type, levels] :
         {std::pair{GgmlType::Q4_1, 16}, std::pair{GgmlType::Q5_1, 32}}) {
      CAPTURE(tessera::ggml_type_name(type));
      const std::vector<uint8_t> q = quantize(type, x);
      const std::vector<float> y = dequantize(type, q.data(), n);
      const float top = static_cast<float>(levels - 1);
      for (int64_t ib = 0; ib < n / 32; ++ib) {
        float mn = x[ib * 32];
        float mx = mn;
        for (int j = 0; j < 32; ++j) {
          mn = std::min(mn, x[ib * 32 + j]);
          mx = std::max(mx, x[ib * 32 + j]);
        }
        const float d = (mx - mn) / top;
        const float bound = (0.5f * d + top * d * h + std::fabs(mn) * h) * 1.001f + 1e-6f;
        for (int j = 0; j < 32; ++j) CHECK(std::fabs(y[ib * 32 + j] - x[ib * 32 + j]) <= bound);
      }
    }
  }
}

TEST_CASE("Q4_K dequantize: 6-bit packed scales/mins and nibble layout") {
  // Build a super-block with ggml's packing of (scale, min) pairs; the upper four pairs use
  // values >= 16 so the 2-bit high parts stored in bytes 0-7 matter.
  const uint8_t ls[8] = {1, 2, 3, 63, 33, 17, 48, 5};
  const uint8_t lm[8] = {0, 7, 63, 1, 50, 16, 2, 31};
  Q4_KBlock b{};
  b.d = tessera::fp32_to_fp16(0.5f);
  b.dmin = tessera::fp32_to_fp16(0.25f);
  pack_k4_scales(ls, lm, b.scales);
  // q for element e: sub-block e/32; chunk e/64 uses qs[32*(e/64) .. +32], low nibbles for the
  // first 32 elements of the chunk and high nibbles for the second 32.
  uint8_t q[256];
  for (int e = 0; e < 256; ++e) q[e] = static_cast<uint8_t>((e * 7 + e / 32) & 0xF);
  for (int e = 0; e < 256; ++e) {
    const int chunk = e / 64;
    const int l = e % 32;
    if ((e % 64) < 32) {
      b.qs[chunk * 32 + l] = static_cast<uint8_t>((b.qs[chunk * 32 + l] & 0xF0) | q[e]);
    } else {
      b.qs[chunk * 32 + l] = static_cast<uint8_t>((b.qs[chunk * 32 + l] & 0x0F) | (q[e] << 4));
    }
  }
  float y[512];
  Q4_KBlock two[2] = {b, b};
  two[1].d = tessera::fp32_to_fp16(-1.0f);  // second super-block: a different scale
  REQUIRE(tessera::dequantize_row(GgmlType::Q4_K, two, y, 512));
  for (int e = 0; e < 256; ++e) {
    const int s = e / 32;
    // Values are small integers times powers of two: exact in float.
    CHECK(y[e] == 0.5f * ls[s] * q[e] - 0.25f * lm[s]);
    CHECK(y[256 + e] == -1.0f * ls[s] * q[e] - 0.25f * lm[s]);
  }
}

TEST_CASE("Q5_K dequantize: Q4_K's scales and nibbles plus a fifth bit at bit e/32 of qh[e%32]") {
  const uint8_t ls[8] = {1, 2, 3, 63, 33, 17, 48, 5};
  const uint8_t lm[8] = {0, 7, 63, 1, 50, 16, 2, 31};
  Q5_KBlock b{};
  b.d = tessera::fp32_to_fp16(0.5f);
  b.dmin = tessera::fp32_to_fp16(0.25f);
  pack_k4_scales(ls, lm, b.scales);
  uint8_t q[256];  // 5-bit codes, every value 0..31 present
  for (int e = 0; e < 256; ++e) q[e] = static_cast<uint8_t>((e * 13 + e / 32) & 31);
  for (int e = 0; e < 256; ++e) {
    const int chunk = e / 64, l = e % 32;
    const uint8_t low = q[e] & 0xF;
    if ((e % 64) < 32) {
      b.qs[chunk * 32 + l] = static_cast<uint8_t>((b.qs[chunk * 32 + l] & 0xF0) | low);
    } else {
      b.qs[chunk * 32 + l] = static_cast<uint8_t>((b.qs[chunk * 32 + l] & 0x0F) | (low << 4));
    }
    if (q[e] & 16) b.qh[l] = static_cast<uint8_t>(b.qh[l] | (1 << (e / 32)));
  }
  float y[512];
  Q5_KBlock two[2] = {b, b};
  two[1].d = tessera::fp32_to_fp16(-1.0f);
  REQUIRE(tessera::dequantize_row(GgmlType::Q5_K, two, y, 512));
  for (int e = 0; e < 256; ++e) {
    const int s = e / 32;
    CHECK(y[e] == 0.5f * ls[s] * q[e] - 0.25f * lm[s]);
    CHECK(y[256 + e] == -1.0f * ls[s] * q[e] - 0.25f * lm[s]);
  }
  // The reference quantizer writes this layout back: a row made of these exact values
  // round-trips to the same values.
  std::vector<uint8_t> again(176);
  REQUIRE(tessera::quantize_row(GgmlType::Q5_K, y, again.data(), 256));
  float y2[256];
  REQUIRE(tessera::dequantize_row(GgmlType::Q5_K, again.data(), y2, 256));
  double max_err = 0.0;
  for (int e = 0; e < 256; ++e) max_err = std::max(max_err, std::fabs(double(y2[e]) - y[e]));
  CHECK(max_err <= 0.5 * 0.5 * 63 + 1e-6);  // within half a step of the largest sub-block scale
}

TEST_CASE("Q6_K dequantize: 4+2 bit quants, signed 8-bit scales per 16 elements") {
  uint8_t L[256];  // 6-bit codes, value = code - 32
  for (int e = 0; e < 256; ++e) L[e] = static_cast<uint8_t>((e * 37 + 11) & 63);
  L[0] = 0;   // -32
  L[1] = 63;  // +31
  Q6_KBlock b{};
  for (int s = 0; s < 16; ++s) b.scales[s] = static_cast<int8_t>((s % 2 ? -1 : 1) * (s * 8 + 1));
  b.scales[15] = -128;
  b.d = tessera::fp32_to_fp16(0.125f);
  // ggml's packing (quantize_row_q6_K_ref): per 128 elements, ql[l] holds codes l and l+64,
  // ql[l+32] holds l+32 and l+96, qh[l] holds the high 2 bits of l, l+32, l+64, l+96.
  for (int base = 0; base < 256; base += 128) {
    uint8_t* ql = b.ql + base / 2;
    uint8_t* qh = b.qh + base / 4;
    for (int l = 0; l < 32; ++l) {
      const uint8_t* c = L + base;
      ql[l] = static_cast<uint8_t>((c[l] & 0xF) | ((c[l + 64] & 0xF) << 4));
      ql[l + 32] = static_cast<uint8_t>((c[l + 32] & 0xF) | ((c[l + 96] & 0xF) << 4));
      qh[l] = static_cast<uint8_t>((c[l] >> 4) | ((c[l + 32] >> 4) << 2) | ((c[l + 64] >> 4) << 4) |
                                   ((c[l + 96] >> 4) << 6));
    }
  }
  float y[256];
  REQUIRE(tessera::dequantize_row(GgmlType::Q6_K, &b, y, 256));
  for (int e = 0; e < 256; ++e) {
    CHECK(y[e] == 0.125f * b.scales[e / 16] * (static_cast<int>(L[e]) - 32));
  }
  CHECK(y[0] == 0.125f * 1 * -32);
  CHECK(y[1] == 0.125f * 1 * 31);
}

TEST_CASE("Q8_K known blocks: signed max -> -127, iscale = -127/max, ties to even, bsums") {
  // Block 0: the largest magnitude is -127 (first of the two at 127), so iscale = 1 exactly,
  // d = 1 and q = round-half-even(x). Block 1: the largest magnitude is +2 first, so
  // iscale = -63.5, d = 1/iscale < 0 and every quant flips sign. Block 2 is all zeros (-0.0
  // included). Block 3 is random: d * q must reproduce x within d/2.
  std::vector<float> x(4 * 256, 0.0f);
  const float halves[8] = {0.5f, 1.5f, 2.5f, -0.5f, -1.5f, -2.5f, 3.49f, -3.51f};
  const int rounded[8] = {0, 2, 2, 0, -2, -2, 3, -4};
  for (int j = 0; j < 256; ++j) x[j] = halves[j % 8];
  x[40] = -127.0f;
  x[41] = 127.0f;  // same magnitude, later: does not change the sign of max
  for (int j = 0; j < 256; ++j) x[256 + j] = (j % 2 ? 1.0f : 0.5f);  // -63.5 (tie) and -31.75
  x[256 + 7] = 2.0f;
  x[256 + 9] = -2.0f;
  x[512 + 3] = -0.0f;
  const std::vector<float> r = random_floats(256, 77, 3.0f);
  std::copy(r.begin(), r.end(), x.begin() + 768);

  std::vector<Q8_KBlock> b(4);
  std::memset(b.data(), 0x55, b.size() * sizeof(Q8_KBlock));  // garbage where nothing is written
  REQUIRE(tessera::quantize_row(GgmlType::Q8_K, x.data(), b.data(), 1024));

  CHECK(b[0].d == 1.0f);
  for (int j = 0; j < 256; ++j) {
    if (j == 40 || j == 41) continue;
    CAPTURE(j);
    CHECK(b[0].qs[j] == rounded[j % 8]);
  }
  CHECK(b[0].qs[40] == -127);
  CHECK(b[0].qs[41] == 127);
  // Group 2 (elements 32..47) holds the +-127 pair and 14 other values; the rest of the groups
  // are two copies of the 8-value pattern: 2 * (0 + 2 + 2 + 0 - 2 - 2 + 3 - 4) = -2.
  for (int g = 0; g < 16; ++g) {
    CAPTURE(g);
    int sum = 0;
    for (int l = 0; l < 16; ++l) sum += b[0].qs[16 * g + l];
    CHECK(b[0].bsums[g] == sum);
    if (g != 2) CHECK(b[0].bsums[g] == -2);
  }

  const float iscale1 = -127.0f / 2.0f;
  CHECK(b[1].d == 1.0f / iscale1);
  CHECK(b[1].d < 0.0f);
  CHECK(b[1].qs[7] == -127);
  CHECK(b[1].qs[9] == 127);
  CHECK(b[1].qs[1] == -64);  // 1.0 * -63.5 = -63.5 -> even -64
  CHECK(b[1].qs[0] == -32);  // 0.5 * -63.5 = -31.75 -> -32
  // Group 0: eight 0.5s (-32), six 1.0s (-64) and the +-2 pair (-127, 127).
  CHECK(b[1].bsums[0] == 8 * -32 + 6 * -64);

  CHECK(b[2].d == 0.0f);
  bool zero = true;
  for (int j = 0; j < 256; ++j) zero = zero && b[2].qs[j] == 0;
  for (int g = 0; g < 16; ++g) zero = zero && b[2].bsums[g] == 0;
  CHECK(zero);

  const std::vector<float> y = dequantize(GgmlType::Q8_K, b.data(), 1024);
  const float d3 = std::fabs(b[3].d);
  // 1 / (-127 / max) is max / 127 up to the rounding of the two divisions.
  CHECK(d3 == doctest::Approx(max_abs(r.data(), 256) / 127.0f).epsilon(1e-6));
  for (int j = 0; j < 256; ++j) CHECK(std::fabs(y[768 + j] - r[j]) <= 0.5f * d3 * 1.0001f);

  // The activation path writes the same bytes (ggml's x86 build uses this reference too).
  std::vector<Q8_KBlock> a(4);
  std::memset(a.data(), 0x55, a.size() * sizeof(Q8_KBlock));
  REQUIRE(tessera::quantize_activation_row(GgmlType::Q8_K, x.data(), a.data(), 1024));
  CHECK(std::memcmp(a.data(), b.data(), a.size() * sizeof(Q8_KBlock)) == 0);
}

TEST_CASE("K-quant dots on extreme quants are exact in every implementation") {
  // Unit scales and quants at their extremes: every integer and float partial sum is exactly
  // representable, so the scalar and AVX2 dots must both give the exact value — this catches
  // a wrong scale/min unpacking, a saturating maddubs or a mis-signed offset that tolerances
  // could hide.
  Q8_KBlock x{};
  x.d = 1.0f;
  for (int j = 0; j < 256; ++j) x.qs[j] = 127;
  for (int g = 0; g < 16; ++g) x.bsums[g] = 16 * 127;

  Q4_KBlock w4{};
  w4.d = w4.dmin = 0x3C00;                                   // 1.0
  std::memset(w4.scales, 0xFF, sizeof w4.scales);             // all scales and mins 63
  std::memset(w4.qs, 0xFF, sizeof w4.qs);                     // all quants 15
  const float want4 = 256.0f * 63 * 15 * 127 - 256.0f * 63 * 127;  // 28675584
  CHECK(tessera::vec_dot_scalar(GgmlType::Q4_K, 256, &w4, &x) == want4);
  CHECK(tessera::vec_dot(GgmlType::Q4_K, 256, &w4, &x) == want4);

  Q5_KBlock w5{};
  w5.d = w5.dmin = 0x3C00;
  std::memset(w5.scales, 0xFF, sizeof w5.scales);
  std::memset(w5.qs, 0xFF, sizeof w5.qs);
  std::memset(w5.qh, 0xFF, sizeof w5.qh);                     // all quants 31
  const float want5 = 256.0f * 63 * 31 * 127 - 256.0f * 63 * 127;  // 61046784
  CHECK(tessera::vec_dot_scalar(GgmlType::Q5_K, 256, &w5, &x) == want5);
  CHECK(tessera::vec_dot(GgmlType::Q5_K, 256, &w5, &x) == want5);

  Q6_KBlock w6{};
  w6.d = 0x3C00;
  std::memset(w6.ql, 0xFF, sizeof w6.ql);  // with qh all ones: q = 63, q - 32 = 31
  std::memset(w6.qh, 0xFF, sizeof w6.qh);
  for (int g = 0; g < 16; ++g) w6.scales[g] = static_cast<int8_t>(g % 2 ? -128 : 127);
  const float want6 = 128.0f * 31 * 127 * 127 - 128.0f * 31 * 127 * 128;  // -503936
  CHECK(tessera::vec_dot_scalar(GgmlType::Q6_K, 256, &w6, &x) == want6);
  CHECK(tessera::vec_dot(GgmlType::Q6_K, 256, &w6, &x) == want6);

  // The -32 offset with the smallest quant: ql = qh = 0 gives q - 32 = -32 everywhere.
  std::memset(w6.ql, 0, sizeof w6.ql);
  std::memset(w6.qh, 0, sizeof w6.qh);
  const float want6_neg = -(128.0f * 32 * 127 * 127 - 128.0f * 32 * 127 * 128);
  CHECK(tessera::vec_dot_scalar(GgmlType::Q6_K, 256, &w6, &x) == want6_neg);
  CHECK(tessera::vec_dot(GgmlType::Q6_K, 256, &w6, &x) == want6_neg);
}

TEST_CASE("vec_dot_scalar equals the dot of the dequantized rows") {
  for (GgmlType t : kDotTypes) {
    for (int64_t n : {32, 96, 256, 576, 1536, 4096}) {
      if (!fits(t, n)) continue;
      CAPTURE(tessera::ggml_type_name(t));
      CAPTURE(n);
      const DotCase c = make_dot_case(t, n, static_cast<uint32_t>(n) * 31u + static_cast<uint32_t>(t));
      const float got = tessera::vec_dot_scalar(t, n, c.w.data(), c.x.data());
      // Integer block sums are exact; what remains is float rounding of the per-block scale
      // products and the running float sum (ggml accumulates in float), bounded by a few
      // float ulps per block relative to sum |products|.
      // The min term uses s = fp16(d * sum q) while dequantization uses fp16(d) * q: the two
      // differ by up to two fp16 roundings of each block's m * s.
      const double tol = 1e-5 * c.abs_sum + std::ldexp(min_term_scale(c), -10);
      CHECK(std::fabs(got - c.exact) <= tol);
    }
  }
}

TEST_CASE("F16 and F32 scalar dots accept any length") {
  for (int64_t n : {1, 7, 31, 33, 100}) {
    const std::vector<float> a = random_floats(n, 5, 1.0f);
    const std::vector<float> b = random_floats(n, 6, 1.0f);
    double exact = 0.0;
    double abs_sum = 0.0;
    for (int64_t i = 0; i < n; ++i) {
      exact += static_cast<double>(a[i]) * b[i];
      abs_sum += std::fabs(static_cast<double>(a[i]) * b[i]);
    }
    // Each float product is rounded once (<= 2^-24 relative), the double sum adds nothing
    // measurable, and the result is rounded to float once.
    const float got = tessera::vec_dot_scalar(GgmlType::F32, n, a.data(), b.data());
    CHECK(std::fabs(got - exact) <= 0x1p-24 * abs_sum + 0x1p-24 * std::fabs(exact));
    const std::vector<uint8_t> ah = quantize(GgmlType::F16, a);
    const std::vector<uint8_t> bh = quantize(GgmlType::F16, b);
    // Products of two halves are exact in float and the sum is in double: the only rounding is
    // the final conversion to float.
    const std::vector<float> ad = dequantize(GgmlType::F16, ah.data(), n);
    const std::vector<float> bd = dequantize(GgmlType::F16, bh.data(), n);
    double exact_h = 0.0;
    for (int64_t i = 0; i < n; ++i) exact_h += static_cast<double>(ad[i]) * bd[i];
    CHECK(tessera::vec_dot_scalar(GgmlType::F16, n, ah.data(), bh.data()) ==
          static_cast<float>(exact_h));
  }
}

TEST_CASE("vec_dot (AVX2) matches vec_dot_scalar") {
  if (!tessera::cpu_has_avx2()) {
    MESSAGE("CPU lacks AVX2/FMA/F16C: the SIMD kernels are not used here, skipping");
    return;
  }
  std::mt19937 rng(1234);
  std::vector<int64_t> sizes = {32, 64, 96, 256, 576, 1024, 2304, 4096};
  for (int i = 0; i < 10; ++i) sizes.push_back(32 * std::uniform_int_distribution<int64_t>(1, 128)(rng));
  for (GgmlType t : kDotTypes) {
    for (int64_t n : sizes) {
      if (!fits(t, n)) continue;
      CAPTURE(tessera::ggml_type_name(t));
      CAPTURE(n);
      const DotCase c = make_dot_case(t, n, static_cast<uint32_t>(n) + 17u * static_cast<uint32_t>(t));
      const float simd = tessera::vec_dot(t, n, c.w.data(), c.x.data());
      const float ref = tessera::vec_dot_scalar(t, n, c.w.data(), c.x.data());
      // Same integer sums, different float summation order: a relative 1e-5 of sum |products|
      // is far above the reordering noise (~n/8 float ulps in the worst case) yet catches any
      // wrong element, nibble or scale.
      const double scale = c.abs_sum + min_term_scale(c);
      CHECK(std::fabs(simd - ref) <= 1e-5 * scale);
    }
  }
}

TEST_CASE("vec_dot (AVX2) F16/F32 tails and extreme quants") {
  if (!tessera::cpu_has_avx2()) {
    MESSAGE("CPU lacks AVX2/FMA/F16C: the SIMD kernels are not used here, skipping");
    return;
  }
  // Lengths that are not multiples of the 32-element SIMD step exercise the scalar tail.
  for (int64_t n : {1, 5, 31, 33, 63, 100, 1000, 4097}) {
    CAPTURE(n);
    const std::vector<float> a = random_floats(n, 11, 1.0f);
    const std::vector<float> b = random_floats(n, 12, 1.0f);
    double abs_sum = 0.0;
    for (int64_t i = 0; i < n; ++i) abs_sum += std::fabs(static_cast<double>(a[i]) * b[i]);
    CHECK(std::fabs(tessera::vec_dot(GgmlType::F32, n, a.data(), b.data()) -
                    tessera::vec_dot_scalar(GgmlType::F32, n, a.data(), b.data())) <=
          1e-5 * abs_sum);
    const std::vector<uint8_t> ah = quantize(GgmlType::F16, a);
    const std::vector<uint8_t> bh = quantize(GgmlType::F16, b);
    CHECK(std::fabs(tessera::vec_dot(GgmlType::F16, n, ah.data(), bh.data()) -
                    tessera::vec_dot_scalar(GgmlType::F16, n, ah.data(), bh.data())) <=
          1e-5 * abs_sum);
  }

  // Saturation corner of maddubs: all quants at +-127 (Q8_0) and 15 / -8 (Q4). With unit
  // scales every partial sum is an exactly representable integer, so results must be equal.
  const int64_t n = 256;
  std::vector<Q8_0Block> w8(n / 32), x8(n / 32);
  std::vector<Q4_0Block> w40(n / 32);
  std::vector<Q4_1Block> w41(n / 32);
  std::vector<Q8_1Block> x81(n / 32);
  for (int64_t ib = 0; ib < n / 32; ++ib) {
    w8[ib].d = x8[ib].d = w40[ib].d = w41[ib].d = x81[ib].d = 0x3C00;
    w41[ib].m = 0x3C00;
    int sum = 0;
    for (int j = 0; j < 32; ++j) {
      w8[ib].qs[j] = static_cast<int8_t>((j + ib) % 2 ? 127 : -127);
      x8[ib].qs[j] = static_cast<int8_t>(j % 3 ? -127 : 127);
      x81[ib].qs[j] = x8[ib].qs[j];
      sum += x81[ib].qs[j];
    }
    x81[ib].s = tessera::fp32_to_fp16(static_cast<float>(sum));
    for (int j = 0; j < 16; ++j) {
      w40[ib].qs[j] = static_cast<uint8_t>(j % 2 ? 0xF0 : 0x0F);  // -8 / +7 after the offset
      w41[ib].qs[j] = 0xFF;                                        // 15 everywhere
    }
  }
  CHECK(tessera::vec_dot(GgmlType::Q8_0, n, w8.data(), x8.data()) ==
        tessera::vec_dot_scalar(GgmlType::Q8_0, n, w8.data(), x8.data()));
  CHECK(tessera::vec_dot(GgmlType::Q4_0, n, w40.data(), x8.data()) ==
        tessera::vec_dot_scalar(GgmlType::Q4_0, n, w40.data(), x8.data()));
  CHECK(tessera::vec_dot(GgmlType::Q4_1, n, w41.data(), x81.data()) ==
        tessera::vec_dot_scalar(GgmlType::Q4_1, n, w41.data(), x81.data()));
}

TEST_CASE("vec_dot_tile equals vec_dot element by element, bit for bit") {
  // The tiled matmul shares loads between output elements but keeps each element's operation
  // sequence, so every tile shape (incl. partial tiles at the row and token edges) must give
  // exactly vec_dot's bits — on the AVX2 path and on the scalar one.
  std::mt19937 rng(99);
  for (GgmlType t : kDotTypes) {
    // 45 and 600 leave a tail after the last 32-float step (F32 / F16 only).
    for (int64_t n : {32, 45, 64, 256, 576, 600, 1536}) {
      if (!fits(t, n)) continue;
      // 37 and 70 rows span several of the batched loop's weight panels at n = 1536.
      for (int64_t rows : {1, 2, 3, 5, 16, 37, 70}) {
        for (int64_t tokens : {1, 2, 3, 4, 5, 7, 9, 17}) {
          CAPTURE(tessera::ggml_type_name(t));
          CAPTURE(n);
          CAPTURE(rows);
          CAPTURE(tokens);
          const GgmlType xt = tessera::vec_dot_type(t);
          const size_t w_bytes = tessera::ggml_row_size(t, n);
          const size_t x_bytes = tessera::ggml_row_size(xt, n);
          std::vector<uint8_t> w(w_bytes * rows), x(x_bytes * tokens);
          for (int64_t r = 0; r < rows; ++r) {
            const std::vector<uint8_t> row = weight_row(t, n, static_cast<uint32_t>(rng()), 0.5f, 0.05f);
            std::memcpy(w.data() + r * w_bytes, row.data(), w_bytes);
          }
          for (int64_t k = 0; k < tokens; ++k) {
            const std::vector<float> f = random_floats(n, static_cast<uint32_t>(rng()), 2.0f);
            REQUIRE(tessera::quantize_activation_row(xt, f.data(), x.data() + k * x_bytes, n));
          }
          // Output rows further apart than the tile, as in a matmul over a slice of rows.
          const int64_t y_stride = rows + 3;
          std::vector<float> y(static_cast<size_t>(y_stride * tokens), -1.0f);
          std::vector<float> ys(y.size(), -1.0f);
          tessera::vec_dot_tile(t, n, w.data(), w_bytes, rows, x.data(), x_bytes, tokens, y.data(),
                                y_stride);
          tessera::vec_dot_tile_scalar(t, n, w.data(), w_bytes, rows, x.data(), x_bytes, tokens,
                                       ys.data(), y_stride);
          bool all_equal = true;
          for (int64_t k = 0; k < tokens; ++k)
            for (int64_t r = 0; r < y_stride; ++r) {
              const float want = r < rows ? tessera::vec_dot(t, n, w.data() + r * w_bytes,
                                                             x.data() + k * x_bytes)
                                          : -1.0f;
              const float want_s = r < rows ? tessera::vec_dot_scalar(t, n, w.data() + r * w_bytes,
                                                                      x.data() + k * x_bytes)
                                            : -1.0f;
              const float got = y[k * y_stride + r];
              const float got_s = ys[k * y_stride + r];
              all_equal = all_equal && std::memcmp(&got, &want, 4) == 0 &&
                          std::memcmp(&got_s, &want_s, 4) == 0;
            }
          CHECK(all_equal);
        }
      }
    }
  }
}

TEST_CASE("quantize_activation_row (dispatched) writes the scalar reference's bytes") {
  // Random rows at several scales, an all-zero block, and values whose quotient x * 127/amax
  // lands exactly on .5 (round half to even must agree).
  for (GgmlType t : {GgmlType::Q8_0, GgmlType::Q8_1, GgmlType::Q8_K}) {
    for (uint32_t seed = 0; seed < 20; ++seed) {
      const int64_t n = 32 * (1 + seed % 7) * 16;
      std::vector<float> x = random_floats(n, 500 + seed, seed % 3 == 0 ? 1e-3f : 4.0f);
      for (int j = 0; j < 32; ++j) x[j] = 0.0f;
      for (int j = 0; j < 32; ++j) x[32 + j] = static_cast<float>(j - 16) + 0.5f;  // amax 16.5 -> halves
      x[64] = -0.0f;
      if (t == GgmlType::Q8_K && n >= 768) {
        for (int j = 256; j < 512; ++j) x[j] = 0.0f;  // an all-zero super-block
        x[600] = -1000.0f;                            // the first of two largest magnitudes
        x[700] = 1000.0f;                             // sets the sign
      }
      const size_t bytes = tessera::ggml_row_size(t, n);
      std::vector<uint8_t> a(bytes), b(bytes);
      REQUIRE(tessera::quantize_activation_row(t, x.data(), a.data(), n));
      REQUIRE(tessera::quantize_activation_row_scalar(t, x.data(), b.data(), n));
      CAPTURE(tessera::ggml_type_name(t));
      CAPTURE(seed);
      CHECK(a == b);
    }
  }
}
