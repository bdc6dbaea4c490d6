// A drafter that runs a model through the host (tessera/sdk/model_host.h): the drafting loop
// of drafter.draft-model (another GGUF with the target's vocabulary) and drafter.layer-skip
// (the target's own weights through a subset of its layers), for any plugin that drafts with
// a HostModel. Header-only; SDK 2.8 (2.13: restrict_vocabulary).
//
// Each step, for all sequences at once: a catch-up forward feeds each sequence's tokens the
// draft cache does not hold yet (the whole prompt the first time; afterwards the accepted
// drafts' successor and whatever the cache lost), then k - 1 batched one-token forwards
// extend every sequence's draft. The cache's validity is decided by comparing the tokens it
// was fed with the sequence's committed tokens (their longest common prefix), so rejected
// drafts are rolled back without trusting any notification, and preemption, n > 1 forks and
// cancellations need no special case.
//
// Drafts are the draft model's argmax and q is left one-hot: the verification is then exact
// for greedy requests (accept while the draft equals the target's argmax) and for sampled
// ones (rejection sampling against a one-hot q keeps the target's distribution).
// Engine thread only.
#pragma once

#include <algorithm>
#include <charconv>
#include <cstdint>
#include <fstream>
#include <memory>
#include <span>
#include <sstream>
#include <string>
#include <unordered_map>
#include <vector>

#include "tessera/sdk/drafter.h"
#include "tessera/sdk/model_host.h"

namespace tessera {

// What the draft cache holds for one sequence: the tokens it was fed, position by position,
// and the blocks holding their K/V.
struct HostModelDraftSequence {
  std::vector<TokenId> fed;
  std::vector<int32_t> blocks;
};

// One sequence's part of this step's drafting.
struct HostModelDraftJob {
  const DraftRequest* request;
  HostModelDraftSequence* state;
  int32_t begin = 0;   // first committed token to feed in the catch-up
  int32_t k = 0;       // drafts to propose
  TokenId last = -1;   // the draft fed in the current one-token forward
};

inline TokenId host_model_argmax(const float* row, int32_t n) {
  return static_cast<TokenId>(std::max_element(row, row + n) - row);
}

// The parameters of a reduced draft vocabulary, for a HostModelDrafter plugin's ParamSpec
// table (HostModelDrafter::restrict_vocabulary(config, context, plugin) reads them).
inline constexpr ParamSpec kDraftVocabularyParam = {
    "vocabulary", ParamType::kInt, "0",
    "draft from this many tokens only, the most frequent first (FR-Spec): a smaller output head makes "
    "each draft forward cheaper, a target token outside it is never drafted; 0: the whole vocabulary",
    0, 16777216};
inline constexpr ParamSpec kDraftVocabularyRankingParam = {
    "vocabulary_ranking", ParamType::kString, "",
    "a file of token ids, most frequent first, that `vocabulary` takes its tokens from (README); "
    "empty: ascending ids, the tokenizer's own order"};

// Reads a token ranking for HostModelDrafter::restrict_vocabulary: token ids, most frequent
// first, separated by white space; '#' starts a comment running to the end of its line. For
// example from a corpus: `tessera tokenize -m MODEL < corpus.txt | tr ' ' '\n' | sort -n |
// uniq -c | sort -rn | awk '{print $2}'`. Errors name `key`, the file, and the line of a bad
// entry (not a number, or outside [0, vocab_size)).
inline Status read_token_ranking(const std::string& path, int32_t vocab_size, const std::string& key,
                                 std::vector<TokenId>* out) {
  out->clear();
  std::ifstream in(path);
  if (!in) return invalid_argument(key + ": cannot read the token ranking '" + path + "'");
  std::string line;
  for (int64_t number = 1; std::getline(in, line); ++number) {
    std::istringstream words(line.substr(0, line.find('#')));
    std::string word;
    while (words >> word) {
      TokenId id = -1;
      const auto [end, ec] = std::from_chars(word.data(), word.data() + word.size(), id);
      if (ec != std::errc() || end != word.data() + word.size() || id < 0 || id >= vocab_size)
        return invalid_argument(key + ": " + path + " line " + std::to_string(number) + ": '" + word +
                                "' is not a token id of the model (0.." + std::to_string(vocab_size - 1) + ")");
      out->push_back(id);
    }
  }
  if (out->empty()) return invalid_argument(key + ": the token ranking '" + path + "' lists no token ids");
  return Status::ok();
}

class HostModelDrafter : public Drafter {
 public:
  explicit HostModelDrafter(std::unique_ptr<HostModel> model) : model_(std::move(model)) {
    const KvLayout& layout = model_->kv_layout();
    free_blocks_.reserve(static_cast<size_t>(layout.num_blocks));
    for (int32_t b = layout.num_blocks - 1; b >= 0; --b) free_blocks_.push_back(b);
  }

  // Drafts from the `size` first tokens of `ranking` only (a frequency-ranked draft
  // vocabulary, FR-Spec; HostModel::restrict_logits, SDK 2.13): each draft forward then
  // computes that many logits instead of the whole vocabulary's. An empty ranking means token
  // ids in ascending order: the tokenizer's own order, which for BPE vocabularies (merge rank)
  // and SentencePiece ones (sorted by score) roughly follows frequency in the tokenizer's
  // training text. size 0, or one at least the vocabulary's, keeps the whole vocabulary.
  // Verification is exact whatever is drafted: a smaller vocabulary trades acceptance (a
  // target token outside it is never drafted) for cheaper draft forwards.
  Status restrict_vocabulary(int32_t size, std::span<const TokenId> ranking) {
    if (size <= 0 || size >= model_->vocab_size()) return Status::ok();
    std::vector<TokenId> tokens;
    if (ranking.empty()) {
      for (TokenId t = 0; t < size; ++t) tokens.push_back(t);
    } else {
      tokens.assign(ranking.begin(), ranking.begin() + std::min<size_t>(ranking.size(), static_cast<size_t>(size)));
    }
    std::vector<TokenId> columns;
    Status st = model_->restrict_logits(tokens, &columns);
    if (st.is_ok()) columns_ = std::move(columns);
    return st;
  }

  // restrict_vocabulary from the plugin's kDraftVocabularyParam and
  // kDraftVocabularyRankingParam (ranking: a read_token_ranking file, or empty for ascending
  // ids), logging the size as drafter.<plugin>. Errors start with the slot's key.
  Status restrict_vocabulary(const PluginConfig& config, const PluginContext& context, const std::string& plugin) {
    const std::string key = config.key_path();
    const std::string ranking_path = config.get_string(kDraftVocabularyRankingParam.name);
    std::vector<TokenId> ranking;
    if (!ranking_path.empty()) {
      if (Status st = read_token_ranking(ranking_path, model_->vocab_size(), key + ".vocabulary_ranking", &ranking);
          !st.is_ok())
        return st;
    }
    // The parameter's range (at most 2^24) fits an int32_t.
    Status st = restrict_vocabulary(static_cast<int32_t>(config.get_int(kDraftVocabularyParam.name)), ranking);
    if (!st.is_ok()) return Status(st.code(), key + ".vocabulary: " + st.message());
    if (!columns_.empty())
      context.logger->log(LogLevel::kInfo, "drafter." + plugin + ": drafting from " + std::to_string(columns_.size()) +
                                               " of " + std::to_string(model_->vocab_size()) + " tokens");
    return st;
  }

  Status propose(std::span<const DraftRequest> requests) override {
    jobs_.clear();
    for (const DraftRequest& r : requests) {
      HostModelDraftSequence& s = sequences_[r.seq->id];
      const std::span<const TokenId> tokens = r.seq->tokens;
      const auto n = static_cast<int32_t>(tokens.size());
      if (n == 0) continue;
      // The cache is valid up to the longest common prefix of what it was fed and the
      // committed tokens; the last committed token is always fed again (its logits are the
      // first draft's).
      const auto common = static_cast<int32_t>(
          std::mismatch(s.fed.begin(), s.fed.end(), tokens.begin(), tokens.end()).first - s.fed.begin());
      const int32_t begin = std::min(common, n - 1);
      const int32_t k = std::min(r.max_drafts, model_->max_context() - n + 1);
      if (k <= 0) continue;
      // Positions up to n + k − 2 are written (the last draft is never fed).
      if (!reserve(s, n + k - 1)) {
        release(s);  // no room: this sequence drafts nothing this step and starts over later
        continue;
      }
      s.fed.resize(static_cast<size_t>(begin));
      jobs_.push_back({&r, &s, begin, k, -1});
    }
    if (jobs_.empty()) return Status::ok();
    Status st = catch_up();
    bool more = true;
    for (int32_t step = 1; st.is_ok() && more; ++step) st = extend(step, &more);
    if (st.is_ok()) return st;
    // A failed forward leaves the caches in an unknown state: start every sequence over.
    for (HostModelDraftJob& j : jobs_) {
      j.state->fed.clear();
      j.request->out->clear();
    }
    return st;
  }

  // Nothing to do: the next propose compares the cache's tokens with the committed ones.
  void on_drafts_settled(SeqId, int32_t, int32_t) override {}

  void forget(SeqId seq) override {
    auto it = sequences_.find(seq);
    if (it == sequences_.end()) return;
    release(it->second);
    sequences_.erase(it);
  }

 private:
  // Columns of the draft's logits rows: the restricted vocabulary's size, else the whole one.
  int32_t draft_vocabulary_size() const {
    return columns_.empty() ? model_->vocab_size() : static_cast<int32_t>(columns_.size());
  }

  // Blocks for `positions` positions of `s`, allocated from the pool; false if it ran out.
  bool reserve(HostModelDraftSequence& s, int32_t positions) {
    const int32_t block = model_->kv_layout().block_size;
    const auto need = static_cast<size_t>((positions + block - 1) / block);
    while (s.blocks.size() < need) {
      if (free_blocks_.empty()) return false;
      s.blocks.push_back(free_blocks_.back());
      free_blocks_.pop_back();
    }
    return true;
  }

  void release(HostModelDraftSequence& s) {
    free_blocks_.insert(free_blocks_.end(), s.blocks.begin(), s.blocks.end());
    s.blocks.clear();
    s.fed.clear();
  }

  // Feeds every job's uncached committed tokens, in forwards of at most max_batch_tokens
  // tokens (a long prompt in several chunks, only its last one asking for logits), and
  // takes each job's first draft from its last row's logits.
  Status catch_up() {
    const int32_t budget = model_->max_batch_tokens();
    size_t next = 0;         // the job being fed
    int32_t offset = 0;      // tokens of it already fed in earlier chunks
    while (next < jobs_.size()) {
      batch_.clear();
      logit_jobs_.clear();
      int32_t used = 0;
      while (next < jobs_.size() && used < budget) {
        HostModelDraftJob& j = jobs_[next];
        const std::span<const TokenId> tokens = j.request->seq->tokens;
        const int32_t start = j.begin + offset;
        const int32_t remaining = static_cast<int32_t>(tokens.size()) - start;
        const int32_t take = std::min(remaining, budget - used);
        const bool last_chunk = take == remaining;
        batch_.push_back({tokens.data() + start, take, start, j.state->blocks, last_chunk ? 1 : 0});
        j.state->fed.insert(j.state->fed.end(), tokens.begin() + start, tokens.begin() + start + take);
        used += take;
        if (last_chunk) {
          logit_jobs_.push_back(&j);
          ++next;
          offset = 0;
        } else {
          offset += take;
        }
      }
      if (Status st = forward_and_take_drafts(); !st.is_ok()) return st;
    }
    return Status::ok();
  }

  // Runs batch_ and appends to each of logit_jobs_ (one logits row each, in batch order) the
  // argmax of its row as its next draft.
  Status forward_and_take_drafts() {
    const int32_t width = draft_vocabulary_size();
    Status st = model_->forward(batch_, &logits_);
    if (!st.is_ok()) return st;
    for (size_t i = 0; i < logit_jobs_.size(); ++i) {
      HostModelDraftJob& j = *logit_jobs_[i];
      const TokenId column = host_model_argmax(logits_.data() + i * static_cast<size_t>(width), width);
      j.last = columns_.empty() ? column : columns_[static_cast<size_t>(column)];
      j.request->out->tokens.push_back(j.last);
    }
    return Status::ok();
  }

  // The step-th one-token forward: every job still short of its k drafts feeds its last
  // draft and takes the next. *more = false (and nothing run) when no job needs another.
  Status extend(int32_t step, bool* more) {
    batch_.clear();
    logit_jobs_.clear();
    for (HostModelDraftJob& j : jobs_) {
      if (j.k <= step) continue;
      const auto position = static_cast<int32_t>(j.state->fed.size());
      j.state->fed.push_back(j.last);
      batch_.push_back({&j.state->fed.back(), 1, position, j.state->blocks, 1});
      logit_jobs_.push_back(&j);
    }
    *more = !batch_.empty();
    if (!*more) return Status::ok();
    return forward_and_take_drafts();
  }

  std::unique_ptr<HostModel> model_;
  std::vector<int32_t> free_blocks_;
  std::unordered_map<SeqId, HostModelDraftSequence> sequences_;
  // Scratch reused across steps.
  std::vector<HostModelDraftJob> jobs_;
  std::vector<ForwardSequence> batch_;
  std::vector<HostModelDraftJob*> logit_jobs_;
  std::vector<float> logits_;
  std::vector<TokenId> columns_;  // restrict_vocabulary's token per logits column; empty: all
};

}  // namespace tessera
