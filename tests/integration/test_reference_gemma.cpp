// Gemma 3 270M (GGUF Q4_K_M) against llama.cpp: prompt token ids (SentencePiece vocabulary
// with <start_of_turn>/<end_of_turn>; identical), last-position logits (within quantization
// noise, same argmax) and 32-token greedy continuations (reported; not yet all identical)
// recorded by scripts/make-reference-fixtures.py --prompts gemma. One prompt is longer than
// the 512-token sliding window of the local layers. Also: the sliding window is honoured the
// same way by attention.flash, the paged KV cache with prefix caching, and chunked prefill.
#include <doctest/doctest.h>

#include <numeric>

#include "support/real_model.h"
#include "support/reference_fixtures.h"
#include "support/stacks.h"
#include "support/test_env.h"
#include "tessera/chat_template.h"
#include "tessera/config.h"
#include "tessera/cpu_backend.h"
#include "tessera/engine.h"
#include "tessera/model.h"
#include "tessera/model_runner.h"
#include "tessera/plugin_registry.h"
#include "tessera/stack.h"

using namespace tessera;

namespace {

std::vector<test::ReferencePrompt> load_fixtures() {
  return test::load_reference_fixtures("gemma-3-270m-q4_k_m");
}

// The reference stack unless `file` names another; the model path is the test's.
StackConfig load_stack(PluginRegistry& registry, const char* file = "configs/gemma3-270m-f32kv.yaml") {
  registry.scan_directory(test::plugin_dir());
  StackConfig config = load_stack_config((test::source_dir() / file).string(), registry);
  config.model.path = test::gemma_model_path();
  return config;
}

}  // namespace

TEST_CASE("gemma3: the architecture as llama.cpp reads it") {
  if (!test::have_gemma_model()) return;
  PluginRegistry registry;
  auto model = Model::load(test::gemma_model_path(), *test::plugin<Quantizer>(registry, "gguf"));
  const ModelHparams& hp = model->hparams();
  CHECK(hp.architecture == "gemma3");
  CHECK(hp.num_layers == 18);
  CHECK(hp.head_dim == 256);
  CHECK(hp.num_heads * hp.head_dim != hp.embedding_dim);  // q is 1,024 wide, the residual 640
  CHECK(hp.sliding_window == 512);
  CHECK(hp.rope.neox);
  CHECK(hp.rope.freq_base == 1000000.0f);
  CHECK(hp.rope_local.freq_base == 10000.0f);
  CHECK(hp.embedding_scale == doctest::Approx(std::sqrt(640.0f)));
  CHECK(hp.ffn_activation == FfnActivation::kGeluTanh);
  // Every sixth layer is global (llama.cpp's set_swa_pattern(6)).
  for (int32_t l = 0; l < hp.num_layers; ++l) CHECK(hp.layer_is_local[l] == (l % 6 != 5));
  CHECK(!model->layers()[0].q_norm.empty());
  CHECK(!model->layers()[0].post_ffn_norm.empty());
  CHECK(detect_chat_template(model->chat_template()) == "gemma");
  CHECK(apply_chat_template(model->chat_template(), {{"system", "Be brief."}, {"user", "Hi"}}, true) ==
        "<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n");
  const auto& eog = model->tokenizer().end_of_generation_ids();
  CHECK(eog.count(106) == 1);  // <end_of_turn>
}

TEST_CASE("gemma3: prompt token ids equal llama.cpp's") {
  if (!test::have_gemma_model()) return;
  test::check_prompt_ids(test::gemma_model_path(), load_fixtures());
}

TEST_CASE("gemma3: last-position logits near llama.cpp's, same argmax (f32 KV, naive and flash attention)") {
  if (!test::have_gemma_model()) return;
  auto fixtures = load_fixtures();
  PluginRegistry registry;
  auto quantizer = test::plugin<Quantizer>(registry, "gguf");
  auto naive = test::plugin<AttentionKernel>(registry, "naive");
  auto flash = test::plugin<AttentionKernel>(registry, "flash");
  auto model = Model::load(test::gemma_model_path(), *quantizer);
  CpuBackend backend(2);
  // 1,024 token slots in blocks 0..63 in order.
  const KvLayout layout{16, 64, KvDtype::kF32, KvDtype::kF32};
  ModelRunner runner(*model, backend, *quantizer, *naive, layout, 1024);
  ModelRunner flash_runner(*model, backend, *quantizer, *flash, layout, 1024);
  std::vector<int32_t> table(64);
  std::iota(table.begin(), table.end(), 0);
  double worst = 0, worst_flash = 0;
  for (const auto& f : fixtures) {
    INFO("prompt " << f.name);
    const std::vector<float> logits = test::prompt_logits(runner, f, table);
    const test::LogitDiff diff = test::logit_diff(logits, f);
    const test::LogitDiff diff_flash = test::logit_diff(test::prompt_logits(flash_runner, f, table), f);
    worst = std::max(worst, diff.fraction());
    worst_flash = std::max(worst_flash, diff_flash.fraction());
    MESSAGE(f.name << " (" << f.prompt_ids.size() << " tokens): max |logit - llama.cpp| = " << diff.max_abs
                   << " over a range of " << diff.range << "; flash attention " << diff_flash.max_abs);
    // Not bit-identical (unlike SmolLM2's Q4_1): llama.cpp repacks this file's Q4_K weights
    // for AVX2 at load (which alone moves its own logits by ~0.46 here) and sums Q5_0/K-quant
    // dots in orders not yet mirrored, so one-ulp differences grow through 18 layers to the
    // size of the quantization noise (as the interleaved Q4_1 layout's do, ~3% of the range).
    // Measured: 2.1-5.1% of the range (naive), 1.8-4.6% (flash).
    CHECK(diff.fraction() < 0.06);
    CHECK(diff_flash.fraction() < 0.06);
    CHECK(test::argmax(logits) == test::argmax(f.logits));
  }
  MESSAGE("gemma3 worst max-abs logit difference: " << 100 * worst << "% of the logit range (naive), "
          << 100 * worst_flash << "% (flash)");
}

TEST_CASE("gemma3: greedy continuations equal llama.cpp's, batched and alone") {
  if (!test::have_gemma_model()) return;
  auto fixtures = load_fixtures();
  PluginRegistry registry;
  auto engine = build_engine(load_stack(registry), registry);
  const std::vector<GenerationRequest> reqs = test::greedy_requests(fixtures);
  const auto batched = test::run_all(*engine, reqs);
  int identical = 0;
  for (size_t i = 0; i < fixtures.size(); ++i) {
    const auto& ref = fixtures[i].greedy_ids;
    const size_t agree = std::mismatch(batched[i].begin(), batched[i].end(), ref.begin(), ref.end()).first -
                         batched[i].begin();
    MESSAGE(fixtures[i].name << ": first " << agree << " of " << ref.size() << " greedy tokens equal llama.cpp's");
    identical += batched[i] == ref;
    // The logits are not bit-identical (see above), so a continuation follows llama.cpp's
    // until a near-tie flips (measured: 3 of 8 identical, the others after 2-18 tokens).
    // What must hold: the first token (the prompt's argmax) and the full length.
    CHECK(agree >= 1);
    CHECK(batched[i].size() == ref.size());
  }
  MESSAGE(identical << "/" << fixtures.size() << " gemma3 greedy continuations identical to llama.cpp's");
  const auto alone = test::run_all(*engine, {reqs.back()});
  CHECK(alone[0] == batched.back());
}

TEST_CASE("gemma3: the serving stack (chunked prefill, paged KV with prefix hits, flash) past the window") {
  // The long prompt crosses the 512-token window. Its greedy continuation must not depend on
  // the chunk size, on the prefix cache or on the attention kernel beyond flash's rounding:
  // the serving stack (f32 KV so only the kernel differs) is compared with itself run twice
  // (the second run's prompt comes from the prefix cache) and in 64-token chunks.
  if (!test::have_gemma_model()) return;
  auto fixtures = load_fixtures();
  const test::ReferencePrompt& longest = *std::max_element(
      fixtures.begin(), fixtures.end(),
      [](const auto& a, const auto& b) { return a.prompt_ids.size() < b.prompt_ids.size(); });
  REQUIRE(longest.prompt_ids.size() > 512);
  const std::vector<GenerationRequest> reqs = test::greedy_requests({longest});
  auto serving = [&](int chunk) {
    return test::make_stack("gemma-serving-" + std::to_string(chunk),
                            "model: {path: " + test::gemma_model_path() + "}\n"
                            "engine:\n  kv_cache: {dtype: f32}\n"
                            "  scheduler: {max_batch_tokens: " + std::to_string(chunk) + "}\n",
                            "configs/gemma3-270m.yaml");
  };
  test::Stack stack = serving(512);
  const auto first = test::run_all(*stack.engine, reqs);
  const auto cached = test::run_all(*stack.engine, reqs);  // prompt blocks from the prefix cache
  CHECK(stack.engine->stats().kv.prefix_hit_tokens > 512);
  test::Stack chunked = serving(64);
  const auto small_chunks = test::run_all(*chunked.engine, reqs);
  CHECK(cached[0] == first[0]);
  CHECK(small_chunks[0] == first[0]);
  test::check_all_blocks_free(*stack.engine);
  const size_t agree = std::mismatch(first[0].begin(), first[0].end(), longest.greedy_ids.begin()).first -
                       first[0].begin();
  MESSAGE("serving stack (flash, paged, chunked prefill, f32 KV): first " << agree
          << " of " << longest.greedy_ids.size() << " greedy tokens equal llama.cpp's on the "
          << longest.prompt_ids.size() << "-token prompt");
}
