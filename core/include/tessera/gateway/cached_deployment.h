// A deployment behind a chain of cache layers (gateway.cache, in config order). Lookups and
// stores run on the gateway's worker threads (CacheWorkers), never on the caller's thread:
// a layer may wait on Redis. A hit replays the cached tokens as events, so the HTTP layer
// streams it exactly like a model answer; a miss goes to the inner deployment, and its
// finished output is stored in every layer.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "tessera/gateway/deployment.h"
#include "tessera/sdk/cache_layer.h"

namespace tessera {

// A small pool of threads for cache lookups and stores (boost::asio::thread_pool inside).
class CacheWorkers {
 public:
  explicit CacheWorkers(int num_threads);
  ~CacheWorkers();  // waits for the queued work
  void post(std::function<void()> fn);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

struct CachedCall;  // one request's state through the chain (cached_deployment.cpp)

struct NamedCacheLayer {
  std::string name;  // the plugin name, the `layer` label of its metrics
  std::shared_ptr<CacheLayer> layer;
};

class CachedDeployment : public Deployment {
 public:
  // Turns stored tokens into CachedResponse::text; default: the inner model's tokenizer.
  using Decoder = std::function<std::string(const std::vector<TokenId>&)>;
  // Embeds DeploymentRequest::semantic_text for layers with needs_embedding(); called on a
  // cache worker, at most once per request. Throws on failure (the request then skips
  // those layers).
  using Embedder = std::function<std::vector<float>(const std::string&)>;
  // `layers` and `workers` must outlive the deployment and every request it started.
  CachedDeployment(std::shared_ptr<Deployment> inner, std::vector<NamedCacheLayer> layers, CacheWorkers& workers,
                   Decoder decode = {}, Embedder embed = {});

  const std::string& name() const override { return inner_->name(); }
  const Model& model() const override { return inner_->model(); }
  int32_t max_context() const override { return inner_->max_context(); }
  Status check(const GenerationRequest& request) const override { return inner_->check(request); }
  Status compile_constraint(const ConstraintSpec& spec,
                            std::shared_ptr<const CompiledConstraint>* out) const override {
    return inner_->compile_constraint(spec, out);
  }
  Status submit(DeploymentRequest request, std::shared_ptr<RequestSink> sink,
                std::unique_ptr<RequestHandle>* handle) override;

 private:
  // On a cache worker: the chain's lookups, then a replay or the inner deployment.
  void lookup_or_submit(const std::shared_ptr<CachedCall>& call);
  void end_without_answer(CachedCall& call, FinishReason reason, const Status& error);

  std::shared_ptr<Deployment> inner_;
  std::vector<NamedCacheLayer> layers_;
  CacheWorkers& workers_;
  Decoder decode_;
  Embedder embed_;
  bool needs_embedding_ = false;  // some layer wants CacheKey::embedding
};

}  // namespace tessera
