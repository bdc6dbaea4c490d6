// tessera bench: latency (pp/tg at batch 1), offline (a workload through the engine),
// ab (two stacks on one workload, interleaved), roofline (decode step time vs batch size),
// serve (against an OpenAI-compatible server, see bench_serve.cpp), make-workload.
// Tables and a progress bar go to stderr; --json and --html write machine and human reports.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <thread>

#include "bench.h"
#include "commands.h"
#include "stack_loader.h"
#include "tessera/tokenizer.h"

namespace tessera::cli {
namespace bench {
void add_serve_subcommand(CLI::App& bench);        // bench_serve.cpp
void add_constrained_subcommand(CLI::App& bench);  // bench_constrained.cpp
}  // namespace bench

namespace {
using namespace bench;

struct ReportOptions {
  std::string json_path, html_path;
  void add_to(CLI::App& cmd) {
    cmd.add_option("--json", json_path, "write the results as JSON to FILE");
    cmd.add_option("--html", html_path, "write an HTML report with SVG plots to FILE");
  }
};

int model_threads(const LoadedStack& s) {
  const int t = s.config.model.threads;
  return t > 0 ? t : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

// ---- latency ----------------------------------------------------------------------------

struct LatencyOptions {
  std::string config;
  int prompt_tokens = 512;
  int gen_tokens = 128;
  int repetitions = 3;
  ReportOptions report;
};

// Runs one request alone through the engine on this thread and returns its timings.
RequestTimings run_alone(Engine& engine, std::vector<TokenId> prompt, int max_tokens) {
  GenerationRequest req;
  req.prompt = std::move(prompt);
  req.params.temperature = 0;
  req.params.max_tokens = max_tokens;
  req.params.ignore_eos = true;
  RequestTimings timings;
  std::string error;
  req.on_event = [&](const GenerationEvent& ev) {
    if (!ev.finished) return;
    timings = *ev.timings;
    if (!ev.error.is_ok()) error = ev.error.message();
  };
  uint64_t id = 0;
  Status st = engine.submit(std::move(req), &id);
  if (!st.is_ok()) throw CommandError("bench: " + st.message());
  engine.run_until_idle();
  if (!error.empty()) throw CommandError("bench: " + error);
  return timings;
}

void run_latency(const LatencyOptions& opt) {
  LoadedStack stack = load_stack(opt.config, false);
  Engine& engine = *stack.engine;
  const Tokenizer& tok = engine.model().tokenizer();
  if (opt.prompt_tokens + 1 > engine.max_context() || opt.gen_tokens + 2 > engine.max_context())
    throw CommandError("bench latency: pp/tg sizes exceed the context of " + std::to_string(engine.max_context()));
  std::fprintf(stderr, "measuring this machine's limits (%d threads)...\n", model_threads(stack));
  const MachineLimits limits = measure_machine_limits(model_threads(stack));
  const ModelCost cost = model_cost(engine.model());
  // Rooflines: decode reads every weight once per token; prefill does 2 flop per weight.
  const double tg_roofline = limits.read_bandwidth_bytes_s / cost.weight_bytes_per_token;
  const double pp_roofline = limits.fma_peak_flop_s / (2.0 * cost.matmul_params);

  // Warm-up: pages of the mapped weights, thread pool, allocator.
  run_alone(engine, text_like_tokens(tok, 32, 99), 4);
  std::vector<double> pp, tg;
  const int total = opt.repetitions * 2;
  for (int r = 0; r < opt.repetitions; ++r) {
    // pp: the prompt's forward pass (plus sampling its first token), as llama-bench's ppN.
    const RequestTimings p = run_alone(engine, text_like_tokens(tok, opt.prompt_tokens, r + 1), 1);
    pp.push_back(opt.prompt_tokens / (p.first_token - p.first_scheduled));
    print_progress("latency", 2 * r + 1, total);
    // tg: N decode steps after a one-token prompt; the prompt step is not counted.
    const RequestTimings g = run_alone(engine, text_like_tokens(tok, 1, r + 100), opt.gen_tokens + 1);
    const auto& tt = g.token_times;
    tg.push_back(opt.gen_tokens / (tt.back() - tt.front()));
    print_progress("latency", 2 * r + 2, total);
  }
  const Summary spp = summarize(pp), stg = summarize(tg);
  const std::string pp_name = "pp" + std::to_string(opt.prompt_tokens);
  const std::string tg_name = "tg" + std::to_string(opt.gen_tokens);
  std::fprintf(stderr, "\nmachine: %.1f GB/s DRAM read, %.1f GFLOP/s FP32 FMA (%d threads); model: %.1f MiB "
               "weights read per token, %.1f M matmul params\n",
               limits.read_bandwidth_bytes_s / 1e9, limits.fma_peak_flop_s / 1e9, limits.threads,
               cost.weight_bytes_per_token / 1048576.0, cost.matmul_params / 1e6);
  auto row = [](const std::string& name, const Summary& s, double roof, const char* limit) {
    return std::vector<std::string>{name, fmt(s.p50), fmt(s.min), fmt(s.max), fmt(s.stdev),
                                    fmt(roof, 1), fmt(100.0 * s.p50 / roof, 1) + "%", limit};
  };
  const std::vector<std::string> header = {"test", "t/s median", "min", "max", "stdev", "roofline t/s",
                                           "of roofline", "limit"};
  const std::vector<std::vector<std::string>> rows = {row(pp_name, spp, pp_roofline, "FMA peak"),
                                                      row(tg_name, stg, tg_roofline, "DRAM bandwidth")};
  print_table(header, rows);

  nlohmann::json j;
  j["command"] = "latency";
  j["config"] = stack.config.file;
  j["machine"] = limits_json(limits);
  j["model"] = {{"weight_bytes_per_token", cost.weight_bytes_per_token}, {"matmul_params", cost.matmul_params}};
  j["pp"] = {{"tokens", opt.prompt_tokens}, {"tokens_per_s", summary_json(spp)}, {"runs", pp},
             {"roofline_tokens_per_s", pp_roofline}, {"fraction_of_roofline", spp.p50 / pp_roofline}};
  j["tg"] = {{"tokens", opt.gen_tokens}, {"tokens_per_s", summary_json(stg)}, {"runs", tg},
             {"roofline_tokens_per_s", tg_roofline}, {"fraction_of_roofline", stg.p50 / tg_roofline}};
  if (!opt.report.json_path.empty()) write_json(opt.report.json_path, j);
  if (!opt.report.html_path.empty()) {
    std::vector<Bar> bars = {{pp_name, spp.p50 / pp_roofline, spp.min / pp_roofline, spp.max / pp_roofline},
                             {tg_name, stg.p50 / tg_roofline, stg.min / tg_roofline, stg.max / tg_roofline}};
    write_html(opt.report.html_path, "tessera bench latency",
               {"<p>" + html_escape(stack.config.file) + "</p>", html_table(header, rows),
                svg_bar_chart("fraction of this machine's limit (median, min-max)", "fraction", bars, 1.0)});
  }
}

// ---- offline ----------------------------------------------------------------------------

struct WorkloadOptions {
  std::string path;
  std::string make_kind;
  int num_requests = 32;
  double rate = 0;
  double interval = 0;
  uint64_t seed = 1;
  void add_to(CLI::App& cmd) {
    cmd.add_option("-w,--workload", path, "workload JSONL ({\"prompt\"|\"prompt_ids\", \"max_tokens\", \"arrival_s\", \"tag\"})");
    cmd.add_option("--make", make_kind, "generate the workload instead: mixed, shared-prefix, uniform-output, long-prompt-interference");
    cmd.add_option("-n,--num-requests", num_requests, "requests to generate with --make")->capture_default_str();
    cmd.add_option("--rate", rate, "Poisson arrivals per second with --make (0: all at once)")->capture_default_str();
    cmd.add_option("--interval", interval, "fixed seconds between arrivals with --make shared-prefix / long-prompt-interference")
        ->capture_default_str();
    cmd.add_option("--seed", seed, "generator seed")->capture_default_str();
  }
  Workload load(const Tokenizer& tok) const {
    if (path.empty() == make_kind.empty()) throw CommandError("bench: give exactly one of --workload FILE or --make KIND");
    Workload w = path.empty() ? make_workload({make_kind, num_requests, rate, seed, interval}, tok) : read_workload(path);
    prepare_workload(&w, tok);
    return w;
  }
};

struct OfflineOptions {
  std::string config;
  WorkloadOptions workload;
  ReportOptions report;
};

RunResult run_once(LoadedStack& stack, const Workload& w, const char* label) {
  const double block = kv_block_bytes(stack.config, *stack.engine);
  return run_workload(*stack.engine, w, block, [label](size_t d, size_t t) { print_progress(label, d, t); });
}

std::vector<std::vector<std::string>> metric_rows(const nlohmann::json& m) {
  std::vector<std::vector<std::string>> rows;
  for (const auto& [k, v] : m.items()) rows.push_back({k, fmt(v.get<double>(), 3)});
  return rows;
}

// The sorted values of one latency against their percentile: a CDF line.
Series cdf_series(const std::string& name, std::vector<double> ms) {
  std::sort(ms.begin(), ms.end());
  Series s{name, {}, {}};
  for (size_t i = 0; i < ms.size(); ++i) {
    s.x.push_back(ms[i]);
    s.y.push_back(static_cast<double>(i + 1) / ms.size());
  }
  return s;
}

void run_offline(const OfflineOptions& opt) {
  LoadedStack stack = load_stack(opt.config, false);
  const Workload w = opt.workload.load(stack.engine->model().tokenizer());
  const RunResult r = run_once(stack, w, "requests");
  nlohmann::json j = run_json(r, true);
  j["command"] = "offline";
  j["config"] = stack.config.file;
  const auto rows = metric_rows(j["metrics"]);
  print_table({"metric", "value"}, rows);
  if (!opt.report.json_path.empty()) write_json(opt.report.json_path, j);
  if (!opt.report.html_path.empty()) {
    std::vector<double> ttft, itl;
    for (const auto& q : r.requests) {
      ttft.push_back(q.ttft * 1e3);
      for (double x : q.itl) itl.push_back(x * 1e3);
    }
    write_html(opt.report.html_path, "tessera bench offline",
               {"<p>" + html_escape(stack.config.file) + "</p>", html_table({"metric", "value"}, rows),
                svg_line_chart("TTFT distribution", "TTFT ms", "fraction of requests", {cdf_series("TTFT", ttft)}),
                svg_line_chart("inter-token latency distribution", "ITL ms", "fraction of tokens",
                               {cdf_series("ITL", itl)})});
  }
}

// ---- ab ---------------------------------------------------------------------------------

struct AbOptions {
  std::string config_a, config_b;
  int rounds = 3;
  WorkloadOptions workload;
  ReportOptions report;
};

// The metrics shown in the table (all of them go to JSON): throughput, latency, memory.
bool shown_in_ab_table(const std::string& k) {
  static const char* kShown[] = {"output_tokens_per_s", "requests_per_s", "ttft_p50_ms", "ttft_p99_ms",
                                 "tpot_p50_ms", "itl_p50_ms", "itl_p99_ms", "peak_running", "mean_running",
                                 "mean_kv_waste", "peak_kv_used_mib", "kv_pool_mib", "prefix_hit_rate", "preemptions",
                                 "spec_acceptance_rate", "spec_mean_acceptance_length"};
  const auto dot = k.find('.');
  const std::string base = dot == std::string::npos ? k : k.substr(dot + 1);
  if (dot != std::string::npos) return base == "ttft_p50_ms" || base == "itl_p99_ms" || base == "tpot_p50_ms";
  return std::find(std::begin(kShown), std::end(kShown), base) != std::end(kShown);
}

void run_ab(const AbOptions& opt) {
  std::vector<nlohmann::json> metrics_a, metrics_b;
  std::string file_a, file_b;
  for (int r = 0; r < opt.rounds; ++r) {
    // A fresh engine per run: no prefix cache, KV state or warm scheduler carries over from
    // one run to the next, so the rounds are independent samples.
    for (int side = 0; side < 2; ++side) {
      LoadedStack stack = load_stack(side == 0 ? opt.config_a : opt.config_b, /*quiet=*/true);
      (side == 0 ? file_a : file_b) = stack.config.file;
      const Workload w = opt.workload.load(stack.engine->model().tokenizer());
      const std::string label = std::string("round ") + std::to_string(r + 1) + "/" +
                                std::to_string(opt.rounds) + (side == 0 ? " A" : " B");
      const RunResult res = run_once(stack, w, label.c_str());
      (side == 0 ? metrics_a : metrics_b).push_back(run_metrics(res));
    }
  }
  nlohmann::json j;
  j["command"] = "ab";
  j["a"] = file_a;
  j["b"] = file_b;
  j["rounds"] = opt.rounds;
  j["metrics"] = nlohmann::json::object();
  std::vector<std::vector<std::string>> rows;
  std::vector<Bar> bars;
  for (const auto& [name, unused] : metrics_a.front().items()) {
    std::vector<double> a, b, ratios;
    for (int r = 0; r < opt.rounds; ++r) {
      a.push_back(metrics_a[r][name].get<double>());
      b.push_back(metrics_b[r].value(name, 0.0));
      if (b.back() != 0) ratios.push_back(a.back() / b.back());
    }
    const Summary sa = summarize(a), sb = summarize(b), sr = summarize(ratios);
    const double ratio = sb.p50 != 0 ? sa.p50 / sb.p50 : 0;
    const double p = mann_whitney_p(a, b);
    // A verdict only when every round of one side beats every round of the other (the
    // ranges do not overlap); otherwise the difference is within the noise of this run.
    // One round has no spread to compare against: no verdict at all.
    std::string verdict = opt.rounds < 2 ? "no verdict (1 round)" : "no significant difference";
    const bool a_higher = sa.min > sb.max, b_higher = sb.min > sa.max;
    const int direction = metric_direction(name);
    if (opt.rounds >= 2 && (a_higher || b_higher)) {
      const bool a_better = a_higher == (direction > 0);
      verdict = direction == 0 ? std::string(a_higher ? "A higher" : "B higher")
                               : std::string(a_better ? "A better" : "B better");
      if (sb.p50 != 0) verdict += " (" + fmt(ratio, 2) + "x)";
    }
    // No ratio against a zero (e.g. prefix hits of a stack without prefix caching).
    const nlohmann::json ratio_json = sb.p50 != 0 ? nlohmann::json(ratio) : nlohmann::json(nullptr);
    j["metrics"][name] = {{"a", summary_json(sa)}, {"b", summary_json(sb)}, {"a_rounds", a}, {"b_rounds", b},
                          {"ratio_a_over_b", ratio_json}, {"ratio_rounds", summary_json(sr)},
                          {"mann_whitney_p", p}, {"direction", direction},
                          {"verdict", verdict}};
    if (!shown_in_ab_table(name)) continue;
    rows.push_back({name, fmt(sa.p50, 3) + " [" + fmt(sa.min, 3) + ", " + fmt(sa.max, 3) + "]",
                    fmt(sb.p50, 3) + " [" + fmt(sb.min, 3) + ", " + fmt(sb.max, 3) + "]",
                    sb.p50 != 0 ? fmt(ratio, 3) : "-",
                    "[" + fmt(sr.min, 3) + ", " + fmt(sr.max, 3) + "]", fmt(p, 3), verdict});
    if (sb.p50 != 0) bars.push_back({name, ratio, sr.min, sr.max});
  }
  std::fprintf(stderr, "A = %s\nB = %s\n%d rounds, interleaved A B; values: median [min, max]\n",
               file_a.c_str(), file_b.c_str(), opt.rounds);
  const std::vector<std::string> header = {"metric", "A", "B", "A/B", "A/B per round", "MW p", "verdict"};
  print_table(header, rows);
  if (!opt.report.json_path.empty()) write_json(opt.report.json_path, j);
  if (!opt.report.html_path.empty())
    write_html(opt.report.html_path, "tessera bench ab",
               {"<p>A = " + html_escape(file_a) + "<br>B = " + html_escape(file_b) + "<br>" +
                    std::to_string(opt.rounds) + " rounds, interleaved</p>",
                html_table(header, rows),
                svg_bar_chart("A/B ratio of medians (bars: min-max of per-round ratios; dashed: 1)", "A / B",
                              bars, 1.0)});
}

}  // namespace

// Submit B short prompts that generate long enough, skip the steps that carry prompt tokens,
// time `steps` pure decode steps, then cancel.
bench::DecodeSteps bench::time_decode_steps(Engine& engine, const Tokenizer& tok, int batch, int steps,
                                            int prompt_tokens, uint64_t seed,
                                            const std::shared_ptr<const CompiledConstraint>& constraint,
                                            const std::string& command) {
  std::vector<uint64_t> ids;
  for (int i = 0; i < batch; ++i) {
    GenerationRequest req;
    req.prompt = text_like_tokens(tok, prompt_tokens, seed + static_cast<uint64_t>(i));
    req.params.temperature = 0;
    req.params.max_tokens = steps + 16;  // more than the steps timed: nobody finishes early
    req.params.ignore_eos = true;
    req.constraint = constraint;
    req.on_event = [](const GenerationEvent&) {};
    uint64_t id = 0;
    Status st = engine.submit(std::move(req), &id);
    if (!st.is_ok()) throw CommandError(command + ": " + st.message());
    ids.push_back(id);
  }
  DecodeSteps d;
  for (int guard = 0; static_cast<int>(d.step_ms.size()) < steps && guard < steps + 64; ++guard) {
    const EngineStats before = engine.stats();
    const auto t0 = std::chrono::steady_clock::now();
    engine.step();
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    const EngineStats s = engine.stats();
    if (s.last_batch_size == batch && s.last_batch_tokens == batch) {
      d.step_ms.push_back(ms);
      d.constraint_seconds += s.constraint_seconds - before.constraint_seconds;
      d.masked_rows += s.num_masked_rows - before.num_masked_rows;
      d.prepare_seconds += s.constraint_prepare_seconds - before.constraint_prepare_seconds;
      d.prepared_masks += s.num_prepared_masks - before.num_prepared_masks;
    }
  }
  for (uint64_t id : ids) engine.cancel(id);
  engine.run_until_idle();
  if (d.step_ms.empty())
    throw CommandError(command + ": batch " + std::to_string(batch) +
                       " never ran as one decode batch (scheduler max_num_seqs or KV memory too small?)");
  return d;
}

namespace {

// ---- roofline ---------------------------------------------------------------------------

struct RooflineOptions {
  std::string config;
  int max_batch = 64;
  int steps = 8;
  double threshold = 1.25;
  ReportOptions report;
};

struct BatchPoint {
  int batch = 0;
  Summary step_ms;
  double tokens_per_s = 0;
};

// Step times of B sequences all decoding (time_decode_steps).
BatchPoint measure_batch(Engine& engine, const Tokenizer& tok, int batch, int steps) {
  const DecodeSteps d = time_decode_steps(engine, tok, batch, steps, 8, 1000, nullptr, "bench roofline");
  BatchPoint p;
  p.batch = batch;
  p.step_ms = summarize(d.step_ms);
  p.tokens_per_s = batch / (p.step_ms.p50 / 1e3);
  return p;
}

void run_roofline(const RooflineOptions& opt) {
  LoadedStack stack = load_stack(opt.config, false);
  Engine& engine = *stack.engine;
  const Tokenizer& tok = engine.model().tokenizer();
  const int max_seqs = static_cast<int>(stack.config.engine.at(PluginKind::kScheduler).config.get_int("max_num_seqs", 1));
  std::fprintf(stderr, "measuring this machine's limits (%d threads)...\n", model_threads(stack));
  const MachineLimits limits = measure_machine_limits(model_threads(stack));
  const ModelCost cost = model_cost(engine.model());
  const double step_floor_ms = cost.weight_bytes_per_token / limits.read_bandwidth_bytes_s * 1e3;
  const double compute_tps = limits.fma_peak_flop_s / (2.0 * cost.matmul_params);
  // Where reading the weights once per step stops being the larger cost than the FLOPs.
  const double ridge_batch = compute_tps * step_floor_ms / 1e3;

  run_alone(engine, text_like_tokens(tok, 8, 7), 4);  // warm-up
  std::vector<int> batches;
  for (int b = 1; b <= opt.max_batch; b *= 2) {
    if (b > max_seqs) {
      std::fprintf(stderr, "batch %d skipped: the stack's scheduler runs at most %d sequences\n", b, max_seqs);
      break;
    }
    batches.push_back(b);
  }
  std::vector<BatchPoint> points;
  for (size_t i = 0; i < batches.size(); ++i) {
    points.push_back(measure_batch(engine, tok, batches[i], opt.steps));
    print_progress("roofline", i + 1, batches.size());
  }
  // The knee: the first batch whose step takes materially longer than a batch-1 step, i.e.
  // where adding a sequence stops being nearly free because the step is no longer dominated
  // by reading the weights.
  const double base = points.front().step_ms.p50;
  int knee = 0;
  for (const auto& p : points)
    if (p.step_ms.p50 > opt.threshold * base) { knee = p.batch; break; }
  std::vector<std::vector<std::string>> rows;
  for (const auto& p : points) {
    const double bw_roof = p.batch * 1e3 / step_floor_ms;
    rows.push_back({std::to_string(p.batch), fmt(p.step_ms.p50), fmt(p.step_ms.min), fmt(p.step_ms.max),
                    fmt(p.step_ms.p50 / base, 2), fmt(p.tokens_per_s, 1), fmt(std::min(bw_roof, compute_tps), 1)});
  }
  std::fprintf(stderr, "\nmachine: %.1f GB/s DRAM read, %.1f GFLOP/s FP32 FMA; weights %.1f MiB/token -> "
               "memory-bound step floor %.2f ms, compute limit %.0f t/s, ridge at batch %.1f\n",
               limits.read_bandwidth_bytes_s / 1e9, limits.fma_peak_flop_s / 1e9,
               cost.weight_bytes_per_token / 1048576.0, step_floor_ms, compute_tps, ridge_batch);
  const std::vector<std::string> header = {"batch", "step ms median", "min", "max", "vs batch 1",
                                           "decode t/s", "roofline t/s"};
  print_table(header, rows);
  const std::string verdict =
      knee ? "decode step time exceeds " + fmt(opt.threshold, 2) + "x the batch-1 step from batch " +
                 std::to_string(knee) + " on: memory-bound up to batch " + std::to_string(knee / 2)
           : "decode step time stays within " + fmt(opt.threshold, 2) + "x the batch-1 step up to batch " +
                 std::to_string(points.back().batch);
  std::fprintf(stderr, "%s\n", verdict.c_str());

  nlohmann::json j;
  j["command"] = "roofline";
  j["config"] = stack.config.file;
  j["machine"] = limits_json(limits);
  j["model"] = {{"weight_bytes_per_token", cost.weight_bytes_per_token}, {"matmul_params", cost.matmul_params}};
  j["memory_bound_step_floor_ms"] = step_floor_ms;
  j["compute_limit_tokens_per_s"] = compute_tps;
  j["ridge_batch"] = ridge_batch;
  j["threshold"] = opt.threshold;
  j["knee_batch"] = knee;  // 0: none within the batches measured
  j["memory_bound_up_to_batch"] = knee ? knee / 2 : points.back().batch;
  j["verdict"] = verdict;
  j["points"] = nlohmann::json::array();
  for (const auto& p : points)
    j["points"].push_back({{"batch", p.batch}, {"step_ms", summary_json(p.step_ms)}, {"tokens_per_s", p.tokens_per_s},
                           {"roofline_tokens_per_s", std::min(p.batch * 1e3 / step_floor_ms, compute_tps)}});
  if (!opt.report.json_path.empty()) write_json(opt.report.json_path, j);
  if (!opt.report.html_path.empty()) {
    Series measured{"measured decode t/s", {}, {}}, roof{"roofline min(B x BW/bytes, FMA peak/2P)", {}, {}};
    Series step{"step ms", {}, {}}, floor{"memory-bound floor ms", {}, {}};
    for (const auto& p : points) {
      measured.x.push_back(p.batch); measured.y.push_back(p.tokens_per_s);
      roof.x.push_back(p.batch); roof.y.push_back(std::min(p.batch * 1e3 / step_floor_ms, compute_tps));
      step.x.push_back(p.batch); step.y.push_back(p.step_ms.p50);
      floor.x.push_back(p.batch); floor.y.push_back(step_floor_ms);
    }
    write_html(opt.report.html_path, "tessera bench roofline",
               {"<p>" + html_escape(stack.config.file) + "</p><p>" + html_escape(verdict) + "</p>",
                html_table(header, rows),
                svg_line_chart("decode throughput vs batch", "batch size", "tokens/s", {measured, roof}, true),
                svg_line_chart("decode step time vs batch", "batch size", "ms per step", {step, floor}, true)});
  }
}

// ---- make-workload ----------------------------------------------------------------------

struct MakeWorkloadOptions {
  std::string config, output;
  WorkloadSpec spec;
};

void run_make_workload(const MakeWorkloadOptions& opt) {
  // Only the tokenizer is needed, but it comes with the model.
  LoadedStack stack = load_stack(opt.config, true);
  const Workload w = make_workload(opt.spec, stack.engine->model().tokenizer());
  write_workload(w, opt.output);
  int64_t in = 0, out = 0;
  for (const auto& r : w) { in += static_cast<int64_t>(r.prompt_ids.size()); out += r.max_tokens; }
  std::fprintf(stderr, "%zu requests, %lld prompt tokens, %lld output tokens -> %s\n", w.size(),
               static_cast<long long>(in), static_cast<long long>(out), opt.output.c_str());
}

}  // namespace

void add_bench_command(CLI::App& app) {
  CLI::App* bench = app.add_subcommand("bench", "benchmark stacks: latency, offline, ab, roofline, serve");
  bench->require_subcommand(1);

  auto lat = std::make_shared<LatencyOptions>();
  CLI::App* cl = bench->add_subcommand("latency", "batch-1 prompt processing (ppN) and generation (tgN)");
  cl->add_option("-c,--config", lat->config, "stack YAML (default: configs/smollm2-cpu.yaml)");
  cl->add_option("-p,--prompt-tokens", lat->prompt_tokens, "N of ppN")->capture_default_str()->check(CLI::PositiveNumber);
  cl->add_option("-g,--gen-tokens", lat->gen_tokens, "N of tgN")->capture_default_str()->check(CLI::Range(2, 1 << 20));
  cl->add_option("-r,--repetitions", lat->repetitions, "repetitions of each test")->capture_default_str()->check(CLI::PositiveNumber);
  lat->report.add_to(*cl);
  cl->callback([lat] { run_latency(*lat); });

  auto off = std::make_shared<OfflineOptions>();
  CLI::App* co = bench->add_subcommand("offline", "a workload through the engine: throughput, latency, KV use");
  co->add_option("-c,--config", off->config, "stack YAML (default: configs/smollm2-cpu.yaml)");
  off->workload.add_to(*co);
  off->report.add_to(*co);
  co->callback([off] { run_offline(*off); });

  auto ab = std::make_shared<AbOptions>();
  CLI::App* ca = bench->add_subcommand("ab", "one workload on two stacks, interleaved A B A B, with verdicts");
  ca->add_option("a", ab->config_a, "stack A YAML")->required();
  ca->add_option("b", ab->config_b, "stack B YAML")->required();
  ca->add_option("-r,--rounds", ab->rounds, "rounds (each runs A then B)")->capture_default_str()->check(CLI::PositiveNumber);
  ab->workload.add_to(*ca);
  ab->report.add_to(*ca);
  ca->callback([ab] { run_ab(*ab); });

  auto roof = std::make_shared<RooflineOptions>();
  CLI::App* cr = bench->add_subcommand("roofline", "decode step time at batch 1, 2, 4, ... and where it stops being memory-bound");
  cr->add_option("-c,--config", roof->config, "stack YAML (its scheduler's max_num_seqs caps the batch)");
  cr->add_option("--max-batch", roof->max_batch, "largest batch")->capture_default_str()->check(CLI::PositiveNumber);
  cr->add_option("--steps", roof->steps, "decode steps timed per batch size")->capture_default_str()->check(CLI::PositiveNumber);
  cr->add_option("--threshold", roof->threshold, "step time / batch-1 step time that ends the memory-bound region")
      ->capture_default_str();
  roof->report.add_to(*cr);
  cr->callback([roof] { run_roofline(*roof); });

  auto mk = std::make_shared<MakeWorkloadOptions>();
  CLI::App* cm = bench->add_subcommand("make-workload", "write a workload JSONL");
  cm->add_option("-c,--config", mk->config, "stack YAML whose model's tokenizer sizes the prompts");
  cm->add_option("-k,--kind", mk->spec.kind, "mixed, shared-prefix, uniform-output, long-prompt-interference")->required();
  cm->add_option("-n,--num-requests", mk->spec.num_requests)->capture_default_str();
  cm->add_option("--rate", mk->spec.rate, "Poisson arrivals per second (0: the kind's default timing)")->capture_default_str();
  cm->add_option("--seed", mk->spec.seed)->capture_default_str();
  cm->add_option("--interval", mk->spec.interval, "fixed seconds between arrivals (shared-prefix, long-prompt-interference)")
      ->capture_default_str();
  cm->add_option("-o,--output", mk->output, "output JSONL")->required();
  cm->callback([mk] { run_make_workload(*mk); });

  bench::add_serve_subcommand(*bench);
  bench::add_constrained_subcommand(*bench);
}

}  // namespace tessera::cli
