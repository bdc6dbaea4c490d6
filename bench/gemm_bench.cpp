// bench_gemm: prefill matmuls three ways, on the shapes of SmolLM2-135M's 30 layers (Q4_1):
//
//   int8     what quantizer.gguf does: activations quantized to Q8_1, integer block dots in
//            ggml's order (vec_dot_tile), bit-identical to llama.cpp's CPU results;
//   blas     OpenBLAS sgemm on weights dequantized to f32 on every call (the tiles a
//            quantizer would have to produce: nothing extra stays in memory);
//   blas-f32 OpenBLAS sgemm on weights dequantized once and kept (4.5x the weight memory:
//            about 400 MiB more for this model).
//
// Prints ms per forward pass (matmuls only) and tokens/s for each batch size, both paths on
// the same 2 threads, interleaved, median of --passes; and how far the f32 results are from
// the int8 ones (they are not the same numbers: f32 activations are not rounded to 8 bits).
//
//     build/bench/bench_gemm [--threads 2] [--passes 5] [--tokens 16,64,512]
#include <cblas.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "tessera/ggml_types.h"
#include "tessera/thread_pool.h"

extern "C" void openblas_set_num_threads(int num_threads);

namespace {

using tessera::GgmlType;

struct Matrix {
  int64_t rows, cols;
  std::vector<uint8_t> q4_1;   // as stored in the GGUF
  std::vector<float> f32;      // dequantized once (blas-f32)
  size_t row_bytes() const { return tessera::ggml_row_size(GgmlType::Q4_1, cols); }
};

double now_ms() {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

std::vector<int> parse_list(const std::string& s) {
  std::vector<int> out;
  for (size_t p = 0; p < s.size();) {
    size_t q = s.find(',', p);
    if (q == std::string::npos) q = s.size();
    out.push_back(std::atoi(s.substr(p, q - p).c_str()));
    p = q + 1;
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  int threads = 2, passes = 5;
  std::vector<int> token_counts = {16, 64, 512};
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--threads" && i + 1 < argc) threads = std::atoi(argv[++i]);
    else if (a == "--passes" && i + 1 < argc) passes = std::atoi(argv[++i]);
    else if (a == "--tokens" && i + 1 < argc) token_counts = parse_list(argv[++i]);
    else {
      std::fprintf(stderr, "usage: %s [--threads N] [--passes N] [--tokens 16,64,512]\n", argv[0]);
      return 2;
    }
  }
  openblas_set_num_threads(threads);
  tessera::ThreadPool pool(threads);
  std::mt19937 rng(11);
  std::normal_distribution<float> dist(0.0f, 0.05f);
  const int64_t d = 576, kv = 192, ffn = 1536, layers = 30;
  std::vector<Matrix> mats;
  for (int64_t l = 0; l < layers; ++l) {
    for (auto [r, c] : {std::pair{d, d}, {kv, d}, {kv, d}, {d, d}, {ffn, d}, {ffn, d}, {d, ffn}}) {
      Matrix m{r, c, {}, {}};
      m.q4_1.resize(m.row_bytes() * r);
      m.f32.resize(static_cast<size_t>(r * c));
      std::vector<float> row(c);
      for (int64_t i = 0; i < r; ++i) {
        for (float& v : row) v = dist(rng);
        tessera::quantize_row(GgmlType::Q4_1, row.data(), m.q4_1.data() + i * m.row_bytes(), c);
        tessera::dequantize_row(GgmlType::Q4_1, m.q4_1.data() + i * m.row_bytes(),
                                m.f32.data() + i * c, c);
      }
      mats.push_back(std::move(m));
    }
  }
  const int max_tokens = *std::max_element(token_counts.begin(), token_counts.end());
  std::vector<float> x(static_cast<size_t>(max_tokens) * ffn);
  std::normal_distribution<float> xdist(0.0f, 1.0f);
  for (float& v : x) v = xdist(rng);
  std::vector<uint8_t> xq(tessera::ggml_row_size(GgmlType::Q8_1, ffn) * max_tokens);
  std::vector<float> y_int8(static_cast<size_t>(max_tokens) * ffn), y_blas(y_int8.size());
  std::vector<float> tile(static_cast<size_t>(ffn) * ffn);  // one dequantized matrix

  const auto run_int8 = [&](const Matrix& m, int tokens) {
    const size_t xb = tessera::ggml_row_size(GgmlType::Q8_1, m.cols);
    pool.run(tokens, [&](int64_t b, int64_t e, int) {
      for (int64_t t = b; t < e; ++t)
        tessera::quantize_activation_row(GgmlType::Q8_1, x.data() + t * m.cols, xq.data() + t * xb, m.cols);
    });
    const int64_t tasks = (m.rows + 15) / 16;
    pool.run(tasks, [&](int64_t b, int64_t e, int) {
      const int64_t r0 = b * 16, r1 = std::min(m.rows, e * 16);
      tessera::vec_dot_tile(GgmlType::Q4_1, m.cols, m.q4_1.data() + r0 * m.row_bytes(), m.row_bytes(),
                            r1 - r0, xq.data(), xb, tokens, y_int8.data() + r0, m.rows);
    });
  };
  const auto sgemm = [&](const Matrix& m, const float* w, int tokens) {
    // y[tokens][rows] = x[tokens][cols] * W[rows][cols]^T
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, tokens, static_cast<int>(m.rows),
                static_cast<int>(m.cols), 1.0f, x.data(), static_cast<int>(m.cols), w,
                static_cast<int>(m.cols), 0.0f, y_blas.data(), static_cast<int>(m.rows));
  };
  const auto run_blas = [&](const Matrix& m, int tokens) {
    pool.run(m.rows, [&](int64_t b, int64_t e, int) {
      for (int64_t r = b; r < e; ++r)
        tessera::dequantize_row(GgmlType::Q4_1, m.q4_1.data() + r * m.row_bytes(), tile.data() + r * m.cols, m.cols);
    });
    sgemm(m, tile.data(), tokens);
  };
  const auto run_blas_f32 = [&](const Matrix& m, int tokens) { sgemm(m, m.f32.data(), tokens); };

  std::printf("SmolLM2-135M layer matmuls (30 x q,k,v,o,gate,up,down; Q4_1), %d threads, median of %d passes\n",
              threads, passes);
  std::printf("tokens   int8 ms  (t/s)      blas ms  (t/s)      blas-f32 ms  (t/s)    blas/int8 speed   max rel diff f32 vs int8\n");
  for (int tokens : token_counts) {
    std::vector<double> t_int8, t_blas, t_blas_f32;
    for (int p = 0; p < passes + 1; ++p) {  // pass 0 warms up
      double t0 = now_ms();
      for (const Matrix& m : mats) run_int8(m, tokens);
      double t1 = now_ms();
      for (const Matrix& m : mats) run_blas(m, tokens);
      double t2 = now_ms();
      for (const Matrix& m : mats) run_blas_f32(m, tokens);
      double t3 = now_ms();
      if (p > 0) {
        t_int8.push_back(t1 - t0);
        t_blas.push_back(t2 - t1);
        t_blas_f32.push_back(t3 - t2);
      }
    }
    // Agreement on the last matrix of the pass (int8 and blas outputs both hold it).
    const Matrix& last = mats.back();
    run_int8(last, tokens);
    run_blas(last, tokens);
    double worst = 0.0, scale = 0.0;
    for (int64_t i = 0; i < tokens * last.rows; ++i) {
      worst = std::max(worst, static_cast<double>(std::fabs(y_int8[i] - y_blas[i])));
      scale = std::max(scale, static_cast<double>(std::fabs(y_blas[i])));
    }
    const auto median = [](std::vector<double> v) {
      std::sort(v.begin(), v.end());
      return v[v.size() / 2];
    };
    const double a = median(t_int8), b = median(t_blas), c = median(t_blas_f32);
    std::printf("%6d %9.1f (%6.0f) %9.1f (%6.0f) %12.1f (%6.0f) %12.2fx %22.2e\n", tokens, a,
                tokens * 1000.0 / a, b, tokens * 1000.0 / b, c, tokens * 1000.0 / c, a / b,
                worst / scale);
  }
  return 0;
}
