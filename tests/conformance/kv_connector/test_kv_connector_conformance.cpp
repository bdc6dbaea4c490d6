// Every kv_connector plugin (the build's and any on TESSERA_PLUGIN_PATH), serving a scripted
// KvPrefillHost on loopback and calling it through a second instance of itself, as a decode
// engine and a gateway would:
//   - serve on port 0 reports the bound address; probe returns the host's fingerprint, and
//     kUnavailable while the host drains or when nothing listens;
//   - remote_prefill delivers the first token, then every layer's K and V payloads in order,
//     byte for byte; a fingerprint mismatch is kFailedPrecondition naming both;
//   - the caller's timeout reaches the host (the time left of it, within the transport's
//     rounding): a host that used the SDK's default instead cut every prefill at 30 s,
//     whatever transfer_timeout said;
//   - remote_generate (when the connector carries replicas) delivers every event in order for
//     every sample; a sink's error ends the call with that error and the host sees the caller
//     leave;
//   - the cancel function a sink receives aborts a blocked call from another thread (kCancelled,
//     and the host sees it), and stays safe to call after the call returned: a client that
//     leaves just as a request ends calls it then (a connector whose function pointed into the
//     returned call's stack frame crashed the gateway this way).
#include <doctest/doctest.h>

#include <sys/socket.h>
#include <netinet/in.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "support/plugins.h"
#include "tessera/sdk.h"
#include "tessera/sdk/kv_connector.h"

using namespace tessera;
using namespace std::chrono_literals;

namespace {

constexpr TokenId kBlockUntilCancelled = 999;  // a first prompt token the host never finishes
constexpr int32_t kLayers = 3;
const std::string kFingerprint = "model=conformance layers=3 k=f16 v=f16";

// Layer `layer`'s payload for `tokens` prompt tokens: distinct bytes per layer, token and side.
std::vector<uint8_t> payload(int32_t layer, int32_t tokens, bool v) {
  std::vector<uint8_t> out(static_cast<size_t>(tokens) * 64);
  for (size_t i = 0; i < out.size(); ++i) out[i] = static_cast<uint8_t>(i * 7 + layer * 31 + (v ? 101 : 0));
  return out;
}

class ScriptedExport final : public KvExportHandle {
 public:
  explicit ScriptedExport(PrefillResult r) : result_(std::move(r)) {}
  const PrefillResult& result() const override { return result_; }
  Status read_layer(int32_t layer, std::vector<uint8_t>* k, std::vector<uint8_t>* v) override {
    *k = payload(layer, result_.num_kv_tokens, false);
    *v = payload(layer, result_.num_kv_tokens, true);
    return Status::ok();
  }

 private:
  PrefillResult result_;
};

// The engine side: answers from the prompt alone, so the caller can check every byte.
class ScriptedHost final : public KvPrefillHost {
 public:
  std::atomic<bool> draining_now{false};
  std::atomic<int> saw_cancel{0};  // calls that ended because the caller left
  std::atomic<double> prefill_timeout{0}, generate_timeout{0};  // the last call's timeout_seconds

  std::string fingerprint() const override { return kFingerprint; }
  bool draining() const override { return draining_now; }

  Status prefill(const RemotePrefillRequest& request, const std::function<bool()>& cancelled,
                 std::unique_ptr<KvExportHandle>* out) override {
    if (draining_now) return unavailable("draining");
    prefill_timeout = request.timeout_seconds;
    if (!request.prompt.empty() && request.prompt[0] == kBlockUntilCancelled) {
      if (!wait_for_cancel(cancelled)) return internal_error("the caller never cancelled");
      return Status(StatusCode::kCancelled, "the caller went away");
    }
    PrefillResult r;
    r.tokens.push_back(SampledToken{static_cast<TokenId>(request.prompt.size() + 40), -0.25f, {}});
    r.num_kv_tokens = request.want_kv ? static_cast<int32_t>(request.prompt.size()) : 0;
    r.num_layers = request.want_kv ? kLayers : 0;
    r.rng_state = 0x1234abcdULL;
    *out = std::make_unique<ScriptedExport>(r);
    return Status::ok();
  }

  // Sample c's token i is 1000 * c + i; max_tokens events of one token each per sample.
  Status generate(const RemoteGenerateRequest& request, const std::function<bool()>& cancelled,
                  const std::function<bool(const RemoteEvent&)>& emit) override {
    if (draining_now) return unavailable("draining");
    generate_timeout = request.timeout_seconds;
    if (!request.prompt.empty() && request.prompt[0] == kBlockUntilCancelled) {
      RemoteEvent first;
      first.tokens.push_back(SampledToken{7, 0.f, {}});
      if (!emit(first)) {
        ++saw_cancel;
        return Status(StatusCode::kCancelled, "the caller went away");
      }
      if (!wait_for_cancel(cancelled)) return internal_error("the caller never cancelled");
      return Status(StatusCode::kCancelled, "the caller went away");
    }
    for (int32_t i = 0; i < request.params.max_tokens; ++i) {
      for (int32_t c = 0; c < request.n; ++c) {
        RemoteEvent e;
        e.choice = c;
        e.tokens.push_back(SampledToken{1000 * c + i, -0.5f, {}});
        e.finished = i + 1 == request.params.max_tokens;
        e.finish_reason = e.finished ? FinishReason::kLength : FinishReason::kNone;
        e.num_prompt_tokens = static_cast<int32_t>(request.prompt.size());
        if (cancelled() || !emit(e)) {
          ++saw_cancel;
          return Status(StatusCode::kCancelled, "the caller went away");
        }
      }
      // A long request paces itself like an engine, so the caller's leaving reaches it
      // before every event is already written.
      if (request.params.max_tokens > 100) std::this_thread::sleep_for(1ms);
    }
    return Status::ok();
  }

 private:
  bool wait_for_cancel(const std::function<bool()>& cancelled) {
    const auto deadline = std::chrono::steady_clock::now() + 20s;
    while (std::chrono::steady_clock::now() < deadline) {
      if (cancelled()) {
        ++saw_cancel;
        return true;
      }
      std::this_thread::sleep_for(2ms);
    }
    return false;
  }
};

// The caller's side of both kinds of call: records what arrives, keeps the cancel function.
class RecordingSink final : public KvImportSink, public RemoteEventSink {
 public:
  std::mutex mutex;
  std::function<void()> cancel_fn;
  std::vector<PrefillResult> prefilled;
  std::vector<int32_t> layers;
  bool payloads_exact = true;
  std::vector<RemoteEvent> events;
  Status fail_on_event_index_status;
  int fail_on_event_index = -1;

  void on_cancel_available(std::function<void()> cancel) override {
    std::lock_guard<std::mutex> lock(mutex);
    cancel_fn = std::move(cancel);
  }
  std::function<void()> cancel() {
    std::lock_guard<std::mutex> lock(mutex);
    return cancel_fn;
  }
  Status on_prefilled(const PrefillResult& result) override {
    prefilled.push_back(result);
    return Status::ok();
  }
  Status on_layer(int32_t layer, std::span<const uint8_t> k, std::span<const uint8_t> v) override {
    layers.push_back(layer);
    const int32_t tokens = prefilled.empty() ? 0 : prefilled.back().num_kv_tokens;
    const auto want_k = payload(layer, tokens, false), want_v = payload(layer, tokens, true);
    payloads_exact = payloads_exact && std::equal(k.begin(), k.end(), want_k.begin(), want_k.end()) &&
                     std::equal(v.begin(), v.end(), want_v.begin(), want_v.end());
    return Status::ok();
  }
  Status on_event(const RemoteEvent& event) override {
    events.push_back(event);
    if (static_cast<int>(events.size()) - 1 == fail_on_event_index) return fail_on_event_index_status;
    return Status::ok();
  }
};

std::string default_params(const std::string&) { return "{}"; }

// A loopback port nothing listens on (bound, then closed).
std::string closed_address() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr);
  socklen_t len = sizeof addr;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  ::close(fd);
  return "127.0.0.1:" + std::to_string(ntohs(addr.sin_port));
}

RemoteGenerateRequest generate_request(std::vector<TokenId> prompt, int32_t max_tokens, int32_t n) {
  RemoteGenerateRequest r;
  r.request_id = "conformance";
  r.prompt = std::move(prompt);
  r.params.max_tokens = max_tokens;
  r.n = n;
  r.fingerprint = kFingerprint;
  r.timeout_seconds = 30;
  return r;
}

}  // namespace

TEST_CASE("every kv_connector moves prefills and requests between processes, and cancels safely") {
  test::check_no_load_errors();
  const auto names = test::plugin_names(PluginKind::kKvConnector);
  REQUIRE(!names.empty());
  for (const std::string& name : names) {
    INFO("kv_connector." << name);
    const std::string params = test::conformance_params(PluginKind::kKvConnector, name, default_params(name));
    ScriptedHost host;
    auto server = test::create_plugin<KvConnector>(name, params);
    auto client = test::create_plugin<KvConnector>(name, params);
    std::string address;
    REQUIRE(server->serve("127.0.0.1:0", &host, &address).is_ok());
    CHECK_MESSAGE(address.rfind("127.0.0.1:", 0) == 0, address);
    CHECK(address != "127.0.0.1:0");

    std::string fingerprint;
    REQUIRE(client->probe(address, &fingerprint).is_ok());
    CHECK(fingerprint == kFingerprint);

    {
      INFO("remote_prefill: the first token, then every layer in order, byte for byte");
      RemotePrefillRequest rq;
      rq.request_id = "conformance";
      rq.prompt = {1, 2, 3, 4, 5};
      rq.fingerprint = kFingerprint;
      rq.timeout_seconds = 123;  // not the SDK's default of 30
      RecordingSink sink;
      const Status st = client->remote_prefill(address, rq, &sink);
      REQUIRE_MESSAGE(st.is_ok(), st.message());
      // What is left of the caller's 123 s when the host starts. gRPC sends a deadline with
      // at most 8 digits, rounded up (123 s arrived as 124), hence the 2 % above.
      CHECK_MESSAGE(host.prefill_timeout > 100, host.prefill_timeout.load());
      CHECK_MESSAGE(host.prefill_timeout <= 123 * 1.02, host.prefill_timeout.load());
      CHECK(sink.cancel());
      REQUIRE(sink.prefilled.size() == 1);
      REQUIRE(sink.prefilled[0].tokens.size() == 1);
      CHECK(sink.prefilled[0].tokens[0].token == 45);
      CHECK(sink.prefilled[0].rng_state == 0x1234abcdULL);
      CHECK(sink.prefilled[0].num_kv_tokens == 5);
      CHECK(sink.layers == std::vector<int32_t>{0, 1, 2});
      CHECK(sink.payloads_exact);

      rq.fingerprint = "model=other layers=30";
      RecordingSink refused;
      const Status mismatch = client->remote_prefill(address, rq, &refused);
      CHECK(mismatch.code() == StatusCode::kFailedPrecondition);
      CHECK_MESSAGE(mismatch.message().find("model=other") != std::string::npos, mismatch.message());
      CHECK_MESSAGE(mismatch.message().find(kFingerprint) != std::string::npos, mismatch.message());
    }

    {
      INFO("remote_prefill: cancelled from another thread while the host works");
      RemotePrefillRequest rq;
      rq.prompt = {kBlockUntilCancelled, 2};
      rq.fingerprint = kFingerprint;
      rq.timeout_seconds = 30;
      RecordingSink sink;
      std::thread canceller([&] {
        std::this_thread::sleep_for(200ms);
        if (auto fn = sink.cancel()) fn();
      });
      const auto start = std::chrono::steady_clock::now();
      const Status st = client->remote_prefill(address, rq, &sink);
      canceller.join();
      CHECK_MESSAGE(st.code() == StatusCode::kCancelled, st.message());
      CHECK(std::chrono::steady_clock::now() - start < 10s);
      for (int i = 0; i < 500 && host.saw_cancel == 0; ++i) std::this_thread::sleep_for(10ms);
      CHECK(host.saw_cancel >= 1);
      sink.cancel()();  // after the return: does nothing
    }

    // A connector without replicas answers kUnimplemented; the rest of the suite needs them.
    RecordingSink probe_sink;
    const Status supports = client->remote_generate(address, generate_request({1, 2}, 1, 1), &probe_sink);
    if (supports.code() == StatusCode::kUnimplemented) {
      MESSAGE("kv_connector." << name << " carries no whole requests (replicas): " << supports.message());
      server->shutdown();
      continue;
    }
    REQUIRE_MESSAGE(supports.is_ok(), supports.message());

    {
      INFO("remote_generate: every event of every sample, in order");
      RecordingSink sink;
      RemoteGenerateRequest rq = generate_request({4, 5, 6}, 5, 2);
      rq.timeout_seconds = 1234;  // not the SDK's default of 600
      const Status st = client->remote_generate(address, rq, &sink);
      REQUIRE_MESSAGE(st.is_ok(), st.message());
      CHECK_MESSAGE(host.generate_timeout > 1200, host.generate_timeout.load());
      CHECK_MESSAGE(host.generate_timeout <= 1234 * 1.02, host.generate_timeout.load());  // 1240 arrives
      std::vector<std::vector<TokenId>> tokens(2);
      int finished = 0;
      for (const RemoteEvent& e : sink.events) {
        REQUIRE((e.choice == 0 || e.choice == 1));
        for (const SampledToken& t : e.tokens) tokens[e.choice].push_back(t.token);
        CHECK(e.num_prompt_tokens == 3);
        if (e.finished) {
          ++finished;
          CHECK(e.finish_reason == FinishReason::kLength);
        }
      }
      CHECK(finished == 2);
      CHECK(tokens[0] == std::vector<TokenId>{0, 1, 2, 3, 4});
      CHECK(tokens[1] == std::vector<TokenId>{1000, 1001, 1002, 1003, 1004});

      auto other = generate_request({4, 5, 6}, 5, 1);
      other.fingerprint = "model=other layers=30";
      RecordingSink refused;
      const Status mismatch = client->remote_generate(address, other, &refused);
      CHECK(mismatch.code() == StatusCode::kFailedPrecondition);
      CHECK_MESSAGE(mismatch.message().find("model=other") != std::string::npos, mismatch.message());
      CHECK(refused.events.empty());
    }

    {
      INFO("remote_generate: a sink's error ends the call with it, and the host sees the caller leave");
      RecordingSink sink;
      sink.fail_on_event_index = 2;
      sink.fail_on_event_index_status = invalid_argument("the client's sink refused event 2");
      const int before = host.saw_cancel;
      const Status st = client->remote_generate(address, generate_request({4, 5, 6}, 400, 1), &sink);
      CHECK(st.code() == StatusCode::kInvalidArgument);
      CHECK(st.message() == "the client's sink refused event 2");
      CHECK(sink.events.size() == 3);
      for (int i = 0; i < 500 && host.saw_cancel == before; ++i) std::this_thread::sleep_for(10ms);
      CHECK(host.saw_cancel > before);
    }

    {
      INFO("remote_generate: cancelled from another thread mid-stream");
      RecordingSink sink;
      const int before = host.saw_cancel;
      std::thread canceller([&] {
        std::this_thread::sleep_for(200ms);
        if (auto fn = sink.cancel()) fn();
      });
      const Status st = client->remote_generate(address, generate_request({kBlockUntilCancelled}, 10, 1), &sink);
      canceller.join();
      CHECK_MESSAGE(st.code() == StatusCode::kCancelled, st.message());
      CHECK(sink.events.size() == 1);
      for (int i = 0; i < 500 && host.saw_cancel == before; ++i) std::this_thread::sleep_for(10ms);
      CHECK(host.saw_cancel > before);
    }

    {
      INFO("the cancel function is safe after the call returned, also racing the return");
      // Each call ends by itself after a few events; a second thread calls its cancel function
      // over and over from the moment it exists until well after the return.
      int completed = 0, cancelled = 0;
      for (int round = 0; round < 40; ++round) {
        RecordingSink sink;
        std::atomic<bool> returned{false};
        std::thread racer([&] {
          std::function<void()> fn;
          while (!(fn = sink.cancel())) std::this_thread::yield();
          for (int i = 0; i < 2000 && !returned; ++i) {
            if (round % 2 == 0) fn();  // half the rounds race a cancel with the end
            std::this_thread::yield();
          }
          for (int i = 0; i < 50; ++i) fn();  // after the return
        });
        const Status st = client->remote_generate(address, generate_request({4, 5}, 3, 1), &sink);
        returned = true;
        racer.join();
        if (st.is_ok()) ++completed;
        else if (st.code() == StatusCode::kCancelled) ++cancelled;
        else FAIL_CHECK("round " << round << ": " << st.message());
        sink.cancel()();
      }
      MESSAGE("kv_connector." << name << ": 40 rounds, " << completed << " completed, " << cancelled
                              << " cancelled by the race");
      CHECK(completed + cancelled == 40);
    }

    {
      INFO("draining: probes and new calls are refused with kUnavailable");
      host.draining_now = true;
      std::string fp;
      CHECK(client->probe(address, &fp).code() == StatusCode::kUnavailable);
      RecordingSink sink;
      CHECK(client->remote_generate(address, generate_request({1}, 2, 1), &sink).code() == StatusCode::kUnavailable);
      host.draining_now = false;
      CHECK(client->probe(address, &fp).is_ok());
    }

    {
      INFO("nothing listening: kUnavailable, naming the address");
      const std::string nowhere = closed_address();
      std::string fp;
      const Status st = client->probe(nowhere, &fp);
      CHECK(st.code() == StatusCode::kUnavailable);
      CHECK_MESSAGE(st.message().find(nowhere) != std::string::npos, st.message());
      RecordingSink sink;
      CHECK(client->remote_generate(nowhere, generate_request({1}, 2, 1), &sink).code() == StatusCode::kUnavailable);
    }
    server->shutdown();
  }
}
