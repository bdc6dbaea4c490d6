// Log-probabilities of one row of raw logits, as OpenAI reports them: log-softmax of the
// logits before penalties, temperature and filters. The engine uses it for prompt logprobs;
// the normalizer is computed as the standard sampler computes it for generated tokens
// (max + log of a double sum of single-precision exponentials), so both agree.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "tessera/sdk/sampler.h"

namespace tessera {

// Fills out->logprob (at out->token) and out->top (the num_top most likely tokens, most
// likely first; ties by lower id) from `logits`. `index` is scratch, reused between calls.
void fill_token_logprobs(std::span<const float> logits, int32_t num_top, SampledToken* out,
                         std::vector<TokenId>* index);

}  // namespace tessera
