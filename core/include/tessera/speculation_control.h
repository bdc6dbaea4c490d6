// How many drafts a sequence should propose this step (speculative decoding's control): a
// draft row pays when the token it may add is worth more than the forward time it costs.
//
//   - AcceptanceEstimate: a sequence's per-draft acceptance rate alpha (geometric model: the
//     j-th draft is used iff drafts 1..j are all accepted, probability alpha^j), from its own
//     verifications, shrunk to a prior (the engine-wide rate) and forgotten over time so a
//     sequence whose drafts were switched off is probed again.
//   - StepTimeModel: t(n) = a + b n, the engine's measured step time against the tokens fed,
//     a least-squares fit with exponential forgetting (this machine, this stack, this load).
//   - DraftCostModel: d, the drafter's own seconds per draft token proposed (its propose()
//     time over the tokens it proposed). Prompt lookup costs ~nothing; a drafter that runs a
//     model (draft-model, layer-skip) pays a forward per draft before the target sees it,
//     time the step-time fit does not contain. (Calls that were a sequence's first are left
//     out: they feed the drafter the whole prompt.)
//   - choose_num_drafts: the largest k <= max with alpha^k * (t(n)/n) >= b + d: the k-th
//     draft's expected token (valued at what a token costs in a plain step of n rows)
//     against one more row (b) and drafting it (d). Under load b * n / t(n) grows and k falls
//     to 0 — speculation turns itself off, and back on when the load drops; a draft that
//     costs about what a target step does is switched off at any load.
//
// Plain values, no clock: the engine feeds measured times in; unit tests feed made-up ones.
#pragma once

#include <cstdint>

namespace tessera {

class AcceptanceEstimate {
 public:
  // One verification: of `proposed` drafts the first `accepted` were kept.
  void record(int32_t proposed, int32_t accepted);
  // A step in which the sequence proposed nothing: the evidence fades toward the prior.
  void age();
  // The estimate shrunk toward `prior` (e.g. the engine-wide rate of all sequences, so that a
  // new sequence in a workload whose drafts rarely pay starts pessimistic).
  double alpha(double prior = 0.5) const;

 private:
  static constexpr double kPriorWeight = 2.0, kForget = 0.95;
  double accepted_ = 0;  // accepted drafts (decayed)
  double tried_ = 0;     // drafts whose fate was decided: accepted + one per rejection
};

class StepTimeModel {
 public:
  void record(int32_t num_tokens, double seconds);
  bool has_data() const { return weight_ > 0; }
  // Fitted t(n); with no spread in n yet, b is assumed a sixteenth of a step.
  double seconds_for(int32_t num_tokens) const;
  double seconds_per_extra_token() const;  // b, at least 0

 private:
  static constexpr double kForget = 0.98;
  double weight_ = 0, sum_n_ = 0, sum_nn_ = 0, sum_t_ = 0, sum_nt_ = 0;
};

class DraftCostModel {
 public:
  // One propose() call that took `seconds` and proposed `num_tokens` drafts (0 counts too:
  // the time was spent for nothing).
  void record(int32_t num_tokens, double seconds);
  // A step in which the control proposed nothing because drafts did not pay: the measured cost
  // fades slowly (half-life ~350 such steps), so drafts are tried again now and then in case
  // the load, not the drafter, made them expensive.
  void age();
  double seconds_per_token() const;  // 0 until a draft token was proposed

 private:
  static constexpr double kForget = 0.9, kAge = 0.998;
  double tokens_ = 0, seconds_ = 0;
};

// Drafts worth proposing for a sequence with acceptance `alpha`, in a step of `num_rows`
// decode rows costing `step_seconds`, where a row costs `row_seconds` more and drafting one
// token `draft_token_seconds`; at most max_drafts.
int32_t choose_num_drafts(double alpha, int32_t max_drafts, int32_t num_rows, double step_seconds,
                          double row_seconds, double draft_token_seconds = 0);

}  // namespace tessera
