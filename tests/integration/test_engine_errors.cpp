// A plugin error inside a step ends that step's requests with FinishReason::kError and the
// message, and the engine keeps serving: a scheduler that throws or returns an error, a
// sampler that throws for one request (only that request fails), on the calling thread and on
// the engine's own thread (where an escaped exception used to be std::terminate). The KV
// blocks of the failed requests come back.
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "support/real_model.h"
#include "support/stacks.h"
#include "support/test_env.h"
#include "tessera/config.h"
#include "tessera/engine.h"
#include "tessera/plugin_registry.h"
#include "tessera/stack.h"

using namespace tessera;

namespace {

// Delegates to the configured scheduler; fails its next schedule() call that has sequences
// to plan, on demand.
class FlakyScheduler final : public Scheduler {
 public:
  explicit FlakyScheduler(std::shared_ptr<Scheduler> inner) : inner_(std::move(inner)) {}
  enum class Failure { kNone, kThrow, kStatus };
  std::atomic<Failure> next{Failure::kNone};

  int32_t max_num_seqs() const override { return inner_->max_num_seqs(); }
  int32_t max_batch_tokens() const override { return inner_->max_batch_tokens(); }
  void add(const SequenceInfo* seq) override { inner_->add(seq); }
  void remove(SeqId id) override { inner_->remove(id); }
  Status schedule(KvCacheManager& kv, double now, SchedulePlan* plan) override {
    if (inner_->num_waiting() + inner_->num_running() == 0) return inner_->schedule(kv, now, plan);
    switch (next.exchange(Failure::kNone)) {
      case Failure::kThrow: throw std::runtime_error("injected scheduler exception");
      case Failure::kStatus: return internal_error("injected scheduler failure");
      case Failure::kNone: break;
    }
    return inner_->schedule(kv, now, plan);
  }
  int32_t num_waiting() const override { return inner_->num_waiting(); }
  int32_t num_running() const override { return inner_->num_running(); }

 private:
  std::shared_ptr<Scheduler> inner_;
};

// Delegates to the configured sampler; throws for requests seeded with kPoisonSeed.
constexpr uint64_t kPoisonSeed = 666;
class PoisonedSampler final : public test::ForwardingSampler {
 public:
  using ForwardingSampler::ForwardingSampler;
  Status sample(std::span<float> logits, const SamplingInput& in, SamplerState* state, SampledToken* out) override {
    if (in.params->has_seed && in.params->seed == kPoisonSeed) throw std::runtime_error("injected sampler exception");
    return inner_->sample(logits, in, state, out);
  }
};

struct Rig {
  std::unique_ptr<PluginRegistry> registry;
  std::shared_ptr<FlakyScheduler> scheduler;
  std::unique_ptr<Engine> engine;
};

Rig make_rig() {
  const auto path = test::write_stack_file("engine-errors",
                                           "engine:\n"
                                           "  scheduler: {plugin: chunked-prefill, chunk_size: 16, max_batch_tokens: 64}\n"
                                           "  kv_cache: {plugin: paged, block_size: 16, memory: 64MiB}\n");
  Rig r;
  r.registry = std::make_unique<PluginRegistry>();
  r.registry->scan_directory(test::plugin_dir());
  EngineComponents c = build_engine_components(load_stack_config(path.string(), *r.registry), *r.registry);
  r.scheduler = std::make_shared<FlakyScheduler>(c.scheduler);
  c.scheduler = r.scheduler;
  c.sampler = std::make_shared<PoisonedSampler>(c.sampler);
  r.engine = std::make_unique<Engine>(std::move(c));
  return r;
}

using test::Outcome;

uint64_t submit(Engine& engine, const std::string& text, Outcome* o, uint64_t seed = 1, int32_t max_tokens = 8) {
  GenerationRequest r;
  r.prompt = engine.model().tokenizer().encode(text, true, false);
  r.params.temperature = 0;
  r.params.seed = seed;
  r.params.has_seed = true;
  r.params.max_tokens = max_tokens;
  r.params.ignore_eos = true;
  r.on_event = test::record_into(o);
  uint64_t id = 0;
  REQUIRE(engine.submit(std::move(r), &id).is_ok());
  return id;
}


}  // namespace

TEST_CASE("a scheduler that throws or fails ends the step's requests with an error; the engine goes on") {
  if (!test::have_real_model()) return;
  Rig rig = make_rig();
  Engine& engine = *rig.engine;
  for (auto failure : {FlakyScheduler::Failure::kThrow, FlakyScheduler::Failure::kStatus}) {
    const bool thrown = failure == FlakyScheduler::Failure::kThrow;
    INFO((thrown ? "exception" : "error status"));
    Outcome a, b, after;
    submit(engine, "The capital of France is", &a);
    submit(engine, "Once upon a time", &b);
    engine.step();  // both admitted, prompts computed
    rig.scheduler->next = failure;
    engine.step();
    for (const Outcome* o : {&a, &b}) {
      CHECK(o->finished);
      CHECK(o->reason == FinishReason::kError);
      CHECK(o->error.find(thrown ? "engine step: injected scheduler exception" : "scheduler: injected scheduler failure") !=
            std::string::npos);
    }
    test::check_all_blocks_free(engine);
    // Still serving: a new request completes.
    submit(engine, "Once upon a time", &after);
    engine.run_until_idle();
    CHECK(after.finished);
    CHECK(after.reason == FinishReason::kLength);
    CHECK(after.tokens.size() == 8);
    test::check_all_blocks_free(engine);
  }
  CHECK(engine.stats().num_step_errors == 2);
}

TEST_CASE("a sampler exception fails only its own request") {
  if (!test::have_real_model()) return;
  Rig rig = make_rig();
  Engine& engine = *rig.engine;
  Outcome good, bad;
  submit(engine, "List three colours:", &good);
  submit(engine, "List three colours:", &bad, kPoisonSeed);
  engine.run_until_idle();
  CHECK(bad.finished);
  CHECK(bad.reason == FinishReason::kError);
  CHECK(bad.error == "sampler: injected sampler exception");
  CHECK(good.reason == FinishReason::kLength);
  CHECK(good.tokens.size() == 8);
  test::check_all_blocks_free(engine);
}

TEST_CASE("on the engine's own thread a throwing scheduler does not end the process") {
  if (!test::have_real_model()) return;
  Rig rig = make_rig();
  Engine& engine = *rig.engine;
  std::mutex m;
  std::condition_variable cv;
  int finished = 0;
  Outcome first, second;
  auto wait_for = [&](int n) {
    std::unique_lock<std::mutex> lock(m);
    return cv.wait_for(lock, std::chrono::minutes(5), [&] { return finished >= n; });
  };
  // The engine thread delivers events; count finishes under the lock.
  GenerationRequest r;
  r.prompt = engine.model().tokenizer().encode("Once upon a time", true, false);
  r.params.temperature = 0;
  r.params.max_tokens = 8;
  r.params.ignore_eos = true;
  auto make_sink = [&](Outcome* o) {
    return [&, o](const GenerationEvent& ev) {
      for (const auto& t : ev.tokens) o->tokens.push_back(t.token);
      if (!ev.finished) return;
      std::lock_guard<std::mutex> lock(m);
      o->reason = ev.finish_reason;
      o->error = ev.error.message();
      ++finished;
      cv.notify_all();
    };
  };
  rig.scheduler->next = FlakyScheduler::Failure::kThrow;
  engine.start();
  uint64_t id = 0;
  r.on_event = make_sink(&first);
  REQUIRE(engine.submit(r, &id).is_ok());
  REQUIRE(wait_for(1));
  r.on_event = make_sink(&second);
  REQUIRE(engine.submit(r, &id).is_ok());
  REQUIRE(wait_for(2));
  engine.stop();
  CHECK(first.reason == FinishReason::kError);
  CHECK(first.error.find("injected scheduler exception") != std::string::npos);
  CHECK(second.reason == FinishReason::kLength);
  CHECK(second.tokens.size() == 8);
  test::check_all_blocks_free(engine);
}
