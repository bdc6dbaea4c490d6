#include "tessera/gateway/disaggregated.h"

#include <algorithm>
#include <chrono>

#include "tessera/plugin_registry.h"
#include "tessera/sdk/logger.h"

namespace tessera {
namespace {

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

// The prefill engine's tokens of one request, captured from its events.
struct CapturedTokens {
  std::mutex mutex;
  std::vector<SampledToken> tokens;
};

// Counts one prefill in flight at its host from construction to destruction.
class InFlight {
 public:
  explicit InFlight(std::shared_ptr<std::atomic<int32_t>> count) : count_(std::move(count)) { count_->fetch_add(1); }
  ~InFlight() { count_->fetch_sub(1); }
  InFlight(const InFlight&) = delete;
  InFlight& operator=(const InFlight&) = delete;

 private:
  std::shared_ptr<std::atomic<int32_t>> count_;
};

class ExportHandle final : public KvExportHandle {
 public:
  ExportHandle(std::shared_ptr<KvExport> exp, PrefillResult result, std::unique_ptr<InFlight> counted)
      : export_(std::move(exp)), result_(std::move(result)), counted_(std::move(counted)) {}
  ~ExportHandle() override { export_->release(); }
  const PrefillResult& result() const override { return result_; }
  Status read_layer(int32_t layer, std::vector<uint8_t>* k, std::vector<uint8_t>* v) override {
    return export_->read_layer(layer, k, v);
  }

 private:
  std::shared_ptr<KvExport> export_;
  PrefillResult result_;
  std::unique_ptr<InFlight> counted_;  // until the transfer was acknowledged or abandoned
};

}  // namespace

Status EnginePrefillHost::prefill(const RemotePrefillRequest& request, const std::function<bool()>& cancelled,
                                  std::unique_ptr<KvExportHandle>* out) {
  // Counted before draining_ is read, as DeploymentReplicaHost::generate does.
  auto counted = std::make_unique<InFlight>(in_flight_);
  if (draining_) return unavailable("the prefill engine is draining (shutting down): it takes no new prefills");
  auto exp = std::make_shared<KvExport>();
  auto captured = std::make_shared<CapturedTokens>();
  GenerationRequest g;
  g.prompt = request.prompt;
  g.params = request.params;
  g.params.max_tokens = 1;
  g.kv_export = exp;
  g.on_event = [captured](const GenerationEvent& ev) {
    std::lock_guard<std::mutex> lock(captured->mutex);
    captured->tokens.insert(captured->tokens.end(), ev.tokens.begin(), ev.tokens.end());
  };
  uint64_t id = 0;
  if (Status st = engine_.submit(std::move(g), &id); !st.is_ok()) return st;
  const auto start = std::chrono::steady_clock::now();
  while (!exp->wait_ready(0.05)) {
    const bool gone = cancelled();
    if (gone || seconds_since(start) > request.timeout_seconds) {
      engine_.cancel(id);
      exp->wait_ready(5.0);
      exp->release();  // in case it finished meanwhile and holds blocks
      return gone ? Status(StatusCode::kCancelled, "the decode engine cancelled the prefill")
                  : deadline_exceeded("prefill did not finish within " + std::to_string(request.timeout_seconds) + " s");
    }
  }
  PrefillResult result = exp->result();
  if (result.finish == FinishReason::kError) {
    exp->release();
    return result.error.is_ok() ? internal_error("the prefill failed") : result.error;
  }
  {
    std::lock_guard<std::mutex> lock(captured->mutex);
    result.tokens = captured->tokens;
  }
  *out = std::make_unique<ExportHandle>(exp, std::move(result), std::move(counted));
  return Status::ok();
}

// One request's transfer, shared by the worker that runs it, the handle that cancels it and
// the import sink the connector calls.
struct DisaggregatedDeployment::Call final : public KvImportSink {
  DeploymentRequest request;
  std::shared_ptr<RequestSink> sink;
  std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
  std::chrono::steady_clock::time_point first_token_at;
  DisaggregatedDeployment* owner = nullptr;

  std::mutex mutex;
  bool cancelled = false;
  CancelReason cancel_reason = CancelReason::kAbandoned;
  std::function<void()> abort_transfer;  // the connector's, while a remote call runs
  uint64_t engine_id = 0;
  bool handed_to_engine = false;        // the engine now owns the request's events
  bool answered = false;                // finished without the engine (first token ended it)
  std::shared_ptr<KvImport> import;
  RequestTimings timings;

  void cancel(CancelReason reason) {
    std::function<void()> abort;
    uint64_t id = 0;
    std::shared_ptr<KvImport> imp;
    {
      std::lock_guard<std::mutex> lock(mutex);
      if (cancelled) return;
      cancelled = true;
      cancel_reason = reason;
      abort = abort_transfer;
      if (handed_to_engine) id = engine_id;
      imp = import;
    }
    if (abort) abort();
    // A worker waiting for the engine's blocks wakes; rows still in flight are refused.
    if (imp) imp->refuse(Status(StatusCode::kCancelled, "the client went away"));
    if (id) owner->engine().cancel(id);
  }

  // A finished event for a request the engine never saw.
  void finish_here(FinishReason reason, const Status& error, std::vector<SampledToken> tokens) {
    GenerationEvent ev;
    ev.tokens = std::move(tokens);
    ev.finished = true;
    ev.finish_reason = reason;
    ev.error = error;
    ev.num_prompt_tokens = static_cast<int32_t>(request.generation.prompt.size());
    timings.finished = owner->engine().now();
    ev.timings = &timings;
    sink->on_event(ev);
  }

  void on_cancel_available(std::function<void()> abort) override {
    bool already = false;
    {
      std::lock_guard<std::mutex> lock(mutex);
      abort_transfer = abort;
      already = cancelled;
    }
    if (already) abort();
  }

  Status on_prefilled(const PrefillResult& result) override {
    first_token_at = std::chrono::steady_clock::now();
    {
      std::lock_guard<std::mutex> lock(owner->stats_mutex_);
      owner->stats_.prefill_seconds += std::chrono::duration<double>(first_token_at - start).count();
    }
    std::unique_lock<std::mutex> lock(mutex);
    if (cancelled) return Status(StatusCode::kCancelled, "the client went away");
    if (result.finish == FinishReason::kError) return result.error;
    const GenerationRequest& g = request.generation;
    timings.arrival = owner->engine().now() - seconds_since(start);
    timings.first_token = owner->engine().now();
    if (result.finish == FinishReason::kStop || g.params.max_tokens <= 1) {
      // The first token is the whole answer: the decode engine is not needed.
      answered = true;
      lock.unlock();
      finish_here(result.finish == FinishReason::kStop ? FinishReason::kStop : FinishReason::kLength, {},
                  result.tokens);
      return Status::ok();
    }
    import = std::make_shared<KvImport>(result, owner->import_options_);
    GenerationRequest decode = g;
    decode.kv_import = import;
    std::shared_ptr<RequestSink> s = sink;
    decode.on_event = [s](const GenerationEvent& ev) { s->on_event(ev); };
    uint64_t id = 0;
    if (Status st = owner->engine().submit(std::move(decode), &id); !st.is_ok()) {
      import.reset();
      return st;
    }
    engine_id = id;
    handed_to_engine = true;
    std::shared_ptr<KvImport> imp = import;
    lock.unlock();
    // The engine allocates blocks at its next step; until then no row can land.
    Status st = imp->wait_target(request_timeout());
    if (!st.is_ok()) return st;  // the engine computes the prompt itself, or the request ended
    return Status::ok();
  }

  Status on_layer(int32_t layer, std::span<const uint8_t> k, std::span<const uint8_t> v) override {
    return import->write_layer(layer, k, v);
  }

  double request_timeout() const { return owner->timeout_; }
};

namespace {

class CallHandle final : public RequestHandle {
 public:
  explicit CallHandle(std::shared_ptr<DisaggregatedDeployment::Call> call) : call_(std::move(call)) {}
  void cancel(CancelReason reason) override { call_->cancel(reason); }

 private:
  std::shared_ptr<DisaggregatedDeployment::Call> call_;
};

// A GenerationRequest that can travel: one sample, no prompt logits, no constraint.
bool transferable(const GenerationRequest& g) { return g.n == 1 && g.prompt_logprobs < 0 && !g.constraint; }

}  // namespace

DisaggregatedDeployment::DisaggregatedDeployment(std::string name, Engine& engine,
                                                 std::shared_ptr<KvConnector> connector,
                                                 std::vector<std::string> prefill_addresses, double timeout,
                                                 KvImport::Options import_options, int num_workers)
    : EngineDeployment(std::move(name), engine),
      connector_(std::move(connector)),
      prefill_addresses_(std::move(prefill_addresses)),
      timeout_(timeout),
      import_options_(import_options),
      fingerprint_(engine.kv_fingerprint()),
      workers_(std::make_unique<BlockingCallWorkers<Call>>(num_workers,
                                                           [this](const std::shared_ptr<Call>& call) { run(call); })) {}

DisaggregatedDeployment::~DisaggregatedDeployment() { shutdown(); }

void DisaggregatedDeployment::shutdown() {
  workers_->stop([](Call& c) { c.cancel(CancelReason::kAbandoned); },
                 [](Call& c) { c.finish_here(FinishReason::kCancelled, {}, {}); });
}

Status DisaggregatedDeployment::check_prefill_engines(std::vector<std::string>* warnings) {
  for (const std::string& address : prefill_addresses_) {
    std::string theirs;
    Status st = connector_->probe(address, &theirs);
    if (!st.is_ok()) {
      warnings->push_back(st.message());
      continue;
    }
    if (theirs != fingerprint_)
      return failed_precondition("deployment '" + name() + "': the prefill engine at " + address +
                                 " serves another model or KV layout: it has '" + theirs + "', this decode engine '" +
                                 fingerprint_ + "'");
  }
  return Status::ok();
}

DisaggregationStats DisaggregatedDeployment::stats() const {
  std::lock_guard<std::mutex> lock(stats_mutex_);
  return stats_;
}

Status DisaggregatedDeployment::submit(DeploymentRequest request, std::shared_ptr<RequestSink> sink,
                                       std::unique_ptr<RequestHandle>* handle) {
  if (Status st = engine().check(request.generation); !st.is_ok()) return st;
  auto call = std::make_shared<Call>();
  call->owner = this;
  call->sink = sink;
  call->request = std::move(request);
  ServedBy served;
  served.deployment = name();
  sink->on_start(served);
  if (!transferable(call->request.generation)) {
    // n > 1, prompt logprobs, a constraint: state a transfer does not carry; computed here.
    submit_local(call);
    *handle = std::make_unique<CallHandle>(call);
    return Status::ok();
  }
  if (!workers_->push(call)) return unavailable("deployment '" + name() + "' is shutting down");
  *handle = std::make_unique<CallHandle>(call);
  return Status::ok();
}

void DisaggregatedDeployment::submit_local(const std::shared_ptr<Call>& call) {
  GenerationRequest g = call->request.generation;
  std::shared_ptr<RequestSink> s = call->sink;
  g.on_event = [s](const GenerationEvent& ev) { s->on_event(ev); };
  std::unique_lock<std::mutex> lock(call->mutex);
  if (call->cancelled) {
    lock.unlock();
    call->finish_here(FinishReason::kCancelled, {}, {});
    return;
  }
  uint64_t id = 0;
  Status st = engine().submit(std::move(g), &id);
  if (!st.is_ok()) {
    lock.unlock();
    call->finish_here(FinishReason::kError, st, {});
    return;
  }
  call->engine_id = id;
  call->handed_to_engine = true;
}

void DisaggregatedDeployment::run(const std::shared_ptr<Call>& call) {
  RemotePrefillRequest rp;
  rp.request_id = name() + "-" + std::to_string(reinterpret_cast<uintptr_t>(call.get()));
  rp.prompt = call->request.generation.prompt;
  rp.params = call->request.generation.params;
  rp.want_kv = rp.params.max_tokens > 1;
  rp.fingerprint = fingerprint_;
  rp.timeout_seconds = timeout_;
  Status last;
  for (const std::string& address : prefill_addresses_) {
    Status st = connector_->remote_prefill(address, rp, call.get());
    bool handed = false, answered = false, cancelled = false;
    std::shared_ptr<KvImport> import;
    {
      std::lock_guard<std::mutex> lock(call->mutex);
      call->abort_transfer = nullptr;  // the connector's call is over
      handed = call->handed_to_engine;
      answered = call->answered;
      cancelled = call->cancelled;
      import = call->import;
    }
    if (answered) {
      std::lock_guard<std::mutex> lock(stats_mutex_);
      ++stats_.remote_prefills;
      return;
    }
    if (handed) {
      // From here the engine owns the request: it decodes (every layer landed) or computes
      // the prompt itself (the transfer failed); either way the client's stream goes on.
      const uint64_t bytes = import ? static_cast<uint64_t>(import->bytes_written()) : 0;
      if (import) import->complete(st);
      std::lock_guard<std::mutex> lock(stats_mutex_);
      ++stats_.remote_prefills;
      stats_.kv_bytes += bytes;
      if (st.is_ok())
        stats_.transfer_seconds += seconds_since(call->first_token_at);
      else if (!cancelled)
        ++stats_.transfer_failures;
      if (!st.is_ok() && !cancelled)
        host_logger().log(LogLevel::kWarn, "deployment '" + name() + "': KV transfer from " + address + " failed (" + st.message() +
                           "); the decode engine computes the prompt itself");
      return;
    }
    if (cancelled) {
      call->finish_here(FinishReason::kCancelled, {}, {});
      return;
    }
    if (st.code() == StatusCode::kFailedPrecondition || st.code() == StatusCode::kInvalidArgument ||
        st.code() == StatusCode::kOutOfRange) {
      // A model mismatch or a request the prefill engine refuses: another one would too.
      call->finish_here(FinishReason::kError, st, {});
      return;
    }
    last = st;
    std::lock_guard<std::mutex> lock(stats_mutex_);
    ++stats_.prefill_failovers;
    host_logger().log(LogLevel::kWarn, "deployment '" + name() + "': prefill engine " + address + " failed (" + st.message() +
                       "); trying the next");
  }
  // No prefill engine answered: compute the whole request here.
  {
    std::lock_guard<std::mutex> lock(stats_mutex_);
    ++stats_.local_prefills;
  }
  submit_local(call);
}

}  // namespace tessera
