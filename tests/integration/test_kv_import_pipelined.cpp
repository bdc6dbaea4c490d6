// Layer-pipelined decode start (disaggregation): a decode engine schedules an imported
// sequence once the first KV layer landed, and its first step's forward waits for each
// layer before reading it. Two real engines on the real model, the transfer played by a
// thread that moves the rows layer by layer with the pauses each case needs:
//   - every layer arrives, slowly: the step starts before the last layer (counted), the
//     output equals a colocated run's, next to a local request decoding in the same steps;
//   - the transfer fails after some layers, or stalls past layer_wait: the step's result for
//     that sequence is discarded, the prompt is computed on the decode engine, the output is
//     still identical, and no block is left on either engine;
//   - pipelined_start off: the sequence waits for the last layer, as before;
//   - on the prefill side, an export released before its prefill finished holds nothing.
#include <doctest/doctest.h>

#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "support/real_model.h"
#include "support/stacks.h"
#include "support/test_env.h"
#include "tessera/config.h"
#include "tessera/engine.h"
#include "tessera/kv_transfer.h"
#include "tessera/plugin_registry.h"
#include "tessera/stack.h"

using namespace tessera;

namespace {

constexpr int32_t kMaxTokens = 12;
const char* const kPrompt =
    "The history of the printing press begins in the fifteenth century, when movable type made "
    "books cheaper to produce than ever before. Within fifty years printing shops had spread";
const char* const kOtherPrompt = "Once upon a time, in a small village by the sea,";

struct Rig {
  std::unique_ptr<PluginRegistry> registry;
  std::unique_ptr<Engine> prefill, decode;
};

Rig make_rig() {
  const auto path = test::write_stack_file("kv-import-pipelined",
                                           "engine:\n"
                                           "  scheduler: {plugin: chunked-prefill, chunk_size: 32, max_batch_tokens: 64}\n"
                                           "  kv_cache: {plugin: paged, block_size: 16, memory: 64MiB}\n");
  Rig r;
  r.registry = std::make_unique<PluginRegistry>();
  r.registry->scan_directory(test::plugin_dir());
  const StackConfig config = load_stack_config(path.string(), *r.registry);
  r.prefill = std::make_unique<Engine>(build_engine_components(config, *r.registry));
  r.decode = std::make_unique<Engine>(build_engine_components(config, *r.registry));
  return r;
}

using test::Outcome;

GenerationRequest greedy(const Engine& engine, const std::string& text, Outcome* o) {
  GenerationRequest r;
  r.prompt = engine.model().tokenizer().encode(text, true, false);
  r.params.temperature = 0;
  r.params.max_tokens = kMaxTokens;
  r.params.ignore_eos = true;
  r.on_event = test::record_into(o);
  return r;
}

std::vector<TokenId> colocated(Engine& engine, const std::string& text) {
  Outcome o;
  uint64_t id = 0;
  REQUIRE(engine.submit(greedy(engine, text, &o), &id).is_ok());
  engine.run_until_idle();
  REQUIRE(o.finished);
  return o.tokens;
}

// The prefill engine computes the prompt, samples the first token and holds the blocks for
// the transfer (as the gateway's prefill host does: one token, the result carries it).
struct Prefilled {
  std::shared_ptr<KvExport> exp;
  PrefillResult result;
};

Prefilled prefill(Engine& engine, const std::string& text) {
  auto first = std::make_shared<Outcome>();
  GenerationRequest r = greedy(engine, text, first.get());
  r.params.max_tokens = 1;
  r.on_event = [first](const GenerationEvent& ev) {
    for (const auto& t : ev.tokens) first->tokens.push_back(t.token);
  };
  Prefilled p;
  p.exp = std::make_shared<KvExport>();
  r.kv_export = p.exp;
  uint64_t id = 0;
  REQUIRE(engine.submit(std::move(r), &id).is_ok());
  engine.run_until_idle();
  REQUIRE(p.exp->wait_ready(1.0));
  p.result = p.exp->result();
  REQUIRE(p.result.finish == FinishReason::kNone);
  REQUIRE(first->tokens.size() == 1);
  p.result.tokens.push_back(SampledToken{});
  p.result.tokens.back().token = first->tokens[0];
  return p;
}

// How the transfer thread moves the rows.
struct Script {
  double pause_after_first_layer = 0;  // seconds
  double pause_per_layer = 0;
  int32_t fail_after_layers = -1;      // >= 0: complete(error) after this many layers
  int32_t stall_after_layers = -1;     // >= 0: stop sending for stall_seconds, then go on
  double stall_seconds = 0;
};

struct TransferResult {
  int32_t layers_written = 0;
  Status write_error;
};

void transfer(KvExport& exp, KvImport& imp, const Script& script, TransferResult* out) {
  if (!imp.wait_target(5.0).is_ok()) return;
  const int32_t layers = exp.result().num_layers;
  std::vector<uint8_t> k, v;
  Status outcome = Status::ok();
  for (int32_t layer = 0; layer < layers; ++layer) {
    if (layer == script.fail_after_layers) {
      outcome = data_loss("injected: the transfer broke at layer " + std::to_string(layer));
      break;
    }
    if (layer == script.stall_after_layers)
      std::this_thread::sleep_for(std::chrono::duration<double>(script.stall_seconds));
    // No doctest assertion on this thread: a failed read ends the transfer with its error.
    Status st = exp.read_layer(layer, &k, &v);
    if (st.is_ok()) st = imp.write_layer(layer, k, v);
    if (!st.is_ok()) {
      out->write_error = st;
      outcome = st;
      break;
    }
    ++out->layers_written;
    std::this_thread::sleep_for(std::chrono::duration<double>(
        layer == 0 ? script.pause_after_first_layer : script.pause_per_layer));
  }
  imp.complete(outcome);
  exp.release();
}

struct Imported {
  Outcome outcome;
  TransferResult transfer;
};

// Runs one imported request on the decode engine (and, when `local` is set, a colocated
// request decoding in the same steps), driving the engine from this thread.
Imported run_import(Rig& rig, const Script& script, KvImport::Options options, Outcome* local = nullptr) {
  Prefilled prefilled = prefill(*rig.prefill, kPrompt);
  std::shared_ptr<KvExport> exp = prefilled.exp;
  Imported result;
  uint64_t id = 0;
  if (local) {
    REQUIRE(rig.decode->submit(greedy(*rig.decode, kOtherPrompt, local), &id).is_ok());
    for (int i = 0; i < 3; ++i) rig.decode->step();  // its prompt computed, decoding
  }
  GenerationRequest r = greedy(*rig.decode, kPrompt, &result.outcome);
  auto imp = std::make_shared<KvImport>(prefilled.result, options);
  r.kv_import = imp;
  REQUIRE(rig.decode->submit(std::move(r), &id).is_ok());
  std::thread mover([&] { transfer(*exp, *imp, script, &result.transfer); });
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (!(result.outcome.finished && (!local || local->finished)) && std::chrono::steady_clock::now() < deadline) {
    if (!rig.decode->step()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  mover.join();
  rig.decode->run_until_idle();  // the landed notice of a transfer that ended last
  rig.prefill->run_until_idle();  // the released export's blocks go back
  return result;
}

}  // namespace

TEST_CASE("an imported sequence decodes before its last KV layer lands, with identical output") {
  if (!test::have_real_model()) return;
  Rig rig = make_rig();
  const std::vector<TokenId> want = colocated(*rig.prefill, kPrompt);
  const std::vector<TokenId> want_other = colocated(*rig.prefill, kOtherPrompt);
  REQUIRE(want.size() == static_cast<size_t>(kMaxTokens));

  Script slow;
  // Long enough that the engine's next step starts while layers 1.. are missing, even under a
  // sanitizer (a step there takes a few hundred ms).
  slow.pause_after_first_layer = 1.0;
  slow.pause_per_layer = 0.002;
  Outcome local;
  const Imported got = run_import(rig, slow, KvImport::Options{true, 5.0}, &local);
  CHECK(got.outcome.reason == FinishReason::kLength);
  CHECK(got.outcome.tokens == want);
  CHECK(local.tokens == want_other);
  const EngineStats s = rig.decode->stats();
  CHECK(s.num_kv_pipelined_starts >= 1);
  CHECK(s.kv_layer_wait_seconds > 0.05);  // it waited inside the forward for the layers
  CHECK(s.num_kv_imports == 1);
  CHECK(s.num_kv_import_fallbacks == 0);
  CHECK(got.transfer.layers_written == rig.decode->model().hparams().num_layers);
  test::check_all_blocks_free(*rig.decode);
  test::check_all_blocks_free(*rig.prefill);
  MESSAGE("pipelined starts " << s.num_kv_pipelined_starts << ", waited " << s.kv_layer_wait_seconds * 1e3
                              << " ms for layers inside the forward");
}

TEST_CASE("a pipelined import that fails or stalls mid-transfer is recomputed on the decode engine") {
  if (!test::have_real_model()) return;
  Rig rig = make_rig();
  const std::vector<TokenId> want = colocated(*rig.prefill, kPrompt);
  const int32_t layers = rig.decode->model().hparams().num_layers;

  SUBCASE("the transfer breaks after a third of the layers") {
    Script broken;
    broken.pause_after_first_layer = 0.1;
    broken.fail_after_layers = layers / 3;
    Outcome local;
    const Imported got = run_import(rig, broken, KvImport::Options{true, 5.0}, &local);
    CHECK(got.outcome.tokens == want);
    CHECK(got.outcome.reason == FinishReason::kLength);
    CHECK(local.finished);
    CHECK(rig.decode->stats().num_kv_import_fallbacks == 1);
    CHECK(rig.decode->stats().num_kv_imports == 0);
  }
  SUBCASE("a layer does not land within layer_wait") {
    Script stalled;
    stalled.pause_after_first_layer = 0.05;
    stalled.stall_after_layers = 5;
    stalled.stall_seconds = 0.6;
    const Imported got = run_import(rig, stalled, KvImport::Options{true, 0.15});
    CHECK(got.outcome.tokens == want);
    CHECK(rig.decode->stats().num_kv_import_fallbacks == 1);
    // The import detached itself when the wait gave up: the late rows were refused.
    CHECK(got.transfer.layers_written == 5);
    CHECK(got.transfer.write_error.code() == StatusCode::kDeadlineExceeded);
  }
  test::check_all_blocks_free(*rig.decode);
  test::check_all_blocks_free(*rig.prefill);
}

TEST_CASE("pipelined_start off: an imported sequence waits for its last KV layer") {
  if (!test::have_real_model()) return;
  Rig rig = make_rig();
  const std::vector<TokenId> want = colocated(*rig.prefill, kPrompt);
  Script slow;
  slow.pause_after_first_layer = 0.05;
  slow.pause_per_layer = 0.001;
  const Imported got = run_import(rig, slow, KvImport::Options{false, 5.0});
  CHECK(got.outcome.tokens == want);
  const EngineStats s = rig.decode->stats();
  CHECK(s.num_kv_pipelined_starts == 0);
  CHECK(s.kv_layer_wait_seconds == 0);
  CHECK(s.num_kv_imports == 1);
  test::check_all_blocks_free(*rig.decode);
  test::check_all_blocks_free(*rig.prefill);
}

// The prefill side's race: its host gives up waiting (the decode side's call was cancelled or
// timed out) and releases the export while the prefill still runs; the prefill then finishes
// normally. Before 2026-12-05 the engine held the blocks for a transfer nobody would read or
// release, until the process stopped (seen under TSan, where a prefill outlasts the host's wait).
TEST_CASE("an export released before its prefill finished holds no blocks") {
  if (!test::have_real_model()) return;
  Rig rig = make_rig();
  auto first = std::make_shared<Outcome>();
  // Several chunks (chunk_size 32): the prefill is still running after the first step.
  const std::string prompt = std::string(kPrompt) + " " + kPrompt + " " + kPrompt;
  GenerationRequest r = greedy(*rig.prefill, prompt, first.get());
  REQUIRE(r.prompt.size() > 64);
  r.params.max_tokens = 1;
  r.on_event = test::record_into(first.get());
  auto exp = std::make_shared<KvExport>();
  r.kv_export = exp;
  uint64_t id = 0;
  REQUIRE(rig.prefill->submit(std::move(r), &id).is_ok());
  rig.prefill->step();  // admitted, the first chunks computed
  REQUIRE(!first->finished);
  exp->release();       // the host gave up
  rig.prefill->run_until_idle();
  CHECK(first->finished);
  CHECK(exp->wait_ready(1.0));
  CHECK(rig.prefill->stats().num_held_exports == 0);
  test::check_all_blocks_free(*rig.prefill);
}
