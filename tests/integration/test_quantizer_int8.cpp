// quantizer.int8 (W8A8) through the plugin registry: each output equals the exact integer dot
// of the int8 weight row and the int8 token, scaled, computed here independently of the
// plugin's code; the portable, AVX2 and AVX-VNNI kernels give the same bits; a batch never
// changes a token's result; grouped matmuls equal single ones; bad weights are refused. Needs
// the plugins, not the model.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "support/test_env.h"
#include "tessera/ggml_types.h"
#include "tessera/plugin_registry.h"
#include "tessera/sdk.h"
#include "tessera/thread_pool.h"

using namespace tessera;

namespace {

// The plugin with `kernel: <kernel>`; nullptr when this CPU lacks the kernel's instructions
// (create refuses it with an error naming the key).
std::shared_ptr<Quantizer> make_int8(PluginRegistry& registry, const std::string& kernel) {
  PluginContext ctx{&host_logger(), ""};
  try {
    return registry.create<Quantizer>(
        "int8", PluginConfig("int8", "engine.quantizer", {{"kernel", kernel}}), ctx);
  } catch (const PluginError& e) {
    MESSAGE("kernel " << kernel << " not available: " << std::string(e.what()));
    CHECK(std::string(e.what()).find("engine.quantizer.kernel") != std::string::npos);
    return nullptr;
  }
}

// The W8A8 definition: q_w = round(w * 127 / max|row|), q_x = round(x * 127 / max|x|) (ties to
// even), y = (float(sum q_w q_x) * max|row| / 127) * (max|x| / 127).
std::vector<float> w8a8_reference(const std::vector<float>& w, int64_t rows, int64_t cols,
                                  const std::vector<float>& x, int64_t num_tokens) {
  auto quantize = [](const float* v, int64_t n, std::vector<int32_t>* q) {
    float amax = 0.0f;
    for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(v[i]));
    const float inv = amax > 0 ? 127.0f / amax : 0.0f;
    q->resize(n);
    for (int64_t i = 0; i < n; ++i) (*q)[i] = static_cast<int32_t>(std::nearbyint(v[i] * inv));
    return amax / 127.0f;
  };
  std::vector<float> y(static_cast<size_t>(rows * num_tokens));
  std::vector<int32_t> qw, qx;
  for (int64_t t = 0; t < num_tokens; ++t) {
    const float sx = quantize(x.data() + t * cols, cols, &qx);
    for (int64_t r = 0; r < rows; ++r) {
      const float sw = quantize(w.data() + r * cols, cols, &qw);
      int64_t sum = 0;
      for (int64_t c = 0; c < cols; ++c) sum += static_cast<int64_t>(qw[c]) * qx[c];
      y[t * rows + r] = (static_cast<float>(sum) * sw) * sx;
    }
  }
  return y;
}

std::vector<float> normal(size_t n, uint32_t seed, float sigma) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, sigma);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

}  // namespace

TEST_CASE("quantizer.int8: exact int8 dots, the same bits from every kernel, batch and grouping") {
  PluginRegistry registry;
  registry.scan_directory(test::plugin_dir());
  std::vector<std::string> kernels = {"scalar"};
  if (cpu_has_avx2()) kernels.push_back("avx2");
  auto vnni = make_int8(registry, "avxvnni");
  if (vnni) kernels.push_back("avxvnni");
  MESSAGE("kernels checked: " << kernels.size());

  // Shapes: rows not a multiple of 8, columns not a multiple of 32 (padding), a wide one with
  // an outlier column (as LLM activations have), and many tokens (4-token tiles + remainders).
  struct Shape { int64_t rows, cols, tokens; };
  const Shape shapes[] = {{19, 100, 1}, {8, 32, 3}, {37, 576, 7}, {21, 1536, 13}};
  ThreadPool pool(3);
  for (const Shape& s : shapes) {
    CAPTURE(s.rows);
    CAPTURE(s.cols);
    std::vector<float> w = normal(s.rows * s.cols, 11 + s.rows, 0.05f);
    std::vector<float> x = normal(s.tokens * s.cols, 5 + s.cols, 1.0f);
    for (int64_t t = 0; t < s.tokens; ++t) x[t * s.cols + s.cols / 3] *= 40.0f;  // outlier channel
    const std::vector<float> want = w8a8_reference(w, s.rows, s.cols, x, s.tokens);
    std::vector<float> first;
    for (const std::string& k : kernels) {
      CAPTURE(k);
      auto q = make_int8(registry, k);
      REQUIRE(q);
      WeightView view{"blk.0.ffn_up.weight", static_cast<uint32_t>(GgmlType::F32), s.cols, s.rows,
                      w.data(), w.size() * sizeof(float)};
      std::unique_ptr<PreparedWeight> pw;
      REQUIRE(q->prepare(view, &pw).is_ok());
      CHECK(std::string(pw->format()) == "int8");
      CHECK(pw->num_bytes() < w.size() * sizeof(float) / 2);
      std::vector<float> y(want.size(), NAN);
      q->matmul(*pw, x.data(), s.tokens, y.data(), pool);
      CHECK(std::memcmp(y.data(), want.data(), want.size() * sizeof(float)) == 0);
      for (int64_t t = 0; t < s.tokens; ++t) {  // alone in a call: the same bits
        std::vector<float> one(s.rows, NAN);
        q->matmul(*pw, x.data() + t * s.cols, 1, one.data(), pool);
        CHECK(std::memcmp(one.data(), want.data() + t * s.rows, s.rows * sizeof(float)) == 0);
      }
      // Grouped with itself: each output equals matmul's.
      auto* grouped = dynamic_cast<GroupedMatmul*>(q.get());
      REQUIRE(grouped != nullptr);
      std::vector<float> g1(want.size(), NAN), g2(want.size(), NAN);
      const MatmulTarget targets[] = {{pw.get(), g1.data()}, {pw.get(), g2.data()}};
      grouped->matmul_group(targets, x.data(), s.tokens, pool);
      CHECK(g1 == y);
      CHECK(g2 == y);
      // The embedding lookup: q * scale, within half a step of the row's max of the floats.
      std::vector<float> row(s.cols);
      q->dequantize_row(*pw, s.rows - 1, row.data());
      float amax = 0.0f;
      for (int64_t c = 0; c < s.cols; ++c) amax = std::max(amax, std::fabs(w[(s.rows - 1) * s.cols + c]));
      for (int64_t c = 0; c < s.cols; ++c)
        CHECK(std::fabs(row[c] - w[(s.rows - 1) * s.cols + c]) <= amax / 254.0f * 1.0001f);
      if (first.empty()) first = y;
      CHECK(y == first);
    }
  }
}

TEST_CASE("quantizer.int8 reads block formats and refuses what it cannot read") {
  PluginRegistry registry;
  registry.scan_directory(test::plugin_dir());
  auto q = make_int8(registry, "auto");
  REQUIRE(q);
  // A Q4_K weight: converted from its dequantization.
  const int64_t rows = 9, cols = 256;
  std::vector<float> f = normal(rows * cols, 3, 0.1f);
  const size_t row_bytes = ggml_row_size(GgmlType::Q4_K, cols);
  std::vector<uint8_t> blocks(row_bytes * rows);
  for (int64_t r = 0; r < rows; ++r)
    REQUIRE(quantize_row(GgmlType::Q4_K, f.data() + r * cols, blocks.data() + r * row_bytes, cols));
  WeightView view{"blk.0.attn_q.weight", static_cast<uint32_t>(GgmlType::Q4_K), cols, rows, blocks.data(), blocks.size()};
  std::unique_ptr<PreparedWeight> pw;
  REQUIRE(q->prepare(view, &pw).is_ok());
  std::vector<float> deq(cols), got(cols);
  for (int64_t r = 0; r < rows; ++r) {
    REQUIRE(dequantize_row(GgmlType::Q4_K, blocks.data() + r * row_bytes, deq.data(), cols));
    q->dequantize_row(*pw, r, got.data());
    float amax = 0.0f;
    for (float v : deq) amax = std::max(amax, std::fabs(v));
    for (int64_t c = 0; c < cols; ++c) CHECK(std::fabs(got[c] - deq[c]) <= amax / 254.0f * 1.0001f);
  }
  // Wrong byte count, unknown type: one error naming the weight.
  WeightView short_view = view;
  short_view.num_bytes -= 1;
  Status st = q->prepare(short_view, &pw);
  CHECK_FALSE(st.is_ok());
  CHECK(st.message().find("blk.0.attn_q.weight") != std::string::npos);
  std::vector<uint8_t> junk(ggml_row_size(GgmlType::Q2_K, 256));
  WeightView q2{"blk.1.ffn_down.weight", static_cast<uint32_t>(GgmlType::Q2_K), 256, 1, junk.data(), junk.size()};
  st = q->prepare(q2, &pw);
  CHECK_FALSE(st.is_ok());
  CHECK(st.message().find("blk.1.ffn_down.weight") != std::string::npos);
  // An unknown kernel name is one error naming the key.
  CHECK_FALSE(make_int8(registry, "sse9"));
}
