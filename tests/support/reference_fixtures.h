// llama.cpp reference fixtures (scripts/make-reference-fixtures.py) and the helpers the
// reference-model tests share: loading a fixture set, comparing logits, running requests.
#pragma once

#include <doctest/doctest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <string>
#include <vector>

#include "support/test_env.h"
#include "tessera/engine.h"
#include "tessera/gguf.h"
#include "tessera/plugin_registry.h"
#include "tessera/tokenizer.h"
#include "tessera/model_runner.h"

namespace tessera::test {

struct ReferencePrompt {
  std::string name;
  std::string text;
  bool parse_special = false;
  std::vector<TokenId> prompt_ids;
  std::vector<TokenId> greedy_ids;
  std::vector<float> logits;
};

// tests/fixtures/reference/<name>.json and its logits file.
inline std::vector<ReferencePrompt> load_reference_fixtures(const std::string& name) {
  const auto dir = source_dir() / "tests/fixtures/reference";
  std::ifstream meta_in(dir / (name + ".json"));
  REQUIRE(meta_in.good());
  const nlohmann::json meta = nlohmann::json::parse(meta_in);
  const size_t vocab = meta["vocab_size"].get<size_t>();
  std::ifstream logits_in(dir / meta["logits_file"].get<std::string>(), std::ios::binary);
  REQUIRE(logits_in.good());
  std::vector<ReferencePrompt> out;
  for (const auto& p : meta["prompts"]) {
    ReferencePrompt r;
    r.name = p["name"];
    r.text = p["text"];
    r.parse_special = p["parse_special"];
    r.prompt_ids = p["prompt_ids"].get<std::vector<TokenId>>();
    r.greedy_ids = p["greedy_ids"].get<std::vector<TokenId>>();
    r.logits.resize(vocab);
    logits_in.read(reinterpret_cast<char*>(r.logits.data()), vocab * sizeof(float));
    REQUIRE(logits_in.good());
    out.push_back(std::move(r));
  }
  REQUIRE(out.size() >= 6);
  return out;
}

// A plugin from the build's plugin dir with its default parameters, e.g.
// plugin<AttentionKernel>(registry, "naive").
template <class Interface>
std::shared_ptr<Interface> plugin(PluginRegistry& registry, const std::string& name) {
  if (registry.scanned_dirs().empty()) registry.scan_directory(plugin_dir());
  const std::string slot = std::string("engine.") + plugin_kind_name(PluginKindOf<Interface>::value);
  PluginContext ctx{&host_logger(), ""};
  return registry.create<Interface>(name, PluginConfig(name, slot, {}), ctx);
}

// Every fixture prompt tokenizes to llama.cpp's ids with the tokenizer of `model_path`.
inline void check_prompt_ids(const std::string& model_path, const std::vector<ReferencePrompt>& fixtures) {
  auto file = gguf::GgufFile::open(model_path);
  auto tok = Tokenizer::from_gguf(*file);
  for (const auto& f : fixtures) {
    INFO("prompt " << f.name);
    CHECK(tok->encode(f.text, true, f.parse_special) == f.prompt_ids);
  }
}

// Index of the largest logit: the greedy token.
inline size_t argmax(const std::vector<float>& v) {
  return static_cast<size_t>(std::max_element(v.begin(), v.end()) - v.begin());
}

// Largest |logit - llama.cpp's| as a fraction of the range of llama.cpp's logits, and that range.
struct LogitDiff {
  double max_abs = 0;
  double range = 0;
  double fraction() const { return max_abs / range; }
};

inline LogitDiff logit_diff(const std::vector<float>& logits, const ReferencePrompt& f) {
  LogitDiff d;
  for (size_t i = 0; i < f.logits.size(); ++i)
    d.max_abs = std::max(d.max_abs, static_cast<double>(std::fabs(logits[i] - f.logits[i])));
  const auto [lo, hi] = std::minmax_element(f.logits.begin(), f.logits.end());
  d.range = *hi - *lo;
  return d;
}

// The last-position logits of a fixture prompt, run alone from position 0 in blocks table[...].
inline std::vector<float> prompt_logits(ModelRunner& runner, const ReferencePrompt& f,
                                        const std::vector<int32_t>& table) {
  RunnerSequence seq{f.prompt_ids.data(), static_cast<int32_t>(f.prompt_ids.size()), 0, table, 1};
  std::vector<float> logits;
  REQUIRE(runner.forward({&seq, 1}, &logits).is_ok());
  return logits;
}

// Runs every request to completion and returns the generated ids per request.
inline std::vector<std::vector<TokenId>> run_all(Engine& engine, const std::vector<GenerationRequest>& reqs) {
  std::vector<std::vector<TokenId>> outputs(reqs.size());
  std::vector<bool> finished(reqs.size(), false);
  for (size_t i = 0; i < reqs.size(); ++i) {
    GenerationRequest r = reqs[i];
    r.on_event = [&outputs, &finished, i](const GenerationEvent& ev) {
      for (const auto& t : ev.tokens) outputs[i].push_back(t.token);
      if (ev.finished) {
        CHECK_MESSAGE(ev.error.is_ok(), ev.error.message());
        finished[i] = true;
      }
    };
    uint64_t id = 0;
    REQUIRE(engine.submit(std::move(r), &id).is_ok());
  }
  engine.run_until_idle();
  for (size_t i = 0; i < reqs.size(); ++i) CHECK(finished[i]);
  return outputs;
}

// Greedy requests for each fixture's prompt, as long as its recorded continuation
// (end-of-generation ignored, as the fixture script does).
inline std::vector<GenerationRequest> greedy_requests(const std::vector<ReferencePrompt>& fixtures) {
  std::vector<GenerationRequest> reqs;
  for (const auto& f : fixtures) {
    GenerationRequest r;
    r.prompt = f.prompt_ids;
    r.params.temperature = 0;
    r.params.max_tokens = static_cast<int32_t>(f.greedy_ids.size());
    r.params.ignore_eos = true;
    reqs.push_back(r);
  }
  return reqs;
}

}  // namespace tessera::test
