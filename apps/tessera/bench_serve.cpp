// tessera bench serve: load against a running OpenAI-compatible server. Each request is a
// POST /v1/completions with stream=true over HTTP/1.1 (Boost.Beast, one connection per
// request); the SSE events are timed as they arrive. Arrivals are Poisson at each given rate,
// or a fixed number of clients each sending its next request when the last one ends.
// Against a router (e.g. Tessera's ab-split, --model ab) each request's arm is read from the
// x-tessera-route header (else the response's model field, when it differs from the one
// sent) and the report adds per-arm figures.
#include <CLI/CLI.hpp>
#include <boost/asio/connect.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <limits>
#include <map>
#include <mutex>
#include <random>
#include <sstream>
#include <thread>

#include "bench.h"
#include "commands.h"
#include "stack_loader.h"

namespace tessera::cli::bench {
namespace {

namespace beast = boost::beast;
namespace http = beast::http;
namespace net = boost::asio;
using tcp = net::ip::tcp;
using Clock = std::chrono::steady_clock;

struct ServeOptions {
  std::string url = "http://127.0.0.1:8080";
  std::string model;
  std::string config;  // for --make: the tokenizer that sizes generated prompts
  std::string workload_path, make_kind;
  int workload_size = 64;
  uint64_t seed = 1;
  std::vector<double> rates;
  std::vector<int> concurrency;
  int num_requests = 32;  // per level
  int num_users = 0;      // >0: request i sends user "bench-user-<i mod num_users>" (sticky A/B arms)
  std::string slo_ttft_text = "1s", slo_tpot_text = "100ms";
  double slo_ttft = 1.0, slo_tpot = 0.1;  // seconds, parsed from the texts
  double timeout = 600;
  std::string json_path, html_path;
};

// "1s", "100ms", "250us" or plain seconds ("0.5").
double parse_duration(const std::string& text, const char* flag) {
  size_t used = 0;
  double v = 0;
  try {
    v = std::stod(text, &used);
  } catch (const std::exception&) {
    throw CommandError(std::string("bench serve: ") + flag + ": expected a duration like 1s or 100ms, got '" + text + "'");
  }
  const std::string unit = text.substr(used);
  if (unit.empty() || unit == "s") return v;
  if (unit == "ms") return v * 1e-3;
  if (unit == "us") return v * 1e-6;
  if (unit == "m" || unit == "min") return v * 60;
  throw CommandError(std::string("bench serve: ") + flag + ": unknown unit '" + unit + "' (s, ms, us, min)");
}

struct Endpoint {
  std::string host, port, path;
};

Endpoint parse_url(const std::string& url) {
  const std::string scheme = "http://";
  if (url.rfind(scheme, 0) != 0) throw CommandError("bench serve: --url must start with http:// (got '" + url + "')");
  std::string rest = url.substr(scheme.size());
  Endpoint e;
  const auto slash = rest.find('/');
  e.path = slash == std::string::npos ? "" : rest.substr(slash);
  if (!e.path.empty() && e.path.back() == '/') e.path.pop_back();
  rest = rest.substr(0, slash);
  const auto colon = rest.rfind(':');
  e.host = colon == std::string::npos ? rest : rest.substr(0, colon);
  e.port = colon == std::string::npos ? "80" : rest.substr(colon + 1);
  return e;
}

struct ServeRecord {
  bool ok = false;
  std::string error;
  double start = 0;  // seconds since the level began
  double ttft = 0, e2e = 0, tpot = 0;
  int output_tokens = 0;
  int requested_tokens = 0;
  std::vector<double> itl;
  std::string arm;  // the deployment a router chose ("" when the target is not a router)
};

// Splits an SSE stream into events and records when each content event arrived.
class SseReader {
 public:
  explicit SseReader(Clock::time_point sent) : sent_(sent) {}

  // Returns false when the stream said [DONE].
  bool feed(const char* data, size_t n, Clock::time_point now) {
    buffer_.append(data, n);
    for (;;) {
      // Events end with a blank line; servers use \n\n or \r\n\r\n.
      size_t end = buffer_.find("\n\n");
      size_t skip = 2;
      const size_t crlf = buffer_.find("\r\n\r\n");
      if (crlf != std::string::npos && (end == std::string::npos || crlf < end)) { end = crlf; skip = 4; }
      if (end == std::string::npos) return !done_;
      const std::string event = buffer_.substr(0, end);
      buffer_.erase(0, end + skip);
      handle_event(event, now);
      if (done_) return false;
    }
  }

  std::vector<double> event_times;  // seconds after the request was sent, content events
  int usage_completion_tokens = -1;
  std::string model;                // the "model" the server answered with
  std::string error;

 private:
  void handle_event(const std::string& event, Clock::time_point now) {
    std::istringstream lines(event);
    std::string line, data;
    while (std::getline(lines, line)) {
      if (!line.empty() && line.back() == '\r') line.pop_back();
      if (line.rfind("data:", 0) == 0) data += line.substr(line[5] == ' ' ? 6 : 5);
    }
    if (data.empty()) return;
    if (data == "[DONE]") { done_ = true; return; }
    nlohmann::json j = nlohmann::json::parse(data, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded()) { error = "unparsable SSE data: " + data.substr(0, 200); return; }
    if (j.contains("error")) { error = j["error"].dump(); done_ = true; return; }
    if (model.empty() && j.contains("model") && j["model"].is_string()) model = j["model"].get<std::string>();
    if (j.contains("usage") && j["usage"].is_object() && j["usage"].contains("completion_tokens"))
      usage_completion_tokens = j["usage"]["completion_tokens"].get<int>();
    // A content event carries generated text (one token per event on llama.cpp-style servers).
    if (j.contains("choices") && j["choices"].is_array() && !j["choices"].empty()) {
      const auto& c = j["choices"][0];
      const bool has_text = c.contains("text") && c["text"].is_string() && !c["text"].get<std::string>().empty();
      if (has_text) event_times.push_back(std::chrono::duration<double>(now - sent_).count());
    }
  }

  Clock::time_point sent_;
  std::string buffer_;
  bool done_ = false;
};

ServeRecord send_one(const Endpoint& ep, const std::string& model, const std::string& user, const WorkloadRequest& r,
                     double timeout) {
  ServeRecord rec;
  rec.requested_tokens = r.max_tokens;
  nlohmann::json body = {{"max_tokens", r.max_tokens}, {"stream", true}, {"temperature", 0},
                         // Honour the requested length (vLLM and llama.cpp understand it).
                         {"ignore_eos", true}, {"stream_options", {{"include_usage", true}}}};
  if (!model.empty()) body["model"] = model;
  if (!user.empty()) body["user"] = user;
  if (!r.prompt.empty()) body["prompt"] = r.prompt;
  else body["prompt"] = r.prompt_ids;  // OpenAI accepts a prompt as token ids
  const auto sent = Clock::now();
  try {
    net::io_context ioc;
    beast::tcp_stream stream(ioc);
    tcp::resolver resolver(ioc);
    stream.expires_after(std::chrono::milliseconds(static_cast<int64_t>(timeout * 1e3)));
    stream.connect(resolver.resolve(ep.host, ep.port));
    http::request<http::string_body> req{http::verb::post, ep.path + "/v1/completions", 11};
    req.set(http::field::host, ep.host);
    req.set(http::field::content_type, "application/json");
    req.set(http::field::accept, "text/event-stream");
    req.body() = body.dump();
    req.prepare_payload();
    http::write(stream, req);

    beast::flat_buffer buffer;
    http::response_parser<http::buffer_body> parser;
    parser.body_limit(std::numeric_limits<std::uint64_t>::max());
    http::read_header(stream, buffer, parser);
    const unsigned status = parser.get().result_int();
    if (const auto route = parser.get()["x-tessera-route"]; !route.empty()) {
      const std::string v(route);
      rec.arm = v.substr(v.find('=') + 1);  // "ROUTER=ARM"
    }
    SseReader sse(sent);
    std::string raw;  // kept for error messages
    char chunk[8192];
    while (!parser.is_done()) {
      parser.get().body().data = chunk;
      parser.get().body().size = sizeof chunk;
      beast::error_code ec;
      // read_some: hand over what arrived. http::read would wait until the 8 KiB body buffer
      // is full, so every SSE event of its first 8 KiB would look as if it came at once.
      http::read_some(stream, buffer, parser, ec);
      if (ec == http::error::need_buffer) ec = {};
      if (ec) throw beast::system_error(ec);
      const size_t n = sizeof chunk - parser.get().body().size;
      const auto now = Clock::now();
      if (status != 200) { raw.append(chunk, n); continue; }
      if (!sse.feed(chunk, n, now)) break;
    }
    rec.e2e = std::chrono::duration<double>(Clock::now() - sent).count();
    if (status != 200) throw std::runtime_error("HTTP " + std::to_string(status) + ": " + raw.substr(0, 300));
    if (!sse.error.empty()) throw std::runtime_error(sse.error);
    beast::error_code ignored;
    stream.socket().shutdown(tcp::socket::shutdown_both, ignored);
    const auto& t = sse.event_times;
    if (t.empty()) throw std::runtime_error("the stream carried no generated text");
    rec.ttft = t.front();
    for (size_t i = 1; i < t.size(); ++i) rec.itl.push_back(t[i] - t[i - 1]);
    // Servers that send several tokens per event report the count in usage.
    rec.output_tokens = sse.usage_completion_tokens >= 0 ? sse.usage_completion_tokens : static_cast<int>(t.size());
    rec.tpot = rec.output_tokens > 1 ? (t.back() - t.front()) / (rec.output_tokens - 1) : 0;
    if (rec.arm.empty() && !model.empty() && !sse.model.empty() && sse.model != model) rec.arm = sse.model;
    rec.ok = true;
  } catch (const std::exception& e) {
    rec.error = e.what();
    rec.e2e = std::chrono::duration<double>(Clock::now() - sent).count();
  }
  return rec;
}

struct LevelResult {
  std::string label;  // "rate 2/s" or "concurrency 4"
  double offered = 0;
  double makespan = 0;
  std::vector<ServeRecord> records;
  nlohmann::json metrics;
  std::map<std::string, nlohmann::json> arms;  // per router arm, when the target was a router
};

nlohmann::json level_metrics(const LevelResult& lv, double slo_ttft, double slo_tpot) {
  std::vector<double> ttft, tpot, itl;
  int64_t tokens = 0, ok = 0, good = 0, good_tokens = 0;
  for (const auto& r : lv.records) {
    if (!r.ok) continue;
    ++ok;
    tokens += r.output_tokens;
    ttft.push_back(r.ttft * 1e3);
    if (r.output_tokens > 1) tpot.push_back(r.tpot * 1e3);
    for (double x : r.itl) itl.push_back(x * 1e3);
    // Goodput counts the requests that met both latency objectives.
    if (r.ttft <= slo_ttft && r.tpot <= slo_tpot) { ++good; good_tokens += r.output_tokens; }
  }
  const Summary st = summarize(ttft), sp = summarize(tpot), si = summarize(itl);
  const double span = lv.makespan > 0 ? lv.makespan : 1;
  return {{"requests", lv.records.size()}, {"completed", ok}, {"failed", lv.records.size() - ok},
          {"output_tokens", tokens}, {"makespan_s", lv.makespan},
          {"output_tokens_per_s", tokens / span}, {"requests_per_s", ok / span},
          {"goodput_requests_per_s", good / span}, {"goodput_tokens_per_s", good_tokens / span},
          {"slo_attainment", lv.records.empty() ? 0.0 : static_cast<double>(good) / lv.records.size()},
          {"ttft_p50_ms", st.p50}, {"ttft_p90_ms", st.p90}, {"ttft_p99_ms", st.p99},
          {"tpot_p50_ms", sp.p50}, {"tpot_p90_ms", sp.p90}, {"tpot_p99_ms", sp.p99},
          {"itl_p50_ms", si.p50}, {"itl_p90_ms", si.p90}, {"itl_p99_ms", si.p99}};
}

LevelResult run_level(const Endpoint& ep, const ServeOptions& opt, const Workload& w, double rate,
                      int concurrency) {
  LevelResult lv;
  lv.label = rate > 0 ? "rate " + fmt(rate, 2) + "/s" : "concurrency " + std::to_string(concurrency);
  lv.offered = rate > 0 ? rate : concurrency;
  lv.records.resize(opt.num_requests);
  std::atomic<int> done{0};
  const auto level_start = Clock::now();
  auto request_of = [&](int i) -> const WorkloadRequest& { return w[static_cast<size_t>(i) % w.size()]; };
  auto run_request = [&](int i) {
    const double start = std::chrono::duration<double>(Clock::now() - level_start).count();
    const std::string user = opt.num_users > 0 ? "bench-user-" + std::to_string(i % opt.num_users) : "";
    ServeRecord rec = send_one(ep, opt.model, user, request_of(i), opt.timeout);
    rec.start = start;
    lv.records[i] = std::move(rec);
    done.fetch_add(1);
  };
  std::vector<std::thread> threads;
  // Out here, not in the closed-loop branch: its client threads take one more index after
  // their last request and are joined below, after that branch's scope (ASan:
  // stack-use-after-scope in integration_bench_cli).
  std::atomic<int> next_index{0};
  if (rate > 0) {
    // Poisson process: exponential gaps, one thread per request so a slow response never
    // delays the next arrival.
    std::mt19937_64 rng(opt.seed);
    std::exponential_distribution<double> gap(rate);
    auto next = level_start;
    for (int i = 0; i < opt.num_requests; ++i) {
      std::this_thread::sleep_until(next);
      threads.emplace_back(run_request, i);
      next += std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(gap(rng)));
      print_progress(lv.label.c_str(), done.load(), opt.num_requests);
    }
  } else {
    // Closed loop: each client sends its next request as soon as its last one ends.
    for (int c = 0; c < concurrency; ++c)
      threads.emplace_back([&] {
        for (int i = next_index.fetch_add(1); i < opt.num_requests; i = next_index.fetch_add(1)) run_request(i);
      });
  }
  int shown = -1;
  while (done.load() < opt.num_requests) {
    if (done.load() != shown) { shown = done.load(); print_progress(lv.label.c_str(), shown, opt.num_requests); }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  for (auto& t : threads) t.join();
  print_progress(lv.label.c_str(), opt.num_requests, opt.num_requests);
  double end = 0;
  for (const auto& r : lv.records) end = std::max(end, r.start + r.e2e);
  lv.makespan = end;
  lv.metrics = level_metrics(lv, opt.slo_ttft, opt.slo_tpot);
  // Per arm: the same figures over each arm's requests (throughput over the whole level).
  std::map<std::string, LevelResult> by_arm;
  for (const auto& r : lv.records)
    if (r.ok && !r.arm.empty()) by_arm[r.arm].records.push_back(r);
  for (auto& [arm, sub] : by_arm) {
    sub.makespan = lv.makespan;
    lv.arms[arm] = level_metrics(sub, opt.slo_ttft, opt.slo_tpot);
  }
  return lv;
}

void run_serve(ServeOptions opt) {
  opt.slo_ttft = parse_duration(opt.slo_ttft_text, "--slo-ttft");
  opt.slo_tpot = parse_duration(opt.slo_tpot_text, "--slo-tpot");
  if (opt.rates.empty() && opt.concurrency.empty())
    throw CommandError("bench serve: give --rate R[,R...] (Poisson arrivals) or --concurrency C[,C...]");
  if (opt.workload_path.empty() == opt.make_kind.empty())
    throw CommandError("bench serve: give exactly one of --workload FILE or --make KIND");
  Workload w;
  if (!opt.workload_path.empty()) {
    w = read_workload(opt.workload_path);
  } else {
    LoadedStack stack = load_stack(opt.config, true);
    w = make_workload({opt.make_kind, opt.workload_size, 0, opt.seed}, stack.engine->model().tokenizer());
  }
  const Endpoint ep = parse_url(opt.url);
  std::vector<LevelResult> levels;
  for (double r : opt.rates) levels.push_back(run_level(ep, opt, w, r, 0));
  for (int c : opt.concurrency) levels.push_back(run_level(ep, opt, w, 0, c));

  const std::vector<std::string> header = {"load", "ok/sent", "out t/s", "req/s", "goodput req/s", "TTFT p50/p90/p99 ms",
                                           "TPOT p50/p90/p99 ms", "ITL p50/p90/p99 ms"};
  std::vector<std::vector<std::string>> rows;
  nlohmann::json j;
  j["command"] = "serve";
  j["url"] = opt.url;
  j["slo"] = {{"ttft_s", opt.slo_ttft}, {"tpot_s", opt.slo_tpot}};
  j["levels"] = nlohmann::json::array();
  Series ttft_curve{"TTFT p50 ms", {}, {}}, tpot_curve{"TPOT p50 ms", {}, {}}, itl_curve{"ITL p99 ms", {}, {}};
  for (const auto& lv : levels) {
    const auto& m = lv.metrics;
    auto trio = [&](const char* k) {
      const std::string b = k;
      return fmt(m[b + "_p50_ms"].get<double>(), 1) + "/" + fmt(m[b + "_p90_ms"].get<double>(), 1) + "/" +
             fmt(m[b + "_p99_ms"].get<double>(), 1);
    };
    rows.push_back({lv.label, std::to_string(m["completed"].get<int64_t>()) + "/" + std::to_string(lv.records.size()),
                    fmt(m["output_tokens_per_s"].get<double>(), 1), fmt(m["requests_per_s"].get<double>(), 2),
                    fmt(m["goodput_requests_per_s"].get<double>(), 2), trio("ttft"), trio("tpot"), trio("itl")});
    nlohmann::json lj = {{"label", lv.label}, {"offered", lv.offered}, {"metrics", m}};
    if (!lv.arms.empty()) lj["arms"] = lv.arms;
    lj["errors"] = nlohmann::json::array();
    for (const auto& r : lv.records)
      if (!r.ok && lj["errors"].size() < 5) lj["errors"].push_back(r.error);
    j["levels"].push_back(lj);
    const double x = m["output_tokens_per_s"].get<double>();
    ttft_curve.x.push_back(x); ttft_curve.y.push_back(m["ttft_p50_ms"].get<double>());
    tpot_curve.x.push_back(x); tpot_curve.y.push_back(m["tpot_p50_ms"].get<double>());
    itl_curve.x.push_back(x); itl_curve.y.push_back(m["itl_p99_ms"].get<double>());
  }
  std::fprintf(stderr, "server %s; SLO: TTFT <= %.0f ms, TPOT <= %.0f ms\n", opt.url.c_str(), opt.slo_ttft * 1e3,
               opt.slo_tpot * 1e3);
  print_table(header, rows);
  // A router target: the same columns per arm.
  std::vector<std::vector<std::string>> arm_rows;
  for (const auto& lv : levels) {
    for (const auto& [arm, m] : lv.arms) {
      auto trio = [&](const char* k) {
        const std::string b = k;
        return fmt(m[b + "_p50_ms"].get<double>(), 1) + "/" + fmt(m[b + "_p90_ms"].get<double>(), 1) + "/" +
               fmt(m[b + "_p99_ms"].get<double>(), 1);
      };
      arm_rows.push_back({lv.label + " arm " + arm, std::to_string(m["completed"].get<int64_t>()),
                          fmt(m["output_tokens_per_s"].get<double>(), 1), fmt(m["requests_per_s"].get<double>(), 2),
                          fmt(m["goodput_requests_per_s"].get<double>(), 2), trio("ttft"), trio("tpot"), trio("itl")});
    }
  }
  if (!arm_rows.empty()) {
    std::fprintf(stderr, "per router arm (x-tessera-route):\n");
    auto arm_header = header;
    arm_header[1] = "ok";
    print_table(arm_header, arm_rows);
  }
  for (const auto& lv : levels)
    for (const auto& r : lv.records)
      if (!r.ok) { std::fprintf(stderr, "%s: first error: %s\n", lv.label.c_str(), r.error.c_str()); break; }
  if (!opt.json_path.empty()) write_json(opt.json_path, j);
  if (!opt.html_path.empty())
    write_html(opt.html_path, "tessera bench serve",
               {"<p>" + html_escape(opt.url) + "</p>", html_table(header, rows),
                arm_rows.empty() ? std::string() : "<h2>per router arm</h2>" + html_table(header, arm_rows),
                svg_line_chart("latency vs throughput", "output tokens/s", "ms", {ttft_curve, tpot_curve, itl_curve})});
}

}  // namespace

void add_serve_subcommand(CLI::App& bench) {
  auto opt = std::make_shared<ServeOptions>();
  CLI::App* cmd = bench.add_subcommand("serve", "load a running OpenAI-compatible server (POST /v1/completions, SSE)");
  cmd->add_option("--url", opt->url, "server base URL")->capture_default_str();
  cmd->add_option("--model", opt->model, "model name to send (default: none)");
  cmd->add_option("-w,--workload", opt->workload_path, "workload JSONL (prompt text, max_tokens)");
  cmd->add_option("--make", opt->make_kind, "generate the workload (needs the model's tokenizer, -c)");
  cmd->add_option("-c,--config", opt->config, "stack YAML whose tokenizer sizes --make prompts");
  cmd->add_option("--workload-size", opt->workload_size, "prompts generated with --make")->capture_default_str();
  cmd->add_option("--seed", opt->seed)->capture_default_str();
  cmd->add_option("--rate", opt->rates, "Poisson arrival rates in requests/s, e.g. 1,2,4")->delimiter(',');
  cmd->add_option("--concurrency", opt->concurrency, "fixed numbers of clients, e.g. 1,4,16")->delimiter(',');
  cmd->add_option("-n,--num-requests", opt->num_requests, "requests per load level")->capture_default_str();
  cmd->add_option("--users", opt->num_users,
                  "send `user` from this many distinct users (request i is user i mod N), so a sticky A/B router "
                  "splits them; 0: no user field")
      ->capture_default_str();
  cmd->add_option("--slo-ttft", opt->slo_ttft_text, "TTFT objective for goodput (e.g. 1s, 500ms)")->capture_default_str();
  cmd->add_option("--slo-tpot", opt->slo_tpot_text, "TPOT objective for goodput (e.g. 100ms)")->capture_default_str();
  cmd->add_option("--timeout", opt->timeout, "seconds per request")->capture_default_str();
  cmd->add_option("--json", opt->json_path, "write the results as JSON to FILE");
  cmd->add_option("--html", opt->html_path, "write an HTML report with SVG plots to FILE");
  cmd->callback([opt] { run_serve(*opt); });
}

}  // namespace tessera::cli::bench
