// attention.cuda-flash through the SDK AttentionKernel interface, for device pointers. The
// backend.cuda runner launches the same kernels directly (its per-step metadata is already on
// the device and decode steps are graph-captured); this object is what the engine's attention
// slot names, what the runner checks for (DeviceAttentionKernel), and a standalone entry point
// for other device runners and the tests.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

#include "tessera/sdk/kernels/cuda.h"
#include "tessera/sdk.h"

namespace tessera {
namespace {

class CudaFlashAttention final : public AttentionKernel, public DeviceAttentionKernel {
 public:
  explicit CudaFlashAttention(int32_t decode_splits) : decode_splits_(decode_splits) {}
  ~CudaFlashAttention() override {
    if (stream_) cudaStreamDestroy(stream_);
    if (dev_meta_) cudaFree(dev_meta_);
    if (scratch_) cudaFree(scratch_);
  }

  const char* device_name() const override { return "cuda"; }

  size_t scratch_bytes(const AttentionShape& shape, int32_t max_rows, int32_t) const override {
    const cuda::AttnShape sh = to_cuda(shape);
    return cuda::decode_scratch_bytes(sh, max_rows, 64) +
           (sizeof(cuda::AttnSeq) + sizeof(cuda::AttnWork) * 4) * static_cast<size_t>(max_rows);
  }

  // Pointers in `batch` (q, pools, out, block tables) are device pointers. Synchronizes the
  // device first (the caller's stream is not known through this interface) and returns when
  // the result is complete.
  Status forward(const AttentionShape& shape, const AttentionBatch& batch, Executor&) override {
    if (shape.sliding_window > 0)
      return invalid_argument("cuda-flash: sliding-window attention (sliding_window " +
                              std::to_string(shape.sliding_window) +
                              ") is not implemented on the device yet; use attention.flash or attention.naive");
    if (shape.k_dtype != shape.v_dtype || shape.k_dtype == KvDtype::kQ8_0)
      return invalid_argument(std::string("cuda-flash: reads f16 or f32 KV pools with one dtype for K and V, got K ") +
                              kv_dtype_name(shape.k_dtype) + ", V " + kv_dtype_name(shape.v_dtype) +
                              " (q8_0 is read by attention.flash and attention.naive)");
    try {
      if (!stream_) cuda::check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
      const cuda::AttnShape sh = to_cuda(shape);
      const int32_t n = static_cast<int32_t>(batch.sequences.size());
      if (n == 0) return Status::ok();
      std::vector<cuda::AttnSeq> seqs(n);
      bool decode = sh.num_heads / sh.num_kv_heads <= cuda::kAttnRowsPerCta;
      int32_t max_context = 1;
      for (int32_t i = 0; i < n; ++i) {
        const AttentionSequence& s = batch.sequences[i];
        seqs[i] = cuda::AttnSeq{s.query_start, s.num_queries, s.context_len, 0, s.block_table};
        decode = decode && s.num_queries == 1;
        max_context = std::max(max_context, s.context_len);
      }
      std::vector<cuda::AttnWork> work;
      if (!decode) {
        work.resize(cuda::count_prefill_work(sh, seqs.data(), n));
        cuda::plan_prefill(sh, seqs.data(), n, work.data());
      }
      const size_t seq_bytes = (sizeof(cuda::AttnSeq) * n + 15) / 16 * 16;
      const size_t meta = seq_bytes + sizeof(cuda::AttnWork) * work.size();
      if (meta > meta_capacity_) {
        if (dev_meta_) cudaFree(dev_meta_);
        dev_meta_ = nullptr;
        cuda::check(cudaMalloc(&dev_meta_, meta * 2), "cudaMalloc (attention metadata)");
        meta_capacity_ = meta * 2;
      }
      auto* dev = static_cast<uint8_t*>(dev_meta_);
      cuda::check(cudaDeviceSynchronize(), "cuda-flash: inputs");
      cuda::check(cudaMemcpyAsync(dev, seqs.data(), sizeof(cuda::AttnSeq) * n, cudaMemcpyHostToDevice, stream_),
                  "cuda-flash: metadata");
      if (!work.empty())
        cuda::check(cudaMemcpyAsync(dev + seq_bytes, work.data(), sizeof(cuda::AttnWork) * work.size(),
                                    cudaMemcpyHostToDevice, stream_),
                    "cuda-flash: metadata");
      const auto* dseqs = reinterpret_cast<const cuda::AttnSeq*>(dev);
      if (decode) {
        int sms = 1;
        int device = 0;
        cudaGetDevice(&device);
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
        const int32_t splits = decode_splits_ > 0 ? decode_splits_ : cuda::choose_decode_splits(sh, n, max_context, sms);
        const size_t need = cuda::decode_scratch_bytes(sh, n, splits);
        if (need > scratch_capacity_) {
          if (scratch_) cudaFree(scratch_);
          scratch_ = nullptr;
          cuda::check(cudaMalloc(&scratch_, need), "cudaMalloc (attention scratch)");
          scratch_capacity_ = need;
        }
        cuda::attention_decode(sh, dseqs, n, splits, batch.q, batch.k_pool, batch.v_pool, batch.out, scratch_,
                               stream_);
      } else {
        cuda::attention_prefill(sh, dseqs, reinterpret_cast<const cuda::AttnWork*>(dev + seq_bytes),
                                static_cast<int32_t>(work.size()), batch.q, batch.k_pool, batch.v_pool, batch.out,
                                stream_);
      }
      cuda::check(cudaStreamSynchronize(stream_), "cuda-flash");
    } catch (const std::exception& e) {
      return internal_error(std::string("cuda-flash: ") + e.what());
    }
    return Status::ok();
  }

  static Status create(const PluginConfig& config, const PluginContext&, std::unique_ptr<AttentionKernel>* out) {
    *out = std::make_unique<CudaFlashAttention>(static_cast<int32_t>(config.get_int("decode_splits", 0)));
    return Status::ok();
  }

 private:
  static cuda::AttnShape to_cuda(const AttentionShape& s) {
    return cuda::AttnShape{s.num_heads, s.num_kv_heads, s.head_dim, s.scale, s.block_size,
                           s.k_dtype == KvDtype::kF16};
  }

  int32_t decode_splits_ = 0;
  cudaStream_t stream_ = nullptr;
  void* dev_meta_ = nullptr;
  size_t meta_capacity_ = 0;
  void* scratch_ = nullptr;
  size_t scratch_capacity_ = 0;
};

const ParamSpec kParams[] = {
    {"decode_splits", ParamType::kInt, "0",
     "split-K chunks per sequence and KV head for decode batches called through this interface; 0 picks "
     "from the SM count (the backend.cuda runner has its own decode_splits)",
     0, 64},
};

}  // namespace
}  // namespace tessera

// Its pointers are device pointers, so only a backend that runs the forward pass on the device
// (backend.cuda's runner) can drive it; the core's host ModelRunner cannot.
TESSERA_REGISTER_PLUGIN_WITH(tessera::CudaFlashAttention, tessera::AttentionKernel, "cuda-flash", "0.1.0",
                             "CUDA tiled online-softmax attention over the paged KV pool (prefill) and "
                             "split-K flash-decoding, with GQA",
                             tessera::kParams, "device_attention", "backend.forward_runner")
