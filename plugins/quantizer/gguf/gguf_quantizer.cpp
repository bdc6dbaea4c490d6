// quantizer.gguf: uses GGUF weights in place (Q4_0, Q4_1, Q8_0, F16, F32, BF16 via F32
// conversion at load) with the GGML block dot products. Activations are quantized once per
// row to the weight type's dot type (Q8_1 for Q4_1, ...), as llama.cpp does, so logits match.
#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "tessera/ggml_types.h"
#include "tessera/sdk.h"

namespace tessera {
namespace {

class GgufWeight final : public PreparedWeight {
 public:
  GgufWeight(GgmlType type, int64_t rows, int64_t cols, const uint8_t* data,
             std::vector<uint8_t> owned)
      : type_(type), rows_(rows), cols_(cols), row_bytes_(ggml_row_size(type, cols)),
        data_(owned.empty() ? data : owned.data()), owned_(std::move(owned)) {}
  int64_t rows() const override { return rows_; }
  int64_t cols() const override { return cols_; }
  size_t num_bytes() const override { return row_bytes_ * static_cast<size_t>(rows_); }
  const char* format() const override { return ggml_type_name(type_); }

  GgmlType type() const { return type_; }
  size_t row_bytes() const { return row_bytes_; }
  const uint8_t* row(int64_t r) const { return data_ + static_cast<size_t>(r) * row_bytes_; }

 private:
  GgmlType type_;
  int64_t rows_, cols_;
  size_t row_bytes_;
  const uint8_t* data_;         // the mapped file bytes, or owned_ after a conversion
  std::vector<uint8_t> owned_;
};

// Output rows per task: enough work per task to amortize scheduling, small enough to balance.
constexpr int64_t kRowsPerTask = 16;

class GgufQuantizer final : public Quantizer {
 public:
  bool supports(uint32_t ggml_type) const override {
    const auto t = static_cast<GgmlType>(ggml_type);
    return has_vec_dot(t) || t == GgmlType::BF16;
  }

  Status prepare(const WeightView& w, std::unique_ptr<PreparedWeight>* out) override {
    const auto type = static_cast<GgmlType>(w.ggml_type);
    if (!supports(w.ggml_type))
      return unimplemented(std::string("weight '") + w.name + "' has type " +
                           ggml_type_name(type) + ", not supported by quantizer.gguf");
    if (ggml_row_size(type, w.cols) * static_cast<size_t>(w.rows) != w.num_bytes)
      return invalid_argument(std::string("weight '") + w.name + "' has " +
                              std::to_string(w.num_bytes) + " bytes, its shape needs " +
                              std::to_string(ggml_row_size(type, w.cols) * w.rows));
    if (type == GgmlType::BF16) {
      // No BF16 dot kernel: widen to F32 once at load.
      std::vector<uint8_t> f32(static_cast<size_t>(w.rows * w.cols) * sizeof(float));
      const size_t src_row = ggml_row_size(type, w.cols);
      for (int64_t r = 0; r < w.rows; ++r)
        tessera::dequantize_row(type, static_cast<const uint8_t*>(w.data) + r * src_row,
                       reinterpret_cast<float*>(f32.data()) + r * w.cols, w.cols);
      *out = std::make_unique<GgufWeight>(GgmlType::F32, w.rows, w.cols, nullptr, std::move(f32));
      return Status::ok();
    }
    *out = std::make_unique<GgufWeight>(type, w.rows, w.cols,
                                        static_cast<const uint8_t*>(w.data), std::vector<uint8_t>{});
    return Status::ok();
  }

  void matmul(const PreparedWeight& pw, const float* x, int64_t num_tokens, float* y,
              Executor& executor) override {
    const auto& w = static_cast<const GgufWeight&>(pw);
    const GgmlType dot_type = vec_dot_type(w.type());
    const int64_t cols = w.cols();
    const int64_t rows = w.rows();
    const size_t x_row_bytes = ggml_row_size(dot_type, cols);

    // Quantize each activation row once; every output row reuses it.
    const void* xq = x;
    if (dot_type != GgmlType::F32) {
      const size_t needed = x_row_bytes * static_cast<size_t>(num_tokens);
      if (activations_.size() < needed) activations_.resize(needed);
      executor.run(num_tokens, [&](int64_t begin, int64_t end, int) {
        for (int64_t t = begin; t < end; ++t)
          quantize_activation_row(dot_type, x + t * cols, activations_.data() + t * x_row_bytes, cols);
      });
      xq = activations_.data();
    }
    const auto* xb = static_cast<const uint8_t*>(xq);
    const int64_t num_tasks = (rows + kRowsPerTask - 1) / kRowsPerTask;
    executor.run(num_tasks, [&](int64_t begin, int64_t end, int) {
      const int64_t r0 = begin * kRowsPerTask;
      const int64_t r1 = std::min(rows, end * kRowsPerTask);
      // A tile of weight rows x activation rows per pass: each weight block is unpacked once
      // for several tokens, each activation block loaded once for several rows. Every output
      // element equals vec_dot of its pair bit for bit, whatever the tiling.
      vec_dot_tile(w.type(), cols, w.row(r0), w.row_bytes(), r1 - r0, xb, x_row_bytes,
                   num_tokens, y + r0, rows);
    });
  }

  void dequantize_row(const PreparedWeight& pw, int64_t row, float* out) override {
    const auto& w = static_cast<const GgufWeight&>(pw);
    tessera::dequantize_row(w.type(), w.row(row), out, w.cols());
  }

  static Status create(const PluginConfig&, const PluginContext&, std::unique_ptr<Quantizer>* out) {
    *out = std::make_unique<GgufQuantizer>();
    return Status::ok();
  }

 private:
  std::vector<uint8_t> activations_;  // quantized activations, grown on demand
};

}  // namespace
}  // namespace tessera

TESSERA_REGISTER_PLUGIN(tessera::GgufQuantizer, tessera::Quantizer, "gguf", "0.1.0",
                        "GGUF block formats in place (Q4_0, Q4_1, Q8_0, F16, F32, BF16)",
                        TESSERA_NO_PARAMS)
