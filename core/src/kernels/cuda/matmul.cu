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


// Eight consecutive weights of a dense row as floats: one 16-byte streaming load for 16-bit
// types, two for f32. `chunk` counts groups of 8 elements.
template <class T>
__device__ __forceinline__ void load8(const T* row, int64_t chunk, float* f) {
  if constexpr (std::is_same_v<T, float>) {
    const float4 a = __ldcs(reinterpret_cast<const float4*>(row) + 2 * chunk);
    const float4 b = __ldcs(reinterpret_cast<const float4*>(row) + 2 * chunk + 1);
    f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w; f[4] = b.x; f[5] = b.y; f[6] = b.z; f[7] = b.w;
  } else {
    unpack8(__ldcs(reinterpret_cast<const uint4*>(row) + chunk), static_cast<const T*>(nullptr), f);
  }
}

// Dense weights (f32, f16, bf16): each lane streams chunks of 8 elements of the row (16-byte
// loads, weights are read once: __ldcs), unrolled so several loads are in flight; x goes
// through the read-only cache (shared by all rows of the CTA and by neighbouring CTAs).
template <class T, int NT>
__global__ void __launch_bounds__(kGemvWarps * 32)
gemv_dense_kernel(const T* __restrict__ w, int64_t rows, int64_t cols, const float* __restrict__ x,
                  float* __restrict__ y) {
  const int lane = threadIdx.x & 31;
  const int64_t row = blockIdx.x * static_cast<int64_t>(kGemvWarps) + (threadIdx.x >> 5);
  if (row >= rows) return;
  const T* wr = w + row * cols;
  float acc[NT];
#pragma unroll
  for (int t = 0; t < NT; ++t) acc[t] = 0.0f;
  const int64_t chunks = cols / 8;  // cols % 32 == 0 checked by the launcher
  constexpr int kUnroll = 4;
  for (int64_t c0 = lane; c0 < chunks; c0 += 32 * kUnroll) {
    float f[kUnroll][8];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (c0 + 32 * u < chunks) load8(wr, c0 + 32 * u, f[u]);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t c = c0 + 32 * u;
      if (c >= chunks) break;
#pragma unroll
      for (int t = 0; t < NT; ++t) {
        const float4 a = __ldg(reinterpret_cast<const float4*>(x + t * cols + c * 8));
        const float4 b = __ldg(reinterpret_cast<const float4*>(x + t * cols + c * 8 + 4));
        acc[t] += f[u][0] * a.x + f[u][1] * a.y + f[u][2] * a.z + f[u][3] * a.w + f[u][4] * b.x +
                  f[u][5] * b.y + f[u][6] * b.z + f[u][7] * b.w;
      }
    }
  }
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    const float s = warp_sum(acc[t]);
    if (lane == 0) y[t * rows + row] = s;
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

template <uint32_t F, int NT>
__global__ void __launch_bounds__(kGemvWarps * 32)
gemv_quant_kernel(const uint8_t* __restrict__ w, int64_t rows, int64_t cols, size_t row_bytes,
                  const float* __restrict__ x, float* __restrict__ y) {
  constexpr int kBlockBytes = F == kQ8_0 ? 34 : (F == kQ4_0 ? 18 : 20);
  const int lane = threadIdx.x & 31;
  const int64_t row = blockIdx.x * static_cast<int64_t>(kGemvWarps) + (threadIdx.x >> 5);
  if (row >= rows) return;
  const uint8_t* wr = w + row * row_bytes;
  const int64_t nblocks = cols / 32;
  float acc[NT];
#pragma unroll
  for (int t = 0; t < NT; ++t) acc[t] = 0.0f;
  for (int64_t blk = lane; blk < nblocks; blk += 32) {
    float q[32], d, m;
    load_block<F>(wr + blk * kBlockBytes, q, &d, &m);
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      const float4* xs = reinterpret_cast<const float4*>(x + t * cols + blk * 32);
      float dot = 0.0f, sum = 0.0f;
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const float4 a = __ldg(xs + k);
        dot += q[4 * k] * a.x + q[4 * k + 1] * a.y + q[4 * k + 2] * a.z + q[4 * k + 3] * a.w;
        if constexpr (F == kQ4_1) sum += a.x + a.y + a.z + a.w;
      }
      acc[t] += d * dot + m * sum;
    }
  }
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    const float s = warp_sum(acc[t]);
    if (lane == 0) y[t * rows + row] = s;
  }
}

template <int NT>
void launch_gemv(uint32_t format, const void* w, int64_t rows, int64_t cols, const float* x, float* y,
                 cudaStream_t stream) {
  const unsigned grid = static_cast<unsigned>((rows + kGemvWarps - 1) / kGemvWarps);
  const unsigned block = kGemvWarps * 32;
  const auto* wb = static_cast<const uint8_t*>(w);
  switch (format) {
    case kBF16:
      gemv_dense_kernel<__nv_bfloat16, NT><<<grid, block, 0, stream>>>(
          static_cast<const __nv_bfloat16*>(w), rows, cols, x, y);
      break;
    case kF16:
      gemv_dense_kernel<__half, NT><<<grid, block, 0, stream>>>(static_cast<const __half*>(w), rows, cols,
                                                                x, y);
      break;
    case kF32:
      gemv_dense_kernel<float, NT><<<grid, block, 0, stream>>>(static_cast<const float*>(w), rows, cols, x, y);
      break;
    case kQ8_0:
      gemv_quant_kernel<kQ8_0, NT><<<grid, block, 0, stream>>>(wb, rows, cols, format_row_bytes(format, cols), x, y);
      break;
    case kQ4_0:
      gemv_quant_kernel<kQ4_0, NT><<<grid, block, 0, stream>>>(wb, rows, cols, format_row_bytes(format, cols), x, y);
      break;
    case kQ4_1:
      gemv_quant_kernel<kQ4_1, NT><<<grid, block, 0, stream>>>(wb, rows, cols, format_row_bytes(format, cols), x, y);
      break;
    default:
      throw std::runtime_error("gemv: unsupported weight format " + std::to_string(format));
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
  if (ntok <= 0 || rows <= 0) return;
  if (cols % 32 != 0) throw std::runtime_error("gemv: cols must be a multiple of 32");
  // Token counts are split into runs of 8, 4, 2 and 1 (four instantiations per format keep
  // nvcc time down; a weight row is re-read at most four times per call).
  for (int64_t t0 = 0; t0 < ntok;) {
    const int64_t left = ntok - t0;
    const int64_t nt = left >= 8 ? 8 : left >= 4 ? 4 : left >= 2 ? 2 : 1;
    const float* xs = x + t0 * cols;
    float* ys = y + t0 * rows;
    switch (nt) {
      case 1: launch_gemv<1>(format, w, rows, cols, xs, ys, stream); break;
      case 2: launch_gemv<2>(format, w, rows, cols, xs, ys, stream); break;
      case 4: launch_gemv<4>(format, w, rows, cols, xs, ys, stream); break;
      default: launch_gemv<8>(format, w, rows, cols, xs, ys, stream); break;
    }
    check_launch("gemv");
    t0 += nt;
  }
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
