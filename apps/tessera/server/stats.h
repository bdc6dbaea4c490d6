// `GET /v1/stats`: the numbers /metrics reports, as JSON, plus a bounded history of them.
//
// A StatsRecorder samples ServerMetrics and Engine::stats() (the two objects /metrics renders
// from) once per interval into a fixed ring (default 900 one-second samples: 15 minutes).
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
#include <string>
#include <string_view>
#include <vector>

#include "http_server.h"
#include "metrics.h"
#include "tessera/engine.h"

namespace tessera::server {

struct HistogramSnapshot {
  std::vector<uint64_t> counts;  // per bucket, not cumulative; the last is +Inf
  double sum = 0;
  uint64_t count = 0;
};

// Everything one stats sample holds, read from the objects /metrics renders.
struct StatsSample {
  double time = 0;  // unix seconds
  EngineStats engine;
  int64_t in_flight = 0;
  uint64_t prompt_tokens = 0;
  uint64_t generation_tokens = 0;
  uint64_t rejected_full_queue = 0;
  uint64_t cancelled_by_client = 0;
  HistogramSnapshot queue_time, ttft, tpot, itl, e2e;
};

StatsSample take_stats_sample(const ServerMetrics& metrics, const EngineStats& engine, double unix_time);

// The q-quantile (0 < q <= 1) of the observations between `earlier` and `later` (earlier may
// be null: since start), interpolated linearly inside the bucket that holds it, as
// Prometheus' histogram_quantile does: 0 is the lower edge of the first bucket, and a rank
// in the +Inf bucket returns the largest finite bound. NaN when nothing was observed.
double histogram_quantile(double q, const std::vector<double>& bounds, const HistogramSnapshot& later,
                          const HistogramSnapshot* earlier);

struct StatsOptions {
  double interval_s = 1;         // sampling period
  int capacity = 900;            // samples kept (capacity x interval = the longest window)
  std::string roofline_report;   // `tessera bench roofline --json` output; empty: none
};

class StatsRecorder {
 public:
  static constexpr int kMaxPoints = 180;  // per series, whatever the window

  StatsRecorder(boost::asio::any_io_executor executor, const Engine& engine, const ServerMetrics& metrics,
                std::string model_id, StatsOptions options);
  // Takes the first sample now and one every interval until stop().
  void start();
  void stop();
  void sample_now();

  // The /v1/stats body. `window_s` is clamped to [interval, capacity x interval].
  std::string render(double window_s, bool include_roofline) const;
  // Answers `GET /v1/stats[?window=SECONDS][&roofline=1]`.
  HttpResponse respond(std::string_view target) const;

 private:
  void schedule();
  const StatsSample& at(size_t i) const;  // 0 = oldest kept
  nlohmann::json roofline() const;

  const Engine& engine_;
  const ServerMetrics& metrics_;
  std::string model_id_;
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
