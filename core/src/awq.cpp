#include "tessera/awq.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>

#include "tessera/thread_pool.h"

namespace tessera::quant {

namespace {

constexpr int64_t kClipBlock = 32;
constexpr float kClipRatios[] = {1.0f, 0.95f, 0.9f, 0.85f, 0.8f, 0.75f};

float dot_lanes(const float* a, const float* b, int64_t n) {
  float lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t k = 0;
  for (; k + 8 <= n; k += 8)
    for (int l = 0; l < 8; ++l) lane[l] += a[k + l] * b[k + l];
  float s = 0;
  for (int l = 0; l < 8; ++l) s += lane[l];
  for (; k < n; ++k) s += a[k] * b[k];
  return s;
}

// e^T H e for a symmetric n x n H (row-major floats).
double quadratic(const float* h, const float* e, int64_t n) {
  double s = 0;
  for (int64_t i = 0; i < n; ++i)
    if (e[i] != 0) s += static_cast<double>(e[i]) * dot_lanes(h + i * n, e, n);
  return s;
}

std::vector<float> read_rows(const gguf::TensorInfo& t, int64_t first, int64_t count) {
  const int64_t cols = t.dims[0];
  std::vector<float> out(static_cast<size_t>(count * cols));
  const size_t row_bytes = ggml_row_size(t.type, cols);
  for (int64_t r = 0; r < count; ++r)
    if (!dequantize_row(t.type, t.data + (first + r) * row_bytes, out.data() + r * cols, cols))
      throw std::runtime_error("awq: tensor '" + t.name + "' is of type " + ggml_type_name(t.type) +
                               ", which cannot be read");
  return out;
}

std::string blk(int64_t layer, const char* name) { return "blk." + std::to_string(layer) + "." + name; }

struct GroupSpec {
  std::string key;                   // blk.L.attn_qkv, blk.L.attn_output, blk.L.ffn_gate_up, blk.L.ffn_down
  std::vector<std::string> weights;  // the consumers whose columns are scaled
  int64_t kv_heads_shared = 1;       // attn_output: query heads per V row (GQA)
  int64_t head_dim = 0;
};

struct Shape {
  int64_t num_layers = 0, num_heads = 0, num_kv_heads = 0;
};

Shape shape_of(const gguf::GgufFile& file) {
  const std::string arch = file.opt_string("general.architecture").value_or("");
  Shape s;
  s.num_layers = static_cast<int64_t>(file.opt_uint(arch + ".block_count").value_or(0));
  s.num_heads = static_cast<int64_t>(file.opt_uint(arch + ".attention.head_count").value_or(0));
  s.num_kv_heads = static_cast<int64_t>(file.opt_uint(arch + ".attention.head_count_kv").value_or(s.num_heads));
  return s;
}

std::vector<GroupSpec> groups_of(const gguf::GgufFile& file) {
  const Shape sh = shape_of(file);
  std::vector<GroupSpec> out;
  for (int64_t l = 0; l < sh.num_layers; ++l) {
    out.push_back({blk(l, "attn_qkv"), {blk(l, "attn_q.weight"), blk(l, "attn_k.weight"), blk(l, "attn_v.weight")}});
    GroupSpec o{blk(l, "attn_output"), {blk(l, "attn_output.weight")}};
    if (const auto* q = file.find_tensor(blk(l, "attn_q.weight")); q != nullptr && sh.num_heads > 0 &&
                                                                    sh.num_kv_heads > 0) {
      o.head_dim = q->num_rows() / sh.num_heads;
      o.kv_heads_shared = sh.num_heads / sh.num_kv_heads;
    }
    out.push_back(o);
    out.push_back({blk(l, "ffn_gate_up"), {blk(l, "ffn_gate.weight"), blk(l, "ffn_up.weight")}});
    out.push_back({blk(l, "ffn_down"), {blk(l, "ffn_down.weight")}});
  }
  return out;
}

// attn_output's scale is one value per V row (kv_dim); its columns (num_heads * head_dim) take
// the value of the V row their head reads.
std::vector<float> expand_kv(const std::vector<float>& s_kv, const GroupSpec& g, int64_t cols) {
  std::vector<float> s(static_cast<size_t>(cols));
  for (int64_t c = 0; c < cols; ++c) {
    const int64_t head = c / g.head_dim;
    s[c] = s_kv[(head / g.kv_heads_shared) * g.head_dim + c % g.head_dim];
  }
  return s;
}

}  // namespace

AwqFold awq_fold(const gguf::GgufFile& file, const std::map<std::string, std::vector<float>>& scales) {
  AwqFold fold;
  auto data = [&](const std::string& name) -> std::vector<float>& {
    auto it = fold.tensors.find(name);
    if (it != fold.tensors.end()) return it->second;
    const gguf::TensorInfo* t = file.find_tensor(name);
    if (t == nullptr) throw std::invalid_argument("awq: no tensor '" + name + "'");
    return fold.tensors[name] = read_rows(*t, 0, t->num_rows());
  };
  auto cols_of = [&](const std::string& name) { return file.find_tensor(name)->dims[0]; };
  auto scale_columns = [&](const std::string& name, const std::vector<float>& s) {
    std::vector<float>& w = data(name);
    const int64_t cols = cols_of(name);
    if (static_cast<int64_t>(s.size()) != cols)
      throw std::invalid_argument("awq: " + std::to_string(s.size()) + " scales for '" + name + "' of " +
                                  std::to_string(cols) + " columns");
    for (size_t i = 0; i < w.size(); ++i) w[i] *= s[i % cols];
    auto& acc = fold.input_scale[name];
    if (acc.empty()) acc.assign(s.size(), 1.0f);
    for (size_t c = 0; c < s.size(); ++c) acc[c] *= s[c];
  };
  // Row i of a matrix, or element i of a vector (a norm weight or a bias), divided by s[i].
  auto divide_rows = [&](const std::string& name, const std::vector<float>& s) {
    std::vector<float>& w = data(name);
    const int64_t cols = file.find_tensor(name)->dims.size() == 1 ? 1 : cols_of(name);
    if (static_cast<int64_t>(s.size() * cols) != static_cast<int64_t>(w.size()))
      throw std::invalid_argument("awq: " + std::to_string(s.size()) + " scales for the rows of '" + name + "'");
    for (size_t i = 0; i < w.size(); ++i) w[i] /= s[i / cols];
  };
  for (const GroupSpec& g : groups_of(file)) {
    auto it = scales.find(g.key);
    if (it == scales.end()) continue;
    const std::vector<float>& s = it->second;
    const std::string layer = g.key.substr(0, g.key.find('.', 4) + 1);  // "blk.L."
    if (g.key.ends_with("attn_qkv") || g.key.ends_with("ffn_gate_up")) {
      // The RMSNorm's weight multiplies its output elementwise: dividing it by s divides the
      // input of every consumer by s.
      divide_rows(layer + (g.key.ends_with("attn_qkv") ? "attn_norm.weight" : "ffn_norm.weight"), s);
      for (const std::string& w : g.weights) scale_columns(w, s);
    } else if (g.key.ends_with("attn_output")) {
      divide_rows(layer + "attn_v.weight", s);
      if (file.find_tensor(layer + "attn_v.bias") != nullptr) divide_rows(layer + "attn_v.bias", s);
      scale_columns(g.weights[0], expand_kv(s, g, cols_of(g.weights[0])));
    } else {  // ffn_down: its input is act(gate) * up, linear in up's rows
      divide_rows(layer + "ffn_up.weight", s);
      scale_columns(g.weights[0], s);
    }
  }
  return fold;
}

AwqFold awq_search(const gguf::GgufFile& file, const std::vector<TensorPlan>& plan,
                   const CalibrationStats& stats, const AwqOptions& options, int threads) {
  std::map<std::string, GgmlType> type_of;
  for (const TensorPlan& p : plan) type_of[p.name] = p.to;
  const std::vector<GroupSpec> groups = groups_of(file);
  std::vector<std::vector<float>> chosen(groups.size());
  std::vector<float> chosen_alpha(groups.size(), -1.0f);
  const int grid = std::max(1, options.alpha_grid);

  ThreadPool pool(std::max(1, std::min<int>(threads, static_cast<int>(groups.size()))));
  pool.run(static_cast<int64_t>(groups.size()), [&](int64_t begin, int64_t end, int) {
    for (int64_t gi = begin; gi < end; ++gi) {
      const GroupSpec& g = groups[gi];
      bool complete = !g.weights.empty();
      for (const std::string& w : g.weights)
        complete = complete && file.find_tensor(w) != nullptr && stats.find(w) != nullptr;
      if (g.key.ends_with("attn_output"))
        complete = complete && g.head_dim > 0 && file.find_tensor(g.key.substr(0, g.key.find('.', 4) + 1) + "attn_v.weight");
      if (!complete) continue;
      const InputStats& in = *stats.find(g.weights[0]);
      if (in.xtx.empty() || in.count == 0) continue;
      const int64_t cols = in.cols;
      // Mean |x| per channel; for attn_output averaged over the query heads sharing a V row.
      std::vector<float> mag(static_cast<size_t>(cols));
      for (int64_t c = 0; c < cols; ++c)
        mag[c] = std::max(1e-4f, static_cast<float>(in.sum_abs[c] / static_cast<double>(in.count)));
      const bool is_o = g.key.ends_with("attn_output");
      if (is_o) {
        std::vector<float> kv(static_cast<size_t>(cols / g.kv_heads_shared), 0.0f);
        for (int64_t c = 0; c < cols; ++c)
          kv[(c / g.head_dim / g.kv_heads_shared) * g.head_dim + c % g.head_dim] += mag[c] / g.kv_heads_shared;
        mag = kv;
      }
      std::vector<float> h(in.xtx.begin(), in.xtx.end());
      std::vector<float> diag(static_cast<size_t>(cols));
      for (int64_t c = 0; c < cols; ++c) diag[c] = h[c * cols + c];
      struct Sample {
        GgmlType type;
        std::vector<float> rows;
        int64_t n;
      };
      std::vector<Sample> samples;
      for (const std::string& w : g.weights) {
        const gguf::TensorInfo& t = *file.find_tensor(w);
        const int64_t rows = t.num_rows();
        const int64_t n = std::min<int64_t>(rows, std::max(1, options.search_rows));
        Sample s{type_of.count(w) ? type_of[w] : t.type, {}, n};
        s.rows.resize(static_cast<size_t>(n * cols));
        for (int64_t i = 0; i < n; ++i) {
          std::vector<float> r = read_rows(t, i * rows / n, 1);
          std::copy(r.begin(), r.end(), s.rows.begin() + i * cols);
        }
        samples.push_back(std::move(s));
      }
      auto scales_for = [&](float alpha) {
        std::vector<float> s(mag.size());
        float lo = std::numeric_limits<float>::max(), hi = 0;
        for (size_t c = 0; c < s.size(); ++c) {
          s[c] = std::pow(mag[c], alpha);
          lo = std::min(lo, s[c]);
          hi = std::max(hi, s[c]);
        }
        const float norm = std::sqrt(lo * hi);  // AWQ's normalization: geometric middle at 1
        for (float& v : s) v /= norm;
        return s;
      };
      double best = std::numeric_limits<double>::infinity();
      std::vector<float> ws(static_cast<size_t>(cols)), deq(static_cast<size_t>(cols)), e(static_cast<size_t>(cols)),
          imp(static_cast<size_t>(cols));
      std::vector<uint8_t> buf;
      for (int k = 0; k <= grid; ++k) {
        const float alpha = options.fixed_alpha >= 0 ? options.fixed_alpha : static_cast<float>(k) / grid;
        const std::vector<float> s_group = scales_for(alpha);
        const std::vector<float> s = is_o ? expand_kv(s_group, g, cols) : s_group;
        for (int64_t c = 0; c < cols; ++c) imp[c] = diag[c] / (s[c] * s[c]);
        double loss = 0;
        for (const Sample& smp : samples) {
          buf.resize(ggml_row_size(smp.type, cols));
          for (int64_t i = 0; i < smp.n; ++i) {
            const float* w = smp.rows.data() + i * cols;
            for (int64_t c = 0; c < cols; ++c) ws[c] = w[c] * s[c];
            quantize_weight_row(smp.type, ws.data(), buf.data(), cols, imp.data());
            dequantize_row(smp.type, buf.data(), deq.data(), cols);
            for (int64_t c = 0; c < cols; ++c) e[c] = deq[c] / s[c] - w[c];
            loss += quadratic(h.data(), e.data(), cols);
          }
        }
        if (loss < best) {
          best = loss;
          chosen[gi] = s_group;
          chosen_alpha[gi] = alpha;
        }
        if (options.fixed_alpha >= 0) break;
      }
    }
  });
  std::map<std::string, std::vector<float>> scales;
  for (size_t gi = 0; gi < groups.size(); ++gi)
    if (!chosen[gi].empty()) scales[groups[gi].key] = chosen[gi];
  AwqFold fold = awq_fold(file, scales);
  for (size_t gi = 0; gi < groups.size(); ++gi)
    if (chosen_alpha[gi] >= 0) fold.alpha[groups[gi].key] = chosen_alpha[gi];
  return fold;
}

std::vector<uint8_t> awq_quantize_tensor(GgmlType type, const float* w, int64_t rows, int64_t cols,
                                         const InputStats& input, const std::vector<float>& scale,
                                         const AwqOptions& options, int threads) {
  if (input.cols != cols || static_cast<int64_t>(input.xtx.size()) != cols * cols)
    throw std::invalid_argument("awq: input statistics of " + std::to_string(input.cols) + " columns for a weight of " +
                                std::to_string(cols));
  auto s = [&](int64_t c) { return scale.empty() ? 1.0f : scale[c]; };
  // H in the scaled basis (the weight's columns were multiplied by s, its input divided by it):
  // its diagonal, and the 32 x 32 diagonal blocks the clipping search measures with.
  std::vector<float> imp(static_cast<size_t>(cols));
  for (int64_t c = 0; c < cols; ++c) imp[c] = static_cast<float>(input.xtx[c * cols + c]) / (s(c) * s(c));
  const int64_t blocks = cols / kClipBlock;
  std::vector<float> hb(static_cast<size_t>(blocks * kClipBlock * kClipBlock));
  for (int64_t b = 0; b < blocks; ++b)
    for (int64_t i = 0; i < kClipBlock; ++i)
      for (int64_t j = 0; j < kClipBlock; ++j) {
        const int64_t ci = b * kClipBlock + i, cj = b * kClipBlock + j;
        hb[(b * kClipBlock + i) * kClipBlock + j] = static_cast<float>(input.xtx[ci * cols + cj]) / (s(ci) * s(cj));
      }
  const size_t row_bytes = ggml_row_size(type, cols);
  std::vector<uint8_t> out(row_bytes * static_cast<size_t>(rows));
  const bool clip = options.clip && cols % kClipBlock == 0;
  ThreadPool pool(std::max(1, std::min<int>(threads, static_cast<int>(rows))));
  pool.run(rows, [&](int64_t begin, int64_t end, int) {
    std::vector<float> clipped(static_cast<size_t>(cols)), deq(static_cast<size_t>(cols)), e(kClipBlock);
    std::vector<float> best_loss(static_cast<size_t>(blocks)), ratio(static_cast<size_t>(blocks));
    std::vector<uint8_t> buf(row_bytes);
    for (int64_t r = begin; r < end; ++r) {
      const float* wr = w + r * cols;
      uint8_t* dst = out.data() + r * row_bytes;
      if (!clip) {
        quantize_weight_row(type, wr, dst, cols, imp.data());
        continue;
      }
      std::fill(best_loss.begin(), best_loss.end(), std::numeric_limits<float>::infinity());
      for (float candidate : kClipRatios) {
        for (int64_t b = 0; b < blocks; ++b) {
          const float* x = wr + b * kClipBlock;
          float lo = 0, hi = 0;
          for (int64_t i = 0; i < kClipBlock; ++i) lo = std::min(lo, x[i]), hi = std::max(hi, x[i]);
          for (int64_t i = 0; i < kClipBlock; ++i)
            clipped[b * kClipBlock + i] = std::clamp(x[i], candidate * lo, candidate * hi);
        }
        quantize_weight_row(type, clipped.data(), buf.data(), cols, imp.data());
        dequantize_row(type, buf.data(), deq.data(), cols);
        for (int64_t b = 0; b < blocks; ++b) {
          for (int64_t i = 0; i < kClipBlock; ++i) e[i] = deq[b * kClipBlock + i] - wr[b * kClipBlock + i];
          const float loss = static_cast<float>(quadratic(hb.data() + b * kClipBlock * kClipBlock, e.data(), kClipBlock));
          if (loss < best_loss[b]) best_loss[b] = loss, ratio[b] = candidate;
        }
      }
      for (int64_t b = 0; b < blocks; ++b) {
        const float* x = wr + b * kClipBlock;
        float lo = 0, hi = 0;
        for (int64_t i = 0; i < kClipBlock; ++i) lo = std::min(lo, x[i]), hi = std::max(hi, x[i]);
        for (int64_t i = 0; i < kClipBlock; ++i) clipped[b * kClipBlock + i] = std::clamp(x[i], ratio[b] * lo, ratio[b] * hi);
      }
      quantize_weight_row(type, clipped.data(), dst, cols, imp.data());
    }
  });
  return out;
}

}  // namespace tessera::quant
