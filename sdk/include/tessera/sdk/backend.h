// backend plugins own device memory and the element-wise kernels of the forward pass. The
// CPU backend is built into the core; GPU backends are plugins. Pointers passed to these
// methods are device pointers of this backend (host pointers for the CPU).
#pragma once

#include <cstddef>
#include <cstdint>

#include "tessera/sdk/executor.h"
#include "tessera/sdk/plugin.h"
#include "tessera/sdk/types.h"

namespace tessera {

struct RopeParams {
  int32_t head_dim = 0;
  int32_t rotary_dim = 0;      // leading dims rotated (usually head_dim)
  float freq_base = 10000.0f;
  float freq_scale = 1.0f;     // linear scaling: position * freq_scale
  bool neox = false;           // false: rotate adjacent pairs (Llama GGUF); true: halves (NeoX)
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual const char* device_name() const = 0;
  virtual Executor& executor() = 0;

  // Device memory. allocate returns nullptr on failure; memory is zero-initialized.
  virtual void* allocate(size_t bytes) = 0;
  virtual void release(void* ptr) = 0;
  virtual void copy_to_device(void* dst, const void* host_src, size_t bytes) = 0;
  virtual void copy_to_host(void* host_dst, const void* src, size_t bytes) = 0;
  virtual void copy_on_device(void* dst, const void* src, size_t bytes) = 0;

  // out[r] = in[r] / rms(in[r]) * weight, rows of `dim` floats.
  virtual void rms_norm(float* out, const float* in, const float* weight, int64_t rows,
                        int64_t dim, float eps) = 0;
  // Rotates x in place: rows of num_heads * head_dim floats, row r at position positions[r].
  virtual void rope(float* x, const int32_t* positions, int64_t rows, int32_t num_heads,
                    const RopeParams& params) = 0;
  // gate[i] = silu(gate[i]) * up[i]
  virtual void silu_mul(float* gate, const float* up, int64_t n) = 0;
  // gate[i] = gelu(gate[i]) * up[i], GELU in its tanh form (Gemma's GeGLU FFN; ABI 2.5).
  // A backend without the kernel keeps this default, and the runner refuses such models.
  virtual bool gelu_mul(float* /*gate*/, const float* /*up*/, int64_t /*n*/) { return false; }
  // inout[i] += x[i]
  virtual void add(float* inout, const float* x, int64_t n) = 0;
  // Writes `rows` token vectors (num_kv_heads * head_dim floats each) into a KV pool of
  // `dtype` at slot indices slots[r] (block * block_size + offset).
  virtual void store_kv(void* pool, KvDtype dtype, const float* src, const int32_t* slots,
                        int64_t rows, int64_t row_elems) = 0;
};

template <> struct PluginKindOf<Backend> {
  static constexpr PluginKind value = PluginKind::kBackend;
};

}  // namespace tessera
