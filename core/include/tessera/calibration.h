// Calibration: observes the activations that enter each weight matmul during forward passes,
// for quantizers that weight their error by them (llama.cpp's imatrix).
#pragma once

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "tessera/quantize.h"
#include "tessera/sdk/quantizer.h"

namespace tessera {

// A Quantizer that forwards everything to `inner` and, on each matmul, adds the squares of
// the input activations per column to the weight's entry (by GGUF tensor name). A model loaded
// through it and run by a ModelRunner yields llama-imatrix's statistics: per weight and column,
// the mean of x^2 over every token evaluated. It has no GroupedMatmul capability, so the runner
// calls matmul() once per weight. `inner` must outlive it. matmul() may be called from one
// thread at a time (the runner's).
//
// With `covariance`, it also gathers per distinct input (quant::InputStats) the sum of |x| and
// the full x x^T that GPTQ's Hessian and AWQ's output error need. Consecutive matmuls on the
// same activation buffer with the same shape (q/k/v, gate/up) are one input, recorded once;
// the x x^T update is spread over the executor the runner passes.
class ActivationRecorder final : public Quantizer {
 public:
  explicit ActivationRecorder(Quantizer& inner, bool covariance = false)
      : inner_(inner), covariance_(covariance) {}

  bool supports(uint32_t ggml_type) const override { return inner_.supports(ggml_type); }
  Status prepare(const WeightView& weight, std::unique_ptr<PreparedWeight>* out) override;
  void matmul(const PreparedWeight& weight, const float* x, int64_t num_tokens, float* y,
              Executor& executor) override;
  void dequantize_row(const PreparedWeight& weight, int64_t row, float* out) override {
    inner_.dequantize_row(weight, row, out);
  }

  // The statistics gathered so far (entries of weights that saw no token are left out).
  quant::ImportanceMatrix importance() const;
  // Per-input statistics (empty unless constructed with `covariance`), x x^T made symmetric.
  // Call once, after the last forward pass.
  const quant::CalibrationStats& finish_stats();

 private:
  void record_input(const std::string& name, const float* x, int64_t num_tokens, int64_t cols,
                    Executor& executor);

  Quantizer& inner_;
  bool covariance_ = false;
  std::map<const PreparedWeight*, std::string> names_;
  std::map<std::string, quant::ImportanceMatrix::Entry> entries_;
  quant::CalibrationStats stats_;
  // The previous matmul's input, to group the weights that share it.
  const float* last_x_ = nullptr;
  int64_t last_tokens_ = 0;
  int64_t last_cols_ = 0;
  size_t last_input_ = 0;
  std::vector<float> transposed_;  // cols x num_tokens scratch for x^T x
};

}  // namespace tessera
