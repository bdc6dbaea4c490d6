// The SDK's CUDA kernel helpers: host-callable launchers of the device kernels, implemented in
// core/src/kernels/cuda/*.cu and compiled once into the static library tessera_cuda_kernels,
// installed with the SDK (where the SDK was built with a CUDA toolkit) and exported by its
// package config as tessera::cuda_kernels. backend.cuda, attention.cuda-flash, the CUDA tests
// and the benchmark link it; a third party's CUDA plugin links the same code. Kernels version
// (tessera/sdk/kernels/version.h) 1.1 added this header. Every launcher is asynchronous on
// `stream`; all pointers are device pointers unless a parameter says otherwise. Activations
// are f32 throughout. Needs <cuda_runtime_api.h> (CUDA::cudart, linked by the library).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace tessera::cuda {

// Weight formats, numbered as GGML types (the GGUF ids).
enum WeightFormat : uint32_t {
  kF32 = 0, kF16 = 1, kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8, kBF16 = 30,
};
bool format_supported(uint32_t ggml_type);
size_t format_row_bytes(uint32_t format, int64_t cols);  // cols a multiple of the block size
int64_t format_block_elems(uint32_t format);

// Throws std::runtime_error("<what>: <cuda error string>") when err != cudaSuccess.
void check(cudaError_t err, const char* what);
// The last launch error (cudaGetLastError), checked.
void check_launch(const char* what);

// Programmatic dependent launch (kernels 1.4, sm_90): while enabled on the calling thread,
// gemv, gemv_multi, gemv_swiglu, rms_norm, rope_store_kv, attention_decode, gather_rows and
// sample_rows launch with CUDA's
// programmatic-stream-serialization attribute, so each may be scheduled while the kernel
// before it drains (they wait for its results before reading them). Off by default; results
// are the same bits either way. Works inside stream capture (CUDA graphs).
void set_programmatic_launch(bool enabled);
bool programmatic_launch();

// ---- element-wise (elementwise.cu) ----
// out[r] = in[r] / rms(in[r]) * weight; in == out allowed.
void rms_norm(float* out, const float* in, const float* weight, int64_t rows, int64_t dim,
              float eps, cudaStream_t stream);
// RoPE in place on rows of num_heads * head_dim floats; pair-adjacent or NeoX halves, with the
// CPU backend's float recurrence for theta so angles round alike.
void rope(float* x, const int32_t* positions, int64_t rows, int32_t num_heads, int32_t head_dim,
          int32_t rotary_dim, float freq_base, float freq_scale, bool neox, cudaStream_t stream);
void silu_mul(float* gate, const float* up, int64_t n, cudaStream_t stream);
void add(float* inout, const float* x, int64_t n, cudaStream_t stream);
// y[r][i] += bias[i] for r < rows.
void add_bias(float* y, const float* bias, int64_t rows, int64_t n, cudaStream_t stream);
// pool[slots[r]] = src[r] (row_elems each) in f16 or f32; rows with slots[r] < 0 are skipped.
void store_kv(void* pool, bool f16, const float* src, const int32_t* slots, int64_t rows,
              int64_t row_elems, cudaStream_t stream);
// The K/V half of an attention layer's input in one launch (kernels 1.4): rope() on q
// (num_heads) and k (num_kv_heads) in place, then store_kv() of k into k_pool and v into
// v_pool; the same values as those four calls.
void rope_store_kv(float* q, float* k, const float* v, const int32_t* positions,
                   const int32_t* slots, int64_t rows, int32_t num_heads, int32_t num_kv_heads,
                   int32_t head_dim, int32_t rotary_dim, float freq_base, float freq_scale,
                   bool neox, void* k_pool, void* v_pool, bool f16, cudaStream_t stream);
// out[i] = dequantized row tokens[i] of `table` ([vocab][cols] in `format`).
void embed_rows(float* out, const void* table, uint32_t format, int64_t cols,
                const int32_t* tokens, int64_t n, cudaStream_t stream);
// out[i] = in[rows[i]] (dim floats each).
void gather_rows(float* out, const float* in, const int32_t* rows, int64_t n, int64_t dim,
                 cudaStream_t stream);
// Copies whole blocks inside a pool: pairs[2i] -> pairs[2i+1], each `block_bytes`.
void copy_blocks(void* pool, const int32_t* pairs, int32_t n, size_t block_bytes,
                 cudaStream_t stream);
// Fills n elements with uniform values in [-scale, scale] (hash of seed and index) as
// f32 (format kF32), f16 or bf16: synthetic weights for benchmarks.
void fill_random(void* dst, uint32_t format, int64_t n, float scale, uint64_t seed,
                 cudaStream_t stream);

// ---- sampling (elementwise.cu) ----
// Per row: temperature <= 0 is greedy (argmax, lowest index on ties). Otherwise softmax of
// logits / temperature restricted to the top_k largest (0: all) and then to the smallest
// prefix of the descending distribution whose mass reaches top_p; `uniform` in [0, 1) picks
// the token by inverse CDF in token-id order over the kept candidates. Thresholds are found by
// bisection, so tokens tied exactly at the top-k boundary are all kept.
struct SampleParams {
  float temperature = 0.0f;
  int32_t top_k = 0;
  float top_p = 1.0f;
  float uniform = 0.0f;
};
void sample_rows(const float* logits, int64_t rows, int32_t vocab, const SampleParams* params,
                 int32_t* out_tokens, cudaStream_t stream);

// ---- matmul (matmul.cu) ----
// y[t][r] = sum_c W[r][c] * x[t][c], W in `format` ([rows][cols], GGUF row-major), t < ntok.
// Weight-only GEMV: one warp per output row, up to 8 tokens per launch (larger counts are
// split into runs of 8, 4, 2, 1); any ntok works, but the activation reads grow with ntok:
// see backend.cuda's README for where the cuBLAS path wins per format.
void gemv(uint32_t format, const void* w, int64_t rows, int64_t cols, const float* x,
          int64_t ntok, float* y, cudaStream_t stream);
// Fused GEMVs for decode steps (kernels 1.4). Each target's sums equal gemv()'s bit for bit
// (same per-lane order and warp reduction); they only save launches and activation reads.
// gemv_multi: one launch over up to kGemvMaxTargets matrices of one format and column count
// (a Q/K/V projection), y_s[t][r] = residual_s[t][r] + W_s[r] . x[t] where residual_s is set
// (it may equal y_s: the output projection adding into the residual stream), else W_s[r] . x[t].
inline constexpr int kGemvMaxTargets = 3;
struct GemvTarget {
  const void* w = nullptr;
  int64_t rows = 0;
  float* y = nullptr;                // [ntok][rows]
  const float* residual = nullptr;   // [ntok][rows] or nullptr
};
void gemv_multi(uint32_t format, const GemvTarget* targets, int32_t num_targets, int64_t cols,
                const float* x, int64_t ntok, cudaStream_t stream);
// SwiGLU gate and up projections in one pass: y[t][r] = silu(Wg[r] . x[t]) * (Wu[r] . x[t]),
// equal to gemv() twice followed by silu_mul().
void gemv_swiglu(uint32_t format, const void* w_gate, const void* w_up, int64_t rows, int64_t cols,
                 const float* x, int64_t ntok, float* y, cudaStream_t stream);
// Dequantizes W into half (to_bf16 false) or bfloat16 (to_bf16 true): the GEMM path.
void dequantize(uint32_t format, const void* w, int64_t rows, int64_t cols, void* dst,
                bool to_bf16, cudaStream_t stream);
// f32 -> half / bfloat16.
void convert_f32(const float* src, void* dst, int64_t n, bool to_bf16, cudaStream_t stream);

// ---- attention (attention.cu) ----
// One sequence of an attention batch, in device memory. Query rows q[query_start ..
// query_start + num_queries) are the last num_queries of context_len tokens; block_table is a
// device pointer to ceil(context_len / block_size) block ids.
struct AttnSeq {
  int32_t query_start;
  int32_t num_queries;
  int32_t context_len;
  int32_t reserved;
  const int32_t* block_table;
};
struct AttnShape {
  int32_t num_heads;
  int32_t num_kv_heads;
  int32_t head_dim;     // 64, 128 (other sizes: not supported, see attention_supported)
  float scale;
  int32_t block_size;
  bool kv_f16;
};
bool attention_supported(int32_t head_dim);
// A work item of the prefill kernel (built on the host by plan_prefill).
struct AttnWork {
  int32_t seq;          // index into seqs
  int32_t first_query;  // relative to the sequence's queries
  int32_t num_queries;  // query positions of this item
  int32_t head_begin;   // first query head (a run of heads sharing one KV head)
  int32_t num_heads;
};
// Rows per CTA of the prefill kernel (query positions x heads of one KV head).
inline constexpr int kAttnRowsPerCta = 16;
// Number of work items plan_prefill writes for these sequences (host data).
int32_t count_prefill_work(const AttnShape& shape, const AttnSeq* host_seqs, int32_t num_seqs);
// Writes the work items into host memory `work` (count_prefill_work entries).
void plan_prefill(const AttnShape& shape, const AttnSeq* host_seqs, int32_t num_seqs, AttnWork* work);
// Tiled online-softmax attention for any mix of prompt chunks and decode rows. q/out:
// [rows][num_heads][head_dim] f32; pools: [blocks][block_size][num_kv_heads][head_dim].
void attention_prefill(const AttnShape& shape, const AttnSeq* seqs, const AttnWork* work,
                       int32_t num_work, const float* q,
                       const void* k_pool, const void* v_pool, float* out, cudaStream_t stream);
// Split-K (flash-decoding) attention for num_seqs sequences of exactly one query each (the
// query row of sequence i is seqs[i].query_start). Each (sequence, KV head) is split into
// num_splits chunks of the context computed in parallel, then combined. scratch must hold
// decode_scratch_bytes(shape, num_seqs, num_splits). Sequences with context_len 0 produce
// zeros (padding rows of a captured graph).
size_t decode_scratch_bytes(const AttnShape& shape, int32_t num_seqs, int32_t num_splits);
int32_t choose_decode_splits(const AttnShape& shape, int32_t num_seqs, int32_t max_context,
                             int32_t num_sms);
void attention_decode(const AttnShape& shape, const AttnSeq* seqs, int32_t num_seqs,
                      int32_t num_splits, const float* q,
                      const void* k_pool, const void* v_pool, float* out, void* scratch,
                      cudaStream_t stream);

// ---- memory bandwidth probe (matmul.cu) ----
// Reads n bytes (a multiple of 16) and writes one value per CTA to sink (kProbeBlocks
// floats): used by the
// benchmark to measure achievable HBM read bandwidth.
inline constexpr int kProbeBlocks = 2048;
void read_bandwidth_probe(const void* src, size_t n, float* sink, cudaStream_t stream);

}  // namespace tessera::cuda
