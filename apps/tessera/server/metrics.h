// Server metrics in the Prometheus text exposition format (version 0.0.4): HTTP requests by
// endpoint and status, per-request latency histograms (queue time, TTFT, TPOT, inter-token
// latency, end-to-end), token counters, and the engine's gauges (batch size, KV blocks,
// preemptions, prefix-cache hit rate) read from EngineStats when scraped.
//
// Thread-safety: one thread (the server's io thread) records and renders.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "tessera/engine.h"

namespace tessera::server {

class Histogram {
 public:
  explicit Histogram(std::vector<double> upper_bounds);
  void observe(double value);
  // Appends `name_bucket{le=...}`, `name_sum` and `name_count` lines; `labels` (e.g.
  // `deployment="small"`) go before `le` on every line.
  void render(const std::string& name, std::string* out, const std::string& labels = {}) const;
  uint64_t count() const { return count_; }
  // Read by the stats endpoint (stats.h), so it reports the numbers /metrics does.
  const std::vector<double>& bounds() const { return bounds_; }
  const std::vector<uint64_t>& bucket_counts() const { return counts_; }
  double sum() const { return sum_; }

 private:
  std::vector<double> bounds_;
  std::vector<uint64_t> counts_;  // per bucket, not cumulative; the last is +Inf
  double sum_ = 0;
  uint64_t count_ = 0;
};

class ServerMetrics {
 public:
  ServerMetrics();
  void count_request(const std::string& endpoint, int status);
  // One finished sample (choice) of a generation request.
  void observe_sequence(const RequestTimings& timings, int32_t num_output_tokens);
  void count_tokens(int64_t prompt_tokens, int64_t output_tokens);
  void set_in_flight(int64_t n) { in_flight_ = n; }
  void count_rejected_full_queue() { ++rejected_full_queue_; }
  void count_cancelled_by_client() { ++cancelled_by_client_; }

  // The gateway's view, by deployment (label deployment=) and by router arm (router=, arm=):
  // model-served sequences' latencies, cache answers by result and tier, routed requests.
  void observe_deployment(const std::string& deployment, const RequestTimings& timings);
  void count_cache(const std::string& deployment, const std::string& result, const std::string& tier);
  void count_route(const std::string& router, const std::string& arm);
  void observe_arm(const std::string& router, const std::string& arm, const RequestTimings& timings);
  // How long a router took to choose (with the prompt's embedding when the router needs one).
  void observe_route_decision(const std::string& router, double seconds);
  // A client's verdict on a routed response (POST /v1/route_feedback): `misroute` when it named
  // another deployment than the arm that answered.
  void count_route_feedback(const std::string& router, const std::string& arm, bool misroute);

  std::string render(const EngineStats& engine) const;
  // Each deployment's engine gauges, labelled deployment= (render() has the first's unlabelled).
  static void render_deployment_engines(const std::vector<std::pair<std::string, EngineStats>>& engines,
                                        std::string* out);

  // Read by the stats endpoint (stats.h).
  const Histogram& queue_time() const { return queue_time_; }
  const Histogram& ttft() const { return ttft_; }
  const Histogram& tpot() const { return tpot_; }
  const Histogram& itl() const { return itl_; }
  const Histogram& e2e() const { return e2e_; }
  uint64_t prompt_tokens() const { return prompt_tokens_; }
  uint64_t generation_tokens() const { return generation_tokens_; }
  int64_t in_flight() const { return in_flight_; }
  uint64_t rejected_full_queue() const { return rejected_full_queue_; }
  uint64_t cancelled_by_client() const { return cancelled_by_client_; }

  struct Latencies {
    Latencies();
    Histogram queue_time, ttft, tpot;
  };
  const std::map<std::string, Latencies>& deployment_latencies() const { return by_deployment_; }
  const std::map<std::pair<std::string, std::string>, Latencies>& arm_latencies() const { return by_arm_; }
  const std::map<std::pair<std::string, std::string>, uint64_t>& routed() const { return routed_; }
  const std::map<std::string, Histogram>& route_decisions() const { return route_decision_; }
  struct RouteFeedback {
    uint64_t total = 0;      // feedback on responses this arm answered
    uint64_t misroutes = 0;  // of which named another deployment
  };
  const std::map<std::pair<std::string, std::string>, RouteFeedback>& route_feedback() const {
    return route_feedback_;
  }
  const std::map<std::tuple<std::string, std::string, std::string>, uint64_t>& cache_requests() const {
    return cache_;
  }

 private:
  std::map<std::pair<std::string, int>, uint64_t> requests_;
  Histogram queue_time_, ttft_, tpot_, itl_, e2e_, output_tokens_;
  uint64_t prompt_tokens_ = 0;
  uint64_t generation_tokens_ = 0;
  int64_t in_flight_ = 0;
  uint64_t rejected_full_queue_ = 0;
  uint64_t cancelled_by_client_ = 0;
  std::map<std::string, Latencies> by_deployment_;
  std::map<std::pair<std::string, std::string>, Latencies> by_arm_;      // (router, arm)
  std::map<std::pair<std::string, std::string>, uint64_t> routed_;       // (router, arm)
  std::map<std::string, Histogram> route_decision_;                      // by router
  std::map<std::pair<std::string, std::string>, RouteFeedback> route_feedback_;  // (router, arm)
  std::map<std::tuple<std::string, std::string, std::string>, uint64_t> cache_;  // (deployment, result, tier)
};

}  // namespace tessera::server
