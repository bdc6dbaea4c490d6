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
// thread at a time (the runner's); the accumulation itself is single-threaded.
class ActivationRecorder final : public Quantizer {
 public:
  explicit ActivationRecorder(Quantizer& inner) : inner_(inner) {}

  bool supports(uint32_t ggml_type) const override { return inner_.supports(ggml_type); }
  Status prepare(const WeightView& weight, std::unique_ptr<PreparedWeight>* out) override;
  void matmul(const PreparedWeight& weight, const float* x, int64_t num_tokens, float* y,
              Executor& executor) override;
  void dequantize_row(const PreparedWeight& weight, int64_t row, float* out) override {
    inner_.dequantize_row(weight, row, out);
  }

  // The statistics gathered so far (entries of weights that saw no token are left out).
  quant::ImportanceMatrix importance() const;

 private:
  Quantizer& inner_;
  std::map<const PreparedWeight*, std::string> names_;
  std::map<std::string, quant::ImportanceMatrix::Entry> entries_;
};

}  // namespace tessera
