// The gateway: every configured deployment (an engine each, behind the cache layers of
// gateway.cache) and the optional router, by the model id clients send. The HTTP layer asks
// it for a deployment by name, or for the router's choice, and then talks to that Deployment.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "tessera/config.h"
#include "tessera/engine.h"
#include "tessera/gateway/cached_deployment.h"
#include "tessera/gateway/deployment.h"
#include "tessera/gateway/disaggregated.h"
#include "tessera/gateway/replicated.h"
#include "tessera/model.h"
#include "tessera/plugin_registry.h"
#include "tessera/sdk/router.h"

namespace tessera {

class EncoderModel;

class Gateway {
 public:
  // Builds each deployment's engine (in file order), the cache layers and the router.
  // Throws PluginError / std::runtime_error naming the slot, as build_engine does.
  // `progress` gets the deployment's name with the model load's progress.
  using ProgressFn = std::function<void(const std::string& deployment, size_t done, size_t total)>;
  static std::unique_ptr<Gateway> build(const StackConfig& config, PluginRegistry& registry,
                                        const ProgressFn& progress = {});
  // Wraps engines built elsewhere (tests): deployment i is served as names[i].
  Gateway(std::vector<std::string> names, std::vector<std::unique_ptr<Engine>> engines,
          std::vector<NamedCacheLayer> cache_layers = {});
  ~Gateway();

  size_t num_deployments() const { return deployments_.size(); }
  Deployment& deployment(size_t i) { return *deployments_[i]; }
  const Deployment& deployment(size_t i) const { return *deployments_[i]; }
  Engine& engine(size_t i) { return *engines_[i]; }
  const Engine& engine(size_t i) const { return *engines_[i]; }
  // nullptr when no deployment has that name.
  Deployment* find(const std::string& name);

  bool has_router() const { return router_ != nullptr; }
  const std::string& router_name() const { return router_name_; }
  // The router's choice for a request. Thread-safe. Cheap (a hash) unless the router needs
  // the prompt's embedding: then the caller computes it off the I/O thread (post_embedding_job).
  Status route(const RouteRequest& request, Deployment** out);
  // Whether route() wants RouteRequest::embedding (build() refuses such a router without an
  // `embedding:` model, so embedding_model() is then set).
  bool router_needs_embedding() const { return router_ && router_->needs_embedding(); }
  // Appends the router's own metrics (Prometheus text), labelled router="NAME".
  void render_router_metrics(std::string* out) const;
  // The samples both render_* write, as values: each cache layer's with ("layer", NAME) and
  // the router's with ("router", NAME) as the first label (for /v1/stats).
  void collect_plugin_metrics(std::vector<CacheMetric>* out) const;

  // The `embedding:` model, or nullptr when the config has none.
  EncoderModel* embedding_model() { return embedding_.get(); }
  // Runs `job` with the embedding model on the gateway's embedding thread (never the
  // caller's: tokenizing and forwards are slow). Requires embedding_model() != nullptr; the
  // job must not throw.
  void post_embedding_job(std::function<void(EncoderModel&)> job);

  // Appends the cache layers' own metrics (Prometheus text), labelled layer="NAME".
  void render_cache_metrics(std::string* out) const;
  // Appends tessera_disagg_* (decode deployments) and tessera_kv_transfer_* (every engine)
  // metrics, labelled deployment="NAME"; nothing when no deployment is disaggregated.
  void render_disaggregation_metrics(std::string* out) const;
  // Prefill-role deployments: "NAME HOST:PORT" for each kv_connector listening.
  const std::vector<std::string>& prefill_endpoints() const { return prefill_endpoints_; }
  // The decode deployment named so, or nullptr.
  DisaggregatedDeployment* disaggregated(const std::string& name);

  // Replicas: "NAME HOST:PORT" for each deployment this process serves to gateways
  // (replicas.listen), and the replicated deployment named so (replicas.endpoints) or nullptr.
  const std::vector<std::string>& replica_endpoints() const { return replica_endpoints_; }
  ReplicatedDeployment* replicated(const std::string& name);
  // Appends tessera_replica_* metrics (labelled deployment and replica) and each replica
  // router's own; nothing when no deployment is replicated or served to gateways.
  void render_replica_metrics(std::string* out) const;
  // SIGTERM: the engine endpoints this process serves (replica and prefill) refuse new calls
  // and fail health probes, so gateways send new requests elsewhere; calls in flight go on.
  void begin_drain();
  // Requests this process is running for gateways (replicas.listen) and prefills it is running
  // or holding for decode engines (disaggregation role prefill) now.
  int32_t served_remote_in_flight() const;
  // Cancels the calls gateways and decode engines have in flight here (the drain's deadline).
  void stop_serving_remote();

  void start();  // every engine's step loop
  void stop();

 private:
  Gateway() = default;
  // `bases[i]` (optional, else an EngineDeployment of engine i) behind the cache layers.
  void wrap_deployments(const std::vector<std::string>& names,
                        std::vector<std::shared_ptr<Deployment>> bases = {});

  std::vector<std::unique_ptr<Engine>> engines_;
  // Disaggregation: prefill hosts served by their connectors (shut down before the engines
  // go), and the decode deployments by name.
  std::vector<std::unique_ptr<EnginePrefillHost>> prefill_hosts_;
  std::vector<std::shared_ptr<KvConnector>> connectors_;
  std::vector<std::string> prefill_endpoints_;
  std::vector<std::shared_ptr<DisaggregatedDeployment>> decode_deployments_;
  // Replicas: hosts served to gateways (by connectors in connectors_), their endpoints, and
  // the replicated deployments.
  std::vector<std::unique_ptr<DeploymentReplicaHost>> replica_hosts_;
  std::vector<std::string> replica_endpoints_;
  std::vector<std::shared_ptr<ReplicatedDeployment>> replicated_deployments_;
  std::vector<NamedCacheLayer> cache_layers_;
  std::vector<std::shared_ptr<Deployment>> deployments_;
  std::shared_ptr<Router> router_;
  std::string router_name_;
  std::shared_ptr<EncoderModel> embedding_;
  std::unique_ptr<CacheWorkers> embed_worker_;  // /v1/embeddings forwards (one thread)
  // Last: destroyed (joined) first, while the deployments its tasks use still exist.
  std::unique_ptr<CacheWorkers> workers_;
};

}  // namespace tessera
