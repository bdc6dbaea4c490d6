// Device helpers shared by the .cu files: GGML block layouts, conversions, reductions.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <utility>

#include "tessera/sdk/kernels/cuda.h"

namespace tessera::cuda {

// GGML block layouts (ggml-common.h): 32 elements per block.
struct BlockQ4_0 { __half d; uint8_t qs[16]; };            // 18 bytes
struct BlockQ4_1 { __half d; __half m; uint8_t qs[16]; };  // 20 bytes
struct BlockQ8_0 { __half d; int8_t qs[32]; };             // 34 bytes
static_assert(sizeof(BlockQ4_0) == 18 && sizeof(BlockQ4_1) == 20 && sizeof(BlockQ8_0) == 34);

// Unaligned little-endian half load (GGUF blocks are packed: 18- and 34-byte strides).
__device__ __forceinline__ float load_half(const uint8_t* p) {
  const uint16_t bits = static_cast<uint16_t>(p[0]) | (static_cast<uint16_t>(p[1]) << 8);
  return __half2float(__ushort_as_half(bits));
}

// Element `i` of a row in `format` (slow path: embeddings, dequantize).
__device__ __forceinline__ float load_element(uint32_t format, const uint8_t* row, int64_t i) {
  switch (format) {
    case kF32: return reinterpret_cast<const float*>(row)[i];
    case kF16: return __half2float(reinterpret_cast<const __half*>(row)[i]);
    case kBF16: return __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(row)[i]);
    case kQ8_0: {
      const uint8_t* b = row + (i / 32) * 34;
      return __fmul_rn(static_cast<float>(static_cast<int8_t>(b[2 + i % 32])), load_half(b));
    }
    case kQ4_0: {
      const uint8_t* b = row + (i / 32) * 18;
      const int j = static_cast<int>(i % 32);
      const int q = j < 16 ? (b[2 + j] & 0xF) : (b[2 + j - 16] >> 4);
      return __fmul_rn(static_cast<float>(q - 8), load_half(b));
    }
    case kQ4_1: {
      const uint8_t* b = row + (i / 32) * 20;
      const int j = static_cast<int>(i % 32);
      const int q = j < 16 ? (b[4 + j] & 0xF) : (b[4 + j - 16] >> 4);
      return __fadd_rn(__fmul_rn(static_cast<float>(q), load_half(b)), load_half(b + 2));
    }
  }
  return 0.0f;
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ double warp_sum(double v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Block-wide reductions for blockDim.x a multiple of 32 (<= 1024). `shared` holds 32 slots.
// Every thread gets the result.
template <class T, class Op>
__device__ __forceinline__ T block_reduce(T v, T* shared, Op op, T identity) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  __syncthreads();  // shared may still be read by a previous reduction
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  v = lane < nwarps ? shared[lane] : identity;
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

inline int blocks_for(int64_t n, int threads) {
  return static_cast<int>((n + threads - 1) / threads);
}

// Programmatic dependent launch (sm_90): a kernel launched with the attribute may start while
// the previous kernel in the stream drains; it must not read that kernel's outputs, nor write
// anything, before grid_dependency_wait(). Both instructions are no-ops for a kernel launched
// without the attribute (and compiled out below sm_90).
__device__ __forceinline__ void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
// Lets the next kernel's CTAs be scheduled once every CTA of this one has issued it.
__device__ __forceinline__ void allow_dependent_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Launches `kernel`, with the programmatic-stream-serialization attribute when this thread
// enabled it (set_programmatic_launch).
template <class... KernelArgs, class... Args>
void launch(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = 0;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = programmatic_launch() ? attr : nullptr;
  cfg.numAttrs = programmatic_launch() ? 1 : 0;
  check(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...), "cudaLaunchKernelEx");
}

}  // namespace tessera::cuda
