// The seam between the HTTP layer and whatever serves a request: submit a request with a
// sink for its events, get a handle that cancels it. An engine implements it
// (EngineDeployment); a cache layer chain wraps another implementation (CachedDeployment,
// gateway/cached_deployment.h); a remote engine could too. The HTTP layer sees only this.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "tessera/engine.h"

namespace tessera {

// Who answered a request. Given once, before the request's first event.
struct ServedBy {
  std::string deployment;
  bool cache_consulted = false;  // a cache layer looked the request up
  std::string cache_layer;       // the layer that answered ("exact"); empty: the model did
  std::string cache_tier;        // where that layer found it ("memory", "redis")
  float cache_similarity = 1.0f; // the hit's prompt similarity (semantic layer; exact: 1)
  bool is_cache_hit() const { return !cache_layer.empty(); }
};

// Receives one request's progress. Calls come from any thread (an engine thread, a cache
// worker) but never two at once for one request, and in order: on_start, then events.
class RequestSink {
 public:
  virtual ~RequestSink() = default;
  virtual void on_start(const ServedBy& served) = 0;
  // As Engine's callback has them; event.timings is valid during the call only.
  virtual void on_event(const GenerationEvent& event) = 0;
};

enum class CancelReason {
  kAbandoned,       // the client went away or the server shuts down: the output is partial
  kOutputComplete,  // the caller has all the output it needs (a stop string matched)
};

// Thread-safe; cancelling twice, or after the request finished, does nothing.
class RequestHandle {
 public:
  virtual ~RequestHandle() = default;
  virtual void cancel(CancelReason reason) = 0;
};

struct DeploymentRequest {
  GenerationRequest generation;  // its on_event is ignored: events go to the sink
  // For cache layers: the prompt as text (chat rendered through the template) and the
  // canonical text of what changes the output besides the tokens (gateway/cache_key.h).
  std::string prompt_text;
  std::string output_params;
  bool reproducible = true;      // greedy, or a fixed seed
  bool cacheable = false;        // one sample, no logprobs: a cached answer can stand for it
  // For similarity-matching layers: the text to embed (the messages' contents, or the
  // completions prompt) and whose cache it is (CacheKey::tenant).
  std::string semantic_text;
  std::string tenant;
  // semantic_text's embedding when the router computed it already (a classifier router):
  // similarity layers reuse it instead of embedding the prompt a second time.
  std::vector<float> embedding;
};

class Deployment {
 public:
  virtual ~Deployment() = default;
  virtual const std::string& name() const = 0;
  // The model requests are tokenized for (its tokenizer and chat template).
  virtual const Model& model() const = 0;
  virtual int32_t max_context() const = 0;
  // The checks submit() makes (the errors Engine::submit returns); cheap, any thread.
  virtual Status check(const GenerationRequest& request) const = 0;
  // Compiles a structured-output spec for GenerationRequest::constraint with the serving
  // engine's constraint plugin (Engine::compile_constraint: kInvalidArgument naming the part
  // of the spec, kUnimplemented when the engine has none). Any thread.
  virtual Status compile_constraint(const ConstraintSpec& spec,
                                    std::shared_ptr<const CompiledConstraint>* out) const = 0;
  // Validates and starts the request; never blocks on slow work (cache tiers, the engine),
  // so it may be called from an I/O thread. On an error nothing started and the sink hears
  // nothing; on success *handle cancels it.
  virtual Status submit(DeploymentRequest request, std::shared_ptr<RequestSink> sink,
                        std::unique_ptr<RequestHandle>* handle) = 0;
};

// A deployment served by an engine in this process. The engine must outlive it.
class EngineDeployment : public Deployment {
 public:
  EngineDeployment(std::string name, Engine& engine) : name_(std::move(name)), engine_(engine) {}
  const std::string& name() const override { return name_; }
  const Model& model() const override { return engine_.model(); }
  int32_t max_context() const override { return engine_.max_context(); }
  Status check(const GenerationRequest& request) const override { return engine_.check(request); }
  Status compile_constraint(const ConstraintSpec& spec,
                            std::shared_ptr<const CompiledConstraint>* out) const override {
    return engine_.compile_constraint(spec, out);
  }
  Status submit(DeploymentRequest request, std::shared_ptr<RequestSink> sink,
                std::unique_ptr<RequestHandle>* handle) override;
  Engine& engine() { return engine_; }

 private:
  std::string name_;
  Engine& engine_;
};

}  // namespace tessera
