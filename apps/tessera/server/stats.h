// `GET /v1/stats`: the numbers /metrics reports, as JSON, plus a bounded history of them.
//
// A StatsRecorder samples ServerMetrics and every deployment's Engine::stats() (the objects
// /metrics renders from) once per interval into a fixed ring (default 900 one-second samples:
// 15 minutes).
// A stats request renders the live values ("current"), a summary over the requested window
// ("window": rates, percentiles from histogram bucket deltas, the way Prometheus'
// histogram_quantile computes them) and the window's time series ("series", at most
// kMaxPoints points, columnar). docs/server.md documents every field.
//
// Threading: like ServerMetrics, everything runs on the server's io thread (the sampling
// timer too).
#pragma once

#include <boost/asio/any_io_executor.hpp>
#include <boost/asio/steady_timer.hpp>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <tuple>
#include <string_view>
#include <vector>

#include "http_server.h"
#include "metrics.h"
#include "tessera/engine.h"
#include "tessera/sdk/cache_layer.h"

namespace tessera::server {

struct HistogramSnapshot {
  std::vector<uint64_t> counts;  // per bucket, not cumulative; the last is +Inf
  double sum = 0;
  uint64_t count = 0;
};

// One deployment's part of a sample: its engine and the gateway's histograms labelled
// deployment= (model-served sequences only).
struct DeploymentSample {
  EngineStats engine;
  HistogramSnapshot queue_time, ttft, tpot;
};

// One router arm's part: requests routed to it, and its model-served latencies.
struct ArmSample {
  uint64_t requests = 0;
  uint64_t feedback = 0, misroutes = 0;  // tessera_router_feedback_total (all, misroute)
  HistogramSnapshot queue_time, ttft, tpot;
};

// Everything one stats sample holds, read from the objects /metrics renders.
struct StatsSample {
  double time = 0;  // unix seconds
  EngineStats engine;  // the first (default) deployment's, as the unlabelled /metrics families
  std::vector<DeploymentSample> deployments;  // in StatsRecorder's deployment order
  std::map<std::pair<std::string, std::string>, ArmSample> arms;  // (router, arm)
  // Cache-chain lookups (deployment, result, tier): tessera_cache_requests_total.
  std::map<std::tuple<std::string, std::string, std::string>, uint64_t> cache;
  // Routing decision latency by router (tessera_router_decision_seconds).
  std::map<std::string, HistogramSnapshot> route_decision;
  // The gateway plugins' own samples (Gateway::collect_plugin_metrics): semantic hits by
  // similarity bucket, a router's held-out figures.
  std::vector<CacheMetric> plugins;
  int64_t in_flight = 0;
  uint64_t prompt_tokens = 0;
  uint64_t generation_tokens = 0;
  uint64_t rejected_full_queue = 0;
  uint64_t cancelled_by_client = 0;
  HistogramSnapshot queue_time, ttft, tpot, itl, e2e;
};

// A deployment the recorder follows: its served name, its engine, and its drafter plugin
// (empty: none), which names its speculative-acceptance line.
struct StatsDeployment {
  std::string name;
  const Engine* engine = nullptr;
  std::string drafter;
};

// `engines` in the order of the deployments (the first is the default one).
StatsSample take_stats_sample(const ServerMetrics& metrics, const std::vector<std::string>& deployments,
                              const std::vector<EngineStats>& engines, double unix_time);

// The q-quantile (0 < q <= 1) of the observations between `earlier` and `later` (earlier may
// be null: since start), interpolated linearly inside the bucket that holds it, as
// Prometheus' histogram_quantile does: 0 is the lower edge of the first bucket, and a rank
// in the +Inf bucket returns the largest finite bound. NaN when nothing was observed.
double histogram_quantile(double q, const std::vector<double>& bounds, const HistogramSnapshot& later,
                          const HistogramSnapshot* earlier);

// The fraction (0..1) of the observations between `earlier` and `later` at most `x`,
// interpolated linearly inside the bucket holding x as histogram_quantile is (its inverse);
// NaN when nothing was observed. x past the largest bound counts every finite bucket only.
double histogram_fraction_at_most(double x, const std::vector<double>& bounds, const HistogramSnapshot& later,
                                  const HistogramSnapshot* earlier);

// What a /v1/stats request asks for: the window, the roofline, and latency targets (by
// histogram name, e.g. "queue_time_seconds"; seconds) to report the share within.
struct StatsQuery {
  double window_s = 0;  // clamped to [interval, capacity x interval]; NaN/inf: all kept
  bool roofline = false;
  std::map<std::string, double> targets;
};

struct StatsOptions {
  double interval_s = 1;         // sampling period
  int capacity = 900;            // samples kept (capacity x interval = the longest window)
  std::string roofline_report;   // `tessera bench roofline --json` output; empty: none
  // Reads the gateway plugins' metrics into a sample (on the io thread); empty: none.
  std::function<void(std::vector<CacheMetric>*)> plugin_metrics;
};

class StatsRecorder {
 public:
  static constexpr int kMaxPoints = 180;  // per series, whatever the window

  // `deployments` must not be empty; the first is the default (its name is `model`).
  StatsRecorder(boost::asio::any_io_executor executor, std::vector<StatsDeployment> deployments,
                const ServerMetrics& metrics, StatsOptions options);
  // Takes the first sample now and one every interval until stop().
  void start();
  void stop();
  void sample_now();

  // The /v1/stats body.
  std::string render(const StatsQuery& query) const;
  // Answers `GET /v1/stats[?window=SECONDS][&roofline=1][&slo_queue=S&slo_ttft=S&slo_tpot=S&slo_itl=S]`.
  HttpResponse respond(std::string_view target) const;

 private:
  void schedule();
  const StatsSample& at(size_t i) const;  // 0 = oldest kept
  StatsSample take() const;
  nlohmann::json roofline() const;

  std::vector<StatsDeployment> deployments_;
  std::vector<std::string> names_;
  const ServerMetrics& metrics_;
  StatsOptions options_;
  double started_ = 0;
  boost::asio::steady_timer timer_;
  bool running_ = false;
  std::vector<StatsSample> ring_;
  size_t head_ = 0;  // where the next sample goes
  size_t size_ = 0;
};

// The value of `name` in the query string of `target`, percent-decoded; empty when absent.
std::string query_param(std::string_view target, std::string_view name);

}  // namespace tessera::server
