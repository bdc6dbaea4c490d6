// Replicas: several engine processes serve one deployment (docs/replicas.md).
//
//  DeploymentReplicaHost  what a kv_connector serves on an engine process (`replicas.listen`):
//                         whole requests run through the process's deployment, their events
//                         streamed back; refuses new ones while draining (SIGTERM).
//  ReplicatedDeployment   a gateway's deployment over the engine processes in
//                         `replicas.endpoints` and, with `local: true`, its own engine. A
//                         router plugin (prefix-affinity by default) picks a healthy replica
//                         per request; health probes run in the background. A replica that
//                         fails before the request's first token costs the client nothing
//                         but time (the next one serves it); one that fails mid-stream ends
//                         the request with a clear error, or, for a greedy request that a
//                         prefix of its output determines, continues it on another replica.
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "tessera/engine.h"
#include "tessera/gateway/blocking_call_workers.h"
#include "tessera/gateway/deployment.h"
#include "tessera/sdk/kv_connector.h"
#include "tessera/sdk/router.h"

namespace tessera {

class DeploymentReplicaHost final : public KvPrefillHost {
 public:
  // `deployment` serves the requests; `fingerprint` is its engine's (Engine::kv_fingerprint).
  DeploymentReplicaHost(std::shared_ptr<Deployment> deployment, std::string fingerprint)
      : deployment_(std::move(deployment)), fingerprint_(std::move(fingerprint)) {}
  std::string fingerprint() const override { return fingerprint_; }
  Status prefill(const RemotePrefillRequest&, const std::function<bool()>&, std::unique_ptr<KvExportHandle>*) override {
    return unimplemented("this endpoint serves whole requests (replicas.listen), not remote prefills; "
                         "point disaggregation.prefill at a prefill engine's listen address");
  }
  Status generate(const RemoteGenerateRequest& request, const std::function<bool()>& cancelled,
                  const std::function<bool(const RemoteEvent&)>& emit) override;
  bool draining() const override { return draining_.load(); }
  void begin_drain() { draining_ = true; }
  // Requests being served for gateways now.
  int32_t in_flight() const { return in_flight_.load(); }
  const std::string& deployment_name() const { return deployment_->name(); }

 private:
  std::shared_ptr<Deployment> deployment_;
  std::string fingerprint_;
  std::atomic<bool> draining_{false};
  std::atomic<int32_t> in_flight_{0};
};

// One replica as the gateway sees it (for /metrics).
struct ReplicaStatus {
  std::string name;          // "local", or the engine process's HOST:PORT
  bool healthy = false;
  int32_t in_flight = 0;
  uint64_t requests = 0;     // requests (and resumptions) sent to it
  uint64_t failures = 0;     // of them, calls that failed because of the replica
};

struct ReplicationStats {
  uint64_t failovers = 0;        // requests moved to another replica before their first token
  uint64_t resumed = 0;          // greedy requests continued on another replica mid-stream
  uint64_t midstream_errors = 0; // requests ended with an error: their replica failed mid-stream
  uint64_t unavailable = 0;      // requests refused: no replica could serve them
};

struct ReplicationOptions {
  std::vector<std::string> endpoints;  // the engine processes' HOST:PORT
  bool local = true;                   // the gateway's own engine serves requests too
  double health_interval = 1.0;
  double timeout = 600;
  int max_concurrent = 64;
};

class ReplicatedDeployment final : public EngineDeployment {
 public:
  // `engine` is the gateway's own (its model tokenizes requests; it serves when options.local).
  // `router` was created for this deployment; configure() is called here with the replica names.
  ReplicatedDeployment(std::string name, Engine& engine, std::shared_ptr<KvConnector> connector,
                       std::shared_ptr<Router> router, std::string router_plugin, ReplicationOptions options);
  ~ReplicatedDeployment() override;
  // Cancels queued and in-flight remote requests, stops the health probes, joins the threads.
  void shutdown();

  Status submit(DeploymentRequest request, std::shared_ptr<RequestSink> sink,
                std::unique_ptr<RequestHandle>* handle) override;

  // Probes every endpoint once: a model or KV layout mismatch is an error naming both; an
  // unreachable one goes to *warnings (it counts as unhealthy until a probe answers). Then
  // starts the background health probes.
  Status check_replicas(std::vector<std::string>* warnings);
  std::vector<ReplicaStatus> replicas() const;
  ReplicationStats stats() const;
  const std::string& router_plugin() const { return router_plugin_; }
  const Router& router() const { return *router_; }

  struct Replica;
  struct Call;

 private:
  // The replica the router picks among the healthy ones not in `exclude`; nullptr: none.
  Replica* choose(const DeploymentRequest& request, const std::vector<Replica*>& exclude, bool local_only);
  void run(const std::shared_ptr<Call>& call);
  void submit_local(const std::shared_ptr<Call>& call);
  void health_loop();
  void probe(Replica& replica);

  std::shared_ptr<KvConnector> connector_;
  std::shared_ptr<Router> router_;
  std::string router_plugin_;
  ReplicationOptions options_;
  std::string fingerprint_;
  std::vector<std::unique_ptr<Replica>> replicas_;  // "local" first when options.local

  mutable std::mutex stats_mutex_;
  ReplicationStats stats_;

  std::mutex health_mutex_;
  std::condition_variable health_cv_;
  bool stopping_ = false;
  std::thread health_thread_;
  // Remote requests, a thread each while they stream. Last: destroyed (joined) first.
  std::unique_ptr<BlockingCallWorkers<Call>> workers_;
};

}  // namespace tessera
