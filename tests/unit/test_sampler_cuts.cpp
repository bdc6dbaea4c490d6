// sampler.standard sorts only as much of the vocabulary as its cuts need: nothing without
// top-k/top-p/min-p, the top k with top-k, and otherwise a sorted head that grows (256, then
// 2048, ...) until top-p and min-p end inside it. Its draws are checked here against a
// reference that sorts the whole vocabulary (in double precision), on ramps whose kept sets
// end before, inside and past the first head. Statistical, with fixed seeds (the same draws
// every run): a chi-square over rank bins of the kept set, each p-value stated, and any draw
// outside the kept set fails outright.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "support/chi_square.h"
#include "support/plugins.h"
#include "tessera/sdk.h"

using namespace tessera;

namespace {

constexpr int kVocab = 8192;
constexpr int kSamples = 6000;
constexpr int kBins = 20;

// Logits falling by `step` per rank, the ranks shuffled over the token ids.
std::vector<float> ramp(float step, uint32_t seed) {
  std::vector<int> rank(kVocab);
  std::iota(rank.begin(), rank.end(), 0);
  std::shuffle(rank.begin(), rank.end(), std::mt19937(seed));
  std::vector<float> logits(kVocab);
  for (int t = 0; t < kVocab; ++t) logits[t] = 3.0f - step * static_cast<float>(rank[t]);
  return logits;
}

// llama.cpp's chain over the fully sorted vocabulary: top-k, then top-p and min-p on the
// temperature-1 softmax of what is left, then temperature. Probabilities per token, and the
// kept tokens by rank.
struct Reference {
  std::vector<double> p;
  std::vector<TokenId> kept;
};

Reference reference(const std::vector<float>& logits, const SamplingParams& params) {
  std::vector<TokenId> order(logits.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](TokenId a, TokenId b) { return logits[a] > logits[b]; });
  if (params.top_k > 0 && static_cast<size_t>(params.top_k) < order.size()) order.resize(params.top_k);
  const double max = logits[order[0]];
  std::vector<double> unit(order.size());
  double sum = 0;
  for (size_t i = 0; i < order.size(); ++i) sum += unit[i] = std::exp(logits[order[i]] - max);
  for (double& u : unit) u /= sum;
  size_t keep = order.size();
  if (params.top_p < 1.0f) {
    double cum = 0;
    for (size_t i = 0; i < keep; ++i) {
      cum += unit[i];
      if (cum >= params.top_p) { keep = i + 1; break; }
    }
  }
  if (params.min_p > 0.0f) {
    size_t last = 1;
    while (last < keep && unit[last] >= unit[0] * params.min_p) ++last;
    keep = last;
  }
  order.resize(keep);
  Reference r{std::vector<double>(logits.size(), 0.0), order};
  double z = 0;
  for (TokenId t : order) z += r.p[t] = std::exp((logits[t] - max) / params.temperature);
  for (TokenId t : order) r.p[t] /= z;
  return r;
}

struct Drawn {
  test::ChiSquare fit;
  int64_t deepest_rank = -1;  // the largest rank (in the kept set) drawn
};

Drawn draw_and_fit(Sampler& sampler, const std::vector<float>& logits, SamplingParams params,
                   uint64_t seed) {
  const Reference ref = reference(logits, params);
  std::vector<int64_t> rank_of(logits.size(), -1);
  for (size_t r = 0; r < ref.kept.size(); ++r) rank_of[ref.kept[r]] = static_cast<int64_t>(r);
  // Categories: kBins rank bins of the kept set, then one for everything outside it.
  const size_t bins = std::min<size_t>(kBins, ref.kept.size());
  auto bin_of = [&](TokenId t) {
    return rank_of[t] < 0 ? bins : static_cast<size_t>(rank_of[t]) * bins / ref.kept.size();
  };
  std::vector<double> expected(bins + 1, 0.0);
  for (TokenId t : ref.kept) expected[bin_of(t)] += ref.p[t];
  std::vector<int64_t> observed(bins + 1, 0);
  params.seed = seed;
  params.has_seed = true;
  SamplerState state{seed};
  std::vector<float> row;
  Drawn d;
  for (int i = 0; i < kSamples; ++i) {
    row = logits;
    SampledToken t;
    REQUIRE(sampler.sample(row, SamplingInput{&params, {}}, &state, &t).is_ok());
    ++observed[bin_of(t.token)];
    d.deepest_rank = std::max(d.deepest_rank, rank_of[t.token]);
  }
  CHECK(observed[bins] == 0);  // nothing outside the kept set
  d.fit = test::chi_square(observed, expected);
  return d;
}

}  // namespace

TEST_CASE("sampler.standard's partial sorts draw what a full sort of the vocabulary gives") {
  auto sampler = test::create_plugin<Sampler>("standard", "{}");
  struct Case {
    const char* what;
    float step;
    float temperature, top_p, min_p;
    int top_k;
    int64_t kept_at_least;  // the reference's kept set is at least this large
  };
  const Case cases[] = {
      {"no cuts (the whole vocabulary, unsorted)", 0.001f, 0.8f, 1.0f, 0.0f, 0, kVocab},
      {"top-p inside the first head", 0.004f, 1.0f, 0.5f, 0.0f, 0, 150},
      {"top-p past the first head", 0.004f, 1.0f, 0.9f, 0.0f, 0, 500},
      {"min-p past the first head", 0.002f, 0.7f, 1.0f, 0.3f, 0, 500},
      {"top-p and min-p", 0.002f, 1.2f, 0.95f, 0.5f, 0, 300},
      {"top-k, then top-p", 0.01f, 1.3f, 0.8f, 0.0f, 50, 30},
  };
  uint64_t seed = 17;
  for (const Case& c : cases) {
    const std::string what = c.what;
    INFO(what);
    SamplingParams params;
    params.temperature = c.temperature;
    params.top_p = c.top_p;
    params.min_p = c.min_p;
    params.top_k = c.top_k;
    const std::vector<float> logits = ramp(c.step, static_cast<uint32_t>(seed));
    const Reference ref = reference(logits, params);
    CHECK(static_cast<int64_t>(ref.kept.size()) >= c.kept_at_least);
    const Drawn d = draw_and_fit(*sampler, logits, params, seed++);
    MESSAGE(what << ": kept " << ref.kept.size() << " tokens, deepest rank drawn "
                   << d.deepest_rank << ", chi-square " << d.fit.statistic << ", df "
                   << d.fit.degrees_of_freedom << ", p-value " << d.fit.p_value);
    CHECK(d.fit.p_value > 1e-3);
    // Where the kept set runs past the first head, draws come from past it too.
    if (ref.kept.size() > 400) CHECK(d.deepest_rank > 256);
  }
}

TEST_CASE("sampler.standard: the test has power (a cut one token short is detected)") {
  // Drawing with top-p 0.9 checked against the reference for 0.85 must fail: the draws land
  // on tokens that reference excludes.
  auto sampler = test::create_plugin<Sampler>("standard", "{}");
  const std::vector<float> logits = ramp(0.004f, 5);
  SamplingParams drawn;
  drawn.temperature = 1.0f;
  drawn.top_p = 0.9f;
  SamplingParams narrower = drawn;
  narrower.top_p = 0.85f;
  const Reference ref = reference(logits, narrower);
  std::vector<bool> kept(logits.size(), false);
  for (TokenId t : ref.kept) kept[t] = true;
  drawn.seed = 3;
  drawn.has_seed = true;
  SamplerState state{3};
  int outside = 0;
  std::vector<float> row;
  for (int i = 0; i < 2000; ++i) {
    row = logits;
    SampledToken t;
    REQUIRE(sampler->sample(row, SamplingInput{&drawn, {}}, &state, &t).is_ok());
    outside += !kept[t.token];
  }
  CHECK(outside > 0);
}
