// Every quantizer plugin (the build's and any on TESSERA_PLUGIN_PATH), for every GGML type it
// says it supports: weights written by the SDK's reference quantize_row come back from its
// dequantize_row within the format's bound of the original floats and of the reference
// dequantization; matmul equals a float dot against the dequantized rows within the
// activation-quantization bound, and does not depend on how many tokens share the call; a
// declared grouped_matmul capability is implemented and writes what matmul writes.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "support/plugins.h"
#include "support/random_data.h"
#include "tessera/sdk.h"
#include "tessera/sdk/kernels/ggml_types.h"

using namespace tessera;
using test::random_floats;

namespace {

struct Format {
  GgmlType type;
  // Largest |dequantized - original| over a block, as a fraction of the block's largest
  // magnitude: half a quantization step plus the rounding of the block's f16 scales (K types
  // also quantize their sub-block scales to 6 bits). F32 is exact.
  double bound;
};
const Format kFormats[] = {
    {GgmlType::F32, 0.0},         {GgmlType::F16, 1.0 / 1024},  {GgmlType::BF16, 1.0 / 128},
    {GgmlType::Q8_0, 1.0 / 120},  {GgmlType::Q5_0, 1.0 / 14},   {GgmlType::Q5_1, 1.0 / 14},
    {GgmlType::Q4_0, 1.0 / 7},    {GgmlType::Q4_1, 1.0 / 7},    {GgmlType::Q4_K, 1.0 / 6},
    {GgmlType::Q5_K, 1.0 / 12},   {GgmlType::Q6_K, 1.0 / 24},
};

// Extra error a prepared weight's own layout adds when it re-quantizes the file's values,
// as a fraction of the row's largest dequantized magnitude: "int8" (quantizer.int8's W8A8)
// rounds each row to 255 levels of max|row| / 127, so half a step. Layouts that keep the
// file's blocks (or widen them) add nothing.
double requantization_bound(const std::string& layout) {
  return layout == "int8" ? 0.5 / 127 + 1e-6 : 0.0;
}

constexpr int64_t kRows = 19;   // not a multiple of 8: interleaved layouts pad a last group
constexpr int64_t kCols = 512;  // two K super-blocks

Backend& cpu_backend() {
  static std::shared_ptr<Backend> backend =
      test::create_plugin<Backend>("cpu", test::conformance_params(PluginKind::kBackend, "cpu", "{threads: 3}"));
  return *backend;
}

}  // namespace

TEST_CASE("every quantizer keeps the round trip, matmul and capability contracts") {
  test::check_no_load_errors();
  const auto names = test::plugin_names(PluginKind::kQuantizer);
  REQUIRE(!names.empty());
  Executor& executor = cpu_backend().executor();
  for (const std::string& name : names) {
    auto q = test::create_plugin<Quantizer>(name, test::conformance_params(PluginKind::kQuantizer, name, "{}"));
    auto* grouped = dynamic_cast<GroupedMatmul*>(q.get());
    INFO("quantizer." << name);
    CHECK_MESSAGE((grouped != nullptr) == test::declares(PluginKind::kQuantizer, name, kCapabilityGroupedMatmul),
                  "GroupedMatmul implemented and capability 'grouped_matmul' declared must agree");
    int num_supported = 0;
    for (const Format& f : kFormats) {
      if (!q->supports(static_cast<uint32_t>(f.type))) continue;
      ++num_supported;
      INFO("type " << std::string(ggml_type_name(f.type)));
      const std::vector<float> w = random_floats(kRows * kCols, 7 + static_cast<uint32_t>(f.type), 0.05f);
      const size_t row_bytes = ggml_row_size(f.type, kCols);
      std::vector<uint8_t> bytes(row_bytes * kRows);
      for (int64_t r = 0; r < kRows; ++r)
        REQUIRE(quantize_row(f.type, w.data() + r * kCols, bytes.data() + r * row_bytes, kCols));
      WeightView view{"blk.0.ffn_up.weight", static_cast<uint32_t>(f.type), kCols, kRows, bytes.data(), bytes.size()};
      std::unique_ptr<PreparedWeight> prepared;
      REQUIRE(q->prepare(view, &prepared).is_ok());
      CHECK(prepared->rows() == kRows);
      CHECK(prepared->cols() == kCols);

      // dequantize_row: the format's bound from the floats and from the reference decoding.
      const int64_t block = ggml_type_traits(f.type).block_size;
      std::vector<float> dequantized(kRows * kCols), reference(kCols);
      const double layout_bound = requantization_bound(prepared->format());
      double worst = 0.0;
      for (int64_t r = 0; r < kRows; ++r) {
        float* got = dequantized.data() + r * kCols;
        q->dequantize_row(*prepared, r, got);
        REQUIRE(dequantize_row(f.type, bytes.data() + r * row_bytes, reference.data(), kCols));
        float row_amax = 0.0f;
        for (int64_t i = 0; i < kCols; ++i) row_amax = std::max(row_amax, std::fabs(reference[i]));
        const double layout_err = layout_bound * row_amax;
        for (int64_t b = 0; b < kCols; b += block) {
          float amax = 0.0f;
          for (int64_t i = b; i < b + block; ++i) amax = std::max(amax, std::fabs(w[r * kCols + i]));
          for (int64_t i = b; i < b + block; ++i) {
            const double err = std::fabs(got[i] - w[r * kCols + i]);
            worst = std::max(worst, amax > 0 ? err / amax : err);
            CHECK(err <= f.bound * amax + layout_err);
            CHECK(std::fabs(got[i] - reference[i]) <= f.bound * amax + layout_err);
          }
        }
      }
      MESSAGE("quantizer." << name << " " << std::string(ggml_type_name(f.type)) << ": worst round-trip error "
                           << worst << " of the block's max (bound " << f.bound << ")");

      // matmul against a float dot over the dequantized rows, for 1 and 5 tokens.
      constexpr int64_t kTokens = 5;
      const std::vector<float> x = random_floats(kTokens * kCols, 99, 1.0f);
      std::vector<float> y(kTokens * kRows, NAN), y_one(kRows, NAN);
      q->matmul(*prepared, x.data(), kTokens, y.data(), executor);
      for (int64_t t = 0; t < kTokens; ++t) {
        // Alone in a call, each token gets the same bits: a batch never changes a result.
        q->matmul(*prepared, x.data() + t * kCols, 1, y_one.data(), executor);
        for (int64_t r = 0; r < kRows; ++r) {
          double dot = 0.0, magnitude = 0.0;
          for (int64_t c = 0; c < kCols; ++c) {
            dot += static_cast<double>(dequantized[r * kCols + c]) * x[t * kCols + c];
            magnitude += std::fabs(static_cast<double>(dequantized[r * kCols + c]) * x[t * kCols + c]);
          }
          // Activations are quantized to the type's dot type (Q8: 1/254 of a block's max per
          // element, F16 for F16 weights; int8 layouts: 1/254 of the token's max) and products
          // summed in float (int8: in int32).
          // A re-quantizing layout (int8) quantizes the activations of F32 weights too.
          const bool float_activations = f.type == GgmlType::F32 && layout_bound == 0.0;
          const double tolerance = (float_activations ? 1e-5 : 1.2e-2) * magnitude + 1e-5;
          CHECK(std::fabs(y[t * kRows + r] - dot) <= tolerance);
          CHECK(y_one[r] == y[t * kRows + r]);
        }
      }
      if (grouped) {
        // The same weight twice and another row count: each output equals matmul's.
        std::vector<float> g1(kTokens * kRows, NAN), g2(kTokens * kRows, NAN);
        const MatmulTarget targets[] = {{prepared.get(), g1.data()}, {prepared.get(), g2.data()}};
        grouped->matmul_group(targets, x.data(), kTokens, executor);
        CHECK(g1 == y);
        CHECK(g2 == y);
      }
    }
    MESSAGE("quantizer." << name << ": " << num_supported << " GGML types checked");
    CHECK_MESSAGE(num_supported > 0, "supports() accepts none of the GGML types the suite knows");
    // A type it does not support is refused by prepare, not mis-read.
    if (!q->supports(static_cast<uint32_t>(GgmlType::Q2_K))) {
      std::vector<uint8_t> junk(ggml_row_size(GgmlType::Q2_K, 256));
      WeightView view{"w", static_cast<uint32_t>(GgmlType::Q2_K), 256, 1, junk.data(), junk.size()};
      std::unique_ptr<PreparedWeight> prepared;
      CHECK_FALSE(q->prepare(view, &prepared).is_ok());
    }
  }
}
