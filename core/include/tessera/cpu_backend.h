// The CPU backend: host memory, a persistent thread pool, and the element-wise kernels of the
// forward pass. Built into the core and registered as the builtin plugin backend.cpu.
#pragma once

#include <memory>

#include "tessera/sdk/backend.h"
#include "tessera/thread_pool.h"

namespace tessera {

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(int num_threads);
  const char* device_name() const override { return "cpu"; }
  Executor& executor() override { return pool_; }

  void* allocate(size_t bytes) override;
  void release(void* ptr) override;
  void copy_to_device(void* dst, const void* src, size_t bytes) override;
  void copy_to_host(void* dst, const void* src, size_t bytes) override;
  void copy_on_device(void* dst, const void* src, size_t bytes) override;

  void rms_norm(float* out, const float* in, const float* weight, int64_t rows, int64_t dim,
                float eps) override;
  void rope(float* x, const int32_t* positions, int64_t rows, int32_t num_heads,
            const RopeParams& params) override;
  void silu_mul(float* gate, const float* up, int64_t n) override;
  bool gelu_mul(float* gate, const float* up, int64_t n) override;
  void add(float* inout, const float* x, int64_t n) override;
  void store_kv(void* pool, KvDtype dtype, const float* src, const int32_t* slots, int64_t rows,
                int64_t row_elems) override;

  static Status create(const PluginConfig& config, const PluginContext& context,
                       std::unique_ptr<Backend>* out);

 private:
  ThreadPool pool_;
};

// Manifest of the builtin backend.cpu plugin (registered by PluginRegistry's constructor).
const PluginManifest* cpu_backend_manifest();

}  // namespace tessera
