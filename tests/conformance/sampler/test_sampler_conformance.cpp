// Every sampler plugin (the build's and any on TESSERA_PLUGIN_PATH): greedy picks the argmax
// with its log-softmax; a seeded state reproduces its draws and states are independent;
// top-k and top-p draw only from their support sets (and from more than one token of them);
// top logprobs are the most likely tokens in order; greedy verification accepts exactly the
// drafts that are the argmax and then samples one token, as non-speculative decoding would.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "support/plugins.h"
#include "tessera/sdk.h"

using namespace tessera;

namespace {

constexpr int kVocab = 300;

std::vector<float> random_logits(uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 2.0f);
  std::vector<float> v(kVocab);
  for (float& x : v) x = dist(rng);
  return v;
}

double log_softmax_at(const std::vector<float>& logits, TokenId token) {
  const float m = *std::max_element(logits.begin(), logits.end());
  double z = 0.0;
  for (float l : logits) z += std::exp(static_cast<double>(l - m));
  return logits[token] - m - std::log(z);
}

TokenId argmax(const std::vector<float>& logits) {
  return static_cast<TokenId>(std::max_element(logits.begin(), logits.end()) - logits.begin());
}

SampledToken sample(Sampler& s, std::vector<float> logits, const SamplingParams& params, SamplerState* state) {
  SamplingInput input{&params, {}};
  SampledToken out;
  REQUIRE(s.sample(logits, input, state, &out).is_ok());
  return out;
}

// `n` draws with a fresh state seeded `seed`.
std::vector<TokenId> draws(Sampler& s, const std::vector<float>& logits, SamplingParams params, uint64_t seed, int n) {
  params.seed = seed;
  params.has_seed = true;
  SamplerState state{seed};
  std::vector<TokenId> out;
  for (int i = 0; i < n; ++i) out.push_back(sample(s, logits, params, &state).token);
  return out;
}

}  // namespace

TEST_CASE("every sampler keeps the greedy, seeded, top-k/top-p and verify contracts") {
  test::check_no_load_errors();
  const auto names = test::plugin_names(PluginKind::kSampler);
  REQUIRE(!names.empty());
  for (const std::string& name : names) {
    INFO("sampler." << name);
    auto s = test::create_plugin<Sampler>(name, test::conformance_params(PluginKind::kSampler, name, "{}"));

    // Greedy: the argmax, with log-softmax of the raw logits; top logprobs in order.
    SamplingParams greedy;
    greedy.temperature = 0.0f;
    greedy.num_logprobs = 4;
    for (uint32_t seed = 1; seed <= 20; ++seed) {
      const auto logits = random_logits(seed);
      SamplerState state{seed};
      const SampledToken t = sample(*s, logits, greedy, &state);
      CHECK(t.token == argmax(logits));
      CHECK(std::fabs(t.logprob - log_softmax_at(logits, t.token)) < 1e-3);
      REQUIRE(t.top.size() == 4);
      std::vector<TokenId> order(kVocab);
      std::iota(order.begin(), order.end(), 0);
      std::partial_sort(order.begin(), order.begin() + 4, order.end(),
                        [&](TokenId a, TokenId b) { return logits[a] > logits[b]; });
      for (int i = 0; i < 4; ++i) {
        CHECK(t.top[i].token == order[i]);
        CHECK(std::fabs(t.top[i].logprob - log_softmax_at(logits, order[i])) < 1e-3);
      }
    }

    // Seeded: the same seed draws the same tokens, whatever runs in between; another seed
    // draws another sequence (flat-ish logits at temperature 1: 40 equal draws by chance is
    // far below 1e-20).
    SamplingParams random;
    random.temperature = 1.0f;
    std::vector<float> flat = random_logits(77);
    for (float& l : flat) l *= 0.1f;
    const auto a = draws(*s, flat, random, 1234, 40);
    (void)draws(*s, flat, random, 999, 13);
    CHECK(draws(*s, flat, random, 1234, 40) == a);
    CHECK(draws(*s, flat, random, 4321, 40) != a);
    CHECK(std::set<TokenId>(a.begin(), a.end()).size() > 5);

    // top-k: only the k largest, and more than one of them.
    SamplingParams top_k = random;
    top_k.top_k = 3;
    std::vector<TokenId> order(kVocab);
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(), [&](TokenId x, TokenId y) { return flat[x] > flat[y]; });
    const std::set<TokenId> top3(order.begin(), order.begin() + 3);
    const auto k_draws = draws(*s, flat, top_k, 5, 200);
    for (TokenId t : k_draws) CHECK(top3.count(t) == 1);
    CHECK(std::set<TokenId>(k_draws.begin(), k_draws.end()).size() > 1);

    // top-p: probabilities 0.4, 0.3, 0.2 and the rest 0.1 spread thin; p = 0.75 keeps
    // exactly the first three (the smallest set whose mass reaches p).
    std::vector<float> shaped(kVocab, std::log(0.1f / (kVocab - 3)));
    shaped[10] = std::log(0.4f);
    shaped[20] = std::log(0.3f);
    shaped[30] = std::log(0.2f);
    SamplingParams top_p = random;
    top_p.top_p = 0.75f;
    const auto p_draws = draws(*s, shaped, top_p, 6, 300);
    for (TokenId t : p_draws) CHECK((t == 10 || t == 20 || t == 30));
    CHECK(std::set<TokenId>(p_draws.begin(), p_draws.end()).size() == 3);

    // Greedy verification: drafts that are the argmax are accepted, the first that is not is
    // replaced by the argmax, and nothing after it is kept.
    std::vector<std::vector<float>> rows;
    for (uint32_t i = 0; i < 4; ++i) rows.push_back(random_logits(100 + i));
    std::vector<std::span<float>> spans(rows.begin(), rows.end());
    const std::vector<TokenId> all_right = {argmax(rows[0]), argmax(rows[1]), argmax(rows[2])};
    SamplingParams verify_params;
    verify_params.temperature = 0.0f;
    SamplingInput input{&verify_params, {}};
    SamplerState state{1};
    std::vector<SampledToken> out;
    REQUIRE(s->verify(spans, DraftView{all_right, {}}, input, &state, &out).is_ok());
    REQUIRE(out.size() == 4);
    for (int i = 0; i < 4; ++i) CHECK(out[i].token == argmax(rows[i]));
    std::vector<TokenId> second_wrong = all_right;
    second_wrong[1] = (argmax(rows[1]) + 1) % kVocab;
    // verify may modify the rows it is given: fresh ones for the second call.
    for (uint32_t i = 0; i < 4; ++i) rows[i] = random_logits(100 + i);
    spans.assign(rows.begin(), rows.end());
    out.clear();
    REQUIRE(s->verify(spans, DraftView{second_wrong, {}}, input, &state, &out).is_ok());
    REQUIRE(out.size() == 2);
    CHECK(out[0].token == argmax(rows[0]));
    CHECK(out[1].token == argmax(rows[1]));
  }
}
