// bench_matmul: the quantized matmuls of one SmolLM2-135M forward pass, alone, on the
// persistent thread pool — 30 layers of q/k/v/o/gate/up/down in Q4_1 (or --type) plus the
// 49152 x 576 Q8_0 output projection, about the model's 92 MiB, so the weights stream from DRAM
// each pass as they do in decode. Prints ms per pass and tokens/s for batches 1..32, and the
// bytes/s the batch-1 pass reaches. Use it to measure a kernel change without the noise of a
// whole run:
//
//     build/bench/bench_matmul [--threads 2] [--passes 20] [--batches 1,4,8,16]
//                              [--layout ggml|interleaved|both] [--type Q4_1|Q4_0|Q5_0|Q8_0|...]
//
// --layout picks quantizer.gguf's interleaved layout (tessera/interleaved.h) or ggml's rows;
// `both` alternates the two pass by pass, so their ratio is measured side by side. --type sets
// the layer matrices' type (one with an interleaved layout whose block divides 576 and 1536:
// the K-quants' 256 does not divide 576).
#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "tessera/ggml_types.h"
#include "tessera/interleaved.h"
#include "tessera/thread_pool.h"

namespace {

using tessera::GgmlType;

struct Matrix {
  GgmlType type;
  int64_t rows, cols;
  std::vector<uint8_t> data;
  std::vector<uint8_t> interleaved;  // the same rows in the interleaved layout
  size_t row_bytes() const { return tessera::ggml_row_size(type, cols); }
};

Matrix random_matrix(GgmlType type, int64_t rows, int64_t cols, bool interleave, std::mt19937& rng) {
  Matrix m{type, rows, cols, {}};
  m.data.resize(m.row_bytes() * rows);
  std::normal_distribution<float> dist(0.0f, 0.05f);
  std::vector<float> f(cols);
  for (int64_t r = 0; r < rows; ++r) {
    for (auto& v : f) v = dist(rng);
    tessera::quantize_row(type, f.data(), m.data.data() + r * m.row_bytes(), cols);
  }
  if (interleave) {
    m.interleaved.resize(tessera::interleaved_size(type, rows, cols));
    tessera::interleave_rows(type, m.data.data(), rows, cols, m.interleaved.data());
  }
  return m;
}

struct Job {
  const Matrix* m;
  const uint8_t* x;
  size_t x_stride;
  int64_t tokens;
  float* y;
  bool interleaved;
};

// The same split as quantizer.gguf: 16-row tasks, contiguous ranges per thread.
void run_matmul(tessera::ThreadPool& pool, const Job& job) {
  constexpr int64_t kRowsPerTask = 16;
  const int64_t tasks = (job.m->rows + kRowsPerTask - 1) / kRowsPerTask;
  pool.run(tasks, [&](int64_t b, int64_t e, int) {
    const int64_t r0 = b * kRowsPerTask, r1 = std::min(job.m->rows, e * kRowsPerTask);
    if (job.interleaved && !job.m->interleaved.empty()) {
      const size_t group_bytes = tessera::interleaved_group_size(job.m->type, job.m->cols);
      tessera::matmul_interleaved(job.m->type, job.m->interleaved.data() + r0 / 8 * group_bytes,
                                  job.m->cols, r1 - r0, job.x, job.x_stride, job.tokens,
                                  job.y + r0, job.m->rows);
      return;
    }
    tessera::vec_dot_tile(job.m->type, job.m->cols, job.m->data.data() + r0 * job.m->row_bytes(),
                          job.m->row_bytes(), r1 - r0, job.x, job.x_stride, job.tokens,
                          job.y + r0, job.m->rows);
  });
}

}  // namespace

int main(int argc, char** argv) {
  int threads = 2, passes = 20;
  std::string layout = "ggml";
  GgmlType layer_type = GgmlType::Q4_1;
  std::vector<int> batches = {1, 2, 4, 8, 16, 32};
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--threads" && i + 1 < argc) threads = std::atoi(argv[++i]);
    else if (a == "--passes" && i + 1 < argc) passes = std::atoi(argv[++i]);
    else if (a == "--layout" && i + 1 < argc) layout = argv[++i];
    else if (a == "--type" && i + 1 < argc) {
      std::string name = argv[++i];  // ggml's names are lower case; accept either
      for (char& ch : name) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
      std::optional<GgmlType> t;
      for (GgmlType c : {GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q5_0, GgmlType::Q5_1,
                         GgmlType::Q8_0})
        if (name == tessera::ggml_type_name(c)) t = c;
      if (!t) {
        std::fprintf(stderr, "--type: expected a type with an interleaved layout and a block "
                     "dividing 576 (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0), got '%s'\n", name.c_str());
        return 2;
      }
      layer_type = *t;
    }
    else if (a == "--batches" && i + 1 < argc) {
      batches.clear();
      std::string s = argv[++i];
      for (size_t p = 0; p < s.size();) {
        size_t q = s.find(',', p);
        if (q == std::string::npos) q = s.size();
        batches.push_back(std::atoi(s.substr(p, q - p).c_str()));
        p = q + 1;
      }
    } else {
      std::fprintf(stderr, "usage: %s [--threads N] [--passes N] [--batches 1,4,...] "
                   "[--layout ggml|interleaved|both] [--type T]\n", argv[0]);
      return 2;
    }
  }
  if (layout != "ggml" && layout != "interleaved" && layout != "both") {
    std::fprintf(stderr, "--layout: expected ggml, interleaved or both, got '%s'\n", layout.c_str());
    return 2;
  }
  std::vector<bool> layouts;  // interleaved?
  if (layout != "interleaved") layouts.push_back(false);
  if (layout != "ggml") layouts.push_back(true);
  std::mt19937 rng(7);
  const int64_t d = 576, kv = 192, ffn = 1536, vocab = 49152, layers = 30;
  std::vector<Matrix> mats;
  size_t bytes = 0;
  for (int64_t l = 0; l < layers; ++l) {
    for (auto [r, c] : {std::pair{d, d}, {kv, d}, {kv, d}, {d, d}, {ffn, d}, {ffn, d}, {d, ffn}})
      mats.push_back(random_matrix(layer_type, r, c, layout != "ggml", rng));
  }
  mats.push_back(random_matrix(GgmlType::Q8_0, vocab, d, false, rng));
  for (const auto& m : mats) bytes += m.data.size();
  const int max_batch = *std::max_element(batches.begin(), batches.end());
  std::vector<float> xf(static_cast<size_t>(max_batch) * ffn);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  for (auto& v : xf) v = dist(rng);
  // Activations quantized once per type (the layer type's dot type and Q8_0, up to ffn columns).
  auto quantized = [&](GgmlType t, int64_t cols) {
    const size_t rb = tessera::ggml_row_size(t, cols);
    std::vector<uint8_t> q(rb * max_batch);
    for (int b = 0; b < max_batch; ++b)
      tessera::quantize_activation_row(t, xf.data() + b * cols, q.data() + b * rb, cols);
    return q;
  };
  const GgmlType layer_dot = tessera::vec_dot_type(layer_type);
  const auto xl_d = quantized(layer_dot, d), xl_f = quantized(layer_dot, ffn);
  const auto x80_d = quantized(GgmlType::Q8_0, d);
  std::vector<float> y(static_cast<size_t>(max_batch) * vocab);
  tessera::ThreadPool pool(threads);
  std::printf("weights %.1f MiB in %zu matrices (layers %s), %d threads, %d passes per batch\n",
              bytes / 1048576.0, mats.size(), tessera::ggml_type_name(layer_type), threads, passes);
  std::printf("layout        batch   ms/pass (median)   min     tokens/s   GB/s (weights)\n");
  for (int batch : batches) {
    std::vector<std::vector<double>> ms(layouts.size());
    for (int p = 0; p < passes + 2; ++p) {
      for (size_t li = 0; li < layouts.size(); ++li) {
        const auto t0 = std::chrono::steady_clock::now();
        for (const auto& m : mats) {
          const bool head = &m == &mats.back();
          const auto& x = head ? x80_d : (m.cols == d ? xl_d : xl_f);
          const size_t xs = tessera::ggml_row_size(head ? GgmlType::Q8_0 : layer_dot, m.cols);
          run_matmul(pool, Job{&m, x.data(), xs, batch, y.data(), layouts[li]});
        }
        const auto t1 = std::chrono::steady_clock::now();
        if (p >= 2) ms[li].push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
      }
    }
    for (size_t li = 0; li < layouts.size(); ++li) {
      std::sort(ms[li].begin(), ms[li].end());
      const double med = ms[li][ms[li].size() / 2];
      std::printf("%-12s %6d   %16.2f %8.2f %12.1f %10.1f\n", layouts[li] ? "interleaved" : "ggml",
                  batch, med, ms[li].front(), batch * 1000.0 / med, bytes / (med * 1e6));
    }
  }
  return 0;
}
