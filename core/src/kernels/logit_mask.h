// Applying a constraint's token mask to a row of logits: every token whose bit is clear
// becomes -inf. Core-private (the engine's sampling phase); the AVX2 build and the portable
// one give the same bits.
#pragma once

#include <cstdint>

namespace tessera::kernels {

// `allowed` holds ceil(vocab / 32) words, bit t % 32 of word t / 32 for token t. Returns
// whether any token is left.
bool apply_logit_mask(const uint32_t* allowed, float* row, int32_t vocab);
bool apply_logit_mask_scalar(const uint32_t* allowed, float* row, int32_t vocab);

}  // namespace tessera::kernels
