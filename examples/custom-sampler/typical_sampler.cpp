// sampler.typical: locally typical sampling (Meister et al., 2022, "Locally Typical
// Sampling"), an example of a third-party plugin built against the installed SDK.
//
// Instead of keeping the most likely tokens (top-k/top-p), it keeps the tokens whose
// surprisal -log p is closest to the distribution's entropy H, until they cover `typical_p`
// of the probability mass, then samples among them. The request's temperature, top_k and
// top_p apply first; temperature 0 is greedy, as for every sampler.
//
// Thread-safety: sample/verify only touch the per-sequence SamplerState the engine passes in,
// so one instance may serve many sequences from the engine's step thread.
#include <tessera/sdk.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

namespace {

using namespace tessera;

constexpr ParamSpec kParams[] = {
    {"typical_p", ParamType::kFloat, "0.95",
     "probability mass of the most typical tokens to sample from (1 keeps all)", 0.0, 1.0},
    {"min_keep", ParamType::kInt, "1", "keep at least this many candidates", 1, 1000000},
};

// splitmix64 over the sequence's own stream: reproducible for a seeded request whatever else
// shares the batch.
double next_uniform(SamplerState* state) {
  uint64_t z = (state->rng += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return static_cast<double>(z >> 11) * 0x1.0p-53;
}

class TypicalSampler final : public Sampler {
 public:
  TypicalSampler(double typical_p, int64_t min_keep) : typical_p_(typical_p), min_keep_(min_keep) {}

  static Status create(const PluginConfig& config, const PluginContext& context,
                       std::unique_ptr<Sampler>* out) {
    double p = config.get_float("typical_p", 0.95);
    if (p <= 0.0) return invalid_argument("typical_p must be > 0 (got 0)");
    *out = std::make_unique<TypicalSampler>(p, config.get_int("min_keep", 1));
    if (context.logger && context.logger->enabled(LogLevel::kDebug))
      context.logger->log(LogLevel::kDebug, "sampler.typical: typical_p=" + std::to_string(p));
    return Status::ok();
  }

  Status sample(std::span<float> logits, const SamplingInput& input, SamplerState* state,
                SampledToken* out) override {
    if (logits.empty()) return invalid_argument("empty logits row");
    if (!input.params) return invalid_argument("no sampling params");
    out->token = pick(logits, *input.params, state);
    fill_logprobs(logits, *input.params, out);
    return Status::ok();
  }

  // Greedy requests accept a draft iff it is the argmax. Otherwise each position is sampled
  // from this sampler's distribution and a draft is accepted iff the sample equals it, which
  // leaves the output distribution exactly that of non-speculative sampling.
  Status verify(std::span<const std::span<float>> logits, const DraftView& drafts,
                const SamplingInput& input, SamplerState* state,
                std::vector<SampledToken>* out) override {
    if (logits.size() != drafts.tokens.size() + 1)
      return invalid_argument("verify needs one more row of logits than drafts");
    if (!input.params) return invalid_argument("no sampling params");
    for (size_t i = 0; i < logits.size(); ++i) {
      if (logits[i].empty()) return invalid_argument("empty logits row");
      SampledToken token;
      token.token = pick(logits[i], *input.params, state);
      fill_logprobs(logits[i], *input.params, &token);
      out->push_back(std::move(token));
      if (i < drafts.tokens.size() && out->back().token != drafts.tokens[i]) break;
    }
    return Status::ok();
  }

 private:
  static TokenId argmax(std::span<const float> logits) {
    return static_cast<TokenId>(std::max_element(logits.begin(), logits.end()) - logits.begin());
  }

  TokenId pick(std::span<const float> logits, const SamplingParams& params,
               SamplerState* state) const {
    if (params.is_greedy()) return argmax(logits);
    const size_t n = logits.size();
    // Log-softmax of logits / temperature, in double for a stable entropy.
    const double inv_t = 1.0 / params.temperature;
    double max = -INFINITY;
    for (float l : logits) max = std::max(max, l * inv_t);
    double sum = 0;
    for (float l : logits) sum += std::exp(l * inv_t - max);
    const double log_z = max + std::log(sum);
    std::vector<double> logp(n), prob(n);
    for (size_t i = 0; i < n; ++i) {
      logp[i] = logits[i] * inv_t - log_z;
      prob[i] = std::exp(logp[i]);
    }
    // The request's top_k and top_p apply first, as in llama.cpp's sampler chain (and as the
    // sampler conformance suite asks of every sampler): typical filtering then works on the
    // tokens they keep, renormalized.
    std::vector<TokenId> likely(n);
    std::iota(likely.begin(), likely.end(), 0);
    std::stable_sort(likely.begin(), likely.end(), [&](TokenId a, TokenId b) { return prob[a] > prob[b]; });
    size_t num_kept = n;
    if (params.top_k > 0) num_kept = std::min(num_kept, static_cast<size_t>(params.top_k));
    if (params.top_p < 1.0f) {
      // The smallest set of most likely tokens whose mass reaches top_p.
      double nucleus = 0;
      size_t i = 0;
      while (i < num_kept && nucleus < params.top_p) nucleus += prob[likely[i++]];
      num_kept = std::max<size_t>(i, 1);
    }
    double kept_mass = 0;
    for (size_t i = 0; i < num_kept; ++i) kept_mass += prob[likely[i]];
    for (size_t i = num_kept; i < n; ++i) prob[likely[i]] = 0;
    double entropy = 0;
    for (size_t i = 0; i < num_kept; ++i) {
      const TokenId t = likely[i];
      prob[t] /= kept_mass;
      logp[t] = std::log(prob[t]);
      if (prob[t] > 0) entropy -= prob[t] * logp[t];
    }
    // Most typical first: smallest distance between surprisal and entropy (tokens cut above
    // last). Distances are computed once; the sort is the cost that dominates over a
    // 50k-token vocabulary.
    std::vector<double> distance(n, INFINITY);
    for (size_t i = 0; i < num_kept; ++i) distance[likely[i]] = std::fabs(-logp[likely[i]] - entropy);
    std::vector<TokenId> order(n);
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(),
              [&](TokenId a, TokenId b) { return distance[a] < distance[b]; });
    size_t keep = 0;
    double mass = 0;
    while (keep < num_kept && (mass < typical_p_ || keep < static_cast<size_t>(min_keep_))) {
      mass += prob[order[keep]];
      ++keep;
    }
    double r = next_uniform(state) * mass;
    for (size_t i = 0; i < keep; ++i) {
      r -= prob[order[i]];
      if (r <= 0) return order[i];
    }
    return order[keep - 1];  // rounding left a sliver of mass
  }

  // The SDK's contract: logprobs are the log-softmax of the raw logits.
  static void fill_logprobs(std::span<const float> logits, const SamplingParams& params,
                            SampledToken* out) {
    float max = *std::max_element(logits.begin(), logits.end());
    double sum = 0;
    for (float l : logits) sum += std::exp(static_cast<double>(l - max));
    const float log_z = max + static_cast<float>(std::log(sum));
    out->logprob = logits[out->token] - log_z;
    out->top.clear();
    const int k = std::min<int>(params.num_logprobs, static_cast<int>(logits.size()));
    if (k <= 0) return;
    std::vector<TokenId> ids(logits.size());
    std::iota(ids.begin(), ids.end(), 0);
    std::partial_sort(ids.begin(), ids.begin() + k, ids.end(),
                      [&](TokenId a, TokenId b) { return logits[a] > logits[b]; });
    for (int i = 0; i < k; ++i) out->top.push_back({ids[i], logits[ids[i]] - log_z});
  }

  double typical_p_;
  int64_t min_keep_;
};

}  // namespace

TESSERA_REGISTER_PLUGIN(TypicalSampler, tessera::Sampler, "typical", "0.1.0",
                        "locally typical sampling (keeps tokens whose surprisal is near the "
                        "entropy)",
                        kParams)
