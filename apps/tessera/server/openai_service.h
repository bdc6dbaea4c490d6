// The OpenAI-compatible API over the gateway's deployments: routes, API keys, request validation, the chat
// template, submission to the engine, stop strings, streaming (SSE), usage, logprobs and
// metrics. Runs on the HTTP server's io thread; engine events (on the engine thread) are
// posted back to it.
#pragma once

#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdint>
#include <optional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "http_server.h"
#include "metrics.h"
#include "route_feedback.h"
#include "tessera/config.h"
#include "tessera/engine.h"
#include "tessera/gateway/gateway.h"

namespace tessera::server {

struct GenerationCall;
struct PendingGeneration;  // a parsed generation request waiting for its deployment
class CallSink;
class StatsRecorder;

// What the access log line of a request needs from its arrival.
struct AccessRecord {
  std::string method;
  std::string path;  // without the query string, unsafe bytes percent-encoded
  std::chrono::steady_clock::time_point start;
};

// Per-generation figures for the access log line (-1: not known).
struct AccessFigures {
  std::string id;
  int64_t prompt_tokens = -1;
  int64_t completion_tokens = -1;
  int64_t cached_tokens = -1;
  double ttft_ms = -1;
};

class OpenAiService : public HttpHandler {
 public:
  // `api_keys` empty: no authentication. Clients name a deployment of `gateway` (or its
  // router) as "model".
  OpenAiService(Gateway& gateway, const ServerConfig& config, std::vector<std::string> api_keys);
  ~OpenAiService() override;

  void handle(HttpRequest request, std::shared_ptr<ResponseChannel> channel) override;
  void on_protocol_error(std::string_view target, int status) override;

  // One structured line per request on the "access" logger (stderr): method, path, status,
  // duration, and for generations the id, tokens in/out, cached tokens and TTFT. Never a
  // prompt, an output or a key. On by default.
  void set_access_log(bool on) { access_log_ = on; }

  // Shutdown: new generation requests get 503 from now on.
  void begin_shutdown() { draining_ = true; }
  // Cancels every request still generating (their clients get what was produced so far,
  // finish_reason "abort").
  void cancel_all();
  // Completes every response still open as if its samples had ended with "abort" (what was
  // produced, then the end of the stream), whatever the engine is doing: the last step of a
  // shutdown, once cancelled requests had their grace period to end by themselves.
  void end_all_as_aborted();
  // Requests the engine still holds, and responses not yet fully handed to the server.
  int64_t in_flight() const { return in_flight_; }
  size_t open_calls() const;
  // Serves GET /v1/stats from `stats` and GET /dashboard (dashboard.h); both off until set.
  void attach_stats(const StatsRecorder* stats) { stats_ = stats; }
  const ServerMetrics& metrics() const { return metrics_; }
  void set_max_embedding_inputs(int n) { max_embedding_inputs_ = n; }

 private:
  friend struct GenerationCall;

  void route(const HttpRequest& request, const std::shared_ptr<ResponseChannel>& channel,
             const std::string& endpoint);
  bool authorized(const HttpRequest& request) const;
  void reply(const std::shared_ptr<ResponseChannel>& channel, const std::string& endpoint, HttpResponse res);
  void reply_error(const std::shared_ptr<ResponseChannel>& channel, const std::string& endpoint,
                   http::status status, const std::string& message, const std::string& type,
                   const std::string& param = {}, const std::string& code = {});
  void handle_generation(const HttpRequest& request, const std::shared_ptr<ResponseChannel>& channel,
                         const std::string& endpoint, bool chat);
  // After routing (on the io thread, whether the router ran here or on the embedding thread).
  void finish_routing(PendingGeneration& pending, const Status& status, double seconds,
                      const std::shared_ptr<ResponseChannel>& channel, const std::string& endpoint);
  void submit_generation(PendingGeneration& pending, const std::shared_ptr<ResponseChannel>& channel,
                         const std::string& endpoint);
  void handle_tokenize(const HttpRequest& request, const std::shared_ptr<ResponseChannel>& channel,
                       const std::string& endpoint);
  void handle_detokenize(const HttpRequest& request, const std::shared_ptr<ResponseChannel>& channel,
                         const std::string& endpoint);
  // POST /v1/embeddings (embeddings.cpp): parsed here, embedded on the gateway's embedding thread.
  void handle_embeddings(const HttpRequest& request, const std::shared_ptr<ResponseChannel>& channel,
                         const std::string& endpoint);
  nlohmann::json embedding_model_card() const;
  // POST /v1/route_feedback (route_feedback.cpp): which deployment should have answered a
  // routed response; counts live misroutes.
  void handle_route_feedback(const HttpRequest& request, const std::shared_ptr<ResponseChannel>& channel,
                             const std::string& endpoint);
  // The body as a JSON object, or an error answered (and std::nullopt).
  std::optional<nlohmann::json> read_json_object(const HttpRequest& request,
                                                 const std::shared_ptr<ResponseChannel>& channel,
                                                 const std::string& endpoint);
  // The deployment a tokenizer route's optional "model" names, or nullptr with the error answered.
  Deployment* tokenizer_deployment(const nlohmann::json& body, const std::shared_ptr<ResponseChannel>& channel,
                                   const std::string& endpoint);
  void reply_unknown_model(const std::shared_ptr<ResponseChannel>& channel, const std::string& endpoint,
                           const std::string& model);
  std::string served_ids() const;  // "'small', 'large', 'ab' (a router)"
  void log_access(const AccessRecord& record, int status, const AccessFigures* figures = nullptr) const;
  nlohmann::json model_card(const Deployment& deployment) const;
  nlohmann::json router_card() const;
  static std::string endpoint_label(std::string_view target);

  Gateway& gateway_;
  const ServerConfig& config_;
  std::vector<std::string> api_keys_;
  int max_embedding_inputs_ = 256;  // embedding.max_inputs
  int64_t created_ = 0;  // unix time the server started (reported as the model's "created")
  ServerMetrics metrics_;
  int64_t in_flight_ = 0;
  bool draining_ = false;
  bool access_log_ = true;
  // The request being handled synchronously now: a reply() made while it is set writes its
  // access line (generations write theirs when they end).
  std::optional<AccessRecord> current_;
  uint64_t next_call_ = 1;
  std::map<uint64_t, std::weak_ptr<GenerationCall>> calls_;
  RouteLedger route_ledger_;  // the arm of each recent routed response, for route feedback
  const StatsRecorder* stats_ = nullptr;
};

}  // namespace tessera::server
