// Built in ThreadSanitizer builds only. The interleaved x86 kernels are compiled there without
// TSan's instrumentation, and matmul_interleaved declares each call's ranges instead
// (core/src/kernels/interleaved.cpp). Two threads run the same Q8_0 matmul:
//   "same rows"      both write the same output rows: TSan must report a data race;
//   "disjoint rows"  each writes its own rows: no report, and every output is the exact dot.
// TSan's report hook counts the reports. A report is process-wide state, so ctest runs each
// case in its own process (--test-case); the test's TSAN_OPTIONS (halt_on_error=0,
// exitcode=0) leave the verdict to the checks below.
#include <doctest/doctest.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#include "tessera/sdk/kernels/ggml_types.h"
#include "tessera/sdk/kernels/interleaved.h"

using tessera::GgmlType;

namespace {
std::atomic<int> tsan_reports{0};

constexpr int64_t kRows = 16, kCols = 128;

// Two threads through matmul_interleaved at once, writing the same rows or each its own;
// returns the outputs (2 * kRows, the second half untouched with same_rows).
std::vector<float> run_two_threads(bool same_rows) {
  // Q8_0 blocks (fp16 scale 1.0, then 32 int8 quants) of 1s for the weights and the activation
  // row, so each output is exactly kCols.
  const size_t row_bytes = tessera::ggml_row_size(GgmlType::Q8_0, kCols);
  std::vector<uint8_t> block(row_bytes / (kCols / 32), 1);
  const uint16_t one_fp16 = 0x3C00;
  std::memcpy(block.data(), &one_fp16, sizeof one_fp16);
  std::vector<uint8_t> x;
  for (int64_t b = 0; b < kCols / 32; ++b) x.insert(x.end(), block.begin(), block.end());
  std::vector<uint8_t> w;
  for (int64_t r = 0; r < kRows; ++r) w.insert(w.end(), x.begin(), x.end());
  std::vector<uint8_t> packed(tessera::interleaved_size(GgmlType::Q8_0, kRows, kCols));
  tessera::interleave_rows(GgmlType::Q8_0, w.data(), kRows, kCols, packed.data());

  std::vector<float> y(2 * kRows, 0.0f);
  auto run = [&](int thread) {
    float* out = y.data() + (same_rows ? 0 : thread * kRows);
    tessera::matmul_interleaved(GgmlType::Q8_0, packed.data(), kCols, kRows, x.data(), row_bytes,
                                1, out, kRows);
  };
  std::thread a(run, 0), b(run, 1);
  a.join();
  b.join();
  return y;
}
}  // namespace

// Called by the TSan runtime for every report it prints (a weak hook of libtsan).
extern "C" void __tsan_on_report(const void* /*report*/) { tsan_reports.fetch_add(1); }

TEST_CASE("same rows: two threads writing the same outputs draw a data-race report") {
  const std::vector<float> y = run_two_threads(true);
  CHECK(tsan_reports.load() > 0);
  for (int64_t i = 0; i < kRows; ++i) CHECK(y[i] == static_cast<float>(kCols));
}

TEST_CASE("disjoint rows: each thread writing its own outputs draws no report") {
  const std::vector<float> y = run_two_threads(false);
  CHECK(tsan_reports.load() == 0);
  for (int64_t i = 0; i < 2 * kRows; ++i) CHECK(y[i] == static_cast<float>(kCols));
}
