// quantizer plugins own a weight format and its matmul kernels. At load the runner hands
// each 2-D weight to prepare() (which may keep GGUF blocks in place or convert them once,
// e.g. to INT8 or AWQ), and calls matmul() in the forward pass.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>

#include "tessera/sdk/executor.h"
#include "tessera/sdk/plugin.h"

namespace tessera {

// A weight as stored in the model file: `rows` rows of `cols` elements of GGML type
// `ggml_type` (numbered as in the GGUF spec). The data stays mapped while the model lives.
struct WeightView {
  const char* name = "";
  uint32_t ggml_type = 0;
  int64_t cols = 0;
  int64_t rows = 0;
  const void* data = nullptr;
  size_t num_bytes = 0;
};

// A weight ready for matmul, in whatever form the quantizer chose. Immutable after prepare;
// matmul may read it from many threads.
class PreparedWeight {
 public:
  virtual ~PreparedWeight() = default;
  virtual int64_t rows() const = 0;
  virtual int64_t cols() const = 0;
  virtual size_t num_bytes() const = 0;  // memory it holds (in place: the mapped bytes)
  virtual const char* format() const = 0; // e.g. "q4_1", "int8"
};

class Quantizer {
 public:
  virtual ~Quantizer() = default;
  // Whether prepare() accepts weights of this GGML type.
  virtual bool supports(uint32_t ggml_type) const = 0;
  virtual Status prepare(const WeightView& weight, std::unique_ptr<PreparedWeight>* out) = 0;
  // y[t][r] = sum_c W[r][c] * x[t][c] for t < num_tokens (x: [num_tokens][cols] floats,
  // y: [num_tokens][rows]). Splits work over `executor`.
  virtual void matmul(const PreparedWeight& weight, const float* x, int64_t num_tokens,
                      float* y, Executor& executor) = 0;
  // Dequantizes row `row` into `out` (cols floats): embedding lookups.
  virtual void dequantize_row(const PreparedWeight& weight, int64_t row, float* out) = 0;
};

// One weight of a grouped matmul and where its output goes ([num_tokens][weight.rows()]).
struct MatmulTarget {
  const PreparedWeight* weight = nullptr;
  float* y = nullptr;
};

// Optional capability of a Quantizer, found with dynamic_cast (no vtable grows, the SDK ABI is
// unchanged): several weights applied to the same input, such as a layer's q/k/v or gate/up
// projections. A quantizer implementing it converts the input once and splits the rows of
// all the weights over one parallel pass, instead of one conversion and one pass (each ending
// in a barrier) per weight. Each output must equal what matmul() would write for it.
class GroupedMatmul {
 public:
  virtual ~GroupedMatmul() = default;
  virtual void matmul_group(std::span<const MatmulTarget> targets, const float* x,
                            int64_t num_tokens, Executor& executor) = 0;
};

template <> struct PluginKindOf<Quantizer> {
  static constexpr PluginKind value = PluginKind::kQuantizer;
};

}  // namespace tessera
