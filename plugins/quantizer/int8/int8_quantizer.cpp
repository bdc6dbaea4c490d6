// quantizer.int8: W8A8. At load every weight (any type the SDK can dequantize: F32, F16, BF16,
// the legacy and K block formats) is converted to int8 with one f32 scale per output row
// (max|row| / 127, round to nearest); at run time each token's activations are quantized to
// int8 with one scale of their own (max|x| / 127), and the matmul sums int8 x int8 products
// exactly in int32 (int8_kernels.h). No file format of its own: the layout lives in memory,
// like vLLM's load-time int8/fp8 quantization; from an F32 or F16 file it is 1 byte per
// weight plus a scale per row.
//
// Parameter `kernel`: auto (AVX-VNNI, else AVX2, else scalar), or one of them by name (the A/B
// and test knob; all three give the same bits).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "int8_kernels.h"
#include "tessera/sdk/kernels/ggml_types.h"
#include "tessera/sdk/kernels/huge_buffer.h"
#include "tessera/sdk.h"

namespace tessera {
namespace {

using int8_w8a8::Activations;
using int8_w8a8::PackedWeight;

class Int8Weight final : public PreparedWeight {
 public:
  Int8Weight(int64_t rows, int64_t cols, std::shared_ptr<const HugeBuffer> storage, size_t offset)
      : storage_(std::move(storage)) {
    const int64_t kp = int8_w8a8::padded_cols(cols);
    const int64_t padded_rows = int8_w8a8::num_groups(rows) * int8_w8a8::kGroupRows;
    uint8_t* base = const_cast<uint8_t*>(storage_->data()) + offset;
    packed_.groups = reinterpret_cast<const int8_t*>(base);
    packed_.scale = reinterpret_cast<const float*>(base + padded_rows * kp);
    packed_.row_sum = reinterpret_cast<const int32_t*>(base + padded_rows * kp + padded_rows * 4);
    packed_.rows = rows;
    packed_.cols = cols;
    packed_.padded_cols = kp;
  }
  // Bytes a weight of this shape takes: int8 groups, then the f32 scales and int32 row sums.
  static size_t bytes_for(int64_t rows, int64_t cols) {
    const int64_t padded_rows = int8_w8a8::num_groups(rows) * int8_w8a8::kGroupRows;
    return static_cast<size_t>(padded_rows * int8_w8a8::padded_cols(cols) + padded_rows * 8);
  }
  int64_t rows() const override { return packed_.rows; }
  int64_t cols() const override { return packed_.cols; }
  size_t num_bytes() const override { return bytes_for(packed_.rows, packed_.cols); }
  const char* format() const override { return "int8"; }
  const PackedWeight& packed() const { return packed_; }

 private:
  std::shared_ptr<const HugeBuffer> storage_;
  PackedWeight packed_;
};

enum class Kernel { kScalar, kAvx2, kAvxVnni };

const ParamSpec kParams[] = {
    {"kernel", ParamType::kEnum, "auto",
     "auto: AVX-VNNI where the CPU has it, else AVX2, else portable C++; or one of them by name "
     "(same results, for A/B runs and tests)",
     -INFINITY, INFINITY, "auto|scalar|avx2|avxvnni"},
};

// Output rows per task: a multiple of the 8-row group.
constexpr int64_t kRowsPerTask = 16;
// Below this many activation elements the input is quantized on the calling thread (a decode
// batch): a parallel pass and its barrier cost more.
constexpr int64_t kSerialQuantizeElements = 16 * 1536;

class Int8Quantizer final : public Quantizer, public GroupedMatmul {
 public:
  explicit Int8Quantizer(Kernel kernel)
      : kernel_(kernel),
        gemm_(kernel == Kernel::kAvxVnni ? &int8_w8a8::gemm_avxvnni
              : kernel == Kernel::kAvx2  ? &int8_w8a8::gemm_avx2
                                         : &int8_w8a8::gemm_scalar) {}

  bool supports(uint32_t ggml_type) const override {
    const auto t = static_cast<GgmlType>(ggml_type);
    return has_vec_dot(t) || t == GgmlType::BF16;  // every type dequantize_row reads
  }

  Status prepare(const WeightView& w, std::unique_ptr<PreparedWeight>* out) override {
    const auto type = static_cast<GgmlType>(w.ggml_type);
    if (!supports(w.ggml_type))
      return unimplemented(std::string("weight '") + w.name + "' has type " + ggml_type_name(type) +
                           ", which quantizer.int8 cannot read");
    if (w.rows <= 0 || w.cols <= 0)
      return invalid_argument(std::string("weight '") + w.name + "' has an empty shape");
    const size_t src_row = ggml_row_size(type, w.cols);
    if (src_row == 0 || src_row * static_cast<size_t>(w.rows) != w.num_bytes)
      return invalid_argument(std::string("weight '") + w.name + "' has " + std::to_string(w.num_bytes) +
                              " bytes, its shape and type need " +
                              std::to_string(src_row * static_cast<size_t>(w.rows)));
    // Dequantize in slabs of rows (bounded scratch for the 49k-row output projection).
    const size_t bytes = Int8Weight::bytes_for(w.rows, w.cols);
    size_t offset = 0;
    std::shared_ptr<const HugeBuffer> storage = arena_allocate(bytes, &offset);
    auto weight = std::make_unique<Int8Weight>(w.rows, w.cols, storage, offset);
    const PackedWeight& p = weight->packed();
    constexpr int64_t kSlab = 64;  // a multiple of the 8-row group
    std::vector<float> rows_f32(static_cast<size_t>(kSlab * w.cols));
    for (int64_t r0 = 0; r0 < w.rows; r0 += kSlab) {
      const int64_t n = std::min(kSlab, w.rows - r0);
      for (int64_t r = 0; r < n; ++r)
        if (!tessera::dequantize_row(type, static_cast<const uint8_t*>(w.data) + (r0 + r) * src_row,
                            rows_f32.data() + r * w.cols, w.cols))
          return unimplemented(std::string("weight '") + w.name + "': cannot dequantize type " +
                               ggml_type_name(type));
      int8_w8a8::pack_rows(rows_f32.data(), n, w.cols,
                           const_cast<int8_t*>(p.groups) + r0 * p.padded_cols,
                           const_cast<float*>(p.scale) + r0, const_cast<int32_t*>(p.row_sum) + r0);
    }
    *out = std::move(weight);
    return Status::ok();
  }

  void matmul(const PreparedWeight& pw, const float* x, int64_t num_tokens, float* y,
              Executor& executor) override {
    const MatmulTarget target{&pw, y};
    matmul_group(std::span<const MatmulTarget>(&target, 1), x, num_tokens, executor);
  }

  // The input is quantized once for all targets (they share it: q/k/v, gate/up), then all
  // targets' rows run in one parallel pass of kRowsPerTask-row tasks.
  void matmul_group(std::span<const MatmulTarget> targets, const float* x, int64_t num_tokens,
                    Executor& executor) override {
    if (targets.empty() || num_tokens <= 0) return;
    const int64_t cols = targets.front().weight->cols();
    const Activations xs = quantize_input(x, cols, num_tokens, executor);
    std::vector<int64_t>& first_task = first_task_;  // capacity kept between calls
    first_task.resize(targets.size() + 1);
    first_task[0] = 0;
    for (size_t i = 0; i < targets.size(); ++i)
      first_task[i + 1] = first_task[i] + (targets[i].weight->rows() + kRowsPerTask - 1) / kRowsPerTask;
    executor.run(first_task.back(), [&](int64_t begin, int64_t end, int) {
      for (size_t i = 0; i < targets.size() && begin < end; ++i) {
        if (begin >= first_task[i + 1]) continue;
        const auto& w = static_cast<const Int8Weight&>(*targets[i].weight).packed();
        const int64_t stop = std::min(end, first_task[i + 1]);
        const int64_t r0 = (begin - first_task[i]) * kRowsPerTask;
        const int64_t r1 = std::min(w.rows, (stop - first_task[i]) * kRowsPerTask);
        gemm_(w, r0, r1, xs, num_tokens, targets[i].y, w.rows);
        begin = stop;
      }
    });
  }

  void dequantize_row(const PreparedWeight& pw, int64_t row, float* out) override {
    int8_w8a8::unpack_row(static_cast<const Int8Weight&>(pw).packed(), row, out);
  }

  static Status create(const PluginConfig& config, const PluginContext&, std::unique_ptr<Quantizer>* out) {
    const std::string name = config.get_string("kernel", "auto");
    Kernel kernel = Kernel::kScalar;
    if (name == "auto") {
      kernel = cpu_has_avx_vnni() ? Kernel::kAvxVnni
               : cpu_has_avx2()   ? Kernel::kAvx2
                                             : Kernel::kScalar;
    } else if (name == "avx2" || name == "avxvnni") {
      const bool available = name == "avx2" ? cpu_has_avx2() : cpu_has_avx_vnni();
      if (!available)
        return invalid_argument(config.key_path() + ".kernel: '" + name + "' needs a CPU with " +
                                (name == "avx2" ? "AVX2 and FMA" : "AVX-VNNI") + ", which this one lacks");
      kernel = name == "avx2" ? Kernel::kAvx2 : Kernel::kAvxVnni;
    } else if (name != "scalar") {
      return invalid_argument(config.key_path() + ".kernel: expected auto, scalar, avx2 or avxvnni, got '" +
                              name + "'");
    }
    *out = std::make_unique<Int8Quantizer>(kernel);
    return Status::ok();
  }

 private:
  // The activations in the chosen kernel's form, in buffers kept between calls.
  Activations quantize_input(const float* x, int64_t cols, int64_t num_tokens, Executor& executor) {
    const int64_t kp = int8_w8a8::padded_cols(cols);
    const bool offset = kernel_ == Kernel::kAvxVnni;
    const size_t needed = static_cast<size_t>(kp * num_tokens);
    if (activations_.size() < needed) activations_.resize(needed);
    if (token_scales_.size() < static_cast<size_t>(num_tokens)) token_scales_.resize(num_tokens);
    uint8_t* q = activations_.data();
    float* scales = token_scales_.data();
    const bool simd = kernel_ != Kernel::kScalar;
    const auto quantize = [&](int64_t begin, int64_t end, int) {
      for (int64_t t = begin; t < end; ++t)
        scales[t] = simd ? int8_w8a8::quantize_token_avx2(x + t * cols, cols, kp, offset, q + t * kp)
                         : int8_w8a8::quantize_token_scalar(x + t * cols, cols, kp, offset, q + t * kp);
    };
    if (num_tokens * cols <= kSerialQuantizeElements) {
      quantize(0, num_tokens, 0);
    } else {
      executor.run(num_tokens, quantize);
    }
    return Activations{q, static_cast<size_t>(kp), scales, offset};
  }

  // Converted weights are carved out of 16 MiB huge-page chunks (see quantizer.gguf: decode
  // streams every weight each step, and 4 KiB pages would cost a TLB miss each).
  std::shared_ptr<const HugeBuffer> arena_allocate(size_t bytes, size_t* offset) {
    constexpr size_t kChunkBytes = size_t{16} << 20;
    const size_t rounded = (bytes + 63) / 64 * 64;
    if (!arena_ || arena_used_ + rounded > arena_->size()) {
      arena_ = std::make_shared<HugeBuffer>(std::max(kChunkBytes, rounded));
      arena_used_ = 0;
    }
    *offset = arena_used_;
    arena_used_ += rounded;
    return arena_;
  }

  using Gemm = void (*)(const PackedWeight&, int64_t, int64_t, const Activations&, int64_t, float*, int64_t);
  Kernel kernel_;  // also decides the activations' form (signed, or offset for AVX-VNNI)
  Gemm gemm_;      // the kernel's matmul
  std::vector<uint8_t> activations_;  // quantized inputs, grown on demand
  std::vector<float> token_scales_;
  std::vector<int64_t> first_task_;   // per-call scratch, capacity kept
  std::shared_ptr<HugeBuffer> arena_;
  size_t arena_used_ = 0;
};

}  // namespace
}  // namespace tessera

TESSERA_REGISTER_PLUGIN_WITH(tessera::Int8Quantizer, tessera::Quantizer, "int8", "0.1.0",
                             "W8A8: int8 weights with a scale per output row (converted at load "
                             "from any readable type), int8 activations with a scale per token, "
                             "exact int32 dot products",
                             tessera::kParams, "grouped_matmul", "")
