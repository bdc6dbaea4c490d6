// The inner kernel of attention.flash, shared by the plugin and the three builds of the kernel
// (portable, AVX2/FMA/F16C, and AVX-512 for CPUs that have them).
#pragma once

#include <cstddef>
#include <cstdint>

#include "tessera/sdk/attention.h"

namespace tessera::flash {

// One unit of parallel work: query positions [q_begin, q_end) of one sequence, for query
// heads [head_begin, head_end) of the group that shares KV head `kv_head` (the whole group
// unless a small decode batch is split per head to keep every thread busy). Every query row
// is computed the same way whatever task holds it.
struct Task {
  int32_t seq = 0;
  int32_t kv_head = 0;
  int32_t q_begin = 0;
  int32_t q_end = 0;
  int32_t head_begin = 0;  // within the group: query head kv_head * group + head_begin ...
  int32_t head_end = 0;
  // Decode tasks of a large batch cover KV heads [kv_head, kv_head_end) of their sequence, so
  // each position's K/V rows of all those heads (contiguous in the pool) are read together.
  int32_t kv_head_end = 0;
  int64_t cost = 0;  // rows x visible K/V positions, to start the longest tasks first

  // A decode task of a large batch: one query position, every KV head of its sequence.
  bool whole_sequence() const { return kv_head_end > kv_head + 1; }
};

// K rows of the next tile a decode prefetches while the current tile is computed.
inline constexpr int32_t kPrefetchRows = 8;

// Where each buffer sits in a thread's scratch (offsets in floats).
struct Layout {
  int32_t kv_tile = 0;   // K/V positions per tile, capped by the context
  int32_t max_rows = 0;  // query rows of a task: query positions x heads per KV head
  size_t q = 0, o = 0, m = 0, l = 0, s = 0, k = 0, v = 0;
  size_t slots = 0;  // a decode tile's pool row offsets (int64, 8-byte aligned)
  size_t num_floats = 0;
  size_t total_bytes() const { return num_floats * sizeof(float); }
};

// Computes the output rows of one task into batch.out. `scratch` holds layout.num_floats
// floats owned by the calling thread. Thread-safe across distinct tasks. `following` is the
// task this thread runs next, or null: a whole-sequence decode task asks for its first K/V
// tile while computing its own last one (only a prefetch; no result depends on it).
void run_task_generic(const AttentionShape& shape, const AttentionBatch& batch, const Task& task,
                      const Layout& layout, float* scratch, const Task* following);
// The same, compiled for AVX2/FMA/F16C: call only when cpu_has_avx2().
void run_task_avx2(const AttentionShape& shape, const AttentionBatch& batch, const Task& task,
                   const Layout& layout, float* scratch, const Task* following);
// The same, compiled for AVX-512 F/BW/VL as well, with the AVX2 build's results: call only when
// cpu_has_avx512().
void run_task_avx512(const AttentionShape& shape, const AttentionBatch& batch, const Task& task,
                     const Layout& layout, float* scratch, const Task* following);

}  // namespace tessera::flash
