#include "cuda_runner.h"

#include <dlfcn.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>

namespace tessera::cuda {
namespace {

// cuBLAS is loaded on first use rather than linked: the plugin is scanned by every process
// that lists plugins, and binding libcublas/libcublasLt at dlopen costs about a second.
struct CublasApi {
  decltype(&cublasCreate_v2) create = nullptr;
  decltype(&cublasDestroy_v2) destroy = nullptr;
  decltype(&cublasSetStream_v2) set_stream = nullptr;
  decltype(&cublasSetWorkspace_v2) set_workspace = nullptr;
  // cublasGemmEx is overloaded in C++ (a legacy cudaDataType compute type): the C symbol's type.
  cublasStatus_t (*gemm_ex)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int, int, const void*,
                            const void*, cudaDataType, int, const void*, cudaDataType, int, const void*, void*,
                            cudaDataType, int, cublasComputeType_t, cublasGemmAlgo_t) = nullptr;
};

const CublasApi& cublas() {
  static const CublasApi api = [] {
    void* lib = dlopen(TESSERA_CUBLAS_SONAME, RTLD_NOW | RTLD_LOCAL);
    if (!lib) lib = dlopen(TESSERA_CUBLAS_DIR "/" TESSERA_CUBLAS_SONAME, RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
      const char* err = dlerror();
      throw std::runtime_error(std::string("backend cuda: cannot load cuBLAS (" TESSERA_CUBLAS_SONAME "): ") +
                               (err ? err : "not found"));
    }
    CublasApi a;
    auto sym = [&](auto* fn, const char* name) {
      *fn = reinterpret_cast<std::remove_reference_t<decltype(*fn)>>(dlsym(lib, name));
      if (!*fn) throw std::runtime_error(std::string("backend cuda: cuBLAS lacks ") + name);
    };
    sym(&a.create, "cublasCreate_v2");
    sym(&a.destroy, "cublasDestroy_v2");
    sym(&a.set_stream, "cublasSetStream_v2");
    sym(&a.set_workspace, "cublasSetWorkspace_v2");
    sym(&a.gemm_ex, "cublasGemmEx");
    return a;
  }();
  return api;
}

void check_cublas(cublasStatus_t st, const char* what) {
  if (st != CUBLAS_STATUS_SUCCESS)
    throw std::runtime_error(std::string(what) + ": cuBLAS status " + std::to_string(static_cast<int>(st)));
}

size_t align_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

int32_t next_pow2(int32_t n) {
  int32_t p = 1;
  while (p < n) p <<= 1;
  return p;
}

}  // namespace

// ---------------------------------------------------------------- DeviceModel

DeviceModel::~DeviceModel() {
  for (void* p : allocations_) cudaFree(p);
}

void* DeviceModel::alloc(size_t bytes) {
  void* p = nullptr;
  check(cudaMalloc(&p, std::max<size_t>(bytes, 16)), "cudaMalloc (weights)");
  allocations_.push_back(p);
  weight_bytes += bytes;
  return p;
}

std::unique_ptr<DeviceModel> DeviceModel::upload(const ForwardModelView& v, cudaStream_t stream) {
  std::unique_ptr<DeviceModel> m(new DeviceModel());
  m->shape = ModelShape{v.vocab_size, v.embedding_dim, v.num_layers, v.num_heads, v.num_kv_heads,
                        v.head_dim, v.ffn_dim, v.rms_eps, v.rope};
  auto matrix = [&](const WeightView& w) {
    if (!format_supported(w.ggml_type))
      throw std::runtime_error(std::string("backend cuda: tensor '") + w.name + "' has GGML type " +
                               std::to_string(w.ggml_type) +
                               ", which has no CUDA kernel (supported: F32, F16, BF16, Q4_0, Q4_1, Q8_0)");
    if (w.cols % 32 != 0)
      throw std::runtime_error(std::string("backend cuda: tensor '") + w.name + "' has " +
                               std::to_string(w.cols) + " columns; the kernels need a multiple of 32");
    const size_t bytes = format_row_bytes(w.ggml_type, w.cols) * static_cast<size_t>(w.rows);
    if (bytes != w.num_bytes)
      throw std::runtime_error(std::string("backend cuda: tensor '") + w.name + "' has an unexpected size");
    DeviceMatrix d{w.ggml_type, w.rows, w.cols, m->alloc(bytes)};
    check(cudaMemcpyAsync(d.data, w.data, bytes, cudaMemcpyHostToDevice, stream), "upload weight");
    return d;
  };
  auto vec = [&](const float* src, int64_t n) -> float* {
    if (!src) return nullptr;
    auto* d = static_cast<float*>(m->alloc(sizeof(float) * n));
    check(cudaMemcpyAsync(d, src, sizeof(float) * n, cudaMemcpyHostToDevice, stream), "upload vector");
    return d;
  };
  const int64_t d = v.embedding_dim;
  const int64_t q_dim = static_cast<int64_t>(v.num_heads) * v.head_dim;
  const int64_t kv_dim = static_cast<int64_t>(v.num_kv_heads) * v.head_dim;
  m->token_embd = matrix(v.token_embd);
  m->output = v.output.data == v.token_embd.data ? m->token_embd : matrix(v.output);
  m->output_norm = vec(v.output_norm, d);
  m->layers.resize(v.layers.size());
  for (size_t i = 0; i < v.layers.size(); ++i) {
    const auto& s = v.layers[i];
    Layer& l = m->layers[i];
    l.attn_norm = vec(s.attn_norm, d);
    l.ffn_norm = vec(s.ffn_norm, d);
    l.bq = vec(s.bq, q_dim);
    l.bk = vec(s.bk, kv_dim);
    l.bv = vec(s.bv, kv_dim);
    l.wq = matrix(s.wq);
    l.wk = matrix(s.wk);
    l.wv = matrix(s.wv);
    l.wo = matrix(s.wo);
    l.w_gate = matrix(s.w_gate);
    l.w_up = matrix(s.w_up);
    l.w_down = matrix(s.w_down);
  }
  check(cudaStreamSynchronize(stream), "upload weights");
  return m;
}

std::unique_ptr<DeviceModel> DeviceModel::synthetic(const ModelShape& shape, uint32_t format, uint64_t seed,
                                                    cudaStream_t stream) {
  if (format != kBF16 && format != kF16 && format != kF32)
    throw std::runtime_error("synthetic weights: bf16, f16 or f32 only");
  std::unique_ptr<DeviceModel> m(new DeviceModel());
  m->shape = shape;
  const size_t elem = format == kF32 ? 4 : 2;
  uint64_t next_seed = seed;
  auto matrix = [&](int64_t rows, int64_t cols, float scale) {
    DeviceMatrix d{format, rows, cols, m->alloc(elem * rows * cols)};
    fill_random(d.data, format, rows * cols, scale, next_seed++, stream);
    return d;
  };
  const std::vector<float> ones(std::max(shape.embedding_dim, 1), 1.0f);
  auto norm = [&]() {
    auto* p = static_cast<float*>(m->alloc(sizeof(float) * shape.embedding_dim));
    check(cudaMemcpyAsync(p, ones.data(), sizeof(float) * shape.embedding_dim, cudaMemcpyHostToDevice, stream),
          "synthetic norm");
    check(cudaStreamSynchronize(stream), "synthetic norm");
    return p;
  };
  const int64_t d = shape.embedding_dim;
  const int64_t q_dim = static_cast<int64_t>(shape.num_heads) * shape.head_dim;
  const int64_t kv_dim = static_cast<int64_t>(shape.num_kv_heads) * shape.head_dim;
  // Uniform in +-sqrt(3/cols) keeps each output at unit variance for unit inputs.
  auto s = [](int64_t cols) { return std::sqrt(3.0f / static_cast<float>(cols)); };
  m->token_embd = matrix(shape.vocab_size, d, 1.0f);
  m->output = m->token_embd;
  m->output_norm = norm();
  m->layers.resize(shape.num_layers);
  for (auto& l : m->layers) {
    l.attn_norm = norm();
    l.ffn_norm = norm();
    l.wq = matrix(q_dim, d, s(d));
    l.wk = matrix(kv_dim, d, s(d));
    l.wv = matrix(kv_dim, d, s(d));
    l.wo = matrix(d, q_dim, s(q_dim));
    l.w_gate = matrix(shape.ffn_dim, d, s(d));
    l.w_up = matrix(shape.ffn_dim, d, s(d));
    l.w_down = matrix(d, shape.ffn_dim, s(shape.ffn_dim));
  }
  check(cudaStreamSynchronize(stream), "synthetic weights");
  return m;
}

// ---------------------------------------------------------------- CudaRunner

struct CudaRunner::Step {
  int32_t rows = 0;        // token rows (padded for graphs)
  int32_t logit_rows = 0;
  int32_t seqs = 0;        // attention sequences (padded for graphs)
  bool decode = false;     // split-K kernel (every sequence feeds one token)
  int32_t splits = 0;
  int32_t num_work = 0;    // prefill work items
  bool sample = false;
  StepLayout lay;
};

CudaRunner::CudaRunner(std::shared_ptr<DeviceModel> model, const KvLayout& layout, int32_t max_batch_tokens,
                       int32_t max_context, const RunnerOptions& options, int device)
    : model_(std::move(model)), layout_(layout), max_rows_(std::max(1, max_batch_tokens)),
      max_context_(std::max(1, max_context)), options_(options), device_(device) {
  const ModelShape& s = model_->shape;
  if (!attention_supported(s.head_dim))
    throw std::runtime_error("backend cuda: head_dim " + std::to_string(s.head_dim) +
                             " is not supported by cuda-flash (64 or 128)");
  if (layout_.block_size <= 0 || layout_.num_blocks <= 0)
    throw std::runtime_error("backend cuda: empty KV layout");
  max_blocks_per_seq_ = (max_context_ + layout_.block_size - 1) / layout_.block_size;
  check(cudaSetDevice(device_), "cudaSetDevice");
  check(cudaDeviceGetAttribute(&num_sms_, cudaDevAttrMultiProcessorCount, device_), "device attributes");
  int major = 0;
  check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device_), "device attributes");
  // Programmatic dependent launch is a Hopper (sm_90) feature; older devices launch as usual.
  options_.programmatic_launch = options_.programmatic_launch && major >= 9;
  check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
  check_cublas(cublas().create(&cublas_), "cublasCreate");
  check_cublas(cublas().set_stream(cublas_, stream_), "cublasSetStream");
  // An explicit workspace: cuBLAS must not allocate while a graph is being captured.
  const size_t ws = 32ull << 20;
  check(cudaMalloc(&cublas_workspace_, ws), "cudaMalloc (cuBLAS workspace)");
  check_cublas(cublas().set_workspace(cublas_, cublas_workspace_, ws), "cublasSetWorkspace");

  const size_t elem = kv_dtype_size(layout_.k_dtype);
  layer_pool_bytes_ = static_cast<size_t>(layout_.num_blocks) * layout_.block_size * s.num_kv_heads *
                      s.head_dim * elem;
  kv_pool_bytes_ = 2 * layer_pool_bytes_ * s.num_layers;
  if (cudaMalloc(&kv_pool_, kv_pool_bytes_) != cudaSuccess) {
    cudaGetLastError();
    throw std::runtime_error("cannot allocate the KV pool: " + std::to_string(kv_pool_bytes_) +
                             " bytes on cuda:" + std::to_string(device_));
  }
  check(cudaMemset(kv_pool_, 0, kv_pool_bytes_), "cudaMemset (KV pool)");

  const size_t r = static_cast<size_t>(max_rows_);
  const size_t q_dim = static_cast<size_t>(s.num_heads) * s.head_dim;
  const size_t kv_dim = static_cast<size_t>(s.num_kv_heads) * s.head_dim;
  auto falloc = [&](size_t n) {
    void* p = nullptr;
    check(cudaMalloc(&p, sizeof(float) * std::max<size_t>(n, 4)), "cudaMalloc (scratch)");
    return static_cast<float*>(p);
  };
  x_ = falloc(r * s.embedding_dim);
  h_ = falloc(r * s.embedding_dim);
  q_ = falloc(r * q_dim);
  attn_ = falloc(r * q_dim);
  k_ = falloc(r * kv_dim);
  v_ = falloc(r * kv_dim);
  gate_ = falloc(r * s.ffn_dim);
  up_ = falloc(r * s.ffn_dim);
  logit_in_ = falloc(r * s.embedding_dim);
  const size_t widest = std::max({static_cast<size_t>(s.embedding_dim), q_dim, static_cast<size_t>(s.ffn_dim)});
  check(cudaMalloc(&act16_, 2 * r * widest), "cudaMalloc (GEMM activations)");
  size_t biggest_converted = 0;
  auto consider = [&](const DeviceMatrix& m) {
    if (m.format != kBF16 && m.format != kF16)
      biggest_converted = std::max(biggest_converted, static_cast<size_t>(m.rows * m.cols));
  };
  consider(model_->token_embd);
  consider(model_->output);
  for (const auto& l : model_->layers)
    for (const DeviceMatrix* m : {&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down}) consider(*m);
  if (biggest_converted > 0 && max_rows_ > std::max(8, options_.gemv_max_tokens))
    check(cudaMalloc(&weight16_, 2 * biggest_converted), "cudaMalloc (dequantized weight)");
  ensure_logit_rows(std::min(max_rows_, 64));
  ensure_staging(layout_for(max_rows_, std::min(max_rows_, 64), std::min(max_rows_, 64), 1, 0).total);
}

CudaRunner::~CudaRunner() {
  for (auto& [key, exec] : graphs_) cudaGraphExecDestroy(exec);
  if (stream_) cudaStreamSynchronize(stream_);
  for (void* p : {static_cast<void*>(x_), static_cast<void*>(h_), static_cast<void*>(q_),
                  static_cast<void*>(attn_), static_cast<void*>(k_), static_cast<void*>(v_),
                  static_cast<void*>(gate_), static_cast<void*>(up_), static_cast<void*>(logit_in_),
                  static_cast<void*>(logits_), static_cast<void*>(sampled_), act16_, weight16_,
                  decode_scratch_, static_cast<void*>(dev_staging_), kv_pool_, cublas_workspace_})
    if (p) cudaFree(p);
  if (host_staging_) cudaFreeHost(host_staging_);
  if (host_logits_) cudaFreeHost(host_logits_);
  if (host_tokens_) cudaFreeHost(host_tokens_);
  if (cublas_) cublas().destroy(cublas_);
  if (stream_) cudaStreamDestroy(stream_);
}

CudaRunner::StepLayout CudaRunner::layout_for(int32_t rows, int32_t logit_rows, int32_t seqs,
                                              int32_t table_stride, int32_t work) const {
  StepLayout l;
  size_t at = 0;
  auto take = [&](size_t bytes) {
    const size_t start = at;
    at = align_up(at + bytes, 16);
    return start;
  };
  l.tokens = take(4ull * rows);
  l.positions = take(4ull * rows);
  l.slots = take(4ull * rows);
  l.logit_rows = take(4ull * logit_rows);
  l.params = take(sizeof(SampleParams) * logit_rows);
  l.seqs = take(sizeof(AttnSeq) * seqs);
  l.tables = take(4ull * seqs * table_stride);
  l.work = take(sizeof(AttnWork) * work);
  l.table_stride = table_stride;
  l.total = at;
  return l;
}

void CudaRunner::ensure_staging(size_t bytes) {
  if (bytes <= staging_capacity_) return;
  // Captured graphs hold the old addresses: drop them.
  check(cudaStreamSynchronize(stream_), "staging");
  for (auto& [key, exec] : graphs_) cudaGraphExecDestroy(exec);
  graphs_.clear();
  if (host_staging_) cudaFreeHost(host_staging_);
  if (dev_staging_) cudaFree(dev_staging_);
  host_staging_ = nullptr;
  dev_staging_ = nullptr;
  const size_t cap = align_up(bytes + bytes / 2, 4096);
  check(cudaMallocHost(reinterpret_cast<void**>(&host_staging_), cap), "cudaMallocHost (staging)");
  check(cudaMalloc(reinterpret_cast<void**>(&dev_staging_), cap), "cudaMalloc (staging)");
  staging_capacity_ = cap;
}

void CudaRunner::ensure_logit_rows(int32_t rows) {
  if (rows <= logit_capacity_) return;
  check(cudaStreamSynchronize(stream_), "logits");
  for (auto& [key, exec] : graphs_) cudaGraphExecDestroy(exec);
  graphs_.clear();
  const int32_t cap = std::min(max_rows_, std::max(rows, 2 * logit_capacity_));
  const size_t n = static_cast<size_t>(cap) * model_->shape.vocab_size;
  if (logits_) cudaFree(logits_);
  if (sampled_) cudaFree(sampled_);
  if (host_logits_) cudaFreeHost(host_logits_);
  if (host_tokens_) cudaFreeHost(host_tokens_);
  check(cudaMalloc(reinterpret_cast<void**>(&logits_), sizeof(float) * n), "cudaMalloc (logits)");
  check(cudaMalloc(reinterpret_cast<void**>(&sampled_), sizeof(int32_t) * cap), "cudaMalloc (tokens)");
  check(cudaMallocHost(reinterpret_cast<void**>(&host_logits_), sizeof(float) * n), "cudaMallocHost (logits)");
  check(cudaMallocHost(reinterpret_cast<void**>(&host_tokens_), sizeof(int32_t) * cap), "cudaMallocHost (tokens)");
  logit_capacity_ = cap;
}

bool CudaRunner::use_gemv(const DeviceMatrix& w, int64_t ntok) const {
  if (options_.gemv_max_tokens >= 0) return ntok <= options_.gemv_max_tokens;
  const bool dense = w.format == kF32 || w.format == kF16 || w.format == kBF16;
  return ntok <= (dense ? 2 : 8);
}

void CudaRunner::matmul(const DeviceMatrix& w, const float* x, int64_t ntok, float* y, bool x_converted) {
  if (use_gemv(w, ntok)) {
    gemv(w.format, w.data, w.rows, w.cols, x, ntok, y, stream_);
    return;
  }
  // cuBLAS: y (col-major rows x ntok) = W^T (W is col-major cols x rows) * x (cols x ntok).
  const bool bf16 = w.format == kBF16;
  const void* w16 = w.data;
  if (w.format != kBF16 && w.format != kF16) {
    dequantize(w.format, w.data, w.rows, w.cols, weight16_, false, stream_);
    w16 = weight16_;
  }
  if (!x_converted) convert_f32(x, act16_, ntok * w.cols, bf16, stream_);
  const float one = 1.0f, zero = 0.0f;
  const cudaDataType_t t = bf16 ? CUDA_R_16BF : CUDA_R_16F;
  check_cublas(cublas().gemm_ex(cublas_, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(w.rows), static_cast<int>(ntok),
                            static_cast<int>(w.cols), &one, w16, t, static_cast<int>(w.cols), act16_, t,
                            static_cast<int>(w.cols), &zero, y, CUDA_R_32F, static_cast<int>(w.rows),
                            CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
               "cublasGemmEx");
}

void CudaRunner::add_projection(const DeviceMatrix& w, const float* in, int64_t n, bool fuse) {
  if (fuse && use_gemv(w, n)) {  // the residual added in the GEMV's epilogue
    const GemvTarget t{w.data, w.rows, x_, x_};
    gemv_multi(w.format, &t, 1, w.cols, in, n, stream_);
  } else {
    matmul(w, in, n, h_);
    add(x_, h_, n * w.rows, stream_);
  }
}

void CudaRunner::enqueue(const Step& st) {
  const ModelShape& s = model_->shape;
  const DeviceModel& m = *model_;
  check(cudaMemcpyAsync(dev_staging_, host_staging_, st.lay.total, cudaMemcpyHostToDevice, stream_),
        "upload step metadata");
  const auto* tokens = reinterpret_cast<const int32_t*>(dev_staging_ + st.lay.tokens);
  const auto* positions = reinterpret_cast<const int32_t*>(dev_staging_ + st.lay.positions);
  const auto* slots = reinterpret_cast<const int32_t*>(dev_staging_ + st.lay.slots);
  const auto* logit_rows = reinterpret_cast<const int32_t*>(dev_staging_ + st.lay.logit_rows);
  const auto* params = reinterpret_cast<const SampleParams*>(dev_staging_ + st.lay.params);
  const auto* seqs = reinterpret_cast<const AttnSeq*>(dev_staging_ + st.lay.seqs);
  const auto* work = reinterpret_cast<const AttnWork*>(dev_staging_ + st.lay.work);
  const int64_t n = st.rows;
  const int64_t d = s.embedding_dim;
  const int64_t q_dim = static_cast<int64_t>(s.num_heads) * s.head_dim;
  const int64_t kv_dim = static_cast<int64_t>(s.num_kv_heads) * s.head_dim;
  const bool f16 = layout_.k_dtype == KvDtype::kF16;
  const AttnShape sh{s.num_heads, s.num_kv_heads, s.head_dim, 1.0f / std::sqrt(static_cast<float>(s.head_dim)),
                     layout_.block_size, f16};

  embed_rows(x_, m.token_embd.data, m.token_embd.format, d, tokens, n, stream_);
  for (int32_t li = 0; li < s.num_layers; ++li) {
    const DeviceModel::Layer& w = m.layers[li];
    uint8_t* k_pool = static_cast<uint8_t*>(kv_pool_) + 2 * li * layer_pool_bytes_;
    uint8_t* v_pool = k_pool + layer_pool_bytes_;
    // Fused launches where every matmul of the group takes the GEMV path in one format; the
    // same bits either way (see gemv_multi in the SDK's cuda.h).
    const bool fuse = options_.fused_gemv;
    rms_norm(h_, x_, w.attn_norm, n, d, s.rms_eps, stream_);
    if (fuse && use_gemv(w.wq, n) && w.wk.format == w.wq.format && w.wv.format == w.wq.format) {
      const GemvTarget qkv[3] = {{w.wq.data, w.wq.rows, q_, nullptr},
                                 {w.wk.data, w.wk.rows, k_, nullptr},
                                 {w.wv.data, w.wv.rows, v_, nullptr}};
      gemv_multi(w.wq.format, qkv, 3, w.wq.cols, h_, n, stream_);
    } else {
      // On the cuBLAS path h_ is converted to 16 bits once for the three (same input, and
      // the same 16-bit type when the three formats match).
      const bool shared16 = !use_gemv(w.wq, n) && w.wk.format == w.wq.format && w.wv.format == w.wq.format;
      matmul(w.wq, h_, n, q_);
      matmul(w.wk, h_, n, k_, shared16);
      matmul(w.wv, h_, n, v_, shared16);
    }
    if (w.bq) add_bias(q_, w.bq, n, q_dim, stream_);
    if (w.bk) add_bias(k_, w.bk, n, kv_dim, stream_);
    if (w.bv) add_bias(v_, w.bv, n, kv_dim, stream_);
    rope_store_kv(q_, k_, v_, positions, slots, n, s.num_heads, s.num_kv_heads, s.head_dim, s.rope.rotary_dim,
                  s.rope.freq_base, s.rope.freq_scale, s.rope.neox, k_pool, v_pool, f16, stream_);
    if (st.decode)
      attention_decode(sh, seqs, st.seqs, st.splits, q_, k_pool, v_pool, attn_, decode_scratch_, stream_);
    else
      attention_prefill(sh, seqs, work, st.num_work, q_, k_pool, v_pool, attn_, stream_);
    add_projection(w.wo, attn_, n, fuse);
    rms_norm(h_, x_, w.ffn_norm, n, d, s.rms_eps, stream_);
    if (fuse && use_gemv(w.w_gate, n) && w.w_up.format == w.w_gate.format) {
      gemv_swiglu(w.w_gate.format, w.w_gate.data, w.w_up.data, w.w_gate.rows, w.w_gate.cols, h_, n, gate_, stream_);
    } else {
      const bool shared16 = !use_gemv(w.w_gate, n) && w.w_up.format == w.w_gate.format;
      matmul(w.w_gate, h_, n, gate_);
      matmul(w.w_up, h_, n, up_, shared16);
      silu_mul(gate_, up_, n * s.ffn_dim, stream_);
    }
    add_projection(w.w_down, gate_, n, fuse);
  }
  if (st.logit_rows == 0) return;
  gather_rows(logit_in_, x_, logit_rows, st.logit_rows, d, stream_);
  rms_norm(logit_in_, logit_in_, m.output_norm, st.logit_rows, d, s.rms_eps, stream_);
  matmul(m.output, logit_in_, st.logit_rows, logits_);
  if (st.sample) sample_rows(logits_, st.logit_rows, s.vocab_size, params, sampled_, stream_);
}

Status CudaRunner::forward(std::span<const ForwardSequence> sequences, std::vector<float>* logits) {
  return run(sequences, {}, logits, nullptr);
}

Status CudaRunner::forward_sample(std::span<const ForwardSequence> sequences,
                                  std::span<const DeviceSampleParams> params, std::vector<int32_t>* tokens) {
  return run(sequences, params, nullptr, tokens);
}

Status CudaRunner::run(std::span<const ForwardSequence> sequences, std::span<const DeviceSampleParams> params,
                       std::vector<float>* logits, std::vector<int32_t>* tokens) {
  const ModelShape& s = model_->shape;
  const bool sample = tokens != nullptr;
  int32_t num_rows = 0, num_logit_rows = 0, max_table = 1;
  bool all_decode = true;
  for (const auto& q : sequences) {
    if (q.num_tokens <= 0 || q.num_logit_rows < 0 || q.num_logit_rows > q.num_tokens)
      return invalid_argument("runner: a sequence must feed at least one token and request at most that many logit rows");
    const int32_t context = q.start_position + q.num_tokens;
    if (context > max_blocks_per_seq_ * layout_.block_size)
      return out_of_range("runner: context of " + std::to_string(context) + " tokens exceeds the engine's " +
                          std::to_string(max_context_));
    const int32_t blocks = (context + layout_.block_size - 1) / layout_.block_size;
    if (static_cast<int64_t>(q.block_table.size()) < blocks)
      return internal_error("runner: block table has " + std::to_string(q.block_table.size()) +
                            " blocks, context of " + std::to_string(context) + " tokens needs " +
                            std::to_string(blocks));
    for (int32_t i = 0; i < q.num_tokens; ++i)
      if (q.tokens[i] < 0 || q.tokens[i] >= s.vocab_size)
        return invalid_argument("token id " + std::to_string(q.tokens[i]) + " is outside the vocabulary (0.." +
                                std::to_string(s.vocab_size - 1) + ")");
    num_rows += q.num_tokens;
    num_logit_rows += q.num_logit_rows;
    max_table = std::max(max_table, blocks);
    all_decode = all_decode && q.num_tokens == 1 && q.num_logit_rows == 1;
  }
  if (num_rows == 0) return Status::ok();
  if (num_rows > max_rows_)
    return invalid_argument("runner: " + std::to_string(num_rows) + " tokens exceed max_batch_tokens " +
                            std::to_string(max_rows_));
  if (sample && static_cast<int32_t>(params.size()) != num_logit_rows)
    return invalid_argument("runner: one sampling parameter set per logit row is required");
  const int32_t group = s.num_heads / s.num_kv_heads;
  try {
    Step st;
    st.sample = sample;
    st.decode = all_decode && group <= kAttnRowsPerCta;
    const int32_t num_seqs = static_cast<int32_t>(sequences.size());
    const bool graph = options_.cuda_graphs && st.decode && num_seqs <= options_.graph_max_batch &&
                       next_pow2(num_seqs) <= max_rows_;
    st.seqs = graph ? next_pow2(num_seqs) : num_seqs;
    st.rows = graph ? st.seqs : num_rows;
    st.logit_rows = graph ? st.seqs : num_logit_rows;
    const int32_t stride = graph ? max_blocks_per_seq_ : max_table;

    host_seqs_.resize(st.seqs);
    int32_t row = 0;
    for (int32_t i = 0; i < num_seqs; ++i) {
      const auto& q = sequences[i];
      host_seqs_[i] = AttnSeq{row, q.num_tokens, q.start_position + q.num_tokens, 0, nullptr};
      row += q.num_tokens;
    }
    for (int32_t i = num_seqs; i < st.seqs; ++i) host_seqs_[i] = AttnSeq{i, 1, 0, 0, nullptr};
    if (!st.decode) {
      const AttnShape sh{s.num_heads, s.num_kv_heads, s.head_dim, 0.0f, layout_.block_size, false};
      st.num_work = count_prefill_work(sh, host_seqs_.data(), num_seqs);
      host_work_.resize(st.num_work);
      plan_prefill(sh, host_seqs_.data(), num_seqs, host_work_.data());
    }
    st.lay = layout_for(st.rows, st.logit_rows, st.seqs, stride, st.num_work);
    ensure_staging(st.lay.total);
    ensure_logit_rows(st.logit_rows);
    if (st.decode) {
      st.splits = options_.decode_splits > 0
                      ? options_.decode_splits
                      : choose_decode_splits(AttnShape{s.num_heads, s.num_kv_heads, s.head_dim, 0.0f,
                                                       layout_.block_size, false},
                                             st.seqs, max_context_, num_sms_);
      const size_t need = decode_scratch_bytes(AttnShape{s.num_heads, s.num_kv_heads, s.head_dim, 0.0f,
                                                         layout_.block_size, false},
                                               st.seqs, st.splits);
      if (need > decode_scratch_bytes_) {
        check(cudaStreamSynchronize(stream_), "decode scratch");
        for (auto& [key, exec] : graphs_) cudaGraphExecDestroy(exec);
        graphs_.clear();
        if (decode_scratch_) cudaFree(decode_scratch_);
        check(cudaMalloc(&decode_scratch_, need), "cudaMalloc (decode scratch)");
        decode_scratch_bytes_ = need;
      }
    }

    // Host staging: the transfer of a previous step reading it must be complete.
    check(cudaStreamSynchronize(stream_), "previous step");
    uint8_t* h = host_staging_;
    auto* tok = reinterpret_cast<int32_t*>(h + st.lay.tokens);
    auto* pos = reinterpret_cast<int32_t*>(h + st.lay.positions);
    auto* slot = reinterpret_cast<int32_t*>(h + st.lay.slots);
    auto* lrow = reinterpret_cast<int32_t*>(h + st.lay.logit_rows);
    auto* prm = reinterpret_cast<SampleParams*>(h + st.lay.params);
    auto* hseq = reinterpret_cast<AttnSeq*>(h + st.lay.seqs);
    auto* tables = reinterpret_cast<int32_t*>(h + st.lay.tables);
    auto* hwork = reinterpret_cast<AttnWork*>(h + st.lay.work);
    std::memset(tables, 0, 4ull * st.seqs * stride);
    row = 0;
    int32_t out_row = 0;
    for (int32_t i = 0; i < num_seqs; ++i) {
      const auto& q = sequences[i];
      const int32_t context = q.start_position + q.num_tokens;
      const int32_t blocks = (context + layout_.block_size - 1) / layout_.block_size;
      std::memcpy(tables + static_cast<size_t>(i) * stride, q.block_table.data(), 4ull * blocks);
      for (int32_t t = 0; t < q.num_tokens; ++t, ++row) {
        const int32_t p = q.start_position + t;
        tok[row] = q.tokens[t];
        pos[row] = p;
        slot[row] = q.block_table[p / layout_.block_size] * layout_.block_size + p % layout_.block_size;
      }
      for (int32_t t = q.num_tokens - q.num_logit_rows; t < q.num_tokens; ++t, ++out_row)
        lrow[out_row] = row - q.num_tokens + t;
    }
    for (; row < st.rows; ++row) {  // graph padding: token 0 at position 0, K/V not stored
      tok[row] = 0;
      pos[row] = 0;
      slot[row] = -1;
    }
    for (; out_row < st.logit_rows; ++out_row) lrow[out_row] = out_row;
    for (int32_t i = 0; i < st.logit_rows; ++i)
      prm[i] = (sample && i < num_logit_rows) ? params[i] : SampleParams{};
    for (int32_t i = 0; i < st.seqs; ++i) {
      hseq[i] = host_seqs_[i];
      hseq[i].block_table = reinterpret_cast<const int32_t*>(dev_staging_ + st.lay.tables) +
                            static_cast<size_t>(i) * stride;
    }
    if (st.num_work > 0) std::memcpy(hwork, host_work_.data(), sizeof(AttnWork) * st.num_work);

    // Launch mode of this thread's kernels while the step is enqueued (restored after).
    struct LaunchMode {
      bool before = programmatic_launch();
      explicit LaunchMode(bool on) { set_programmatic_launch(on); }
      ~LaunchMode() { set_programmatic_launch(before); }
    } launch_mode(options_.programmatic_launch);
    if (graph) {
      const auto key = std::make_pair(st.seqs, sample);
      auto it = graphs_.find(key);
      if (it == graphs_.end()) {
        cudaGraph_t g = nullptr;
        check(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal), "cudaStreamBeginCapture");
        try {
          enqueue(st);
        } catch (...) {
          cudaStreamEndCapture(stream_, &g);
          if (g) cudaGraphDestroy(g);
          throw;
        }
        check(cudaStreamEndCapture(stream_, &g), "cudaStreamEndCapture");
        cudaGraphExec_t exec = nullptr;
        const cudaError_t err = cudaGraphInstantiate(&exec, g, 0);
        cudaGraphDestroy(g);
        check(err, "cudaGraphInstantiate");
        it = graphs_.emplace(key, exec).first;
      } else {
        ++graph_replays_;
      }
      check(cudaGraphLaunch(it->second, stream_), "cudaGraphLaunch");
    } else {
      enqueue(st);
    }

    if (sample) {
      check(cudaMemcpyAsync(host_tokens_, sampled_, sizeof(int32_t) * num_logit_rows, cudaMemcpyDeviceToHost,
                            stream_),
            "download tokens");
      check(cudaStreamSynchronize(stream_), "forward");
      tokens->assign(host_tokens_, host_tokens_ + num_logit_rows);
    } else if (num_logit_rows > 0) {
      const size_t n = static_cast<size_t>(num_logit_rows) * s.vocab_size;
      check(cudaMemcpyAsync(host_logits_, logits_, sizeof(float) * n, cudaMemcpyDeviceToHost, stream_),
            "download logits");
      check(cudaStreamSynchronize(stream_), "forward");
      if (logits->size() < n) logits->resize(n);
      std::memcpy(logits->data(), host_logits_, sizeof(float) * n);
    } else {
      check(cudaStreamSynchronize(stream_), "forward");
    }
  } catch (const std::exception& e) {
    return internal_error(std::string("backend cuda: ") + e.what());
  }
  return Status::ok();
}

void CudaRunner::copy_blocks(std::span<const BlockCopy> copies) {
  if (copies.empty()) return;
  std::vector<int32_t> pairs;
  for (const BlockCopy& c : copies) {
    pairs.push_back(c.src);
    pairs.push_back(c.dst);
  }
  int32_t* dev = nullptr;
  check(cudaMalloc(reinterpret_cast<void**>(&dev), 4 * pairs.size()), "cudaMalloc (block copies)");
  check(cudaMemcpyAsync(dev, pairs.data(), 4 * pairs.size(), cudaMemcpyHostToDevice, stream_), "block copies");
  const ModelShape& s = model_->shape;
  const size_t block_bytes = static_cast<size_t>(layout_.block_size) * s.num_kv_heads * s.head_dim *
                             kv_dtype_size(layout_.k_dtype);
  for (int32_t l = 0; l < 2 * s.num_layers; ++l)
    tessera::cuda::copy_blocks(static_cast<uint8_t*>(kv_pool_) + l * layer_pool_bytes_, dev,
                               static_cast<int32_t>(copies.size()), block_bytes, stream_);
  check(cudaStreamSynchronize(stream_), "block copies");
  cudaFree(dev);
}

}  // namespace tessera::cuda
