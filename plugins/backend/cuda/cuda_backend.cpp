// backend.cuda: device memory, one stream, the element-wise kernels of the SDK Backend
// interface on the GPU, and (ForwardRunnerProvider) a device runner for the whole forward.
#include <cuda_runtime_api.h>

#include <cmath>
#include <memory>
#include <stdexcept>
#include <string>

#include "cuda_runner.h"
#include "tessera/sdk/kernels/cuda.h"
#include "tessera/sdk.h"

namespace tessera {
namespace {

// Host-side work of the plugins that take an Executor: there is none on this backend's hot
// path, so ranges run inline on the calling thread.
class InlineExecutor final : public Executor {
 public:
  int num_threads() const override { return 1; }
  void parallel_for(int64_t n, RangeFn fn, void* context) override {
    if (n > 0) fn(context, 0, n, 0);
  }
};

class CudaBackend final : public Backend, public ForwardRunnerProvider {
 public:
  CudaBackend(int device, cuda::RunnerOptions options) : device_(device), options_(options) {
    cuda::check(cudaSetDevice(device_), "cudaSetDevice");
    cuda::check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, device_) == cudaSuccess)
      name_ = std::string("cuda:") + std::to_string(device_) + " (" + prop.name + ")";
    else
      name_ = "cuda:" + std::to_string(device_);
  }
  ~CudaBackend() override {
    if (stream_) {
      cudaStreamSynchronize(stream_);
      cudaStreamDestroy(stream_);
    }
  }

  const char* device_name() const override { return name_.c_str(); }
  Executor& executor() override { return executor_; }

  void* allocate(size_t bytes) override {
    void* p = nullptr;
    if (cudaMalloc(&p, bytes == 0 ? 16 : bytes) != cudaSuccess) {
      cudaGetLastError();
      return nullptr;
    }
    if (cudaMemset(p, 0, bytes == 0 ? 16 : bytes) != cudaSuccess) {
      cudaFree(p);
      return nullptr;
    }
    return p;
  }
  void release(void* ptr) override {
    if (!ptr) return;
    cudaStreamSynchronize(stream_);
    cudaFree(ptr);
  }
  void copy_to_device(void* dst, const void* src, size_t bytes) override {
    cuda::check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream_), "copy_to_device");
    cuda::check(cudaStreamSynchronize(stream_), "copy_to_device");
  }
  void copy_to_host(void* dst, const void* src, size_t bytes) override {
    cuda::check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream_), "copy_to_host");
    cuda::check(cudaStreamSynchronize(stream_), "copy_to_host");
  }
  void copy_on_device(void* dst, const void* src, size_t bytes) override {
    cuda::check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_), "copy_on_device");
  }

  void rms_norm(float* out, const float* in, const float* weight, int64_t rows, int64_t dim,
                float eps) override {
    cuda::rms_norm(out, in, weight, rows, dim, eps, stream_);
  }
  void rope(float* x, const int32_t* positions, int64_t rows, int32_t num_heads,
            const RopeParams& p) override {
    cuda::rope(x, positions, rows, num_heads, p.head_dim, p.rotary_dim, p.freq_base, p.freq_scale, p.neox,
               stream_);
  }
  void silu_mul(float* gate, const float* up, int64_t n) override { cuda::silu_mul(gate, up, n, stream_); }
  void add(float* inout, const float* x, int64_t n) override { cuda::add(inout, x, n, stream_); }
  void store_kv(void* pool, KvDtype dtype, const float* src, const int32_t* slots, int64_t rows,
                int64_t row_elems) override {
    // Only f16/f32 reach here: create_forward_runner refuses a q8_0 layout.
    cuda::store_kv(pool, dtype == KvDtype::kF16, src, slots, rows, row_elems, stream_);
  }

  Status create_forward_runner(const ForwardModelView& model, const KvLayout& layout,
                               int32_t max_batch_tokens, int32_t max_context, AttentionKernel& attention,
                               std::unique_ptr<ForwardRunner>* out) override {
    auto* device_attention = dynamic_cast<DeviceAttentionKernel*>(&attention);
    if (!device_attention || std::string(device_attention->device_name()) != "cuda")
      return invalid_argument(
          "backend cuda runs the forward pass on the GPU and needs a CUDA attention kernel; set "
          "engine.attention to {plugin: cuda-flash} (the configured one computes on the host)");
    if (layout.k_dtype != layout.v_dtype || layout.k_dtype == KvDtype::kQ8_0)
      return invalid_argument(std::string("backend cuda: the device runner stores K and V as f16 or f32 with one "
                                          "dtype, engine.kv_cache asks for K ") +
                              kv_dtype_name(layout.k_dtype) + ", V " + kv_dtype_name(layout.v_dtype));
    if (!cuda::attention_supported(model.head_dim))
      return unimplemented("backend cuda: head_dim " + std::to_string(model.head_dim) +
                           " has no cuda-flash kernel (64 or 128)");
    try {
      cuda::check(cudaSetDevice(device_), "cudaSetDevice");
      std::shared_ptr<cuda::DeviceModel> weights = cuda::DeviceModel::upload(model, stream_);
      *out = std::make_unique<cuda::CudaRunner>(std::move(weights), layout, max_batch_tokens, max_context,
                                                options_, device_);
    } catch (const std::exception& e) {
      return internal_error(e.what());
    }
    return Status::ok();
  }

  static Status create(const PluginConfig& config, const PluginContext&, std::unique_ptr<Backend>* out) {
    int count = 0;
    const cudaError_t err = cudaGetDeviceCount(&count);
    if (err != cudaSuccess || count == 0)
      return unimplemented(std::string("backend cuda: no CUDA device (cudaGetDeviceCount: ") +
                           (err != cudaSuccess ? cudaGetErrorString(err) : "0 devices") + ")");
    const int device = static_cast<int>(config.get_int("device", 0));
    if (device >= count)
      return invalid_argument("backend cuda: device " + std::to_string(device) + " does not exist (" +
                              std::to_string(count) + " present)");
    cuda::RunnerOptions options;
    options.gemv_max_tokens = static_cast<int32_t>(config.get_int("gemv_max_tokens", -1));
    options.cuda_graphs = config.get_bool("cuda_graphs", true);
    options.graph_max_batch = static_cast<int32_t>(config.get_int("graph_max_batch", 256));
    options.decode_splits = static_cast<int32_t>(config.get_int("decode_splits", 0));
    options.fused_gemv = config.get_bool("fused_gemv", true);
    options.programmatic_launch = config.get_bool("programmatic_launch", true);
    *out = std::make_unique<CudaBackend>(device, options);
    return Status::ok();
  }

 private:
  int device_ = 0;
  cuda::RunnerOptions options_;
  cudaStream_t stream_ = nullptr;
  std::string name_;
  InlineExecutor executor_;
};

const ParamSpec kParams[] = {
    {"device", ParamType::kInt, "0", "CUDA device ordinal", 0, 1024},
    {"gemv_max_tokens", ParamType::kInt, "-1",
     "matmuls over at most this many token rows use the weight-only GEMV kernels, more rows cuBLAS; -1 picks per "
     "weight format (2 for f32/f16/bf16, 8 for Q4_0/Q4_1/Q8_0)", -1, 1 << 20},
    {"cuda_graphs", ParamType::kBool, "true", "capture and replay decode steps as CUDA graphs"},
    {"graph_max_batch", ParamType::kInt, "256",
     "largest decode batch captured (batches are padded to the next power of two)", 1, 1 << 16},
    {"decode_splits", ParamType::kInt, "0",
     "split-K chunks per sequence and KV head in decode attention; 0 picks from the SM count", 0, 64},
    {"fused_gemv", ParamType::kBool, "true",
     "GEMV steps fuse Q/K/V into one launch, gate/up with SiLU, and the residual adds (same results, fewer "
     "launches); false launches each matmul and element-wise op separately (for A/B)"},
    {"programmatic_launch", ParamType::kBool, "true",
     "launch the GEMV, rms_norm and rope kernels with programmatic dependent launch (sm_90 and newer; ignored "
     "below): each may start while the previous kernel drains; same results"},
};

}  // namespace
}  // namespace tessera

// create_forward_runner refuses a host attention kernel (see above), so the stack must pair
// it with a device one; declaring the need refuses such a stack before the model loads.
TESSERA_REGISTER_PLUGIN_WITH(tessera::CudaBackend, tessera::Backend, "cuda", "0.1.0",
                             "CUDA backend: device memory, kernels, device forward runner with CUDA graphs",
                             tessera::kParams, "forward_runner", "attention.device_attention")
