// sampler plugins turn one row of logits into a token (and its logprobs), and verify draft
// tokens for speculative decoding. The engine keeps one SamplerState per sequence so that
// seeded sampling is reproducible whatever else shares the batch.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "tessera/sdk/plugin.h"
#include "tessera/sdk/types.h"

namespace tessera {

// Per-sequence state the engine owns and passes back on every call.
struct SamplerState {
  uint64_t rng = 0;  // random stream position, seeded from SamplingParams::seed
};

struct TokenLogprob {
  TokenId token = 0;
  float logprob = 0.0f;
};

struct SampledToken {
  TokenId token = 0;
  float logprob = 0.0f;              // log-softmax of the raw logits at `token`
  std::vector<TokenLogprob> top;     // num_logprobs most likely, when requested
};

struct SamplingInput {
  const SamplingParams* params = nullptr;
  std::span<const TokenId> history;  // prompt and generated tokens so far (for penalties)
};

// The drafts a sequence fed this step, as the sampler verifies them.
struct DraftView {
  std::span<const TokenId> tokens;
  // Empty, or tokens.size() rows of vocabulary-size draft probabilities (Draft::q); empty
  // means a deterministic proposal, q one-hot at each draft token.
  std::span<const float> q;
};

class Sampler {
 public:
  virtual ~Sampler() = default;
  // Picks the next token from `logits` (vocab-size floats; the sampler may modify them).
  virtual Status sample(std::span<float> logits, const SamplingInput& input, SamplerState* state,
                        SampledToken* out) = 0;
  // Speculative verification: logits[i] is the row after feeding history + drafts[0..i)
  // (drafts.tokens.size() + 1 rows). Appends the accepted drafts and then one token sampled
  // from the first rejected position (or the bonus position) to `out`; greedy requests
  // accept a draft iff it is the argmax, so the output equals non-speculative decoding, and
  // sampled ones use rejection sampling against drafts.q so the output distribution is the
  // one `sample` draws from.
  virtual Status verify(std::span<const std::span<float>> logits, const DraftView& drafts,
                        const SamplingInput& input, SamplerState* state,
                        std::vector<SampledToken>* out) = 0;
};

template <> struct PluginKindOf<Sampler> {
  static constexpr PluginKind value = PluginKind::kSampler;
};

}  // namespace tessera
