// quantizer.gguf: uses GGUF weights in place (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, F16,
// F32, BF16 via F32 conversion at load) with the GGML block dot products. Activations are
// quantized once per row to the weight type's dot type (Q8_1 for Q4_1/Q5_1, Q8_K for the
// K-quants, ...), as llama.cpp does, so logits match.
//
// Parameter `layout`: `ggml` (default) keeps every dot in ggml's order, so logits equal
// llama.cpp's bit for bit; `interleaved` repacks Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K
// weights 8 rows at a time at load (tessera/interleaved.h) for kernels with about half the
// instructions per block, whose logits differ from llama.cpp's only by float rounding (the
// block sums stay exact). Other types (F16, F32) are unaffected.
#include <algorithm>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "tessera/sdk/kernels/ggml_types.h"
#include "tessera/sdk/kernels/huge_buffer.h"
#include "tessera/sdk/kernels/interleaved.h"
#include "tessera/sdk.h"

namespace tessera {
namespace {

class GgufWeight final : public PreparedWeight {
 public:
  // data: the mapped file bytes, or bytes of `storage` this weight owns (owned_bytes of them).
  GgufWeight(GgmlType type, int64_t rows, int64_t cols, const uint8_t* data,
             std::shared_ptr<const HugeBuffer> storage = nullptr, size_t owned_bytes = 0,
             bool interleaved = false)
      : type_(type), rows_(rows), cols_(cols), row_bytes_(ggml_row_size(type, cols)),
        data_(data), storage_(std::move(storage)), owned_bytes_(owned_bytes),
        interleaved_(interleaved) {}
  int64_t rows() const override { return rows_; }
  int64_t cols() const override { return cols_; }
  size_t num_bytes() const override {
    return interleaved_ ? owned_bytes_ : row_bytes_ * static_cast<size_t>(rows_);
  }
  const char* format() const override { return interleaved_ ? interleaved_name(type_) : ggml_type_name(type_); }

  GgmlType type() const { return type_; }
  bool interleaved() const { return interleaved_; }
  size_t row_bytes() const { return row_bytes_; }
  // Row r's bytes (GGML layout only).
  const uint8_t* row(int64_t r) const { return data_ + static_cast<size_t>(r) * row_bytes_; }
  // The interleaved group holding row r, a multiple of kInterleaveRows (interleaved only).
  const uint8_t* group(int64_t r) const {
    return data_ + static_cast<size_t>(r / kInterleaveRows) * interleaved_group_size(type_, cols_);
  }

 private:
  GgmlType type_;
  int64_t rows_, cols_;
  size_t row_bytes_;
  const uint8_t* data_;         // the mapped file bytes, or a converted copy in storage_
  std::shared_ptr<const HugeBuffer> storage_;  // the arena chunk holding a converted copy
  size_t owned_bytes_;
  bool interleaved_;            // in the 8-row interleaved layout

  static const char* interleaved_name(GgmlType type) {
    switch (type) {
      case GgmlType::Q4_0: return "q4_0x8";
      case GgmlType::Q4_1: return "q4_1x8";
      case GgmlType::Q5_0: return "q5_0x8";
      case GgmlType::Q5_1: return "q5_1x8";
      case GgmlType::Q4_K: return "q4_Kx8";
      case GgmlType::Q5_K: return "q5_Kx8";
      case GgmlType::Q6_K: return "q6_Kx8";
      default: return "q8_0x8";
    }
  }
};

// Output rows per task: enough work per task to amortize scheduling, small enough to balance.
// A multiple of kInterleaveRows, so a task starts at an interleaved group.
constexpr int64_t kRowsPerTask = 16;
static_assert(kRowsPerTask % kInterleaveRows == 0);

const ParamSpec kParams[] = {
    {"layout", ParamType::kEnum, "ggml",
     "ggml: every dot in ggml's order, logits equal llama.cpp's bit for bit; interleaved: Q4_0, "
     "Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K weights repacked 8 rows at a time at load, faster kernels, "
     "logits within float rounding",
     -INFINITY, INFINITY, "ggml|interleaved"},
};

class GgufQuantizer final : public Quantizer, public GroupedMatmul {
 public:
  explicit GgufQuantizer(bool interleave) : interleave_(interleave) {}

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
      const size_t bytes = static_cast<size_t>(w.rows * w.cols) * sizeof(float);
      std::shared_ptr<const HugeBuffer> storage;
      uint8_t* f32 = arena_allocate(bytes, &storage);
      const size_t src_row = ggml_row_size(type, w.cols);
      for (int64_t r = 0; r < w.rows; ++r)
        tessera::dequantize_row(type, static_cast<const uint8_t*>(w.data) + r * src_row,
                       reinterpret_cast<float*>(f32) + r * w.cols, w.cols);
      *out = std::make_unique<GgufWeight>(GgmlType::F32, w.rows, w.cols, f32, std::move(storage), bytes);
      return Status::ok();
    }
    if (interleave_ && has_interleaved_layout(type)) {
      const size_t bytes = interleaved_size(type, w.rows, w.cols);
      std::shared_ptr<const HugeBuffer> storage;
      uint8_t* packed = arena_allocate(bytes, &storage);
      interleave_rows(type, w.data, w.rows, w.cols, packed);
      *out = std::make_unique<GgufWeight>(type, w.rows, w.cols, packed, std::move(storage), bytes,
                                          true);
      return Status::ok();
    }
    *out = std::make_unique<GgufWeight>(type, w.rows, w.cols, static_cast<const uint8_t*>(w.data));
    return Status::ok();
  }

  void matmul(const PreparedWeight& pw, const float* x, int64_t num_tokens, float* y,
              Executor& executor) override {
    const MatmulTarget target{&pw, y};
    matmul_group(std::span<const MatmulTarget>(&target, 1), x, num_tokens, executor);
  }

  // All targets' rows in one parallel pass over kRowsPerTask-row tasks numbered across the
  // targets in order; the input is quantized once per dot type. Each output element is the
  // vec_dot_tile of its pair, so the grouping does not change any result.
  void matmul_group(std::span<const MatmulTarget> targets, const float* x, int64_t num_tokens,
                    Executor& executor) override {
    if (targets.empty() || num_tokens <= 0) return;
    const int64_t cols = targets.front().weight->cols();
    int64_t num_tasks = 0;
    size_t num_parts = 0, num_inputs = 0;
    for (const MatmulTarget& t : targets) {
      const auto& w = static_cast<const GgufWeight&>(*t.weight);
      const GgmlType dot_type = vec_dot_type(w.type());
      Part part{&w, t.y, num_tasks, nullptr, ggml_row_size(dot_type, cols)};
      // The input in this weight's dot type: quantized by an earlier target of the same dot
      // type, or now.
      for (size_t i = 0; i < num_parts && part.x == nullptr; ++i)
        if (vec_dot_type(parts_[i].weight->type()) == dot_type) part.x = parts_[i].x;
      if (part.x == nullptr) {
        if (num_inputs == kBuffers) {  // more distinct input types than buffers: no grouping
          for (const MatmulTarget& one : targets)
            matmul_group(std::span<const MatmulTarget>(&one, 1), x, num_tokens, executor);
          return;
        }
        part.x = quantized_input(activations_[num_inputs++], dot_type, x, cols, num_tokens,
                                 executor);
      }
      num_tasks += (w.rows() + kRowsPerTask - 1) / kRowsPerTask;
      if (parts_.size() <= num_parts) parts_.resize(num_parts + 1);
      parts_[num_parts++] = part;
    }
    const Part* parts = parts_.data();
    executor.run(num_tasks, [&](int64_t begin, int64_t end, int) {
      // The range may span several targets: run the piece that falls in each.
      for (size_t i = 0; i < num_parts && begin < end; ++i) {
        const Part& p = parts[i];
        const int64_t rows = p.weight->rows();
        const int64_t part_end = p.first_task + (rows + kRowsPerTask - 1) / kRowsPerTask;
        if (begin >= part_end) continue;
        const int64_t stop = std::min(end, part_end);
        const int64_t r0 = (begin - p.first_task) * kRowsPerTask;
        const int64_t r1 = std::min(rows, (stop - p.first_task) * kRowsPerTask);
        // A tile of weight rows x activation rows per pass: each weight block is unpacked
        // once for several tokens, each activation block loaded once for several rows.
        if (p.weight->interleaved()) {
          matmul_interleaved(p.weight->type(), p.weight->group(r0), cols, r1 - r0, p.x,
                             p.x_row_bytes, num_tokens, p.y + r0, rows);
        } else {
          vec_dot_tile(p.weight->type(), cols, p.weight->row(r0), p.weight->row_bytes(), r1 - r0,
                       p.x, p.x_row_bytes, num_tokens, p.y + r0, rows);
        }
        begin = stop;
      }
    });
  }

  void dequantize_row(const PreparedWeight& pw, int64_t row, float* out) override {
    const auto& w = static_cast<const GgufWeight&>(pw);
    if (w.interleaved()) {
      // Back to GGUF blocks first; the buffer is kept so embedding lookups in the step loop
      // do not allocate.
      thread_local std::vector<uint8_t> blocks;
      blocks.resize(w.row_bytes());
      deinterleave_row(w.type(), w.group(0), w.cols(), row, blocks.data());
      tessera::dequantize_row(w.type(), blocks.data(), out, w.cols());
      return;
    }
    tessera::dequantize_row(w.type(), w.row(row), out, w.cols());
  }

  static Status create(const PluginConfig& config, const PluginContext&,
                       std::unique_ptr<Quantizer>* out) {
    *out = std::make_unique<GgufQuantizer>(config.get_string("layout", "ggml") == "interleaved");
    return Status::ok();
  }

 private:
  // One target of a grouped matmul: its weight, output, first task number and input.
  struct Part {
    const GgufWeight* weight;
    float* y;
    int64_t first_task;
    const uint8_t* x;
    size_t x_row_bytes;
  };

  // x in `dot_type` (F32: x itself). Rows are quantized on the calling thread when there are
  // few of them: a parallel pass (and its barrier) costs more than quantizing a decode batch.
  static const uint8_t* quantized_input(std::vector<uint8_t>& buffer, GgmlType dot_type,
                                        const float* x, int64_t cols, int64_t num_tokens,
                                        Executor& executor) {
    if (dot_type == GgmlType::F32) return reinterpret_cast<const uint8_t*>(x);
    const size_t row_bytes = ggml_row_size(dot_type, cols);
    const size_t needed = row_bytes * static_cast<size_t>(num_tokens);
    if (buffer.size() < needed) buffer.resize(needed);
    uint8_t* out = buffer.data();
    const auto quantize = [&](int64_t begin, int64_t end, int) {
      for (int64_t t = begin; t < end; ++t)
        quantize_activation_row(dot_type, x + t * cols, out + t * row_bytes, cols);
    };
    if (num_tokens * cols <= kSerialQuantizeElements) {
      quantize(0, num_tokens, 0);
    } else {
      executor.run(num_tokens, quantize);
    }
    return out;
  }

  // One buffer per distinct input type of a group (a group may mix e.g. Q8_1 and Q8_0).
  static constexpr size_t kBuffers = 4;
  static constexpr int64_t kSerialQuantizeElements = 16 * 1536;
  std::vector<uint8_t> activations_[kBuffers];  // quantized inputs, grown on demand
  std::vector<Part> parts_;                     // per-call scratch, capacity kept
  bool interleave_;  // layout: interleaved

  // Converted weights are carved out of 16 MiB chunks on huge pages (a matrix of this model
  // is at most ~0.5 MiB, too small to get a huge page of its own): decode streams all of them
  // every step, and with 4 KiB pages each page costs a TLB miss. A chunk lives as long as
  // any weight in it.
  static constexpr size_t kArenaChunkBytes = size_t{16} << 20;
  std::shared_ptr<HugeBuffer> arena_;
  size_t arena_used_ = 0;

  uint8_t* arena_allocate(size_t bytes, std::shared_ptr<const HugeBuffer>* storage) {
    const size_t rounded = (bytes + 63) / 64 * 64;
    if (!arena_ || arena_used_ + rounded > arena_->size()) {
      arena_ = std::make_shared<HugeBuffer>(std::max(kArenaChunkBytes, rounded));
      arena_used_ = 0;
    }
    uint8_t* p = arena_->data() + arena_used_;
    arena_used_ += rounded;
    *storage = arena_;
    return p;
  }
};

}  // namespace
}  // namespace tessera

TESSERA_REGISTER_PLUGIN_WITH(tessera::GgufQuantizer, tessera::Quantizer, "gguf", "0.1.0",
                             "GGUF block formats in place (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, "
                             "F16, F32, BF16)",
                             tessera::kParams, "grouped_matmul", "")
