// scheduler.chunked-prefill: Sarathi-Serve's stall-free batching. Every step has a fixed
// token budget. Running decodes go first (one token plus any drafts each), so a long prompt
// never stalls generation; the rest of the budget is filled with prompt chunks of at most
// chunk_size tokens, first from sequences already part-way through their prompt, then from
// newly admitted ones (first come, first served). When KV memory runs out the most recently
// arrived running sequence is preempted (blocks freed, recomputed later).
#include <algorithm>
#include <memory>
#include <vector>

#include "common/sequence_queues.h"
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

  void add(const SequenceInfo* seq) override { queues_.add(seq); }
  void remove(SeqId id) override { queues_.remove(id); }

  Status schedule(KvCacheManager& kv, double now, SchedulePlan* plan) override {
    plan->clear();
    queues_.reject_expired(now, max_queue_time_, plan);
    int32_t budget = max_batch_tokens_;
    bool preempted = false;

    // Victims leave the running list while we walk it, so walk a snapshot: decodes first, then the
    // next chunk of every prompt still being fed.
    const std::vector<const SequenceInfo*>& snapshot = queues_.running_snapshot();
    for (const SequenceInfo* seq : snapshot) {
      if (budget <= 0) break;
      if (!queues_.is_running(seq) || !is_decode(*seq)) continue;
      // Drafts beyond the budget are cut; the engine samples only when a chunk reaches the end.
      preempted |= queues_.place_running(kv, seq, std::min(seq->num_uncomputed(), budget), &budget, plan);
    }
    for (const SequenceInfo* seq : snapshot) {
      if (budget <= 0) break;
      if (!queues_.is_running(seq) || is_decode(*seq)) continue;
      const int32_t n = std::min({seq->num_uncomputed(), chunk_size_, budget});
      preempted |= queues_.place_running(kv, seq, n, &budget, plan);
    }

    // After a preemption memory is short, and the victims (at the head of the queue) still
    // show their old progress until the engine resets it: admit nobody this step.
    if (preempted) return Status::ok();
    while (!queues_.waiting.empty() && num_running() < max_num_seqs_ && budget > 0) {
      const SequenceInfo* seq = queues_.waiting.front();
      // Prefix reuse first: the engine starts the sequence after the cached tokens, so the
      // chunk and the allocation begin there.
      int32_t cached = 0;
      if (seq->num_computed_tokens == 0) cached = kv.attach_cached_prefix(*seq);
      const int32_t start = std::max(seq->num_computed_tokens, cached);
      const int32_t n = std::min({seq->num_tokens() - start, chunk_size_, budget});
      // allocate_slots counts from num_computed_tokens, which excludes the cached prefix
      // until the engine applies this plan.
      if (!kv.allocate_slots(*seq, cached + n)) {
        if (queues_.running.empty()) {  // not even one chunk fits an empty cache
          scheduling::reject_too_large(kv, seq, plan);
          queues_.waiting.pop_front();
          continue;
        }
        // Wait for memory (FCFS). The attached prefix stays cached and is found again.
        if (cached > 0) kv.free(seq->id);
        break;
      }
      queues_.start_front();
      plan->scheduled.push_back(scheduling::scheduled_entry(seq->id, cached, n));
      budget -= n;
    }
    return Status::ok();
  }

  int32_t num_waiting() const override { return static_cast<int32_t>(queues_.waiting.size()); }
  int32_t num_running() const override { return static_cast<int32_t>(queues_.running.size()); }

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
  // A decode feeds its last sampled token plus drafts. Anything else is (re)computing a
  // prompt, including its last token, and the generated tokens of a sequence resumed after
  // preemption; those go in chunks after the decodes.
  static bool is_decode(const SequenceInfo& seq) {
    return !seq.is_prefill() && seq.num_uncomputed() <= 1 + seq.num_draft_tokens;
  }

  int32_t max_num_seqs_;
  int32_t max_batch_tokens_;
  int32_t chunk_size_;
  double max_queue_time_;
  scheduling::SequenceQueues queues_;
};

}  // namespace
}  // namespace tessera

TESSERA_REGISTER_PLUGIN(tessera::ChunkedPrefillScheduler, tessera::Scheduler, "chunked-prefill",
                        "0.1.0",
                        "Sarathi-Serve stall-free batching: decodes first, then prompt chunks "
                        "within a fixed token budget",
                        tessera::kParams)
