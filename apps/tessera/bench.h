// `tessera bench`: the pieces its subcommands share. Statistics over repeated rounds, this
// machine's limits (DRAM read bandwidth, FP32 FMA peak), workload files, a workload runner
// over an in-process engine, and the report writers (terminal table, JSON, HTML with SVG).
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "tessera/config.h"
#include "tessera/engine.h"

namespace tessera::cli::bench {

// ---- statistics -------------------------------------------------------------------------

// Order statistics with linear interpolation between closest ranks (numpy's default), so
// p50 <= p90 <= p99 always holds.
struct Summary {
  size_t n = 0;
  double mean = 0, stdev = 0, min = 0, max = 0, p50 = 0, p90 = 0, p99 = 0;
};
Summary summarize(std::vector<double> values);
nlohmann::json summary_json(const Summary& s);
double percentile(const std::vector<double>& sorted, double q);

// Exact two-sided Mann-Whitney U test over two small samples (rounds of an A/B run):
// the probability, with no difference between A and B, of a U at least as extreme.
double mann_whitney_p(const std::vector<double>& a, const std::vector<double>& b);

// ---- machine limits ---------------------------------------------------------------------

struct MachineLimits {
  int threads = 0;
  double read_bandwidth_bytes_s = 0;  // streaming read of a buffer much larger than the LLC
  double fma_peak_flop_s = 0;         // FP32 fused multiply-adds on registers, 2 flop each
  size_t bandwidth_buffer_bytes = 0;
};
MachineLimits measure_machine_limits(int threads);
nlohmann::json limits_json(const MachineLimits& m);

// What one decode token reads and computes: every matmul weight once (plus the output
// projection), 2 flop per weight element.
struct ModelCost {
  double weight_bytes_per_token = 0;
  double matmul_params = 0;
};
ModelCost model_cost(const Model& model);

// ---- workloads --------------------------------------------------------------------------

struct WorkloadRequest {
  std::string id;
  std::string prompt;               // text (what `serve` sends)
  std::vector<TokenId> prompt_ids;  // when present, the engine runs these exactly
  int32_t max_tokens = 16;          // generated exactly (ignore_eos)
  double arrival_s = 0;             // after the start of the run
  std::string tag;                  // optional group, metrics are also reported per tag
};
using Workload = std::vector<WorkloadRequest>;

Workload read_workload(const std::string& path);
void write_workload(const Workload& w, const std::string& path);
// Tokenizes text-only prompts; sorts by arrival time.
void prepare_workload(Workload* w, const Tokenizer& tok);

struct WorkloadSpec {
  std::string kind;  // mixed | shared-prefix | uniform-output | long-prompt-interference
  int num_requests = 32;
  double rate = 0;   // Poisson arrivals per second; 0: all at t = 0
  uint64_t seed = 1;
  // Fixed spacing of arrivals for the kinds that stagger them without a rate
  // (shared-prefix: 1 s, long-prompt-interference: 2 s between long prompts); 0: default.
  double interval = 0;
};
Workload make_workload(const WorkloadSpec& spec, const Tokenizer& tok);
// Exactly `num_tokens` ids of word-like English text (no BOS), deterministic in `seed`.
std::vector<TokenId> text_like_tokens(const Tokenizer& tok, int num_tokens, uint64_t seed);

// ---- running a workload through an engine -----------------------------------------------

struct RequestRecord {
  std::string id, tag;
  int32_t prompt_tokens = 0;
  int32_t cached_prompt_tokens = 0;
  int32_t requested_tokens = 0;
  int32_t output_tokens = 0;
  std::string finish_reason;
  std::string error;
  double intended_arrival = 0;  // engine clock
  double ttft = 0, tpot = 0, e2e = 0, queue = 0;
  std::vector<double> itl;
};

struct RunResult {
  std::vector<RequestRecord> requests;
  double makespan_s = 0;      // first arrival to last finish
  int32_t peak_running = 0;
  double mean_running = 0;    // over engine steps
  int32_t peak_waiting = 0;
  int32_t peak_kv_blocks_used = 0;
  int32_t kv_blocks_total = 0;
  int64_t peak_slots_reserved = 0;
  double kv_block_bytes = 0;
  double mean_kv_waste = 0;   // over steps with sequences live: 1 - filled / reserved slots
  uint64_t steps = 0, preemptions = 0;
  int64_t prefix_hit_tokens = 0, prefix_query_tokens = 0;
  // Speculative decoding (EngineStats): verifications, draft tokens verified, accepted.
  uint64_t spec_drafts = 0, spec_draft_tokens = 0, spec_accepted_tokens = 0;
};

using ProgressFn = std::function<void(size_t done, size_t total)>;
// Submits each request at its arrival time to an engine running its own step loop (the way
// a server drives it), and samples EngineStats after every step.
// `kv_block_bytes`: bytes of one KV block of the stack (see kv_block_bytes()).
RunResult run_workload(Engine& engine, const Workload& w, double kv_block_bytes,
                       const ProgressFn& progress);
// Flat name -> value metrics of a run (throughput, latency percentiles, memory), the unit
// that `ab` compares. Per-tag latency metrics are named "<tag>.itl_p99_ms" etc.
nlohmann::json run_metrics(const RunResult& r);
nlohmann::json run_json(const RunResult& r, bool with_requests);
// Bytes of one KV block of a stack: token slots per block (the paged cache's block_size;
// a contiguous region holds the whole context) times the bytes of a slot (all layers, K and
// V, in the configured dtype).
double kv_block_bytes(const StackConfig& config, const Engine& engine);

// +1 when a larger value of the metric is better (tokens/s, sequences in flight), -1 when
// worse (latencies, waste, preemptions), 0 when it only describes the run (counts, sizes).
int metric_direction(const std::string& metric);

// Step times of `batch` greedy sequences decoding together (ignore_eos, `prompt_tokens`-token
// text prompts from `seed`, each under `constraint` when not null): the engine is stepped on
// this thread and only steps that were one pure decode batch are timed, `steps` of them; the
// requests are cancelled after. Throws CommandError naming `command` when the batch never
// forms. Used by `roofline` and `constrained`.
struct DecodeSteps {
  std::vector<double> step_ms;
  double constraint_seconds = 0;  // EngineStats::constraint_seconds over the timed steps
  uint64_t masked_rows = 0;
  double prepare_seconds = 0;  // EngineStats::constraint_prepare_seconds (beside the forward)
  uint64_t prepared_masks = 0;
};
DecodeSteps time_decode_steps(Engine& engine, const Tokenizer& tok, int batch, int steps, int prompt_tokens,
                              uint64_t seed, const std::shared_ptr<const CompiledConstraint>& constraint,
                              const std::string& command);

// ---- reports ----------------------------------------------------------------------------

void print_table(const std::vector<std::string>& header,
                 const std::vector<std::vector<std::string>>& rows);
std::string fmt(double v, int precision = 2);

struct Series {
  std::string name;
  std::vector<double> x, y;
};
// Line chart with points; log2 x axis when asked (batch sizes).
std::string svg_line_chart(const std::string& title, const std::string& x_label,
                           const std::string& y_label, const std::vector<Series>& series,
                           bool log2_x = false);
struct Bar {
  std::string label;
  double value = 0, low = 0, high = 0;  // low/high: error bar (the spread over rounds)
};
std::string svg_bar_chart(const std::string& title, const std::string& y_label,
                          const std::vector<Bar>& bars, double reference_line = 0);
// Writes a self-contained HTML page: a heading, then each section (already HTML).
void write_html(const std::string& path, const std::string& title,
                const std::vector<std::string>& sections);
std::string html_table(const std::vector<std::string>& header,
                       const std::vector<std::vector<std::string>>& rows);
std::string html_escape(const std::string& s);
void write_json(const std::string& path, const nlohmann::json& j);
// Writes a whole report or workload file atomically (never half-written: a full disk leaves
// the destination as it was); throws CommandError naming the path and the reason.
void write_report_file(const std::string& path, const std::string& contents);

}  // namespace tessera::cli::bench
