// The rotation a q8_0 KV cache keeps its rows in. Rounding a row to int8 with one scale per
// 32 elements costs most where a few elements are far larger than the rest (the scale follows
// the outlier and the others lose their bits). Rotating each head's row by an orthonormal
// Hadamard matrix H spreads every outlier over the whole row first (QuaRot's observation), and
// since H^T H = I the attention sees the same numbers:
//  - K: Q and K rotated alike, so every score (H q) . (H k) = q . k;
//  - V: V rotated before it is stored, and each head's output rotated back after attention
//    (the output is a weighted sum of V rows, so it comes out rotated; H is its own inverse).
// llama.cpp does the same for quantized caches since its attn_rot_k / attn_rot_v (Sylvester's
// H / sqrt(n): n the largest power of two dividing the head for K, 64 for V). On SmolLM2 with
// F32 weights, this is what took the q8_0 K cache's mean KLD against the f16 cache from
// ~0.0009 to llama.cpp's ~0.0004 (docs/benchmarks.md).
#pragma once

#include <cstdint>

namespace tessera {

// Elements one rotation spans in a K row of `head_dim` (the largest power of two dividing it),
// or 0 where the head is not a multiple of 64 (no rotation, as in llama.cpp).
int32_t kv_k_rotation_block(int32_t head_dim);
// The same for V rows: 64 (llama.cpp measured smaller blocks to do better for V), or 0.
int32_t kv_v_rotation_block(int32_t head_dim);

// x[b * block .. (b + 1) * block) = H x[...] / sqrt(block) for each of `blocks` consecutive
// blocks, in place: Sylvester's Hadamard matrix (H_1 = [1], H_2n = [[H_n, H_n], [H_n, -H_n]])
// by the fast Walsh-Hadamard butterflies, block * log2(block) adds. Applying it twice gives x
// back up to rounding (exactly where 1/sqrt(block) is a power of two: block 64, 256, ...).
// `block` must be a power of two.
void hadamard_rotate(float* x, int64_t blocks, int32_t block);

}  // namespace tessera
