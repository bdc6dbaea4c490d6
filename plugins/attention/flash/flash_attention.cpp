// attention.flash: exact attention computed tile by tile with an online softmax
// (FlashAttention-2's loop order, on the CPU). The full score matrix is never materialized:
// each task owns a tile of query rows of one sequence and one KV head, streams that
// sequence's K/V through the block table one tile at a time, and keeps per row only a
// running maximum, a running sum and an unnormalized output, rescaled whenever the maximum
// grows. All query heads that share a KV head (GQA) are processed by the same task, so each
// K/V tile is read and widened once for the whole group. Scratch memory per thread is a few
// tiles, independent of the context length.
#include <algorithm>
#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "flash_kernel_impl.h"
#include "tessera/sdk/kernels/ggml_types.h"
#include "tessera/sdk.h"

namespace tessera {
namespace flash {
void run_task_generic(const AttentionShape& shape, const AttentionBatch& batch, const Task& task,
                      const Layout& layout, float* scratch, const Task* following) {
  run_task_impl(shape, batch, task, layout, scratch, following);
}
}  // namespace flash

namespace {

using flash::Layout;
using flash::Task;

const ParamSpec kParams[] = {
    {"tile_size", ParamType::kInt, "64",
     "K/V positions per tile: loaded once per KV head and shared by its query heads", 1, 4096},
    {"query_tile", ParamType::kInt, "32",
     "query positions per task (each task covers these for all heads of one KV head)", 1, 4096},
    {"simd", ParamType::kEnum, "auto",
     "auto: the AVX-512 kernel when the CPU has AVX-512 F/BW/VL, else the AVX2/FMA/F16C one when "
     "it has those (both give the same bits); avx2: the AVX2 one even where AVX-512 exists; off: "
     "the portable kernel",
     -INFINITY, INFINITY, "auto|avx2|off"},
};

class FlashAttention final : public AttentionKernel {
 public:
  FlashAttention(int32_t kv_tile, int32_t query_tile, const std::string& simd)
      : kv_tile_(kv_tile), query_tile_(query_tile), run_task_(pick_build(simd)) {}

  size_t scratch_bytes(const AttentionShape& shape, int32_t max_rows,
                       int32_t max_context) const override {
    return layout(shape, std::max(1, max_rows), std::max(1, max_context)).total_bytes();
  }

  Status forward(const AttentionShape& shape, const AttentionBatch& batch,
                 Executor& executor) override {
    if (shape.num_kv_heads <= 0 || shape.num_heads % shape.num_kv_heads != 0)
      return invalid_argument("attention.flash: num_heads (" + std::to_string(shape.num_heads) +
                              ") must be a multiple of num_kv_heads (" +
                              std::to_string(shape.num_kv_heads) + ")");
    for (KvDtype t : {shape.k_dtype, shape.v_dtype})
      if (!kv_dtype_fits(t, shape.head_dim))
        return invalid_argument(std::string("attention.flash: KV dtype ") + kv_dtype_name(t) +
                                " needs head_dim % 32 == 0, got " + std::to_string(shape.head_dim));
    int32_t max_queries = 1;
    int32_t max_context = 1;
    const int32_t group = shape.num_heads / shape.num_kv_heads;
    const int32_t num_threads = std::max(1, executor.num_threads());
    // A small decode batch has fewer (sequence, KV head) tasks than keep the threads evenly
    // busy (batch 1 of a 3-KV-head model: 3 tasks on 2 threads, one thread does 2). Then each
    // decode task is split per query head: a decode row reads f32/f16 K/V in place, so a split
    // costs no extra copying, only K/V reads that hit the cache. Not for q8_0 or mixed pools:
    // there every head of a split would widen the same rows again (a q8_0 row costs a
    // multiply per element more than an f16 one; measured at batch 1, 2,048 tokens: 0.120 ms
    // split vs 0.086 unsplit, f16 split 0.083), while an unsplit task widens each row once for
    // the whole group.
    int64_t decode_tasks = 0;
    for (const AttentionSequence& seq : batch.sequences)
      if (seq.num_queries == 1) decode_tasks += shape.num_kv_heads;
    const bool split_heads = shape.k_dtype == shape.v_dtype && shape.k_dtype != KvDtype::kQ8_0 &&
                             decode_tasks > 0 && decode_tasks < 4 * num_threads;
    // With many decode sequences, one task per sequence covers all its KV heads: the pool
    // stores a position's K (or V) rows of all KV heads side by side, so reading them together
    // streams whole cache lines in order instead of a third of every position's bytes per task.
    const bool whole_sequences = decode_tasks >= 4 * num_threads * shape.num_kv_heads;
    tasks_.clear();
    for (size_t i = 0; i < batch.sequences.size(); ++i) {
      const AttentionSequence& seq = batch.sequences[i];
      max_queries = std::max(max_queries, seq.num_queries);
      max_context = std::max(max_context, seq.context_len);
      const int32_t heads_per_task = split_heads && seq.num_queries == 1 ? 1 : group;
      if (whole_sequences && seq.num_queries == 1) {
        tasks_.push_back({static_cast<int32_t>(i), 0, 0, 1, 0, group, shape.num_kv_heads,
                          static_cast<int64_t>(seq.context_len) * shape.num_heads});
        continue;
      }
      for (int32_t q = 0; q < seq.num_queries; q += query_tile_) {
        const int32_t q_end = std::min(seq.num_queries, q + query_tile_);
        const int64_t visible = seq.context_len - seq.num_queries + q_end;
        for (int32_t h = 0; h < shape.num_kv_heads; ++h)
          for (int32_t g = 0; g < group; g += heads_per_task)
            tasks_.push_back({static_cast<int32_t>(i), h, q, q_end, g, g + heads_per_task, h + 1,
                              (q_end - q) * visible * heads_per_task});
      }
    }
    if (tasks_.empty()) return Status::ok();
    // Longest first, handed out dynamically: a causal prefill's last query tiles cost far
    // more than its first ones, so a static even split would leave threads idle. A total
    // order keeps the hand-out deterministic; std::sort, unlike stable_sort, needs no
    // temporary buffer, so the steady-state step allocates nothing here.
    std::sort(tasks_.begin(), tasks_.end(), [](const Task& a, const Task& b) {
      if (a.cost != b.cost) return a.cost > b.cost;
      if (a.seq != b.seq) return a.seq < b.seq;
      if (a.kv_head != b.kv_head) return a.kv_head < b.kv_head;
      if (a.head_begin != b.head_begin) return a.head_begin < b.head_begin;
      return a.q_begin < b.q_begin;
    });

    const Layout lay = layout(shape, max_queries, max_context);
    if (static_cast<int32_t>(scratch_.size()) < num_threads) scratch_.resize(num_threads);
    // Sized once for full tiles (the most any call can need), not for this call's context:
    // growing with a short context would reallocate during decode.
    const size_t full_tiles = layout(shape, query_tile_, kv_tile_).num_floats;
    for (auto& s : scratch_)
      if (s.size() < std::max(full_tiles, lay.num_floats)) s.resize(std::max(full_tiles, lay.num_floats));

    std::atomic<size_t> next{0};
    const int64_t workers = std::min<int64_t>(num_threads, static_cast<int64_t>(tasks_.size()));
    executor.run(workers, [&](int64_t, int64_t, int thread) {
      float* scratch = scratch_[thread].data();
      // Each thread claims its next task before running the current one, so a decode task
      // can ask for the next one's first K/V tile while it computes its last (run_task_impl).
      size_t t = next.fetch_add(1, std::memory_order_relaxed);
      while (t < tasks_.size()) {
        const size_t following = next.fetch_add(1, std::memory_order_relaxed);
        run_task_(shape, batch, tasks_[t], lay, scratch,
                 following < tasks_.size() ? &tasks_[following] : nullptr);
        t = following;
      }
    });
    return Status::ok();
  }

  static Status create(const PluginConfig& config, const PluginContext&,
                       std::unique_ptr<AttentionKernel>* out) {
    *out = std::make_unique<FlashAttention>(static_cast<int32_t>(config.get_int("tile_size", 64)),
                                            static_cast<int32_t>(config.get_int("query_tile", 32)),
                                            config.get_string("simd", "auto"));
    return Status::ok();
  }

 private:
  Layout layout(const AttentionShape& shape, int32_t max_queries, int32_t max_context) const {
    const int32_t group = shape.num_kv_heads > 0 ? shape.num_heads / shape.num_kv_heads : 1;
    const size_t d = static_cast<size_t>(shape.head_dim);
    Layout lay;
    lay.kv_tile = std::min(kv_tile_, max_context);
    // A whole-sequence decode task holds one row per query head.
    lay.max_rows = std::max(std::min(query_tile_, max_queries) * group, shape.num_heads);
    const size_t rows = static_cast<size_t>(lay.max_rows);
    lay.q = 0;                                // the task's queries, at cache precision
    lay.o = lay.q + rows * d;                 // unnormalized outputs
    lay.m = lay.o + rows * d;                 // running maxima
    lay.l = (lay.m + rows + 1) & ~size_t{1};  // running sums, as doubles (8-byte aligned)
    lay.s = lay.l + 2 * rows;                 // scores / probabilities: a tile row per head of a group
    lay.k = lay.s + static_cast<size_t>(group) * lay.kv_tile;  // K tile, widened to float
    lay.v = lay.k + lay.kv_tile * d;          // V tile
    // Row offsets of a decode tile and the rows prefetched past it, as int64 (2 floats each).
    lay.slots = (lay.v + lay.kv_tile * d + 1) & ~size_t{1};
    // Two sets: a whole-sequence decode task holds the next tile's beside the current one's.
    lay.num_floats = lay.slots + 4 * static_cast<size_t>(lay.kv_tile + flash::kPrefetchRows);
    return lay;
  }

  using RunTask = void (*)(const AttentionShape&, const AttentionBatch&, const Task&,
                          const Layout&, float*, const Task*);
  // The build of the inner kernel for `simd` on this CPU: AVX-512 only for auto, AVX2 for auto
  // or avx2, else (or for off) the portable one.
  static RunTask pick_build(const std::string& simd) {
    if (simd == "auto" && cpu_has_avx512()) return &flash::run_task_avx512;
    if (simd != "off" && cpu_has_avx2()) return &flash::run_task_avx2;
    return &flash::run_task_generic;
  }

  int32_t kv_tile_;
  int32_t query_tile_;
  RunTask run_task_;  // the build of the inner kernel (the CPU was checked)
  std::vector<Task> tasks_;                  // rebuilt per call, capacity kept
  std::vector<std::vector<float>> scratch_;  // per thread
};

}  // namespace
}  // namespace tessera

TESSERA_REGISTER_PLUGIN(tessera::FlashAttention, tessera::AttentionKernel, "flash", "0.1.0",
                        "tiled attention with online softmax; scratch independent of context length",
                        tessera::kParams)
