// quantizer.gguf with the weight types of llama.cpp's Q4_K_M files (Q4_K, Q6_K, and Q5_0 / Q5_1
// where a width is not a multiple of 256) beside Q8_0: the plugin accepts them, quantizes the
// input once per dot type (Q8_K, Q8_0, Q8_1), and every output element equals vec_dot of its
// (weight row, activation row) pair bit for bit, also when one grouped matmul mixes all of
// them. Needs the plugins, not the model.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <span>
#include <vector>

#include "support/test_env.h"
#include "tessera/ggml_types.h"
#include "tessera/plugin_registry.h"
#include "tessera/sdk.h"
#include "tessera/thread_pool.h"

using namespace tessera;

namespace {

// A weight of `rows` rows: K-quant rows are random bytes (every pattern is a valid block) with
// moderate fp16 scales; other types are quantized from random floats.
std::vector<uint8_t> random_weight(GgmlType type, int64_t rows, int64_t cols, uint32_t seed) {
  std::mt19937 rng(seed);
  const size_t row_bytes = ggml_row_size(type, cols);
  std::vector<uint8_t> w(row_bytes * rows);
  if (type == GgmlType::Q4_K || type == GgmlType::Q6_K) {
    for (auto& b : w) b = static_cast<uint8_t>(rng());
    // Q4_K: d, dmin are the first two fp16 fields; Q6_K: d is the last 2 bytes of its 210.
    const size_t block = type == GgmlType::Q4_K ? 144 : 210;
    for (size_t off = 0; off < w.size(); off += block) {
      const uint16_t d = fp32_to_fp16(type == GgmlType::Q4_K ? 0.001f : 0.0003f);
      const uint16_t dmin = fp32_to_fp16(0.0005f);
      if (type == GgmlType::Q4_K) {
        std::memcpy(&w[off], &d, 2);
        std::memcpy(&w[off + 2], &dmin, 2);
      } else {
        std::memcpy(&w[off + block - 2], &d, 2);
      }
    }
    return w;
  }
  std::normal_distribution<float> dist(0.0f, 0.3f);
  std::vector<float> f(static_cast<size_t>(cols));
  for (int64_t r = 0; r < rows; ++r) {
    for (auto& v : f) v = dist(rng);
    REQUIRE(quantize_row(type, f.data(), w.data() + r * row_bytes, cols));
  }
  return w;
}

}  // namespace

TEST_CASE("quantizer.gguf runs Q4_K, Q6_K, Q5_0 and Q5_1 weights, alone and grouped with Q8_0") {
  PluginRegistry registry;
  registry.scan_directory(test::plugin_dir());
  PluginContext ctx{&host_logger(), ""};
  auto quantizer = registry.create<Quantizer>("gguf", PluginConfig("gguf", "engine.quantizer", {}), ctx);
  REQUIRE(quantizer);
  CHECK(quantizer->supports(static_cast<uint32_t>(GgmlType::Q4_K)));
  CHECK(quantizer->supports(static_cast<uint32_t>(GgmlType::Q6_K)));
  CHECK(quantizer->supports(static_cast<uint32_t>(GgmlType::Q5_0)));
  CHECK(quantizer->supports(static_cast<uint32_t>(GgmlType::Q5_1)));
  CHECK_FALSE(quantizer->supports(static_cast<uint32_t>(GgmlType::Q5_K)));
  CHECK_FALSE(quantizer->supports(static_cast<uint32_t>(GgmlType::Q8_K)));

  const int64_t cols = 512;
  const int64_t num_tokens = 5;
  constexpr int kWeights = 5;
  const GgmlType types[kWeights] = {GgmlType::Q4_K, GgmlType::Q8_0, GgmlType::Q6_K,
                                    GgmlType::Q5_0, GgmlType::Q5_1};
  const int64_t rows[kWeights] = {37, 20, 19, 23, 18};
  std::vector<std::vector<uint8_t>> data;
  std::vector<std::unique_ptr<PreparedWeight>> prepared;
  for (int i = 0; i < kWeights; ++i) {
    data.push_back(random_weight(types[i], rows[i], cols, 100u + i));
    WeightView view{"w", static_cast<uint32_t>(types[i]), cols, rows[i], data.back().data(),
                    data.back().size()};
    std::unique_ptr<PreparedWeight> pw;
    REQUIRE(quantizer->prepare(view, &pw).is_ok());
    CHECK(pw->num_bytes() == data.back().size());
    prepared.push_back(std::move(pw));
  }
  // A K-quant weight whose byte count does not match its shape is refused.
  WeightView bad{"bad", static_cast<uint32_t>(GgmlType::Q4_K), cols, 2, data[0].data(), 144 * 3};
  std::unique_ptr<PreparedWeight> bad_pw;
  CHECK_FALSE(quantizer->prepare(bad, &bad_pw).is_ok());

  std::mt19937 rng(7);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(num_tokens * cols));
  for (auto& v : x) v = dist(rng);

  // What each output must be: vec_dot of the weight row and the activation row converted the
  // way llama.cpp does at run time.
  auto expected = [&](int i) {
    const GgmlType xt = vec_dot_type(types[i]);
    const size_t xb = ggml_row_size(xt, cols);
    const size_t wb = ggml_row_size(types[i], cols);
    std::vector<uint8_t> xq(xb * num_tokens);
    for (int64_t t = 0; t < num_tokens; ++t)
      REQUIRE(quantize_activation_row(xt, x.data() + t * cols, xq.data() + t * xb, cols));
    std::vector<float> y(static_cast<size_t>(num_tokens * rows[i]));
    for (int64_t t = 0; t < num_tokens; ++t)
      for (int64_t r = 0; r < rows[i]; ++r)
        y[t * rows[i] + r] = vec_dot(types[i], cols, data[i].data() + r * wb, xq.data() + t * xb);
    return y;
  };

  ThreadPool exec(1);  // one thread: every range runs on the caller
  std::vector<std::vector<float>> single(kWeights), grouped(kWeights);
  for (int i = 0; i < kWeights; ++i) {
    single[i].assign(static_cast<size_t>(num_tokens * rows[i]), -1.0f);
    grouped[i].assign(single[i].size(), -1.0f);
    quantizer->matmul(*prepared[i], x.data(), num_tokens, single[i].data(), exec);
  }
  auto* group = dynamic_cast<GroupedMatmul*>(quantizer.get());
  REQUIRE(group != nullptr);
  std::vector<MatmulTarget> targets;
  for (int i = 0; i < kWeights; ++i) targets.push_back({prepared[i].get(), grouped[i].data()});
  group->matmul_group(std::span<const MatmulTarget>(targets), x.data(), num_tokens, exec);
  for (int i = 0; i < kWeights; ++i) {
    CAPTURE(ggml_type_name(types[i]));
    const std::vector<float> want = expected(i);
    CHECK(std::memcmp(single[i].data(), want.data(), want.size() * sizeof(float)) == 0);
    CHECK(std::memcmp(grouped[i].data(), want.data(), want.size() * sizeof(float)) == 0);
    // And the values are real dots, not, e.g., NaN from an unwired type.
    bool finite = true;
    for (float v : want) finite = finite && std::isfinite(v) && v != 0.0f;
    CHECK(finite);
  }

  // Embedding lookups of a K-quant row dequantize it.
  std::vector<float> row(cols), ref(cols);
  quantizer->dequantize_row(*prepared[2], 3, row.data());
  REQUIRE(dequantize_row(GgmlType::Q6_K, data[2].data() + 3 * ggml_row_size(GgmlType::Q6_K, cols),
                         ref.data(), cols));
  CHECK(row == ref);
  // Likewise a Q5_0 row.
  quantizer->dequantize_row(*prepared[3], 4, row.data());
  REQUIRE(dequantize_row(GgmlType::Q5_0, data[3].data() + 4 * ggml_row_size(GgmlType::Q5_0, cols),
                         ref.data(), cols));
  CHECK(row == ref);
}
