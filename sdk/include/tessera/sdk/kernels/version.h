// Version of the SDK's kernel helpers (tessera/sdk/kernels/*.h and the tessera::kernels static
// library), apart from the plugin ABI: a kernel plugin links these helpers into itself, so
// they never cross the plugin seam and a change here does not make the host refuse a plugin.
// What the version promises is the numerics contract in docs/plugin-authoring.md ("kernel
// helpers"): a minor bump adds functions and keeps every existing result bit for bit; a major
// bump changes a result, a block layout or a signature. sdk/abi.lock records it (part
// "kernels") and the sdk_abi_lock test fails when a header here changes without a bump.
//
// History: 1.0 the block formats and their reference/SIMD dot products (ggml_types.h),
// activation quantization, ggml's exp in scalar and AVX2 form (ggml_simd.h), the
// element-wise kernels (cpu_kernels.h), the 8-row interleaved layouts and their matmuls
// (interleaved.h), huge-page buffers (huge_buffer.h), fp_contract_off.h.
// 1.1 the CUDA kernels (cuda.h, library tessera::cuda_kernels, only where the SDK was built
// with a CUDA toolkit): moved from backend.cuda unchanged, so attention.cuda-flash and any
// third-party CUDA plugin use them through the SDK.
// 1.2 Q5_K in ggml_types.h (dequantize_row, quantize_row / quantize_weight_row as
// llama-quantize writes it, vec_dot / vec_dot_tile in ggml's order against Q8_K) and in
// interleaved.h (an 8-row layout and its matmuls), Q5_1 in interleaved.h too; every existing
// result unchanged.
// 1.3 cpu_has_avx_vnni (the W8A8 quantizer's dispatch); every existing result unchanged.
// 1.4 fused CUDA decode kernels in cuda.h: gemv_multi (up to three matrices per launch, a
// residual added in the epilogue), gemv_swiglu (gate and up projections with silu_mul) and
// rope_store_kv, each equal to the unfused calls bit for bit; set_programmatic_launch
// (programmatic dependent launch for those kernels, rms_norm, attention_decode, gather_rows
// and sample_rows). rms_norm now reads float4 with up to 1024 threads: its double sum runs in
// another order, which can move a result by one ulp only at a near rounding tie.
// 1.5 exp_shifted_row in cpu_kernels.h (a row's unnormalized softmax at a temperature, for
// sampling over a whole vocabulary without sorting it); every existing result unchanged.
// 1.6 argmax_row in cpu_kernels.h (std::max_element's index over a row, vectorized: greedy
// sampling and the logprob normalizer's maximum); every existing result unchanged.
// 1.7 cpu_has_avx512 in ggml_types.h (AVX-512 F/BW/VL usable); every existing result unchanged.
#pragma once

#define TESSERA_SDK_KERNELS_VERSION_MAJOR 1
#define TESSERA_SDK_KERNELS_VERSION_MINOR 7

namespace tessera {
inline constexpr int kSdkKernelsVersionMajor = TESSERA_SDK_KERNELS_VERSION_MAJOR;
inline constexpr int kSdkKernelsVersionMinor = TESSERA_SDK_KERNELS_VERSION_MINOR;
}  // namespace tessera
