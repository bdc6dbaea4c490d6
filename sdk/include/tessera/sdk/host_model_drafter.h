// A drafter that runs a model through the host (tessera/sdk/model_host.h): the drafting loop
// of drafter.draft-model (another GGUF with the target's vocabulary) and drafter.layer-skip
// (the target's own weights through a subset of its layers), for any plugin that drafts with
// a HostModel. Header-only; SDK 2.8.
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
#include <cstdint>
#include <memory>
#include <span>
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

class HostModelDrafter : public Drafter {
 public:
  explicit HostModelDrafter(std::unique_ptr<HostModel> model) : model_(std::move(model)) {
    const KvLayout& layout = model_->kv_layout();
    free_blocks_.reserve(static_cast<size_t>(layout.num_blocks));
    for (int32_t b = layout.num_blocks - 1; b >= 0; --b) free_blocks_.push_back(b);
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
    const int32_t vocab = model_->vocab_size();
    Status st = model_->forward(batch_, &logits_);
    if (!st.is_ok()) return st;
    for (size_t i = 0; i < logit_jobs_.size(); ++i) {
      HostModelDraftJob& j = *logit_jobs_[i];
      j.last = host_model_argmax(logits_.data() + i * static_cast<size_t>(vocab), vocab);
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
};

}  // namespace tessera
