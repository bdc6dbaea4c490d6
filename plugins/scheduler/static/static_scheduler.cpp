// scheduler.static: request-level (static) batching. A batch of up to max_num_seqs waiting
// sequences is admitted only when no batch is running, and it runs until its last sequence
// finishes; sequences that finish early leave their slot idle. Prompts are fed whole (split
// only to respect max_batch_tokens). The baseline continuous batching is measured against.
#include <algorithm>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "tessera/sdk.h"

namespace tessera {
namespace {

const ParamSpec kParams[] = {
    {"max_num_seqs", ParamType::kInt, "16", "sequences in one batch", 1, 4096},
    {"max_batch_tokens", ParamType::kInt, "2048", "tokens fed per engine step", 1, 1 << 20},
    {"max_queue_time", ParamType::kDuration, "0",
     "reject a request still waiting after this long (0: wait forever)", 0, INFINITY},
};

class StaticScheduler final : public Scheduler {
 public:
  StaticScheduler(int32_t max_num_seqs, int32_t max_batch_tokens, double max_queue_time)
      : max_num_seqs_(max_num_seqs), max_batch_tokens_(max_batch_tokens),
        max_queue_time_(max_queue_time) {}

  int32_t max_num_seqs() const override { return max_num_seqs_; }
  int32_t max_batch_tokens() const override { return max_batch_tokens_; }

  void add(const SequenceInfo* seq) override { waiting_.push_back(seq); }

  void remove(SeqId id) override {
    auto match = [id](const SequenceInfo* s) { return s->id == id; };
    std::erase_if(waiting_, match);
    std::erase_if(running_, match);
    cached_.erase(id);
  }

  Status schedule(KvCacheManager& kv, double now, SchedulePlan* plan) override {
    plan->clear();
    reject_expired(now, plan);
    if (running_.empty()) admit_batch(kv);

    int32_t budget = max_batch_tokens_;
    for (size_t i = 0; i < running_.size() && budget > 0;) {
      const SequenceInfo* seq = running_[i];
      auto cached_it = cached_.find(seq->id);
      const int32_t cached = cached_it == cached_.end() ? 0 : cached_it->second;
      const int32_t n = std::min(seq->num_uncomputed() - cached, budget);
      if (n <= 0) { ++i; continue; }
      // allocate_slots counts from num_computed_tokens, which does not include the cached
      // prefix until the engine applies this plan.
      if (!kv.allocate_slots(*seq, cached + n)) {
        // Out of memory: preempt the newest arrival of the batch and retry.
        const SequenceInfo* victim = running_.back();
        kv.free(victim->id);
        plan->preempted.push_back(victim->id);
        running_.pop_back();
        cached_.erase(victim->id);
        waiting_.push_front(victim);
        std::erase_if(plan->scheduled, [&](const ScheduledSequence& s) { return s.id == victim->id; });
        if (victim == seq) continue;  // i now points past the end or at the next sequence
        continue;
      }
      plan->scheduled.push_back({seq->id, cached, n});
      if (cached_it != cached_.end()) cached_.erase(cached_it);
      budget -= n;
      ++i;
    }
    return Status::ok();
  }

  int32_t num_waiting() const override { return static_cast<int32_t>(waiting_.size()); }
  int32_t num_running() const override { return static_cast<int32_t>(running_.size()); }

  static Status create(const PluginConfig& config, const PluginContext&,
                       std::unique_ptr<Scheduler>* out) {
    *out = std::make_unique<StaticScheduler>(static_cast<int32_t>(config.get_int("max_num_seqs")),
                                             static_cast<int32_t>(config.get_int("max_batch_tokens")),
                                             config.get_float("max_queue_time"));
    return Status::ok();
  }

 private:
  void admit_batch(KvCacheManager& kv) {
    while (!waiting_.empty() && static_cast<int32_t>(running_.size()) < max_num_seqs_) {
      const SequenceInfo* seq = waiting_.front();
      // Prefix reuse (when the cache offers it) before the first chunk is scheduled.
      if (seq->num_computed_tokens == 0) cached_[seq->id] = kv.attach_cached_prefix(*seq);
      waiting_.pop_front();
      running_.push_back(seq);
    }
  }

  void reject_expired(double now, SchedulePlan* plan) {
    if (max_queue_time_ <= 0) return;
    std::erase_if(waiting_, [&](const SequenceInfo* s) {
      if (now - s->arrival_time <= max_queue_time_) return false;
      plan->rejected.push_back({s->id, resource_exhausted("request waited longer than max_queue_time (" +
                                                          std::to_string(max_queue_time_) + " s)")});
      return true;
    });
  }

  int32_t max_num_seqs_;
  int32_t max_batch_tokens_;
  double max_queue_time_;
  std::deque<const SequenceInfo*> waiting_;
  std::vector<const SequenceInfo*> running_;
  // Prefix-cache hits attached at admission, reported in the sequence's first plan entry.
  std::map<SeqId, int32_t> cached_;
};

}  // namespace
}  // namespace tessera

TESSERA_REGISTER_PLUGIN(tessera::StaticScheduler, tessera::Scheduler, "static", "0.1.0",
                        "request-level batching: a batch runs until its last sequence finishes",
                        tessera::kParams)
