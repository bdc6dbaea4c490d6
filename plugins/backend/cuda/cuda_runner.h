// The device forward runner of backend.cuda: the same Llama-family forward as the core's
// ModelRunner (RMSNorm, RoPE, GQA attention over the paged KV pool, SwiGLU, residuals, logits
// for the sampled rows only) over the same KV layout, with every step on one CUDA stream.
// Built from a ForwardModelView (weights uploaded as stored: GGUF Q4_0/Q4_1/Q8_0 blocks stay
// quantized, F16/BF16/F32 stay dense) or from synthetic random weights (benchmarks).
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <map>
#include <memory>
#include <span>
#include <vector>

#include "tessera/sdk/kernels/cuda.h"
#include "tessera/sdk/forward.h"

namespace tessera::cuda {

struct RunnerOptions {
  // Matmuls over at most this many token rows use the GEMV kernels, more use cuBLAS; -1 picks
  // per weight format what measured faster on an H200 (README): 2 for f32/f16/bf16 (whose
  // GEMV reads the activations once per token and loses to cuBLAS from 4 rows), 8 for the
  // GGUF block formats (cuBLAS would dequantize the whole matrix every call).
  int32_t gemv_max_tokens = -1;
  bool cuda_graphs = true;          // capture decode steps of padded batch sizes
  int32_t graph_max_batch = 256;    // largest captured decode batch (powers of two up to it)
  int32_t decode_splits = 0;        // split-K chunks per (sequence, KV head); 0 = automatic
  bool programmatic_launch = true;  // GEMV, rms_norm and rope_store_kv kernels launched with
                                    // programmatic dependent launch (see the SDK's cuda.h) on
                                    // sm_90 and newer: 1-4% off a batch-1 step on an H200
  bool fused_gemv = true;           // GEMV steps: Q/K/V in one launch, gate/up with SiLU, residual
                                    // adds in the epilogue (same bits as unfused, fewer launches)
};

struct ModelShape {
  int32_t vocab_size = 0, embedding_dim = 0, num_layers = 0, num_heads = 0, num_kv_heads = 0,
          head_dim = 0, ffn_dim = 0;
  float rms_eps = 1e-5f;
  RopeParams rope;
};

struct DeviceMatrix {
  uint32_t format = kF32;
  int64_t rows = 0, cols = 0;
  void* data = nullptr;
};

// Weights in device memory. Owns its allocations.
class DeviceModel {
 public:
  ~DeviceModel();
  // Uploads the view's weights. Throws std::runtime_error naming an unsupported tensor.
  static std::unique_ptr<DeviceModel> upload(const ForwardModelView& view, cudaStream_t stream);
  // Random weights of `format` (kBF16, kF16 or kF32), uniform in +-scale, norms = 1; tied
  // output. For benchmarks that cannot ship multi-GB files.
  static std::unique_ptr<DeviceModel> synthetic(const ModelShape& shape, uint32_t format, uint64_t seed,
                                                cudaStream_t stream);

  struct Layer {
    float* attn_norm = nullptr;
    float* ffn_norm = nullptr;
    float* bq = nullptr;
    float* bk = nullptr;
    float* bv = nullptr;
    DeviceMatrix wq, wk, wv, wo, w_gate, w_up, w_down;
  };
  ModelShape shape;
  DeviceMatrix token_embd, output;
  float* output_norm = nullptr;
  std::vector<Layer> layers;
  size_t weight_bytes = 0;

 private:
  DeviceModel() = default;
  void* alloc(size_t bytes);
  std::vector<void*> allocations_;
};

// Device-side sampling parameters of one logit row (kernels.h SampleParams).
using DeviceSampleParams = SampleParams;

class CudaRunner final : public ForwardRunner {
 public:
  CudaRunner(std::shared_ptr<DeviceModel> model, const KvLayout& layout, int32_t max_batch_tokens,
             int32_t max_context, const RunnerOptions& options, int device);
  ~CudaRunner() override;

  Status forward(std::span<const ForwardSequence> sequences, std::vector<float>* logits) override;
  void copy_blocks(std::span<const BlockCopy> copies) override;
  int32_t vocab_size() const override { return model_->shape.vocab_size; }
  size_t kv_pool_bytes() const override { return kv_pool_bytes_; }

  // Forward plus sampling on the device: one token per logit row, chosen with params[i].
  Status forward_sample(std::span<const ForwardSequence> sequences,
                        std::span<const DeviceSampleParams> params, std::vector<int32_t>* tokens);

  cudaStream_t stream() const { return stream_; }
  const DeviceModel& model() const { return *model_; }
  int32_t num_captured_graphs() const { return static_cast<int32_t>(graphs_.size()); }
  int64_t num_graph_replays() const { return graph_replays_; }

  // y[ntok][w.rows] = x[ntok][w.cols] . W^T on the runner's stream: the GEMV kernels up to the
  // crossover (gemv_max_tokens), cuBLAS above. `x_converted` says the 16-bit copy of x from
  // the previous cuBLAS call of this step is still current (same x, same 16-bit type), so a
  // group of matmuls sharing an input (Q/K/V, gate/up) converts it once. Public for the
  // benchmark's per-shape timings.
  void matmul(const DeviceMatrix& w, const float* x, int64_t ntok, float* y, bool x_converted = false);

 private:
  struct StepLayout {
    size_t tokens = 0, positions = 0, slots = 0, logit_rows = 0, params = 0, seqs = 0, tables = 0,
           work = 0, total = 0;
    int32_t table_stride = 0;
  };
  struct Step;
  Status run(std::span<const ForwardSequence> sequences, std::span<const DeviceSampleParams> params,
             std::vector<float>* logits, std::vector<int32_t>* tokens);
  StepLayout layout_for(int32_t rows, int32_t logit_rows, int32_t seqs, int32_t table_stride,
                        int32_t work) const;
  void ensure_staging(size_t bytes);
  void ensure_logit_rows(int32_t rows);
  // Enqueues the whole step (upload of `upload_bytes` staging bytes, layers, logits, optional
  // sampling); captured as a graph for padded decode batches.
  void enqueue(const Step& step);
  bool use_gemv(const DeviceMatrix& w, int64_t ntok) const;
  // x_ += in . W^T (the output and down projections into the residual stream).
  void add_projection(const DeviceMatrix& w, const float* in, int64_t n, bool fuse);

  std::shared_ptr<DeviceModel> model_;
  KvLayout layout_;
  int32_t max_rows_ = 0;
  int32_t max_context_ = 0;
  int32_t max_blocks_per_seq_ = 0;
  RunnerOptions options_;
  int device_ = 0;
  int num_sms_ = 1;
  cudaStream_t stream_ = nullptr;
  cublasHandle_t cublas_ = nullptr;
  void* cublas_workspace_ = nullptr;

  // KV pool: one allocation, [layer][k|v][blocks][block_size][kv_heads][head_dim].
  void* kv_pool_ = nullptr;
  size_t kv_pool_bytes_ = 0;
  size_t layer_pool_bytes_ = 0;

  // Device scratch sized for max_rows_.
  float *x_ = nullptr, *h_ = nullptr, *q_ = nullptr, *k_ = nullptr, *v_ = nullptr, *attn_ = nullptr,
        *gate_ = nullptr, *up_ = nullptr, *logit_in_ = nullptr, *logits_ = nullptr;
  int32_t logit_capacity_ = 0;
  int32_t* sampled_ = nullptr;
  void* act16_ = nullptr;        // activations converted for cuBLAS
  void* weight16_ = nullptr;     // dequantized weight for cuBLAS (quantized formats only)
  void* decode_scratch_ = nullptr;
  size_t decode_scratch_bytes_ = 0;

  // Per-step metadata: pinned host staging copied in one transfer to a fixed device buffer.
  uint8_t* host_staging_ = nullptr;
  uint8_t* dev_staging_ = nullptr;
  size_t staging_capacity_ = 0;
  float* host_logits_ = nullptr;
  int32_t* host_tokens_ = nullptr;
  std::vector<AttnSeq> host_seqs_;
  std::vector<AttnWork> host_work_;

  // Decode graphs keyed by (padded batch, sampling).
  std::map<std::pair<int32_t, bool>, cudaGraphExec_t> graphs_;
  int64_t graph_replays_ = 0;
};

}  // namespace tessera::cuda
