// The real model against llama.cpp: prompt token ids, last-position logits and 64-token greedy
// continuations recorded by scripts/make-reference-fixtures.py (llama-cpp-python on the same
// GGUF). Also checks that generation is reproducible run to run, greedy and seeded.
#include <doctest/doctest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <map>
#include <cstring>
#include <numeric>
#include <random>

#include "support/real_model.h"
#include "support/reference_fixtures.h"
#include "support/test_env.h"
#include "tessera/config.h"
#include "tessera/cpu_backend.h"
#include "tessera/engine.h"
#include "tessera/model.h"
#include "tessera/model_runner.h"
#include "tessera/plugin_registry.h"
#include "tessera/quantize.h"
#include "tessera/stack.h"

using namespace tessera;

namespace {

using test::LogitDiff;
using test::ReferencePrompt;
using test::logit_diff;
using test::prompt_logits;
using test::run_all;

std::vector<ReferencePrompt> load_fixtures() {
  return test::load_reference_fixtures("smollm2-135m-instruct-q4_1");
}

// The fixtures were made with llama.cpp's KV cache in f32 (see the fixture script); the
// matching Tessera stack is smollm2-cpu-f32kv.yaml. The default (f16 cache) is reported.
StackConfig load_stack(PluginRegistry& registry, const char* file = "configs/smollm2-cpu-f32kv.yaml") {
  registry.scan_directory(test::plugin_dir());
  return load_stack_config((test::source_dir() / file).string(), registry);
}

}  // namespace

TEST_CASE("prompt token ids equal llama.cpp's") {
  if (!test::have_real_model()) return;
  test::check_prompt_ids(test::real_model_path(), load_fixtures());
}

TEST_CASE("last-position logits are close to llama.cpp's") {
  if (!test::have_real_model()) return;
  auto fixtures = load_fixtures();
  PluginRegistry registry;
  auto quantizer = test::plugin<Quantizer>(registry, "gguf");
  auto attention = test::plugin<AttentionKernel>(registry, "naive");
  auto model = Model::load(test::real_model_path(), *quantizer);
  CpuBackend backend(2);
  // 512 token slots in blocks 0..31 in order; f32 like the fixtures, f16 reported beside.
  ModelRunner runner(*model, backend, *quantizer, *attention, KvLayout{16, 32, KvDtype::kF32, KvDtype::kF32}, 256);
  ModelRunner runner_f16(*model, backend, *quantizer, *attention, KvLayout{16, 32, KvDtype::kF16, KvDtype::kF16}, 256);
  std::vector<int32_t> table(32);
  std::iota(table.begin(), table.end(), 0);
  double worst_fraction = 0;
  double worst_fraction_f16 = 0;
  for (const auto& f : fixtures) {
    INFO("prompt " << f.name);
    const std::vector<float> logits = prompt_logits(runner, f, table);
    const std::vector<float> logits_f16 = prompt_logits(runner_f16, f, table);
    const LogitDiff diff = logit_diff(logits, f);
    const double fraction = diff.fraction();
    worst_fraction = std::max(worst_fraction, fraction);
    worst_fraction_f16 = std::max(worst_fraction_f16, logit_diff(logits_f16, f).fraction());
    MESSAGE(f.name << ": max |logit - llama.cpp| = " << diff.max_abs << " over a range of " << diff.range
                   << " (" << 100 * fraction << "%)");
    // Same floats in the same order as llama.cpp's x86 CPU path: expected bit-identical;
    // the bound is 1% of the logit range.
    CHECK(fraction < 0.01);
    CHECK(test::argmax(logits) == test::argmax(f.logits));
  }
  MESSAGE("worst max-abs logit difference: " << 100 * worst_fraction << "% of the logit range (f32 KV cache); "
          << 100 * worst_fraction_f16 << "% with an f16 KV cache");
}

TEST_CASE("quantizer.gguf: a grouped matmul equals one matmul per weight, bit for bit") {
  // The runner applies q/k/v and gate/up as groups (one input conversion, one parallel pass);
  // every output must be exactly what a matmul of its own would give, at decode and batch
  // sizes (1 row, a partial tile, several tiles and panels).
  if (!test::have_real_model()) return;
  PluginRegistry registry;
  registry.scan_directory(test::plugin_dir());
  PluginContext ctx{&host_logger(), ""};
  auto quantizer = registry.create<Quantizer>("gguf", PluginConfig("gguf", "engine.quantizer", {}), ctx);
  auto model = Model::load(test::real_model_path(), *quantizer);
  auto* grouped = dynamic_cast<GroupedMatmul*>(quantizer.get());
  REQUIRE(grouped != nullptr);
  CpuBackend backend(2);
  const LayerWeights& layer = model->layers()[3];
  const PreparedWeight* weights[] = {layer.wq.get(), layer.wk.get(), layer.wv.get()};
  const int64_t cols = layer.wq->cols();
  std::mt19937 rng(5);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  for (int64_t tokens : {1, 3, 9}) {
    CAPTURE(tokens);
    std::vector<float> x(static_cast<size_t>(tokens * cols));
    for (float& v : x) v = dist(rng);
    std::vector<std::vector<float>> separate(3), together(3);
    std::vector<MatmulTarget> targets;
    for (int i = 0; i < 3; ++i) {
      separate[i].assign(static_cast<size_t>(tokens * weights[i]->rows()), 0.0f);
      together[i].assign(separate[i].size(), -1.0f);
      quantizer->matmul(*weights[i], x.data(), tokens, separate[i].data(), backend.executor());
      targets.push_back({weights[i], together[i].data()});
    }
    grouped->matmul_group(targets, x.data(), tokens, backend.executor());
    for (int i = 0; i < 3; ++i)
      CHECK(std::memcmp(separate[i].data(), together[i].data(), separate[i].size() * sizeof(float)) == 0);
  }
}

TEST_CASE("greedy continuations equal llama.cpp's, batched and alone") {
  if (!test::have_real_model()) return;
  auto fixtures = load_fixtures();
  PluginRegistry registry;
  auto engine = build_engine(load_stack(registry), registry);
  const std::vector<GenerationRequest> reqs = test::greedy_requests(fixtures);
  const auto batched = run_all(*engine, reqs);
  int identical = 0;
  for (size_t i = 0; i < fixtures.size(); ++i) {
    const auto& ref = fixtures[i].greedy_ids;
    const size_t agree = std::mismatch(batched[i].begin(), batched[i].end(), ref.begin(), ref.end()).first -
                         batched[i].begin();
    MESSAGE(fixtures[i].name << ": first " << agree << " of " << ref.size() << " greedy tokens equal llama.cpp's");
    identical += batched[i] == ref;
    CHECK(batched[i] == ref);
  }
  MESSAGE(identical << "/" << fixtures.size() << " greedy continuations of 64 tokens identical to llama.cpp");
  // The same prompt alone gives the same tokens as in the batch.
  const auto alone = run_all(*engine, {reqs[2]});
  CHECK(alone[0] == batched[2]);

  // Reported, not gated: the default stack (f16 KV cache) against the same fixtures.
  PluginRegistry registry_f16;
  auto engine_f16 = build_engine(load_stack(registry_f16, "configs/smollm2-cpu.yaml"), registry_f16);
  const auto batched_f16 = run_all(*engine_f16, reqs);
  int identical_f16 = 0;
  for (size_t i = 0; i < fixtures.size(); ++i) identical_f16 += batched_f16[i] == fixtures[i].greedy_ids;
  MESSAGE(identical_f16 << "/" << fixtures.size() << " identical with the default f16 KV cache");
}

namespace {

// Mean negative log-likelihood of each next token of `tokens` (one forward pass over the whole
// sequence, logits for every position) and the argmax prediction at each position.
struct TextScore {
  double mean_nll = 0;
  std::vector<size_t> predictions;
};

TextScore score_text(ModelRunner& runner, const std::vector<TokenId>& tokens, size_t vocab) {
  std::vector<int32_t> table(64);
  std::iota(table.begin(), table.end(), 0);
  const auto n = static_cast<int32_t>(tokens.size());
  RunnerSequence seq{tokens.data(), n, 0, table, n};
  std::vector<float> logits;
  REQUIRE(runner.forward({&seq, 1}, &logits).is_ok());
  REQUIRE(logits.size() == static_cast<size_t>(n) * vocab);
  TextScore score;
  for (int32_t i = 0; i + 1 < n; ++i) {
    const float* row = logits.data() + static_cast<size_t>(i) * vocab;
    const double top = *std::max_element(row, row + vocab);
    double sum = 0;
    for (size_t v = 0; v < vocab; ++v) sum += std::exp(static_cast<double>(row[v]) - top);
    score.mean_nll += top + std::log(sum) - row[tokens[i + 1]];
    score.predictions.push_back(std::max_element(row, row + vocab) - row);
  }
  score.mean_nll /= n - 1;
  return score;
}

}  // namespace

// quantizer.gguf's `layout: interleaved` (the default stack's) sums each Q4_1 block exactly
// instead of in ggml's order, so its logits are not llama.cpp's bits. The model amplifies any
// such rounding difference: an activation that moves by one ulp can round to the next 8-bit
// quantum before the next matmul, so the difference grows to the size of the quantization
// noise, as with the f16 KV cache. What must hold is that it is noise: the model's perplexity
// on a text is the same, and so are nearly all of its next-token predictions.
TEST_CASE("the interleaved Q4_1 layout: same perplexity as ggml's order, logits near llama.cpp's") {
  if (!test::have_real_model()) return;
  auto fixtures = load_fixtures();
  PluginRegistry registry;
  registry.scan_directory(test::plugin_dir());
  PluginContext ctx{&host_logger(), ""};
  auto ggml_quantizer = registry.create<Quantizer>("gguf", PluginConfig("gguf", "engine.quantizer", {}), ctx);
  auto quantizer = registry.create<Quantizer>(
      "gguf", PluginConfig("gguf", "engine.quantizer", {{"layout", std::string("interleaved")}}), ctx);
  auto attention = registry.create<AttentionKernel>("naive", PluginConfig("naive", "engine.attention", {}), ctx);
  auto ggml_model = Model::load(test::real_model_path(), *ggml_quantizer);
  auto model = Model::load(test::real_model_path(), *quantizer);
  CpuBackend backend(2);
  ModelRunner ggml_runner(*ggml_model, backend, *ggml_quantizer, *attention, KvLayout{16, 64, KvDtype::kF32, KvDtype::kF32}, 1024);
  ModelRunner runner(*model, backend, *quantizer, *attention, KvLayout{16, 64, KvDtype::kF32, KvDtype::kF32}, 1024);

  std::vector<int32_t> table(64);
  std::iota(table.begin(), table.end(), 0);
  double worst_fraction = 0;
  for (const auto& f : fixtures) {
    worst_fraction = std::max(worst_fraction, logit_diff(prompt_logits(runner, f, table), f).fraction());
  }
  MESSAGE("interleaved layout: worst max-abs logit difference from llama.cpp "
          << 100 * worst_fraction << "% of the logit range (f32 KV cache)");
  CHECK(worst_fraction < 0.05);  // the size of the quantization noise (f16 KV cache: ~3%)

  std::ifstream text_in(test::source_dir() / "tests/fixtures/text/perplexity-en.txt");
  REQUIRE(text_in.good());
  const std::string text((std::istreambuf_iterator<char>(text_in)), std::istreambuf_iterator<char>());
  auto file = gguf::GgufFile::open(test::real_model_path());
  const std::vector<TokenId> tokens = Tokenizer::from_gguf(*file)->encode(text, true, false);
  REQUIRE(tokens.size() > 300);
  REQUIRE(tokens.size() <= 1024);
  const size_t vocab = fixtures.front().logits.size();
  const TextScore ref = score_text(ggml_runner, tokens, vocab);
  const TextScore got = score_text(runner, tokens, vocab);
  // For scale, the same comparison for a change the project already accepts: the f16 KV cache.
  ModelRunner f16_runner(*ggml_model, backend, *ggml_quantizer, *attention, KvLayout{16, 64, KvDtype::kF16, KvDtype::kF16}, 1024);
  const TextScore f16 = score_text(f16_runner, tokens, vocab);
  const auto agreement = [&](const TextScore& other) {
    size_t same = 0;
    for (size_t i = 0; i < ref.predictions.size(); ++i) same += ref.predictions[i] == other.predictions[i];
    return static_cast<double>(same) / ref.predictions.size();
  };
  MESSAGE(tokens.size() << "-token text, perplexity: " << std::exp(ref.mean_nll) << " ggml order, "
          << std::exp(got.mean_nll) << " interleaved, " << std::exp(f16.mean_nll)
          << " ggml order with an f16 KV cache; next-token argmax equal to ggml order's at "
          << 100 * agreement(got) << "% (interleaved) and " << 100 * agreement(f16)
          << "% (f16 KV) of positions");
  CHECK(std::fabs(got.mean_nll - ref.mean_nll) < 0.01 * ref.mean_nll);
  CHECK(agreement(got) > 0.9);
}

TEST_CASE("generation with a fixed seed is reproducible, greedy and sampled") {
  if (!test::have_real_model()) return;
  PluginRegistry registry;
  auto engine = build_engine(load_stack(registry), registry);
  const auto& tok = engine->model().tokenizer();
  GenerationRequest sampled;
  sampled.prompt = tok.encode("Write a short poem about the sea.", true, false);
  sampled.params.temperature = 0.9f;
  sampled.params.top_k = 40;
  sampled.params.top_p = 0.95f;
  sampled.params.seed = 1234;
  sampled.params.has_seed = true;
  sampled.params.max_tokens = 40;
  sampled.params.ignore_eos = true;
  GenerationRequest greedy = sampled;
  greedy.params.temperature = 0;
  GenerationRequest other_seed = sampled;
  other_seed.params.seed = 99;

  const auto first = run_all(*engine, {sampled, greedy, other_seed});
  const auto second = run_all(*engine, {greedy, sampled});
  CHECK(first[0].size() == 40);
  CHECK(first[0] == second[1]);  // sampled, same seed, different batch position
  CHECK(first[1] == second[0]);  // greedy
  CHECK(first[0] != first[2]);   // another seed samples another continuation
  // A second engine (a new process would be the same) reproduces it too.
  PluginRegistry registry2;
  auto engine2 = build_engine(load_stack(registry2), registry2);
  CHECK(run_all(*engine2, {sampled})[0] == first[0]);
}

// Q5_K weights (what llama.cpp's Q5_K_M and Q5_K_S files hold) against llama.cpp.
// `tessera quantize --pure --type Q5_K` of the default model writes the tensors that
// llama-quantize --allow-requantize --pure ... Q5_K_S writes (bit for bit: test_quantize's
// SHA-256 fixtures), Q5_K where a row is whole 256-element super-blocks (ffn_down) and Q5_1
// elsewhere, so llama.cpp's fixtures made on that file (scripts/make-reference-fixtures.py
// --name smollm2-135m-instruct-q5_k-pure --no-tiled) apply to this one. --no-tiled: from 8
// rows on llama.cpp sends K-quant matmuls to its tiled kernel, whose order is not
// ggml_vec_dot's, so its own logits depend on the batch; without it every row is ggml_vec_dot,
// which quantizer.gguf's ggml layout reproduces. The reference stack: ggml's order, naive
// attention, f32 KV cache. Measured: logits identical (max difference 0) and 9/9 greedy
// continuations identical.
TEST_CASE("Q5_K weights: last-position logits and greedy continuations equal llama.cpp's") {
  if (!test::have_real_model()) return;
  const auto fixtures = test::load_reference_fixtures("smollm2-135m-instruct-q5_k-pure");
  quant::QuantizeOptions options;
  options.input = test::real_model_path();
  options.output = (test::scratch_dir("reference_q5_k") / "q5_k-pure.gguf").string();
  options.target = GgmlType::Q5_K;
  options.pure = true;
  options.threads = 2;
  const quant::QuantizeResult result = quant::quantize_model(options);
  CHECK(std::count_if(result.plan.begin(), result.plan.end(),
                      [](const quant::TensorPlan& p) { return p.to == GgmlType::Q5_K; }) == 30);

  PluginRegistry registry;
  auto quantizer = test::plugin<Quantizer>(registry, "gguf");
  auto attention = test::plugin<AttentionKernel>(registry, "naive");
  auto model = Model::load(options.output, *quantizer);
  CpuBackend backend(2);
  ModelRunner runner(*model, backend, *quantizer, *attention, KvLayout{16, 32, KvDtype::kF32, KvDtype::kF32}, 256);
  std::vector<int32_t> table(32);
  std::iota(table.begin(), table.end(), 0);
  double worst = 0;
  for (const auto& f : fixtures) {
    INFO("prompt " << f.name);
    const std::vector<float> logits = prompt_logits(runner, f, table);
    const LogitDiff diff = logit_diff(logits, f);
    worst = std::max(worst, diff.max_abs);
    CHECK(diff.fraction() < 0.01);
    CHECK(test::argmax(logits) == test::argmax(f.logits));
  }
  MESSAGE("Q5_K file: worst max |logit - llama.cpp| = " << worst);

  PluginRegistry stack_registry;
  StackConfig stack = load_stack(stack_registry);
  stack.model.path = options.output;
  auto engine = build_engine(stack, stack_registry);
  const auto got = run_all(*engine, test::greedy_requests(fixtures));
  int identical = 0;
  for (size_t i = 0; i < fixtures.size(); ++i) {
    INFO("prompt " << fixtures[i].name);
    identical += got[i] == fixtures[i].greedy_ids;
    CHECK(got[i] == fixtures[i].greedy_ids);
  }
  MESSAGE(identical << "/" << fixtures.size() << " greedy continuations identical to llama.cpp's on Q5_K");
}
