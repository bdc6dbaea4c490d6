// Speculative decoding on the real model with every drafter (ngram, suffix, draft-model,
// layer-skip): greedy output
// is byte-identical with and without each drafter on every scheduler/KV stack of the
// invariance suite, prompts alone and 16 at once; EOS-like stop tokens and max_tokens hold inside accepted drafts; no KV
// block is left behind after cancellation with drafts pending, preemption of sequences with
// drafts, and n > 1; and at temperature 1 (and top-p 0.9) verification draws the next token
// from the same distribution as plain sampling (chi-square on the model's real logits).
#include <doctest/doctest.h>

#include <algorithm>
#include <map>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "support/chi_square.h"
#include "support/greedy_runs.h"
#include "support/real_model.h"
#include "support/spec_prompts.h"
#include "support/stacks.h"
#include "support/test_env.h"
#include "tessera/config.h"
#include "tessera/engine.h"
#include "tessera/plugin_registry.h"
#include "tessera/stack.h"

using namespace tessera;

namespace {

constexpr int kNewTokens = 24;
// adaptive: false, so that every stack really verifies drafts (the adaptive control follows
// measured step times); one variant below runs the adaptive control.
const char* kDrafter = "  drafter: {plugin: ngram, num_draft_tokens: 4, min_ngram: 1, max_ngram: 3, adaptive: false}\n";
// Every drafter the tests run, by name: draft-model drafts with the target's own file (the
// real model twice), so nearly every draft is accepted and verification is exercised hard;
// layer-skip drafts with the target's first 20 of its 30 layers (weights shared) from a
// reduced vocabulary of the 4,096 lowest ids (SDK 2.13 restrict_logits), so that targets'
// tokens outside it are rejected and the reduced head's column mapping is exercised.
// The leak test gives it a KV pool of one 512-token context and a little more (12MiB), so
// that a draft block left behind shows as a sequence that can no longer draft.
std::vector<std::pair<std::string, std::string>> drafters(const std::string& draft_kv_memory = "128MiB") {
  return {
      {"ngram", kDrafter},
      {"suffix", "  drafter: {plugin: suffix, num_draft_tokens: 4, min_match: 1, adaptive: false}\n"},
      {"draft-model", "  drafter: {plugin: draft-model, model: '" + test::real_model_path() +
                          "', num_draft_tokens: 4, memory: " + draft_kv_memory + ", adaptive: false}\n"},

      {"layer-skip", "  drafter: {plugin: layer-skip, layers: '0-19', vocabulary: 4096, num_draft_tokens: 4, memory: " +
                         draft_kv_memory + ", adaptive: false}\n"},
  };
}

using test::check_all_blocks_free;
using test::Stack;

test::Stack make_stack(const std::string& name, const std::string& yaml) {
  return test::make_stack("speculative-" + name, yaml);
}

std::vector<std::vector<TokenId>> encode_all(const Engine& engine, const std::vector<std::string>& texts) {
  std::vector<std::vector<TokenId>> out;
  for (const auto& t : texts) out.push_back(engine.model().tokenizer().encode(t, false, true));
  return out;
}

// 8 input-grounded prompts (drafts get accepted) and 8 chat prompts (few drafts).
std::vector<std::string> prompt_texts() {
  auto texts = test::grounded_prompts(8);
  for (auto& t : test::chat_prompts(8)) texts.push_back(t);
  return texts;
}


std::vector<std::vector<TokenId>> run_alone(Engine& engine, const std::vector<std::vector<TokenId>>& prompts) {
  std::vector<std::vector<TokenId>> out;
  for (const auto& p : prompts) out.push_back(test::run_greedy(engine, {p}, kNewTokens)[0]);
  return out;
}

}  // namespace

TEST_CASE("greedy output with drafts equals greedy output without, for every drafter on every invariance stack") {
  if (!test::have_real_model()) return;
  std::map<std::string, std::vector<std::vector<TokenId>>> reference;  // per attention kernel
  std::vector<std::vector<TokenId>> prompts;
  for (const char* kernel : {"naive", "flash"}) {
    Stack s = make_stack(std::string("plain-") + kernel,
                         "engine:\n  kv_cache: {plugin: contiguous, memory: 256MiB, dtype: f32}\n"
                         "  attention: {plugin: " + std::string(kernel) + "}\n");
    if (prompts.empty()) prompts = encode_all(*s.engine, prompt_texts());
    reference[kernel] = run_alone(*s.engine, prompts);
    for (const auto& r : reference[kernel]) REQUIRE(r.size() == static_cast<size_t>(kNewTokens));
  }

  struct Variant { std::string name, kernel, yaml; };
  const std::vector<Variant> variants = {
      {"static-contiguous", "naive",
       "  scheduler: {plugin: static, max_num_seqs: 16}\n"
       "  kv_cache: {plugin: contiguous, memory: 256MiB, dtype: f32}\n"},
      {"continuous-paged16", "naive",
       "  scheduler: {plugin: continuous, max_num_seqs: 16}\n"
       "  kv_cache: {plugin: paged, block_size: 16, memory: 128MiB, dtype: f32, prefix_caching: false}\n"},
      {"chunked64-paged32-prefix", "naive",
       "  scheduler: {plugin: chunked-prefill, chunk_size: 64, max_batch_tokens: 256}\n"
       "  kv_cache: {plugin: paged, block_size: 32, memory: 128MiB, dtype: f32, prefix_caching: true}\n"},
      {"chunked16-paged8-prefix", "flash",
       "  scheduler: {plugin: chunked-prefill, chunk_size: 16, max_batch_tokens: 96}\n"
       "  kv_cache: {plugin: paged, block_size: 8, memory: 128MiB, dtype: f32, prefix_caching: true}\n"},
      {"chunked256-paged16", "flash",
       "  scheduler: {plugin: chunked-prefill, chunk_size: 256, max_batch_tokens: 512}\n"
       "  kv_cache: {plugin: paged, block_size: 16, memory: 128MiB, dtype: f32, prefix_caching: false}\n"},
      {"continuous-contiguous", "flash",
       "  scheduler: {plugin: continuous, max_num_seqs: 16}\n"
       "  kv_cache: {plugin: contiguous, memory: 256MiB, dtype: f32}\n"},
  };
  for (const auto& [drafter, drafter_yaml] : drafters()) {
    for (const Variant& v : variants) {
      INFO("stack " << v.name << " with " << v.kernel << " attention and drafter." << drafter);
      Stack s = make_stack(v.name + "-" + v.kernel + "-" + drafter,
                           "engine:\n" + v.yaml + "  attention: {plugin: " + v.kernel + "}\n" + drafter_yaml);
      const auto out = test::run_greedy(*s.engine, prompts, kNewTokens);  // all 16 at once
      int same = 0;
      for (size_t i = 0; i < prompts.size(); ++i) same += out[i] == reference[v.kernel][i];
      const EngineStats st = s.engine->stats();
      MESSAGE(v.name << " + " << v.kernel << " + " << drafter << ", 16 concurrent: " << same << "/"
                     << prompts.size() << " identical; drafts verified " << st.num_draft_tokens << ", accepted "
                     << st.num_accepted_draft_tokens);
      CHECK(same == static_cast<int>(prompts.size()));
      CHECK(st.num_accepted_draft_tokens > 0);  // the drafts were really exercised
      check_all_blocks_free(*s.engine);
    }
  }

  // The adaptive control changes how many drafts each step verifies, never the output.
  {
    Stack a = make_stack("adaptive", "engine:\n  kv_cache: {plugin: paged, block_size: 16, memory: 128MiB, dtype: f32}\n"
                                     "  attention: {plugin: flash}\n"
                                     "  drafter: {plugin: ngram, num_draft_tokens: 8, adaptive: true}\n");
    const auto out = test::run_greedy(*a.engine, prompts, kNewTokens);
    int same = 0;
    for (size_t i = 0; i < prompts.size(); ++i) same += out[i] == reference["flash"][i];
    MESSAGE("adaptive ngram, 16 concurrent: " << same << "/" << prompts.size() << " identical; drafts verified "
                                              << a.engine->stats().num_draft_tokens << ", skipped "
                                              << a.engine->stats().num_draft_skips << " sequence-steps");
    CHECK(same == static_cast<int>(prompts.size()));
    // A seeded sampled request keeps its draft count under the control: it reproduces.
    std::vector<TokenId> sampled[2];
    for (auto& tokens : sampled) {
      GenerationRequest r;
      r.prompt = prompts[0];
      r.params.temperature = 1.0f;
      r.params.seed = 11;
      r.params.has_seed = true;
      r.params.max_tokens = kNewTokens;
      r.params.ignore_eos = true;
      r.on_event = [&tokens](const GenerationEvent& ev) {
        for (const auto& t : ev.tokens) tokens.push_back(t.token);
      };
      uint64_t id = 0;
      REQUIRE(a.engine->submit(r, &id).is_ok());
      a.engine->run_until_idle();
    }
    CHECK(sampled[0].size() == static_cast<size_t>(kNewTokens));
    CHECK(sampled[0] == sampled[1]);
    check_all_blocks_free(*a.engine);
  }

  // Each prompt alone (batch 1) with each drafter.
  for (const auto& [drafter, drafter_yaml] : drafters()) {
    INFO("alone with drafter." << drafter);
    Stack s = make_stack("alone-" + drafter, std::string("engine:\n  kv_cache: {plugin: paged, block_size: 16, "
                                                         "memory: 128MiB, dtype: f32}\n  attention: {plugin: flash}\n") +
                                                 drafter_yaml);
    const auto alone = run_alone(*s.engine, prompts);
    int same = 0;
    for (size_t i = 0; i < prompts.size(); ++i) same += alone[i] == reference["flash"][i];
    MESSAGE("alone + " << drafter << ": " << same << "/" << prompts.size() << " identical; acceptance "
                       << s.engine->stats().num_accepted_draft_tokens << "/" << s.engine->stats().num_draft_tokens);
    CHECK(same == static_cast<int>(prompts.size()));
    check_all_blocks_free(*s.engine);
  }
}

TEST_CASE("stop tokens and max_tokens hold inside accepted drafts") {
  if (!test::have_real_model()) return;
  Stack plain = make_stack("stop-plain", "");
  Stack spec = make_stack("stop-spec", std::string("engine:\n") + kDrafter);
  const auto prompts = encode_all(*plain.engine, test::grounded_prompts(4));
  int checked = 0;
  for (const auto& prompt : prompts) {
    const auto reference = test::run_greedy(*plain.engine, {prompt}, 40)[0];
    // A stop token from the middle of the output: the first occurrence ends it there.
    const TokenId stop = reference[12];
    const size_t cut = std::find(reference.begin(), reference.end(), stop) - reference.begin();
    for (int32_t max_tokens : {7, 40}) {
      std::vector<TokenId> out;
      FinishReason reason = FinishReason::kNone;
      GenerationRequest r;
      r.prompt = prompt;
      r.params.temperature = 0;
      r.params.max_tokens = max_tokens;
      r.params.ignore_eos = true;
      r.params.stop_token_ids = {stop};
      r.on_event = [&](const GenerationEvent& ev) {
        for (const auto& t : ev.tokens) out.push_back(t.token);
        if (ev.finished) reason = ev.finish_reason;
      };
      uint64_t id = 0;
      REQUIRE(spec.engine->submit(r, &id).is_ok());
      spec.engine->run_until_idle();
      const size_t expected = std::min<size_t>(cut, max_tokens);
      CHECK(out == std::vector<TokenId>(reference.begin(), reference.begin() + expected));
      CHECK(reason == (cut < static_cast<size_t>(max_tokens) ? FinishReason::kStop : FinishReason::kLength));
      ++checked;
    }
  }
  CHECK(checked == 8);
  CHECK(spec.engine->stats().num_accepted_draft_tokens > 0);
  check_all_blocks_free(*spec.engine);
}

TEST_CASE("cancellation with drafts pending, preemption of sequences with drafts and n > 1 leave no KV block") {
  if (!test::have_real_model()) return;
  // A pool of 34 blocks of 16 tokens for 8 prompts of ~100 tokens: sequences get preempted.
  const std::string small = "model: {context_length: 512}\nengine:\n"
                            "  scheduler: {plugin: chunked-prefill, chunk_size: 64, max_batch_tokens: 256}\n"
                            "  kv_cache: {plugin: paged, block_size: 16, memory: 24MiB, dtype: f32}\n";
  Stack plain = make_stack("leaks-plain", small);
  const auto prompts = encode_all(*plain.engine, test::grounded_prompts(8));
  const auto reference = run_alone(*plain.engine, prompts);
  for (const auto& [drafter, drafter_yaml] : drafters("12MiB")) {
    INFO("drafter." << drafter);
    Stack spec = make_stack("leaks-spec-" + drafter, small + drafter_yaml);
    const auto out = test::run_greedy(*spec.engine, prompts, kNewTokens);
    CHECK(out == reference);
    MESSAGE("preemptions with drafts: " << spec.engine->stats().num_preemptions << ", accepted "
                                        << spec.engine->stats().num_accepted_draft_tokens);
    CHECK(spec.engine->stats().num_preemptions > 0);
    CHECK(spec.engine->stats().num_accepted_draft_tokens > 0);
    check_all_blocks_free(*spec.engine);

    // Cancelled while its next drafts wait to be verified.
    Engine& engine = *spec.engine;
    bool cancelled = false;
    GenerationRequest victim;
    victim.prompt = prompts[0];
    victim.params.temperature = 0;
    victim.params.max_tokens = 200;
    victim.params.ignore_eos = true;
    victim.on_event = [&](const GenerationEvent& ev) {
      if (ev.finished) cancelled = ev.finish_reason == FinishReason::kCancelled;
    };
    uint64_t id = 0;
    REQUIRE(engine.submit(victim, &id).is_ok());
    const uint64_t drafts_before = engine.stats().num_drafts;
    for (int i = 0; i < 200 && engine.stats().num_drafts < drafts_before + 3; ++i) engine.step();
    REQUIRE(engine.stats().num_drafts >= drafts_before + 3);
    engine.cancel(id);
    engine.run_until_idle();
    CHECK(cancelled);
    check_all_blocks_free(engine);

    // n = 3: greedy samples all equal the plain greedy output; seeded samples reproduce, and
    // equal the plain stack's seeded samples (every drafter here is deterministic, and
    // verification against a one-hot q draws as plain sampling does).
    std::map<int, std::vector<TokenId>> greedy, sampled[2], plain_sampled;
    auto run_n = [&](std::map<int, std::vector<TokenId>>* samples, float temperature, Engine& on) {
      GenerationRequest r;
      r.prompt = prompts[1];
      r.n = 3;
      r.params.temperature = temperature;
      r.params.seed = 5;
      r.params.has_seed = true;
      r.params.max_tokens = kNewTokens;
      r.params.ignore_eos = true;
      r.on_event = [samples](const GenerationEvent& ev) {
        for (const auto& t : ev.tokens) (*samples)[ev.choice].push_back(t.token);
      };
      uint64_t ignored = 0;
      REQUIRE(on.submit(r, &ignored).is_ok());
      on.run_until_idle();
    };
    run_n(&greedy, 0.0f, engine);
    REQUIRE(greedy.size() == 3);
    for (const auto& [choice, tokens] : greedy) CHECK(tokens == reference[1]);
    run_n(&sampled[0], 1.0f, engine);
    run_n(&sampled[1], 1.0f, engine);
    run_n(&plain_sampled, 1.0f, *plain.engine);
    CHECK(sampled[0] == sampled[1]);
    CHECK(sampled[0] == plain_sampled);
    for (const auto& [choice, tokens] : sampled[0]) CHECK(tokens.size() == static_cast<size_t>(kNewTokens));
    check_all_blocks_free(engine);

    // The drafter's own state is released too: a request needing nearly a whole context of
    // draft KV (draft-model's pool holds one 512-token context) still gets drafts accepted,
    // which it could not if any earlier sequence had left a draft block behind.
    if (drafter == "draft-model") {
      GenerationRequest r;
      for (int i = 0; r.prompt.size() < 400; ++i) r.prompt.insert(r.prompt.end(), prompts[i % 8].begin(), prompts[i % 8].end());
      r.prompt.resize(400);
      r.params.temperature = 0;
      r.params.max_tokens = 100;
      r.params.ignore_eos = true;
      uint64_t ignored = 0;
      const uint64_t accepted_before = engine.stats().num_accepted_draft_tokens;
      REQUIRE(engine.submit(r, &ignored).is_ok());
      engine.run_until_idle();
      CHECK(engine.stats().num_accepted_draft_tokens > accepted_before + 50);
      check_all_blocks_free(engine);
    }
  }
}

namespace {
// Records the first logits row the engine samples from, then samples as configured.
class RecordingSampler final : public test::ForwardingSampler {
 public:
  using ForwardingSampler::ForwardingSampler;
  std::vector<float> row;
  Status sample(std::span<float> logits, const SamplingInput& in, SamplerState* s, SampledToken* out) override {
    if (row.empty()) row.assign(logits.begin(), logits.end());
    return inner_->sample(logits, in, s, out);
  }
};
}  // namespace

TEST_CASE("at temperature 1 and top-p 0.9 verification samples the model's next-token distribution") {
  if (!test::have_real_model()) return;
  // The model's real next-token logits after an open-ended text prompt (a broad distribution:
  // top-p 0.9 keeps many tokens).
  const auto dir = test::scratch_dir("speculative-distribution");
  PluginRegistry registry;
  registry.scan_directory(test::plugin_dir());
  StackConfig config = load_stack_config((test::source_dir() / "configs/smollm2-cpu.yaml").string(), registry);
  EngineComponents c = build_engine_components(config, registry);
  std::shared_ptr<Sampler> standard = c.sampler;
  auto recorder = std::make_shared<RecordingSampler>(standard);
  c.sampler = recorder;
  Engine engine(std::move(c));
  const auto prompt = engine.model().tokenizer().encode("Once upon a time, in a small", true, false);
  test::run_greedy(engine, {prompt}, 1);
  REQUIRE(!recorder->row.empty());
  // Its 512 most likely tokens as the vocabulary (each sample sorts the row: the full 49152
  // would make 80,000 samples take minutes; the tail beyond 512 holds little mass).
  std::vector<int32_t> order(recorder->row.size());
  std::iota(order.begin(), order.end(), 0);
  std::partial_sort(order.begin(), order.begin() + 512, order.end(),
                    [&](int32_t a, int32_t b) { return recorder->row[a] > recorder->row[b]; });
  std::vector<float> logits(512);
  for (int i = 0; i < 512; ++i) logits[i] = recorder->row[order[i]];

  constexpr int kSamples = 20000;
  for (float top_p : {1.0f, 0.9f}) {
    SamplingParams params;
    params.temperature = 1.0f;
    params.top_p = top_p;
    // Draft proposals: one-hot at the second most likely token (prompt lookup's kind), and a
    // flatter q (the row at temperature 2) with the draft drawn from it (a draft model's kind).
    std::vector<float> flat_q(512);
    double sum = 0;
    for (int i = 0; i < 512; ++i) sum += flat_q[i] = std::exp((logits[i] - logits[0]) / 2.0f);
    for (float& v : flat_q) v = static_cast<float>(v / sum);
    for (bool one_hot : {true, false}) {
      std::vector<int64_t> plain(512, 0), spec(512, 0);
      SamplerState plain_state{1}, spec_state{2};
      std::mt19937_64 draft_rng(3);
      std::discrete_distribution<int> from_q(flat_q.begin(), flat_q.end());
      std::vector<float> row, row0, row1;
      std::vector<SampledToken> out;
      int64_t accepted = 0;
      for (int i = 0; i < kSamples; ++i) {
        row = logits;
        SampledToken t;
        REQUIRE(standard->sample(row, SamplingInput{&params, {}}, &plain_state, &t).is_ok());
        ++plain[t.token];
        const TokenId draft = one_hot ? 1 : from_q(draft_rng);
        row0 = logits;
        row1 = logits;
        const std::span<float> rows[2] = {row0, row1};
        const TokenId drafts[1] = {draft};
        out.clear();
        const DraftView view{drafts, one_hot ? std::span<const float>() : std::span<const float>(flat_q)};
        REQUIRE(standard->verify(rows, view, SamplingInput{&params, {}}, &spec_state, &out).is_ok());
        ++spec[out[0].token];
        accepted += out.size() == 2;
      }
      const test::ChiSquare h = test::chi_square_two_sample(spec, plain);
      const std::string kind = one_hot ? "one-hot q at the second most likely token" : "q = p at temperature 2";
      MESSAGE("temperature 1, top_p " << top_p << ", " << kind
                                      << ": " << kSamples << " spec vs " << kSamples << " plain samples, acceptance "
                                      << static_cast<double>(accepted) / kSamples << ", chi-square " << h.statistic
                                      << ", df " << h.degrees_of_freedom << ", p-value " << h.p_value);
      CHECK(h.p_value > 1e-3);
    }
  }
}
