// tessera/sdk/kv_rows.h: how attention kernels read K/V pools of every dtype. The half to
// float conversion equals the core's for all 65536 halves; widening an f16 or Q8_0 row gives
// the same bits in the portable and the AVX2/F16C builds, and Q8_0 rows equal the core's
// reference dequantization; the rows the CPU backend stores (store_kv) read back to within
// Q8_0's rounding of what was stored.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "tessera/cpu_backend.h"
#include "tessera/ggml_types.h"
#include "tessera/sdk/kv_rows.h"

namespace kv_rows_check {  // tests/support/kv_rows_avx2.cpp
bool built_for_avx2();
void widen_avx2(tessera::KvDtype dtype, const void* row, float* out, int32_t n);
}  // namespace kv_rows_check

using namespace tessera;

namespace {

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

}  // namespace

TEST_CASE("kv_half_to_float equals the core's fp16_to_fp32 for every half") {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float a = kv_half_to_float(static_cast<uint16_t>(h)), b = fp16_to_fp32(static_cast<uint16_t>(h));
    CAPTURE(h);
    if (std::isnan(b)) CHECK(std::isnan(a));
    else CHECK(std::memcmp(&a, &b, sizeof a) == 0);
  }
}

TEST_CASE("widen_kv_row: portable and AVX2 builds give the same bits; Q8_0 equals the reference dequantization") {
  if (!cpu_has_avx2()) {
    MESSAGE("CPU lacks AVX2/F16C: only the portable build exists here");
    return;
  }
  // tests/support/kv_rows_avx2.cpp is compiled with -mavx2 -mf16c: if it lost those flags (or
  // kv_rows.h stopped keying its AVX2 path on them) the comparison below would compare the
  // portable build with itself and prove nothing, so that fails here instead of skipping.
  REQUIRE_MESSAGE(kv_rows_check::built_for_avx2(),
                  "tests/support/kv_rows_avx2.cpp was not built with TESSERA_KV_ROWS_AVX2");
  std::mt19937 rng(17);
  std::normal_distribution<float> dist(0.0f, 2.0f);
  for (int32_t n : {32, 64, 96, 128, 192}) {
    CAPTURE(n);
    std::vector<float> src(n);
    for (float& x : src) x = dist(rng);
    src[3] = 0.0f;
    src[n - 1] = 1e-6f;  // tiny values and an all-tiny block below
    if (n >= 64) for (int i = 32; i < 64; ++i) src[i] = 1e-7f * static_cast<float>(i - 48);
    std::vector<uint8_t> q8(kv_row_bytes(KvDtype::kQ8_0, n));
    REQUIRE(quantize_activation_row(GgmlType::Q8_0, src.data(), q8.data(), n));
    std::vector<uint16_t> f16(n);
    for (int32_t i = 0; i < n; ++i) f16[i] = fp32_to_fp16(src[i]);
    std::vector<float> portable(n), avx2(n), ref(n);
    widen_kv_row(KvDtype::kQ8_0, q8.data(), portable.data(), n);
    kv_rows_check::widen_avx2(KvDtype::kQ8_0, q8.data(), avx2.data(), n);
    REQUIRE(dequantize_row(GgmlType::Q8_0, q8.data(), ref.data(), n));
    CHECK(same_bits(portable, avx2));
    CHECK(same_bits(portable, ref));
    widen_kv_row(KvDtype::kF16, f16.data(), portable.data(), n);
    kv_rows_check::widen_avx2(KvDtype::kF16, f16.data(), avx2.data(), n);
    CHECK(same_bits(portable, avx2));
    for (int32_t i = 0; i < n; ++i) CHECK(portable[i] == fp16_to_fp32(f16[i]));
  }
}

TEST_CASE("store_kv writes Q8_0 rows at slot * row bytes that read back within Q8_0 rounding") {
  // 3 KV heads x 64 = 192 values per token row: 6 blocks, 204 bytes. Slots out of order.
  CpuBackend backend(1);
  const int64_t row_elems = 192, rows = 3;
  const size_t row_bytes = kv_row_bytes(KvDtype::kQ8_0, row_elems);
  CHECK(row_bytes == 204);
  std::vector<uint8_t> pool(8 * row_bytes, 0xAB);
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> unit(-4.0f, 4.0f);
  std::vector<float> src(rows * row_elems);
  for (float& x : src) x = unit(rng);
  const int32_t slots[] = {5, 0, 2};
  backend.store_kv(pool.data(), KvDtype::kQ8_0, src.data(), slots, rows, row_elems);
  for (int64_t r = 0; r < rows; ++r) {
    std::vector<float> back(row_elems);
    // Each head's row read through the same offsets an attention kernel uses.
    for (int32_t head = 0; head < 3; ++head)
      widen_kv_row(KvDtype::kQ8_0, pool.data() + kv_row_offset(KvDtype::kQ8_0, slots[r], 3, head, 64),
                   back.data() + head * 64, 64);
    for (int64_t b = 0; b < row_elems / 32; ++b) {
      float amax = 0;
      for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(src[r * row_elems + b * 32 + i]));
      const float step = amax / 127.0f;
      for (int i = 0; i < 32; ++i)
        CHECK(std::fabs(back[b * 32 + i] - src[r * row_elems + b * 32 + i]) <= 0.57f * step + 1e-6f);  // half a step + the f16 scale's rounding (127 * 2^-11 steps)
    }
  }
  // Slots not written keep their bytes.
  for (int32_t untouched : {1, 3, 4, 6, 7})
    for (size_t i = 0; i < row_bytes; ++i) CHECK(pool[untouched * row_bytes + i] == 0xAB);
}
