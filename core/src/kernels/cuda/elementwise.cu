// Element-wise kernels of the forward pass, embedding gather, block copies and sampling.
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <stdexcept>
#include <string>

#include "common.cuh"

namespace tessera::cuda {

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(err));
}
void check_launch(const char* what) { check(cudaGetLastError(), what); }

namespace {
thread_local bool programmatic_launch_enabled = false;
}
void set_programmatic_launch(bool enabled) { programmatic_launch_enabled = enabled; }
bool programmatic_launch() { return programmatic_launch_enabled; }

bool format_supported(uint32_t t) {
  return t == kF32 || t == kF16 || t == kBF16 || t == kQ4_0 || t == kQ4_1 || t == kQ8_0;
}
int64_t format_block_elems(uint32_t t) { return (t == kQ4_0 || t == kQ4_1 || t == kQ8_0) ? 32 : 1; }
size_t format_row_bytes(uint32_t t, int64_t cols) {
  switch (t) {
    case kF32: return 4 * cols;
    case kF16: case kBF16: return 2 * cols;
    case kQ4_0: return cols / 32 * 18;
    case kQ4_1: return cols / 32 * 20;
    case kQ8_0: return cols / 32 * 34;
  }
  return 0;
}

namespace {

// One CTA per row. Sum of squares in double like the CPU backend; products rounded to float
// first (no FMA contraction) so the norm matches it closely. Rows whose length is a multiple
// of 4 are read as float4 (one load in flight per 4 elements instead of 4 dependent ones).
__global__ void rms_norm_kernel(float* out, const float* in, const float* weight, int64_t dim,
                                float eps) {
  __shared__ double shared[32];
  allow_dependent_launch();
  grid_dependency_wait();
  const float* x = in + blockIdx.x * dim;
  float* y = out + blockIdx.x * dim;
  const bool vec = dim % 4 == 0;
  double sum = 0.0;
  if (vec) {
    for (int64_t i = threadIdx.x; i < dim / 4; i += blockDim.x) {
      const float4 v = reinterpret_cast<const float4*>(x)[i];
      sum += static_cast<double>(__fmul_rn(v.x, v.x)) + static_cast<double>(__fmul_rn(v.y, v.y)) +
             static_cast<double>(__fmul_rn(v.z, v.z)) + static_cast<double>(__fmul_rn(v.w, v.w));
    }
  } else {
    for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) sum += static_cast<double>(__fmul_rn(x[i], x[i]));
  }
  sum = block_reduce(sum, shared, [](double a, double b) { return a + b; }, 0.0);
  const float mean = static_cast<float>(sum / static_cast<double>(dim));
  const float scale = 1.0f / sqrtf(mean + eps);
  if (vec) {
    for (int64_t i = threadIdx.x; i < dim / 4; i += blockDim.x) {
      const float4 v = reinterpret_cast<const float4*>(x)[i];
      const float4 w = reinterpret_cast<const float4*>(weight)[i];
      reinterpret_cast<float4*>(y)[i] =
          make_float4(__fmul_rn(__fmul_rn(v.x, scale), w.x), __fmul_rn(__fmul_rn(v.y, scale), w.y),
                      __fmul_rn(__fmul_rn(v.z, scale), w.z), __fmul_rn(__fmul_rn(v.w, scale), w.w));
    }
  } else {
    for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) y[i] = __fmul_rn(__fmul_rn(x[i], scale), weight[i]);
  }
}

// Rotates pair i of one head vector v at position pos. theta follows the CPU's float
// recurrence theta_{i+1} = theta_i * theta_scale so angles round alike.
__device__ __forceinline__ void rope_pair(float* v, int32_t i, int32_t pos, int32_t rot, float theta_scale,
                                          float freq_scale, bool neox) {
  float theta = __fmul_rn(static_cast<float>(pos), freq_scale);
  for (int32_t k = 0; k < i; ++k) theta = __fmul_rn(theta, theta_scale);
  const float c = cosf(theta);
  const float s = sinf(theta);
  const int32_t a = neox ? i : 2 * i;
  const int32_t b = neox ? i + rot / 2 : 2 * i + 1;
  const float x0 = v[a];
  const float x1 = v[b];
  v[a] = fmaf(x0, c, -__fmul_rn(x1, s));
  v[b] = fmaf(x0, s, __fmul_rn(x1, c));
}

// One thread per (row, head, pair).
__global__ void rope_kernel(float* x, const int32_t* positions, int64_t rows, int32_t num_heads,
                            int32_t head_dim, int32_t rot, float theta_scale, float freq_scale,
                            bool neox) {
  const int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const int32_t pairs = rot / 2;
  const int64_t total = rows * num_heads * pairs;
  if (idx >= total) return;
  const int32_t i = static_cast<int32_t>(idx % pairs);
  const int64_t rh = idx / pairs;
  const int32_t h = static_cast<int32_t>(rh % num_heads);
  const int64_t r = rh / num_heads;
  rope_pair(x + (r * num_heads + h) * head_dim, i, positions[r], rot, theta_scale, freq_scale, neox);
}

// dst element `offset` onward = src[0 .. n), as f16 or f32.
__device__ __forceinline__ void store_slice(void* pool, bool f16, const float* s, int64_t offset, int64_t n) {
  if (f16) {
    __half* d = static_cast<__half*>(pool) + offset;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) d[i] = __float2half_rn(s[i]);
  } else {
    float* d = static_cast<float*>(pool) + offset;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) d[i] = s[i];
  }
}

// One CTA per (token row, head): query heads are rotated in place; a KV head is rotated, then
// (the head complete) its K and V slices are written to the pools.
__global__ void rope_store_kv_kernel(float* q, float* k, const float* v, const int32_t* positions,
                                     const int32_t* slots, int32_t num_heads, int32_t num_kv_heads,
                                     int32_t head_dim, int32_t rot, float theta_scale, float freq_scale,
                                     bool neox, void* k_pool, void* v_pool, bool f16) {
  const int64_t r = blockIdx.x;
  const int32_t h = blockIdx.y;
  allow_dependent_launch();
  grid_dependency_wait();
  const int32_t pos = positions[r];
  const int64_t kv_dim = static_cast<int64_t>(num_kv_heads) * head_dim;
  float* vec = h < num_heads ? q + (r * num_heads + h) * head_dim : k + r * kv_dim + (h - num_heads) * head_dim;
  for (int32_t i = threadIdx.x; i < rot / 2; i += blockDim.x)
    rope_pair(vec, i, pos, rot, theta_scale, freq_scale, neox);
  if (h < num_heads) return;
  const int32_t slot = slots[r];
  if (slot < 0) return;  // uniform per CTA: no thread reaches the barrier below
  __syncthreads();
  const int64_t kh = h - num_heads;
  const int64_t offset = static_cast<int64_t>(slot) * kv_dim + kh * head_dim;
  store_slice(k_pool, f16, vec, offset, head_dim);
  store_slice(v_pool, f16, v + r * kv_dim + kh * head_dim, offset, head_dim);
}

__global__ void silu_mul_kernel(float* gate, const float* up, int64_t n) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  const float g = gate[i];
  gate[i] = __fmul_rn(__fdiv_rn(g, 1.0f + expf(-g)), up[i]);
}

__global__ void add_kernel(float* inout, const float* x, int64_t n) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n) inout[i] += x[i];
}

__global__ void add_bias_kernel(float* y, const float* bias, int64_t rows, int64_t n) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < rows * n) y[i] += bias[i % n];
}

__global__ void store_kv_kernel(void* pool, bool f16, const float* src, const int32_t* slots,
                                int64_t row_elems) {
  const int64_t r = blockIdx.x;
  const int32_t slot = slots[r];
  if (slot < 0) return;
  store_slice(pool, f16, src + r * row_elems, static_cast<int64_t>(slot) * row_elems, row_elems);
}

__global__ void embed_kernel(float* out, const uint8_t* table, uint32_t format, size_t row_bytes,
                             int64_t cols, const int32_t* tokens) {
  const uint8_t* row = table + static_cast<size_t>(tokens[blockIdx.x]) * row_bytes;
  float* y = out + blockIdx.x * cols;
  for (int64_t i = threadIdx.x; i < cols; i += blockDim.x) y[i] = load_element(format, row, i);
}

__global__ void gather_kernel(float* out, const float* in, const int32_t* rows, int64_t dim) {
  allow_dependent_launch();
  grid_dependency_wait();
  const float* x = in + static_cast<int64_t>(rows[blockIdx.x]) * dim;
  float* y = out + blockIdx.x * dim;
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) y[i] = x[i];
}

__global__ void copy_blocks_kernel(uint8_t* pool, const int32_t* pairs, size_t block_bytes) {
  const uint4* src = reinterpret_cast<const uint4*>(pool + pairs[2 * blockIdx.x] * block_bytes);
  uint4* dst = reinterpret_cast<uint4*>(pool + pairs[2 * blockIdx.x + 1] * block_bytes);
  for (size_t i = threadIdx.x; i < block_bytes / 16; i += blockDim.x) dst[i] = src[i];
}

__device__ __forceinline__ uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

__global__ void fill_random_kernel(void* dst, uint32_t format, int64_t n, float scale, uint64_t seed) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const uint64_t h = mix64(seed * 0x9e3779b97f4a7c15ull + static_cast<uint64_t>(i));
    const float u = static_cast<float>(h >> 40) * (1.0f / 16777216.0f);  // [0, 1)
    const float v = (2.0f * u - 1.0f) * scale;
    if (format == kF32) static_cast<float*>(dst)[i] = v;
    else if (format == kF16) static_cast<__half*>(dst)[i] = __float2half_rn(v);
    else static_cast<__nv_bfloat16*>(dst)[i] = __float2bfloat16_rn(v);
  }
}

// ---- sampling: one CTA (kSampleThreads) per row ----
constexpr int kSampleThreads = 1024;

struct ArgMax { float v; int32_t i; };

__global__ void sample_kernel(const float* logits_all, int32_t vocab, const SampleParams* params_all,
                              int32_t* out) {
  __shared__ float sf[32];
  __shared__ int32_t si[32];
  __shared__ double sd[32];
  __shared__ double prefix[kSampleThreads];
  allow_dependent_launch();
  grid_dependency_wait();
  const float* logits = logits_all + static_cast<int64_t>(blockIdx.x) * vocab;
  const SampleParams p = params_all[blockIdx.x];
  const int tid = threadIdx.x;

  // Argmax, lowest index on ties (each thread visits its indices in increasing order and keeps
  // the first maximum; the reduction below prefers the lower index). A vocabulary that is a
  // multiple of 4 is read as float4, two loads in flight per iteration.
  float best = -INFINITY;
  int32_t best_i = vocab;
  auto visit = [&](float v, int32_t i) {
    if (v > best) { best = v; best_i = i; }
  };
  if (vocab % 4 == 0) {
    const float4* l4 = reinterpret_cast<const float4*>(logits);
    const int32_t n4 = vocab / 4;
    int32_t j = tid;
    for (; j + static_cast<int32_t>(blockDim.x) < n4; j += 2 * blockDim.x) {
      const float4 a = l4[j], b = l4[j + blockDim.x];
      visit(a.x, 4 * j); visit(a.y, 4 * j + 1); visit(a.z, 4 * j + 2); visit(a.w, 4 * j + 3);
      const int32_t k = j + blockDim.x;
      visit(b.x, 4 * k); visit(b.y, 4 * k + 1); visit(b.z, 4 * k + 2); visit(b.w, 4 * k + 3);
    }
    for (; j < n4; j += blockDim.x) {
      const float4 a = l4[j];
      visit(a.x, 4 * j); visit(a.y, 4 * j + 1); visit(a.z, 4 * j + 2); visit(a.w, 4 * j + 3);
    }
  } else {
    for (int32_t i = tid; i < vocab; i += blockDim.x) visit(logits[i], i);
  }
  {
    const int lane = tid & 31, warp = tid >> 5;
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, best, o);
      const int32_t oi = __shfl_xor_sync(0xffffffffu, best_i, o);
      if (ov > best || (ov == best && oi < best_i)) { best = ov; best_i = oi; }
    }
    if (lane == 0) { sf[warp] = best; si[warp] = best_i; }
    __syncthreads();
    best = lane < (blockDim.x >> 5) ? sf[lane] : -INFINITY;
    best_i = lane < (blockDim.x >> 5) ? si[lane] : vocab;
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, best, o);
      const int32_t oi = __shfl_xor_sync(0xffffffffu, best_i, o);
      if (ov > best || (ov == best && oi < best_i)) { best = ov; best_i = oi; }
    }
  }
  if (p.temperature <= 0.0f || best_i >= vocab) {
    if (tid == 0) out[blockIdx.x] = best_i < vocab ? best_i : 0;
    return;
  }
  const float max_logit = best;
  const float inv_t = 1.0f / p.temperature;
  auto prob = [&](int32_t i) { return expf((logits[i] - max_logit) * inv_t); };

  // Top-k: the largest logit threshold t with count(logit >= t) >= k, by bisection.
  float keep_logit = -INFINITY;
  if (p.top_k > 0 && p.top_k < vocab) {
    float mn = INFINITY;
    for (int32_t i = tid; i < vocab; i += blockDim.x) mn = fminf(mn, logits[i]);
    mn = block_reduce(mn, sf, [](float a, float b) { return fminf(a, b); }, INFINITY);
    float lo = mn, hi = max_logit;  // count(>= lo) >= k always; find the largest such value
    for (int it = 0; it < 48 && lo < hi; ++it) {
      const float mid = lo + (hi - lo) * 0.5f;
      if (mid <= lo || mid >= hi) break;
      int32_t cnt = 0;
      for (int32_t i = tid; i < vocab; i += blockDim.x) cnt += logits[i] >= mid;
      cnt = block_reduce(cnt, si, [](int32_t a, int32_t b) { return a + b; }, 0);
      if (cnt >= p.top_k) lo = mid; else hi = mid;
    }
    // hi may itself keep >= k (when the loop ended on float resolution).
    int32_t cnt_hi = 0;
    for (int32_t i = tid; i < vocab; i += blockDim.x) cnt_hi += logits[i] >= hi;
    cnt_hi = block_reduce(cnt_hi, si, [](int32_t a, int32_t b) { return a + b; }, 0);
    keep_logit = cnt_hi >= p.top_k ? hi : lo;
  }

  // Mass of the kept candidates.
  double total = 0.0;
  for (int32_t i = tid; i < vocab; i += blockDim.x)
    if (logits[i] >= keep_logit) total += prob(i);
  total = block_reduce(total, sd, [](double a, double b) { return a + b; }, 0.0);

  // Top-p: the largest probability threshold q whose kept mass still reaches top_p.
  float keep_prob = 0.0f;
  if (p.top_p < 1.0f) {
    const double target = static_cast<double>(p.top_p) * total;
    float lo = 0.0f, hi = 1.0f;  // mass(>= 0) = total >= target; the max token has prob 1
    for (int it = 0; it < 40; ++it) {
      const float mid = 0.5f * (lo + hi);
      double m = 0.0;
      for (int32_t i = tid; i < vocab; i += blockDim.x)
        if (logits[i] >= keep_logit) { const float q = prob(i); if (q >= mid) m += q; }
      m = block_reduce(m, sd, [](double a, double b) { return a + b; }, 0.0);
      if (m >= target) lo = mid; else hi = mid;
    }
    keep_prob = lo;
    total = 0.0;
    for (int32_t i = tid; i < vocab; i += blockDim.x)
      if (logits[i] >= keep_logit) { const float q = prob(i); if (q >= keep_prob) total += q; }
    total = block_reduce(total, sd, [](double a, double b) { return a + b; }, 0.0);
  }

  // Inverse CDF in token-id order: contiguous chunks per thread, exclusive scan of chunk sums.
  const int32_t chunk = (vocab + blockDim.x - 1) / blockDim.x;
  const int32_t begin = min(vocab, tid * chunk), end = min(vocab, begin + chunk);
  double mine = 0.0;
  int32_t last_kept = -1;
  for (int32_t i = begin; i < end; ++i)
    if (logits[i] >= keep_logit) {
      const float q = prob(i);
      if (q >= keep_prob) { mine += q; last_kept = i; }
    }
  prefix[tid] = mine;
  __syncthreads();
  if (tid == 0) {
    double run = 0.0;
    for (int t = 0; t < static_cast<int>(blockDim.x); ++t) { const double v = prefix[t]; prefix[t] = run; run += v; }
  }
  __syncthreads();
  const double target = static_cast<double>(p.uniform) * total;
  int32_t chosen = -1;
  if (mine > 0.0 && target >= prefix[tid] && target < prefix[tid] + mine) {
    double run = prefix[tid];
    for (int32_t i = begin; i < end; ++i)
      if (logits[i] >= keep_logit) {
        const float q = prob(i);
        if (q < keep_prob) continue;
        run += q;
        if (target < run) { chosen = i; break; }
      }
    if (chosen < 0) chosen = last_kept;
  }
  // Exactly one thread's interval contains target unless rounding put it past the end: then
  // the last kept token wins.
  const int32_t picked = block_reduce(chosen, si, [](int32_t a, int32_t b) { return max(a, b); }, -1);
  const int32_t fallback = block_reduce(last_kept, si, [](int32_t a, int32_t b) { return max(a, b); }, -1);
  if (tid == 0) out[blockIdx.x] = picked >= 0 ? picked : (fallback >= 0 ? fallback : best_i);
}

}  // namespace

void rms_norm(float* out, const float* in, const float* weight, int64_t rows, int64_t dim,
              float eps, cudaStream_t stream) {
  if (rows <= 0) return;
  const unsigned threads = static_cast<unsigned>(std::clamp<int64_t>((dim / 4 + 31) / 32 * 32, 32, 1024));
  launch(rms_norm_kernel, dim3(static_cast<unsigned>(rows)), dim3(threads), stream, out, in, weight, dim, eps);
  check_launch("rms_norm");
}

void rope(float* x, const int32_t* positions, int64_t rows, int32_t num_heads, int32_t head_dim,
          int32_t rotary_dim, float freq_base, float freq_scale, bool neox, cudaStream_t stream) {
  const int64_t total = rows * num_heads * (rotary_dim / 2);
  if (total <= 0) return;
  const float theta_scale = std::pow(freq_base, -2.0f / static_cast<float>(rotary_dim));
  rope_kernel<<<blocks_for(total, 256), 256, 0, stream>>>(x, positions, rows, num_heads, head_dim,
                                                          rotary_dim, theta_scale, freq_scale, neox);
  check_launch("rope");
}

void rope_store_kv(float* q, float* k, const float* v, const int32_t* positions, const int32_t* slots,
                   int64_t rows, int32_t num_heads, int32_t num_kv_heads, int32_t head_dim, int32_t rotary_dim,
                   float freq_base, float freq_scale, bool neox, void* k_pool, void* v_pool, bool f16,
                   cudaStream_t stream) {
  if (rows <= 0) return;
  const float theta_scale = std::pow(freq_base, -2.0f / static_cast<float>(rotary_dim));
  const dim3 grid(static_cast<unsigned>(rows), static_cast<unsigned>(num_heads + num_kv_heads));
  const unsigned threads = static_cast<unsigned>(std::clamp((rotary_dim / 2 + 31) / 32 * 32, 32, 256));
  launch(rope_store_kv_kernel, grid, dim3(threads), stream, q, k, v, positions, slots, num_heads, num_kv_heads,
         head_dim, rotary_dim, theta_scale, freq_scale, neox, k_pool, v_pool, f16);
  check_launch("rope_store_kv");
}

void silu_mul(float* gate, const float* up, int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  silu_mul_kernel<<<blocks_for(n, 256), 256, 0, stream>>>(gate, up, n);
  check_launch("silu_mul");
}

void add(float* inout, const float* x, int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  add_kernel<<<blocks_for(n, 256), 256, 0, stream>>>(inout, x, n);
  check_launch("add");
}

void add_bias(float* y, const float* bias, int64_t rows, int64_t n, cudaStream_t stream) {
  if (rows * n <= 0) return;
  add_bias_kernel<<<blocks_for(rows * n, 256), 256, 0, stream>>>(y, bias, rows, n);
  check_launch("add_bias");
}

void store_kv(void* pool, bool f16, const float* src, const int32_t* slots, int64_t rows,
              int64_t row_elems, cudaStream_t stream) {
  if (rows <= 0) return;
  store_kv_kernel<<<static_cast<unsigned>(rows), 128, 0, stream>>>(pool, f16, src, slots, row_elems);
  check_launch("store_kv");
}

void embed_rows(float* out, const void* table, uint32_t format, int64_t cols, const int32_t* tokens,
                int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  embed_kernel<<<static_cast<unsigned>(n), 256, 0, stream>>>(
      out, static_cast<const uint8_t*>(table), format, format_row_bytes(format, cols), cols, tokens);
  check_launch("embed_rows");
}

void gather_rows(float* out, const float* in, const int32_t* rows, int64_t n, int64_t dim,
                 cudaStream_t stream) {
  if (n <= 0) return;
  launch(gather_kernel, dim3(static_cast<unsigned>(n)), dim3(256), stream, out, in, rows, dim);
  check_launch("gather_rows");
}

void copy_blocks(void* pool, const int32_t* pairs, int32_t n, size_t block_bytes, cudaStream_t stream) {
  if (n <= 0) return;
  if (block_bytes % 16) throw std::runtime_error("copy_blocks: block bytes must be a multiple of 16");
  copy_blocks_kernel<<<static_cast<unsigned>(n), 256, 0, stream>>>(static_cast<uint8_t*>(pool), pairs,
                                                                   block_bytes);
  check_launch("copy_blocks");
}

void fill_random(void* dst, uint32_t format, int64_t n, float scale, uint64_t seed, cudaStream_t stream) {
  if (n <= 0) return;
  if (format != kF32 && format != kF16 && format != kBF16)
    throw std::runtime_error("fill_random: only f32, f16 and bf16");
  fill_random_kernel<<<4096, 256, 0, stream>>>(dst, format, n, scale, seed);
  check_launch("fill_random");
}

void sample_rows(const float* logits, int64_t rows, int32_t vocab, const SampleParams* params,
                 int32_t* out_tokens, cudaStream_t stream) {
  if (rows <= 0) return;
  launch(sample_kernel, dim3(static_cast<unsigned>(rows)), dim3(kSampleThreads), stream, logits, vocab, params,
         out_tokens);
  check_launch("sample_rows");
}

}  // namespace tessera::cuda
