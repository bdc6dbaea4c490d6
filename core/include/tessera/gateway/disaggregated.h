// Prefill/decode disaggregation in the gateway (docs/disaggregation.md).
//
//  EnginePrefillHost        what a kv_connector serves on a prefill engine: runs a prompt with
//                           GenerationRequest::kv_export and hands out its KV rows.
//  DisaggregatedDeployment  a decode engine's deployment: each request is prefilled at one of
//                           the prefill engines (in order), its first token streamed at once,
//                           its KV imported, and decoded here. When no prefill engine answers
//                           before the header, the request is computed here instead; when a
//                           transfer fails after it, the decode engine recomputes the prompt
//                           (the client's stream goes on, nothing is lost or repeated).
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "tessera/engine.h"
#include "tessera/kv_transfer.h"
#include "tessera/gateway/blocking_call_workers.h"
#include "tessera/gateway/deployment.h"
#include "tessera/sdk/kv_connector.h"

namespace tessera {

class EnginePrefillHost final : public KvPrefillHost {
 public:
  explicit EnginePrefillHost(Engine& engine) : engine_(engine), fingerprint_(engine.kv_fingerprint()) {}
  std::string fingerprint() const override { return fingerprint_; }
  Status prefill(const RemotePrefillRequest& request, const std::function<bool()>& cancelled,
                 std::unique_ptr<KvExportHandle>* out) override;
  bool draining() const override { return draining_.load(); }
  // SIGTERM: new prefills are refused (decode engines go to the next prefill engine).
  void begin_drain() { draining_ = true; }
  // Prefills running or holding their blocks for a transfer not yet acknowledged: a draining
  // process waits for these (up to server.shutdown_timeout) before it stops serving.
  int32_t in_flight() const { return in_flight_->load(); }

 private:
  Engine& engine_;
  std::string fingerprint_;
  std::atomic<bool> draining_{false};
  // Shared with the export handles, which the connector may destroy after a drain gave up.
  std::shared_ptr<std::atomic<int32_t>> in_flight_ = std::make_shared<std::atomic<int32_t>>(0);
};

// Counters of a decode deployment (rendered in /metrics as tessera_disagg_*).
struct DisaggregationStats {
  uint64_t remote_prefills = 0;       // requests whose prompt a prefill engine computed
  uint64_t prefill_failovers = 0;     // prefill engines that failed before the header (next tried)
  uint64_t local_prefills = 0;        // requests computed here: no prefill engine answered
  uint64_t transfer_failures = 0;     // transfers that failed after the header (recomputed here)
  uint64_t kv_bytes = 0;              // KV payload bytes received
  double prefill_seconds = 0;         // call start .. first token (remote queue + compute + network)
  double transfer_seconds = 0;        // first token .. last layer landed
};

// The engine-facing methods (model, check, constraints) are EngineDeployment's; only how a
// request is started differs.
class DisaggregatedDeployment final : public EngineDeployment {
 public:
  // `prefill_addresses` are tried in order per request; `timeout` bounds one remote call;
  // `import_options` say whether decoding may start before the last layer landed.
  DisaggregatedDeployment(std::string name, Engine& engine, std::shared_ptr<KvConnector> connector,
                          std::vector<std::string> prefill_addresses, double timeout,
                          KvImport::Options import_options = {}, int num_workers = 32);
  ~DisaggregatedDeployment() override;
  // Cancels queued and in-flight transfers and joins the workers (before the engine stops).
  void shutdown();

  Status submit(DeploymentRequest request, std::shared_ptr<RequestSink> sink,
                std::unique_ptr<RequestHandle>* handle) override;

  // Asks every prefill engine for its fingerprint: a mismatch is an error naming both; an
  // unreachable one is reported in *warnings (it may come up later).
  Status check_prefill_engines(std::vector<std::string>* warnings);
  DisaggregationStats stats() const;
  const std::vector<std::string>& prefill_addresses() const { return prefill_addresses_; }

  struct Call;  // one request's transfer state (disaggregated_deployment.cpp)

 private:
  void run(const std::shared_ptr<Call>& call);
  void submit_local(const std::shared_ptr<Call>& call);

  std::shared_ptr<KvConnector> connector_;
  std::vector<std::string> prefill_addresses_;
  double timeout_;
  KvImport::Options import_options_;
  std::string fingerprint_;

  mutable std::mutex stats_mutex_;
  DisaggregationStats stats_;

  // Workers block in remote calls; each request takes one for its prefill and transfer. Last:
  // destroyed (joined) first.
  std::unique_ptr<BlockingCallWorkers<Call>> workers_;
};

}  // namespace tessera
