// scheduler plugins decide, each engine step, which sequences run and how many new tokens
// each contributes (a prompt chunk, one decode token, or one token plus drafts to verify),
// and whom to preempt when KV memory runs out. Static, continuous and chunked-prefill
// batching are three implementations of this one interface.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "tessera/sdk/kv_cache.h"
#include "tessera/sdk/plugin.h"
#include "tessera/sdk/types.h"

namespace tessera {

struct ScheduledSequence {
  SeqId id = 0;
  // Tokens the KV cache attached from its prefix cache when this sequence was admitted this
  // step (the return value of kv.attach_cached_prefix). The engine adds them to
  // num_computed_tokens before feeding: they need no computation.
  int32_t num_cached_tokens = 0;
  int32_t num_new_tokens = 0;  // tokens fed this step, starting after the cached ones
};

struct RejectedSequence {
  SeqId id = 0;
  Status reason;  // e.g. waited longer than the admission limit
};

struct SchedulePlan {
  std::vector<ScheduledSequence> scheduled;
  // Sequences whose blocks the scheduler freed to make room; the engine resets their
  // progress and they go back to waiting (recompute on resume).
  std::vector<SeqId> preempted;
  std::vector<RejectedSequence> rejected;

  void clear() { scheduled.clear(); preempted.clear(); rejected.clear(); }
};

class Scheduler {
 public:
  virtual ~Scheduler() = default;

  // Limits other plugins size themselves by (the KV cache reserves per sequence).
  virtual int32_t max_num_seqs() const = 0;
  virtual int32_t max_batch_tokens() const = 0;

  // A new sequence arrives (status waiting). The pointer stays valid until remove().
  virtual void add(const SequenceInfo* seq) = 0;
  // The sequence finished or was cancelled; the engine frees its KV blocks itself.
  virtual void remove(SeqId id) = 0;

  // Plans one step. Calls kv.attach_cached_prefix / kv.allocate_slots for what it schedules
  // and kv.free for what it preempts. `now` is the engine clock in seconds.
  // Must schedule at least one token when any sequence is runnable and memory allows.
  virtual Status schedule(KvCacheManager& kv, double now, SchedulePlan* plan) = 0;

  virtual int32_t num_waiting() const = 0;
  virtual int32_t num_running() const = 0;
};

template <> struct PluginKindOf<Scheduler> {
  static constexpr PluginKind value = PluginKind::kScheduler;
};

}  // namespace tessera
