// Sampling flags shared by `generate` and `chat` (llama.cpp's defaults).
#pragma once

#include <CLI/CLI.hpp>

#include "tessera/sdk/types.h"

namespace tessera::cli {

struct SamplingOptions {
  int max_tokens = 128;
  float temperature = 0.8f;
  int top_k = 40;
  float top_p = 0.95f;
  float min_p = 0.05f;
  float repeat_penalty = 1.0f;
  float presence_penalty = 0.0f;
  float frequency_penalty = 0.0f;
  int64_t seed = -1;  // -1: a different seed every run
  bool ignore_eos = false;

  void add_to(CLI::App& cmd) {
    cmd.add_option("-n,--max-tokens", max_tokens, "tokens to generate at most")->capture_default_str()
        ->check(CLI::PositiveNumber);
    cmd.add_option("--temperature,--temp", temperature, "0 = greedy")->capture_default_str()
        ->check(CLI::Range(0.0, 100.0));
    cmd.add_option("--top-k", top_k, "0 = off")->capture_default_str()->check(CLI::NonNegativeNumber);
    cmd.add_option("--top-p", top_p, "1 = off")->capture_default_str()->check(CLI::Range(0.0, 1.0));
    cmd.add_option("--min-p", min_p, "0 = off")->capture_default_str()->check(CLI::Range(0.0, 1.0));
    cmd.add_option("--repeat-penalty", repeat_penalty, "1 = off")->capture_default_str();
    cmd.add_option("--presence-penalty", presence_penalty)->capture_default_str();
    cmd.add_option("--frequency-penalty", frequency_penalty)->capture_default_str();
    cmd.add_option("--seed", seed, "random seed; -1 picks one per run")->capture_default_str();
    cmd.add_flag("--ignore-eos", ignore_eos, "keep generating past end-of-generation tokens");
  }

  SamplingParams to_params() const {
    SamplingParams p;
    p.max_tokens = max_tokens;
    p.temperature = temperature;
    p.top_k = top_k;
    p.top_p = top_p;
    p.min_p = min_p;
    p.repetition_penalty = repeat_penalty;
    p.presence_penalty = presence_penalty;
    p.frequency_penalty = frequency_penalty;
    p.has_seed = seed >= 0;
    p.seed = seed >= 0 ? static_cast<uint64_t>(seed) : 0;
    p.ignore_eos = ignore_eos;
    return p;
  }
};

}  // namespace tessera::cli
