#include "tessera/calibration.h"

#include <cmath>

namespace tessera {

namespace {

// sum_t a[t] * b[t] with 8 independent float lanes (so the compiler vectorizes it without
// reassociation flags); a chunk is at most a few thousand tokens, well within float's range
// for activations, and the result is added to a double accumulator.
float dot_lanes(const float* a, const float* b, int64_t n) {
  float lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t t = 0;
  for (; t + 8 <= n; t += 8)
    for (int k = 0; k < 8; ++k) lane[k] += a[t + k] * b[t + k];
  float s = 0;
  for (int k = 0; k < 8; ++k) s += lane[k];
  for (; t < n; ++t) s += a[t] * b[t];
  return s;
}

}  // namespace

Status ActivationRecorder::prepare(const WeightView& weight, std::unique_ptr<PreparedWeight>* out) {
  Status st = inner_.prepare(weight, out);
  if (st.is_ok() && *out) {
    names_[out->get()] = weight.name;
    auto& e = entries_[weight.name];
    e.sum_sq.assign(static_cast<size_t>(weight.cols), 0.0);
    e.count = 0;
  }
  return st;
}

void ActivationRecorder::record_input(const std::string& name, const float* x, int64_t num_tokens,
                                      int64_t cols, Executor& executor) {
  auto known = stats_.input_of.find(name);
  const bool same_as_last = x == last_x_ && num_tokens == last_tokens_ && cols == last_cols_;
  size_t index;
  if (known != stats_.input_of.end()) {
    index = known->second;
  } else if (same_as_last && !stats_.inputs.empty()) {
    index = last_input_;
    stats_.inputs[index].weights.push_back(name);
    stats_.input_of[name] = index;
  } else {
    index = stats_.inputs.size();
    quant::InputStats s;
    s.weights = {name};
    s.cols = cols;
    s.sum_abs.assign(static_cast<size_t>(cols), 0.0);
    s.sum_sq.assign(static_cast<size_t>(cols), 0.0);
    s.xtx.assign(static_cast<size_t>(cols * cols), 0.0);
    stats_.inputs.push_back(std::move(s));
    stats_.input_of[name] = index;
  }
  last_x_ = x;
  last_tokens_ = num_tokens;
  last_cols_ = cols;
  last_input_ = index;
  quant::InputStats& s = stats_.inputs[index];
  // The input is recorded once per call group: by the first weight that reads it.
  if (s.weights.front() != name) return;
  s.count += num_tokens;
  transposed_.resize(static_cast<size_t>(cols * num_tokens));
  for (int64_t t = 0; t < num_tokens; ++t)
    for (int64_t c = 0; c < cols; ++c) {
      const float v = x[t * cols + c];
      transposed_[c * num_tokens + t] = v;
      s.sum_abs[c] += std::fabs(v);
      s.sum_sq[c] += static_cast<double>(v) * v;
    }
  // Upper triangle, rows paired (i, cols-1-i) so every range holds the same work.
  const float* xt = transposed_.data();
  double* h = s.xtx.data();
  auto row = [&](int64_t i) {
    for (int64_t j = i; j < cols; ++j)
      h[i * cols + j] += dot_lanes(xt + i * num_tokens, xt + j * num_tokens, num_tokens);
  };
  executor.run((cols + 1) / 2, [&](int64_t begin, int64_t end, int) {
    for (int64_t p = begin; p < end; ++p) {
      row(p);
      if (cols - 1 - p != p) row(cols - 1 - p);
    }
  });
}

void ActivationRecorder::matmul(const PreparedWeight& weight, const float* x, int64_t num_tokens,
                                float* y, Executor& executor) {
  auto it = names_.find(&weight);
  if (it != names_.end()) {
    auto& e = entries_[it->second];
    const int64_t cols = weight.cols();
    for (int64_t t = 0; t < num_tokens; ++t) {
      const float* row = x + t * cols;
      for (int64_t c = 0; c < cols; ++c) e.sum_sq[c] += static_cast<double>(row[c]) * row[c];
    }
    e.count += num_tokens;
    if (covariance_) record_input(it->second, x, num_tokens, cols, executor);
  }
  inner_.matmul(weight, x, num_tokens, y, executor);
}

quant::ImportanceMatrix ActivationRecorder::importance() const {
  quant::ImportanceMatrix m;
  for (const auto& [name, e] : entries_)
    if (e.count > 0) m.entries[name] = e;
  return m;
}

const quant::CalibrationStats& ActivationRecorder::finish_stats() {
  // Mirror the upper triangle so consumers read a full symmetric matrix.
  for (quant::InputStats& s : stats_.inputs)
    for (int64_t i = 0; i < s.cols; ++i)
      for (int64_t j = 0; j < i; ++j) s.xtx[i * s.cols + j] = s.xtx[j * s.cols + i];
  return stats_;
}

}  // namespace tessera
