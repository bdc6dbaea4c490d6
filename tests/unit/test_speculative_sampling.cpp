// sampler.standard's speculative verification at temperature > 0: rejection sampling with a
// draft distribution q that differs from the target p must still yield p (Leviathan et al.,
// Theorem 1), for a full q row (a draft model) and a one-hot q (a deterministic drafter), with
// top-k/top-p applied to p as plain sampling applies them. Statistical, with fixed seeds: the
// same draws every run, so not flaky; each check states its chi-square p-value.
#include <doctest/doctest.h>

#include <cmath>
#include <random>
#include <vector>

#include "support/chi_square.h"
#include "support/plugins.h"
#include "tessera/sdk.h"

using namespace tessera;

namespace {

constexpr int kSamples = 40000;

std::vector<double> softmax(const std::vector<float>& logits, double temperature) {
  std::vector<double> p(logits.size());
  double max = logits[0], sum = 0;
  for (float l : logits) max = std::max<double>(max, l);
  for (size_t i = 0; i < p.size(); ++i) sum += p[i] = std::exp((logits[i] - max) / temperature);
  for (double& v : p) v /= sum;
  return p;
}

// First token verify() returns for one draft drawn from q (or fixed, when q is empty).
struct VerifyCounts {
  std::vector<int64_t> first;   // distribution of the token at the verified position
  int64_t num_accepted = 0;
};

VerifyCounts run_verify(Sampler& sampler, const std::vector<float>& logits, const std::vector<float>& q,
                        TokenId fixed_draft, const SamplingParams& params, uint64_t seed) {
  VerifyCounts c;
  c.first.assign(logits.size(), 0);
  std::mt19937_64 draft_rng(seed);
  std::discrete_distribution<int> from_q(q.begin(), q.end());
  std::vector<float> row0, row1;
  std::vector<SampledToken> out;
  SamplerState state{seed * 7919};
  for (int i = 0; i < kSamples; ++i) {
    const TokenId draft = q.empty() ? fixed_draft : from_q(draft_rng);
    row0 = logits;
    row1 = logits;  // the bonus row; its draw is not counted
    const std::span<float> rows[2] = {row0, row1};
    const TokenId drafts[1] = {draft};
    out.clear();
    REQUIRE(sampler.verify(rows, DraftView{drafts, q}, SamplingInput{&params, {}}, &state, &out).is_ok());
    REQUIRE(!out.empty());
    ++c.first[out[0].token];
    c.num_accepted += out[0].token == draft && out.size() == 2;
  }
  return c;
}

std::vector<int64_t> run_plain(Sampler& sampler, const std::vector<float>& logits,
                               const SamplingParams& params, uint64_t seed) {
  std::vector<int64_t> counts(logits.size(), 0);
  std::vector<float> row;
  SamplerState state{seed};
  for (int i = 0; i < kSamples; ++i) {
    row = logits;
    SampledToken t;
    REQUIRE(sampler.sample(row, SamplingInput{&params, {}}, &state, &t).is_ok());
    ++counts[t.token];
  }
  return counts;
}

}  // namespace

TEST_CASE("rejection sampling with a hand-built q that differs from p yields p") {
  auto sampler = test::create_plugin<Sampler>("standard", "{}");
  const std::vector<float> logits = {2.0f, 1.0f, 0.5f, 0.0f, -0.5f, 1.5f, -1.0f, 0.25f};
  SamplingParams params;
  params.temperature = 1.0f;
  const std::vector<double> p = softmax(logits, 1.0);
  // q puts its mass where p has little and little where p has most.
  const std::vector<float> q = {0.02f, 0.08f, 0.10f, 0.30f, 0.25f, 0.05f, 0.15f, 0.05f};

  const VerifyCounts c = run_verify(*sampler, logits, q, 0, params, 11);
  const test::ChiSquare fit = test::chi_square(c.first, p);
  MESSAGE("verify with q != p, " << kSamples << " samples: chi-square " << fit.statistic << ", df "
                                 << fit.degrees_of_freedom << ", p-value " << fit.p_value);
  CHECK(fit.p_value > 1e-3);
  // The acceptance rate is sum_x min(p(x), q(x)) (about 0.40 here), within 4 standard errors.
  double expected_accept = 0;
  for (size_t i = 0; i < p.size(); ++i) expected_accept += std::min<double>(p[i], q[i]);
  const double rate = static_cast<double>(c.num_accepted) / kSamples;
  CHECK(std::fabs(rate - expected_accept) < 4 * std::sqrt(expected_accept * (1 - expected_accept) / kSamples));

  // The test has power: the drafts themselves (distributed as q) are refused as p.
  std::vector<int64_t> drafts(logits.size(), 0);
  std::mt19937_64 rng(11);
  std::discrete_distribution<int> from_q(q.begin(), q.end());
  for (int i = 0; i < kSamples; ++i) ++drafts[from_q(rng)];
  CHECK(test::chi_square(drafts, p).p_value < 1e-9);
}

TEST_CASE("a one-hot q (deterministic drafter) with top-k, top-p and temperature matches plain sampling") {
  auto sampler = test::create_plugin<Sampler>("standard", "{}");
  const std::vector<float> logits = {2.0f, 1.0f, 0.5f, 0.0f, -0.5f, 1.5f, -1.0f, 0.25f, 1.2f, 0.9f};
  SamplingParams params;
  params.temperature = 0.8f;
  params.top_k = 6;
  params.top_p = 0.9f;
  // A likely draft, an unlikely one and one that top-k removes (p = 0: never accepted).
  for (TokenId draft : {0, 3, 6}) {
    INFO("draft " << draft);
    const VerifyCounts spec = run_verify(*sampler, logits, {}, draft, params, 21 + draft);
    const std::vector<int64_t> plain = run_plain(*sampler, logits, params, 97 + draft);
    const test::ChiSquare h = test::chi_square_two_sample(spec.first, plain);
    MESSAGE("one-hot draft " << draft << ", " << kSamples << " + " << kSamples
                             << " samples: chi-square " << h.statistic << ", df " << h.degrees_of_freedom
                             << ", p-value " << h.p_value);
    CHECK(h.p_value > 1e-3);
    if (draft == 6) CHECK(spec.num_accepted == 0);
  }
}

TEST_CASE("verify refuses q rows that do not match the drafts") {
  auto sampler = test::create_plugin<Sampler>("standard", "{}");
  std::vector<float> row0(4, 0.0f), row1(4, 0.0f);
  const std::span<float> rows[2] = {row0, row1};
  const TokenId drafts[1] = {1};
  const std::vector<float> short_q = {0.5f, 0.5f};
  SamplingParams params;
  SamplerState state{1};
  std::vector<SampledToken> out;
  const Status st = sampler->verify(rows, DraftView{drafts, short_q}, SamplingInput{&params, {}}, &state, &out);
  CHECK(st.code() == StatusCode::kInvalidArgument);
  CHECK(st.message().find("q must hold one vocabulary row per draft") != std::string::npos);
}
