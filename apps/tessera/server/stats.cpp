#include "stats.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <optional>

namespace tessera::server {

using nlohmann::json;

namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
// Percentiles of a series point are taken over at least this many seconds before it, so a
// point is not empty just because no request finished in its own second.
constexpr double kPercentileSpanS = 10;

double unix_now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

HistogramSnapshot snapshot(const Histogram& h) { return {h.bucket_counts(), h.sum(), h.count()}; }

json number_or_null(double v) { return std::isfinite(v) ? json(v) : json(nullptr); }

double ratio(double num, double den) { return den > 0 ? num / den : kNaN; }

// Compact number text for the series (4 significant digits; null for NaN/inf).
void append_number(std::string* out, double v) {
  if (!std::isfinite(v)) {
    *out += "null";
    return;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.4g", v);
  *out += buf;
}

struct LatencyView {
  const char* name;                        // JSON key
  HistogramSnapshot StatsSample::*member;
  const Histogram& (ServerMetrics::*histogram)() const;
  const char* metric;                      // the /metrics family
};

const LatencyView kLatencies[] = {
    {"queue_time_seconds", &StatsSample::queue_time, &ServerMetrics::queue_time, "tessera_queue_time_seconds"},
    {"ttft_seconds", &StatsSample::ttft, &ServerMetrics::ttft, "tessera_time_to_first_token_seconds"},
    {"tpot_seconds", &StatsSample::tpot, &ServerMetrics::tpot, "tessera_time_per_output_token_seconds"},
    {"itl_seconds", &StatsSample::itl, &ServerMetrics::itl, "tessera_inter_token_latency_seconds"},
    {"e2e_seconds", &StatsSample::e2e, &ServerMetrics::e2e, "tessera_e2e_request_latency_seconds"},
};
const double kQuantiles[] = {0.5, 0.9, 0.99};
const char* const kQuantileNames[] = {"p50", "p90", "p99"};

int32_t free_blocks(const KvStats& kv) {
  return std::max(0, kv.num_blocks - kv.num_used_blocks - kv.num_cached_blocks);
}

double fraction(uint64_t num, uint64_t den) {
  return den ? static_cast<double>(num) / static_cast<double>(den) : 0.0;
}

// The engine's counters and gauges, as "current" reports them (top level and per deployment).
void put_engine_current(const EngineStats& e, json* j) {
  (*j)["engine"] = {{"steps_total", e.num_steps},
                    {"batch_tokens_total", e.num_batch_tokens},
                    {"last_batch_size", e.last_batch_size},
                    {"last_batch_tokens", e.last_batch_tokens},
                    {"mean_batch_tokens", fraction(e.num_batch_tokens, e.num_steps)},
                    {"preemptions_total", e.num_preemptions}};
  (*j)["kv"] = {{"blocks_total", e.kv.num_blocks},
                {"blocks_used", e.kv.num_used_blocks},
                {"blocks_cached", e.kv.num_cached_blocks},
                {"blocks_free", free_blocks(e.kv)},
                {"slots_reserved", e.kv.num_slots_reserved}};
  (*j)["prefix_cache"] = {{"query_tokens_total", e.kv.prefix_query_tokens},
                          {"hit_tokens_total", e.kv.prefix_hit_tokens},
                          {"hit_rate", fraction(e.kv.prefix_hit_tokens, e.kv.prefix_query_tokens)}};
  if (e.num_draft_tokens > 0)
    (*j)["speculative"] = {{"draft_tokens_total", e.num_draft_tokens},
                           {"accepted_tokens_total", e.num_accepted_draft_tokens},
                           {"acceptance_rate", fraction(e.num_accepted_draft_tokens, e.num_draft_tokens)}};
}

double delta_ratio(uint64_t num_later, uint64_t num_earlier, uint64_t den_later, uint64_t den_earlier) {
  return ratio(static_cast<double>(num_later - num_earlier), static_cast<double>(den_later - den_earlier));
}

// An engine over a window: what happened between `base` and `live`.
void put_engine_window(const EngineStats& live, const EngineStats& base, json* w) {
  (*w)["finished_sequences"] = live.num_finished - base.num_finished;
  (*w)["preemptions"] = live.num_preemptions - base.num_preemptions;
  (*w)["steps"] = live.num_steps - base.num_steps;
  (*w)["tokens_per_step"] =
      number_or_null(delta_ratio(live.num_batch_tokens, base.num_batch_tokens, live.num_steps, base.num_steps));
  (*w)["prefix_cache_hit_rate"] = number_or_null(delta_ratio(
      live.kv.prefix_hit_tokens, base.kv.prefix_hit_tokens, live.kv.prefix_query_tokens, base.kv.prefix_query_tokens));
  if (live.num_draft_tokens > 0)
    (*w)["speculative_acceptance_rate"] = number_or_null(delta_ratio(
        live.num_accepted_draft_tokens, base.num_accepted_draft_tokens, live.num_draft_tokens, base.num_draft_tokens));
}

// count, mean and percentiles of one histogram between two snapshots, and the share within
// the request's target for it when one was asked for.
json latency_window(const std::vector<double>& bounds, const HistogramSnapshot& later, const HistogramSnapshot& earlier,
                    const StatsQuery& query, const std::string& name) {
  const uint64_t count = later.count - earlier.count;
  json h = {{"count", count}, {"mean", number_or_null(ratio(later.sum - earlier.sum, static_cast<double>(count)))}};
  for (size_t k = 0; k < 3; ++k)
    h[kQuantileNames[k]] = number_or_null(histogram_quantile(kQuantiles[k], bounds, later, &earlier));
  const auto target = query.targets.find(name);
  if (target != query.targets.end())
    h["within_target"] = {{"target", target->second},
                          {"fraction", number_or_null(histogram_fraction_at_most(target->second, bounds, later, &earlier))}};
  return h;
}

// The /v1/stats query parameter of each latency target.
const std::pair<const char*, const char*> kTargetParams[] = {
    {"slo_queue", "queue_time_seconds"}, {"slo_ttft", "ttft_seconds"}, {"slo_tpot", "tpot_seconds"}, {"slo_itl", "itl_seconds"}};

json current_json(const StatsSample& s) {
  const EngineStats& e = s.engine;
  json latency = json::object();
  for (const auto& l : kLatencies) {
    const HistogramSnapshot& h = s.*(l.member);
    latency[l.name] = {{"count", h.count}, {"sum", h.sum}};
  }
  json j = {
      {"requests",
       {{"in_flight", s.in_flight},
        {"running", e.num_running},
        {"waiting", e.num_waiting},
        {"finished_sequences_total", e.num_finished},
        {"rejected_queue_full_total", s.rejected_full_queue},
        {"cancelled_by_client_total", s.cancelled_by_client}}},
      {"tokens", {{"prompt_total", s.prompt_tokens}, {"generation_total", s.generation_tokens}}},
      {"latency", latency},
  };
  put_engine_current(e, &j);
  return j;
}

// The columns of one series object, filled point by point: {"name":[v,...],...}.
class Columns {
 public:
  void put(const std::string& name, double v) {
    std::string& t = column(name);
    t += t.empty() ? "[" : ",";
    append_number(&t, v);
  }
  void put_time(double t) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.3f", t);
    std::string& c = column("t");
    c += c.empty() ? "[" : ",";
    c += buf;
  }
  void append_to(std::string* out) const {
    *out += '{';
    for (size_t i = 0; i < columns_.size(); ++i) {
      if (i) *out += ',';
      *out += json(columns_[i].first).dump() + ":" + (columns_[i].second.empty() ? "[" : columns_[i].second) + "]";
    }
    *out += '}';
  }

 private:
  std::string& column(const std::string& name) {
    for (auto& c : columns_)
      if (c.first == name) return c.second;
    columns_.emplace_back(name, std::string());
    return columns_.back().second;
  }
  std::vector<std::pair<std::string, std::string>> columns_;
};

const HistogramSnapshot kEmptyHistogram;
const ArmSample kEmptyArm;

const ArmSample& arm_of(const StatsSample& s, const std::pair<std::string, std::string>& key) {
  const auto it = s.arms.find(key);
  return it == s.arms.end() ? kEmptyArm : it->second;
}

// A counter of ArmSample (requests, feedback, misroutes) summed over the arms of `router`.
uint64_t arm_total(const StatsSample& s, const std::string& router, uint64_t ArmSample::*counter) {
  uint64_t n = 0;
  for (const auto& [key, a] : s.arms)
    if (key.first == router) n += a.*counter;
  return n;
}
// Requests of the router `router` (all its arms) in a sample.
uint64_t routed_total(const StatsSample& s, const std::string& router) {
  return arm_total(s, router, &ArmSample::requests);
}

// Cache lookups of a sample matching `result` ("hit", "miss" or empty: any) and `tier`
// (nullptr: any) over every deployment, or over `deployment` when not null.
uint64_t cache_count(const StatsSample& s, const std::string* deployment, const std::string& result,
                     const std::string* tier) {
  uint64_t n = 0;
  for (const auto& [key, count] : s.cache)
    if ((!deployment || std::get<0>(key) == *deployment) && (result.empty() || std::get<1>(key) == result) &&
        (!tier || std::get<2>(key) == *tier))
      n += count;
  return n;
}

// A cache chain's totals and window for one deployment or all (deployment == nullptr), its
// hits by tier whatever the tiers are called (memory and redis today).
json cache_json(const StatsSample& live, const StatsSample& base, const std::string* deployment,
                const std::vector<std::string>& tiers) {
  const uint64_t lookups = cache_count(live, deployment, "", nullptr);
  const uint64_t hits = cache_count(live, deployment, "hit", nullptr);
  const uint64_t w_lookups = lookups - cache_count(base, deployment, "", nullptr);
  const uint64_t w_hits = hits - cache_count(base, deployment, "hit", nullptr);
  json by_tier = json::object();
  for (const std::string& tier : tiers) {
    const uint64_t t = cache_count(live, deployment, "hit", &tier);
    const uint64_t wt = t - cache_count(base, deployment, "hit", &tier);
    by_tier[tier] = {{"hits_total", t}, {"window_hits", wt},
                     {"window_hit_rate", number_or_null(ratio(static_cast<double>(wt), static_cast<double>(w_lookups)))}};
  }
  return {{"lookups_total", lookups},
          {"hits_total", hits},
          {"misses_total", cache_count(live, deployment, "miss", nullptr)},
          {"window",
           {{"lookups", w_lookups},
            {"hits", w_hits},
            {"hit_rate", number_or_null(ratio(static_cast<double>(w_hits), static_cast<double>(w_lookups)))}}},
          {"tiers", std::move(by_tier)}};
}

int hex_value(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

std::string percent_decode(std::string_view s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '+') {
      out += ' ';
    } else if (s[i] == '%' && i + 2 < s.size() && hex_value(s[i + 1]) >= 0 && hex_value(s[i + 2]) >= 0) {
      out += static_cast<char>(hex_value(s[i + 1]) * 16 + hex_value(s[i + 2]));
      i += 2;
    } else {
      out += s[i];
    }
  }
  return out;
}

}  // namespace

StatsSample take_stats_sample(const ServerMetrics& m, const std::vector<std::string>& deployments,
                              const std::vector<EngineStats>& engines, double unix_time) {
  StatsSample s;
  s.time = unix_time;
  if (!engines.empty()) s.engine = engines.front();
  s.in_flight = m.in_flight();
  s.prompt_tokens = m.prompt_tokens();
  s.generation_tokens = m.generation_tokens();
  s.rejected_full_queue = m.rejected_full_queue();
  s.cancelled_by_client = m.cancelled_by_client();
  for (const auto& l : kLatencies) s.*(l.member) = snapshot((m.*(l.histogram))());
  s.deployments.resize(engines.size());
  for (size_t i = 0; i < engines.size(); ++i) {
    DeploymentSample& d = s.deployments[i];
    d.engine = engines[i];
    const auto it = i < deployments.size() ? m.deployment_latencies().find(deployments[i]) : m.deployment_latencies().end();
    if (it != m.deployment_latencies().end()) {
      d.queue_time = snapshot(it->second.queue_time);
      d.ttft = snapshot(it->second.ttft);
      d.tpot = snapshot(it->second.tpot);
    }
  }
  for (const auto& [key, n] : m.routed()) s.arms[key].requests = n;
  for (const auto& [key, f] : m.route_feedback()) {
    s.arms[key].feedback = f.total;
    s.arms[key].misroutes = f.misroutes;
  }
  for (const auto& [key, l] : m.arm_latencies()) {
    ArmSample& a = s.arms[key];
    a.queue_time = snapshot(l.queue_time);
    a.ttft = snapshot(l.ttft);
    a.tpot = snapshot(l.tpot);
  }
  s.cache = m.cache_requests();
  for (const auto& [router, h] : m.route_decisions()) s.route_decision[router] = snapshot(h);
  return s;
}

double histogram_quantile(double q, const std::vector<double>& bounds, const HistogramSnapshot& later,
                          const HistogramSnapshot* earlier) {
  const size_t n = later.counts.size();
  auto delta = [&](size_t i) {
    const uint64_t before = earlier && i < earlier->counts.size() ? earlier->counts[i] : 0;
    return later.counts[i] >= before ? later.counts[i] - before : 0;
  };
  uint64_t total = 0;
  for (size_t i = 0; i < n; ++i) total += delta(i);
  if (total == 0 || bounds.empty()) return kNaN;
  const double rank = q * static_cast<double>(total);
  double cumulative = 0;
  for (size_t i = 0; i < n; ++i) {
    const double c = static_cast<double>(delta(i));
    if (c > 0 && cumulative + c >= rank) {
      if (i >= bounds.size()) return bounds.back();  // the +Inf bucket
      const double lower = i == 0 ? 0.0 : bounds[i - 1];
      return lower + (bounds[i] - lower) * std::max(0.0, rank - cumulative) / c;
    }
    cumulative += c;
  }
  return bounds.back();
}

double histogram_fraction_at_most(double x, const std::vector<double>& bounds, const HistogramSnapshot& later,
                                  const HistogramSnapshot* earlier) {
  uint64_t total = 0;
  double at_most = 0;
  for (size_t i = 0; i < later.counts.size(); ++i) {
    const uint64_t before = earlier && i < earlier->counts.size() ? earlier->counts[i] : 0;
    const double c = static_cast<double>(later.counts[i] >= before ? later.counts[i] - before : 0);
    total += static_cast<uint64_t>(c);
    if (i >= bounds.size()) continue;  // the +Inf bucket is never within a finite x
    const double lower = i == 0 ? 0.0 : bounds[i - 1];
    if (x >= bounds[i]) at_most += c;
    else if (x > lower) at_most += c * (x - lower) / (bounds[i] - lower);
  }
  return total ? at_most / static_cast<double>(total) : kNaN;
}

std::string query_param(std::string_view target, std::string_view name) {
  const size_t q = target.find('?');
  if (q == std::string_view::npos) return {};
  std::string_view rest = target.substr(q + 1);
  while (!rest.empty()) {
    const size_t amp = rest.find('&');
    const std::string_view pair = rest.substr(0, amp);
    const size_t eq = pair.find('=');
    if (pair.substr(0, eq) == name) return eq == std::string_view::npos ? std::string() : percent_decode(pair.substr(eq + 1));
    if (amp == std::string_view::npos) break;
    rest = rest.substr(amp + 1);
  }
  return {};
}

StatsRecorder::StatsRecorder(boost::asio::any_io_executor executor, std::vector<StatsDeployment> deployments,
                             const ServerMetrics& metrics, StatsOptions options)
    : deployments_(std::move(deployments)), metrics_(metrics), options_(std::move(options)), started_(unix_now()),
      timer_(executor) {
  for (const auto& d : deployments_) names_.push_back(d.name);
  options_.capacity = std::max(2, options_.capacity);
  options_.interval_s = std::max(0.05, options_.interval_s);
  ring_.resize(static_cast<size_t>(options_.capacity));
}

StatsSample StatsRecorder::take() const {
  std::vector<EngineStats> engines;
  engines.reserve(deployments_.size());
  for (const auto& d : deployments_) engines.push_back(d.engine->stats());
  StatsSample s = take_stats_sample(metrics_, names_, engines, unix_now());
  if (options_.plugin_metrics) options_.plugin_metrics(&s.plugins);
  return s;
}

void StatsRecorder::start() {
  running_ = true;
  sample_now();
  schedule();
}

void StatsRecorder::stop() {
  running_ = false;
  timer_.cancel();
}

void StatsRecorder::schedule() {
  timer_.expires_after(std::chrono::duration_cast<std::chrono::steady_clock::duration>(
      std::chrono::duration<double>(options_.interval_s)));
  timer_.async_wait([this](boost::system::error_code ec) {
    if (ec || !running_) return;
    sample_now();
    schedule();
  });
}

void StatsRecorder::sample_now() {
  ring_[head_] = take();
  head_ = (head_ + 1) % ring_.size();
  size_ = std::min(size_ + 1, ring_.size());
}

const StatsSample& StatsRecorder::at(size_t i) const {
  return ring_[(head_ + ring_.size() - size_ + i) % ring_.size()];
}

json StatsRecorder::roofline() const {
  if (options_.roofline_report.empty())
    return {{"recorded", false}, {"path", nullptr},
            {"reason", "no roofline report configured (tessera serve --roofline-report PATH)"}};
  std::ifstream in(options_.roofline_report);
  if (!in)
    return {{"recorded", false}, {"path", options_.roofline_report}, {"reason", "the file does not exist (yet)"}};
  try {
    json report = json::parse(in);
    if (!report.is_object() || report.value("command", "") != "roofline")
      return {{"recorded", false}, {"path", options_.roofline_report},
              {"reason", "not a `tessera bench roofline --json` report"}};
    return {{"recorded", true}, {"path", options_.roofline_report}, {"report", std::move(report)}};
  } catch (const std::exception& e) {
    return {{"recorded", false}, {"path", options_.roofline_report}, {"reason", std::string("unreadable: ") + e.what()}};
  }
}

std::string StatsRecorder::render(const StatsQuery& query) const {
  double window_s = query.window_s;
  const StatsSample live = take();
  const double now = live.time;
  const double interval = options_.interval_s;
  const double max_window = interval * static_cast<double>(options_.capacity - 1);
  if (!std::isfinite(window_s)) window_s = max_window;
  window_s = std::clamp(window_s, interval, max_window);
  // Every latency histogram has the same buckets (metrics.cpp's latency_buckets).
  const std::vector<double>& bounds = metrics_.queue_time().bounds();

  json j;
  j["object"] = "stats";
  j["model"] = deployments_.front().name;
  j["time"] = now;
  j["uptime_s"] = now - started_;
  j["sample_interval_s"] = interval;
  j["history_s"] = max_window;
  j["window_s"] = window_s;
  j["current"] = current_json(live);
  if (query.roofline) j["roofline"] = roofline();

  // The samples of the window: [first, size_). The baseline of the window summary is its
  // oldest sample, window_s before the newest (the server's start while it is younger).
  const StatsSample* newest = size_ ? &at(size_ - 1) : &live;
  size_t first = size_;
  while (first > 0 && at(first - 1).time >= newest->time - window_s - interval * 0.5) --first;
  const StatsSample& base = first < size_ ? at(first) : live;
  // A deployment, arm or tier that appeared after a sample was taken is absent from it.
  auto dep = [&](const StatsSample& s, size_t k) -> const DeploymentSample& {
    static const DeploymentSample kEmpty;
    return k < s.deployments.size() ? s.deployments[k] : kEmpty;
  };

  // Window summary: live values against the baseline.
  {
    const double span = live.time - base.time;
    json w;
    w["span_s"] = span;
    w["output_tokens_per_s"] = number_or_null(ratio(static_cast<double>(live.generation_tokens - base.generation_tokens), span));
    put_engine_window(live.engine, base.engine, &w);
    json latency = json::object();
    for (const auto& l : kLatencies) latency[l.name] = latency_window(bounds, live.*(l.member), base.*(l.member), query, l.name);
    w["latency"] = std::move(latency);
    j["window"] = std::move(w);
  }

  // Per deployment, per router arm, per cache tier.
  std::vector<std::string> tiers;  // every tier that has answered, in name order
  for (const auto& [key, n] : live.cache)
    if (std::get<1>(key) == "hit" && std::find(tiers.begin(), tiers.end(), std::get<2>(key)) == tiers.end())
      tiers.push_back(std::get<2>(key));
  std::sort(tiers.begin(), tiers.end());
  {
    json list = json::array();
    for (size_t k = 0; k < deployments_.size(); ++k) {
      const DeploymentSample& d = dep(live, k);
      const DeploymentSample& b = dep(base, k);
      json current = {{"running", d.engine.num_running},
                      {"waiting", d.engine.num_waiting},
                      {"finished_sequences_total", d.engine.num_finished}};
      put_engine_current(d.engine, &current);
      json latency = {{"queue_time_seconds", {{"count", d.queue_time.count}, {"sum", d.queue_time.sum}}},
                      {"ttft_seconds", {{"count", d.ttft.count}, {"sum", d.ttft.sum}}},
                      {"tpot_seconds", {{"count", d.tpot.count}, {"sum", d.tpot.sum}}}};
      current["latency"] = std::move(latency);
      json w;
      put_engine_window(d.engine, b.engine, &w);
      w["latency"] = {{"queue_time_seconds", latency_window(bounds, d.queue_time, b.queue_time, query, "queue_time_seconds")},
                      {"ttft_seconds", latency_window(bounds, d.ttft, b.ttft, query, "ttft_seconds")},
                      {"tpot_seconds", latency_window(bounds, d.tpot, b.tpot, query, "tpot_seconds")}};
      list.push_back({{"name", deployments_[k].name},
                      {"drafter", deployments_[k].drafter.empty() ? json(nullptr) : json(deployments_[k].drafter)},
                      {"current", std::move(current)},
                      {"window", std::move(w)},
                      {"cache", cache_json(live, base, &deployments_[k].name, tiers)}});
    }
    j["deployments"] = std::move(list);
  }
  {
    json routers = json::array();
    for (const auto& [key, a] : live.arms) {
      if (routers.empty() || routers.back()["name"] != key.first)
        routers.push_back({{"name", key.first}, {"requests_total", routed_total(live, key.first)},
                           {"window_requests", routed_total(live, key.first) - routed_total(base, key.first)},
                           {"arms", json::array()}});
      json& r = routers.back();
      const ArmSample& b = arm_of(base, key);
      const uint64_t w_requests = a.requests - b.requests;
      const uint64_t w_feedback = a.feedback - b.feedback, w_misroutes = a.misroutes - b.misroutes;
      r["arms"].push_back({{"name", key.second},
                           {"requests_total", a.requests},
                           {"feedback_total", a.feedback},
                           {"misroutes_total", a.misroutes},
                           {"window",
                            {{"requests", w_requests},
                             {"feedback", w_feedback},
                             {"misroutes", w_misroutes},
                             {"misroute_rate", number_or_null(ratio(static_cast<double>(w_misroutes),
                                                                    static_cast<double>(w_feedback)))},
                             {"share", number_or_null(ratio(static_cast<double>(w_requests),
                                                            static_cast<double>(r["window_requests"].get<uint64_t>())))},
                             {"latency",
                              {{"queue_time_seconds", latency_window(bounds, a.queue_time, b.queue_time, query,
                                                                     "queue_time_seconds")},
                               {"ttft_seconds", latency_window(bounds, a.ttft, b.ttft, query, "ttft_seconds")},
                               {"tpot_seconds", latency_window(bounds, a.tpot, b.tpot, query, "tpot_seconds")}}}}}});
    }
    for (json& r : routers) {
      const std::string name = r["name"].get<std::string>();
      // Live misroutes: the share of responses with feedback whose feedback named another arm.
      const uint64_t w_feedback = arm_total(live, name, &ArmSample::feedback) - arm_total(base, name, &ArmSample::feedback);
      const uint64_t w_misroutes =
          arm_total(live, name, &ArmSample::misroutes) - arm_total(base, name, &ArmSample::misroutes);
      r["window_feedback"] = w_feedback;
      r["window_misroutes"] = w_misroutes;
      r["window_misroute_rate"] =
          number_or_null(ratio(static_cast<double>(w_misroutes), static_cast<double>(w_feedback)));
      // Decision latency (tessera_router_decision_seconds) and the router's own gauges (a
      // classifier's held-out figures from its training: measured offline, not live).
      const auto d = live.route_decision.find(name);
      if (d != live.route_decision.end() && !metrics_.route_decisions().empty()) {
        const auto db = base.route_decision.find(name);
        static const HistogramSnapshot kNone;
        r["decision_seconds"] = latency_window(metrics_.route_decisions().begin()->second.bounds(), d->second,
                                               db == base.route_decision.end() ? kNone : db->second, query,
                                               "decision_seconds");
      }
      json gauges = json::object();
      for (const CacheMetric& m : live.plugins) {
        if (m.labels.empty() || m.labels[0].first != "router" || m.labels[0].second != name) continue;
        std::string key = m.name.substr(std::string("tessera_router_").size());
        for (size_t i = 1; i < m.labels.size(); ++i) key += "." + m.labels[i].second;
        gauges[key] = m.value;
      }
      if (!gauges.empty()) r["plugin"] = std::move(gauges);
    }
    j["routers"] = std::move(routers);
  }
  j["cache"] = cache_json(live, base, nullptr, tiers);
  {
    // Semantic hits by tier and similarity bucket (tessera_cache_semantic_hits_total).
    json buckets = json::array();
    auto hits_in = [](const StatsSample& s, const CacheMetric& like) -> double {
      for (const CacheMetric& m : s.plugins)
        if (m.name == like.name && m.labels == like.labels) return m.value;
      return 0;
    };
    for (const CacheMetric& m : live.plugins) {
      if (m.name != "tessera_cache_semantic_hits_total") continue;
      json b = {{"hits_total", m.value}, {"window_hits", m.value - hits_in(base, m)}};
      for (const auto& [k, v] : m.labels) b[k] = v;
      buckets.push_back(std::move(b));
    }
    j["semantic_cache"] = {{"similarity_buckets", std::move(buckets)}};
  }

  // Series: points every `step` samples ending at the newest, each over (prev, point].
  const size_t available = size_ - first;
  const size_t step = std::max<size_t>(1, (available + kMaxPoints - 1) / kMaxPoints);
  const size_t pct_span = std::max(step, static_cast<size_t>(std::ceil(kPercentileSpanS / interval)));
  std::vector<size_t> points;
  for (size_t k = size_; k > first; k -= std::min(step, k - first)) points.push_back(k - 1);
  std::reverse(points.begin(), points.end());
  j["series_step_s"] = static_cast<double>(step) * interval;
  j["series_percentile_span_s"] = static_cast<double>(pct_span) * interval;

  Columns top, cache;
  std::vector<Columns> by_deployment(deployments_.size());
  std::map<std::pair<std::string, std::string>, Columns> by_arm;
  std::map<std::string, Columns> by_tier;
  for (size_t idx : points) {
    const StatsSample& s = at(idx);
    const bool has_prev = idx > 0;
    const StatsSample& p = at(has_prev ? (idx >= step ? idx - step : 0) : idx);
    const size_t lo = has_prev ? (idx >= step ? idx - step + 1 : 1) : idx;  // samples in (p, s]
    const StatsSample& pb = at(idx >= pct_span ? idx - pct_span : 0);        // the percentile span's start
    const double dt = s.time - p.time;
    const double pb_dt = s.time - pb.time;
    // Gauges averaged over the point's samples, counters as deltas, rates and percentiles
    // (events counted when a sequence finishes) over the percentile span.
    auto put_engine = [&](Columns& c, auto engine_of, bool speculative) {
      double running = 0, waiting = 0, batch = 0, used = 0, cached = 0, free = 0;
      for (size_t i = lo; i <= idx; ++i) {
        const EngineStats& x = engine_of(at(i));
        running += x.num_running;
        waiting += x.num_waiting;
        batch += x.last_batch_size;
        used += x.kv.num_used_blocks;
        cached += x.kv.num_cached_blocks;
        free += free_blocks(x.kv);
      }
      const double n = static_cast<double>(idx - lo + 1);
      const EngineStats& e = engine_of(s);
      const EngineStats& ep = engine_of(p);
      c.put("running", running / n);
      c.put("waiting", waiting / n);
      c.put("batch_size", batch / n);
      c.put("tokens_per_step", delta_ratio(e.num_batch_tokens, ep.num_batch_tokens, e.num_steps, ep.num_steps));
      c.put("steps_per_s", ratio(static_cast<double>(e.num_steps - ep.num_steps), dt));
      c.put("kv_blocks_used", used / n);
      c.put("kv_blocks_cached", cached / n);
      c.put("kv_blocks_free", free / n);
      c.put("preemptions", has_prev ? static_cast<double>(e.num_preemptions - ep.num_preemptions) : kNaN);
      c.put("prefix_cache_hit_rate", delta_ratio(e.kv.prefix_hit_tokens, ep.kv.prefix_hit_tokens,
                                                 e.kv.prefix_query_tokens, ep.kv.prefix_query_tokens));
      if (speculative)
        c.put("speculative_acceptance_rate", delta_ratio(e.num_accepted_draft_tokens, ep.num_accepted_draft_tokens,
                                                         e.num_draft_tokens, ep.num_draft_tokens));
    };
    auto put_latency = [&](Columns& c, const std::string& prefix, const HistogramSnapshot& later,
                           const HistogramSnapshot& earlier) {
      for (size_t k = 0; k < 3; ++k)
        c.put(prefix + "_" + kQuantileNames[k],
              has_prev ? histogram_quantile(kQuantiles[k], bounds, later, &earlier) : kNaN);
    };
    auto per_s = [&](uint64_t later, uint64_t earlier) {
      return has_prev ? ratio(static_cast<double>(later - earlier), pb_dt) : kNaN;
    };

    top.put_time(s.time);
    double in_flight = 0;
    for (size_t i = lo; i <= idx; ++i) in_flight += static_cast<double>(at(i).in_flight);
    top.put("in_flight", in_flight / static_cast<double>(idx - lo + 1));
    put_engine(top, [](const StatsSample& x) -> const EngineStats& { return x.engine; }, live.engine.num_draft_tokens > 0);
    top.put("output_tokens_per_s", per_s(s.generation_tokens, pb.generation_tokens));
    for (const auto& l : kLatencies) {
      if (l.member == &StatsSample::e2e) continue;
      std::string prefix(l.name);
      put_latency(top, prefix.substr(0, prefix.size() - std::string("_seconds").size()), s.*(l.member), pb.*(l.member));
    }

    for (size_t k = 0; k < deployments_.size(); ++k) {
      Columns& c = by_deployment[k];
      put_engine(c, [&](const StatsSample& x) -> const EngineStats& { return dep(x, k).engine; },
                 dep(live, k).engine.num_draft_tokens > 0);
      put_latency(c, "queue_time", dep(s, k).queue_time, dep(pb, k).queue_time);
      put_latency(c, "ttft", dep(s, k).ttft, dep(pb, k).ttft);
      put_latency(c, "tpot", dep(s, k).tpot, dep(pb, k).tpot);
      c.put("cache_hit_rate", delta_ratio(cache_count(s, &deployments_[k].name, "hit", nullptr),
                                          cache_count(pb, &deployments_[k].name, "hit", nullptr),
                                          cache_count(s, &deployments_[k].name, "", nullptr),
                                          cache_count(pb, &deployments_[k].name, "", nullptr)));
    }
    for (const auto& [key, a] : live.arms) {
      Columns& c = by_arm[key];
      const ArmSample& x = arm_of(s, key);
      const ArmSample& xb = arm_of(pb, key);
      c.put("requests_per_s", per_s(x.requests, xb.requests));
      c.put("misroutes", has_prev ? static_cast<double>(x.misroutes - xb.misroutes) : kNaN);
      c.put("share", has_prev ? delta_ratio(x.requests, xb.requests, routed_total(s, key.first), routed_total(pb, key.first))
                              : kNaN);
      put_latency(c, "queue", x.queue_time, xb.queue_time);
      put_latency(c, "ttft", x.ttft, xb.ttft);
      put_latency(c, "tpot", x.tpot, xb.tpot);
    }
    if (!live.cache.empty()) {
      const uint64_t lookups = cache_count(s, nullptr, "", nullptr), lookups_b = cache_count(pb, nullptr, "", nullptr);
      cache.put("lookups_per_s", per_s(lookups, lookups_b));
      cache.put("misses_per_s", per_s(cache_count(s, nullptr, "miss", nullptr), cache_count(pb, nullptr, "miss", nullptr)));
      cache.put("hit_rate", has_prev ? delta_ratio(cache_count(s, nullptr, "hit", nullptr),
                                                   cache_count(pb, nullptr, "hit", nullptr), lookups, lookups_b)
                                     : kNaN);
      for (const std::string& tier : tiers) {
        const uint64_t hits = cache_count(s, nullptr, "hit", &tier), hits_b = cache_count(pb, nullptr, "hit", &tier);
        by_tier[tier].put("hits_per_s", per_s(hits, hits_b));
        by_tier[tier].put("hit_rate", has_prev ? delta_ratio(hits, hits_b, lookups, lookups_b) : kNaN);
      }
    }
  }

  // The series go after the rest, as text: 4 significant digits, no per-number JSON objects.
  std::string body = j.dump(-1, ' ', false, json::error_handler_t::replace);
  body.pop_back();  // '}'
  body += ",\"series\":";
  top.append_to(&body);
  body += ",\"deployment_series\":{";
  for (size_t k = 0; k < deployments_.size(); ++k) {
    if (k) body += ',';
    body += json(deployments_[k].name).dump() + ":";
    by_deployment[k].append_to(&body);
  }
  body += "},\"router_series\":{";
  bool first_router = true;
  for (auto it = by_arm.begin(); it != by_arm.end();) {
    const std::string& router = it->first.first;
    if (!first_router) body += ',';
    first_router = false;
    body += json(router).dump();
    body += ":{";
    for (bool first_arm = true; it != by_arm.end() && it->first.first == router; ++it, first_arm = false) {
      if (!first_arm) body += ',';
      body += json(it->first.second).dump();
      body += ':';
      it->second.append_to(&body);
    }
    body += '}';
  }
  body += "},\"cache_series\":";
  cache.append_to(&body);
  body.pop_back();
  body += std::string(live.cache.empty() ? "" : ",") + "\"tiers\":{";
  for (auto it = by_tier.begin(); it != by_tier.end(); ++it) {
    if (it != by_tier.begin()) body += ',';
    body += json(it->first).dump() + ":";
    it->second.append_to(&body);
  }
  body += "}}}";
  return body;
}

HttpResponse StatsRecorder::respond(std::string_view target) const {
  StatsQuery query;
  query.window_s = options_.interval_s * static_cast<double>(options_.capacity - 1);
  // A positive number of seconds, or a 400 naming the parameter.
  auto seconds = [&](const char* name, double* out) -> std::optional<HttpResponse> {
    const std::string v = query_param(target, name);
    if (v.empty()) return std::nullopt;
    char* end = nullptr;
    const double x = std::strtod(v.c_str(), &end);
    if (end == v.c_str() || *end != '\0' || !(x > 0) || !std::isfinite(x))
      return make_error_response(http::status::bad_request,
                                 std::string(name) + ": expected a positive number of seconds, got \"" + v + "\"",
                                 "invalid_request_error", name);
    *out = x;
    return std::nullopt;
  };
  if (auto error = seconds("window", &query.window_s)) return std::move(*error);
  for (const auto& [param, histogram] : kTargetParams) {
    double t = 0;
    if (auto error = seconds(param, &t)) return std::move(*error);
    if (t > 0) query.targets[histogram] = t;
  }
  const std::string r = query_param(target, "roofline");
  query.roofline = r == "1" || r == "true";
  auto res = make_json_response(http::status::ok, render(query));
  res.set(http::field::cache_control, "no-store");
  return res;
}

}  // namespace tessera::server
