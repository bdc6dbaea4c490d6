// Element-wise math with llama.cpp's CPU numerics. ggml's x86 build evaluates exp (in softmax
// and SiLU) with a vectorized polynomial (the Arm optimized-routines expf algorithm: range
// reduction to k * 2^n with a degree-5 polynomial) instead of libm's expf; the two differ in
// the last bits for some inputs. After every matmul the activations are re-quantized to 8
// bits, which turns such last-bit differences into different tokens now and then, so Tessera
// evaluates the same algorithm, lane by lane.
#include <cmath>
#include <cstdint>
#include <cstring>

#include "tessera/ggml_types.h"

// Products and sums must round exactly as written, like the vector code they mirror.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

namespace tessera {
namespace {

uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}
float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

}  // namespace

float ggml_expf(float x) {
  const float shift = 0x1.8p23f;                     // rounds x / ln 2 to an integer n
  const float z = std::fma(x, 0x1.715476p+0f, shift);
  const float n = z - shift;
  // b = x - n ln 2, with ln 2 split in two parts for accuracy.
  const float b = std::fma(-n, 0x1.7f7d1cp-20f, std::fma(-n, 0x1.62e4p-1f, x));
  const uint32_t e = bits_of(z) << 23;               // n in the exponent field
  const float k = float_of(e + bits_of(1.0f));       // 2^n
  const float u = b * b;
  const float j = std::fma(std::fma(std::fma(0x1.0e4020p-7f, b, 0x1.573e2ep-5f), u,
                                    std::fma(0x1.555e66p-3f, b, 0x1.fffdb6p-2f)),
                           u, 0x1.ffffecp-1f * b);   // 2^(b / ln 2) - 1
  if (!(std::fabs(n) > 126.0f)) return std::fma(k, j, k);
  // Large |n|: scale in two steps so 2^n does not overflow or flush early.
  const uint32_t g = n <= 0.0f ? 0x82000000u : 0u;
  const float s1 = float_of(g + 0x7f000000u);
  const float s2 = float_of(e - g);
  if (std::fabs(n) > 192.0f) return s1 * s1;
  return std::fma(s2, j, s2) * s1;
}

}  // namespace tessera
