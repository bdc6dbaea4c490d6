// drafter.ngram: prompt lookup decoding (llama.cpp's ngram-simple / lookup, vLLM's `ngram`).
// The last n tokens of a sequence (n from max_ngram down to min_ngram) are looked up earlier
// in the same sequence — its prompt and its output so far — and the tokens that followed the
// match are proposed as drafts. Pays off when the output copies its input (summaries,
// rewrites, code edits, extraction); costs one lookup per sequence and step otherwise.
// Deterministic (q one-hot) and stateless; not thread-safe (engine thread only).
#include <algorithm>
#include <memory>
#include <span>
#include <string>

#include "tessera/sdk.h"

namespace tessera {
namespace {

const ParamSpec kParams[] = {
    {"num_draft_tokens", ParamType::kInt, "4", "most draft tokens proposed per sequence and step", 1,
     32},
    {"min_ngram", ParamType::kInt, "2", "shortest suffix that may be matched", 1, 64},
    {"max_ngram", ParamType::kInt, "4", "longest suffix tried (the longest match wins)", 1, 64},
    {"adaptive", ParamType::kBool, "true",
     "the engine fits each sequence's draft count to its acceptance and the measured step cost, "
     "down to none when verification costs more than it saves"},
};

// Where the continuation of the best earlier match of `tokens`' suffix starts, or -1. Best:
// the longest match of length in [min_n, max_n]; among equals, the most recent one. One scan
// from the end: for each earlier end position j, the match length is how many tokens before
// and at j equal the suffix, capped at max_n.
int64_t find_continuation(std::span<const TokenId> tokens, int32_t min_n, int32_t max_n) {
  const int64_t len = static_cast<int64_t>(tokens.size());
  if (len < min_n + 1) return -1;
  int64_t best_start = -1;
  int32_t best_len = min_n - 1;
  // j is the last token of a candidate occurrence; j < len - 1 so that a continuation exists
  // and the suffix is not matched against itself.
  for (int64_t j = len - 2; j >= 0; --j) {
    if (tokens[j] != tokens[len - 1]) continue;
    int32_t m = 1;
    while (m < max_n && j - m >= 0 && tokens[j - m] == tokens[len - 1 - m]) ++m;
    if (m > best_len) {
      best_len = m;
      best_start = j + 1;
      if (m == max_n) break;  // nothing longer exists; the most recent longest wins
    }
  }
  return best_start;
}

class NgramDrafter final : public Drafter {
 public:
  NgramDrafter(int32_t min_n, int32_t max_n) : min_n_(min_n), max_n_(max_n) {}

  Status propose(std::span<const DraftRequest> requests) override {
    for (const DraftRequest& r : requests) {
      const std::span<const TokenId> tokens = r.seq->tokens;
      const int64_t start = find_continuation(tokens, min_n_, max_n_);
      if (start < 0) continue;
      const int64_t n = std::min<int64_t>(r.max_drafts, static_cast<int64_t>(tokens.size()) - start);
      r.out->tokens.insert(r.out->tokens.end(), tokens.begin() + start, tokens.begin() + start + n);
    }
    return Status::ok();
  }

  void on_drafts_settled(SeqId, int32_t, int32_t) override {}  // stateless
  void forget(SeqId) override {}

  static Status create(const PluginConfig& config, const PluginContext&, std::unique_ptr<Drafter>* out) {
    const auto min_n = static_cast<int32_t>(config.get_int("min_ngram"));
    const auto max_n = static_cast<int32_t>(config.get_int("max_ngram"));
    if (min_n > max_n)
      return invalid_argument(config.key_path() + ".min_ngram: must not exceed max_ngram (" +
                              std::to_string(max_n) + "), got " + std::to_string(min_n));
    *out = std::make_unique<NgramDrafter>(min_n, max_n);
    return Status::ok();
  }

 private:
  int32_t min_n_, max_n_;
};

}  // namespace
}  // namespace tessera

TESSERA_REGISTER_PLUGIN(tessera::NgramDrafter, tessera::Drafter, "ngram", "0.1.0",
                        "prompt lookup: drafts the tokens that followed the longest earlier match of the suffix",
                        tessera::kParams)
