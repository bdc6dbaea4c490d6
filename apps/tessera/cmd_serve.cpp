// tessera serve: the OpenAI-compatible HTTP server over one engine (server/ has the parts).
// The engine steps on its own thread; HTTP runs on one io thread. SIGTERM/SIGINT shut down
// gracefully: stop accepting, let in-flight requests finish for server.shutdown_timeout,
// cancel the rest, close, exit 0.
#include <CLI/CLI.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/signal_set.hpp>
#include <boost/asio/steady_timer.hpp>
#include <spdlog/spdlog.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <sstream>

#include "commands.h"
#include "server/http_server.h"
#include "server/openai_service.h"
#include "server/stats.h"
#include "stack_loader.h"
#include "tessera/embedding/encoder_model.h"

namespace tessera::cli {
namespace {

struct ServeOptions {
  std::string config;
  std::optional<std::string> host;
  std::optional<int> port;
  std::string roofline_report;
  bool no_access_log = false;
};

// Keys from the config plus TESSERA_API_KEYS (comma-separated), so secrets need not be in a
// file that is checked in.
std::vector<std::string> collect_api_keys(const ServerConfig& server) {
  std::vector<std::string> keys = server.api_keys;
  if (const char* env = std::getenv("TESSERA_API_KEYS")) {
    std::stringstream ss(env);
    std::string key;
    while (std::getline(ss, key, ','))
      if (!key.empty()) keys.push_back(key);
  }
  return keys;
}

void run_serve(const ServeOptions& opt) {
  namespace net = boost::asio;
  // Declared before the engine so it outlives it: engine callbacks hold sockets of this
  // io_context until the engine drops them.
  net::io_context io{1};
  LoadedGateway stack = load_gateway(opt.config, /*quiet=*/false);
  ServerConfig& server_config = stack.config.server;
  if (opt.host) server_config.host = *opt.host;
  if (opt.port) {
    if (*opt.port < 0 || *opt.port > 65535) throw CommandError("--port: expected 0..65535, got " + std::to_string(*opt.port));
    server_config.port = *opt.port;
  }
  Gateway& gateway = *stack.gateway;
  const std::string model_id = gateway.deployment(0).name();
  std::string served;
  for (size_t i = 0; i < gateway.num_deployments(); ++i)
    served += (i ? ", \"" : "\"") + gateway.deployment(i).name() + "\"";
  if (gateway.has_router()) served += ", \"" + gateway.router_name() + "\" (router)";
  if (gateway.embedding_model()) served += ", \"" + gateway.embedding_model()->name() + "\" (embeddings)";
  const auto api_keys = collect_api_keys(server_config);

  server::OpenAiService service(gateway, server_config, api_keys);
  if (stack.config.embedding) service.set_max_embedding_inputs(stack.config.embedding->max_inputs);
  // /v1/stats and /dashboard: one sample per second of what /metrics reports (every
  // deployment's engine, the first's as the headline), 15 minutes kept.
  server::StatsOptions stats_options;
  stats_options.roofline_report = opt.roofline_report;
  stats_options.plugin_metrics = [&gateway](std::vector<CacheMetric>* out) { gateway.collect_plugin_metrics(out); };
  std::vector<server::StatsDeployment> stats_deployments;
  for (size_t i = 0; i < gateway.num_deployments(); ++i) {
    const auto& slots = stack.config.deployments[i].engine;
    const auto drafter = slots.find(PluginKind::kDrafter);
    stats_deployments.push_back({gateway.deployment(i).name(), &gateway.engine(i),
                                 drafter == slots.end() ? std::string() : drafter->second.plugin});
  }
  server::StatsRecorder stats(io.get_executor(), std::move(stats_deployments), service.metrics(), stats_options);
  service.attach_stats(&stats);
  service.set_access_log(!opt.no_access_log);
  server::HttpServer http(io, server_config, service);
  try {
    http.listen();
  } catch (const std::exception& e) {
    throw CommandError(e.what());
  }
  gateway.start();
  stats.start();

  const std::string url = "http://" + server_config.host + ":" + std::to_string(http.port());
  std::fprintf(stderr, "tessera serve: listening on %s, %s %s%s\n", url.c_str(),
               gateway.num_deployments() + gateway.has_router() > 1 ? "models" : "model", served.c_str(),
               api_keys.empty() ? "" : ", API key required");
  std::fprintf(stderr,
               "try: curl %s/v1/chat/completions -H 'Content-Type: application/json'%s -d "
               "'{\"model\": \"%s\", \"messages\": [{\"role\": \"user\", \"content\": \"Hello!\"}], "
               "\"max_tokens\": 64}'\n",
               url.c_str(), api_keys.empty() ? "" : " -H 'Authorization: Bearer $KEY'", model_id.c_str());
  for (const std::string& endpoint : gateway.prefill_endpoints())
    std::fprintf(stderr, "tessera serve: prefill engine %s serves remote prefills (disaggregation)\n",
                 endpoint.c_str());
  for (size_t i = 0; i < gateway.num_deployments(); ++i)
    if (DisaggregatedDeployment* d = gateway.disaggregated(gateway.deployment(i).name())) {
      std::string list;
      for (const std::string& a : d->prefill_addresses()) list += (list.empty() ? "" : ", ") + a;
      std::fprintf(stderr, "tessera serve: deployment \"%s\" decodes; prompts are prefilled at %s\n",
                   d->name().c_str(), list.c_str());
    }
  for (const std::string& endpoint : gateway.replica_endpoints())
    std::fprintf(stderr, "tessera serve: replica engine %s serves gateways' requests (replicas)\n", endpoint.c_str());
  for (size_t i = 0; i < gateway.num_deployments(); ++i)
    if (ReplicatedDeployment* d = gateway.replicated(gateway.deployment(i).name())) {
      std::string list;
      for (const ReplicaStatus& r : d->replicas())
        list += (list.empty() ? "" : ", ") + r.name + (r.healthy ? "" : " (unhealthy)");
      std::fprintf(stderr, "tessera serve: deployment \"%s\" is served by replicas %s, chosen by %s\n",
                   d->name().c_str(), list.c_str(), d->router_plugin().c_str());
    }
  std::fflush(stderr);

  // Graceful shutdown, polled: in-flight requests get shutdown_timeout to finish, then are
  // cancelled; the process exits once every response is written or a last grace period ends.
  // A cancelled request ends at its engine step's boundary, so the grace (server.shutdown_grace)
  // should outlast one step (a 512-token prefill chunk takes seconds on a slow or
  // sanitizer-built CPU); responses still open after it are ended as aborted.
  const auto cancel_grace = std::chrono::duration_cast<std::chrono::steady_clock::duration>(
      std::chrono::duration<double>(server_config.shutdown_grace));
  net::signal_set signals(io, SIGINT, SIGTERM);
  net::steady_timer shutdown_timer(io);
  std::chrono::steady_clock::time_point deadline, flush_deadline;
  bool cancelled = false, ended = false;
  std::function<void()> poll_shutdown = [&] {
    const auto now = std::chrono::steady_clock::now();
    // Idle once every response is complete and on the wire: close_all() would cut off a
    // response whose last bytes are still queued (a finished stream's final chunk).
    // Requests served for gateways (replicas.listen) and prefills served for decode engines
    // (disaggregation role prefill) drain too.
    const bool idle = service.in_flight() == 0 && service.open_calls() == 0 && !http.writes_pending() &&
                      gateway.served_remote_in_flight() == 0;
    if (!idle && !ended && now >= deadline + cancel_grace) {
      // The engine did not end the cancelled requests within the grace: their responses end
      // here, as aborted, and get a moment to reach their clients.
      ended = true;
      spdlog::warn("serve: {} requests still open {:g} s after cancelling; ending them as aborted",
                   service.open_calls(), server_config.shutdown_grace);
      service.end_all_as_aborted();
      flush_deadline = now + std::chrono::seconds(2);
    }
    if (idle || (ended && (!http.writes_pending() || now >= flush_deadline))) {
      http.close_all();
      io.stop();
      return;
    }
    if (!cancelled && now >= deadline) {
      cancelled = true;
      std::fprintf(stderr, "tessera serve: cancelling %lld in-flight requests\n",
                   static_cast<long long>(service.in_flight()));
      service.cancel_all();
      gateway.stop_serving_remote();
    }
    shutdown_timer.expires_after(std::chrono::milliseconds(20));
    shutdown_timer.async_wait([&](boost::system::error_code ec) {
      if (!ec) poll_shutdown();
    });
  };
  signals.async_wait([&](boost::system::error_code ec, int signal) {
    if (ec) return;
    std::fprintf(stderr, "tessera serve: %s received, shutting down (%lld requests in flight)\n",
                 signal == SIGINT ? "SIGINT" : "SIGTERM", static_cast<long long>(service.in_flight()));
    deadline = std::chrono::steady_clock::now() +
               std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                   std::chrono::duration<double>(server_config.shutdown_timeout));
    service.begin_shutdown();
    http.stop_accepting();
    // Gateways' health probes now fail, so they send new requests to other replicas.
    gateway.begin_drain();
    poll_shutdown();
  });

  // A handler that throws must not end the server: log it and keep serving (the request
  // handlers answer their own failures; this catches anything else).
  for (;;) {
    try {
      io.run();
      break;
    } catch (const std::exception& e) {
      spdlog::error("serve: an I/O handler failed: {}; the server continues", e.what());
    }
  }
  stats.stop();
  // Teardown order: no more engine callbacks, then connections closed while the server and
  // io_context still exist, then the engine's leftover requests (and their sockets) freed.
  gateway.stop();
  http.close_all();
  io.restart();
  io.poll();
  stack.gateway.reset();
  io.poll();
  std::fprintf(stderr, "tessera serve: stopped\n");
}

}  // namespace

void add_serve_command(CLI::App& app) {
  auto opt = std::make_shared<ServeOptions>();
  CLI::App* cmd = app.add_subcommand("serve", "serve the OpenAI-compatible HTTP API (completions, chat, SSE)");
  cmd->add_option("-c,--config", opt->config, "stack YAML (default: configs/smollm2-cpu.yaml)");
  cmd->add_option("--host", opt->host, "address to bind (overrides server.host; default 127.0.0.1)");
  cmd->add_option("--port", opt->port, "port (overrides server.port; 0 picks a free one)");
  cmd->add_option("--roofline-report", opt->roofline_report,
                  "a `tessera bench roofline --json` file shown on /dashboard (read when the page asks)");
  cmd->add_flag("--no-access-log", opt->no_access_log,
                 "do not write the per-request access line (method, path, status, tokens, TTFT, duration) to stderr");
  cmd->callback([opt] { run_serve(*opt); });
}

}  // namespace tessera::cli
