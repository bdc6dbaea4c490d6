// Engine invariants on the real model: greedy output does not depend on the scheduler, the
// chunk size, the KV cache or its block size, prefix-cache hits or the attention kernel, and
// equals each prompt run alone; afterwards every KV block is free again. Also: cancellation
// mid-prefill, n > 1 forks, and bad requests answered alone while the others complete.
// Prompt log-probabilities (echo + logprobs) are the same across chunk sizes, schedulers and
// block sizes, with prefix-cache hits around, and change no generated token.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "support/greedy_runs.h"
#include "support/real_model.h"
#include "support/stacks.h"
#include "support/test_env.h"
#include "tessera/config.h"
#include "tessera/engine.h"
#include "tessera/plugin_registry.h"
#include "tessera/stack.h"

using namespace tessera;

namespace {

constexpr int kNewTokens = 12;

// A stack: the default config with `engine_yaml` replacing its engine slots. f32 KV caches,
// so the naive and flash kernels see the same K/V values.
test::Stack make_stack(const std::string& name, const std::string& engine_yaml) {
  return test::make_stack("invariance-" + name, "engine:\n" + engine_yaml);
}

// 32 prompts of mixed lengths; half share a long system prefix (prefix-cache hits). Under
// ThreadSanitizer (5-15x slower, and the point there is the threads, not the number of
// prompts) the first 8: still mixed lengths, prefix hits and batches larger than one.
int num_prompts() {
  const char* sanitizer = std::getenv("TESSERA_SANITIZER");
  return sanitizer != nullptr && std::string_view(sanitizer) == "tsan" ? 8 : 32;
}

std::vector<std::vector<TokenId>> make_prompts(const Tokenizer& tok) {
  const std::vector<std::string> topics = {
      "the history of Rome", "how bees make honey", "a recipe for bread", "the rules of chess",
      "why the sky is blue", "the life of a lighthouse keeper", "sorting algorithms",
      "the water cycle"};
  std::string system = "You are a careful assistant. Answer briefly and precisely. ";
  for (int i = 0; i < 6; ++i) system += "Always check your facts before you answer, and say so when unsure. ";
  std::vector<std::vector<TokenId>> prompts;
  for (int i = 0; i < num_prompts(); ++i) {
    std::string text = (i % 2 ? system : std::string()) + "Tell me about " + topics[i % topics.size()];
    for (int r = 0; r < (i * 7) % 5; ++r) text += ", and more about " + topics[(i + r) % topics.size()];
    text += ".";
    prompts.push_back(tok.encode(text, true, false));
  }
  return prompts;
}

std::vector<std::vector<TokenId>> run(Engine& engine, const std::vector<std::vector<TokenId>>& prompts) {
  return test::run_greedy(engine, prompts, kNewTokens);
}

using test::check_all_blocks_free;

}  // namespace

TEST_CASE("greedy output is invariant across schedulers, KV caches, block sizes, prefix caching and chunk sizes") {
  if (!test::have_real_model()) return;
  // Reference per attention kernel: each prompt run alone. Naive and flash attention sum in
  // different orders, and the 8-bit re-quantization of activations can turn that last-bit
  // difference into another greedy token, so each kernel is compared with itself; how often
  // the two kernels agree is reported.
  std::map<std::string, std::vector<std::vector<TokenId>>> alone;
  std::vector<std::vector<TokenId>> prompts;
  for (const char* kernel : {"naive", "flash"}) {
    test::Stack s = make_stack(std::string("alone-") + kernel,
                         "  kv_cache: {plugin: contiguous, memory: 256MiB, dtype: f32}\n"
                         "  attention: {plugin: " + std::string(kernel) + "}\n");
    if (prompts.empty()) prompts = make_prompts(s.engine->model().tokenizer());
    for (const auto& p : prompts) alone[kernel].push_back(run(*s.engine, {p})[0]);
    for (const auto& a : alone[kernel]) REQUIRE(a.size() == static_cast<size_t>(kNewTokens));
  }
  int kernels_agree = 0;
  for (size_t i = 0; i < prompts.size(); ++i) kernels_agree += alone["naive"][i] == alone["flash"][i];
  MESSAGE("naive vs flash attention, prompts alone: " << kernels_agree << "/" << prompts.size()
                                                      << " greedy outputs identical");

  struct Variant { std::string name, kernel, yaml; };
  const std::vector<Variant> variants = {
      {"static-contiguous", "naive",
       "  scheduler: {plugin: static, max_num_seqs: 8}\n"
       "  kv_cache: {plugin: contiguous, memory: 256MiB, dtype: f32}\n"},
      {"continuous-paged16", "naive",
       "  scheduler: {plugin: continuous, max_num_seqs: 12}\n"
       "  kv_cache: {plugin: paged, block_size: 16, memory: 128MiB, dtype: f32, prefix_caching: false}\n"},
      {"chunked64-paged32-prefix", "naive",
       "  scheduler: {plugin: chunked-prefill, chunk_size: 64, max_batch_tokens: 256}\n"
       "  kv_cache: {plugin: paged, block_size: 32, memory: 128MiB, dtype: f32, prefix_caching: true}\n"},
      {"chunked16-paged8-prefix", "flash",
       "  scheduler: {plugin: chunked-prefill, chunk_size: 16, max_batch_tokens: 64}\n"
       "  kv_cache: {plugin: paged, block_size: 8, memory: 128MiB, dtype: f32, prefix_caching: true}\n"},
      {"chunked256-paged16", "flash",
       "  scheduler: {plugin: chunked-prefill, chunk_size: 256, max_batch_tokens: 512}\n"
       "  kv_cache: {plugin: paged, block_size: 16, memory: 128MiB, dtype: f32, prefix_caching: false}\n"},
      {"continuous-contiguous", "flash",
       "  scheduler: {plugin: continuous, max_num_seqs: 6}\n"
       "  kv_cache: {plugin: contiguous, memory: 256MiB, dtype: f32}\n"},
  };
  for (const Variant& v : variants) {
    INFO("stack " << v.name << " with " << v.kernel << " attention");
    test::Stack s = make_stack(v.name + "-" + v.kernel, v.yaml + "  attention: {plugin: " + v.kernel + "}\n");
    const auto out = run(*s.engine, prompts);
    int same = 0;
    for (size_t i = 0; i < prompts.size(); ++i) same += out[i] == alone[v.kernel][i];
    MESSAGE(v.name << " + " << v.kernel << ": " << same << "/" << prompts.size()
                   << " outputs identical to the prompts run alone; prefix-cache hit tokens "
                   << s.engine->stats().kv.prefix_hit_tokens);
    CHECK(same == static_cast<int>(prompts.size()));
    check_all_blocks_free(*s.engine);
  }
}

namespace {

// Cancellation mid-prefill, n = 3 forks (copy on write of shared blocks) and refused requests
// on a paged cache of `dtype`; afterwards no block is in use.
void check_lifecycle(const std::string& dtype) {
  test::Stack s = make_stack("lifecycle-" + dtype,
                       "  scheduler: {plugin: chunked-prefill, chunk_size: 16, max_batch_tokens: 48}\n"
                       "  kv_cache: {plugin: paged, block_size: 8, memory: 64MiB, prefix_caching: true, dtype: " +
                           dtype + "}\n");
  Engine& engine = *s.engine;
  const Tokenizer& tok = engine.model().tokenizer();
  std::string long_text;
  for (int i = 0; i < 40; ++i) long_text += "The quick brown fox jumps over the lazy dog. ";
  const auto long_prompt = tok.encode(long_text, true, false);

  // A request cancelled mid-prefill (its prompt needs many 16-token chunks).
  bool cancelled_finished = false;
  FinishReason cancelled_reason = FinishReason::kNone;
  GenerationRequest victim;
  victim.prompt = long_prompt;
  victim.params.max_tokens = 8;
  victim.on_event = [&](const GenerationEvent& ev) {
    if (ev.finished) { cancelled_finished = true; cancelled_reason = ev.finish_reason; }
  };
  uint64_t victim_id = 0;
  REQUIRE(engine.submit(victim, &victim_id).is_ok());

  // n = 3 samples of one prompt share its KV blocks (fork + copy on write).
  std::map<int, std::vector<TokenId>> samples;
  GenerationRequest forked;
  forked.prompt = tok.encode("Name a colour:", true, false);
  forked.n = 3;
  forked.params.temperature = 1.0f;
  forked.params.seed = 7;
  forked.params.has_seed = true;
  forked.params.max_tokens = 6;
  forked.params.ignore_eos = true;
  int forked_finished = 0;
  forked.on_event = [&](const GenerationEvent& ev) {
    for (const auto& t : ev.tokens) samples[ev.choice].push_back(t.token);
    if (ev.finished) ++forked_finished;
  };
  uint64_t forked_id = 0;
  REQUIRE(engine.submit(forked, &forked_id).is_ok());

  // Bad requests are refused alone.
  GenerationRequest too_long;
  too_long.prompt.assign(engine.max_context(), tok.encode("a", false, false)[0]);
  uint64_t ignored = 0;
  Status st = engine.submit(too_long, &ignored);
  CHECK(st.code() == StatusCode::kOutOfRange);
  CHECK(st.message().find("context") != std::string::npos);
  GenerationRequest past_context;
  past_context.prompt = tok.encode("hello", true, false);
  past_context.params.max_tokens = engine.max_context();
  st = engine.submit(past_context, &ignored);
  CHECK(st.code() == StatusCode::kOutOfRange);
  CHECK(st.message().find("max_tokens") != std::string::npos);
  GenerationRequest bad_token;
  bad_token.prompt = {1, 999999};
  CHECK(engine.submit(bad_token, &ignored).code() == StatusCode::kInvalidArgument);
  GenerationRequest empty;
  CHECK(engine.submit(empty, &ignored).code() == StatusCode::kInvalidArgument);

  engine.step();
  engine.step();  // two chunks of the long prompt are in
  engine.cancel(victim_id);
  engine.run_until_idle();

  CHECK(cancelled_finished);
  CHECK(cancelled_reason == FinishReason::kCancelled);
  CHECK(forked_finished == 3);
  REQUIRE(samples.size() == 3);
  for (const auto& [choice, tokens] : samples) CHECK(tokens.size() == 6);
  CHECK((samples[0] != samples[1] || samples[1] != samples[2]));  // seeds differ per sample
  check_all_blocks_free(engine);
}

}  // namespace

TEST_CASE("cancellation, forks and bad requests leave no KV block behind") {
  if (!test::have_real_model()) return;
  check_lifecycle("f16");
}

TEST_CASE("q8_0 KV cache: cancellation, forks and bad requests leave no KV block behind") {
  if (!test::have_real_model()) return;
  check_lifecycle("q8_0");
}

TEST_CASE("q8_0 KV cache: greedy output is invariant across schedulers, caches, block sizes and prefix hits") {
  // A q8_0 block holds the same quantized values whichever cache, block size or chunk wrote
  // it (each token's row is quantized on its own), so batching must not change greedy
  // output here either. Reference: each prompt alone on a contiguous q8_0 cache.
  if (!test::have_real_model()) return;
  for (const char* kernel : {"flash", "naive"}) {
    INFO("attention " << kernel);
    const std::string attention = std::string("  attention: {plugin: ") + kernel + "}\n";
    test::Stack ref = make_stack(std::string("q8-alone-") + kernel,
                           "  kv_cache: {plugin: contiguous, memory: 256MiB, dtype: q8_0}\n" + attention);
    const auto prompts = make_prompts(ref.engine->model().tokenizer());
    std::vector<std::vector<TokenId>> alone;
    for (const auto& p : prompts) alone.push_back(run(*ref.engine, {p})[0]);
    struct Variant { std::string name, yaml; };
    const std::vector<Variant> variants = {
        {"continuous-paged16",
         "  scheduler: {plugin: continuous, max_num_seqs: 12}\n"
         "  kv_cache: {plugin: paged, block_size: 16, memory: 128MiB, dtype: q8_0, prefix_caching: false}\n"},
        {"chunked16-paged8-prefix",
         "  scheduler: {plugin: chunked-prefill, chunk_size: 16, max_batch_tokens: 64}\n"
         "  kv_cache: {plugin: paged, block_size: 8, memory: 128MiB, dtype: q8_0, prefix_caching: true}\n"},
    };
    for (const Variant& v : variants) {
      INFO("stack " << v.name);
      test::Stack s = make_stack("q8-" + v.name + "-" + kernel, v.yaml + attention);
      const auto out = run(*s.engine, prompts);
      int same = 0;
      for (size_t i = 0; i < prompts.size(); ++i) same += out[i] == alone[i];
      MESSAGE("q8_0 " << v.name << " + " << kernel << ": " << same << "/" << prompts.size()
                      << " outputs identical to the prompts run alone; prefix-cache hit tokens "
                      << s.engine->stats().kv.prefix_hit_tokens);
      CHECK(same == static_cast<int>(prompts.size()));
      check_all_blocks_free(*s.engine);
    }
  }
}

TEST_CASE("a KV pool too small for one request is refused at start-up") {
  if (!test::have_real_model()) return;
  CHECK_THROWS_WITH_AS(make_stack("tiny-pool", "  kv_cache: {plugin: paged, block_size: 16, memory: 1MiB}\n"),
                       doctest::Contains("raise engine.kv_cache.memory"), std::runtime_error);
}

namespace {

struct PromptLogprobRun {
  std::vector<float> logprobs;        // entry i: prompt token i + 1
  std::vector<TokenId> tokens;        // the token each entry scored
  int32_t num_finished = 0;           // samples that ended (n of them)
  int32_t cached_prompt_tokens = -1;
  std::vector<TokenId> generated;     // choice 0's tokens
};

// Every prompt at once with prompt_logprobs (2 alternatives), n samples and `max_tokens`
// greedy tokens (0: the prompt only).
std::vector<PromptLogprobRun> run_prompt_logprobs(Engine& engine, const std::vector<std::vector<TokenId>>& prompts,
                                                  int32_t max_tokens, int32_t n) {
  std::vector<PromptLogprobRun> out(prompts.size());
  for (size_t i = 0; i < prompts.size(); ++i) {
    GenerationRequest r;
    r.prompt = prompts[i];
    r.params.temperature = 0;
    r.params.max_tokens = max_tokens;
    r.params.ignore_eos = true;
    r.n = n;
    r.prompt_logprobs = 2;
    r.on_event = [&out, i](const GenerationEvent& ev) {
      PromptLogprobRun& o = out[i];
      for (const SampledToken& t : ev.prompt_logprobs) {
        o.logprobs.push_back(t.logprob);
        o.tokens.push_back(t.token);
        CHECK(t.top.size() == 2);
        CHECK(t.top[0].logprob >= t.top[1].logprob);
        CHECK(t.logprob <= t.top[0].logprob);
      }
      if (ev.choice == 0)
        for (const SampledToken& t : ev.tokens) o.generated.push_back(t.token);
      if (ev.finished) {
        CHECK_MESSAGE(ev.error.is_ok(), ev.error.message());
        ++o.num_finished;
        o.cached_prompt_tokens = ev.num_cached_prompt_tokens;
      }
    };
    uint64_t id = 0;
    REQUIRE(engine.submit(std::move(r), &id).is_ok());
  }
  engine.run_until_idle();
  return out;
}

}  // namespace

TEST_CASE("prompt logprobs do not depend on chunk sizes, schedulers, block sizes or prefix-cache hits") {
  if (!test::have_real_model()) return;
  struct Variant { std::string name, yaml; int32_t n; };
  // The first is the reference: whole prompts in one step, no prefix cache (and no forks:
  // the contiguous cache has a region per sequence, too few for 12 prompts x 2).
  const std::vector<Variant> variants = {
      {"static-contiguous",
       "  scheduler: {plugin: static, max_num_seqs: 16}\n"
       "  kv_cache: {plugin: contiguous, memory: 256MiB, dtype: f32}\n", 1},
      {"chunked16-paged8-prefix",
       "  scheduler: {plugin: chunked-prefill, chunk_size: 16, max_batch_tokens: 64}\n"
       "  kv_cache: {plugin: paged, block_size: 8, memory: 128MiB, dtype: f32, prefix_caching: true}\n", 2},
      {"continuous-paged32-prefix",
       "  scheduler: {plugin: continuous, max_num_seqs: 6}\n"
       "  kv_cache: {plugin: paged, block_size: 32, memory: 128MiB, dtype: f32, prefix_caching: true}\n", 2},
  };
  std::vector<std::vector<TokenId>> prompts;
  std::vector<PromptLogprobRun> reference;
  std::vector<std::vector<TokenId>> reference_greedy;
  for (const Variant& v : variants) {
    INFO("stack " << v.name);
    test::Stack s = make_stack("promptlp-" + v.name, v.yaml + "  attention: {plugin: naive}\n");
    if (prompts.empty()) {
      prompts = make_prompts(s.engine->model().tokenizer());
      // 12 of them, 6 sharing the long system prefix; under TSan there are only 8 (4 sharing
      // it): resize(12) padded them with empty prompts, which submit() rightly refuses.
      prompts.resize(std::min<size_t>(prompts.size(), 12));
    }
    // Fill the prefix cache first: the prompt-logprob requests must not use it.
    const auto greedy = run(*s.engine, prompts);
    const auto zero = run_prompt_logprobs(*s.engine, prompts, 0, v.n);
    const auto with_generation = run_prompt_logprobs(*s.engine, prompts, kNewTokens, v.n);
    double worst = 0;
    for (size_t i = 0; i < prompts.size(); ++i) {
      const size_t n = prompts[i].size() - 1;
      for (const auto* r : {&zero[i], &with_generation[i]}) {
        REQUIRE(r->logprobs.size() == n);
        CHECK(r->tokens == std::vector<TokenId>(prompts[i].begin() + 1, prompts[i].end()));
        CHECK(r->num_finished == v.n);
        CHECK(r->cached_prompt_tokens == 0);
      }
      CHECK(zero[i].generated.empty());
      CHECK(with_generation[i].generated == greedy[i]);  // prompt logprobs change no output
      const auto& ref = reference.empty() ? zero[i] : reference[i];
      for (size_t k = 0; k < n; ++k) {
        worst = std::max(worst, static_cast<double>(std::fabs(zero[i].logprobs[k] - ref.logprobs[k])));
        CHECK(zero[i].logprobs[k] == with_generation[i].logprobs[k]);
      }
    }
    if (reference.empty()) {
      reference = zero;
      reference_greedy = greedy;
    }
    for (size_t i = 0; i < prompts.size(); ++i) CHECK(greedy[i] == reference_greedy[i]);
    MESSAGE(v.name << ": max |prompt logprob - reference| = " << worst << "; prefix-cache hit tokens "
                   << s.engine->stats().kv.prefix_hit_tokens);
    CHECK(worst < 1e-4);
    check_all_blocks_free(*s.engine);
  }
}
