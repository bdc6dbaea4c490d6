// Tests of the interleaved layouts (Q4_1, Q4_0, Q5_0, Q8_0, Q6_K) and their matmuls: the repacking
// round-trips, the AVX2 kernels equal the scalar ones bit for bit at every shape (and so does
// every element whatever the batch around it), and both stay within float rounding of ggml's
// vec_dot of the same blocks, with an error bound derived from the sizes of the terms.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <initializer_list>
#include <vector>

#include "tessera/ggml_types.h"
#include "kernels/quant_blocks.h"
#include "tessera/interleaved.h"

using tessera::GgmlType;

namespace {

struct Q4_1Block {
  uint16_t d, m;
  uint8_t qs[16];
};
struct Q8_1Block {
  uint16_t d, s;
  int8_t qs[32];
};

std::vector<float> normal(int64_t n, std::mt19937& rng, float scale, float offset = 0.0f) {
  std::normal_distribution<float> dist(offset, scale);
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& x : v) x = dist(rng);
  return v;
}

struct Case {
  int64_t rows, cols, tokens;
  std::vector<uint8_t> w, packed, x;
  size_t w_row_bytes, x_row_bytes;
};

Case make_case(int64_t rows, int64_t cols, int64_t tokens, uint32_t seed) {
  std::mt19937 rng(seed);
  Case c{rows, cols, tokens, {}, {}, {}, tessera::ggml_row_size(GgmlType::Q4_1, cols),
         tessera::ggml_row_size(GgmlType::Q8_1, cols)};
  c.w.resize(c.w_row_bytes * rows);
  for (int64_t r = 0; r < rows; ++r) {
    const std::vector<float> f = normal(cols, rng, 0.5f, 0.1f);
    REQUIRE(tessera::quantize_row(GgmlType::Q4_1, f.data(), c.w.data() + r * c.w_row_bytes, cols));
  }
  c.packed.resize(tessera::interleaved_q4_1_size(rows, cols));
  tessera::interleave_q4_1(c.w.data(), rows, cols, c.packed.data());
  c.x.resize(c.x_row_bytes * tokens);
  for (int64_t t = 0; t < tokens; ++t) {
    const std::vector<float> f = normal(cols, rng, 2.0f);
    REQUIRE(tessera::quantize_activation_row(GgmlType::Q8_1, f.data(), c.x.data() + t * c.x_row_bytes, cols));
  }
  return c;
}

bool same_bits(float a, float b) { return std::memcmp(&a, &b, sizeof a) == 0; }

}  // namespace

TEST_CASE("interleave_q4_1: sizes, zero padding, and every row back unchanged") {
  CHECK(tessera::interleaved_q4_1_group_size(576) == 8 * tessera::ggml_row_size(GgmlType::Q4_1, 576));
  CHECK(tessera::interleaved_q4_1_size(16, 64) == 2 * tessera::interleaved_q4_1_group_size(64));
  CHECK(tessera::interleaved_q4_1_size(17, 64) == 3 * tessera::interleaved_q4_1_group_size(64));
  const Case c = make_case(13, 96, 1, 1);
  std::vector<uint8_t> row(c.w_row_bytes);
  for (int64_t r = 0; r < c.rows; ++r) {
    tessera::deinterleave_q4_1_row(c.packed.data(), c.cols, r, row.data());
    CHECK(std::memcmp(row.data(), c.w.data() + r * c.w_row_bytes, c.w_row_bytes) == 0);
  }
  // Rows 13..15 of the last group are padding: scale, min and quants all zero.
  for (int64_t r = 13; r < 16; ++r) {
    tessera::deinterleave_q4_1_row(c.packed.data(), c.cols, r, row.data());
    CHECK(std::all_of(row.begin(), row.end(), [](uint8_t b) { return b == 0; }));
  }
  // The quant bytes of row j sit 4 at a time at 32 k + 4 j within each block's 128 bytes.
  const auto* blocks = reinterpret_cast<const Q4_1Block*>(c.w.data());
  const uint8_t* group_block0 = c.packed.data();  // 8 d, 8 m, then quants
  for (int j = 0; j < 8; ++j)
    for (int k = 0; k < 4; ++k)
      for (int i = 0; i < 4; ++i)
        CHECK(group_block0[32 + 32 * k + 4 * j + i] == blocks[j * (96 / 32)].qs[4 * k + i]);
}

TEST_CASE("interleaved Q4_1 matmul: a group's rows alone equal the same rows in a wider call") {
  const Case c = make_case(40, 576, 6, 5);
  std::vector<float> all(static_cast<size_t>(40 * 6)), part(static_cast<size_t>(16 * 6));
  tessera::matmul_q4_1_interleaved(c.packed.data(), 576, 40, c.x.data(), c.x_row_bytes, 6,
                                   all.data(), 40);
  // Rows 16..31: the call starts at a group boundary, as the quantizer's 16-row tasks do.
  const uint8_t* from = c.packed.data() + 2 * tessera::interleaved_q4_1_group_size(576);
  tessera::matmul_q4_1_interleaved(from, 576, 16, c.x.data(), c.x_row_bytes, 6, part.data(), 16);
  bool equal = true;
  for (int64_t t = 0; t < 6; ++t)
    for (int64_t r = 0; r < 16; ++r) equal = equal && same_bits(part[t * 16 + r], all[t * 40 + 16 + r]);
  CHECK(equal);
}

TEST_CASE("interleaved Q4_1 matmul stays within float rounding of ggml's vec_dot") {
  // Both compute the same sum of d_w d_x isum_b + m_w s_x over blocks; they differ only in
  // where float rounding happens. Bound: a few ulps of the sum of the terms' magnitudes.
  const Case c = make_case(24, 1536, 3, 11);
  std::vector<float> y(static_cast<size_t>(24 * 3));
  tessera::matmul_q4_1_interleaved(c.packed.data(), c.cols, c.rows, c.x.data(), c.x_row_bytes, 3,
                                   y.data(), c.rows);
  const int64_t nb = c.cols / 32;
  double worst_ratio = 0.0;
  for (int64_t t = 0; t < c.tokens; ++t) {
    const auto* xb = reinterpret_cast<const Q8_1Block*>(c.x.data() + t * c.x_row_bytes);
    for (int64_t r = 0; r < c.rows; ++r) {
      const auto* wb = reinterpret_cast<const Q4_1Block*>(c.w.data() + r * c.w_row_bytes);
      double exact = 0.0, magnitude = 0.0;
      for (int64_t b = 0; b < nb; ++b) {
        int64_t isum = 0;
        for (int i = 0; i < 16; ++i)
          isum += (wb[b].qs[i] & 0x0F) * xb[b].qs[i] + (wb[b].qs[i] >> 4) * xb[b].qs[16 + i];
        const double dd = static_cast<double>(tessera::fp16_to_fp32(wb[b].d) * tessera::fp16_to_fp32(xb[b].d));
        const double mt = static_cast<double>(tessera::fp16_to_fp32(wb[b].m)) * tessera::fp16_to_fp32(xb[b].s);
        exact += dd * static_cast<double>(isum) + mt;
        magnitude += std::fabs(dd * static_cast<double>(isum)) + std::fabs(mt);
      }
      const float ours = y[t * c.rows + r];
      const float ggml = tessera::vec_dot(GgmlType::Q4_1, c.cols, c.w.data() + r * c.w_row_bytes,
                                          c.x.data() + t * c.x_row_bytes);
      const double bound = 4.0 * nb * std::ldexp(1.0, -24) * magnitude;
      CHECK(std::fabs(ours - exact) <= bound);
      CHECK(std::fabs(ggml - exact) <= bound);
      worst_ratio = std::max(worst_ratio, std::fabs(ours - exact) / bound);
    }
  }
  MESSAGE("worst |interleaved - exact| / bound = " << worst_ratio);
}

// ---- Q4_0, Q5_0, Q8_0 (and Q4_1 through the same entry points)

namespace {

Case make_typed_case(GgmlType type, int64_t rows, int64_t cols, int64_t tokens, uint32_t seed) {
  std::mt19937 rng(seed);
  const GgmlType dot = tessera::vec_dot_type(type);
  Case c{rows, cols, tokens, {}, {}, {}, tessera::ggml_row_size(type, cols),
         tessera::ggml_row_size(dot, cols)};
  c.w.resize(c.w_row_bytes * rows);
  for (int64_t r = 0; r < rows; ++r) {
    const std::vector<float> f = normal(cols, rng, 0.5f, 0.1f);
    REQUIRE(tessera::quantize_row(type, f.data(), c.w.data() + r * c.w_row_bytes, cols));
  }
  c.packed.resize(tessera::interleaved_size(type, rows, cols));
  tessera::interleave_rows(type, c.w.data(), rows, cols, c.packed.data());
  c.x.resize(c.x_row_bytes * tokens);
  for (int64_t t = 0; t < tokens; ++t) {
    std::vector<float> f = normal(cols, rng, 2.0f);
    if (t == 1) f.assign(f.size(), 0.0f);  // an all-zero activation row: d_x = 0
    REQUIRE(tessera::quantize_activation_row(dot, f.data(), c.x.data() + t * c.x_row_bytes, cols));
  }
  return c;
}

constexpr GgmlType kInterleavedTypes[] = {GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q5_0,
                                          GgmlType::Q5_1, GgmlType::Q8_0, GgmlType::Q4_K,
                                          GgmlType::Q5_K, GgmlType::Q6_K};

bool is_k_quant(GgmlType type) {
  return type == GgmlType::Q4_K || type == GgmlType::Q5_K || type == GgmlType::Q6_K;
}

// Widths to test: multiples of the type's block (256 for the K-quants), down to one block.
std::vector<int64_t> test_widths(GgmlType type) {
  if (is_k_quant(type)) return {256, 512, 1536};
  return {32, 64, 96, 576, 1536};
}
int64_t one_width(GgmlType type) { return is_k_quant(type) ? 256 : 96; }

}  // namespace

TEST_CASE("interleave_rows: sizes, zero padding, and every row back unchanged, each type") {
  CHECK_FALSE(tessera::has_interleaved_layout(GgmlType::Q3_K));
  CHECK_FALSE(tessera::has_interleaved_layout(GgmlType::F16));
  CHECK_FALSE(tessera::has_interleaved_layout(GgmlType::F32));
  for (GgmlType type : kInterleavedTypes) {
    CAPTURE(tessera::ggml_type_name(type));
    REQUIRE(tessera::has_interleaved_layout(type));
    // Q4_K and Q5_K unpack their 6-bit scales and mins: 32 bytes more per 8-row super-block.
    const size_t extra =
        type == GgmlType::Q4_K || type == GgmlType::Q5_K ? 32 * (1536 / 256) : 0;
    CHECK(tessera::interleaved_group_size(type, 1536) == 8 * tessera::ggml_row_size(type, 1536) + extra);
    CHECK(tessera::interleaved_size(type, 17, 512) == 3 * tessera::interleaved_group_size(type, 512));
    const Case c = make_typed_case(type, 13, one_width(type), 1, 3);
    std::vector<uint8_t> row(c.w_row_bytes);
    for (int64_t r = 0; r < c.rows; ++r) {
      tessera::deinterleave_row(type, c.packed.data(), c.cols, r, row.data());
      CHECK(std::memcmp(row.data(), c.w.data() + r * c.w_row_bytes, c.w_row_bytes) == 0);
    }
    for (int64_t r = 13; r < 16; ++r) {
      tessera::deinterleave_row(type, c.packed.data(), c.cols, r, row.data());
      CHECK(std::all_of(row.begin(), row.end(), [](uint8_t b) { return b == 0; }));
    }
  }
}

TEST_CASE("interleaved matmul, each type: AVX2 equals scalar bit for bit, any batch") {
  for (GgmlType type : kInterleavedTypes) {
    for (int64_t cols : test_widths(type)) {
      for (int64_t rows : {1, 7, 8, 13, 16, 40}) {
        for (int64_t tokens : {1, 2, 3, 4, 5, 9}) {
          CAPTURE(tessera::ggml_type_name(type));
          CAPTURE(cols);
          CAPTURE(rows);
          CAPTURE(tokens);
          const Case c = make_typed_case(type, rows, cols, tokens,
                                         static_cast<uint32_t>(cols * 131 + rows * 7 + tokens));
          const int64_t y_stride = rows + 5;
          std::vector<float> y(static_cast<size_t>(y_stride * tokens), -7.0f), ys(y);
          tessera::matmul_interleaved(type, c.packed.data(), cols, rows, c.x.data(),
                                      c.x_row_bytes, tokens, y.data(), y_stride);
          tessera::matmul_interleaved_scalar(type, c.packed.data(), cols, rows, c.x.data(),
                                             c.x_row_bytes, tokens, ys.data(), y_stride);
          bool equal = true, untouched = true;
          for (int64_t t = 0; t < tokens; ++t) {
            std::vector<float> alone(static_cast<size_t>(rows));
            tessera::matmul_interleaved(type, c.packed.data(), cols, rows,
                                        c.x.data() + t * c.x_row_bytes, c.x_row_bytes, 1,
                                        alone.data(), rows);
            for (int64_t r = 0; r < y_stride; ++r) {
              const float got = y[t * y_stride + r];
              if (r >= rows) {
                untouched = untouched && got == -7.0f && ys[t * y_stride + r] == -7.0f;
                continue;
              }
              equal = equal && same_bits(got, ys[t * y_stride + r]) && same_bits(got, alone[r]);
            }
          }
          CHECK(equal);
          CHECK(untouched);
        }
      }
    }
  }
}

TEST_CASE("interleaved matmul, each type: within float rounding of ggml's vec_dot") {
  // Both sum d_w d_x isum_b over the same blocks with the same exact integer block sums;
  // they differ only in float rounding, bounded by a few ulps of the sum of |terms|.
  for (GgmlType type : {GgmlType::Q4_0, GgmlType::Q5_0, GgmlType::Q5_1, GgmlType::Q8_0,
                        GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::Q6_K}) {
    CAPTURE(tessera::ggml_type_name(type));
    const Case c = make_typed_case(type, 24, 1536, 3, 17);
    std::vector<float> y(static_cast<size_t>(24 * 3));
    tessera::matmul_interleaved(type, c.packed.data(), c.cols, c.rows, c.x.data(), c.x_row_bytes,
                                3, y.data(), c.rows);
    const int64_t nb = c.cols / 32;
    std::vector<float> wf(static_cast<size_t>(c.cols)), xf(wf);
    for (int64_t t = 0; t < c.tokens; ++t) {
      REQUIRE(tessera::dequantize_row(tessera::vec_dot_type(type), c.x.data() + t * c.x_row_bytes,
                                      xf.data(), c.cols));
      for (int64_t r = 0; r < c.rows; ++r) {
        REQUIRE(tessera::dequantize_row(type, c.w.data() + r * c.w_row_bytes, wf.data(), c.cols));
        double exact = 0.0, magnitude = 0.0;
        for (int64_t b = 0; b < nb; ++b) {
          double block = 0.0;  // d_w d_x isum_b: dequantized products are exact in double
          for (int64_t i = 32 * b; i < 32 * (b + 1); ++i)
            block += static_cast<double>(wf[i]) * static_cast<double>(xf[i]);
          exact += block;
          magnitude += std::fabs(block);
        }
        const float ours = y[t * c.rows + r];
        const float ggml = tessera::vec_dot(type, c.cols, c.w.data() + r * c.w_row_bytes,
                                            c.x.data() + t * c.x_row_bytes);
        if (type == GgmlType::Q4_K || type == GgmlType::Q5_K || type == GgmlType::Q5_1) {
          // Q5_1's min term uses the activation block's fp16 s, not the dequantized sum.
          // The dequantized weights d sc q - dmin m are rounded in float, so `exact` is not;
          // compare with ggml's vec_dot instead, within rounding of the products' magnitudes.
          double products = 0.0;
          for (int64_t i = 0; i < c.cols; ++i) products += std::fabs(static_cast<double>(wf[i]) * xf[i]);
          CHECK(std::fabs(ours - ggml) <= 1e-5 * products);
          continue;
        }
        const double bound = 4.0 * nb * std::ldexp(1.0, -24) * magnitude + 1e-30;
        CHECK(std::fabs(ours - exact) <= bound);
        CHECK(std::fabs(ggml - exact) <= bound);
      }
    }
  }
}

#if defined(__x86_64__) || defined(__i386__)
namespace {

using X8Kernels = void (*)(int, int64_t, const void*, int64_t, const uint8_t*, size_t, int64_t,
                           float*, int64_t);

// Every interleaved type at each size: `kernels` gives the AVX2 build's bits.
void check_same_bits_as_avx2(X8Kernels kernels, std::initializer_list<int64_t> row_counts,
                             std::initializer_list<int64_t> token_counts) {
  for (GgmlType type : kInterleavedTypes) {
    for (int64_t rows : row_counts) {
      for (int64_t tokens : token_counts) {
        CAPTURE(tessera::ggml_type_name(type));
        CAPTURE(rows);
        CAPTURE(tokens);
        const int64_t cols = is_k_quant(type) ? 512 : 1536;
        const Case c = make_typed_case(type, rows, cols, tokens,
                                       static_cast<uint32_t>(rows * 17 + tokens * 5 + 3));
        const int64_t nb = cols / (is_k_quant(type) ? 256 : 32);
        std::vector<float> a(static_cast<size_t>(rows * tokens), -1.0f), b(a);
        tessera::kernels::matmul_x8_avx2(static_cast<int>(type), nb, c.packed.data(), rows,
                                         c.x.data(), c.x_row_bytes, tokens, a.data(), rows);
        kernels(static_cast<int>(type), nb, c.packed.data(), rows, c.x.data(), c.x_row_bytes,
                tokens, b.data(), rows);
        bool equal = true;
        for (size_t i = 0; i < a.size(); ++i) equal = equal && same_bits(a[i], b[i]);
        CHECK(equal);
      }
    }
  }
}

}  // namespace

TEST_CASE("interleaved matmul, each type: the AVX-VNNI kernels equal the AVX2 ones bit for bit") {
  if (!tessera::cpu_has_avx2() || !tessera::cpu_has_avx_vnni()) {
    MESSAGE("CPU lacks AVX-VNNI (or TESSERA_NO_AVX_VNNI is set): only the AVX2 kernels run here");
    return;
  }
  check_same_bits_as_avx2(&tessera::kernels::matmul_x8_avxvnni, {5, 8, 24}, {1, 3, 4, 7});
}

TEST_CASE("interleaved matmul, each type: the 256-bit AVX512-VNNI kernels equal the AVX2 ones bit for bit") {
  if (!tessera::kernels::cpu_has_avx512_vnni()) {
    MESSAGE("CPU lacks AVX512-VNNI (or TESSERA_NO_AVX512 is set): only the AVX2 kernels run here");
    return;
  }
  check_same_bits_as_avx2(&tessera::kernels::matmul_x8_vnni256, {5, 8, 24}, {1, 3, 4, 7});
}

TEST_CASE("interleaved matmul, each type: the AVX-512 kernels equal the AVX2 ones bit for bit") {
  if (!tessera::kernels::cpu_has_avx512_vnni()) {
    MESSAGE("CPU lacks AVX512-VNNI (or TESSERA_NO_AVX512 is set): the 256-bit kernels run here");
    return;
  }
  // 16-row passes over pairs of groups, a trailing group of 8 or fewer rows (the 256-bit
  // kernels), and token counts across the 4- and 8-row passes.
  check_same_bits_as_avx2(&tessera::kernels::matmul_x8_avx512, {5, 8, 16, 24, 40, 64},
                          {1, 3, 4, 7, 8, 9, 17});
}
#endif  // x86
