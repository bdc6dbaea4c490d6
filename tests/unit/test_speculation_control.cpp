// The control of speculative decoding (tessera/speculation_control.h) on made-up numbers: no
// clock is involved, so these are exact checks of the cost model, not timings.
#include <doctest/doctest.h>

#include "tessera/speculation_control.h"

using namespace tessera;

TEST_CASE("acceptance: the prior (0.5 by default), then the drafts' own record, forgotten when idle") {
  AcceptanceEstimate a;
  CHECK(a.alpha() == doctest::Approx(0.5));
  for (int i = 0; i < 50; ++i) a.record(4, 4);  // every draft accepted
  CHECK(a.alpha() > 0.95);
  AcceptanceEstimate b;
  for (int i = 0; i < 50; ++i) b.record(4, 0);  // every first draft rejected
  CHECK(b.alpha() < 0.05);
  for (int i = 0; i < 200; ++i) b.age();
  CHECK(b.alpha() == doctest::Approx(0.5).epsilon(0.01));  // back to the prior: probed again
  AcceptanceEstimate c;
  for (int i = 0; i < 200; ++i) c.record(4, 1);  // one accepted, then a rejection: alpha 1/2
  CHECK(c.alpha() == doctest::Approx(0.5).epsilon(0.01));
  AcceptanceEstimate d;
  d.record(0, 0);  // nothing proposed: no evidence
  CHECK(d.alpha() == doctest::Approx(0.5));
  CHECK(d.alpha(0.1) == doctest::Approx(0.1));  // the prior given (the engine-wide rate)
  for (int i = 0; i < 200; ++i) b.age();
  CHECK(b.alpha(0.1) == doctest::Approx(0.1).epsilon(0.01));
}

TEST_CASE("step time model: fits t(n) = a + b n, assumes b = t/16 while every step has one size") {
  StepTimeModel m;
  CHECK_FALSE(m.has_data());
  for (int i = 0; i < 20; ++i) m.record(1, 0.006);
  CHECK(m.seconds_for(1) == doctest::Approx(0.006));
  CHECK(m.seconds_per_extra_token() == doctest::Approx(0.006 / 16));
  StepTimeModel line;
  for (int i = 0; i < 40; ++i) line.record(1 + i % 9, 0.005 + 0.0004 * (1 + i % 9));
  CHECK(line.seconds_per_extra_token() == doctest::Approx(0.0004));
  CHECK(line.seconds_for(32) == doctest::Approx(0.005 + 0.0004 * 32));
}

TEST_CASE("drafts are proposed while the k-th one's expected token is worth its row") {
  // Batch 1, memory-bound: a 6 ms step, 0.3 ms per extra row.
  CHECK(choose_num_drafts(0.5, 8, 1, 0.006, 0.0003) == 4);   // 0.5^4 * 6 = 0.375 >= 0.3 > 0.5^5 * 6
  CHECK(choose_num_drafts(0.9, 8, 1, 0.006, 0.0003) == 8);   // capped at the maximum
  CHECK(choose_num_drafts(0.02, 8, 1, 0.006, 0.0003) == 0);  // 0.02 * 6 = 0.12 < 0.3: off
  // 16 sequences, compute-bound: a 40 ms step, 2 ms per extra row. Even good drafts do not pay.
  CHECK(choose_num_drafts(0.7, 8, 16, 0.040, 0.002) == 0);
  // Load drops to 2 sequences: back on.
  CHECK(choose_num_drafts(0.7, 8, 2, 0.008, 0.0004) > 0);
  // Nothing measured yet: the maximum.
  CHECK(choose_num_drafts(0.1, 4, 1, 0.0, 0.0) == 4);
}

TEST_CASE("a draft that costs about a target step is switched off whatever its acceptance") {
  // Batch 1: a 3 ms step, 0.2 ms per extra row. Prompt lookup drafts for free and pays...
  CHECK(choose_num_drafts(0.7, 4, 1, 0.003, 0.0002, 0.0) == 4);
  // ...a layer-skip draft through 29 of 30 layers costs ~2.9 ms per token: 0.89 * 3 < 3.1.
  CHECK(choose_num_drafts(0.89, 4, 1, 0.003, 0.0002, 0.0029) == 0);
  // A Q4_1 draft for an F32 target: 20 ms steps, 4 ms per draft token, 90 % agreement: all 6.
  CHECK(choose_num_drafts(0.9, 6, 1, 0.020, 0.0005, 0.004) == 6);
}

TEST_CASE("draft cost model: seconds per proposed token, forgetting; fades slowly while off") {
  DraftCostModel m;
  CHECK(m.seconds_per_token() == 0);
  m.record(0, 0.001);  // a call that proposed nothing: no tokens yet, nothing to divide by
  CHECK(m.seconds_per_token() == 0);
  for (int i = 0; i < 50; ++i) m.record(4, 0.012);
  CHECK(m.seconds_per_token() == doctest::Approx(0.003).epsilon(0.01));
  // Time spent proposing nothing raises the cost of the tokens that were proposed.
  DraftCostModel empty_calls;
  for (int i = 0; i < 50; ++i) {
    empty_calls.record(4, 0.004);
    empty_calls.record(0, 0.004);
  }
  CHECK(empty_calls.seconds_per_token() == doctest::Approx(0.002).epsilon(0.05));
  // Off for ~350 steps: half the measured cost, so drafts get tried again.
  const double before = m.seconds_per_token();
  for (int i = 0; i < 347; ++i) m.age();
  CHECK(m.seconds_per_token() == doctest::Approx(before / 2).epsilon(0.02));
}

TEST_CASE("draft cost model: calls with catch-up teach the catch-up price, not the draft price") {
  DraftCostModel m;
  CHECK(m.seconds_per_catch_up_token() == 0);
  for (int i = 0; i < 50; ++i) m.record(4, 0.012);  // up to date: 3 ms per draft
  // A new prompt of 200 tokens, and 4 drafts: 12 ms of drafts plus 100 ms for the prompt.
  m.record(4, 0.112, 200);
  CHECK(m.seconds_per_token() == doctest::Approx(0.003).epsilon(0.01));  // unchanged
  CHECK(m.seconds_per_catch_up_token() == doctest::Approx(0.0005).epsilon(0.01));
  // The draft price fades while drafts are off; the catch-up price stays, to price retries.
  for (int i = 0; i < 347; ++i) m.age();
  CHECK(m.seconds_per_token() == doctest::Approx(0.0015).epsilon(0.02));
  CHECK(m.seconds_per_catch_up_token() == doctest::Approx(0.0005).epsilon(0.01));
  // A catch-up call faster than its drafts at price d counts as free, not negative.
  DraftCostModel fast;
  for (int i = 0; i < 50; ++i) fast.record(4, 0.012);
  fast.record(4, 0.010, 10);
  CHECK(fast.seconds_per_catch_up_token() == 0);
}

TEST_CASE("catch-up pays only when the drafts' saving over the remaining output exceeds it") {
  // Nothing to catch up on (or no price measured yet): always.
  CHECK(catch_up_pays(0.5, 1, 10, 0.004, 0.001, 0.001, 0.0));
  // A draft model for an F32 target: 15 ms per plain token, 8 drafts at 2.5 ms and 1.5 ms per
  // row, 90 % accepted: ~6.1 tokens per 47 ms step saves ~7.3 ms a token, ~0.7 s over 95
  // tokens, far more than 0.5 ms x 60 prompt tokens.
  CHECK(catch_up_pays(0.9, 8, 95, 0.015, 0.0015, 0.0025, 0.0005 * 60));
  // Layer-skip on a 3.5 ms step, its draft price faded to 1.2 ms, 0.8 ms a row, 67 %: one draft
  // per step saves ~0.2 ms a token, ~17 ms over 84 tokens; catching up on 262 tokens at
  // 0.2 ms costs 52 ms.
  CHECK_FALSE(catch_up_pays(0.67, 1, 84, 0.0035, 0.0008, 0.0012, 0.0002 * 262));
  // The same drafts with the same gap near the end of a long output: still no.
  CHECK_FALSE(catch_up_pays(0.67, 1, 4, 0.0035, 0.0008, 0.0012, 0.0002 * 10));
  // Drafts that cost more than they save never pay a catch-up, however long the output.
  CHECK_FALSE(catch_up_pays(0.3, 2, 100000, 0.004, 0.002, 0.003, 0.0001));
  // No drafts or nothing left to generate: no saving to set against a catch-up.
  CHECK_FALSE(catch_up_pays(0.9, 0, 100, 0.004, 0.001, 0.001, 0.001));
  CHECK_FALSE(catch_up_pays(0.9, 4, 0, 0.004, 0.001, 0.001, 0.001));
}
