// scheduler.continuous: iteration-level scheduling (Orca). Sequences join and leave the batch
// at every step: running sequences go first (a decode token plus any drafts to verify), then
// waiting sequences are admitted first-come-first-served while the step's token budget can
// take their whole remaining prompt. Prompts are never chunked; one longer than the budget
// gets a step to itself so it is not starved. When KV memory runs out the most recently
// arrived running sequence is preempted (blocks freed, recomputed later).
#include <algorithm>
#include <limits>
#include <memory>
#include <vector>

#include "common/sequence_queues.h"
#include "tessera/sdk.h"

namespace tessera {
namespace {

const ParamSpec kParams[] = {
    {"max_num_seqs", ParamType::kInt, "32", "sequences running at once", 1, 4096},
    {"max_batch_tokens", ParamType::kInt, "2048",
     "tokens fed per engine step (a single longer prompt is fed alone)", 1, 1 << 20},
    {"max_queue_time", ParamType::kDuration, "0",
     "reject a request still waiting to start after this long (0: wait forever)", 0, INFINITY},
};

class ContinuousScheduler final : public Scheduler {
 public:
  ContinuousScheduler(int32_t max_num_seqs, int32_t max_batch_tokens, double max_queue_time)
      : max_num_seqs_(max_num_seqs), max_batch_tokens_(max_batch_tokens),
        max_queue_time_(max_queue_time) {}

  int32_t max_num_seqs() const override { return max_num_seqs_; }
  int32_t max_batch_tokens() const override { return max_batch_tokens_; }

  void add(const SequenceInfo* seq) override { queues_.add(seq); }
  void remove(SeqId id) override { queues_.remove(id); }

  Status schedule(KvCacheManager& kv, double now, SchedulePlan* plan) override {
    plan->clear();
    queues_.reject_expired(now, max_queue_time_, plan);

    // A prompt longer than the whole budget can never share a step; feed it alone as soon
    // as it reaches the head of the queue (running decodes pause for this one step).
    bool head_blocked = false;
    if (!queues_.waiting.empty() && num_running() < max_num_seqs_ &&
        queues_.waiting.front()->num_uncomputed() > max_batch_tokens_) {
      int32_t used = 0;
      switch (admit_front(kv, std::numeric_limits<int32_t>::max(), plan, &used)) {
        case Admission::kAdmitted: return Status::ok();
        case Admission::kNoRoom: head_blocked = true; break;  // waits for memory, FCFS
        case Admission::kRejected: break;
      }
    }

    int32_t budget = max_batch_tokens_;
    const bool preempted = schedule_running(kv, &budget, plan);
    // After a preemption memory is short, and the victims (at the head of the queue) still
    // show their old progress until the engine resets it: admit nobody this step.
    if (preempted || head_blocked) return Status::ok();

    while (!queues_.waiting.empty() && num_running() < max_num_seqs_ && budget > 0) {
      // A too-long head is handled by the step-of-its-own path above; FCFS means the
      // sequences behind it wait too.
      if (queues_.waiting.front()->num_uncomputed() > max_batch_tokens_) break;
      int32_t used = 0;
      if (admit_front(kv, budget, plan, &used) == Admission::kNoRoom) break;
      budget -= used;
    }
    return Status::ok();
  }

  int32_t num_waiting() const override { return static_cast<int32_t>(queues_.waiting.size()); }
  int32_t num_running() const override { return static_cast<int32_t>(queues_.running.size()); }

  static Status create(const PluginConfig& config, const PluginContext&,
                       std::unique_ptr<Scheduler>* out) {
    *out = std::make_unique<ContinuousScheduler>(
        static_cast<int32_t>(config.get_int("max_num_seqs", 32)),
        static_cast<int32_t>(config.get_int("max_batch_tokens", 2048)),
        config.get_float("max_queue_time", 0.0));
    return Status::ok();
  }

 private:
  enum class Admission { kAdmitted, kNoRoom, kRejected };

  // Tries to start queues_.waiting.front() with its whole remaining prompt within `budget`; *used
  // receives the tokens scheduled.
  Admission admit_front(KvCacheManager& kv, int32_t budget, SchedulePlan* plan, int32_t* used) {
    const SequenceInfo* seq = queues_.waiting.front();
    // Prefix reuse first: the engine starts the sequence after the cached tokens, so the
    // budget and the allocation only cover the rest.
    int32_t cached = 0;
    if (seq->num_computed_tokens == 0) cached = kv.attach_cached_prefix(*seq);
    const int32_t start = std::max(seq->num_computed_tokens, cached);
    const int32_t n = seq->num_tokens() - start;
    // allocate_slots counts from num_computed_tokens, which excludes the cached prefix until
    // the engine applies this plan.
    if (n > budget || !kv.allocate_slots(*seq, cached + n)) {
      if (n <= budget && queues_.running.empty()) {
        scheduling::reject_too_large(kv, seq, plan);
        queues_.waiting.pop_front();
        return Admission::kRejected;
      }
      // Give the attached prefix back; it stays cached and is found again next time.
      if (cached > 0) kv.free(seq->id);
      return Admission::kNoRoom;
    }
    queues_.start_front();
    plan->scheduled.push_back(scheduling::scheduled_entry(seq->id, cached, n));
    *used = n;
    return Admission::kAdmitted;
  }

  // Schedules every running sequence that fits the budget, preempting on KV exhaustion.
  // Returns whether anything was preempted.
  bool schedule_running(KvCacheManager& kv, int32_t* budget, SchedulePlan* plan) {
    bool preempted = false;
    // Victims leave the running list while we walk it, so walk a snapshot.
    const std::vector<const SequenceInfo*>& snapshot = queues_.running_snapshot();
    for (const SequenceInfo* seq : snapshot) {
      if (!queues_.is_running(seq)) continue;
      const int32_t n = seq->num_uncomputed();
      if (n <= 0) continue;
      // Over budget: wait for a later step, unless nothing else runs this step (never stall).
      if (n > *budget && !plan->scheduled.empty()) continue;
      preempted |= queues_.place_running(kv, seq, n, budget, plan);
    }
    return preempted;
  }

  int32_t max_num_seqs_;
  int32_t max_batch_tokens_;
  double max_queue_time_;
  scheduling::SequenceQueues queues_;
};

}  // namespace
}  // namespace tessera

TESSERA_REGISTER_PLUGIN(tessera::ContinuousScheduler, tessera::Scheduler, "continuous", "0.1.0",
                        "iteration-level (Orca) batching: sequences join and leave every step",
                        tessera::kParams)
