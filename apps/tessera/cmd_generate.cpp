// tessera generate: runs prompts through the engine. One --prompt streams its text to stdout;
// several prompts (or --prompts-file, --json) run concurrently and print one JSON line per
// request: id, prompt and generated token ids, text, finish reason, timings.
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include "commands.h"
#include "sampling_options.h"
#include "stack_loader.h"
#include "tessera/chat_template.h"
#include "tessera/tokenizer.h"

namespace tessera::cli {
namespace {

struct PromptJob {
  std::string id;
  std::string text;
  SamplingParams params;
  // Results, filled from engine callbacks.
  std::vector<TokenId> prompt_ids;
  std::vector<TokenId> output_ids;
  std::string output_text;
  FinishReason finish_reason = FinishReason::kNone;
  std::string error;
  RequestTimings timings;
  int32_t cached_prompt_tokens = 0;
  int32_t draft_tokens = 0;           // speculative decoding: drafts verified
  int32_t accepted_draft_tokens = 0;  // and of them accepted
  bool done = false;
};

struct GenerateOptions {
  std::string config;
  std::vector<std::string> prompts;
  std::string prompts_file;
  bool chat = false;
  bool json = false;
  bool print_ids = false;
  SamplingOptions sampling;
};

// A prompts file is JSONL ({"id", "prompt", optional "max_tokens", "temperature", "seed"}) or
// plain text with one prompt per line.
std::vector<PromptJob> read_prompts_file(const std::string& path, const SamplingParams& defaults) {
  std::ifstream in(path);
  if (!in) throw CommandError("cannot open prompts file '" + path + "'");
  std::vector<PromptJob> jobs;
  std::string line;
  int line_no = 0;
  while (std::getline(in, line)) {
    ++line_no;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    PromptJob job;
    job.params = defaults;
    job.id = std::to_string(jobs.size());
    if (line[line.find_first_not_of(" \t")] == '{') {
      nlohmann::json j;
      try {
        j = nlohmann::json::parse(line);
      } catch (const std::exception& e) {
        throw CommandError(path + ":" + std::to_string(line_no) + ": invalid JSON: " + e.what());
      }
      auto where = path + ":" + std::to_string(line_no) + ": ";
      if (!j.contains("prompt") || !j["prompt"].is_string())
        throw CommandError(where + "\"prompt\": expected a string");
      job.text = j["prompt"].get<std::string>();
      if (j.contains("id")) job.id = j["id"].is_string() ? j["id"].get<std::string>() : j["id"].dump();
      try {
        if (j.contains("max_tokens")) job.params.max_tokens = j["max_tokens"].get<int32_t>();
        if (j.contains("temperature")) job.params.temperature = j["temperature"].get<float>();
        if (j.contains("seed")) { job.params.seed = j["seed"].get<uint64_t>(); job.params.has_seed = true; }
      } catch (const std::exception& e) {
        throw CommandError(where + "wrong type: " + e.what());
      }
    } else {
      job.text = line;
    }
    jobs.push_back(std::move(job));
  }
  return jobs;
}

nlohmann::json job_to_json(const PromptJob& job) {
  nlohmann::json j;
  j["id"] = job.id;
  j["prompt_tokens"] = job.prompt_ids;
  j["tokens"] = job.output_ids;
  j["text"] = job.output_text;
  j["finish_reason"] = finish_reason_name(job.finish_reason);
  if (!job.error.empty()) j["error"] = job.error;
  j["cached_prompt_tokens"] = job.cached_prompt_tokens;
  if (job.draft_tokens > 0)
    j["speculative"] = {{"draft_tokens", job.draft_tokens}, {"accepted_tokens", job.accepted_draft_tokens}};
  const auto& t = job.timings;
  j["timings"] = {{"queue_s", t.queue_time()}, {"ttft_s", t.ttft()}, {"tpot_s", t.tpot()},
                  {"e2e_s", t.end_to_end()}, {"itl_s", t.inter_token_latencies()}};
  return j;
}

void run_generate(const GenerateOptions& opt) {
  if (opt.prompts.empty() && opt.prompts_file.empty())
    throw CommandError("generate: give --prompt TEXT or --prompts-file FILE");
  const SamplingParams defaults = opt.sampling.to_params();
  std::vector<PromptJob> jobs;
  for (size_t i = 0; i < opt.prompts.size(); ++i) {
    PromptJob job;
    job.id = std::to_string(i);
    job.text = opt.prompts[i];
    job.params = defaults;
    jobs.push_back(std::move(job));
  }
  if (!opt.prompts_file.empty()) {
    auto more = read_prompts_file(opt.prompts_file, defaults);
    for (auto& j : more) jobs.push_back(std::move(j));
  }
  if (jobs.empty()) throw CommandError("generate: the prompts file holds no prompt");

  LoadedStack stack = load_stack(opt.config, /*quiet=*/false);
  Engine& engine = *stack.engine;
  const Model& model = engine.model();
  const Tokenizer& tok = model.tokenizer();
  const bool stream = jobs.size() == 1 && !opt.json;

  std::vector<std::unique_ptr<StreamingDetokenizer>> detok;
  size_t num_failed = 0;
  for (auto& job : jobs) {
    std::string text = job.text;
    if (opt.chat) text = apply_chat_template(model.chat_template(), {{"user", job.text}}, true);
    // Chat templates spell control tokens as text; plain prompts are plain text.
    job.prompt_ids = tok.encode(text, /*add_special=*/true, /*parse_special=*/opt.chat);
    auto d = std::make_unique<StreamingDetokenizer>(tok);
    StreamingDetokenizer* dp = d.get();
    detok.push_back(std::move(d));
    GenerationRequest req;
    req.prompt = job.prompt_ids;
    req.params = job.params;
    PromptJob* jp = &job;
    req.on_event = [jp, dp, stream](const GenerationEvent& ev) {
      for (const SampledToken& t : ev.tokens) {
        jp->output_ids.push_back(t.token);
        std::string piece = dp->push(t.token);
        jp->output_text += piece;
        if (stream) { std::fwrite(piece.data(), 1, piece.size(), stdout); std::fflush(stdout); }
      }
      if (ev.finished) {
        std::string rest = dp->flush();
        jp->output_text += rest;
        if (stream) { std::fwrite(rest.data(), 1, rest.size(), stdout); std::fflush(stdout); }
        jp->finish_reason = ev.finish_reason;
        if (!ev.error.is_ok()) jp->error = ev.error.message();
        jp->timings = *ev.timings;
        jp->cached_prompt_tokens = ev.num_cached_prompt_tokens;
        jp->draft_tokens = ev.num_draft_tokens;
        jp->accepted_draft_tokens = ev.num_accepted_draft_tokens;
        jp->done = true;
      }
    };
    uint64_t id = 0;
    Status st = engine.submit(std::move(req), &id);
    if (!st.is_ok()) {
      job.error = st.message();
      job.finish_reason = FinishReason::kError;
      job.done = true;
      ++num_failed;
      std::fprintf(stderr, "request %s: %s\n", job.id.c_str(), st.message().c_str());
      continue;
    }
  }
  const auto start = std::chrono::steady_clock::now();
  size_t last_done = 0;
  const bool show_progress = jobs.size() > 1;
  while (engine.step() || engine.stats().num_running + engine.stats().num_waiting > 0) {
    if (show_progress) {
      size_t done = 0;
      for (auto& j : jobs) done += j.done;
      if (done != last_done) { print_progress("requests", done, jobs.size()); last_done = done; }
    }
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  size_t out_tokens = 0;
  for (auto& j : jobs) out_tokens += j.output_ids.size();
  if (stream) {
    std::fputc('\n', stdout);
    std::fflush(stdout);  // the text ends before the statistics on stderr start
    if (opt.print_ids) {
      for (size_t i = 0; i < jobs[0].output_ids.size(); ++i)
        std::printf("%s%d", i ? " " : "", jobs[0].output_ids[i]);
      std::printf("\n");
    }
  } else {
    for (auto& j : jobs) std::cout << job_to_json(j).dump() << "\n";
    std::cout.flush();
  }
  const auto& t0 = jobs[0].timings;
  if (stream && jobs[0].output_ids.size() > 1)
    std::fprintf(stderr, "prompt %zu tokens, generated %zu tokens in %.2f s: TTFT %.1f ms, %.2f tokens/s decode\n",
                 jobs[0].prompt_ids.size(), jobs[0].output_ids.size(), secs, t0.ttft() * 1e3,
                 t0.tpot() > 0 ? 1.0 / t0.tpot() : 0.0);
  else
    std::fprintf(stderr, "%zu requests, %zu output tokens in %.2f s (%.2f tokens/s)\n", jobs.size(),
                 out_tokens, secs, secs > 0 ? out_tokens / secs : 0.0);
  if (stream && jobs[0].draft_tokens > 0)
    std::fprintf(stderr, "speculative: %d of %d draft tokens accepted (%.1f%%)\n", jobs[0].accepted_draft_tokens,
                 jobs[0].draft_tokens, 100.0 * jobs[0].accepted_draft_tokens / jobs[0].draft_tokens);
  // A single prompt that failed is the command's failure; in batch mode the JSON says it.
  if (stream && jobs[0].finish_reason == FinishReason::kError) throw CommandError(jobs[0].error);
  if (num_failed > 0) std::fprintf(stderr, "%zu of %zu requests were rejected\n", num_failed, jobs.size());
}

}  // namespace

void add_generate_command(CLI::App& app) {
  auto opt = std::make_shared<GenerateOptions>();
  CLI::App* cmd = app.add_subcommand("generate", "generate text from prompts with a stack");
  cmd->add_option("-c,--config", opt->config, "stack YAML (default: configs/smollm2-cpu.yaml)");
  cmd->add_option("-p,--prompt", opt->prompts, "prompt text (repeatable)");
  cmd->add_option("-f,--prompts-file", opt->prompts_file,
                  "JSONL ({\"id\",\"prompt\",\"max_tokens\",...} per line) or one prompt per line");
  cmd->add_flag("--chat", opt->chat, "wrap each prompt as a user message in the model's chat template");
  cmd->add_flag("--json", opt->json, "print one JSON line per request even for a single prompt");
  cmd->add_flag("--print-ids", opt->print_ids, "after streamed text, print the generated token ids");
  opt->sampling.add_to(*cmd);
  cmd->callback([opt] { run_generate(*opt); });
}

}  // namespace tessera::cli
