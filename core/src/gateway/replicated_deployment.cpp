#include "tessera/gateway/replicated.h"

#include <algorithm>
#include <chrono>

#include "tessera/plugin_registry.h"
#include "tessera/sdk/logger.h"

namespace tessera {

// ---------------------------------------------------------------------------------------------
// The engine process's side.

namespace {

// Carries one request's events from the engine thread to the connector's handler thread,
// which writes them to the wire (a slow gateway must never stall the engine's step loop).
class EventPipe final : public RequestSink {
 public:
  void on_start(const ServedBy&) override {}
  void on_event(const GenerationEvent& ev) override {
    RemoteEvent e;
    e.choice = ev.choice;
    e.tokens = ev.tokens;
    e.finished = ev.finished;
    e.finish_reason = ev.finish_reason;
    e.error = ev.error;
    e.num_prompt_tokens = ev.num_prompt_tokens;
    e.num_cached_prompt_tokens = ev.num_cached_prompt_tokens;
    e.num_draft_tokens = ev.num_draft_tokens;
    e.num_accepted_draft_tokens = ev.num_accepted_draft_tokens;
    e.prompt_logprobs = ev.prompt_logprobs;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      events_.push_back(std::move(e));
    }
    cv_.notify_one();
  }
  // Waits up to `timeout` for events and takes all there are.
  std::deque<RemoteEvent> take(std::chrono::milliseconds timeout) {
    std::unique_lock<std::mutex> lock(mutex_);
    cv_.wait_for(lock, timeout, [this] { return !events_.empty(); });
    std::deque<RemoteEvent> out;
    out.swap(events_);
    return out;
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<RemoteEvent> events_;
};

}  // namespace

Status DeploymentReplicaHost::generate(const RemoteGenerateRequest& request, const std::function<bool()>& cancelled,
                                       const std::function<bool(const RemoteEvent&)>& emit) {
  // Counted before draining_ is read: a drain that then sees no call in flight has also made
  // every uncounted call refuse (both atomics are sequentially consistent).
  in_flight_.fetch_add(1);
  struct Done {
    std::atomic<int32_t>& count;
    ~Done() { count.fetch_sub(1); }
  } done{in_flight_};
  if (draining_) return unavailable("the engine is draining (shutting down): it takes no new requests");
  auto pipe = std::make_shared<EventPipe>();
  DeploymentRequest dr;
  dr.generation.prompt = request.prompt;
  dr.generation.params = request.params;
  dr.generation.n = std::max(1, request.n);
  dr.generation.prompt_logprobs = request.prompt_logprobs;
  std::unique_ptr<RequestHandle> handle;
  if (Status st = deployment_->submit(std::move(dr), pipe, &handle); !st.is_ok()) return st;
  const int32_t samples = std::max(1, request.n);
  int32_t finished = 0;
  while (finished < samples) {
    for (const RemoteEvent& e : pipe->take(std::chrono::milliseconds(50))) {
      if (e.finished) ++finished;
      if (!emit(e)) {
        handle->cancel(CancelReason::kAbandoned);
        return Status(StatusCode::kCancelled, "the gateway went away");
      }
    }
    if (finished < samples && cancelled()) {
      handle->cancel(CancelReason::kAbandoned);
      return Status(StatusCode::kCancelled, "the gateway cancelled the request");
    }
  }
  return Status::ok();
}

// ---------------------------------------------------------------------------------------------
// The gateway's side.

struct ReplicatedDeployment::Replica {
  std::string name;
  std::string address;  // empty for the local engine
  bool is_local = false;
  std::atomic<bool> healthy{false};
  std::atomic<int32_t> in_flight{0};
  std::atomic<uint64_t> requests{0};
  std::atomic<uint64_t> failures{0};
};

// One request: shared by the worker that runs it, the handle that cancels it, and the
// connector that delivers its events.
struct ReplicatedDeployment::Call final : public RemoteEventSink {
  DeploymentRequest request;  // generation.prompt grows by the output when a request resumes
  std::shared_ptr<RequestSink> sink;
  ReplicatedDeployment* owner = nullptr;
  Replica* first_choice = nullptr;
  int32_t samples = 1;
  int32_t prompt_tokens = 0;  // as the client sent it

  std::mutex mutex;
  bool cancelled = false;
  std::function<void()> abort_call;  // the connector's, while a remote call runs
  bool handed_to_engine = false;     // the local engine owns the request's events
  uint64_t engine_id = 0;

  // Progress, touched only by the thread that delivers events (one at a time).
  std::vector<bool> finished;
  int32_t num_finished = 0;
  int64_t tokens_out = 0;               // all samples, all attempts
  std::vector<TokenId> attempt_output;  // sample 0's tokens in the current attempt
  int32_t resumed_tokens = 0;           // output moved into the prompt by resumptions
  int32_t cached_prompt_tokens = -1;    // from the first attempt
  int32_t draft_tokens = 0, accepted_draft_tokens = 0;            // earlier attempts'
  int32_t attempt_draft_tokens = 0, attempt_accepted_tokens = 0;  // this attempt's so far
  RequestTimings timings;

  bool all_finished() {
    std::lock_guard<std::mutex> lock(mutex);
    return num_finished == samples;
  }

  void cancel() {
    std::function<void()> abort;
    uint64_t id = 0;
    {
      std::lock_guard<std::mutex> lock(mutex);
      if (cancelled) return;
      cancelled = true;
      abort = abort_call;
      if (handed_to_engine) id = engine_id;
    }
    if (abort) abort();
    if (id) owner->engine().cancel(id);
  }

  void on_cancel_available(std::function<void()> abort) override {
    bool already = false;
    {
      std::lock_guard<std::mutex> lock(mutex);
      abort_call = abort;
      already = cancelled;
    }
    if (already) abort();
  }

  Status on_event(const RemoteEvent& e) override {
    {
      std::lock_guard<std::mutex> lock(mutex);
      if (cancelled) return Status(StatusCode::kCancelled, "the client went away");
    }
    if (e.choice < 0 || e.choice >= samples) return data_loss("a replica sent an event for sample " + std::to_string(e.choice));
    GenerationEvent ev;
    ev.choice = e.choice;
    ev.tokens = e.tokens;
    ev.finished = e.finished;
    ev.finish_reason = e.finish_reason;
    ev.error = e.error;
    ev.num_prompt_tokens = prompt_tokens;
    if (cached_prompt_tokens < 0) cached_prompt_tokens = e.num_cached_prompt_tokens;
    ev.num_cached_prompt_tokens = cached_prompt_tokens;
    if (e.choice == 0) {
      attempt_draft_tokens = e.num_draft_tokens;
      attempt_accepted_tokens = e.num_accepted_draft_tokens;
    }
    ev.num_draft_tokens = (e.choice == 0 ? draft_tokens : 0) + e.num_draft_tokens;
    ev.num_accepted_draft_tokens = (e.choice == 0 ? accepted_draft_tokens : 0) + e.num_accepted_draft_tokens;
    ev.prompt_logprobs = e.prompt_logprobs;
    const double now = owner->engine().now();
    if (timings.first_scheduled < 0) timings.first_scheduled = now;
    if (!e.tokens.empty() && timings.first_token < 0) timings.first_token = now;
    for (size_t i = 0; i < e.tokens.size(); ++i) timings.token_times.push_back(now);
    tokens_out += static_cast<int64_t>(e.tokens.size());
    if (e.choice == 0)
      for (const SampledToken& t : e.tokens) attempt_output.push_back(t.token);
    if (e.finished && !finished[e.choice]) {
      finished[e.choice] = true;
      std::lock_guard<std::mutex> lock(mutex);
      ++num_finished;
    }
    if (e.finished && num_finished == samples) timings.finished = now;
    ev.timings = &timings;
    sink->on_event(ev);
    return Status::ok();
  }

  // Ends every sample that has not finished (the request never reached an engine, or its
  // replica failed).
  void finish_remaining(FinishReason reason, const Status& error) {
    for (int32_t c = 0; c < samples; ++c) {
      if (finished[c]) continue;
      finished[c] = true;
      {
        std::lock_guard<std::mutex> lock(mutex);
        ++num_finished;
      }
      GenerationEvent ev;
      ev.choice = c;
      ev.finished = true;
      ev.finish_reason = reason;
      ev.error = error;
      ev.num_prompt_tokens = prompt_tokens;
      ev.num_cached_prompt_tokens = std::max(0, cached_prompt_tokens);
      timings.finished = owner->engine().now();
      ev.timings = &timings;
      sink->on_event(ev);
    }
  }

  // Whether the rest of the output is a function of the prompt and the output so far, so
  // that another replica continuing from them produces exactly what this one would have:
  // one greedy sample without penalties (those count output tokens apart from the prompt)
  // and without prompt logprobs (already delivered).
  bool resumable() const {
    const GenerationRequest& g = request.generation;
    const SamplingParams& p = g.params;
    return samples == 1 && g.prompt_logprobs < 0 && p.is_greedy() && p.repetition_penalty == 1.0f &&
           p.presence_penalty == 0.0f && p.frequency_penalty == 0.0f && !g.constraint;
  }

  // The next attempt continues after the output so far.
  void prepare_resume() {
    GenerationRequest& g = request.generation;
    g.prompt.insert(g.prompt.end(), attempt_output.begin(), attempt_output.end());
    g.params.max_tokens -= static_cast<int32_t>(attempt_output.size());
    resumed_tokens += static_cast<int32_t>(attempt_output.size());
    draft_tokens += attempt_draft_tokens;
    accepted_draft_tokens += attempt_accepted_tokens;
    attempt_draft_tokens = attempt_accepted_tokens = 0;
    attempt_output.clear();
  }
};

namespace {

class CallHandle final : public RequestHandle {
 public:
  explicit CallHandle(std::shared_ptr<ReplicatedDeployment::Call> call) : call_(std::move(call)) {}
  void cancel(CancelReason) override { call_->cancel(); }

 private:
  std::shared_ptr<ReplicatedDeployment::Call> call_;
};

// Failures that say the replica, not the request, is at fault: another replica may serve it.
bool replica_fault(const Status& st) {
  switch (st.code()) {
    case StatusCode::kUnavailable:         // unreachable, draining, or gone mid-stream
    case StatusCode::kFailedPrecondition:  // it restarted with another model or KV layout
    case StatusCode::kUnimplemented:       // the address is not a replica endpoint
    case StatusCode::kDataLoss:            // a malformed stream
    case StatusCode::kInternal:
      return true;
    default:
      return false;
  }
}

}  // namespace

ReplicatedDeployment::ReplicatedDeployment(std::string name, Engine& engine, std::shared_ptr<KvConnector> connector,
                                           std::shared_ptr<Router> router, std::string router_plugin,
                                           ReplicationOptions options)
    : EngineDeployment(std::move(name), engine),
      connector_(std::move(connector)),
      router_(std::move(router)),
      router_plugin_(std::move(router_plugin)),
      options_(std::move(options)),
      fingerprint_(engine.kv_fingerprint()) {
  if (options_.local) {
    auto r = std::make_unique<Replica>();
    r->name = "local";
    r->is_local = true;
    r->healthy = true;
    replicas_.push_back(std::move(r));
  }
  for (const std::string& address : options_.endpoints) {
    auto r = std::make_unique<Replica>();
    r->name = address;
    r->address = address;
    replicas_.push_back(std::move(r));
  }
  std::vector<std::string> names;
  for (const auto& r : replicas_) names.push_back(r->name);
  if (Status st = router_->configure(names); !st.is_ok())
    throw std::runtime_error("deployments." + this->name() + ".replicas.router: " + st.message());
  workers_ = std::make_unique<BlockingCallWorkers<Call>>(options_.max_concurrent,
                                                         [this](const std::shared_ptr<Call>& call) { run(call); });
}

ReplicatedDeployment::~ReplicatedDeployment() { shutdown(); }

void ReplicatedDeployment::shutdown() {
  {
    std::lock_guard<std::mutex> lock(health_mutex_);
    stopping_ = true;
  }
  health_cv_.notify_all();
  if (health_thread_.joinable()) health_thread_.join();
  workers_->stop([](Call& c) { c.cancel(); }, [](Call& c) { c.finish_remaining(FinishReason::kCancelled, {}); });
}

void ReplicatedDeployment::probe(Replica& r) {
  std::string theirs;
  Status st = connector_->probe(r.address, &theirs);
  bool ok = st.is_ok() && theirs == fingerprint_;
  if (st.is_ok() && !ok)
    st = failed_precondition("it serves '" + theirs + "', this gateway's engine '" + fingerprint_ + "'");
  const bool was = r.healthy.exchange(ok);
  if (was != ok)
    host_logger().log(ok ? LogLevel::kInfo : LogLevel::kWarn,
                      "deployment '" + name() + "': replica " + r.name + (ok ? " is healthy" : " is unhealthy: " + st.message()));
}

Status ReplicatedDeployment::check_replicas(std::vector<std::string>* warnings) {
  for (auto& r : replicas_) {
    if (r->is_local) continue;
    std::string theirs;
    Status st = connector_->probe(r->address, &theirs);
    if (!st.is_ok()) {
      warnings->push_back(st.message());
      continue;
    }
    if (theirs != fingerprint_)
      return failed_precondition("the replica at " + r->address + " serves another model or KV layout: it has '" +
                                 theirs + "', this gateway's engine '" + fingerprint_ + "'");
    r->healthy = true;
  }
  if (!health_thread_.joinable()) health_thread_ = std::thread([this] { health_loop(); });
  return Status::ok();
}

void ReplicatedDeployment::health_loop() {
  const auto interval = std::chrono::duration_cast<std::chrono::steady_clock::duration>(
      std::chrono::duration<double>(options_.health_interval));
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(health_mutex_);
      if (health_cv_.wait_for(lock, interval, [this] { return stopping_; })) return;
    }
    for (auto& r : replicas_)
      if (!r->is_local) probe(*r);
  }
}

std::vector<ReplicaStatus> ReplicatedDeployment::replicas() const {
  std::vector<ReplicaStatus> out;
  for (const auto& r : replicas_)
    out.push_back({r->name, r->healthy.load(), r->in_flight.load(), r->requests.load(), r->failures.load()});
  return out;
}

ReplicationStats ReplicatedDeployment::stats() const {
  std::lock_guard<std::mutex> lock(stats_mutex_);
  return stats_;
}

ReplicatedDeployment::Replica* ReplicatedDeployment::choose(const DeploymentRequest& request,
                                                            const std::vector<Replica*>& exclude, bool local_only) {
  std::vector<RouteCandidate> candidates;
  for (const auto& r : replicas_) {
    if (!r->healthy || (local_only && !r->is_local)) continue;
    if (std::find(exclude.begin(), exclude.end(), r.get()) != exclude.end()) continue;
    candidates.push_back({r->name, r->in_flight.load()});
  }
  if (candidates.empty()) return nullptr;
  RouteRequest rr;
  rr.prompt = request.prompt_text;
  rr.tokens = request.generation.prompt;
  rr.user = request.tenant;
  rr.candidates = candidates;
  std::string chosen;
  if (Status st = router_->route(rr, &chosen); !st.is_ok()) {
    host_logger().log(LogLevel::kWarn, "deployment '" + name() + "': replica router failed (" + st.message() +
                                           "); using the least loaded replica");
    chosen = std::string(std::min_element(candidates.begin(), candidates.end(), [](const auto& a, const auto& b) {
                           return a.in_flight < b.in_flight;
                         })->name);
  }
  for (const auto& r : replicas_)
    if (r->name == chosen) return r.get();
  return nullptr;
}

Status ReplicatedDeployment::submit(DeploymentRequest request, std::shared_ptr<RequestSink> sink,
                                    std::unique_ptr<RequestHandle>* handle) {
  if (Status st = engine().check(request.generation); !st.is_ok()) return st;
  // A compiled constraint cannot travel: structured output runs on the gateway's engine.
  const bool local_only = request.generation.constraint != nullptr;
  if (local_only && !options_.local)
    return unimplemented("deployment '" + name() +
                         "': structured output runs on the gateway's own engine, and replicas.local is false");
  auto call = std::make_shared<Call>();
  call->owner = this;
  call->sink = sink;
  call->samples = std::max(1, request.generation.n);
  call->prompt_tokens = static_cast<int32_t>(request.generation.prompt.size());
  call->finished.assign(call->samples, false);
  call->timings.arrival = engine().now();
  call->first_choice = choose(request, {}, local_only);
  call->request = std::move(request);
  if (!call->first_choice) {
    std::lock_guard<std::mutex> lock(stats_mutex_);
    ++stats_.unavailable;
    return unavailable("deployment '" + name() + "': no replica is healthy now; retry later");
  }
  ServedBy served;
  served.deployment = name();
  sink->on_start(served);
  *handle = std::make_unique<CallHandle>(call);
  if (call->first_choice->is_local) {
    submit_local(call);  // the engine's submit does not block: no worker needed
    return Status::ok();
  }
  if (!workers_->push(call)) {
    handle->reset();
    return unavailable("deployment '" + name() + "' is shutting down");
  }
  return Status::ok();
}

void ReplicatedDeployment::submit_local(const std::shared_ptr<Call>& call) {
  Replica* local = replicas_.front().get();
  GenerationRequest g = call->request.generation;
  std::shared_ptr<RequestSink> s = call->sink;
  auto remaining = std::make_shared<std::atomic<int32_t>>(call->samples);
  // A request resumed here after a replica failed: its prompt includes the output so far, so
  // the client's usage is restored to the prompt it sent.
  const int32_t resumed = call->resumed_tokens;
  const int32_t prompt_tokens = call->prompt_tokens;
  const int32_t cached_tokens = std::max(0, call->cached_prompt_tokens);
  g.on_event = [s, local, remaining, resumed, prompt_tokens, cached_tokens](const GenerationEvent& ev) {
    if (resumed == 0) {
      s->on_event(ev);
    } else {
      GenerationEvent adjusted = ev;
      adjusted.num_prompt_tokens = prompt_tokens;
      adjusted.num_cached_prompt_tokens = cached_tokens;
      s->on_event(adjusted);
    }
    if (ev.finished && remaining->fetch_sub(1) == 1) local->in_flight.fetch_sub(1);
  };
  std::unique_lock<std::mutex> lock(call->mutex);
  if (call->cancelled) {
    lock.unlock();
    call->finish_remaining(FinishReason::kCancelled, {});
    return;
  }
  local->in_flight.fetch_add(1);
  local->requests.fetch_add(1);
  uint64_t id = 0;
  Status st = engine().submit(std::move(g), &id);
  if (!st.is_ok()) {
    local->in_flight.fetch_sub(1);
    lock.unlock();
    call->finish_remaining(FinishReason::kError, st);
    return;
  }
  call->engine_id = id;
  call->handed_to_engine = true;
}

void ReplicatedDeployment::run(const std::shared_ptr<Call>& call) {
  std::vector<Replica*> tried;
  Replica* replica = call->first_choice;
  Status last;
  for (;;) {
    if (!replica) replica = choose(call->request, tried, false);
    if (!replica) {
      std::string names;
      for (Replica* r : tried) names += (names.empty() ? "" : ", ") + r->name;
      {
        std::lock_guard<std::mutex> lock(stats_mutex_);
        ++stats_.unavailable;
      }
      call->finish_remaining(FinishReason::kError,
                             unavailable("deployment '" + name() + "': no replica could serve the request" +
                                         (names.empty() ? std::string() : " (failed: " + names + "; last: " + last.message() + ")")));
      return;
    }
    if (replica->is_local) {
      submit_local(call);
      return;
    }
    RemoteGenerateRequest rq;
    rq.request_id = name() + "-" + std::to_string(reinterpret_cast<uintptr_t>(call.get()));
    rq.prompt = call->request.generation.prompt;
    rq.params = call->request.generation.params;
    rq.n = call->samples;
    rq.prompt_logprobs = call->request.generation.prompt_logprobs;
    rq.fingerprint = fingerprint_;
    rq.timeout_seconds = options_.timeout;
    replica->in_flight.fetch_add(1);
    replica->requests.fetch_add(1);
    Status st = connector_->remote_generate(replica->address, rq, call.get());
    replica->in_flight.fetch_sub(1);
    bool cancelled = false;
    {
      std::lock_guard<std::mutex> lock(call->mutex);
      call->abort_call = nullptr;
      cancelled = call->cancelled;
    }
    if (call->all_finished()) return;
    if (cancelled) {
      call->finish_remaining(FinishReason::kCancelled, {});
      return;
    }
    if (st.is_ok()) st = data_loss("replica " + replica->name + " ended the request without finishing it");
    if (!replica_fault(st)) {
      call->finish_remaining(FinishReason::kError, st);
      return;
    }
    replica->failures.fetch_add(1);
    if (st.code() != StatusCode::kDataLoss && replica->healthy.exchange(false))
      host_logger().log(LogLevel::kWarn, "deployment '" + name() + "': replica " + replica->name +
                                             " is unhealthy: " + st.message());
    tried.push_back(replica);
    last = st;
    if (call->tokens_out == 0) {
      std::lock_guard<std::mutex> lock(stats_mutex_);
      ++stats_.failovers;
    } else if (call->resumable()) {
      call->prepare_resume();
      std::lock_guard<std::mutex> lock(stats_mutex_);
      ++stats_.resumed;
    } else {
      {
        std::lock_guard<std::mutex> lock(stats_mutex_);
        ++stats_.midstream_errors;
      }
      call->finish_remaining(
          FinishReason::kError,
          unavailable("replica " + replica->name + " of deployment '" + name() + "' failed after " +
                      std::to_string(call->tokens_out) + " generated tokens (" + st.message() +
                      "); a sampled request cannot continue on another replica unchanged, so it ends here"));
      return;
    }
    replica = nullptr;
  }
}

}  // namespace tessera
