#include "metrics.h"

#include <algorithm>
#include <cstdio>
#include <string>

namespace tessera::server {

namespace {

std::string number(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.9g", v);
  return buf;
}

void header(std::string* out, const char* name, const char* type, const char* help) {
  *out += std::string("# HELP ") + name + " " + help + "\n# TYPE " + name + " " + type + "\n";
}

void sample(std::string* out, const std::string& name, double value) {
  *out += name + " " + number(value) + "\n";
}

// Latency buckets in seconds, from sub-millisecond decode steps on a GPU to minutes in a
// saturated CPU queue.
std::vector<double> latency_buckets() {
  return {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
          1,     2.5,    5,     10,   20,    30,   60,   120,   300};
}

}  // namespace

Histogram::Histogram(std::vector<double> upper_bounds)
    : bounds_(std::move(upper_bounds)), counts_(bounds_.size() + 1, 0) {}

void Histogram::observe(double value) {
  const size_t i = std::lower_bound(bounds_.begin(), bounds_.end(), value) - bounds_.begin();
  ++counts_[i];
  sum_ += value;
  ++count_;
}

void Histogram::render(const std::string& name, std::string* out, const std::string& labels) const {
  const std::string pre = labels.empty() ? "" : labels + ",";
  const std::string own = labels.empty() ? "" : "{" + labels + "}";
  uint64_t cumulative = 0;
  for (size_t i = 0; i < bounds_.size(); ++i) {
    cumulative += counts_[i];
    *out += name + "_bucket{" + pre + "le=\"" + number(bounds_[i]) + "\"} " + std::to_string(cumulative) + "\n";
  }
  *out += name + "_bucket{" + pre + "le=\"+Inf\"} " + std::to_string(count_) + "\n";
  sample(out, name + "_sum" + own, sum_);
  *out += name + "_count" + own + " " + std::to_string(count_) + "\n";
}

ServerMetrics::Latencies::Latencies()
    : queue_time(latency_buckets()), ttft(latency_buckets()), tpot(latency_buckets()) {}

namespace {
void observe_latencies(ServerMetrics::Latencies& l, const RequestTimings& t) {
  if (t.first_scheduled >= 0) l.queue_time.observe(t.queue_time());
  if (t.first_token >= 0) l.ttft.observe(t.ttft());
  if (t.token_times.size() > 1) l.tpot.observe(t.tpot());
}
std::string label(const char* name, const std::string& value) {
  std::string out = std::string(name) + "=\"";
  for (char c : value) {
    if (c == '\n') {
      out += "\\n";
      continue;
    }
    if (c == '\\' || c == '"') out += '\\';
    out += c;
  }
  return out + "\"";
}
}  // namespace

void ServerMetrics::render_deployment_engines(const std::vector<std::pair<std::string, EngineStats>>& engines,
                                              std::string* out) {
  if (engines.empty()) return;
  struct Gauge {
    const char* name;
    const char* type;
    const char* help;
    double (*value)(const EngineStats&);
  };
  static const Gauge kGauges[] = {
      {"tessera_deployment_engine_steps_total", "counter", "Engine steps, by deployment.",
       [](const EngineStats& e) { return static_cast<double>(e.num_steps); }},
      {"tessera_deployment_running_sequences", "gauge", "Sequences running, by deployment.",
       [](const EngineStats& e) { return static_cast<double>(e.num_running); }},
      {"tessera_deployment_waiting_sequences", "gauge", "Sequences waiting to be scheduled, by deployment.",
       [](const EngineStats& e) { return static_cast<double>(e.num_waiting); }},
      {"tessera_deployment_kv_blocks_used", "gauge", "KV blocks referenced by live sequences, by deployment.",
       [](const EngineStats& e) { return static_cast<double>(e.kv.num_used_blocks); }},
      {"tessera_deployment_kv_blocks_total", "gauge", "KV blocks in the pool, by deployment.",
       [](const EngineStats& e) { return static_cast<double>(e.kv.num_blocks); }},
      {"tessera_deployment_kv_blocks_cached", "gauge", "Unreferenced KV blocks kept for prefix reuse, by deployment.",
       [](const EngineStats& e) { return static_cast<double>(e.kv.num_cached_blocks); }},
      {"tessera_deployment_engine_batch_size", "gauge", "Sequences in the last engine step, by deployment.",
       [](const EngineStats& e) { return static_cast<double>(e.last_batch_size); }},
      {"tessera_deployment_engine_preemptions_total", "counter", "Sequences preempted for lack of KV blocks, by deployment.",
       [](const EngineStats& e) { return static_cast<double>(e.num_preemptions); }},
      {"tessera_deployment_prefix_cache_query_tokens_total", "counter",
       "Prompt tokens looked up in the prefix cache, by deployment.",
       [](const EngineStats& e) { return static_cast<double>(e.kv.prefix_query_tokens); }},
      {"tessera_deployment_prefix_cache_hit_tokens_total", "counter", "Prompt tokens found in the prefix cache, by deployment.",
       [](const EngineStats& e) { return static_cast<double>(e.kv.prefix_hit_tokens); }},
      {"tessera_deployment_spec_decode_num_draft_tokens_total", "counter", "Draft tokens verified, by deployment.",
       [](const EngineStats& e) { return static_cast<double>(e.num_draft_tokens); }},
      {"tessera_deployment_spec_decode_num_accepted_tokens_total", "counter", "Draft tokens accepted, by deployment.",
       [](const EngineStats& e) { return static_cast<double>(e.num_accepted_draft_tokens); }},
  };
  for (const Gauge& g : kGauges) {
    header(out, g.name, g.type, g.help);
    for (const auto& [name, stats] : engines)
      sample(out, std::string(g.name) + "{" + label("deployment", name) + "}", g.value(stats));
  }
}

void ServerMetrics::observe_deployment(const std::string& deployment, const RequestTimings& t) {
  observe_latencies(by_deployment_[deployment], t);
}
void ServerMetrics::count_cache(const std::string& deployment, const std::string& result, const std::string& tier) {
  ++cache_[{deployment, result, tier}];
}
void ServerMetrics::count_route(const std::string& router, const std::string& arm) { ++routed_[{router, arm}]; }
void ServerMetrics::observe_arm(const std::string& router, const std::string& arm, const RequestTimings& t) {
  observe_latencies(by_arm_[{router, arm}], t);
}
void ServerMetrics::count_route_feedback(const std::string& router, const std::string& arm, bool misroute) {
  RouteFeedback& f = route_feedback_[{router, arm}];
  ++f.total;
  if (misroute) ++f.misroutes;
}
void ServerMetrics::observe_route_decision(const std::string& router, double seconds) {
  // From a hash (microseconds) to an embedding forward on a loaded CPU (tens of milliseconds).
  auto it = route_decision_.find(router);
  if (it == route_decision_.end())
    it = route_decision_.emplace(router, Histogram({1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0}))
             .first;
  it->second.observe(seconds);
}

ServerMetrics::ServerMetrics()
    : queue_time_(latency_buckets()), ttft_(latency_buckets()), tpot_(latency_buckets()),
      itl_(latency_buckets()), e2e_(latency_buckets()),
      output_tokens_({1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096}) {}

void ServerMetrics::count_request(const std::string& endpoint, int status) { ++requests_[{endpoint, status}]; }

void ServerMetrics::observe_sequence(const RequestTimings& t, int32_t num_output_tokens) {
  if (t.first_scheduled >= 0) queue_time_.observe(t.queue_time());
  if (t.first_token >= 0) ttft_.observe(t.ttft());
  if (t.token_times.size() > 1) tpot_.observe(t.tpot());
  for (double d : t.inter_token_latencies()) itl_.observe(d);
  if (t.finished >= 0) e2e_.observe(t.end_to_end());
  output_tokens_.observe(num_output_tokens);
}

void ServerMetrics::count_tokens(int64_t prompt_tokens, int64_t output_tokens) {
  prompt_tokens_ += static_cast<uint64_t>(prompt_tokens);
  generation_tokens_ += static_cast<uint64_t>(output_tokens);
}

std::string ServerMetrics::render(const EngineStats& e) const {
  std::string out;
  header(&out, "tessera_http_requests_total", "counter", "HTTP requests answered, by endpoint and status code.");
  for (const auto& [key, n] : requests_)
    out += "tessera_http_requests_total{endpoint=\"" + key.first + "\",status=\"" + std::to_string(key.second) +
           "\"} " + std::to_string(n) + "\n";
  header(&out, "tessera_requests_in_flight", "gauge", "Generation requests admitted and not yet finished.");
  sample(&out, "tessera_requests_in_flight", static_cast<double>(in_flight_));
  header(&out, "tessera_requests_rejected_queue_full_total", "counter",
         "Generation requests refused with 429 because max_queued_requests were in flight.");
  sample(&out, "tessera_requests_rejected_queue_full_total", static_cast<double>(rejected_full_queue_));
  header(&out, "tessera_requests_cancelled_by_client_total", "counter",
         "Generation requests cancelled because the client disconnected.");
  sample(&out, "tessera_requests_cancelled_by_client_total", static_cast<double>(cancelled_by_client_));

  header(&out, "tessera_prompt_tokens_total", "counter", "Prompt tokens of admitted requests.");
  sample(&out, "tessera_prompt_tokens_total", static_cast<double>(prompt_tokens_));
  header(&out, "tessera_generation_tokens_total", "counter", "Tokens generated.");
  sample(&out, "tessera_generation_tokens_total", static_cast<double>(generation_tokens_));

  header(&out, "tessera_queue_time_seconds", "histogram", "Arrival to first scheduled step, per sequence.");
  queue_time_.render("tessera_queue_time_seconds", &out);
  header(&out, "tessera_time_to_first_token_seconds", "histogram",
         "Arrival to first generated token (includes the first decode step), per sequence.");
  ttft_.render("tessera_time_to_first_token_seconds", &out);
  header(&out, "tessera_time_per_output_token_seconds", "histogram",
         "Mean time per output token after the first, per sequence.");
  tpot_.render("tessera_time_per_output_token_seconds", &out);
  header(&out, "tessera_inter_token_latency_seconds", "histogram", "Time between consecutive generated tokens.");
  itl_.render("tessera_inter_token_latency_seconds", &out);
  header(&out, "tessera_e2e_request_latency_seconds", "histogram", "Arrival to finish, per sequence.");
  e2e_.render("tessera_e2e_request_latency_seconds", &out);
  header(&out, "tessera_output_tokens_per_sequence", "histogram", "Generated tokens per sequence.");
  output_tokens_.render("tessera_output_tokens_per_sequence", &out);

  // The gateway: per deployment, per cache result, per router arm. A family is written only
  // once it has a sample (a parser refuses a HELP/TYPE without one).
  if (!by_deployment_.empty()) {
    header(&out, "tessera_deployment_queue_time_seconds", "histogram",
           "Arrival to first scheduled step, per model-served sequence, by deployment.");
    for (const auto& [d, l] : by_deployment_)
      l.queue_time.render("tessera_deployment_queue_time_seconds", &out, label("deployment", d));
    header(&out, "tessera_deployment_time_to_first_token_seconds", "histogram",
           "Arrival to first generated token, per model-served sequence, by deployment.");
    for (const auto& [d, l] : by_deployment_)
      l.ttft.render("tessera_deployment_time_to_first_token_seconds", &out, label("deployment", d));
    header(&out, "tessera_deployment_time_per_output_token_seconds", "histogram",
           "Mean time per output token after the first, per model-served sequence, by deployment.");
    for (const auto& [d, l] : by_deployment_)
      l.tpot.render("tessera_deployment_time_per_output_token_seconds", &out, label("deployment", d));
  }
  if (!cache_.empty()) {
    header(&out, "tessera_cache_requests_total", "counter",
           "Generation requests the cache layers looked up, by deployment, result (hit, miss) and tier.");
    for (const auto& [k, n] : cache_)
      out += "tessera_cache_requests_total{" + label("deployment", std::get<0>(k)) + "," +
             label("result", std::get<1>(k)) + "," + label("tier", std::get<2>(k)) + "} " + std::to_string(n) + "\n";
  }
  if (!routed_.empty()) {
    header(&out, "tessera_router_requests_total", "counter", "Requests a router sent to each arm (deployment).");
    for (const auto& [k, n] : routed_)
      out += "tessera_router_requests_total{" + label("router", k.first) + "," + label("arm", k.second) + "} " +
             std::to_string(n) + "\n";
  }
  if (!route_feedback_.empty()) {
    header(&out, "tessera_router_feedback_total", "counter",
           "Client feedback on routed responses (POST /v1/route_feedback), by router, the arm that answered, "
           "and verdict (right: the feedback named that arm; misroute: another deployment).");
    for (const auto& [k, f] : route_feedback_)
      for (const auto& [verdict, n] : {std::pair<const char*, uint64_t>{"right", f.total - f.misroutes},
                                       std::pair<const char*, uint64_t>{"misroute", f.misroutes}})
        out += "tessera_router_feedback_total{" + label("router", k.first) + "," + label("arm", k.second) + "," +
               label("verdict", verdict) + "} " + std::to_string(n) + "\n";
  }
  if (!route_decision_.empty()) {
    header(&out, "tessera_router_decision_seconds", "histogram",
           "Time a router took to choose a deployment, including the prompt's embedding when it needs one.");
    for (const auto& [r, h] : route_decision_) h.render("tessera_router_decision_seconds", &out, label("router", r));
  }
  if (!by_arm_.empty()) {
    header(&out, "tessera_router_queue_time_seconds", "histogram",
           "Arrival to first scheduled step of model-served sequences, by router and arm.");
    for (const auto& [k, l] : by_arm_)
      l.queue_time.render("tessera_router_queue_time_seconds", &out,
                          label("router", k.first) + "," + label("arm", k.second));
    header(&out, "tessera_router_time_to_first_token_seconds", "histogram",
           "Arrival to first generated token of model-served sequences, by router and arm.");
    for (const auto& [k, l] : by_arm_)
      l.ttft.render("tessera_router_time_to_first_token_seconds", &out,
                    label("router", k.first) + "," + label("arm", k.second));
    header(&out, "tessera_router_time_per_output_token_seconds", "histogram",
           "Mean time per output token after the first, by router and arm.");
    for (const auto& [k, l] : by_arm_)
      l.tpot.render("tessera_router_time_per_output_token_seconds", &out,
                    label("router", k.first) + "," + label("arm", k.second));
  }

  header(&out, "tessera_engine_steps_total", "counter", "Engine steps (forward passes).");
  sample(&out, "tessera_engine_steps_total", static_cast<double>(e.num_steps));
  header(&out, "tessera_engine_batch_tokens_total", "counter", "Tokens fed to the model, all steps.");
  sample(&out, "tessera_engine_batch_tokens_total", static_cast<double>(e.num_batch_tokens));
  header(&out, "tessera_engine_batch_size", "gauge", "Sequences in the last engine step.");
  sample(&out, "tessera_engine_batch_size", e.last_batch_size);
  // Not "tessera_engine_batch_tokens": with the counter above it would parse as one family.
  header(&out, "tessera_engine_last_batch_tokens", "gauge", "Tokens in the last engine step.");
  sample(&out, "tessera_engine_last_batch_tokens", e.last_batch_tokens);
  header(&out, "tessera_engine_mean_batch_tokens", "gauge", "Tokens per step, averaged over all steps.");
  sample(&out, "tessera_engine_mean_batch_tokens",
         e.num_steps ? static_cast<double>(e.num_batch_tokens) / static_cast<double>(e.num_steps) : 0.0);
  header(&out, "tessera_engine_running_sequences", "gauge", "Sequences running.");
  sample(&out, "tessera_engine_running_sequences", e.num_running);
  header(&out, "tessera_engine_waiting_sequences", "gauge", "Sequences waiting to be scheduled.");
  sample(&out, "tessera_engine_waiting_sequences", e.num_waiting);
  header(&out, "tessera_engine_preemptions_total", "counter", "Sequences preempted for lack of KV blocks.");
  sample(&out, "tessera_engine_preemptions_total", static_cast<double>(e.num_preemptions));
  header(&out, "tessera_engine_finished_sequences_total", "counter", "Sequences finished (any reason).");
  sample(&out, "tessera_engine_finished_sequences_total", static_cast<double>(e.num_finished));

  header(&out, "tessera_kv_blocks_total", "gauge", "KV cache blocks in the pool.");
  sample(&out, "tessera_kv_blocks_total", e.kv.num_blocks);
  header(&out, "tessera_kv_blocks_used", "gauge", "KV cache blocks referenced by live sequences.");
  sample(&out, "tessera_kv_blocks_used", e.kv.num_used_blocks);
  header(&out, "tessera_kv_blocks_cached", "gauge", "Unreferenced KV blocks kept for prefix reuse (evictable).");
  sample(&out, "tessera_kv_blocks_cached", e.kv.num_cached_blocks);
  header(&out, "tessera_kv_slots_reserved", "gauge", "KV token slots held by live sequences.");
  sample(&out, "tessera_kv_slots_reserved", static_cast<double>(e.kv.num_slots_reserved));
  header(&out, "tessera_prefix_cache_query_tokens_total", "counter", "Prompt tokens looked up in the prefix cache.");
  sample(&out, "tessera_prefix_cache_query_tokens_total", static_cast<double>(e.kv.prefix_query_tokens));
  header(&out, "tessera_prefix_cache_hit_tokens_total", "counter", "Prompt tokens found in the prefix cache.");
  sample(&out, "tessera_prefix_cache_hit_tokens_total", static_cast<double>(e.kv.prefix_hit_tokens));
  header(&out, "tessera_prefix_cache_hit_rate", "gauge", "Prefix-cache hit tokens / query tokens since start.");
  sample(&out, "tessera_prefix_cache_hit_rate",
         e.kv.prefix_query_tokens
             ? static_cast<double>(e.kv.prefix_hit_tokens) / static_cast<double>(e.kv.prefix_query_tokens)
             : 0.0);
  // Speculative decoding, with vLLM's spec_decode_* names.
  header(&out, "tessera_spec_decode_num_drafts_total", "counter", "Sequence-steps that verified draft tokens.");
  sample(&out, "tessera_spec_decode_num_drafts_total", static_cast<double>(e.num_drafts));
  header(&out, "tessera_spec_decode_num_draft_tokens_total", "counter", "Draft tokens verified.");
  sample(&out, "tessera_spec_decode_num_draft_tokens_total", static_cast<double>(e.num_draft_tokens));
  header(&out, "tessera_spec_decode_num_accepted_tokens_total", "counter", "Draft tokens accepted.");
  sample(&out, "tessera_spec_decode_num_accepted_tokens_total", static_cast<double>(e.num_accepted_draft_tokens));
  // Position i can only count once position i-1 has, so the list stops at the first zero;
  // position 0 is always there, so the family has a sample (0) before any draft.
  header(&out, "tessera_spec_decode_num_accepted_tokens_per_pos_total", "counter",
         "Verifications that accepted the draft at this position (0-based).");
  for (size_t i = 0; i < e.num_accepted_tokens_per_pos.size() && (i == 0 || e.num_accepted_tokens_per_pos[i] > 0); ++i)
    sample(&out, "tessera_spec_decode_num_accepted_tokens_per_pos_total{position=\"" + std::to_string(i) + "\"}",
           static_cast<double>(e.num_accepted_tokens_per_pos[i]));
  header(&out, "tessera_spec_decode_mean_acceptance_length", "gauge",
         "Tokens produced per verification: 1 + accepted drafts / verifications.");
  sample(&out, "tessera_spec_decode_mean_acceptance_length",
         e.num_drafts ? 1.0 + static_cast<double>(e.num_accepted_draft_tokens) / static_cast<double>(e.num_drafts) : 0.0);
  header(&out, "tessera_spec_decode_draft_seconds_total", "counter", "Time spent proposing drafts.");
  sample(&out, "tessera_spec_decode_draft_seconds_total", e.draft_seconds);
  header(&out, "tessera_spec_decode_verify_seconds_total", "counter",
         "Forward and sampling time of the steps that verified drafts.");
  sample(&out, "tessera_spec_decode_verify_seconds_total", e.verify_seconds);
  header(&out, "tessera_spec_decode_skipped_total", "counter",
         "Sequence-steps the adaptive control gave no drafts (verification would cost more than it saves).");
  sample(&out, "tessera_spec_decode_skipped_total", static_cast<double>(e.num_draft_skips));
  header(&out, "tessera_spec_decode_auto_off", "gauge",
         "1 when the adaptive control gave no sequence drafts in the last drafting step.");
  sample(&out, "tessera_spec_decode_auto_off", e.speculation_off ? 1.0 : 0.0);
  header(&out, "tessera_engine_step_errors_total", "counter",
         "Steps ended by a plugin error (their requests failed, the engine went on).");
  sample(&out, "tessera_engine_step_errors_total", static_cast<double>(e.num_step_errors));
  return out;
}

}  // namespace tessera::server
