// The steady-state step loop allocates nothing: once every sequence of a batch is decoding,
// a step (scheduling, KV slots, the forward pass, sampling, streaming the token out) must not
// touch the heap. Heap traffic per token costs time and fragments memory in a server that
// runs for weeks. The same holds with a drafter (drafts proposed, verified, rolled back).
// Counted by replacing the global operator new for this test binary, which the plugins
// (shared libraries) resolve to as well.
#include <doctest/doctest.h>

#include <atomic>
#include <cstdlib>
#include <fstream>
#include <new>
#include <string>

#include "support/real_model.h"
#include "support/test_env.h"
#include "tessera/config.h"
#include "tessera/engine.h"
#include "tessera/plugin_registry.h"
#include "tessera/stack.h"
#include "support/replace_global_new.h"

namespace {
std::atomic<uint64_t> g_heap_allocations{0};
}  // namespace

void before_heap_allocation(std::size_t) { g_heap_allocations.fetch_add(1, std::memory_order_relaxed); }

using namespace tessera;

namespace {

constexpr int kSequences = 4;

struct Counts {
  int tokens[kSequences] = {};
  bool finished[kSequences] = {};
};

// Allocations during `measured_steps` steps taken after every sequence has produced at least
// `warmup_tokens` tokens.
uint64_t allocations_in_steady_state(const std::string& name, const std::string& engine_yaml,
                                     int warmup_tokens, int measured_steps, int max_tokens = 48,
                                     bool rehearse = false) {
  const auto dir = test::scratch_dir("step-allocations-" + name);
  const auto path = dir / "stack.yaml";
  std::ofstream(path) << "extends: " << (test::source_dir() / "configs/smollm2-cpu.yaml").string()
                      << "\nengine:\n" << engine_yaml;
  PluginRegistry registry;
  registry.scan_directory(test::plugin_dir());
  auto engine = build_engine(load_stack_config(path.string(), registry), registry);

  Counts counts;
  const std::string texts[kSequences] = {"The capital of France is", "Once upon a time",
                                         "def fibonacci(n):", "List three colours:"};
  auto submit_all = [&] {
    counts = Counts{};
    for (int i = 0; i < kSequences; ++i) {
      GenerationRequest r;
      r.prompt = engine->model().tokenizer().encode(texts[i], true, false);
      r.params.temperature = i % 2 ? 0.8f : 0.0f;  // both the greedy and the sampling path
      r.params.top_p = 0.9f;
      r.params.top_k = 40;
      r.params.seed = 7;
      r.params.has_seed = true;
      r.params.max_tokens = max_tokens;
      r.params.ignore_eos = true;
      // The callback itself must not allocate: it only counts.
      r.on_event = [&counts, i](const GenerationEvent& ev) {
        counts.tokens[i] += static_cast<int>(ev.tokens.size());
        if (ev.finished) counts.finished[i] = true;
      };
      uint64_t id = 0;
      REQUIRE(engine->submit(std::move(r), &id).is_ok());
    }
  };
  // With drafts the batch's logit rows vary step to step, and the runner's row buffers grow
  // to the largest verification seen: a rehearsal of the same (seeded, so identical) workload
  // reaches every size first.
  if (rehearse) {
    submit_all();
    engine->run_until_idle();
  }
  submit_all();
  auto all_past = [&](int n) {
    for (int i = 0; i < kSequences; ++i)
      if (counts.tokens[i] < n) return false;
    return true;
  };
  while (!all_past(warmup_tokens)) REQUIRE(engine->step());

  const uint64_t before = g_heap_allocations.load();
  // No doctest assertion inside the window: its bookkeeping allocates.
  int steps_with_work = 0;
  for (int s = 0; s < measured_steps; ++s) steps_with_work += engine->step() ? 1 : 0;
  const uint64_t allocations = g_heap_allocations.load() - before;
  REQUIRE(steps_with_work == measured_steps);

  for (int i = 0; i < kSequences; ++i) REQUIRE_FALSE(counts.finished[i]);  // still steady state
  engine->run_until_idle();
  for (int i = 0; i < kSequences; ++i) CHECK(counts.tokens[i] == max_tokens);
  CHECK(engine->stats().kv.num_used_blocks == 0);
  if (rehearse) CHECK(engine->stats().num_accepted_draft_tokens > 0);  // drafts were exercised
  MESSAGE(name << ": " << allocations << " heap allocations in " << measured_steps
               << " decode steps of " << kSequences << " sequences");
  return allocations;
}

}  // namespace

TEST_CASE("decode steps allocate nothing once the batch is running") {
  if (!test::have_real_model()) return;
  // Crossing KV block boundaries (block 16) during the measured steps is part of the test.
  CHECK(allocations_in_steady_state("continuous-paged-flash",
                                    "  scheduler: {plugin: continuous, max_num_seqs: 8}\n"
                                    "  kv_cache: {plugin: paged, block_size: 16, memory: 64MiB}\n"
                                    "  attention: {plugin: flash}\n",
                                    4, 24) == 0);
  CHECK(allocations_in_steady_state("chunked-paged-prefix",
                                    "  scheduler: {plugin: chunked-prefill, chunk_size: 32}\n"
                                    "  kv_cache: {plugin: paged, block_size: 8, memory: 64MiB, "
                                    "prefix_caching: true}\n"
                                    "  attention: {plugin: flash}\n",
                                    4, 24) == 0);
  CHECK(allocations_in_steady_state("static-contiguous-naive",
                                    "  scheduler: {plugin: static, max_num_seqs: 8}\n"
                                    "  kv_cache: {plugin: contiguous, memory: 256MiB}\n"
                                    "  attention: {plugin: naive}\n",
                                    4, 24) == 0);
  // Speculative decoding: drafts proposed, verified and rolled back every step. A step can
  // emit up to 5 tokens, so the sequences are longer; rehearsed (see above). adaptive: false,
  // so the drafts do not follow step times and the rehearsal is an exact replay.
  CHECK(allocations_in_steady_state("chunked-paged-ngram",
                                    "  scheduler: {plugin: chunked-prefill, chunk_size: 32}\n"
                                    "  kv_cache: {plugin: paged, block_size: 8, memory: 64MiB}\n"
                                    "  attention: {plugin: flash}\n"
                                    "  drafter: {plugin: ngram, num_draft_tokens: 4, min_ngram: 1, max_ngram: 3, adaptive: false}\n",
                                    8, 24, 200, /*rehearse=*/true) == 0);
  // q8_0 K/V: flash widens tiles into its preallocated scratch, store_kv quantizes in place.
  CHECK(allocations_in_steady_state("continuous-paged-flash-q8_0",
                                    "  scheduler: {plugin: continuous, max_num_seqs: 8}\n"
                                    "  kv_cache: {plugin: paged, block_size: 16, memory: 64MiB, dtype: q8_0}\n"
                                    "  attention: {plugin: flash}\n",
                                    4, 24) == 0);
}
