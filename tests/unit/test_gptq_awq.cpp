// gptq and awq (tessera/gptq.h, tessera/awq.h) on small synthetic layers, where the output
// error ||W X - W^ X|| can be computed exactly:
//  - GPTQ's error compensation gives a smaller output error than round-to-nearest of the same
//    format (Q4_0, and Q4_K's 256-column super-blocks), with and without act-order, and its
//    bytes are that format's (they dequantize to the values GPTQ chose);
//  - the Hessian factor satisfies U^T U (H + damp I) = I;
//  - AWQ's clipping search and scaled importance quantizer do not lose to round-to-nearest;
//  - bad input is an error naming what is wrong.
#include <doctest/doctest.h>

#include <cmath>
#include <random>
#include <vector>

#include "tessera/awq.h"
#include "tessera/ggml_types.h"
#include "tessera/gptq.h"

using namespace tessera;
using namespace tessera::quant;

namespace {

// Activations with a few large channels and correlated columns, as a transformer's are.
struct Layer {
  int64_t rows, cols, tokens;
  std::vector<float> w;  // rows x cols
  std::vector<float> x;  // tokens x cols
  std::vector<double> xtx;
};

Layer make_layer(int64_t rows, int64_t cols, int64_t tokens, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> n(0.0f, 1.0f);
  Layer l{rows, cols, tokens, {}, {}, {}};
  l.w.resize(static_cast<size_t>(rows * cols));
  for (float& v : l.w) v = 0.05f * n(rng);
  std::vector<float> mag(static_cast<size_t>(cols));
  for (int64_t c = 0; c < cols; ++c) mag[c] = (c % 37 == 5) ? 8.0f : 0.5f + std::fabs(n(rng));
  constexpr int kFactors = 8;
  std::vector<float> mix(static_cast<size_t>(kFactors * cols));
  for (float& v : mix) v = n(rng);
  l.x.resize(static_cast<size_t>(tokens * cols));
  for (int64_t t = 0; t < tokens; ++t) {
    float f[kFactors];
    for (float& v : f) v = n(rng);
    for (int64_t c = 0; c < cols; ++c) {
      float v = 0.5f * n(rng);
      for (int k = 0; k < kFactors; ++k) v += 0.4f * f[k] * mix[k * cols + c];
      l.x[t * cols + c] = mag[c] * v;
    }
  }
  l.xtx.assign(static_cast<size_t>(cols * cols), 0.0);
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t i = 0; i < cols; ++i)
      for (int64_t j = 0; j < cols; ++j) l.xtx[i * cols + j] += double(l.x[t * cols + i]) * l.x[t * cols + j];
  return l;
}

std::vector<float> dequantize(GgmlType type, const std::vector<uint8_t>& bytes, int64_t rows, int64_t cols) {
  std::vector<float> out(static_cast<size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r)
    REQUIRE(dequantize_row(type, bytes.data() + r * ggml_row_size(type, cols), out.data() + r * cols, cols));
  return out;
}

std::vector<uint8_t> rtn(GgmlType type, const Layer& l) {
  const size_t rb = ggml_row_size(type, l.cols);
  std::vector<uint8_t> out(rb * l.rows);
  for (int64_t r = 0; r < l.rows; ++r)
    REQUIRE(quantize_weight_row(type, l.w.data() + r * l.cols, out.data() + r * rb, l.cols, nullptr));
  return out;
}

// sum over tokens and rows of ((W - W^) x)^2
double output_error(const Layer& l, const std::vector<float>& wq) {
  double s = 0;
  for (int64_t t = 0; t < l.tokens; ++t)
    for (int64_t r = 0; r < l.rows; ++r) {
      double y = 0;
      for (int64_t c = 0; c < l.cols; ++c) y += double(l.w[r * l.cols + c] - wq[r * l.cols + c]) * l.x[t * l.cols + c];
      s += y * y;
    }
  return s;
}

InputStats stats_of(const Layer& l) {
  InputStats in;
  in.weights = {"blk.0.w"};
  in.cols = l.cols;
  in.count = l.tokens;
  in.xtx = l.xtx;
  in.sum_abs.assign(static_cast<size_t>(l.cols), 0.0);
  in.sum_sq.assign(static_cast<size_t>(l.cols), 0.0);
  for (int64_t t = 0; t < l.tokens; ++t)
    for (int64_t c = 0; c < l.cols; ++c) {
      in.sum_abs[c] += std::fabs(l.x[t * l.cols + c]);
      in.sum_sq[c] += double(l.x[t * l.cols + c]) * l.x[t * l.cols + c];
    }
  return in;
}

}  // namespace

TEST_CASE("gptq: a smaller output error than round-to-nearest, in the format's own bytes") {
  const Layer l = make_layer(48, 512, 1024, 7);
  for (GgmlType type : {GgmlType::Q4_0, GgmlType::Q4_K, GgmlType::Q5_0}) {
    for (bool act_order : {false, true}) {
      const std::string type_name = ggml_type_name(type);
    CAPTURE(type_name);
      CAPTURE(act_order);
      GptqOptions o;
      o.act_order = act_order;
      const GptqHessian h = gptq_prepare(l.xtx, l.cols, gptq_group_size(type), o, "test");
      const std::vector<uint8_t> q = gptq_quantize(type, l.w.data(), l.rows, l.cols, h, o, 2);
      REQUIRE(q.size() == ggml_row_size(type, l.cols) * l.rows);
      const double e_gptq = output_error(l, dequantize(type, q, l.rows, l.cols));
      const double e_rtn = output_error(l, dequantize(type, rtn(type, l), l.rows, l.cols));
      MESSAGE(std::string(ggml_type_name(type)) << (act_order ? " act-order" : "") << ": output error rtn " << e_rtn
                                   << ", gptq " << e_gptq);
      CHECK(e_gptq < 0.8 * e_rtn);
    }
  }
}

TEST_CASE("gptq: the factor U satisfies U^T U (H + damp) = I") {
  const Layer l = make_layer(4, 64, 256, 3);
  GptqOptions o;
  const GptqHessian h = gptq_prepare(l.xtx, l.cols, 32, o, "test");
  double mean = 0;
  for (int64_t c = 0; c < l.cols; ++c) mean += l.xtx[c * l.cols + c];
  mean /= l.cols;
  const int64_t n = l.cols;
  double worst = 0;
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double v = 0;  // (U^T U H)[i][j]
      for (int64_t k = 0; k < n; ++k) {
        double utu = 0;
        for (int64_t m = 0; m <= std::min(i, k); ++m) utu += double(h.u[m * n + i]) * h.u[m * n + k];
        v += utu * (l.xtx[k * n + j] + (k == j ? o.damp * mean : 0.0));
      }
      worst = std::max(worst, std::fabs(v - (i == j ? 1.0 : 0.0)));
    }
  CHECK(worst < 1e-3);
}

TEST_CASE("gptq: bad input names the problem") {
  const Layer l = make_layer(2, 64, 64, 1);
  GptqOptions o;
  CHECK_THROWS_WITH_AS(gptq_prepare(l.xtx, 96, 32, o, "blk.0.w"), doctest::Contains("blk.0.w"), std::invalid_argument);
  std::vector<double> zero(64 * 64, 0.0);
  CHECK_THROWS_WITH(gptq_prepare(zero, 64, 32, o, "blk.1.w"), doctest::Contains("no calibration activation"));
  const GptqHessian h = gptq_prepare(l.xtx, 64, 32, o, "x");
  CHECK_THROWS_WITH(gptq_quantize(GgmlType::Q6_K, l.w.data(), 2, 64, h, o, 1), doctest::Contains("q6_K is not one of"));
}

TEST_CASE("awq: the clipping search and the scaled importance quantizer beat round-to-nearest") {
  const Layer l = make_layer(32, 256, 512, 11);
  const InputStats in = stats_of(l);
  for (GgmlType type : {GgmlType::Q4_0, GgmlType::Q4_K}) {
    const std::string type_name = ggml_type_name(type);
    CAPTURE(type_name);
    AwqOptions o;
    // Scale the columns by mean|x|^0.5 as the search would, quantize, and undo the scale.
    std::vector<float> s(static_cast<size_t>(l.cols));
    for (int64_t c = 0; c < l.cols; ++c) s[c] = std::sqrt(static_cast<float>(in.sum_abs[c] / in.count));
    std::vector<float> ws = l.w;
    for (size_t i = 0; i < ws.size(); ++i) ws[i] *= s[i % l.cols];
    const std::vector<uint8_t> q = awq_quantize_tensor(type, ws.data(), l.rows, l.cols, in, s, o, 2);
    std::vector<float> wq = dequantize(type, q, l.rows, l.cols);
    for (size_t i = 0; i < wq.size(); ++i) wq[i] /= s[i % l.cols];
    const double e_awq = output_error(l, wq);
    const double e_rtn = output_error(l, dequantize(type, rtn(type, l), l.rows, l.cols));
    MESSAGE(std::string(ggml_type_name(type)) << ": output error rtn " << e_rtn << ", awq " << e_awq);
    CHECK(e_awq < e_rtn);
  }
  CHECK_THROWS_WITH(awq_quantize_tensor(GgmlType::Q4_0, l.w.data(), l.rows, 128, in, {}, AwqOptions{}, 1),
                    doctest::Contains("256 columns"));
}
