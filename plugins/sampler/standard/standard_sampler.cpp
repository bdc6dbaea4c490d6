// sampler.standard: the llama.cpp sampling chain — penalties (repetition, presence,
// frequency), then top-k, top-p, min-p, temperature and a draw from the softmax — or argmax
// when temperature is 0. Draws come from a per-sequence counter-based random stream, so a
// seeded request samples the same tokens whatever else shares its batch.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <numeric>
#include <string>
#include <unordered_map>
#include <vector>

#include "tessera/sdk/kernels/cpu_kernels.h"

#include "tessera/sdk.h"

namespace tessera {
namespace {

// splitmix64: a tiny, high-quality generator whose whole state is one integer, which the
// engine keeps per sequence (SamplerState::rng).
uint64_t next_random(uint64_t* state) {
  uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
// Uniform in [0, 1) with 53 bits.
double next_uniform(uint64_t* state) { return (next_random(state) >> 11) * 0x1.0p-53; }

struct Candidate {
  TokenId token;
  float logit;
};

class StandardSampler final : public Sampler {
 public:
  Status sample(std::span<float> logits, const SamplingInput& input, SamplerState* state,
                SampledToken* out) override {
    const SamplingParams& p = *input.params;
    const bool penalized = has_penalties(p);
    const TokenId raw_argmax = fill_logprobs(logits, p.num_logprobs, penalized, out);
    apply_penalties(logits, input);
    if (p.is_greedy())
      out->token = penalized ? argmax(logits) : raw_argmax;  // unpenalized: the same row
    else
      out->token = draw(logits, p, state);
    out->logprob = logprob_of(out->token, logits, penalized);
    return Status::ok();
  }

  Status verify(std::span<const std::span<float>> logits, const DraftView& drafts,
                const SamplingInput& input, SamplerState* state,
                std::vector<SampledToken>* out) override {
    const size_t k = drafts.tokens.size();
    if (logits.size() != k + 1) return invalid_argument("verify: need one more logits row than drafts");
    const size_t vocab = logits[0].size();
    if (!drafts.q.empty() && drafts.q.size() != k * vocab)
      return invalid_argument("verify: q must hold one vocabulary row per draft (" +
                              std::to_string(k * vocab) + " floats), got " + std::to_string(drafts.q.size()));
    const SamplingParams& p = *input.params;
    // Penalties at draft position i see the history plus the drafts accepted before it; only
    // then is the history copied (a copy that grows with the sequence would allocate).
    const bool penalized = has_penalties(p);
    if (penalized) history_.assign(input.history.begin(), input.history.end());
    for (size_t i = 0; i <= k; ++i) {
      SamplingInput step{&p, penalized ? std::span<const TokenId>(history_) : input.history};
      SampledToken token;
      std::span<float> row = logits[i];
      const TokenId raw_argmax = fill_logprobs(row, p.num_logprobs, penalized, &token);
      apply_penalties(row, step);
      if (p.is_greedy()) {
        // The bonus token after every accepted draft (i == k) comes from the last row alike.
        token.token = penalized ? argmax(row) : raw_argmax;
      } else if (i == k) {
        // Every draft accepted: the bonus token is drawn from the last row.
        token.token = draw(row, p, state);
      } else if (drafts.q.empty()) {
        // A deterministic drafter (q one-hot): draw exactly as plain sampling does and keep
        // the draft if the draw equals it. That is rejection sampling against a one-hot q
        // (accepted with probability p(draft), otherwise a draw from p without the draft),
        // and it spends the random stream one draw per emitted token, as plain sampling
        // does: a seeded request gives the same tokens with or without drafts, whatever
        // the drafter proposed (drafts that depend on other requests, as suffix's global
        // cache, included).
        token.token = draw(row, p, state);
      } else {
        const std::span<const float> q =
            drafts.q.empty() ? std::span<const float>() : drafts.q.subspan(i * vocab, vocab);
        token.token = accept_or_resample(filtered_probs(row, p), drafts.tokens[i], q, state);
      }
      token.logprob = logprob_of(token.token, row, penalized);
      out->push_back(token);
      if (i == k || token.token != drafts.tokens[i]) break;
      if (penalized) history_.push_back(token.token);
    }
    return Status::ok();
  }

  // Rejection sampling (Leviathan et al.; Chen et al.): keep the draft with probability
  // min(1, p/q) at it, otherwise draw from norm(max(0, p - q)); the result is distributed as
  // p whatever q is. verify calls it only for drafts with a q (for a one-hot q it draws
  // directly, see above); an empty q here still means one-hot at the draft.
  TokenId accept_or_resample(const std::vector<float>& probs, TokenId draft, std::span<const float> q,
                             SamplerState* state) {
    const double p_draft = probs[draft];
    const double q_draft = q.empty() ? 1.0 : q[draft];
    const double accept = q_draft > 0 ? std::min(1.0, p_draft / q_draft) : (p_draft > 0 ? 1.0 : 0.0);
    if (next_uniform(&state->rng) < accept) return draft;
    residual_.assign(probs.begin(), probs.end());
    double mass = 0.0;
    for (size_t t = 0; t < residual_.size(); ++t) {
      const float qt = q.empty() ? (static_cast<TokenId>(t) == draft ? 1.0f : 0.0f) : q[t];
      residual_[t] = std::max(0.0f, residual_[t] - qt);
      mass += residual_[t];
    }
    // p <= q everywhere (p == q up to rounding): a rejection is then (almost) impossible, and
    // p itself is the right fallback.
    return draw_from(mass > 0 ? residual_ : probs, state);
  }

  static Status create(const PluginConfig&, const PluginContext&, std::unique_ptr<Sampler>* out) {
    *out = std::make_unique<StandardSampler>();
    return Status::ok();
  }

 private:
  // std::max_element's index (the first greatest), vectorized: a scalar pass over a
  // 49,152-token vocabulary per token was ~1 % of a 16-client greedy serving profile.
  static TokenId argmax(std::span<const float> logits) {
    return static_cast<TokenId>(argmax_row(logits.data(), static_cast<int64_t>(logits.size())));
  }
  static float max_logit(std::span<const float> logits) {
    return logits[static_cast<size_t>(argmax(logits))];
  }
  static bool has_penalties(const SamplingParams& p) {
    return p.repetition_penalty != 1.0f || p.presence_penalty != 0.0f || p.frequency_penalty != 0.0f;
  }

  // Log-softmax of the raw logits (before penalties and filters), as OpenAI reports them.
  // Returns the raw row's argmax (the greedy token when nothing penalizes) and, only when
  // penalties will change the row in place, keeps a copy of it for logprob_of.
  TokenId fill_logprobs(std::span<const float> logits, int32_t num_top, bool penalized, SampledToken* out) {
    const TokenId raw_argmax = argmax(logits);
    const float max = logits[static_cast<size_t>(raw_argmax)];  // max_logit without a second pass
    // Every token pays for this normalizer (over the whole vocabulary), on the engine's
    // thread while the workers wait, so the exponentials are single precision, 8 lanes at a
    // time (ggml's exp, within 1.5 ulp), and only the sum is kept in double: glibc's expf per
    // logit was ~5% of a 16-sequence serving run's wall time.
    const double sum = sum_exp_shifted(logits.data(), static_cast<int64_t>(logits.size()), max);
    log_norm_ = max + static_cast<float>(std::log(sum));
    if (penalized) raw_logits_.assign(logits.begin(), logits.end());
    out->top.clear();
    if (num_top <= 0) return raw_argmax;
    const size_t k = std::min<size_t>(num_top, logits.size());
    index_.resize(logits.size());
    std::iota(index_.begin(), index_.end(), 0);
    std::partial_sort(index_.begin(), index_.begin() + k, index_.end(),
                      [&](TokenId a, TokenId b) { return logits[a] > logits[b]; });
    for (size_t i = 0; i < k; ++i) out->top.push_back({index_[i], logits[index_[i]] - log_norm_});
    return raw_argmax;
  }
  // `logits` is the row fill_logprobs saw: penalized in place (its raw copy is then in
  // raw_logits_) or, without penalties, as it was.
  float logprob_of(TokenId token, std::span<const float> logits, bool penalized) const {
    return (penalized ? raw_logits_[token] : logits[static_cast<size_t>(token)]) - log_norm_;
  }

  // llama.cpp's penalties over the last penalty_last_n tokens of the history.
  void apply_penalties(std::span<float> logits, const SamplingInput& input) {
    const SamplingParams& p = *input.params;
    if (p.repetition_penalty == 1.0f && p.presence_penalty == 0.0f && p.frequency_penalty == 0.0f)
      return;
    size_t n = input.history.size();
    if (p.penalty_last_n >= 0) n = std::min(n, static_cast<size_t>(p.penalty_last_n));
    counts_.clear();
    for (size_t i = input.history.size() - n; i < input.history.size(); ++i) ++counts_[input.history[i]];
    for (const auto& [token, count] : counts_) {
      if (token < 0 || static_cast<size_t>(token) >= logits.size()) continue;
      float& l = logits[token];
      if (p.repetition_penalty != 1.0f) l = l > 0 ? l / p.repetition_penalty : l * p.repetition_penalty;
      l -= static_cast<float>(count) * p.frequency_penalty + (count > 0 ? p.presence_penalty : 0.0f);
    }
  }

  // top-k, top-p, min-p and temperature; returns probabilities over the whole vocabulary
  // (zero outside the kept set). Only as much of the vocabulary is sorted as the cuts need:
  // none without cuts (OpenAI's defaults, temperature 1 and top_p 1), the top k with top-k,
  // and a sorted head grown until top-p and min-p are decided without it. A full sort of a
  // 49,152-token vocabulary per sampled token, on the engine thread while the workers wait,
  // was 60 % of a 16-client serving run at temperature 0.7 (docs/benchmarks.md).
  const std::vector<float>& filtered_probs(std::span<const float> logits, const SamplingParams& p) {
    const size_t n = logits.size();
    const float temperature = std::max(p.temperature, 1e-6f);
    const bool top_k = p.top_k > 0 && static_cast<size_t>(p.top_k) < n;
    const bool cuts = p.top_p < 1.0f || p.min_p > 0.0f;
    if (!top_k && !cuts) {
      // The whole vocabulary is kept: a softmax in token order, nothing to sort.
      const float max = max_logit(logits);
      probs_.resize(n);
      const double sum = exp_shifted_row(logits.data(), probs_.data(), static_cast<int64_t>(n),
                                         max, temperature);
      for (float& v : probs_) v = static_cast<float>(v / sum);
      return probs_;
    }
    auto by_logit = [](const Candidate& a, const Candidate& b) { return a.logit > b.logit; };
    candidates_.resize(n);
    for (size_t i = 0; i < n; ++i) candidates_[i] = {static_cast<TokenId>(i), logits[i]};
    // Softmax at temperature 1 over candidates_[0, m) for the top-p / min-p cuts, as
    // llama.cpp's chain does, normalized by `sum` (over the candidates after top-k).
    auto unit_softmax = [&](size_t m, double sum) {
      probs_sorted_.resize(m);
      const float max = candidates_[0].logit;
      for (size_t i = 0; i < m; ++i)
        probs_sorted_[i] = static_cast<float>(std::exp(candidates_[i].logit - max) / sum);
    };
    size_t keep = n;
    if (top_k) {
      keep = p.top_k;
      std::partial_sort(candidates_.begin(), candidates_.begin() + keep, candidates_.end(), by_logit);
      candidates_.resize(keep);
      if (cuts) {
        double sum = 0.0;
        const float max = candidates_[0].logit;
        for (const Candidate& c : candidates_) sum += std::exp(c.logit - max);
        unit_softmax(keep, sum);
        bool decided;  // always: the whole top k is in hand
        candidates_.resize(kept_by_cuts(keep, p, &decided));
      }
    } else {
      // No top-k: the cuts' normalizer is the whole vocabulary's; the head they keep is
      // sorted 256 candidates at a time more, times 8, until the cuts end inside it.
      const float max = max_logit(logits);
      const double sum = sum_exp_shifted(logits.data(), static_cast<int64_t>(n), max);
      size_t head = std::min<size_t>(n, 256);
      for (;;) {
        std::partial_sort(candidates_.begin(), candidates_.begin() + head, candidates_.end(), by_logit);
        unit_softmax(head, sum);
        bool decided;
        keep = kept_by_cuts(head, p, &decided);
        if (decided || head == n) break;
        head = std::min(n, head * 8);
      }
      candidates_.resize(keep);
    }
    // Temperature over the kept candidates, in their sorted order.
    probs_sorted_.resize(candidates_.size());
    const float max = candidates_[0].logit;
    double sum = 0.0;
    for (size_t i = 0; i < candidates_.size(); ++i) {
      probs_sorted_[i] = std::exp((candidates_[i].logit - max) / temperature);
      sum += probs_sorted_[i];
    }
    probs_.assign(n, 0.0f);
    for (size_t i = 0; i < candidates_.size(); ++i)
      probs_[candidates_[i].token] = static_cast<float>(probs_sorted_[i] / sum);
    return probs_;
  }

  // top-p, then min-p (llama.cpp's order), over the sorted probs_sorted_[0, head): how many
  // candidates they keep. *decided: whether a cut ends inside the head, so that candidates past
  // it (no more probable than its last) could not change the result.
  size_t kept_by_cuts(size_t head, const SamplingParams& p, bool* decided) const {
    size_t keep = head;
    *decided = false;
    if (p.top_p < 1.0f) {
      double cum = 0.0;
      for (size_t i = 0; i < head; ++i) {
        cum += probs_sorted_[i];
        if (cum >= p.top_p) {
          keep = i + 1;
          *decided = true;
          break;
        }
      }
    }
    if (p.min_p > 0.0f) {
      const float threshold = probs_sorted_[0] * p.min_p;
      size_t last = 1;
      while (last < keep && probs_sorted_[last] >= threshold) ++last;
      *decided = *decided || last < keep;
      keep = last;
    }
    return keep;
  }

  TokenId draw_from(const std::vector<float>& probs, SamplerState* state) {
    double total = 0.0;
    for (float v : probs) total += v;
    double r = next_uniform(&state->rng) * total;
    TokenId last_nonzero = 0;
    for (size_t i = 0; i < probs.size(); ++i) {
      if (probs[i] <= 0.0f) continue;
      last_nonzero = static_cast<TokenId>(i);
      r -= probs[i];
      if (r < 0) return last_nonzero;
    }
    return last_nonzero;  // rounding left r >= 0: the last candidate
  }

  TokenId draw(std::span<const float> logits, const SamplingParams& p, SamplerState* state) {
    return draw_from(filtered_probs(logits, p), state);
  }

  // Scratch reused across calls (one sampler serves one engine thread).
  std::vector<Candidate> candidates_;
  std::vector<float> probs_sorted_, probs_, raw_logits_, residual_;
  std::vector<TokenId> history_;
  std::vector<TokenId> index_;
  std::unordered_map<TokenId, int32_t> counts_;
  float log_norm_ = 0.0f;
};

}  // namespace
}  // namespace tessera

TESSERA_REGISTER_PLUGIN(tessera::StandardSampler, tessera::Sampler, "standard", "0.1.0",
                        "greedy, temperature, top-k, top-p, min-p, penalties; seeded",
                        TESSERA_NO_PARAMS)
