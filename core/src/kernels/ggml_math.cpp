// Element-wise math with llama.cpp's CPU numerics. ggml's x86 build evaluates exp (in softmax
// and SiLU) with a vectorized polynomial (the Arm optimized-routines expf algorithm: range
// reduction to k * 2^n with a degree-5 polynomial) instead of libm's expf; the two differ in
// the last bits for some inputs. After every matmul the activations are re-quantized to 8
// bits, which turns such last-bit differences into different tokens now and then, so Tessera
// evaluates the same algorithm, lane by lane.
#include <cmath>
#include <cstdint>
#include <cstring>


// Products and sums must round exactly as written, like the vector code they mirror.
#include "tessera/sdk/kernels/fp_contract_off.h"

#include "tessera/sdk/kernels/ggml_simd.h"
#include "tessera/sdk/kernels/ggml_types.h"

namespace tessera {
// The body lives in tessera/ggml_simd.h so SIMD kernels can inline it (and its 8-lane form).
float ggml_expf(float x) { return simd::ggml_expf_inline(x); }

}  // namespace tessera
