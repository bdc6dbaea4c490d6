#include "tessera/calibration.h"

namespace tessera {

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
  }
  inner_.matmul(weight, x, num_tokens, y, executor);
}

quant::ImportanceMatrix ActivationRecorder::importance() const {
  quant::ImportanceMatrix m;
  for (const auto& [name, e] : entries_)
    if (e.count > 0) m.entries[name] = e;
  return m;
}

}  // namespace tessera
