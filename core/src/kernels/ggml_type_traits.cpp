// GGML type traits (block layouts) and the scalar fp16 <-> fp32 conversions.
//
// The layouts must match ggml byte for byte: GGUF files written by llama.cpp are read with
// these sizes, and a wrong type_size would silently shift every tensor after the first.
#include <cmath>
#include <cstring>

#include "tessera/sdk/kernels/ggml_types.h"

namespace tessera {

namespace {

constexpr GgmlTypeTraits kUnknown{"unknown", 0, 0, false};

// Sizes follow ggml's block structs (ggml-common.h); the K-quants use QK_K = 256 with
// 6-bit packed scales (K_SCALE_SIZE = 12).
GgmlTypeTraits traits_for(uint32_t raw) {
  switch (static_cast<GgmlType>(raw)) {
    case GgmlType::F32: return {"f32", 1, 4, true};
    case GgmlType::F16: return {"f16", 1, 2, true};
    case GgmlType::BF16: return {"bf16", 1, 2, true};
    case GgmlType::Q4_0: return {"q4_0", 32, 18, true};   // fp16 d + 16 nibble bytes
    case GgmlType::Q4_1: return {"q4_1", 32, 20, true};   // fp16 d, m + 16 bytes
    case GgmlType::Q5_0: return {"q5_0", 32, 22, true};   // fp16 d + 4 qh + 16 qs
    case GgmlType::Q5_1: return {"q5_1", 32, 24, true};   // fp16 d, m + 4 qh + 16 qs
    case GgmlType::Q8_0: return {"q8_0", 32, 34, true};   // fp16 d + 32 int8
    case GgmlType::Q8_1: return {"q8_1", 32, 36, true};   // fp16 d, s + 32 int8
    case GgmlType::Q2_K: return {"q2_K", 256, 84, true};
    case GgmlType::Q3_K: return {"q3_K", 256, 110, true};
    case GgmlType::Q4_K: return {"q4_K", 256, 144, true};
    case GgmlType::Q5_K: return {"q5_K", 256, 176, true};
    case GgmlType::Q6_K: return {"q6_K", 256, 210, true};
    case GgmlType::Q8_K: return {"q8_K", 256, 292, true};  // f32 d + 256 int8 + 16 int16 bsums
  }
  return kUnknown;
}

float fp32_from_bits(uint32_t w) {
  float f;
  std::memcpy(&f, &w, sizeof f);
  return f;
}

uint32_t fp32_to_bits(float f) {
  uint32_t w;
  std::memcpy(&w, &f, sizeof w);
  return w;
}

}  // namespace

GgmlTypeTraits ggml_type_traits(GgmlType type) { return traits_for(static_cast<uint32_t>(type)); }

const char* ggml_type_name(GgmlType type) { return traits_for(static_cast<uint32_t>(type)).name; }

bool ggml_type_is_known(uint32_t raw_type) { return traits_for(raw_type).is_known; }

size_t ggml_row_size(GgmlType type, int64_t n) {
  const GgmlTypeTraits t = ggml_type_traits(type);
  if (!t.is_known || n <= 0) return 0;
  return static_cast<size_t>(n / t.block_size) * t.type_size;
}

// The two conversions below are ggml's portable scalar fallbacks
// (ggml_compute_fp16_to_fp32 / ggml_compute_fp32_to_fp16, after Maratyszcza's FP16 library).
// They use float arithmetic to do the rounding, so they give bit-identical results to the
// F16C instructions ggml uses on x86, including for subnormals, inf and nan.
float fp16_to_fp32(uint16_t h) {
  const uint32_t w = static_cast<uint32_t>(h) << 16;
  const uint32_t sign = w & UINT32_C(0x80000000);
  const uint32_t two_w = w + w;

  // Normal numbers: shift the exponent/mantissa into place and rebias by multiplying by
  // 2^-112, which also turns half inf/nan (exponent 31) into float inf/nan.
  const uint32_t exp_offset = UINT32_C(0xE0) << 23;
  const float exp_scale = 0x1.0p-112f;
  const float normalized_value = fp32_from_bits((two_w >> 4) + exp_offset) * exp_scale;

  // Subnormals: put the mantissa into a float in [0.5, 1) and subtract the implicit 0.5.
  const uint32_t magic_mask = UINT32_C(126) << 23;
  const float magic_bias = 0.5f;
  const float denormalized_value = fp32_from_bits((two_w >> 17) | magic_mask) - magic_bias;

  const uint32_t denormalized_cutoff = UINT32_C(1) << 27;
  const uint32_t result =
      sign | (two_w < denormalized_cutoff ? fp32_to_bits(denormalized_value)
                                          : fp32_to_bits(normalized_value));
  return fp32_from_bits(result);
}

uint16_t fp32_to_fp16(float f) {
  // Scaling up then down makes values too large for half overflow to inf, and lets the FPU
  // perform round-to-nearest-even when the bias is added below.
  const float scale_to_inf = 0x1.0p+112f;
  const float scale_to_zero = 0x1.0p-110f;
  float base = (std::fabs(f) * scale_to_inf) * scale_to_zero;

  const uint32_t w = fp32_to_bits(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & UINT32_C(0x80000000);
  uint32_t bias = shl1_w & UINT32_C(0xFF000000);
  if (bias < UINT32_C(0x71000000)) bias = UINT32_C(0x71000000);

  base = fp32_from_bits((bias >> 1) + UINT32_C(0x07800000)) + base;
  const uint32_t bits = fp32_to_bits(base);
  const uint32_t exp_bits = (bits >> 13) & UINT32_C(0x00007C00);
  const uint32_t mantissa_bits = bits & UINT32_C(0x00000FFF);
  const uint32_t nonsign = exp_bits + mantissa_bits;
  // Any nan becomes the canonical quiet half nan 0x7E00 (with the sign), as in ggml.
  return static_cast<uint16_t>((sign >> 16) | (shl1_w > UINT32_C(0xFF000000) ? UINT32_C(0x7E00)
                                                                             : nonsign));
}

}  // namespace tessera
