#include "stats.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <limits>

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
      {"engine",
       {{"steps_total", e.num_steps},
        {"batch_tokens_total", e.num_batch_tokens},
        {"last_batch_size", e.last_batch_size},
        {"last_batch_tokens", e.last_batch_tokens},
        {"mean_batch_tokens", e.num_steps ? static_cast<double>(e.num_batch_tokens) / static_cast<double>(e.num_steps) : 0.0},
        {"preemptions_total", e.num_preemptions}}},
      {"kv",
       {{"blocks_total", e.kv.num_blocks},
        {"blocks_used", e.kv.num_used_blocks},
        {"blocks_cached", e.kv.num_cached_blocks},
        {"blocks_free", free_blocks(e.kv)},
        {"slots_reserved", e.kv.num_slots_reserved}}},
      {"prefix_cache",
       {{"query_tokens_total", e.kv.prefix_query_tokens},
        {"hit_tokens_total", e.kv.prefix_hit_tokens},
        {"hit_rate", e.kv.prefix_query_tokens ? static_cast<double>(e.kv.prefix_hit_tokens) /
                                                    static_cast<double>(e.kv.prefix_query_tokens)
                                              : 0.0}}},
      {"latency", latency},
  };
  if (e.num_draft_tokens > 0)
    j["speculative"] = {{"draft_tokens_total", e.num_draft_tokens},
                        {"accepted_tokens_total", e.num_accepted_draft_tokens},
                        {"acceptance_rate", static_cast<double>(e.num_accepted_draft_tokens) /
                                                static_cast<double>(e.num_draft_tokens)}};
  return j;
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

StatsSample take_stats_sample(const ServerMetrics& m, const EngineStats& engine, double unix_time) {
  StatsSample s;
  s.time = unix_time;
  s.engine = engine;
  s.in_flight = m.in_flight();
  s.prompt_tokens = m.prompt_tokens();
  s.generation_tokens = m.generation_tokens();
  s.rejected_full_queue = m.rejected_full_queue();
  s.cancelled_by_client = m.cancelled_by_client();
  for (const auto& l : kLatencies) s.*(l.member) = snapshot((m.*(l.histogram))());
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

StatsRecorder::StatsRecorder(boost::asio::any_io_executor executor, const Engine& engine,
                             const ServerMetrics& metrics, std::string model_id, StatsOptions options)
    : engine_(engine), metrics_(metrics), model_id_(std::move(model_id)), options_(std::move(options)),
      started_(unix_now()), timer_(executor) {
  options_.capacity = std::max(2, options_.capacity);
  options_.interval_s = std::max(0.05, options_.interval_s);
  ring_.resize(static_cast<size_t>(options_.capacity));
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
  ring_[head_] = take_stats_sample(metrics_, engine_.stats(), unix_now());
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

std::string StatsRecorder::render(double window_s, bool include_roofline) const {
  const double now = unix_now();
  const StatsSample live = take_stats_sample(metrics_, engine_.stats(), now);
  const double interval = options_.interval_s;
  const double max_window = interval * static_cast<double>(options_.capacity - 1);
  if (!std::isfinite(window_s)) window_s = max_window;
  window_s = std::clamp(window_s, interval, max_window);

  json j;
  j["object"] = "stats";
  j["model"] = model_id_;
  j["time"] = now;
  j["uptime_s"] = now - started_;
  j["sample_interval_s"] = interval;
  j["history_s"] = max_window;
  j["window_s"] = window_s;
  j["current"] = current_json(live);
  if (include_roofline) j["roofline"] = roofline();

  // The samples of the window: [first, size_). The baseline of the window summary is its
  // oldest sample, window_s before the newest (the server's start while it is younger).
  const StatsSample* newest = size_ ? &at(size_ - 1) : &live;
  size_t first = size_;
  while (first > 0 && at(first - 1).time >= newest->time - window_s - interval * 0.5) --first;
  const StatsSample& base = first < size_ ? at(first) : live;

  // Window summary: live values against the baseline.
  {
    const double span = live.time - base.time;
    json w;
    w["span_s"] = span;
    w["output_tokens_per_s"] = number_or_null(ratio(static_cast<double>(live.generation_tokens - base.generation_tokens), span));
    w["finished_sequences"] = live.engine.num_finished - base.engine.num_finished;
    w["preemptions"] = live.engine.num_preemptions - base.engine.num_preemptions;
    w["steps"] = live.engine.num_steps - base.engine.num_steps;
    w["tokens_per_step"] = number_or_null(ratio(static_cast<double>(live.engine.num_batch_tokens - base.engine.num_batch_tokens),
                                                static_cast<double>(live.engine.num_steps - base.engine.num_steps)));
    w["prefix_cache_hit_rate"] = number_or_null(
        ratio(static_cast<double>(live.engine.kv.prefix_hit_tokens - base.engine.kv.prefix_hit_tokens),
              static_cast<double>(live.engine.kv.prefix_query_tokens - base.engine.kv.prefix_query_tokens)));
    if (live.engine.num_draft_tokens > 0)
      w["speculative_acceptance_rate"] = number_or_null(
          ratio(static_cast<double>(live.engine.num_accepted_draft_tokens - base.engine.num_accepted_draft_tokens),
                static_cast<double>(live.engine.num_draft_tokens - base.engine.num_draft_tokens)));
    json latency = json::object();
    for (const auto& l : kLatencies) {
      const HistogramSnapshot& later = live.*(l.member);
      const HistogramSnapshot& earlier = base.*(l.member);
      const auto& bounds = (metrics_.*(l.histogram))().bounds();
      const uint64_t count = later.count - earlier.count;
      json h = {{"count", count}, {"mean", number_or_null(ratio(later.sum - earlier.sum, static_cast<double>(count)))}};
      for (size_t k = 0; k < 3; ++k)
        h[kQuantileNames[k]] = number_or_null(histogram_quantile(kQuantiles[k], bounds, later, &earlier));
      latency[l.name] = std::move(h);
    }
    w["latency"] = std::move(latency);
    j["window"] = std::move(w);
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
  const bool speculative = live.engine.num_draft_tokens > 0;

  struct Column {
    std::string name;
    std::string text;
  };
  std::vector<Column> columns;
  auto column = [&](const std::string& name) -> std::string& {
    for (auto& c : columns)
      if (c.name == name) return c.text;
    columns.push_back({name, {}});
    return columns.back().text;
  };
  auto put = [&](const std::string& name, double v) {
    std::string& t = column(name);
    t += t.empty() ? "[" : ",";
    append_number(&t, v);
  };
  for (size_t idx : points) {
    const StatsSample& s = at(idx);
    const bool has_prev = idx > 0;
    const StatsSample& p = at(has_prev ? (idx >= step ? idx - step : 0) : idx);
    const size_t lo = has_prev ? (idx >= step ? idx - step + 1 : 1) : idx;  // samples in (p, s]
    const double dt = s.time - p.time;
    double running = 0, waiting = 0, in_flight = 0, batch = 0, used = 0, cached = 0, free = 0;
    for (size_t i = lo; i <= idx; ++i) {
      const StatsSample& x = at(i);
      running += x.engine.num_running;
      waiting += x.engine.num_waiting;
      in_flight += static_cast<double>(x.in_flight);
      batch += x.engine.last_batch_size;
      used += x.engine.kv.num_used_blocks;
      cached += x.engine.kv.num_cached_blocks;
      free += free_blocks(x.engine.kv);
    }
    const double n = static_cast<double>(idx - lo + 1);
    {
      char t[32];
      std::snprintf(t, sizeof t, "%.3f", s.time);
      std::string& c = column("t");
      c += c.empty() ? "[" : ",";
      c += t;
    }
    put("running", running / n);
    put("waiting", waiting / n);
    put("in_flight", in_flight / n);
    put("batch_size", batch / n);
    const double steps = static_cast<double>(s.engine.num_steps - p.engine.num_steps);
    put("tokens_per_step", ratio(static_cast<double>(s.engine.num_batch_tokens - p.engine.num_batch_tokens), steps));
    put("steps_per_s", ratio(steps, dt));
    const StatsSample& pb = at(idx >= pct_span ? idx - pct_span : 0);
    // Generated tokens are counted when their sequence finishes: over the percentile span, so
    // sequences finishing together do not draw spikes.
    put("output_tokens_per_s",
        has_prev ? ratio(static_cast<double>(s.generation_tokens - pb.generation_tokens), s.time - pb.time) : kNaN);
    put("kv_blocks_used", used / n);
    put("kv_blocks_cached", cached / n);
    put("kv_blocks_free", free / n);
    put("preemptions", has_prev ? static_cast<double>(s.engine.num_preemptions - p.engine.num_preemptions) : kNaN);
    put("prefix_cache_hit_rate",
        ratio(static_cast<double>(s.engine.kv.prefix_hit_tokens - p.engine.kv.prefix_hit_tokens),
              static_cast<double>(s.engine.kv.prefix_query_tokens - p.engine.kv.prefix_query_tokens)));
    if (speculative)
      put("speculative_acceptance_rate",
          ratio(static_cast<double>(s.engine.num_accepted_draft_tokens - p.engine.num_accepted_draft_tokens),
                static_cast<double>(s.engine.num_draft_tokens - p.engine.num_draft_tokens)));
    for (const auto& l : kLatencies) {
      if (l.member == &StatsSample::e2e) continue;
      const auto& bounds = (metrics_.*(l.histogram))().bounds();
      std::string prefix(l.name);
      prefix = prefix.substr(0, prefix.size() - std::string("_seconds").size());
      for (size_t k = 0; k < 3; ++k)
        put(prefix + "_" + kQuantileNames[k],
            has_prev ? histogram_quantile(kQuantiles[k], bounds, s.*(l.member), &(pb.*(l.member))) : kNaN);
    }
  }

  std::string body = j.dump(-1, ' ', false, json::error_handler_t::replace);
  body.pop_back();  // '}'
  body += ",\"series\":{";
  for (size_t i = 0; i < columns.size(); ++i) {
    if (i) body += ',';
    body += '"' + columns[i].name + "\":" + (columns[i].text.empty() ? "[" : columns[i].text) + ']';
  }
  body += "}}";
  return body;
}

HttpResponse StatsRecorder::respond(std::string_view target) const {
  double window = options_.interval_s * static_cast<double>(options_.capacity - 1);
  const std::string w = query_param(target, "window");
  if (!w.empty()) {
    char* end = nullptr;
    const double v = std::strtod(w.c_str(), &end);
    if (end == w.c_str() || *end != '\0' || !(v > 0))
      return make_error_response(http::status::bad_request, "window: expected a positive number of seconds, got \"" + w + "\"",
                                 "invalid_request_error", "window");
    window = v;
  }
  const std::string r = query_param(target, "roofline");
  auto res = make_json_response(http::status::ok, render(window, r == "1" || r == "true"));
  res.set(http::field::cache_control, "no-store");
  return res;
}

}  // namespace tessera::server
