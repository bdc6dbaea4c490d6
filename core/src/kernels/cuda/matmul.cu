// Weight-only GEMV kernels (F32/F16/BF16 and GGUF Q4_0/Q4_1/Q8_0 blocks) for small batches,
// dequantization for the cuBLAS GEMM path, and the HBM read-bandwidth probe.
#include <algorithm>
#include <stdexcept>
#include <type_traits>
#include <string>

#include "common.cuh"

namespace tessera::cuda {
namespace {

constexpr int kGemvWarps = 8;  // output rows per CTA (one warp each)

__device__ __forceinline__ void unpack8(const uint4& v, const __nv_bfloat16*, float* f) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const float2 p = __bfloat1622float2(h[k]);
    f[2 * k] = p.x;
    f[2 * k + 1] = p.y;
  }
}
__device__ __forceinline__ void unpack8(const uint4& v, const __half*, float* f) {
  const __half2* h = reinterpret_cast<const __half2*>(&v);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const float2 p = __half22float2(h[k]);
    f[2 * k] = p.x;
    f[2 * k + 1] = p.y;
  }
}


// Raw 16-byte words of 8 weights (two words for f32), kept packed in registers until used so a
// deep unroll stays cheap in registers, then widened to floats.
template <class T>
struct Chunk {
  static constexpr int kWords = std::is_same_v<T, float> ? 2 : 1;
  uint4 w[kWords];
};
template <class T>
__device__ __forceinline__ void load_chunk(const T* row, int64_t chunk, Chunk<T>& c) {
#pragma unroll
  for (int k = 0; k < Chunk<T>::kWords; ++k)
    c.w[k] = __ldcs(reinterpret_cast<const uint4*>(row) + Chunk<T>::kWords * chunk + k);
}
template <class T>
__device__ __forceinline__ void widen(const Chunk<T>& c, float* f) {
  if constexpr (std::is_same_v<T, float>) {
    const float* p = reinterpret_cast<const float*>(c.w);
#pragma unroll
    for (int k = 0; k < 8; ++k) f[k] = p[k];
  } else {
    unpack8(c.w[0], static_cast<const T*>(nullptr), f);
  }
}

// Dot products of R weight rows (R = 1, or 2 for a SwiGLU gate/up pair) with NT activation
// rows, accumulated per lane; the caller reduces over the warp.
//
// Dense weights (f32, f16, bf16): each lane streams chunks of 8 elements of the row (16-byte
// loads, weights are read once: __ldcs), unrolled so several loads are in flight; x goes
// through the read-only cache (shared by all rows of the CTA and by neighbouring CTAs) and is
// loaded once for the R rows.
template <class T, int NT, int R>
__device__ __forceinline__ void dense_row_dots(const uint8_t* const (&rows)[R], int64_t cols, const float* x,
                                               int lane, float (&acc)[R][NT]) {
  const int64_t chunks = cols / 8;  // cols % 32 == 0 checked by the launcher
  // 128 bytes of weights in flight per lane (R rows together): the loads of a whole unrolled
  // step are issued before the first is used. The per-lane order of the sums does not depend
  // on the unroll (chunks lane, lane + 32, ... in turn), so results are the same bits.
  constexpr int kUnroll = 8 / (R * Chunk<T>::kWords);
  for (int64_t c0 = lane; c0 < chunks; c0 += 32 * kUnroll) {
    Chunk<T> raw[R][kUnroll];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
        if (c0 + 32 * u < chunks) load_chunk(reinterpret_cast<const T*>(rows[r]), c0 + 32 * u, raw[r][u]);
    // The weights do not depend on the previous kernel: the first loads are in flight before
    // waiting for it (programmatic dependent launch), x is read only after.
    if (c0 == lane) grid_dependency_wait();
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t c = c0 + 32 * u;
      if (c >= chunks) break;
      float f[R][8];
#pragma unroll
      for (int r = 0; r < R; ++r) widen(raw[r][u], f[r]);
#pragma unroll
      for (int t = 0; t < NT; ++t) {
        const float4 a = __ldg(reinterpret_cast<const float4*>(x + t * cols + c * 8));
        const float4 b = __ldg(reinterpret_cast<const float4*>(x + t * cols + c * 8 + 4));
#pragma unroll
        for (int r = 0; r < R; ++r)
          acc[r][t] += f[r][0] * a.x + f[r][1] * a.y + f[r][2] * a.z + f[r][3] * a.w + f[r][4] * b.x +
                       f[r][5] * b.y + f[r][6] * b.z + f[r][7] * b.w;
      }
    }
  }
}

// GGUF 32-element blocks: one lane per block, the block's 32 quantized values dotted with the
// matching 32 activations of each token, scaled once per block.
template <uint32_t F>
__device__ __forceinline__ void load_block(const uint8_t* b, float* q, float* d, float* m) {
  if constexpr (F == kQ8_0) {
    const uint16_t* h = reinterpret_cast<const uint16_t*>(b);  // 34-byte blocks: 2-aligned
    *d = __half2float(__ushort_as_half(h[0]));
    *m = 0.0f;
#pragma unroll
    for (int k = 0; k < 16; ++k) {
      const uint16_t v = h[1 + k];
      q[2 * k] = static_cast<float>(static_cast<int8_t>(v & 0xFF));
      q[2 * k + 1] = static_cast<float>(static_cast<int8_t>(v >> 8));
    }
  } else if constexpr (F == kQ4_0) {
    const uint16_t* h = reinterpret_cast<const uint16_t*>(b);  // 18-byte blocks: 2-aligned
    *d = __half2float(__ushort_as_half(h[0]));
    *m = 0.0f;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const uint16_t v = h[1 + k];
      const int b0 = v & 0xFF, b1 = v >> 8;
      q[2 * k] = static_cast<float>((b0 & 0xF) - 8);
      q[2 * k + 1] = static_cast<float>((b1 & 0xF) - 8);
      q[2 * k + 16] = static_cast<float>((b0 >> 4) - 8);
      q[2 * k + 17] = static_cast<float>((b1 >> 4) - 8);
    }
  } else {  // Q4_1, 20-byte blocks: 4-aligned
    const uint32_t* u = reinterpret_cast<const uint32_t*>(b);
    const uint32_t dm = u[0];
    *d = __half2float(__ushort_as_half(static_cast<uint16_t>(dm & 0xFFFF)));
    *m = __half2float(__ushort_as_half(static_cast<uint16_t>(dm >> 16)));
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const uint32_t v = u[1 + k];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int byte = (v >> (8 * j)) & 0xFF;
        q[4 * k + j] = static_cast<float>(byte & 0xF);
        q[4 * k + j + 16] = static_cast<float>(byte >> 4);
      }
    }
  }
}

template <uint32_t F, int NT, int R>
__device__ __forceinline__ void quant_row_dots(const uint8_t* const (&rows)[R], int64_t cols, const float* x,
                                               int lane, float (&acc)[R][NT]) {
  constexpr int kBlockBytes = F == kQ8_0 ? 34 : (F == kQ4_0 ? 18 : 20);
  const int64_t nblocks = cols / 32;
  for (int64_t blk = lane; blk < nblocks; blk += 32) {
    float q[R][32], d[R], m[R];
#pragma unroll
    for (int r = 0; r < R; ++r) load_block<F>(rows[r] + blk * kBlockBytes, q[r], &d[r], &m[r]);
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      const float4* xs = reinterpret_cast<const float4*>(x + t * cols + blk * 32);
      float dot[R], sum = 0.0f;
#pragma unroll
      for (int r = 0; r < R; ++r) dot[r] = 0.0f;
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const float4 a = __ldg(xs + k);
#pragma unroll
        for (int r = 0; r < R; ++r)
          dot[r] += q[r][4 * k] * a.x + q[r][4 * k + 1] * a.y + q[r][4 * k + 2] * a.z + q[r][4 * k + 3] * a.w;
        if constexpr (F == kQ4_1) sum += a.x + a.y + a.z + a.w;
      }
#pragma unroll
      for (int r = 0; r < R; ++r) acc[r][t] += d[r] * dot[r] + m[r] * sum;
    }
  }
}

template <uint32_t F, int NT, int R>
__device__ __forceinline__ void row_dots(const uint8_t* const (&rows)[R], int64_t cols, const float* x, int lane,
                                         float (&acc)[R][NT]) {
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int t = 0; t < NT; ++t) acc[r][t] = 0.0f;
  if constexpr (F == kBF16) dense_row_dots<__nv_bfloat16, NT, R>(rows, cols, x, lane, acc);
  else if constexpr (F == kF16) dense_row_dots<__half, NT, R>(rows, cols, x, lane, acc);
  else if constexpr (F == kF32) dense_row_dots<float, NT, R>(rows, cols, x, lane, acc);
  else {
    grid_dependency_wait();
    quant_row_dots<F, NT, R>(rows, cols, x, lane, acc);
  }
  grid_dependency_wait();  // lanes that had no chunk; a no-op once satisfied
}

// One launch over the rows of up to kGemvMaxTargets matrices (their rows concatenated, one
// warp per row): a fused Q/K/V projection, or one matrix with the residual added in the
// epilogue. The sums are the unfused kernels' to the bit: the same per-lane order, the same
// warp reduction, and the residual added as `residual + dot` like add().
struct GemvArgs {
  const uint8_t* w[kGemvMaxTargets];
  float* y[kGemvMaxTargets];
  const float* residual[kGemvMaxTargets];
  int64_t rows[kGemvMaxTargets];
  int64_t row_end[kGemvMaxTargets];  // cumulative row counts
  int32_t num_targets;
  int64_t cols;
  size_t row_bytes;
  const float* x;
};

template <uint32_t F, int NT>
__global__ void __launch_bounds__(kGemvWarps * 32) gemv_kernel(const GemvArgs a) {
  allow_dependent_launch();
  const int lane = threadIdx.x & 31;
  const int64_t g = blockIdx.x * static_cast<int64_t>(kGemvWarps) + (threadIdx.x >> 5);
  int s = 0;
  while (s + 1 < a.num_targets && g >= a.row_end[s]) ++s;
  if (g >= a.row_end[s]) return;
  const int64_t row = g - (s > 0 ? a.row_end[s - 1] : 0);
  const uint8_t* const wr[1] = {a.w[s] + row * a.row_bytes};
  float acc[1][NT];
  row_dots<F, NT, 1>(wr, a.cols, a.x, lane, acc);
  const int64_t rows = a.rows[s];
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    const float v = warp_sum(acc[0][t]);
    if (lane == 0) {
      const int64_t i = t * rows + row;
      a.y[s][i] = a.residual[s] ? a.residual[s][i] + v : v;
    }
  }
}

// y[t][r] = silu(gate_r . x_t) * (up_r . x_t): both rows of a SwiGLU pair in one warp, x read
// once, silu_mul's rounding (w[0] gate, w[1] up, y[0] out).
template <uint32_t F, int NT>
__global__ void __launch_bounds__(kGemvWarps * 32) gemv_swiglu_kernel(const GemvArgs a) {
  allow_dependent_launch();
  const int lane = threadIdx.x & 31;
  const int64_t row = blockIdx.x * static_cast<int64_t>(kGemvWarps) + (threadIdx.x >> 5);
  if (row >= a.rows[0]) return;
  const uint8_t* const wr[2] = {a.w[0] + row * a.row_bytes, a.w[1] + row * a.row_bytes};
  float acc[2][NT];
  row_dots<F, NT, 2>(wr, a.cols, a.x, lane, acc);
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    const float g = warp_sum(acc[0][t]);
    const float u = warp_sum(acc[1][t]);
    if (lane == 0) a.y[0][t * a.rows[0] + row] = __fmul_rn(__fdiv_rn(g, 1.0f + expf(-g)), u);
  }
}

template <int NT>
void launch_gemv(uint32_t format, const GemvArgs& a, bool swiglu, cudaStream_t stream) {
  const int64_t total = swiglu ? a.rows[0] : a.row_end[a.num_targets - 1];
  const unsigned grid = static_cast<unsigned>((total + kGemvWarps - 1) / kGemvWarps);
  const unsigned block = kGemvWarps * 32;
#define TESSERA_GEMV_CASE(F)                                                     \
  case F:                                                                        \
    if (swiglu) launch(gemv_swiglu_kernel<F, NT>, dim3(grid), dim3(block), stream, a); \
    else launch(gemv_kernel<F, NT>, dim3(grid), dim3(block), stream, a);              \
    break;
  switch (format) {
    TESSERA_GEMV_CASE(kBF16)
    TESSERA_GEMV_CASE(kF16)
    TESSERA_GEMV_CASE(kF32)
    TESSERA_GEMV_CASE(kQ8_0)
    TESSERA_GEMV_CASE(kQ4_0)
    TESSERA_GEMV_CASE(kQ4_1)
    default:
      throw std::runtime_error("gemv: unsupported weight format " + std::to_string(format));
  }
#undef TESSERA_GEMV_CASE
}

// Token counts are split into runs of 8, 4, 2 and 1 (four instantiations per format keep nvcc
// time down; a weight row is re-read at most four times per call).
void run_gemv(uint32_t format, GemvArgs a, int64_t ntok, bool swiglu, cudaStream_t stream) {
  if (a.cols % 32 != 0) throw std::runtime_error("gemv: cols must be a multiple of 32");
  a.row_bytes = format_row_bytes(format, a.cols);
  const float* x = a.x;
  float* y[kGemvMaxTargets];
  const float* res[kGemvMaxTargets];
  for (int s = 0; s < a.num_targets; ++s) {
    y[s] = a.y[s];
    res[s] = a.residual[s];
  }
  for (int64_t t0 = 0; t0 < ntok;) {
    const int64_t left = ntok - t0;
    const int64_t nt = left >= 8 ? 8 : left >= 4 ? 4 : left >= 2 ? 2 : 1;
    a.x = x + t0 * a.cols;
    for (int s = 0; s < a.num_targets; ++s) {
      a.y[s] = y[s] ? y[s] + t0 * a.rows[s] : nullptr;
      a.residual[s] = res[s] ? res[s] + t0 * a.rows[s] : nullptr;
    }
    switch (nt) {
      case 1: launch_gemv<1>(format, a, swiglu, stream); break;
      case 2: launch_gemv<2>(format, a, swiglu, stream); break;
      case 4: launch_gemv<4>(format, a, swiglu, stream); break;
      default: launch_gemv<8>(format, a, swiglu, stream); break;
    }
    check_launch(swiglu ? "gemv_swiglu" : "gemv");
    t0 += nt;
  }
}

template <class T>
__global__ void dequantize_kernel(uint32_t format, const uint8_t* w, int64_t rows, int64_t cols,
                                  size_t row_bytes, T* dst) {
  const int64_t n = rows * cols;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / cols, c = i % cols;
    const float v = load_element(format, w + r * row_bytes, c);
    if constexpr (sizeof(T) == 2 && std::is_same_v<T, __half>) dst[i] = __float2half_rn(v);
    else dst[i] = __float2bfloat16_rn(v);
  }
}

template <class T>
__global__ void convert_kernel(const float* src, T* dst, int64_t n) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  if constexpr (std::is_same_v<T, __half>) dst[i] = __float2half_rn(src[i]);
  else dst[i] = __float2bfloat16_rn(src[i]);
}

__global__ void probe_kernel(const uint4* __restrict__ src, size_t n16, float* sink) {
  uint32_t acc = 0;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n16;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const uint4 v = __ldcs(src + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  __shared__ uint32_t s[32];
  for (int o = 16; o > 0; o >>= 1) acc ^= __shfl_xor_sync(0xffffffffu, acc, o);
  if ((threadIdx.x & 31) == 0) s[threadIdx.x >> 5] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    uint32_t r = 0;
    for (int k = 0; k < static_cast<int>(blockDim.x >> 5); ++k) r ^= s[k];
    sink[blockIdx.x] = static_cast<float>(r & 0xFFFF);
  }
}

}  // namespace

void gemv(uint32_t format, const void* w, int64_t rows, int64_t cols, const float* x, int64_t ntok,
          float* y, cudaStream_t stream) {
  const GemvTarget t{w, rows, y, nullptr};
  gemv_multi(format, &t, 1, cols, x, ntok, stream);
}

void gemv_multi(uint32_t format, const GemvTarget* targets, int32_t num_targets, int64_t cols, const float* x,
                int64_t ntok, cudaStream_t stream) {
  if (num_targets < 1 || num_targets > kGemvMaxTargets)
    throw std::runtime_error("gemv_multi: 1 to " + std::to_string(kGemvMaxTargets) + " targets");
  GemvArgs a{};
  int64_t end = 0;
  for (int32_t s = 0; s < num_targets; ++s) {
    a.w[s] = static_cast<const uint8_t*>(targets[s].w);
    a.y[s] = targets[s].y;
    a.residual[s] = targets[s].residual;
    a.rows[s] = targets[s].rows;
    end += targets[s].rows;
    a.row_end[s] = end;
  }
  a.num_targets = num_targets;
  a.cols = cols;
  a.x = x;
  if (ntok <= 0 || end <= 0) return;
  run_gemv(format, a, ntok, false, stream);
}

void gemv_swiglu(uint32_t format, const void* w_gate, const void* w_up, int64_t rows, int64_t cols, const float* x,
                 int64_t ntok, float* y, cudaStream_t stream) {
  if (ntok <= 0 || rows <= 0) return;
  GemvArgs a{};
  a.w[0] = static_cast<const uint8_t*>(w_gate);
  a.w[1] = static_cast<const uint8_t*>(w_up);
  a.y[0] = y;
  a.rows[0] = a.rows[1] = rows;
  a.row_end[0] = rows;
  a.row_end[1] = 2 * rows;
  a.num_targets = 2;
  a.cols = cols;
  a.x = x;
  run_gemv(format, a, ntok, true, stream);
}

void dequantize(uint32_t format, const void* w, int64_t rows, int64_t cols, void* dst, bool to_bf16,
                cudaStream_t stream) {
  if (rows * cols <= 0) return;
  if (!format_supported(format)) throw std::runtime_error("dequantize: unsupported format");
  const size_t rb = format_row_bytes(format, cols);
  const int grid = static_cast<int>(std::min<int64_t>(8192, (rows * cols + 255) / 256));
  if (to_bf16)
    dequantize_kernel<__nv_bfloat16><<<grid, 256, 0, stream>>>(format, static_cast<const uint8_t*>(w), rows,
                                                               cols, rb, static_cast<__nv_bfloat16*>(dst));
  else
    dequantize_kernel<__half><<<grid, 256, 0, stream>>>(format, static_cast<const uint8_t*>(w), rows, cols,
                                                        rb, static_cast<__half*>(dst));
  check_launch("dequantize");
}

void convert_f32(const float* src, void* dst, int64_t n, bool to_bf16, cudaStream_t stream) {
  if (n <= 0) return;
  if (to_bf16)
    convert_kernel<__nv_bfloat16><<<blocks_for(n, 256), 256, 0, stream>>>(src, static_cast<__nv_bfloat16*>(dst), n);
  else
    convert_kernel<__half><<<blocks_for(n, 256), 256, 0, stream>>>(src, static_cast<__half*>(dst), n);
  check_launch("convert_f32");
}

void read_bandwidth_probe(const void* src, size_t n, float* sink, cudaStream_t stream) {
  probe_kernel<<<kProbeBlocks, 512, 0, stream>>>(static_cast<const uint4*>(src), n / 16, sink);
  check_launch("read_bandwidth_probe");
}

}  // namespace tessera::cuda
