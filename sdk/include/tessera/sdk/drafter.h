// drafter plugins propose draft tokens for speculative decoding; the sampler verifies them
// in the next step (one target forward over 1 + k tokens per sequence, batched with the
// other sequences' prompt chunks and decode tokens). SDK ABI 2.0.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "tessera/sdk/plugin.h"
#include "tessera/sdk/types.h"

namespace tessera {

// The drafts of one sequence. The engine owns one per sequence and reuses it every step
// (cleared, capacity kept), so a drafter that fills it allocates nothing in steady state.
struct Draft {
  std::vector<TokenId> tokens;  // proposed continuations of the sequence, in order
  // The proposal distribution q, for drafters that have one (a draft model): tokens.size()
  // rows of vocab_size probabilities, row i being q over the vocabulary at draft position i.
  // Leave it empty for a deterministic drafter (n-gram lookup): q is then one-hot at each
  // draft token, and sampled requests are verified against that.
  std::vector<float> q;

  void clear() { tokens.clear(); q.clear(); }
};

// One sequence the engine asks drafts for.
struct DraftRequest {
  const SequenceInfo* seq = nullptr;  // tokens = prompt + generated, no pending drafts
  int32_t max_drafts = 0;             // >= 1; more tokens than this are cut
  Draft* out = nullptr;               // empty on entry; owned by the engine
};

class Drafter {
 public:
  virtual ~Drafter() = default;
  // Proposes drafts for every request in one call (a draft model runs one batched forward),
  // after each step's tokens are committed. Filling no tokens for a request is fine. A non-OK
  // status means no drafts for any of them this step; the engine counts it and keeps
  // serving. Engine thread only; the spans and pointers are borrowed for the call.
  virtual Status propose(std::span<const DraftRequest> requests) = 0;
  // The drafts last proposed for `seq` were settled: the first `num_accepted` of the
  // `num_proposed` were kept, the rest (and their K/V) rolled back. num_accepted is 0 also
  // when the drafts were dropped unverified (preemption, or a step that could not feed them).
  // Stateful drafters (a draft model's own KV, suffix trees) resynchronize here.
  virtual void on_drafts_settled(SeqId seq, int32_t num_proposed, int32_t num_accepted) = 0;
  // The sequence is gone; drop any per-sequence state.
  virtual void forget(SeqId seq) = 0;
};

template <> struct PluginKindOf<Drafter> {
  static constexpr PluginKind value = PluginKind::kDrafter;
};

}  // namespace tessera
