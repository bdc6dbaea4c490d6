// drafter plugins propose draft tokens for speculative decoding; the sampler verifies them
// in the next step (one forward over 1 + k tokens).
#pragma once

#include <cstdint>
#include <vector>

#include "tessera/sdk/plugin.h"
#include "tessera/sdk/types.h"

namespace tessera {

class Drafter {
 public:
  virtual ~Drafter() = default;
  // Appends at most max_drafts proposed continuations of seq.tokens to `drafts` (may append
  // none). Called from the engine thread after each step for running decode sequences.
  virtual Status propose(const SequenceInfo& seq, int32_t max_drafts,
                         std::vector<TokenId>* drafts) = 0;
  // The sequence is gone; drop any per-sequence state.
  virtual void forget(SeqId seq) = 0;
};

template <> struct PluginKindOf<Drafter> {
  static constexpr PluginKind value = PluginKind::kDrafter;
};

}  // namespace tessera
