// CachedDeployment without a model: a scripted inner deployment and an in-memory cache
// layer. A miss reaches the inner deployment and its finished output is stored; a hit is
// replayed as events (on_start says which layer and tier) and never reaches it; what is
// stored depends on how the request ended; validation errors come back synchronously.
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <map>
#include <mutex>
#include <thread>

#include "tessera/gateway/cache_key.h"
#include "tessera/gateway/cached_deployment.h"

using namespace tessera;

namespace {

// Answers every request with `script` on the calling thread (or later, when `hold` is set:
// then finish() delivers it), counting submissions and cancels.
class ScriptedDeployment : public Deployment {
 public:
  std::vector<TokenId> script = {11, 12, 13};
  FinishReason reason = FinishReason::kStop;
  bool hold = false;
  std::atomic<int> submitted{0};
  // Cancels arrive from the test's thread or a worker (whichever saw the handle first).
  std::atomic<int> num_cancels{0};
  std::atomic<CancelReason> last_cancel{CancelReason::kAbandoned};
  std::shared_ptr<RequestSink> held;   // set on a worker before has_held
  std::atomic<bool> has_held{false};

  const std::string& name() const override { return name_; }
  const Model& model() const override { throw std::logic_error("no model in this test"); }
  int32_t max_context() const override { return 64; }
  Status check(const GenerationRequest& r) const override {
    if (r.params.max_tokens < 1) return invalid_argument("max_tokens: must be at least 1");
    return Status::ok();
  }
  Status compile_constraint(const ConstraintSpec&, std::shared_ptr<const CompiledConstraint>*) const override {
    return unimplemented("no constraint in this test");
  }
  Status submit(DeploymentRequest, std::shared_ptr<RequestSink> sink, std::unique_ptr<RequestHandle>* handle) override {
    ++submitted;
    ServedBy served;
    served.deployment = name_;
    sink->on_start(served);
    struct Handle : RequestHandle {
      ScriptedDeployment* d;
      void cancel(CancelReason r) override {
        d->last_cancel = r;
        ++d->num_cancels;
      }
    };
    auto h = std::make_unique<Handle>();
    h->d = this;
    *handle = std::move(h);
    if (hold) {
      held = sink;
      has_held = true;
      return Status::ok();
    }
    finish(sink, reason);
    return Status::ok();
  }
  void finish(const std::shared_ptr<RequestSink>& sink, FinishReason r) {
    GenerationEvent ev;
    for (TokenId t : script) {
      SampledToken st;
      st.token = t;
      ev.tokens.push_back(st);
    }
    sink->on_event(ev);
    GenerationEvent last;
    last.finished = true;
    last.finish_reason = r;
    sink->on_event(last);
  }

 private:
  std::string name_ = "small";
};

class MapCache : public CacheLayer {
 public:
  Status lookup(const CacheKey& key, std::optional<CachedResponse>* out) override {
    std::lock_guard<std::mutex> lock(mutex);
    ++lookups;
    auto it = entries.find(key.model + "|" + key.params + "|" + key.prompt);
    if (it != entries.end()) {
      *out = it->second;
      (*out)->tier = "map";
    }
    return Status::ok();
  }
  Status store(const CacheKey& key, const CachedResponse& r) override {
    std::lock_guard<std::mutex> lock(mutex);
    entries[key.model + "|" + key.params + "|" + key.prompt] = r;
    stored.notify_all();
    return Status::ok();
  }
  bool wait_for_entries(size_t n) {
    std::unique_lock<std::mutex> lock(mutex);
    return stored.wait_for(lock, std::chrono::seconds(5), [&] { return entries.size() >= n; });
  }
  std::mutex mutex;
  std::condition_variable stored;
  std::map<std::string, CachedResponse> entries;
  int lookups = 0;
};

// Collects what a request's sink hears; wait() blocks until the finished event.
class RecordingSink : public RequestSink {
 public:
  void on_start(const ServedBy& s) override {
    std::lock_guard<std::mutex> lock(mutex);
    served = s;
    ++starts;
  }
  void on_event(const GenerationEvent& ev) override {
    std::lock_guard<std::mutex> lock(mutex);
    for (const auto& t : ev.tokens) tokens.push_back(t.token);
    if (ev.finished) {
      finished = true;
      reason = ev.finish_reason;
      done.notify_all();
    }
  }
  bool wait() {
    std::unique_lock<std::mutex> lock(mutex);
    return done.wait_for(lock, std::chrono::seconds(5), [&] { return finished; });
  }
  std::mutex mutex;
  std::condition_variable done;
  ServedBy served;
  int starts = 0;
  std::vector<TokenId> tokens;
  bool finished = false;
  FinishReason reason = FinishReason::kNone;
};

DeploymentRequest request(const std::string& prompt) {
  DeploymentRequest r;
  r.generation.prompt = {1, 2, 3};
  r.generation.params.temperature = 0;
  r.generation.params.max_tokens = 8;
  r.prompt_text = prompt;
  r.output_params = canonical_output_params(r.generation.params, {});
  r.cacheable = true;
  return r;
}

struct Fixture {
  std::shared_ptr<ScriptedDeployment> inner = std::make_shared<ScriptedDeployment>();
  std::shared_ptr<MapCache> cache = std::make_shared<MapCache>();
  CacheWorkers workers{2};
  // No model here: text is the token ids.
  CachedDeployment deployment{inner, {{"map", cache}}, workers, [](const std::vector<TokenId>& tokens) {
                                std::string text;
                                for (TokenId t : tokens) text += std::to_string(t) + " ";
                                return text;
                              }};
};

}  // namespace

TEST_CASE("validation errors come back from submit itself and nothing starts") {
  Fixture f;
  DeploymentRequest bad = request("x");
  bad.generation.params.max_tokens = 0;
  auto sink = std::make_shared<RecordingSink>();
  std::unique_ptr<RequestHandle> handle;
  Status st = f.deployment.submit(std::move(bad), sink, &handle);
  CHECK(st.code() == StatusCode::kInvalidArgument);
  CHECK(st.message().find("max_tokens") == 0);
  CHECK(sink->starts == 0);
  CHECK(f.inner->submitted == 0);
}

TEST_CASE("a hit is replayed token by token and never reaches the inner deployment") {
  Fixture f;
  DeploymentRequest r = request("hello");
  const std::string key = "small|" + r.output_params + "|hello";
  f.cache->entries[key] = CachedResponse{"text", {5, 6, 7, 8}, FinishReason::kLength, ""};
  auto sink = std::make_shared<RecordingSink>();
  std::unique_ptr<RequestHandle> handle;
  REQUIRE(f.deployment.submit(std::move(r), sink, &handle).is_ok());
  REQUIRE(sink->wait());
  CHECK(sink->served.is_cache_hit());
  CHECK(sink->served.cache_layer == "map");
  CHECK(sink->served.cache_tier == "map");
  CHECK(sink->tokens == std::vector<TokenId>{5, 6, 7, 8});
  CHECK(sink->reason == FinishReason::kLength);
  CHECK(f.inner->submitted == 0);
}

TEST_CASE("not cacheable: straight to the inner deployment, no lookup") {
  Fixture f;
  DeploymentRequest r = request("n2");
  r.cacheable = false;
  auto sink = std::make_shared<RecordingSink>();
  std::unique_ptr<RequestHandle> handle;
  REQUIRE(f.deployment.submit(std::move(r), sink, &handle).is_ok());
  REQUIRE(sink->wait());
  CHECK(f.inner->submitted == 1);
  CHECK_FALSE(sink->served.cache_consulted);
  CHECK(f.cache->lookups == 0);
}

TEST_CASE("a miss is stored when it ended by stop, length or a matched stop string; not when abandoned") {
  struct Case {
    FinishReason reason;
    bool hold;
    CancelReason cancel;
    bool stored;
  };
  const Case cases[] = {{FinishReason::kStop, false, CancelReason::kAbandoned, true},
                        {FinishReason::kLength, false, CancelReason::kAbandoned, true},
                        {FinishReason::kError, false, CancelReason::kAbandoned, false},
                        {FinishReason::kCancelled, true, CancelReason::kOutputComplete, true},
                        {FinishReason::kCancelled, true, CancelReason::kAbandoned, false}};
  int i = 0;
  for (const Case& c : cases) {
    CAPTURE(i);
    Fixture f;
    f.inner->reason = c.reason;
    f.inner->hold = c.hold;
    auto sink = std::make_shared<RecordingSink>();
    std::unique_ptr<RequestHandle> handle;
    REQUIRE(f.deployment.submit(request("p" + std::to_string(i++)), sink, &handle).is_ok());
    if (c.hold) {
      for (int k = 0; k < 500 && !f.inner->has_held; ++k) std::this_thread::sleep_for(std::chrono::milliseconds(10));
      REQUIRE(f.inner->has_held);
      handle->cancel(c.cancel);  // as the gateway does when a stop string matched, or the client left
      for (int k = 0; k < 500 && f.inner->num_cancels == 0; ++k) std::this_thread::sleep_for(std::chrono::milliseconds(10));
      REQUIRE(f.inner->num_cancels == 1);
      CHECK(f.inner->last_cancel == c.cancel);
      f.inner->finish(f.inner->held, FinishReason::kCancelled);
    }
    REQUIRE(sink->wait());
    CHECK(sink->served.cache_consulted);
    CHECK_FALSE(sink->served.is_cache_hit());
    CHECK(sink->tokens == f.inner->script);
    if (c.stored) {
      REQUIRE(f.cache->wait_for_entries(1));
      const CachedResponse& r = f.cache->entries.begin()->second;
      CHECK(r.tokens == f.inner->script);
      CHECK(r.text == "11 12 13 ");
      CHECK(r.finish_reason == c.reason);
    } else {
      // The store would run on the workers; give them the time it takes, then look.
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      CHECK(f.cache->entries.empty());
    }
  }
}

TEST_CASE("a stored answer is a hit for the same request and a miss for another deployment's key") {
  Fixture f;
  auto first = std::make_shared<RecordingSink>();
  std::unique_ptr<RequestHandle> h1, h2;
  REQUIRE(f.deployment.submit(request("same"), first, &h1).is_ok());
  REQUIRE(first->wait());
  REQUIRE(f.cache->wait_for_entries(1));
  auto second = std::make_shared<RecordingSink>();
  REQUIRE(f.deployment.submit(request("same"), second, &h2).is_ok());
  REQUIRE(second->wait());
  CHECK(second->served.is_cache_hit());
  CHECK(second->tokens == first->tokens);
  CHECK(second->reason == FinishReason::kStop);
  CHECK(f.inner->submitted == 1);
  CHECK(f.cache->entries.begin()->first.rfind("small|", 0) == 0);
}

TEST_CASE("a request cancelled before its lookup ran never reaches the model") {
  Fixture f;
  f.inner->hold = true;
  auto sink = std::make_shared<RecordingSink>();
  std::unique_ptr<RequestHandle> handle;
  // Occupy both workers so the lookup waits behind them.
  std::mutex gate;
  gate.lock();
  f.workers.post([&] { std::lock_guard<std::mutex> l(gate); });
  f.workers.post([&] { std::lock_guard<std::mutex> l(gate); });
  REQUIRE(f.deployment.submit(request("late"), sink, &handle).is_ok());
  handle->cancel(CancelReason::kAbandoned);
  gate.unlock();
  // The sink still hears a start and a (cancelled) finish, so the caller can close its books.
  REQUIRE(sink->wait());
  CHECK(sink->reason == FinishReason::kCancelled);
  CHECK(sink->starts == 1);
  CHECK(f.inner->submitted == 0);
  CHECK(f.cache->lookups == 0);
}
