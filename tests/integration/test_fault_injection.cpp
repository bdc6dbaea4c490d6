// Fault injection on the real model: allocation failure while queueing and admitting a
// request, a KV pool that has no room for one request, a KV plugin out of host memory, an
// attention kernel and a drafter that fail. Each fault ends the affected request (or step)
// with a clear error; the other requests finish, no KV block is left held, and the engine
// serves the next request.
//
// Allocation failure is real: this binary replaces the global operator new (the plugins,
// loaded into this process, allocate through it too) and fails, on the arming thread only,
// the next allocation of at least a given size.
#include <doctest/doctest.h>

#include <atomic>
#include <cstdlib>
#include <new>
#include <stdexcept>
#include <string>
#include <vector>

#include "support/plugins.h"
#include "support/real_model.h"
#include "support/stacks.h"
#include "support/test_env.h"
#include "tessera/config.h"
#include "tessera/engine.h"
#include "tessera/plugin_registry.h"
#include "tessera/stack.h"
#include "support/replace_global_new.h"

namespace {
// 0: disarmed. Otherwise the next allocation of at least this many bytes on this thread fails.
thread_local size_t t_fail_at_least = 0;
thread_local int t_failures = 0;  // allocations failed on this thread while armed

}  // namespace

void before_heap_allocation(std::size_t size) {
  if (t_fail_at_least != 0 && size >= t_fail_at_least) {
    t_fail_at_least = 0;
    ++t_failures;
    throw std::bad_alloc();
  }
}

using namespace tessera;

namespace {

// Arms the next allocation of >= `bytes` on this thread to fail; disarms on scope exit.
struct FailNextAllocation {
  explicit FailNextAllocation(size_t bytes) {
    t_failures = 0;
    t_fail_at_least = bytes;
  }
  ~FailNextAllocation() { t_fail_at_least = 0; }
  int failures() const { return t_failures; }
};

// Delegates to the configured KV cache; has no room for the sequences of one request (as a
// pool that this request alone cannot fit), and can throw from allocate_slots on demand.
class FaultyKvCache final : public KvCacheManager {
 public:
  explicit FaultyKvCache(std::shared_ptr<KvCacheManager> inner) : inner_(std::move(inner)) {}
  std::atomic<uint64_t> no_room_for_request{0};
  std::atomic<bool> throw_next{false};

  Status configure(const KvModelShape& shape, KvLayout* layout) override { return inner_->configure(shape, layout); }
  int32_t attach_cached_prefix(const SequenceInfo& seq) override {
    return seq.request_id == no_room_for_request ? 0 : inner_->attach_cached_prefix(seq);
  }
  bool allocate_slots(const SequenceInfo& seq, int32_t n) override {
    if (throw_next.exchange(false)) throw std::runtime_error("injected KV failure");
    if (seq.request_id == no_room_for_request) return false;
    return inner_->allocate_slots(seq, n);
  }
  void mark_computed(const SequenceInfo& seq, int32_t n) override { inner_->mark_computed(seq, n); }
  void truncate(const SequenceInfo& seq, int32_t n) override { inner_->truncate(seq, n); }
  void free(SeqId seq) override { inner_->free(seq); }
  Status fork(SeqId parent, SeqId child) override { return inner_->fork(parent, child); }
  std::span<const int32_t> block_table(SeqId seq) const override { return inner_->block_table(seq); }
  void take_block_copies(std::vector<BlockCopy>* copies) override { inner_->take_block_copies(copies); }
  int32_t num_free_blocks() const override { return inner_->num_free_blocks(); }
  KvStats stats() const override { return inner_->stats(); }

 private:
  std::shared_ptr<KvCacheManager> inner_;
};

// Delegates to the configured attention kernel; fails its next forward on demand.
class FaultyAttention final : public AttentionKernel {
 public:
  explicit FaultyAttention(std::shared_ptr<AttentionKernel> inner) : inner_(std::move(inner)) {}
  enum class Failure { kNone, kThrow, kStatus };
  std::atomic<Failure> next{Failure::kNone};

  size_t scratch_bytes(const AttentionShape& shape, int32_t max_rows, int32_t max_context) const override {
    return inner_->scratch_bytes(shape, max_rows, max_context);
  }
  Status forward(const AttentionShape& shape, const AttentionBatch& batch, Executor& executor) override {
    switch (next.exchange(Failure::kNone)) {
      case Failure::kThrow: throw std::runtime_error("injected attention exception");
      case Failure::kStatus: return internal_error("injected attention failure");
      case Failure::kNone: break;
    }
    return inner_->forward(shape, batch, executor);
  }

 private:
  std::shared_ptr<AttentionKernel> inner_;
};

// Delegates to the configured drafter; fails every propose while `failing` is set.
class FaultyDrafter final : public Drafter {
 public:
  explicit FaultyDrafter(std::shared_ptr<Drafter> inner) : inner_(std::move(inner)) {}
  std::atomic<bool> failing{false};
  std::atomic<bool> throwing{false};

  Status propose(std::span<const DraftRequest> requests) override {
    if (throwing) throw std::runtime_error("injected drafter exception");
    if (failing) return internal_error("injected drafter failure");
    return inner_->propose(requests);
  }
  void on_drafts_settled(SeqId seq, int32_t proposed, int32_t accepted) override {
    inner_->on_drafts_settled(seq, proposed, accepted);
  }
  void forget(SeqId seq) override { inner_->forget(seq); }

 private:
  std::shared_ptr<Drafter> inner_;
};

struct Rig {
  std::unique_ptr<PluginRegistry> registry;
  std::shared_ptr<FaultyKvCache> kv;
  std::shared_ptr<FaultyAttention> attention;
  std::shared_ptr<FaultyDrafter> drafter;
  std::unique_ptr<Engine> engine;
};

Rig make_rig(bool with_drafter = false) {
  std::string yaml =
      "engine:\n"
      "  scheduler: {plugin: continuous, max_num_seqs: 8, max_batch_tokens: 256}\n"
      "  kv_cache: {plugin: paged, block_size: 16, memory: 64MiB}\n";
  if (with_drafter) yaml += "  drafter: {plugin: ngram, num_draft_tokens: 4}\n";
  const auto path = test::write_stack_file(with_drafter ? "faults-drafter" : "faults", yaml);
  Rig r;
  r.registry = std::make_unique<PluginRegistry>();
  r.registry->scan_directory(test::plugin_dir());
  EngineComponents c = build_engine_components(load_stack_config(path.string(), *r.registry), *r.registry);
  r.kv = std::make_shared<FaultyKvCache>(c.kv_cache);
  c.kv_cache = r.kv;
  r.attention = std::make_shared<FaultyAttention>(c.attention);
  c.attention = r.attention;
  if (with_drafter) {
    REQUIRE(c.drafter);
    r.drafter = std::make_shared<FaultyDrafter>(c.drafter);
    c.drafter = r.drafter;
  }
  r.engine = std::make_unique<Engine>(std::move(c));
  return r;
}

struct Outcome {
  std::vector<TokenId> tokens;
  int finish_events = 0;
  FinishReason reason = FinishReason::kNone;
  std::string error;
};

GenerationRequest make_request(Engine& engine, const std::string& text, Outcome* o, int32_t max_tokens = 8,
                               int32_t n = 1) {
  GenerationRequest r;
  r.prompt = engine.model().tokenizer().encode(text, true, false);
  r.params.temperature = 0;
  r.params.max_tokens = max_tokens;
  r.params.ignore_eos = true;
  r.n = n;
  r.on_event = [o](const GenerationEvent& ev) {
    for (const auto& t : ev.tokens) o->tokens.push_back(t.token);
    if (ev.finished) {
      ++o->finish_events;
      o->reason = ev.finish_reason;
      o->error = ev.error.message();
    }
  };
  return r;
}

uint64_t submit(Engine& engine, const std::string& text, Outcome* o, int32_t max_tokens = 8, int32_t n = 1) {
  uint64_t id = 0;
  Status st = engine.submit(make_request(engine, text, o, max_tokens, n), &id);
  REQUIRE_MESSAGE(st.is_ok(), st.message());
  return id;
}

void check_completed(const Outcome& o, size_t tokens = 8) {
  CHECK(o.finish_events == 1);
  CHECK(o.reason == FinishReason::kLength);
  CHECK(o.tokens.size() == tokens);
}

void check_idle(Engine& engine) {
  const EngineStats s = engine.stats();
  CHECK(s.num_running == 0);
  CHECK(s.num_waiting == 0);
  test::check_all_blocks_free(engine);
}

}  // namespace

TEST_CASE("out of memory while queueing a request: submit answers resource_exhausted, nothing is queued") {
  if (!test::have_real_model()) return;
  Rig rig = make_rig();
  Engine& engine = *rig.engine;
  Outcome refused, after;
  GenerationRequest r = make_request(engine, "The capital of France is", &refused);
  uint64_t id = 0;
  Status st;
  {
    FailNextAllocation fail(1);  // submit's first allocation: the request record
    st = engine.submit(std::move(r), &id);
    CHECK(fail.failures() == 1);
  }
  CHECK(st.code() == StatusCode::kResourceExhausted);
  CHECK(st.message().find("admission: out of memory while queueing the request") != std::string::npos);
  submit(engine, "The capital of France is", &after);
  engine.run_until_idle();
  CHECK(refused.finish_events == 0);  // it was never queued
  check_completed(after);
  check_idle(engine);
}

TEST_CASE("out of memory while admitting one request fails it alone; the requests around it finish") {
  if (!test::have_real_model()) return;
  Rig rig = make_rig();
  Engine& engine = *rig.engine;
  Outcome before, victim, behind, later;
  submit(engine, "Once upon a time", &before);
  // 2000 output tokens: its per-token time stamps are reserved at admission (16 KB), the
  // only allocation of that size the step makes before the forward.
  submit(engine, "The capital of France is", &victim, /*max_tokens=*/2000);
  submit(engine, "List three colours:", &behind);
  {
    FailNextAllocation fail(12000);
    engine.step();
    CHECK(fail.failures() == 1);
  }
  CHECK(victim.finish_events == 1);
  CHECK(victim.reason == FinishReason::kError);
  CHECK(victim.error.find("admission: out of memory while admitting the request") != std::string::npos);
  CHECK(victim.tokens.empty());
  engine.run_until_idle();
  check_completed(before);
  check_completed(behind);
  CHECK(victim.finish_events == 1);
  submit(engine, "The capital of France is", &later, 16);
  engine.run_until_idle();
  check_completed(later, 16);
  check_idle(engine);
}

TEST_CASE("a request the KV pool has no room for ends with the KV error; the others finish") {
  if (!test::have_real_model()) return;
  Rig rig = make_rig();
  Engine& engine = *rig.engine;
  Outcome first, victim, behind;
  submit(engine, "Once upon a time", &first);
  rig.kv->no_room_for_request = submit(engine, "The capital of France is", &victim);
  submit(engine, "List three colours:", &behind);
  engine.run_until_idle();
  CHECK(victim.finish_events == 1);
  CHECK(victim.reason == FinishReason::kError);
  CHECK(victim.error.find("KV cache pool is too small for this sequence") != std::string::npos);
  check_completed(first);
  check_completed(behind);
  check_idle(engine);
}

TEST_CASE("the paged KV cache out of host memory says 'no room' and changes nothing") {
  // Without the engine: the plugin alone, so the failed allocation is its own.
  auto kv = test::create_plugin<KvCacheManager>("paged", "{memory: 1MiB, block_size: 16}");
  REQUIRE(kv);
  KvLayout layout;
  REQUIRE(kv->configure(KvModelShape{2, 2, 32, /*max_context=*/256, /*max_num_seqs=*/4}, &layout).is_ok());
  std::vector<TokenId> tokens(40, 7);
  SequenceInfo seq;
  seq.id = 1;
  seq.request_id = 1;
  seq.tokens = tokens;
  seq.num_prompt_tokens = 40;
  const int32_t free_before = kv->num_free_blocks();
  {
    FailNextAllocation fail(1);  // the new sequence's block table
    CHECK_FALSE(kv->allocate_slots(seq, 40));
    CHECK(fail.failures() == 1);
  }
  CHECK(kv->num_free_blocks() == free_before);
  CHECK(kv->block_table(1).empty());
  CHECK(kv->stats().num_slots_reserved == 0);
  // With memory back the same call succeeds, and a fork out of memory fails the child alone.
  REQUIRE(kv->allocate_slots(seq, 40));
  CHECK(kv->block_table(1).size() == 3);
  kv->mark_computed(seq, 40);
  {
    FailNextAllocation fail(1);
    Status st = kv->fork(1, 2);
    CHECK(st.code() == StatusCode::kResourceExhausted);
    CHECK(fail.failures() == 1);
  }
  CHECK(kv->block_table(2).empty());
  kv->free(1);
  CHECK(kv->stats().num_used_blocks == 0);
  CHECK(kv->stats().num_slots_reserved == 0);
}

TEST_CASE("a KV plugin that throws ends that step's requests with the error; the engine goes on") {
  if (!test::have_real_model()) return;
  Rig rig = make_rig();
  Engine& engine = *rig.engine;
  Outcome a, after;
  submit(engine, "Once upon a time", &a);
  rig.kv->throw_next = true;
  engine.step();
  CHECK(a.finish_events == 1);
  CHECK(a.reason == FinishReason::kError);
  CHECK(a.error == "engine step: injected KV failure");
  submit(engine, "Once upon a time", &after);
  engine.run_until_idle();
  check_completed(after);
  CHECK(engine.stats().num_step_errors == 1);
  check_idle(engine);
}

TEST_CASE("an attention kernel that fails or throws ends the batch's requests; the engine goes on") {
  if (!test::have_real_model()) return;
  Rig rig = make_rig();
  Engine& engine = *rig.engine;
  for (auto failure : {FaultyAttention::Failure::kStatus, FaultyAttention::Failure::kThrow}) {
    const bool thrown = failure == FaultyAttention::Failure::kThrow;
    INFO((thrown ? "exception" : "error status"));
    Outcome a, b, after;
    submit(engine, "Once upon a time", &a);
    submit(engine, "List three colours:", &b);
    engine.step();  // prompts computed
    REQUIRE(a.finish_events == 0);
    rig.attention->next = failure;
    engine.step();
    for (const Outcome* o : {&a, &b}) {
      CHECK(o->finish_events == 1);
      CHECK(o->reason == FinishReason::kError);
      CHECK(o->error.find(thrown ? "injected attention exception" : "injected attention failure") != std::string::npos);
    }
    submit(engine, "Once upon a time", &after);
    engine.run_until_idle();
    check_completed(after);
    check_idle(engine);
  }
}

TEST_CASE("a drafter that fails or throws costs its drafts, not the output: greedy text is unchanged") {
  if (!test::have_real_model()) return;
  // A prompt that repeats itself, so the n-gram drafter proposes.
  const std::string prompt = "one two three four one two three four one two three four one two";
  Outcome reference;
  {
    Rig rig = make_rig(/*with_drafter=*/true);
    submit(*rig.engine, prompt, &reference, 24);
    rig.engine->run_until_idle();
    check_completed(reference, 24);
    CHECK(rig.engine->stats().num_draft_tokens > 0);
  }
  for (bool throwing : {false, true}) {
    INFO((throwing ? "exception" : "error status"));
    Rig rig = make_rig(/*with_drafter=*/true);
    rig.drafter->failing = !throwing;
    rig.drafter->throwing = throwing;
    Outcome o;
    submit(*rig.engine, prompt, &o, 24);
    rig.engine->run_until_idle();
    check_completed(o, 24);
    CHECK(o.tokens == reference.tokens);
    const EngineStats s = rig.engine->stats();
    CHECK(s.num_drafter_errors > 0);
    CHECK(s.num_draft_tokens == 0);
    check_idle(*rig.engine);
  }
}
