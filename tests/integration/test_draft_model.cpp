// drafter.draft-model's start-up checks on real files: a draft model whose vocabulary differs
// from the target's is refused naming the token and both models; a missing file is refused
// naming engine.drafter.model; on a real stack it keeps the drafter contract and drafts the
// model's own greedy continuation. drafter.layer-skip (the same drafting loop over the
// target's own layers): bad layer lists refused naming the layer and the model's count; all
// layers draft exactly what draft-model drafts with the target's file; a subset drafts valid
// tokens and its KV pool holds only those layers. A reduced draft vocabulary (`vocabulary`,
// `vocabulary_ranking`; SDK 2.13 restrict_logits) drafts the model's argmax where it lies
// inside the vocabulary and nothing outside it; bad rankings are refused naming the line.
// (Greedy identity, preemption, cancellation and n > 1 with draft-model drafts are in
// test_speculative.cpp, with the other drafters.)
#include <doctest/doctest.h>

#include <algorithm>
#include <fstream>
#include <string>
#include <vector>

#include "support/real_model.h"
#include "support/stacks.h"
#include "support/test_env.h"
#include "tessera/gguf.h"
#include "tessera/stack.h"

using namespace tessera;

namespace {

// A copy of the real model whose vocabulary entry `id` reads `text`: same weights, same
// size, one token that means something else.
std::string write_model_with_token(const std::string& name, int32_t id, const std::string& text) {
  auto in = gguf::GgufFile::open(test::real_model_path());
  gguf::GgufWriter w;
  w.set_alignment(in->alignment());
  for (const auto& [key, value] : in->metadata()) {
    if (key == "general.alignment") continue;
    if (key == "tokenizer.ggml.tokens") {
      std::vector<std::string> tokens = *in->opt_string_array(key);
      tokens.at(static_cast<size_t>(id)) = text;
      w.add_string_array(key, tokens);
    } else {
      w.add_value(key, value);
    }
  }
  for (const gguf::TensorInfo& t : in->tensors())
    w.add_tensor(t.name, t.dims, t.type, std::vector<uint8_t>(t.data, t.data + t.num_bytes));
  const std::string path = (test::scratch_dir(name) / "draft.gguf").string();
  w.write(path);
  return path;
}

void check_refused(const std::string& name, const std::string& drafter_yaml, const std::string& expected) {
  const auto path = test::write_stack_file(name, "engine:\n  drafter: " + drafter_yaml + "\n");
  PluginRegistry registry;
  registry.scan_directory(test::plugin_dir());
  const StackConfig config = load_stack_config(path.string(), registry);
  CHECK_THROWS_WITH(build_engine(config, registry), doctest::Contains(expected.c_str()));
}

}  // namespace

TEST_CASE("a draft model with another vocabulary is refused, naming the token and both models") {
  if (!test::have_real_model()) return;
  const std::string draft = write_model_with_token("draft-model-vocab", 1000, "not-the-same-token");
  check_refused("draft-model-vocab-stack", "{plugin: draft-model, model: '" + draft + "'}",
                "engine.drafter.model: token 1000 is 'not-the-same-token' in the draft model and '");
  check_refused("draft-model-vocab-stack2", "{plugin: draft-model, model: '" + draft + "'}",
                "draft " + std::string("draft: ") + draft);
}

TEST_CASE("draft-model keeps the propose contract on a real stack and drafts what the model would say") {
  if (!test::have_real_model()) return;
  const auto path = test::write_stack_file(
      "draft-model-contract", "engine:\n  drafter: {plugin: draft-model, model: '" + test::real_model_path() + "'}\n");
  PluginRegistry registry;
  registry.scan_directory(test::plugin_dir());
  EngineComponents c = build_engine_components(load_stack_config(path.string(), registry), registry);
  REQUIRE(c.drafter != nullptr);
  const std::vector<TokenId> prompt = c.model->tokenizer().encode("The capital of France is", true, false);
  struct Seq {
    SequenceInfo info;
    std::vector<TokenId> tokens;
    Draft draft;
  };
  std::vector<Seq> seqs(3);
  const std::vector<std::vector<TokenId>> texts = {prompt, {5, 6, 7, 8, 5, 6, 7, 8, 5, 6}, {1}};
  for (size_t i = 0; i < seqs.size(); ++i) {
    seqs[i].tokens = texts[i];
    seqs[i].info.id = static_cast<SeqId>(i + 1);
    seqs[i].info.num_prompt_tokens = static_cast<int32_t>(texts[i].size());
    seqs[i].info.num_computed_tokens = seqs[i].info.num_prompt_tokens;
    seqs[i].info.tokens = seqs[i].tokens;
  }
  std::vector<TokenId> first_drafts;
  for (int32_t max : {1, 3, 8}) {
    std::vector<DraftRequest> requests;
    for (Seq& s : seqs) {
      s.draft.clear();
      requests.push_back({&s.info, max, &s.draft});
    }
    REQUIRE(c.drafter->propose(requests).is_ok());
    for (Seq& s : seqs) {
      CHECK(s.draft.tokens.size() == static_cast<size_t>(max));  // a model always has a next token
      CHECK(s.draft.q.empty());                                   // argmax drafts, one-hot q
      for (TokenId t : s.draft.tokens) CHECK((t >= 0 && t < c.model->hparams().vocab_size));
    }
    // Drafts of one sequence do not depend on how many are asked for: each longer draft
    // extends the shorter one (the cache kept from the last call is reused or refed).
    if (!first_drafts.empty())
      CHECK(std::vector<TokenId>(seqs[0].draft.tokens.begin(), seqs[0].draft.tokens.begin() + first_drafts.size()) ==
            first_drafts);
    first_drafts = seqs[0].draft.tokens;
  }
  // The model's greedy continuation of the prompt, drafted by the same model: " Paris".
  CHECK(c.model->tokenizer().decode(first_drafts, false).rfind(" Paris", 0) == 0);
  c.drafter->on_drafts_settled(1, 3, 1);
  c.drafter->on_drafts_settled(12345, 2, 0);  // unknown ids are fine
  for (SeqId id : {1, 2, 3, 12345}) c.drafter->forget(id);
}

TEST_CASE("a missing draft model file or a KV pool too small for a context is refused naming the key") {
  if (!test::have_real_model()) return;
  check_refused("draft-model-missing", "{plugin: draft-model, model: /nonexistent/draft.gguf}",
                "engine.drafter.model: ");
  check_refused("draft-model-small-pool",
                "{plugin: draft-model, model: '" + test::real_model_path() + "', memory: 1MiB}",
                "fewer than one context of");
}

namespace {

// The drafts of `yaml`'s drafter for two real prompts, 6 each.
std::vector<std::vector<TokenId>> drafts_of(const std::string& name, const std::string& drafter_yaml,
                                            EngineComponents* components = nullptr) {
  const auto path = test::write_stack_file(name, "engine:\n  drafter: " + drafter_yaml + "\n");
  PluginRegistry registry;
  registry.scan_directory(test::plugin_dir());
  EngineComponents c = build_engine_components(load_stack_config(path.string(), registry), registry);
  REQUIRE(c.drafter != nullptr);
  const Tokenizer& tok = c.model->tokenizer();
  std::vector<std::vector<TokenId>> texts = {tok.encode("The capital of France is", true, false),
                                             tok.encode("One, two, three, four, five,", true, false)};
  std::vector<SequenceInfo> infos(texts.size());
  std::vector<Draft> drafts(texts.size());
  std::vector<DraftRequest> requests;
  for (size_t i = 0; i < texts.size(); ++i) {
    infos[i].id = static_cast<SeqId>(i + 1);
    infos[i].num_prompt_tokens = infos[i].num_computed_tokens = static_cast<int32_t>(texts[i].size());
    infos[i].tokens = texts[i];
    requests.push_back({&infos[i], 6, &drafts[i]});
  }
  REQUIRE(c.drafter->propose(requests).is_ok());
  std::vector<std::vector<TokenId>> out;
  for (const Draft& d : drafts) {
    CHECK(d.q.empty());
    for (TokenId t : d.tokens) CHECK((t >= 0 && t < c.model->hparams().vocab_size));
    out.push_back(d.tokens);
  }
  for (SeqId id : {1, 2}) c.drafter->forget(id);
  if (components != nullptr) *components = std::move(c);
  return out;
}

}  // namespace

TEST_CASE("layer-skip refuses layer lists the target does not have, naming the layer and the count") {
  if (!test::have_real_model()) return;
  check_refused("layer-skip-range", "{plugin: layer-skip, layers: '0-30'}",
                "engine.drafter.layers: 30 is not a layer of");
  check_refused("layer-skip-range2", "{plugin: layer-skip, layers: '0-30'}", "which has 30 (0..29)");
  check_refused("layer-skip-order", "{plugin: layer-skip, layers: '10-12,4'}",
                "engine.drafter.layers: 4 follows 12; list them ascending, each once");
  check_refused("layer-skip-syntax", "{plugin: layer-skip, layers: '0-x'}",
                "engine.drafter.layers: '0-x' is not a layer index or an ascending range");
  check_refused("layer-skip-empty", "{plugin: layer-skip, layers: ''}", "engine.drafter.layers: empty");
  check_refused("layer-skip-pool", "{plugin: layer-skip, layers: '0-29', memory: 64KiB}",
                "fewer than one context of");
}

TEST_CASE("layer-skip through all layers drafts what draft-model drafts with the target's file; a subset drafts") {
  if (!test::have_real_model()) return;
  const auto full = drafts_of("layer-skip-all", "{plugin: layer-skip, layers: '0-29'}");
  const auto model = drafts_of("layer-skip-vs-model", "{plugin: draft-model, model: '" + test::real_model_path() + "'}");
  CHECK(full == model);
  CHECK(full[0].size() == 6);
  // A subset runs fewer layers: valid drafts of the full length, from a pool of 20 layers.
  // 40MiB holds a 2,048-token context (the default stack's) of 20 layers' f16 K/V (31.5 MB)
  // but not of all 30 (47.2 MB).
  check_refused("layer-skip-pool-30", "{plugin: layer-skip, layers: '0-29', memory: 40MiB}",
                "fewer than one context of");
  const auto subset = drafts_of("layer-skip-subset", "{plugin: layer-skip, layers: '0-9,20-29', memory: 40MiB}");
  CHECK(subset[0].size() == 6);
  CHECK(subset[1].size() == 6);
  MESSAGE("first prompt: full-model drafts agree with the 20-layer drafts at "
          << std::mismatch(full[0].begin(), full[0].end(), subset[0].begin()).first - full[0].begin()
          << " of 6 leading positions");
}

TEST_CASE("a reduced draft vocabulary drafts the model's argmax inside it, and only its tokens") {
  if (!test::have_real_model()) return;
  const std::string model = test::real_model_path();
  EngineComponents c;
  const auto full = drafts_of("vocabulary-full", "{plugin: draft-model, model: '" + model + "'}", &c);
  const Tokenizer& tok = c.model->tokenizer();
  auto allowed = [&](TokenId t, int32_t size) {
    return t < size || tok.is_end_of_generation(t) || (tok.token_attr(t) & Tokenizer::kAttrControl) != 0;
  };
  // The 8,192 lowest ids hold every token the full vocabulary drafts for these prompts, so
  // the reduced head (the same GGUF rows, the same kernels) drafts exactly the same tokens.
  for (const auto& d : full)
    for (TokenId t : d) REQUIRE(t < 8192);
  const auto reduced = drafts_of("vocabulary-8192", "{plugin: draft-model, model: '" + model + "', vocabulary: 8192}");
  CHECK(reduced == full);
  // A head whose row count is no multiple of the quantizer's row groups drafts the same.
  CHECK(drafts_of("vocabulary-8189", "{plugin: draft-model, model: '" + model + "', vocabulary: 8189}") == full);
  // layer-skip through all layers takes the same parameter and drafts the same.
  CHECK(drafts_of("vocabulary-layer-skip", "{plugin: layer-skip, layers: '0-29', vocabulary: 8192}") == full);

  // A ranking file: its first `vocabulary` ids (plus the end-of-generation and control
  // tokens the host adds) are all that is drafted. " Paris" is left out on purpose.
  const TokenId paris = full[0][0];
  std::vector<TokenId> ranked;
  for (TokenId t = 300; static_cast<int32_t>(ranked.size()) < 64; ++t)
    if (t != paris) ranked.push_back(t);
  const auto ranking = test::scratch_dir("vocabulary-ranking") / "ranking.txt";
  {
    std::ofstream out(ranking);
    out << "# most frequent first\n";
    for (size_t i = 0; i < ranked.size(); ++i) out << ranked[i] << (i % 8 == 7 ? "\n" : " ");
    out << paris << "  # past the first 64: not drafted\n";
  }
  const auto limited = drafts_of("vocabulary-ranked", "{plugin: draft-model, model: '" + model +
                                                          "', vocabulary: 64, vocabulary_ranking: '" +
                                                          ranking.string() + "'}");
  for (const auto& d : limited) {
    CHECK(d.size() == 6);
    for (TokenId t : d)
      CHECK((std::find(ranked.begin(), ranked.end(), t) != ranked.end() || allowed(t, 0)));
  }
  CHECK(limited[0][0] != paris);
}

TEST_CASE("a bad draft vocabulary ranking is refused naming the key, the file and the line") {
  if (!test::have_real_model()) return;
  const std::string model = test::real_model_path();
  const auto dir = test::scratch_dir("vocabulary-bad");
  auto write = [&](const std::string& name, const std::string& text) {
    const auto path = dir / name;
    std::ofstream(path) << text;
    return path.string();
  };
  const std::string drafter = "{plugin: draft-model, model: '" + model + "', vocabulary: 100, vocabulary_ranking: '";
  const std::string word = write("word.txt", "1 2 3\n4 five 6\n");
  check_refused("vocabulary-word", drafter + word + "'}",
                "engine.drafter.vocabulary_ranking: " + word + " line 2: 'five' is not a token id of the model (0..49151)");
  const std::string range = write("range.txt", "49152\n");
  check_refused("vocabulary-range", drafter + range + "'}", "line 1: '49152' is not a token id of the model");
  const std::string empty = write("empty.txt", "# nothing\n\n");
  check_refused("vocabulary-empty", drafter + empty + "'}", "the token ranking '" + empty + "' lists no token ids");
  check_refused("vocabulary-missing", drafter + (dir / "none.txt").string() + "'}",
                "engine.drafter.vocabulary_ranking: cannot read the token ranking");
  // The range is the config's to check, before anything loads.
  const auto path = test::write_stack_file(
      "vocabulary-negative", "engine:\n  drafter: {plugin: draft-model, model: '" + model + "', vocabulary: -5}\n");
  PluginRegistry registry;
  registry.scan_directory(test::plugin_dir());
  CHECK_THROWS_WITH(load_stack_config(path.string(), registry),
                    doctest::Contains("engine.drafter.vocabulary: expected an integer in [0, 16777216], got -5"));
}
