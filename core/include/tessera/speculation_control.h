// How many drafts a sequence should propose this step (speculative decoding's control): a
// draft row pays when the token it may add is worth more than the forward time it costs.
//
//   - AcceptanceEstimate: a sequence's per-draft acceptance rate alpha (geometric model: the
//     j-th draft is used iff drafts 1..j are all accepted, probability alpha^j), from its own
//     verifications, shrunk to a prior (the engine-wide rate) and forgotten over time so a
//     sequence whose drafts were switched off is probed again.
//   - StepTimeModel: t(n) = a + b n, the engine's measured step time against the tokens fed,
//     a least-squares fit with exponential forgetting (this machine, this stack, this load).
//   - DraftCostModel: what the drafter's own propose() time costs, which the step-time fit
//     does not contain. Two prices: d, seconds per draft token proposed, from calls in which
//     every sequence's drafter was up to date; and c, seconds per catch-up token, from calls
//     in which some sequence brought tokens the drafter had not taken in (a new prompt, or
//     the output of steps in which the sequence drafted nothing). Prompt lookup costs ~nothing
//     either way; a drafter that runs a model (draft-model, layer-skip) pays a forward per
//     draft, and a prefill-like forward over every token it catches up on.
//   - choose_num_drafts: the largest k <= max with alpha^k * (t(n)/n) >= b + d: the k-th
//     draft's expected token (valued at what a token costs in a plain step of n rows)
//     against one more row (b) and drafting it (d). Under load b * n / t(n) grows and k falls
//     to 0 — speculation turns itself off, and back on when the load drops; a draft that
//     costs about what a target step does is switched off at any load.
//   - catch_up_pays: for a sequence the drafter is behind on, whether drafting k per step for
//     the rest of its output saves more time than the catch-up costs (c times the tokens).
//     Without it every probe of a drafter that does not pay (a new request, or a retry after
//     its cost faded) bought a few drafts with a forward over the whole sequence so far.
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
  // One propose() call that took `seconds`, proposed `num_tokens` drafts (0 counts too: the
  // time was spent for nothing) and had `catch_up_tokens` tokens to take in beyond the one
  // new token per sequence of a step that follows a verification. A call without catch-up
  // teaches d; one with catch-up teaches c, from what is left after d times its drafts.
  void record(int32_t num_tokens, double seconds, int32_t catch_up_tokens = 0);
  // A step in which the control proposed nothing because drafts did not pay: the measured d
  // fades slowly (half-life ~350 such steps), so drafts are tried again now and then in case
  // the load, not the drafter, made them expensive. c does not fade: what a catch-up costs
  // is what lets a retry be priced.
  void age();
  double seconds_per_token() const;           // d; 0 until a draft token was proposed
  double seconds_per_catch_up_token() const;  // c; 0 until a catch-up was measured

 private:
  static constexpr double kForget = 0.9, kAge = 0.998;
  double tokens_ = 0, seconds_ = 0;
  double catch_up_tokens_ = 0, catch_up_seconds_ = 0;
};

// Drafts worth proposing for a sequence with acceptance `alpha`, in a step of `num_rows`
// decode rows costing `step_seconds`, where a row costs `row_seconds` more and drafting one
// token `draft_token_seconds`; at most max_drafts.
int32_t choose_num_drafts(double alpha, int32_t max_drafts, int32_t num_rows, double step_seconds,
                          double row_seconds, double draft_token_seconds = 0);

// Whether `k` drafts per step with acceptance `alpha`, over the `remaining_tokens` a sequence
// may still generate, save more than `catch_up_seconds`: a plain step costs `token_seconds`
// per token (t(n)/n), a step with drafts that plus k * (row_seconds + draft_token_seconds)
// for 1 + alpha + ... + alpha^k expected tokens.
bool catch_up_pays(double alpha, int32_t k, int32_t remaining_tokens, double token_seconds, double row_seconds,
                   double draft_token_seconds, double catch_up_seconds);

}  // namespace tessera
