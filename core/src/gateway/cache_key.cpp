#include "tessera/gateway/cache_key.h"

#include <algorithm>
#include <cstdio>

namespace tessera {
namespace {

std::string num(double v) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "%.9g", v);
  return buf;
}

// Length-prefixed, so a stop string holding the separators cannot forge another key.
std::string quoted(const std::string& s) { return std::to_string(s.size()) + ":" + s; }

}  // namespace

bool is_reproducible(const SamplingParams& p) { return p.is_greedy() || p.has_seed; }

std::string canonical_output_params(const SamplingParams& p, const std::vector<std::string>& stop_strings) {
  std::string out;
  if (p.is_greedy()) {
    out += "greedy;";
  } else {
    out += "temperature=" + num(p.temperature) + ";";
    if (p.top_k > 0) out += "top_k=" + std::to_string(p.top_k) + ";";
    if (p.top_p < 1.0f) out += "top_p=" + num(p.top_p) + ";";
    if (p.min_p > 0.0f) out += "min_p=" + num(p.min_p) + ";";
    out += p.has_seed ? "seed=" + std::to_string(p.seed) + ";" : "seed=none;";
  }
  const bool penalties = p.repetition_penalty != 1.0f || p.presence_penalty != 0.0f || p.frequency_penalty != 0.0f;
  if (penalties) {
    out += "repetition_penalty=" + num(p.repetition_penalty) + ";presence_penalty=" + num(p.presence_penalty) +
           ";frequency_penalty=" + num(p.frequency_penalty) + ";penalty_last_n=" + std::to_string(p.penalty_last_n) +
           ";";
  }
  out += "max_tokens=" + std::to_string(p.max_tokens) + ";";
  if (p.ignore_eos) out += "ignore_eos;";
  std::vector<TokenId> ids = p.stop_token_ids;
  std::sort(ids.begin(), ids.end());
  ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
  if (!ids.empty()) {
    out += "stop_token_ids=";
    for (TokenId t : ids) out += std::to_string(t) + ",";
    out += ";";
  }
  std::vector<std::string> stops = stop_strings;
  std::sort(stops.begin(), stops.end());
  stops.erase(std::unique(stops.begin(), stops.end()), stops.end());
  if (!stops.empty()) {
    out += "stop=";
    for (const auto& s : stops) out += quoted(s);
    out += ";";
  }
  return out;
}

}  // namespace tessera
