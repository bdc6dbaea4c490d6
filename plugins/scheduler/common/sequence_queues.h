// Queue bookkeeping shared by the in-tree iteration-level schedulers (continuous and
// chunked-prefill): waiting and running lists, recompute preemption of the newest arrival,
// rejection of what can never fit, and max_queue_time. Header-only and internal to
// plugins/scheduler/: each plugin library compiles its own copy, so no symbol crosses
// between plugins. Not thread-safe: used from the engine thread only, like the schedulers.
#pragma once

#include <algorithm>
#include <deque>
#include <string>
#include <unordered_set>
#include <vector>

#include "tessera/sdk.h"

namespace tessera::scheduling {

// A plan entry with its fields set by name: the struct may grow.
inline ScheduledSequence scheduled_entry(SeqId id, int32_t num_cached, int32_t num_new) {
  ScheduledSequence s;
  s.id = id;
  s.num_cached_tokens = num_cached;
  s.num_new_tokens = num_new;
  return s;
}

// Frees whatever the sequence holds and rejects it: it cannot run even with the KV cache
// to itself.
inline void reject_too_large(KvCacheManager& kv, const SequenceInfo* seq, SchedulePlan* plan) {
  kv.free(seq->id);
  plan->rejected.push_back(
      {seq->id, resource_exhausted("the KV cache pool is too small for this sequence: its " +
                                   std::to_string(seq->num_tokens()) +
                                   " tokens do not fit even with no other sequence running (" +
                                   std::to_string(kv.num_free_blocks()) +
                                   " blocks free); raise the kv_cache memory or shorten the request")});
}

class SequenceQueues {
 public:
  std::deque<const SequenceInfo*> waiting;
  std::vector<const SequenceInfo*> running;  // in admission order

  void add(const SequenceInfo* seq) {
    // A forked child (n > 1 samples) arrives with its prompt computed and blocks shared with
    // its parent: it is already running, and holds KV memory that preemption must see.
    if (seq->num_computed_tokens > 0) {
      running.push_back(seq);
      started_.insert(seq->id);
    } else {
      waiting.push_back(seq);
    }
  }

  void remove(SeqId id) {
    auto match = [id](const SequenceInfo* s) { return s->id == id; };
    std::erase_if(waiting, match);
    std::erase_if(running, match);
    started_.erase(id);
  }

  // A copy of `running` to walk while victims leave it. The copy lives in a member whose
  // capacity is kept, so a steady-state step allocates nothing.
  const std::vector<const SequenceInfo*>& running_snapshot() {
    snapshot_.assign(running.begin(), running.end());
    return snapshot_;
  }

  // Moves the head of the waiting queue to running.
  void start_front() {
    const SequenceInfo* seq = waiting.front();
    waiting.pop_front();
    running.push_back(seq);
    started_.insert(seq->id);
  }

  bool is_running(const SequenceInfo* seq) const {
    return std::find(running.begin(), running.end(), seq) != running.end();
  }

  // Allocates and schedules n tokens of a running sequence, preempting the newest arrivals
  // until they fit; a sequence that does not fit even alone is rejected. Returns whether
  // anything was preempted.
  bool place_running(KvCacheManager& kv, const SequenceInfo* seq, int32_t n, int32_t* budget,
                     SchedulePlan* plan) {
    if (n <= 0) return false;
    bool preempted = false;
    for (;;) {
      if (kv.allocate_slots(*seq, n)) {
        plan->scheduled.push_back(scheduled_entry(seq->id, 0, n));
        *budget -= n;
        return preempted;
      }
      if (running.size() == 1) {  // alone and still no room: it can never run
        reject_too_large(kv, seq, plan);
        std::erase(running, seq);
        return preempted;
      }
      const SequenceInfo* victim = newest_running();
      preempt(kv, victim, budget, plan);
      preempted = true;
      if (victim == seq) return preempted;
    }
  }

  // Only sequences that never started are subject to max_queue_time: a preempted sequence
  // already streamed tokens, and rejecting it then would waste that work.
  void reject_expired(double now, double max_queue_time, SchedulePlan* plan) {
    if (max_queue_time <= 0) return;
    std::erase_if(waiting, [&](const SequenceInfo* s) {
      if (started_.count(s->id) || now - s->arrival_time <= max_queue_time) return false;
      plan->rejected.push_back(
          {s->id, resource_exhausted("request waited " + std::to_string(now - s->arrival_time) +
                                     " s in the queue, longer than max_queue_time (" +
                                     std::to_string(max_queue_time) + " s)")});
      return true;
    });
  }

 private:
  // The most recently arrived running sequence (ties: the later id, e.g. a forked child).
  const SequenceInfo* newest_running() const {
    return *std::max_element(running.begin(), running.end(),
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
    std::erase(running, victim);
    waiting.push_front(victim);
  }

  std::vector<const SequenceInfo*> snapshot_;
  std::unordered_set<SeqId> started_;  // ever admitted (exempt from max_queue_time)
};

}  // namespace tessera::scheduling
