// tessera bench: workload files, the workload generator, and the runner that pushes a
// workload through an in-process engine.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <fstream>
#include <mutex>
#include <random>
#include <thread>

#include "bench.h"
#include "commands.h"
#include "tessera/tokenizer.h"

namespace tessera::cli::bench {

// ---- workload files ---------------------------------------------------------------------

Workload read_workload(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw CommandError("cannot open workload '" + path + "'");
  Workload w;
  std::string line;
  int line_no = 0;
  while (std::getline(in, line)) {
    ++line_no;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string where = path + ":" + std::to_string(line_no) + ": ";
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const std::exception& e) {
      throw CommandError(where + "invalid JSON: " + e.what());
    }
    WorkloadRequest r;
    try {
      r.id = j.contains("id") ? (j["id"].is_string() ? j["id"].get<std::string>() : j["id"].dump())
                              : std::to_string(w.size());
      if (j.contains("prompt")) r.prompt = j["prompt"].get<std::string>();
      if (j.contains("prompt_ids")) r.prompt_ids = j["prompt_ids"].get<std::vector<TokenId>>();
      if (j.contains("max_tokens")) r.max_tokens = j["max_tokens"].get<int32_t>();
      if (j.contains("arrival_s")) r.arrival_s = j["arrival_s"].get<double>();
      if (j.contains("tag")) r.tag = j["tag"].get<std::string>();
    } catch (const std::exception& e) {
      throw CommandError(where + "wrong type: " + e.what());
    }
    if (r.prompt.empty() && r.prompt_ids.empty())
      throw CommandError(where + "needs \"prompt\" (text) or \"prompt_ids\" (token ids)");
    if (r.max_tokens < 1) throw CommandError(where + "\"max_tokens\" must be at least 1");
    if (r.arrival_s < 0) throw CommandError(where + "\"arrival_s\" must not be negative");
    w.push_back(std::move(r));
  }
  if (w.empty()) throw CommandError("workload '" + path + "' holds no request");
  return w;
}

void write_workload(const Workload& w, const std::string& path) {
  std::string out;
  for (const auto& r : w) {
    nlohmann::json j = {{"id", r.id}, {"prompt", r.prompt}, {"prompt_ids", r.prompt_ids},
                        {"max_tokens", r.max_tokens}, {"arrival_s", r.arrival_s}};
    if (!r.tag.empty()) j["tag"] = r.tag;
    out += j.dump() + "\n";
  }
  write_report_file(path, out);
}

void prepare_workload(Workload* w, const Tokenizer& tok) {
  for (auto& r : *w)
    if (r.prompt_ids.empty()) r.prompt_ids = tok.encode(r.prompt, /*add_special=*/true, /*parse_special=*/false);
  std::stable_sort(w->begin(), w->end(),
                   [](const WorkloadRequest& a, const WorkloadRequest& b) { return a.arrival_s < b.arrival_s; });
}

// ---- generator --------------------------------------------------------------------------

namespace {

// Ordinary English words, so prompts tokenize like text (about 1.2-1.4 tokens a word).
constexpr const char* kWords[] = {
    "the", "model", "answers", "questions", "about", "history", "science", "and", "art", "with",
    "care", "a", "short", "story", "begins", "when", "the", "river", "meets", "old", "city",
    "walls", "people", "often", "write", "letters", "to", "friends", "in", "distant", "towns",
    "explain", "why", "water", "boils", "at", "lower", "temperature", "on", "mountains",
    "summarize", "this", "report", "for", "engineers", "who", "build", "servers", "that",
    "stream", "tokens", "quickly", "every", "morning", "birds", "sing", "near", "quiet",
    "gardens", "while", "children", "play", "games", "under", "tall", "green", "trees",
    "list", "three", "reasons", "cities", "grow", "faster", "than", "villages", "during",
    "industrial", "periods", "of", "change", "translate", "following", "sentence", "into",
    "simple", "words", "describe", "how", "computer", "memory", "works", "bright", "stars",
};

class PromptMaker {
 public:
  PromptMaker(const Tokenizer& tok, uint64_t seed) : tok_(tok), rng_(seed) {}

  // Exactly `num_tokens` token ids of word-like text (no BOS).
  std::vector<TokenId> ids(int num_tokens) {
    std::uniform_int_distribution<size_t> pick(0, std::size(kWords) - 1);
    std::vector<TokenId> out;
    while (static_cast<int>(out.size()) < num_tokens) {
      std::string text;
      for (int i = 0; i < 64; ++i) { text += kWords[pick(rng_)]; text += ' '; }
      auto more = tok_.encode(text, /*add_special=*/false, /*parse_special=*/false);
      out.insert(out.end(), more.begin(), more.end());
    }
    out.resize(num_tokens);
    return out;
  }

  int uniform(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng_); }
  double exponential(double rate) { return std::exponential_distribution<double>(rate)(rng_); }

 private:
  const Tokenizer& tok_;
  std::mt19937_64 rng_;
};

WorkloadRequest make_request(const Tokenizer& tok, std::vector<TokenId> body, int max_tokens,
                             double arrival, std::string tag, size_t index) {
  WorkloadRequest r;
  r.id = std::to_string(index);
  if (tok.add_bos() && tok.bos_id() >= 0) body.insert(body.begin(), tok.bos_id());
  r.prompt = tok.decode(body, /*render_special=*/false);
  r.prompt_ids = std::move(body);
  r.max_tokens = max_tokens;
  r.arrival_s = arrival;
  r.tag = std::move(tag);
  return r;
}

}  // namespace

std::vector<TokenId> text_like_tokens(const Tokenizer& tok, int num_tokens, uint64_t seed) {
  return PromptMaker(tok, seed).ids(num_tokens);
}

Workload make_workload(const WorkloadSpec& spec, const Tokenizer& tok) {
  PromptMaker maker(tok, spec.seed);
  Workload w;
  double clock = 0;
  auto next_arrival = [&]() {
    if (spec.rate <= 0) return 0.0;
    const double t = clock;
    clock += maker.exponential(spec.rate);
    return t;
  };
  if (spec.kind == "mixed") {
    // Prompts 16-512 tokens, outputs 16-256: the spread that makes per-sequence max-context
    // reservations wasteful.
    for (int i = 0; i < spec.num_requests; ++i) {
      const int prompt = maker.uniform(16, 512), out = maker.uniform(16, 256);
      w.push_back(make_request(tok, maker.ids(prompt), out, next_arrival(), "", i));
    }
  } else if (spec.kind == "shared-prefix") {
    // One ~500-token system prompt shared by every request, then a short user turn. The first
    // request fills the prefix cache; "later" requests can reuse it.
    const std::vector<TokenId> system = maker.ids(500);
    const double gap = spec.interval > 0 ? spec.interval : 1.0;
    for (int i = 0; i < spec.num_requests; ++i) {
      std::vector<TokenId> body = system;
      auto user = maker.ids(maker.uniform(16, 64));
      body.insert(body.end(), user.begin(), user.end());
      const double arrival = spec.rate > 0 ? next_arrival() : gap * i;
      w.push_back(make_request(tok, std::move(body), 16, arrival, i == 0 ? "first" : "later", i));
    }
  } else if (spec.kind == "uniform-output") {
    // Short prompts, output lengths spread 16-256: static batching waits for the longest.
    for (int i = 0; i < spec.num_requests; ++i)
      w.push_back(make_request(tok, maker.ids(maker.uniform(16, 128)), maker.uniform(16, 256),
                               next_arrival(), "", i));
  } else if (spec.kind == "long-prompt-interference") {
    // Eight sequences start decoding at t = 0; long prompts (1000-1200 tokens) arrive while
    // they decode. The "decode" tag's inter-token latency shows the stalls long prefills cause.
    for (int i = 0; i < 8; ++i)
      w.push_back(make_request(tok, maker.ids(32), 256, 0.0, "decode", i));
    const int num_long = std::max(1, spec.num_requests - 8);
    double t = 1.0;
    for (int i = 0; i < num_long; ++i) {
      w.push_back(make_request(tok, maker.ids(maker.uniform(1000, 1200)), 16, t, "long", 8 + i));
      t += spec.rate > 0 ? maker.exponential(spec.rate) : (spec.interval > 0 ? spec.interval : 2.0);
    }
  } else {
    throw CommandError("make-workload: unknown kind '" + spec.kind +
                       "' (mixed, shared-prefix, uniform-output, long-prompt-interference)");
  }
  return w;
}

// ---- running ----------------------------------------------------------------------------

double kv_block_bytes(const StackConfig& config, const Engine& engine) {
  const auto& h = engine.model().hparams();
  KvDtypes dtypes;
  int64_t slots = engine.max_context();
  auto it = config.engine.find(PluginKind::kKvCache);
  if (it != config.engine.end()) {
    dtypes = kv_dtypes_from_config(it->second.config);
    slots = it->second.config.get_int("block_size", slots);
  }
  const KvModelShape shape{h.num_layers, h.num_kv_heads, h.head_dim, 0, 0};
  return static_cast<double>(KvLayout::block_bytes(shape, static_cast<int32_t>(slots), dtypes.k, dtypes.v));
}

RunResult run_workload(Engine& engine, const Workload& w, double block_bytes, const ProgressFn& progress) {
  RunResult result;
  result.kv_block_bytes = block_bytes;
  result.requests.resize(w.size());
  std::atomic<size_t> num_done{0};
  std::mutex records_mutex;  // records are written on the engine thread, read here at the end

  engine.start();
  const double t0 = engine.now();
  const auto wall0 = std::chrono::steady_clock::now();
  uint64_t last_step = engine.stats().num_steps;
  double running_sum = 0, waste_sum = 0;
  uint64_t samples = 0, waste_samples = 0;
  // Reads the stats the engine publishes after each step; called about every millisecond,
  // which is far shorter than a step of this model.
  auto sample = [&] {
    const EngineStats s = engine.stats();
    if (s.num_steps == last_step) return;
    last_step = s.num_steps;
    result.peak_running = std::max(result.peak_running, s.num_running);
    result.peak_waiting = std::max(result.peak_waiting, s.num_waiting);
    result.peak_kv_blocks_used = std::max(result.peak_kv_blocks_used, s.kv.num_used_blocks);
    result.peak_slots_reserved = std::max(result.peak_slots_reserved, s.kv.num_slots_reserved);
    result.kv_blocks_total = s.kv.num_blocks;
    running_sum += s.num_running;
    ++samples;
    if (s.kv.num_slots_reserved > 0) {
      waste_sum += 1.0 - static_cast<double>(s.kv.num_slots_filled) / static_cast<double>(s.kv.num_slots_reserved);
      ++waste_samples;
    }
  };
  auto wait_until = [&](double engine_time) {
    while (engine.now() < engine_time) {
      sample();
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  };

  for (size_t i = 0; i < w.size(); ++i) {
    const WorkloadRequest& wr = w[i];
    RequestRecord& rec = result.requests[i];
    rec.id = wr.id;
    rec.tag = wr.tag;
    rec.prompt_tokens = static_cast<int32_t>(wr.prompt_ids.size());
    rec.requested_tokens = wr.max_tokens;
    rec.intended_arrival = t0 + wr.arrival_s;
    wait_until(rec.intended_arrival);
    GenerationRequest req;
    req.prompt = wr.prompt_ids;
    req.params.temperature = 0;  // greedy: runs of two stacks produce the same tokens
    req.params.max_tokens = wr.max_tokens;
    req.params.ignore_eos = true;  // every request produces exactly max_tokens
    RequestRecord* rp = &rec;
    req.on_event = [rp, &num_done, &records_mutex](const GenerationEvent& ev) {
      std::lock_guard<std::mutex> lock(records_mutex);
      rp->output_tokens += static_cast<int32_t>(ev.tokens.size());
      if (!ev.finished) return;
      rp->finish_reason = finish_reason_name(ev.finish_reason);
      if (!ev.error.is_ok()) rp->error = ev.error.message();
      rp->cached_prompt_tokens = ev.num_cached_prompt_tokens;
      const RequestTimings& t = *ev.timings;
      // Latencies count from the intended arrival: a request the runner submitted late
      // (it was busy) still waited from when it should have arrived.
      const double late = t.arrival - rp->intended_arrival;
      rp->ttft = t.first_token < 0 ? 0 : t.ttft() + late;
      rp->e2e = t.finished < 0 ? 0 : t.end_to_end() + late;
      rp->queue = t.queue_time() + late;
      rp->tpot = t.tpot();
      rp->itl = t.inter_token_latencies();
      num_done.fetch_add(1);
    };
    uint64_t id = 0;
    Status st = engine.submit(std::move(req), &id);
    if (!st.is_ok()) {
      std::lock_guard<std::mutex> lock(records_mutex);
      rec.error = st.message();
      rec.finish_reason = "error";
      num_done.fetch_add(1);
    }
    if (progress) progress(num_done.load(), w.size());
  }
  size_t shown = num_done.load();
  while (num_done.load() < w.size()) {
    sample();
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    if (progress && num_done.load() != shown) { shown = num_done.load(); progress(shown, w.size()); }
  }
  engine.stop();
  sample();
  const EngineStats s = engine.stats();
  if (progress && shown != w.size()) progress(w.size(), w.size());

  std::lock_guard<std::mutex> lock(records_mutex);
  double first_arrival = 1e300, last_finish = 0;
  for (const auto& r : result.requests) {
    first_arrival = std::min(first_arrival, r.intended_arrival);
    if (r.error.empty()) last_finish = std::max(last_finish, r.intended_arrival + r.e2e);
  }
  result.makespan_s = last_finish > first_arrival
                          ? last_finish - first_arrival
                          : std::chrono::duration<double>(std::chrono::steady_clock::now() - wall0).count();
  result.mean_running = samples ? running_sum / static_cast<double>(samples) : 0;
  result.mean_kv_waste = waste_samples ? waste_sum / static_cast<double>(waste_samples) : 0;
  result.steps = s.num_steps;
  result.preemptions = s.num_preemptions;
  result.kv_blocks_total = s.kv.num_blocks;
  result.prefix_hit_tokens = s.kv.prefix_hit_tokens;
  result.prefix_query_tokens = s.kv.prefix_query_tokens;
  result.spec_drafts = s.num_drafts;
  result.spec_draft_tokens = s.num_draft_tokens;
  result.spec_accepted_tokens = s.num_accepted_draft_tokens;
  return result;
}

int metric_direction(const std::string& metric) {
  auto has = [&metric](const char* part) { return metric.find(part) != std::string::npos; };
  if (has("per_s") || has("running") || has("hit_rate") || has("cached_prompt_tokens")) return 1;
  if (has("_ms") || has("waste") || has("preemptions") || has("makespan"))
    return -1;
  return 0;  // requests, output_tokens, kv_blocks_total, kv_pool_mib, peak_kv_used_mib
}

nlohmann::json run_metrics(const RunResult& r) {
  nlohmann::json m;
  int64_t out_tokens = 0, completed = 0, cached = 0;
  std::map<std::string, std::vector<const RequestRecord*>> by_tag;
  for (const auto& q : r.requests) {
    out_tokens += q.output_tokens;
    if (q.error.empty()) ++completed;
    cached += q.cached_prompt_tokens;
    by_tag[""].push_back(&q);
    if (!q.tag.empty()) by_tag[q.tag].push_back(&q);
  }
  m["requests"] = r.requests.size();
  m["completed"] = completed;
  m["output_tokens"] = out_tokens;
  m["makespan_s"] = r.makespan_s;
  m["output_tokens_per_s"] = r.makespan_s > 0 ? out_tokens / r.makespan_s : 0;
  m["requests_per_s"] = r.makespan_s > 0 ? completed / r.makespan_s : 0;
  for (const auto& [tag, reqs] : by_tag) {
    std::vector<double> ttft, tpot, itl, e2e;
    for (const auto* q : reqs) {
      if (!q->error.empty()) continue;
      ttft.push_back(q->ttft * 1e3);
      if (q->output_tokens > 1) tpot.push_back(q->tpot * 1e3);
      e2e.push_back(q->e2e * 1e3);
      for (double x : q->itl) itl.push_back(x * 1e3);
    }
    const std::string p = tag.empty() ? "" : tag + ".";
    const Summary st = summarize(ttft), sp = summarize(tpot), si = summarize(itl), se = summarize(e2e);
    m[p + "ttft_p50_ms"] = st.p50; m[p + "ttft_p90_ms"] = st.p90; m[p + "ttft_p99_ms"] = st.p99;
    m[p + "ttft_mean_ms"] = st.mean;
    m[p + "tpot_p50_ms"] = sp.p50; m[p + "tpot_p90_ms"] = sp.p90; m[p + "tpot_p99_ms"] = sp.p99;
    m[p + "itl_p50_ms"] = si.p50; m[p + "itl_p90_ms"] = si.p90; m[p + "itl_p99_ms"] = si.p99;
    m[p + "itl_max_ms"] = si.max;
    m[p + "e2e_p50_ms"] = se.p50; m[p + "e2e_p99_ms"] = se.p99;
  }
  m["peak_running"] = r.peak_running;
  m["mean_running"] = r.mean_running;
  m["peak_kv_blocks_used"] = r.peak_kv_blocks_used;
  m["kv_blocks_total"] = r.kv_blocks_total;
  // Blocks referenced by live sequences (a shared prefix block counts once) vs the pool.
  m["peak_kv_used_mib"] = r.peak_kv_blocks_used * r.kv_block_bytes / 1048576.0;
  m["kv_pool_mib"] = r.kv_blocks_total * r.kv_block_bytes / 1048576.0;
  m["mean_kv_waste"] = r.mean_kv_waste;
  m["preemptions"] = r.preemptions;
  m["prefix_hit_rate"] = r.prefix_query_tokens > 0
                             ? static_cast<double>(r.prefix_hit_tokens) / r.prefix_query_tokens : 0;
  m["cached_prompt_tokens"] = cached;
  if (r.spec_drafts > 0) {
    m["spec_draft_tokens"] = r.spec_draft_tokens;
    m["spec_accepted_tokens"] = r.spec_accepted_tokens;
    m["spec_acceptance_rate"] = static_cast<double>(r.spec_accepted_tokens) / static_cast<double>(r.spec_draft_tokens);
    // Tokens per verification (1 + accepted drafts), vLLM's mean acceptance length.
    m["spec_mean_acceptance_length"] =
        1.0 + static_cast<double>(r.spec_accepted_tokens) / static_cast<double>(r.spec_drafts);
  }
  return m;
}

nlohmann::json run_json(const RunResult& r, bool with_requests) {
  nlohmann::json j;
  j["metrics"] = run_metrics(r);
  if (with_requests) {
    j["requests"] = nlohmann::json::array();
    for (const auto& q : r.requests) {
      nlohmann::json x = {{"id", q.id}, {"prompt_tokens", q.prompt_tokens},
                          {"cached_prompt_tokens", q.cached_prompt_tokens},
                          {"requested_tokens", q.requested_tokens}, {"output_tokens", q.output_tokens},
                          {"finish_reason", q.finish_reason}, {"ttft_s", q.ttft}, {"tpot_s", q.tpot},
                          {"e2e_s", q.e2e}, {"queue_s", q.queue}};
      if (!q.tag.empty()) x["tag"] = q.tag;
      if (!q.error.empty()) x["error"] = q.error;
      j["requests"].push_back(std::move(x));
    }
  }
  return j;
}

}  // namespace tessera::cli::bench
