#include "tessera/gateway/cached_deployment.h"

#include <boost/asio/post.hpp>
#include <boost/asio/thread_pool.hpp>
#include <spdlog/spdlog.h>

#include <mutex>

#include "tessera/tokenizer.h"

namespace tessera {

struct CacheWorkers::Impl {
  explicit Impl(int n) : pool(static_cast<size_t>(n)) {}
  boost::asio::thread_pool pool;
};

CacheWorkers::CacheWorkers(int num_threads) : impl_(std::make_unique<Impl>(std::max(1, num_threads))) {}
CacheWorkers::~CacheWorkers() { impl_->pool.join(); }
void CacheWorkers::post(std::function<void()> fn) { boost::asio::post(impl_->pool, std::move(fn)); }

// One request through the chain: its key, the cancel state, and the output captured on a miss.
struct CachedCall {
  CacheKey key;
  std::vector<float> embedding;          // key.embedding's storage (layers with needs_embedding)
  DeploymentRequest request;
  std::shared_ptr<RequestSink> sink;
  std::mutex mutex;
  bool cancelled = false;
  CancelReason reason = CancelReason::kAbandoned;
  std::unique_ptr<RequestHandle> inner;  // set once the miss reached the inner deployment
  std::vector<TokenId> tokens;           // generated so far (engine thread only)
  bool started = false;                  // the sink heard on_start (cache worker only)
};

namespace {

class CachedHandle : public RequestHandle {
 public:
  explicit CachedHandle(std::shared_ptr<CachedCall> call) : call_(std::move(call)) {}
  void cancel(CancelReason reason) override {
    std::lock_guard<std::mutex> lock(call_->mutex);
    if (call_->cancelled) return;
    call_->cancelled = true;
    call_->reason = reason;
    if (call_->inner) call_->inner->cancel(reason);
  }

 private:
  std::shared_ptr<CachedCall> call_;
};

bool cancelled(CachedCall& call) {
  std::lock_guard<std::mutex> lock(call.mutex);
  return call.cancelled;
}

// Replays a hit: one event per token, as an engine step would deliver them, then the finish.
void replay(CachedCall& call, const CachedResponse& hit) {
  RequestTimings timings;
  GenerationEvent ev;
  ev.num_prompt_tokens = static_cast<int32_t>(call.request.generation.prompt.size());
  ev.timings = &timings;
  ev.tokens.resize(1);
  for (TokenId t : hit.tokens) {
    if (cancelled(call)) break;
    ev.tokens[0].token = t;
    call.sink->on_event(ev);
  }
  ev.tokens.clear();
  ev.finished = true;
  ev.finish_reason = cancelled(call) ? FinishReason::kCancelled : hit.finish_reason;
  call.sink->on_event(ev);
}

// Forwards the inner deployment's events and keeps the output for the store.
class CapturingSink : public RequestSink {
 public:
  CapturingSink(std::shared_ptr<CachedCall> call, const std::vector<NamedCacheLayer>& layers,
                CacheWorkers& workers, const CachedDeployment::Decoder& decode)
      : call_(std::move(call)), layers_(layers), workers_(workers), decode_(decode) {}

  void on_start(const ServedBy& served) override {
    ServedBy s = served;
    s.cache_consulted = true;
    call_->started = true;
    call_->sink->on_start(s);
  }

  void on_event(const GenerationEvent& ev) override {
    if (ev.choice == 0)
      for (const SampledToken& t : ev.tokens) call_->tokens.push_back(t.token);
    if (ev.finished && ev.choice == 0 && worth_storing(ev.finish_reason)) schedule_store(ev.finish_reason);
    call_->sink->on_event(ev);
  }

 private:
  bool worth_storing(FinishReason reason) {
    if (reason == FinishReason::kStop || reason == FinishReason::kLength) return true;
    // Cancelled because a stop string matched: the tokens up to here hold the whole answer,
    // and replaying them through the same stop strings (they are in the key) ends the same.
    std::lock_guard<std::mutex> lock(call_->mutex);
    return reason == FinishReason::kCancelled && call_->cancelled && call_->reason == CancelReason::kOutputComplete;
  }

  void schedule_store(FinishReason reason) {
    auto call = call_;
    const auto* layers = &layers_;
    const auto* decode = &decode_;
    workers_.post([call, layers, decode, reason] {
      try {
        CachedResponse response;
        response.tokens = std::move(call->tokens);
        response.finish_reason = reason;
        response.text = (*decode)(response.tokens);
        for (const auto& l : *layers) {
          if (l.layer->needs_embedding() && call->key.embedding.empty()) continue;
          Status st = l.layer->store(call->key, response);
          if (!st.is_ok()) spdlog::warn("gateway: cache layer '{}' could not store: {}", l.name, st.message());
        }
      } catch (const std::exception& e) {
        // A worker must not end the process; the answer was served, it is just not kept.
        spdlog::error("gateway: storing an answer failed: {}", e.what());
      }
    });
  }

  std::shared_ptr<CachedCall> call_;
  const std::vector<NamedCacheLayer>& layers_;
  CacheWorkers& workers_;
  const CachedDeployment::Decoder& decode_;
};

}  // namespace

CachedDeployment::CachedDeployment(std::shared_ptr<Deployment> inner, std::vector<NamedCacheLayer> layers,
                                   CacheWorkers& workers, Decoder decode, Embedder embed)
    : inner_(std::move(inner)),
      layers_(std::move(layers)),
      workers_(workers),
      decode_(std::move(decode)),
      embed_(std::move(embed)) {
  for (const auto& l : layers_) needs_embedding_ |= l.layer->needs_embedding();
  if (!decode_) {
    const Deployment* d = inner_.get();
    decode_ = [d](const std::vector<TokenId>& tokens) {
      return d->model().tokenizer().decode(tokens, /*render_special=*/false);
    };
  }
}

Status CachedDeployment::submit(DeploymentRequest request, std::shared_ptr<RequestSink> sink,
                                std::unique_ptr<RequestHandle>* handle) {
  if (!request.cacheable || layers_.empty()) return inner_->submit(std::move(request), std::move(sink), handle);
  if (Status st = inner_->check(request.generation); !st.is_ok()) return st;
  auto call = std::make_shared<CachedCall>();
  call->key.model = inner_->name();
  call->key.prompt = request.prompt_text;
  call->key.params = request.output_params;
  call->key.reproducible = request.reproducible;
  call->key.tenant = request.tenant;
  call->embedding = std::move(request.embedding);  // the router's, when it embedded the prompt
  call->request = std::move(request);
  call->sink = std::move(sink);
  *handle = std::make_unique<CachedHandle>(call);

  workers_.post([this, call] {
    try {
      lookup_or_submit(call);
    } catch (const std::exception& e) {
      spdlog::error("gateway: request failed in the cache chain: {}", e.what());
      end_without_answer(*call, FinishReason::kError, internal_error(e.what()));
    }
  });
  return Status::ok();
}

// Ends a request the chain will not answer: the sink still hears on_start and a finish.
void CachedDeployment::end_without_answer(CachedCall& call, FinishReason reason, const Status& error) {
  if (!call.started) {
    ServedBy served;
    served.deployment = inner_->name();
    served.cache_consulted = true;
    call.started = true;
    call.sink->on_start(served);
  }
  GenerationEvent ev;
  ev.finished = true;
  ev.finish_reason = reason;
  ev.error = error;
  call.sink->on_event(ev);
}

void CachedDeployment::lookup_or_submit(const std::shared_ptr<CachedCall>& call) {
  // Cancelled while queued (the client left): neither a lookup nor the model.
  if (cancelled(*call)) return end_without_answer(*call, FinishReason::kCancelled, Status::ok());
  bool embedded = !call->embedding.empty();
  if (embedded) call->key.embedding = call->embedding;
  {
    for (const auto& l : layers_) {
      // A token-id prompt has no text to embed: similarity layers skip it.
      if (needs_embedding_ && l.layer->needs_embedding() && !embedded && embed_ &&
          !call->request.semantic_text.empty()) {
        // Once per request, here on the worker, and only when the layers before did not
        // answer: the lookup and the store on the way back share it.
        embedded = true;
        try {
          call->embedding = embed_(call->request.semantic_text);
        } catch (const std::exception& e) {
          spdlog::warn("gateway: embedding the prompt failed ({}); similarity layers skip this request", e.what());
          call->embedding.clear();
        }
        call->key.embedding = call->embedding;
      }
      if (l.layer->needs_embedding() && call->key.embedding.empty()) continue;
      std::optional<CachedResponse> hit;
      Status st = l.layer->lookup(call->key, &hit);
      if (!st.is_ok()) {
        spdlog::warn("gateway: cache layer '{}' lookup failed: {}", l.name, st.message());
        continue;
      }
      if (!hit) continue;
      ServedBy served;
      served.deployment = inner_->name();
      served.cache_consulted = true;
      served.cache_layer = l.name;
      served.cache_tier = hit->tier;
      served.cache_similarity = hit->similarity;
      call->started = true;
      call->sink->on_start(served);
      replay(*call, *hit);
      return;
    }
    // A miss: the model answers, and what it says is stored on the way back.
    auto capturing = std::make_shared<CapturingSink>(call, layers_, workers_, decode_);
    std::unique_ptr<RequestHandle> inner;
    Status st = inner_->submit(std::move(call->request), capturing, &inner);
    if (!st.is_ok()) {
      // check() passed moments ago, so this is not the client's input: fail the request.
      return end_without_answer(*call, FinishReason::kError, st);
    }
    std::lock_guard<std::mutex> lock(call->mutex);
    if (call->cancelled) inner->cancel(call->reason);
    call->inner = std::move(inner);
  }
}

}  // namespace tessera
