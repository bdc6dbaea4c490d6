// scheduler.chunked-prefill: Sarathi-Serve's stall-free batching. Every step has a fixed
// token budget. Running decodes go first (one token plus any drafts each), so a long prompt
// never stalls generation; the rest of the budget is filled with prompt chunks of at most
// chunk_size tokens, first from sequences already part-way through their prompt, then from
// newly admitted ones (first come, first served). When KV memory runs out the most recently
// arrived running sequence is preempted (blocks freed, recomputed later).
#include <algorithm>
#include <deque>
#include <memory>
#include <string>
#include <unordered_set>
#include <vector>

#include "tessera/sdk.h"

namespace tessera {
namespace {

const ParamSpec kParams[] = {
    {"max_num_seqs", ParamType::kInt, "32", "sequences running at once", 1, 4096},
    {"max_batch_tokens", ParamType::kInt, "512", "tokens fed per engine step", 1, 1 << 20},
    {"chunk_size", ParamType::kInt, "256", "prompt tokens of one sequence per step, at most", 1,
     1 << 20},
    {"max_queue_time", ParamType::kDuration, "0",
     "reject a request still waiting to start after this long (0: wait forever)", 0, INFINITY},
};

class ChunkedPrefillScheduler final : public Scheduler {
 public:
  ChunkedPrefillScheduler(int32_t max_num_seqs, int32_t max_batch_tokens, int32_t chunk_size,
                          double max_queue_time)
      : max_num_seqs_(max_num_seqs), max_batch_tokens_(max_batch_tokens),
        chunk_size_(chunk_size), max_queue_time_(max_queue_time) {}

  int32_t max_num_seqs() const override { return max_num_seqs_; }
  int32_t max_batch_tokens() const override { return max_batch_tokens_; }

  void add(const SequenceInfo* seq) override {
    // A forked child (n > 1 samples) arrives with its prompt computed and blocks shared with
    // its parent: it is already running, and holds KV memory that preemption must see.
    if (seq->num_computed_tokens > 0) {
      running_.push_back(seq);
      started_.insert(seq->id);
    } else {
      waiting_.push_back(seq);
    }
  }

  void remove(SeqId id) override {
    auto match = [id](const SequenceInfo* s) { return s->id == id; };
    std::erase_if(waiting_, match);
    std::erase_if(running_, match);
    started_.erase(id);
  }

  Status schedule(KvCacheManager& kv, double now, SchedulePlan* plan) override {
    plan->clear();
    reject_expired(now, plan);
    int32_t budget = max_batch_tokens_;
    bool preempted = false;

    // Victims leave running_ while we walk it, so walk a snapshot: decodes first, then the
    // next chunk of every prompt still being fed.
    const std::vector<const SequenceInfo*> snapshot = running_;
    for (const SequenceInfo* seq : snapshot) {
      if (budget <= 0) break;
      if (!is_running(seq) || !is_decode(*seq)) continue;
      // Drafts beyond the budget are cut; the engine samples only when a chunk reaches the end.
      preempted |= place_running(kv, seq, std::min(seq->num_uncomputed(), budget), &budget, plan);
    }
    for (const SequenceInfo* seq : snapshot) {
      if (budget <= 0) break;
      if (!is_running(seq) || is_decode(*seq)) continue;
      const int32_t n = std::min({seq->num_uncomputed(), chunk_size_, budget});
      preempted |= place_running(kv, seq, n, &budget, plan);
    }

    // After a preemption memory is short, and the victims (at the head of the queue) still
    // show their old progress until the engine resets it: admit nobody this step.
    if (preempted) return Status::ok();
    while (!waiting_.empty() && num_running() < max_num_seqs_ && budget > 0) {
      const SequenceInfo* seq = waiting_.front();
      // Prefix reuse first: the engine starts the sequence after the cached tokens, so the
      // chunk and the allocation begin there.
      int32_t cached = 0;
      if (seq->num_computed_tokens == 0) cached = kv.attach_cached_prefix(*seq);
      const int32_t start = std::max(seq->num_computed_tokens, cached);
      const int32_t n = std::min({seq->num_tokens() - start, chunk_size_, budget});
      // allocate_slots counts from num_computed_tokens, which excludes the cached prefix
      // until the engine applies this plan.
      if (!kv.allocate_slots(*seq, cached + n)) {
        if (running_.empty()) {  // not even one chunk fits an empty cache
          reject_too_large(kv, seq, plan);
          waiting_.pop_front();
          continue;
        }
        // Wait for memory (FCFS). The attached prefix stays cached and is found again.
        if (cached > 0) kv.free(seq->id);
        break;
      }
      waiting_.pop_front();
      running_.push_back(seq);
      started_.insert(seq->id);
      plan->scheduled.push_back(entry(seq->id, cached, n));
      budget -= n;
    }
    return Status::ok();
  }

  int32_t num_waiting() const override { return static_cast<int32_t>(waiting_.size()); }
  int32_t num_running() const override { return static_cast<int32_t>(running_.size()); }

  static Status create(const PluginConfig& config, const PluginContext&,
                       std::unique_ptr<Scheduler>* out) {
    *out = std::make_unique<ChunkedPrefillScheduler>(
        static_cast<int32_t>(config.get_int("max_num_seqs", 32)),
        static_cast<int32_t>(config.get_int("max_batch_tokens", 512)),
        static_cast<int32_t>(config.get_int("chunk_size", 256)),
        config.get_float("max_queue_time", 0.0));
    return Status::ok();
  }

 private:
  // Fields set by name: the struct may grow.
  static ScheduledSequence entry(SeqId id, int32_t num_cached, int32_t num_new) {
    ScheduledSequence s;
    s.id = id;
    s.num_cached_tokens = num_cached;
    s.num_new_tokens = num_new;
    return s;
  }

  // A decode feeds its last sampled token plus drafts. Anything else is (re)computing a
  // prompt, including its last token, and the generated tokens of a sequence resumed after
  // preemption; those go in chunks after the decodes.
  static bool is_decode(const SequenceInfo& seq) {
    return !seq.is_prefill() && seq.num_uncomputed() <= 1 + seq.num_draft_tokens;
  }

  // Allocates and schedules n tokens of a running sequence, preempting the newest arrivals
  // until they fit. Returns whether anything was preempted.
  bool place_running(KvCacheManager& kv, const SequenceInfo* seq, int32_t n, int32_t* budget,
                     SchedulePlan* plan) {
    if (n <= 0) return false;
    bool preempted = false;
    for (;;) {
      if (kv.allocate_slots(*seq, n)) {
        plan->scheduled.push_back(entry(seq->id, 0, n));
        *budget -= n;
        return preempted;
      }
      if (running_.size() == 1) {  // alone and still no room: it can never run
        reject_too_large(kv, seq, plan);
        std::erase(running_, seq);
        return preempted;
      }
      const SequenceInfo* victim = newest_running();
      preempt(kv, victim, budget, plan);
      preempted = true;
      if (victim == seq) return preempted;
    }
  }

  bool is_running(const SequenceInfo* seq) const {
    return std::find(running_.begin(), running_.end(), seq) != running_.end();
  }

  // The most recently arrived running sequence (ties: the later id, e.g. a forked child).
  const SequenceInfo* newest_running() const {
    return *std::max_element(running_.begin(), running_.end(),
                             [](const SequenceInfo* a, const SequenceInfo* b) {
                               if (a->arrival_time != b->arrival_time)
                                 return a->arrival_time < b->arrival_time;
                               return a->id < b->id;
                             });
  }

  // Recompute preemption: free the blocks, drop any slots given this step, requeue first.
  void preempt(KvCacheManager& kv, const SequenceInfo* victim, int32_t* budget,
               SchedulePlan* plan) {
    kv.free(victim->id);
    plan->preempted.push_back(victim->id);
    std::erase_if(plan->scheduled, [&](const ScheduledSequence& s) {
      if (s.id != victim->id) return false;
      *budget += s.num_new_tokens;
      return true;
    });
    std::erase(running_, victim);
    waiting_.push_front(victim);
  }

  static void reject_too_large(KvCacheManager& kv, const SequenceInfo* seq, SchedulePlan* plan) {
    kv.free(seq->id);
    plan->rejected.push_back(
        {seq->id, resource_exhausted(
                      "the KV cache pool is too small for this sequence: its " +
                      std::to_string(seq->num_tokens()) +
                      " tokens do not fit even with no other sequence running (" +
                      std::to_string(kv.num_free_blocks()) +
                      " blocks free); raise the kv_cache memory or shorten the request")});
  }

  // Only sequences that never started are subject to max_queue_time: a preempted sequence
  // already streamed tokens, and rejecting it then would waste that work.
  void reject_expired(double now, SchedulePlan* plan) {
    if (max_queue_time_ <= 0) return;
    std::erase_if(waiting_, [&](const SequenceInfo* s) {
      if (started_.count(s->id) || now - s->arrival_time <= max_queue_time_) return false;
      plan->rejected.push_back(
          {s->id, resource_exhausted("request waited " + std::to_string(now - s->arrival_time) +
                                     " s in the queue, longer than max_queue_time (" +
                                     std::to_string(max_queue_time_) + " s)")});
      return true;
    });
  }

  int32_t max_num_seqs_;
  int32_t max_batch_tokens_;
  int32_t chunk_size_;
  double max_queue_time_;
  std::deque<const SequenceInfo*> waiting_;
  std::vector<const SequenceInfo*> running_;  // in admission order
  std::unordered_set<SeqId> started_;         // ever admitted (exempt from max_queue_time)
};

}  // namespace
}  // namespace tessera

TESSERA_REGISTER_PLUGIN(tessera::ChunkedPrefillScheduler, tessera::Scheduler, "chunked-prefill",
                        "0.1.0",
                        "Sarathi-Serve stall-free batching: decodes first, then prompt chunks "
                        "within a fixed token budget",
                        tessera::kParams)
