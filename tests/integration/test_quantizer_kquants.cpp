// quantizer.gguf with the weight types of llama.cpp's Q4_K_M / Q5_K_M files (Q4_K, Q5_K, Q6_K, and Q5_0 / Q5_1
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
#include "tessera/interleaved.h"
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
  if (type == GgmlType::Q4_K || type == GgmlType::Q5_K || type == GgmlType::Q6_K) {
    for (auto& b : w) b = static_cast<uint8_t>(rng());
    // Q4_K / Q5_K: d, dmin are the first two fp16 fields; Q6_K: d is the last 2 bytes of its 210.
    const bool q6 = type == GgmlType::Q6_K;
    const size_t block = ggml_type_traits(type).type_size;
    for (size_t off = 0; off < w.size(); off += block) {
      const uint16_t d = fp32_to_fp16(q6 ? 0.0003f : 0.001f);
      const uint16_t dmin = fp32_to_fp16(0.0005f);
      if (!q6) {
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

// What each output of a matmul of `w` (rows x cols of `type`) with the num_tokens rows of x
// must be: with the activations converted the way llama.cpp does at run time, vec_dot of each
// (weight row, activation row) pair, or with `interleaved` the scalar interleaved kernel on
// the repacked rows.
std::vector<float> expected_outputs(GgmlType type, const std::vector<uint8_t>& w, int64_t rows,
                                    int64_t cols, const std::vector<float>& x,
                                    int64_t num_tokens, bool interleaved) {
  const GgmlType xt = vec_dot_type(type);
  const size_t xb = ggml_row_size(xt, cols);
  const size_t wb = ggml_row_size(type, cols);
  std::vector<uint8_t> xq(xb * num_tokens);
  for (int64_t t = 0; t < num_tokens; ++t)
    REQUIRE(quantize_activation_row(xt, x.data() + t * cols, xq.data() + t * xb, cols));
  std::vector<float> y(static_cast<size_t>(num_tokens * rows));
  if (interleaved) {
    std::vector<uint8_t> packed(interleaved_size(type, rows, cols));
    interleave_rows(type, w.data(), rows, cols, packed.data());
    matmul_interleaved_scalar(type, packed.data(), cols, rows, xq.data(), xb, num_tokens, y.data(),
                              rows);
    return y;
  }
  for (int64_t t = 0; t < num_tokens; ++t)
    for (int64_t r = 0; r < rows; ++r)
      y[t * rows + r] = vec_dot(type, cols, w.data() + r * wb, xq.data() + t * xb);
  return y;
}

// Each weight alone (Quantizer::matmul) and all of them in one grouped matmul, on `exec`:
// outputs [0] alone, [1] grouped, per weight.
std::vector<std::vector<float>> run_alone_and_grouped(
    Quantizer& quantizer, const std::vector<std::unique_ptr<PreparedWeight>>& prepared,
    const std::vector<float>& x, int64_t num_tokens, Executor& exec) {
  std::vector<std::vector<float>> out(2 * prepared.size());
  std::vector<MatmulTarget> targets;
  for (size_t i = 0; i < prepared.size(); ++i) {
    out[2 * i].assign(static_cast<size_t>(num_tokens * prepared[i]->rows()), -1.0f);
    out[2 * i + 1].assign(out[2 * i].size(), -1.0f);
    quantizer.matmul(*prepared[i], x.data(), num_tokens, out[2 * i].data(), exec);
    targets.push_back({prepared[i].get(), out[2 * i + 1].data()});
  }
  auto* group = dynamic_cast<GroupedMatmul*>(&quantizer);
  REQUIRE(group != nullptr);
  group->matmul_group(std::span<const MatmulTarget>(targets), x.data(), num_tokens, exec);
  return out;
}

}  // namespace

TEST_CASE("quantizer.gguf runs Q4_K, Q5_K, Q6_K, Q5_0 and Q5_1 weights, alone and grouped with Q8_0") {
  PluginRegistry registry;
  registry.scan_directory(test::plugin_dir());
  PluginContext ctx{&host_logger(), ""};
  auto quantizer = registry.create<Quantizer>("gguf", PluginConfig("gguf", "engine.quantizer", {}), ctx);
  REQUIRE(quantizer);
  CHECK(quantizer->supports(static_cast<uint32_t>(GgmlType::Q4_K)));
  CHECK(quantizer->supports(static_cast<uint32_t>(GgmlType::Q6_K)));
  CHECK(quantizer->supports(static_cast<uint32_t>(GgmlType::Q5_0)));
  CHECK(quantizer->supports(static_cast<uint32_t>(GgmlType::Q5_1)));
  CHECK(quantizer->supports(static_cast<uint32_t>(GgmlType::Q5_K)));
  CHECK_FALSE(quantizer->supports(static_cast<uint32_t>(GgmlType::Q3_K)));
  CHECK_FALSE(quantizer->supports(static_cast<uint32_t>(GgmlType::Q8_K)));

  const int64_t cols = 512;
  const int64_t num_tokens = 5;
  constexpr int kWeights = 6;
  const GgmlType types[kWeights] = {GgmlType::Q4_K, GgmlType::Q8_0, GgmlType::Q6_K,
                                    GgmlType::Q5_0, GgmlType::Q5_1, GgmlType::Q5_K};
  const int64_t rows[kWeights] = {37, 20, 19, 23, 18, 11};
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

  ThreadPool exec(1);  // one thread: every range runs on the caller
  const auto out = run_alone_and_grouped(*quantizer, prepared, x, num_tokens, exec);
  for (int i = 0; i < kWeights; ++i) {
    CAPTURE(ggml_type_name(types[i]));
    const std::vector<float> want = expected_outputs(types[i], data[i], rows[i], cols, x, num_tokens, false);
    CHECK(std::memcmp(out[2 * i].data(), want.data(), want.size() * sizeof(float)) == 0);
    CHECK(std::memcmp(out[2 * i + 1].data(), want.data(), want.size() * sizeof(float)) == 0);
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
  // And a Q5_K row.
  quantizer->dequantize_row(*prepared[5], 10, row.data());
  REQUIRE(dequantize_row(GgmlType::Q5_K, data[5].data() + 10 * ggml_row_size(GgmlType::Q5_K, cols),
                         ref.data(), cols));
  CHECK(row == ref);
}

// `layout: interleaved` repacks Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K at load
// (tessera/interleaved.h): each output equals the scalar interleaved kernel on the
// repacked rows, alone, grouped with the other types, and split over two threads.
TEST_CASE("quantizer.gguf layout: interleaved: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K repacked") {
  PluginRegistry registry;
  registry.scan_directory(test::plugin_dir());
  PluginContext ctx{&host_logger(), ""};
  auto quantizer = registry.create<Quantizer>(
      "gguf", PluginConfig("gguf", "engine.quantizer", {{"layout", std::string("interleaved")}}), ctx);
  REQUIRE(quantizer);
  const int64_t cols = 512;
  const int64_t num_tokens = 6;
  constexpr int kWeights = 8;
  const GgmlType types[kWeights] = {GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q5_0, GgmlType::Q8_0,
                                    GgmlType::Q4_K, GgmlType::Q6_K, GgmlType::Q5_K, GgmlType::Q5_1};
  const char* formats[kWeights] = {"q4_0x8", "q4_1x8", "q5_0x8", "q8_0x8",
                                   "q4_Kx8", "q6_Kx8", "q5_Kx8", "q5_1x8"};
  const int64_t rows[kWeights] = {37, 20, 19, 41, 18, 9, 21, 13};
  std::vector<std::vector<uint8_t>> data;
  std::vector<std::unique_ptr<PreparedWeight>> prepared;
  for (int i = 0; i < kWeights; ++i) {
    data.push_back(random_weight(types[i], rows[i], cols, 200u + i));
    WeightView view{"w", static_cast<uint32_t>(types[i]), cols, rows[i], data.back().data(),
                    data.back().size()};
    std::unique_ptr<PreparedWeight> pw;
    REQUIRE(quantizer->prepare(view, &pw).is_ok());
    CAPTURE(ggml_type_name(types[i]));
    CHECK(std::string(pw->format()) == formats[i]);
    CHECK(pw->num_bytes() == (has_interleaved_layout(types[i])
                                  ? interleaved_size(types[i], rows[i], cols)
                                  : data.back().size()));
    prepared.push_back(std::move(pw));
  }
  std::mt19937 rng(9);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(num_tokens * cols));
  for (auto& v : x) v = dist(rng);

  for (int threads : {1, 2}) {
    CAPTURE(threads);
    ThreadPool exec(threads);
    const auto out = run_alone_and_grouped(*quantizer, prepared, x, num_tokens, exec);
    for (int i = 0; i < kWeights; ++i) {
      CAPTURE(ggml_type_name(types[i]));
      const std::vector<float> want = expected_outputs(types[i], data[i], rows[i], cols, x,
                                                       num_tokens, has_interleaved_layout(types[i]));
      CHECK(std::memcmp(out[2 * i].data(), want.data(), want.size() * sizeof(float)) == 0);
      CHECK(std::memcmp(out[2 * i + 1].data(), want.data(), want.size() * sizeof(float)) == 0);
    }
  }

  // Embedding lookups of a repacked row give the GGUF row's values.
  std::vector<float> row(cols), ref(cols);
  for (int i = 0; i < kWeights; ++i) {
    CAPTURE(ggml_type_name(types[i]));
    const int64_t r = rows[i] - 1;
    quantizer->dequantize_row(*prepared[i], r, row.data());
    REQUIRE(dequantize_row(types[i], data[i].data() + r * ggml_row_size(types[i], cols), ref.data(), cols));
    CHECK(row == ref);
  }
}
