// drafter.suffix: suffix decoding (Oliaro et al., "SuffixDecoding", arXiv 2411.04975; the
// `suffix` method of ArcticInference / vLLM). Two indexes answer "where did the last tokens
// of this sequence occur before, and what followed?":
//   - per sequence: its prompt and output so far (what prompt lookup sees), and
//   - a bounded global cache of earlier requests' outputs (agentic loops, repeated
//     templates, the same question asked again: the answer's shape is already known).
// Each index maps a token to the positions holding it; a query extends every occurrence of
// the sequence's last token backwards to find the longest suffix match (up to max_match
// tokens), then walks forward from all occurrences of that longest match at once, taking at
// each position the continuation most of them agree on (the most frequent child of the
// matched suffix-tree node, computed on the fly instead of stored: the same answers as a
// depth-bounded suffix tree without a node per substring, and no depth limit on drafts).
// The walk stops when the running product of agreement shares falls under min_token_prob,
// and after ceil(spec_factor × match length) tokens: a long match earns long drafts, a
// one-token match a short one. The candidate with the larger expected accepted length (sum
// of running products) of the two indexes wins.
// Deterministic (q one-hot); engine thread only.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <deque>
#include <memory>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "tessera/sdk.h"

namespace tessera {
namespace {

const ParamSpec kParams[] = {
    {"num_draft_tokens", ParamType::kInt, "8", "most draft tokens proposed per sequence and step", 1, 32},
    {"min_match", ParamType::kInt, "2", "shortest suffix match that may propose drafts", 1, 64},
    {"max_match", ParamType::kInt, "16", "longest suffix matched (longer matches count as this long)", 1, 64},
    {"spec_factor", ParamType::kFloat, "1.0",
     "drafts per step at most ceil(spec_factor × match length): long matches earn long drafts", 0.1, 16},
    {"min_token_prob", ParamType::kFloat, "0.1",
     "stop drafting when the share of matches agreeing on every drafted token so far falls under this", 0,
     1},
    {"global_cache_tokens", ParamType::kInt, "65536",
     "output tokens of finished requests kept for matching (oldest requests dropped first); 0 turns "
     "the global cache off",
     0, 1 << 24},
    {"max_candidates", ParamType::kInt, "1024",
     "most recent occurrences of the last token examined per index and query (bounds the cost of "
     "very common tokens)",
     1, 1 << 20},
    {"adaptive", ParamType::kBool, "true",
     "the engine fits each sequence's draft count to its acceptance and the measured step cost, "
     "down to none when verification costs more than it saves"},
};

struct Settings {
  int32_t min_match = 2;
  int32_t max_match = 16;
  double spec_factor = 1.0;
  double min_token_prob = 0.1;
  int64_t global_cache_tokens = 65536;
  int32_t max_candidates = 1024;
};

// One drafting candidate: the tokens and the expected number of them accepted if each is
// accepted with the share of matches that agreed on it (the score both indexes compete on).
struct Candidate {
  std::vector<TokenId> tokens;
  double score = 0.0;

  void clear() { tokens.clear(), score = 0.0; }
};

// Where one occurrence of the matched suffix continues: text `text`, position `pos`.
struct Cursor {
  const std::vector<TokenId>* text;
  int64_t pos;
};

// How many tokens before and at text[end] equal the last tokens of `suffix`, up to `cap`.
int32_t backward_match(const std::vector<TokenId>& text, int64_t end, std::span<const TokenId> suffix, int32_t cap) {
  int32_t m = 0;
  const int64_t n = static_cast<int64_t>(suffix.size());
  while (m < cap && end - m >= 0 && m < n && text[end - m] == suffix[n - 1 - m]) ++m;
  return m;
}

// The frequency walk shared by both indexes: from every cursor at once, take the token most
// of them continue with (ties: the one of the first cursor among the tied, cursors being in
// most-recent-first order), keep the
// cursors that agree, repeat. `counts` is scratch (token -> count), cleared on return.
void walk(std::vector<Cursor>& cursors, int32_t budget, double min_prob, Candidate* out,
          std::unordered_map<TokenId, int32_t>& counts) {
  double running = 1.0;
  for (int32_t step = 0; step < budget && !cursors.empty(); ++step) {
    counts.clear();
    int32_t best_count = 0;
    for (const Cursor& c : cursors) {
      if (c.pos >= static_cast<int64_t>(c.text->size())) continue;  // this occurrence ends here
      best_count = std::max(best_count, ++counts[(*c.text)[c.pos]]);
    }
    if (best_count == 0) break;
    TokenId best = -1;
    for (const Cursor& c : cursors)
      if (c.pos < static_cast<int64_t>(c.text->size()) && counts[(*c.text)[c.pos]] == best_count) {
        best = (*c.text)[c.pos];
        break;
      }
    // The share includes occurrences that end without a continuation: they vote "stop".
    running *= static_cast<double>(best_count) / static_cast<double>(cursors.size());
    if (running < min_prob) break;
    out->tokens.push_back(best);
    out->score += running;
    size_t kept = 0;
    for (const Cursor& c : cursors)
      if (c.pos < static_cast<int64_t>(c.text->size()) && (*c.text)[c.pos] == best) cursors[kept++] = {c.text, c.pos + 1};
    cursors.resize(kept);
  }
  counts.clear();
}

// Occurrences of tokens in one growing text: token -> its positions, ascending.
class TokenPositions {
 public:
  void add(TokenId t, int64_t pos) { index_[t].push_back(pos); }
  const std::vector<int64_t>* find(TokenId t) const {
    auto it = index_.find(t);
    return it == index_.end() ? nullptr : &it->second;
  }
  void clear() { index_.clear(); }

 private:
  std::unordered_map<TokenId, std::vector<int64_t>> index_;
};

// The index of one sequence: a copy of its tokens (prompt + committed output) and their
// positions, extended with the tokens committed since the last query.
struct SequenceIndex {
  std::vector<TokenId> text;
  TokenPositions positions;
  int32_t num_prompt_tokens = 0;

  void sync(std::span<const TokenId> tokens, int32_t prompt_tokens) {
    // The engine only appends between queries (drafts are not part of `tokens`). Should the
    // text ever not extend what was indexed, rebuild rather than match against stale tokens.
    const bool extends = tokens.size() >= text.size() && std::equal(text.begin(), text.end(), tokens.begin());
    if (!extends) {
      text.clear();
      positions.clear();
    }
    for (size_t i = text.size(); i < tokens.size(); ++i) {
      positions.add(tokens[i], static_cast<int64_t>(i));
      text.push_back(tokens[i]);
    }
    num_prompt_tokens = prompt_tokens;
  }
};

// Outputs of finished requests, oldest dropped first once more than `budget` tokens are
// held. Positions refer to (entry serial, offset); entries evicted are skipped on lookup and
// compacted away once they are a large part of the index.
class GlobalCache {
 public:
  explicit GlobalCache(int64_t budget) : budget_(budget) {}

  void add(std::vector<TokenId> output) {
    if (budget_ <= 0 || output.empty()) return;
    if (static_cast<int64_t>(output.size()) > budget_) output.erase(output.begin(), output.end() - budget_);
    const uint64_t serial = next_serial_++;
    for (size_t i = 0; i < output.size(); ++i) index_[output[i]].push_back({serial, static_cast<int64_t>(i)});
    indexed_ += static_cast<int64_t>(output.size());
    held_ += static_cast<int64_t>(output.size());
    entries_.push_back(std::move(output));
    while (held_ > budget_) {
      held_ -= static_cast<int64_t>(entries_.front().size());
      entries_.pop_front();
      ++first_serial_;
    }
    if (indexed_ > 2 * held_ + 1024) compact();
  }

  // Cursors after the occurrences of `suffix`'s longest match (>= min_match) in the cache.
  int32_t match(std::span<const TokenId> suffix, const Settings& s, std::vector<Cursor>* out) const {
    out->clear();
    if (suffix.empty()) return 0;
    auto it = index_.find(suffix.back());
    if (it == index_.end()) return 0;
    int32_t best = 0;
    int32_t examined = 0;
    for (auto occ = it->second.rbegin(); occ != it->second.rend() && examined < s.max_candidates; ++occ) {
      if (occ->serial < first_serial_) break;  // older ones are all evicted
      ++examined;
      const std::vector<TokenId>& text = entries_[occ->serial - first_serial_];
      const int32_t m = backward_match(text, occ->offset, suffix, s.max_match);
      if (m < s.min_match || m < best) continue;
      if (m > best) out->clear(), best = m;
      out->push_back({&text, occ->offset + 1});
    }
    return out->empty() ? 0 : best;
  }


 private:
  struct Occurrence {
    uint64_t serial;
    int64_t offset;
  };

  void compact() {
    indexed_ = 0;
    for (auto it = index_.begin(); it != index_.end();) {
      auto& v = it->second;
      v.erase(v.begin(), std::find_if(v.begin(), v.end(), [&](const Occurrence& o) { return o.serial >= first_serial_; }));
      indexed_ += static_cast<int64_t>(v.size());
      it = v.empty() ? index_.erase(it) : std::next(it);
    }
  }

  int64_t budget_;
  std::deque<std::vector<TokenId>> entries_;
  std::unordered_map<TokenId, std::vector<Occurrence>> index_;
  uint64_t first_serial_ = 0, next_serial_ = 0;
  int64_t held_ = 0, indexed_ = 0;
};

class SuffixDrafter final : public Drafter {
 public:
  explicit SuffixDrafter(Settings s) : s_(s), global_(s.global_cache_tokens) {}

  Status propose(std::span<const DraftRequest> requests) override {
    for (const DraftRequest& r : requests) {
      SequenceIndex& index = sequences_[r.seq->id];
      index.sync(r.seq->tokens, r.seq->num_prompt_tokens);
      local_.clear();
      global_best_.clear();
      propose_local(index, r.max_drafts, &local_);
      const std::span<const TokenId> suffix = suffix_of(index.text);
      const int32_t gm = global_.match(suffix, s_, &cursors_);
      if (gm > 0) walk(cursors_, budget(gm, r.max_drafts), s_.min_token_prob, &global_best_, counts_);
      const Candidate& best = global_best_.score > local_.score ? global_best_ : local_;
      r.out->tokens.insert(r.out->tokens.end(), best.tokens.begin(), best.tokens.end());
    }
    return Status::ok();
  }

  // Nothing to resynchronize: the indexes hold committed tokens only, never drafts.
  void on_drafts_settled(SeqId, int32_t, int32_t) override {}

  void forget(SeqId seq) override {
    auto it = sequences_.find(seq);
    if (it == sequences_.end()) return;
    SequenceIndex& index = it->second;
    if (static_cast<int32_t>(index.text.size()) > index.num_prompt_tokens)
      global_.add(std::vector<TokenId>(index.text.begin() + index.num_prompt_tokens, index.text.end()));
    sequences_.erase(it);
  }

  static Status create(const PluginConfig& config, const PluginContext&, std::unique_ptr<Drafter>* out) {
    Settings s;
    s.min_match = static_cast<int32_t>(config.get_int("min_match"));
    s.max_match = static_cast<int32_t>(config.get_int("max_match"));
    s.spec_factor = config.get_float("spec_factor");
    s.min_token_prob = config.get_float("min_token_prob");
    s.global_cache_tokens = config.get_int("global_cache_tokens");
    s.max_candidates = static_cast<int32_t>(config.get_int("max_candidates"));
    if (s.min_match > s.max_match)
      return invalid_argument(config.key_path() + ".min_match: must not exceed max_match (" +
                              std::to_string(s.max_match) + "), got " + std::to_string(s.min_match));
    *out = std::make_unique<SuffixDrafter>(s);
    return Status::ok();
  }

 private:
  std::span<const TokenId> suffix_of(const std::vector<TokenId>& text) const {
    const size_t n = std::min(text.size(), static_cast<size_t>(s_.max_match));
    return std::span<const TokenId>(text).subspan(text.size() - n);
  }

  int32_t budget(int32_t match_length, int32_t max_drafts) const {
    const auto by_match = static_cast<int32_t>(std::ceil(s_.spec_factor * match_length));
    return std::max(1, std::min(max_drafts, by_match));
  }

  // The longest earlier match of the sequence's suffix within the sequence itself (the
  // suffix's own occurrence at the end excluded), then the frequency walk from all of them.
  void propose_local(const SequenceIndex& index, int32_t max_drafts, Candidate* out) {
    const std::vector<TokenId>& text = index.text;
    const int64_t n = static_cast<int64_t>(text.size());
    if (n < 2) return;
    const std::vector<int64_t>* occurrences = index.positions.find(text.back());
    if (occurrences == nullptr) return;
    const std::span<const TokenId> suffix = suffix_of(text);
    int32_t best = 0;
    int32_t examined = 0;
    cursors_.clear();
    for (auto p = occurrences->rbegin(); p != occurrences->rend() && examined < s_.max_candidates; ++p) {
      if (*p >= n - 1) continue;  // the suffix itself
      ++examined;
      const int32_t m = backward_match(text, *p, suffix, s_.max_match);
      if (m < s_.min_match || m < best) continue;
      if (m > best) cursors_.clear(), best = m;
      cursors_.push_back({&text, *p + 1});
    }
    if (cursors_.empty()) return;
    walk(cursors_, budget(best, max_drafts), s_.min_token_prob, out, counts_);
  }

  Settings s_;
  std::unordered_map<SeqId, SequenceIndex> sequences_;
  GlobalCache global_;
  // Scratch reused across queries, so that steady-state proposing allocates little.
  std::vector<Cursor> cursors_;
  std::unordered_map<TokenId, int32_t> counts_;
  Candidate local_, global_best_;
};

}  // namespace
}  // namespace tessera

TESSERA_REGISTER_PLUGIN(tessera::SuffixDrafter, tessera::Drafter, "suffix", "0.1.0",
                        "suffix decoding: frequency-ranked continuations of the longest suffix match in the "
                        "sequence and in a bounded cache of earlier outputs",
                        tessera::kParams)
