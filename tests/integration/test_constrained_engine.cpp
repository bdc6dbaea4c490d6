// Constrained decoding through the engine on the real model (engine.constraint: json-schema):
// every output parses and validates and ends with "stop" as soon as the value is complete;
// greedy constrained output is the same with and without speculative drafts (drafts are cut
// where the constraint refuses them, verification rows are masked); sampled output with
// temperature, top-p, n > 1 and a seed parses and is reproducible; no KV block is left
// behind; an engine without the slot refuses constrained requests.
#include <doctest/doctest.h>

#include <cctype>

#include <nlohmann/json.hpp>

#include <string>
#include <vector>

#include "support/real_model.h"
#include "support/stacks.h"
#include "tessera/chat_template.h"
#include "tessera/engine.h"

using namespace tessera;

namespace {

const char* kSchema = R"({"type": "object", "properties": {
  "name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"},
  "pets": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 2},
  "mood": {"enum": ["happy", "sad"]}},
  "required": ["name", "age", "mood"]})";

struct Output {
  std::vector<TokenId> tokens;
  FinishReason reason = FinishReason::kNone;
  std::string error;
};

std::vector<TokenId> chat_prompt(const Engine& engine, const std::string& user) {
  const std::string text = apply_chat_template(engine.model().chat_template(),
                                               {{"system", "Answer with a JSON object: name, age, pets, mood."},
                                                {"user", user}},
                                               true);
  return engine.model().tokenizer().encode(text, true, true);
}

// Submits every prompt at once (n samples each) and steps until idle. Output index =
// prompt * n + sample.
std::vector<Output> run(Engine& engine, const std::vector<std::vector<TokenId>>& prompts,
                        const std::shared_ptr<const CompiledConstraint>& constraint, SamplingParams params,
                        int32_t n = 1) {
  std::vector<Output> out(prompts.size() * static_cast<size_t>(n));
  for (size_t i = 0; i < prompts.size(); ++i) {
    GenerationRequest r;
    r.prompt = prompts[i];
    r.params = params;
    r.n = n;
    r.constraint = constraint;
    r.on_event = [&out, i, n](const GenerationEvent& ev) {
      Output& o = out[i * static_cast<size_t>(n) + static_cast<size_t>(ev.choice)];
      for (const auto& t : ev.tokens) o.tokens.push_back(t.token);
      if (ev.finished) {
        o.reason = ev.finish_reason;
        o.error = ev.error.message();
      }
    };
    uint64_t id = 0;
    REQUIRE(engine.submit(std::move(r), &id).is_ok());
  }
  engine.run_until_idle();
  return out;
}

void check_valid(const Engine& engine, const Output& o) {
  const std::string text = engine.model().tokenizer().decode(o.tokens, false);
  INFO(text);
  CHECK(o.error.empty());
  CHECK(o.reason == FinishReason::kStop);
  nlohmann::json v;
  REQUIRE_NOTHROW(v = nlohmann::json::parse(text));
  REQUIRE(v.is_object());
  CHECK(v["name"].is_string());
  CHECK(v["name"].get<std::string>().size() <= 20 * 4);  // characters, at most 4 bytes each
  CHECK(v["age"].is_number_integer());
  CHECK((v["mood"] == "happy" || v["mood"] == "sad"));
  if (v.contains("pets")) CHECK((v["pets"].is_array() && v["pets"].size() <= 2));
  for (const auto& [key, value] : v.items()) CHECK((key == "name" || key == "age" || key == "pets" || key == "mood"));
}

std::vector<std::vector<TokenId>> prompts_for(const Engine& engine) {
  std::vector<std::vector<TokenId>> prompts;
  for (const char* who : {"a pirate", "my grandmother", "a robot", "a famous chef", "a child in Lagos",
                          "a cat owner", "an astronaut", "a shy student"})
    prompts.push_back(chat_prompt(engine, std::string("Describe ") + who + "."));
  return prompts;
}

}  // namespace

TEST_CASE("greedy constrained output parses, stops when complete, and is the same with speculative drafts") {
  if (!test::have_real_model()) return;
  test::Stack plain = test::make_stack("constrained-plain", "");
  test::Stack spec = test::make_stack(
      "constrained-spec",
      "engine:\n  drafter: {plugin: ngram, num_draft_tokens: 4, min_ngram: 1, max_ngram: 3, adaptive: false}\n");
  std::shared_ptr<const CompiledConstraint> c_plain, c_spec;
  REQUIRE(plain.engine->compile_constraint({"json_schema", kSchema}, &c_plain).is_ok());
  REQUIRE(spec.engine->compile_constraint({"json_schema", kSchema}, &c_spec).is_ok());
  const auto prompts = prompts_for(*plain.engine);
  SamplingParams greedy;
  greedy.temperature = 0;
  greedy.max_tokens = 120;
  const auto a = run(*plain.engine, prompts, c_plain, greedy);
  const auto b = run(*spec.engine, prompts, c_spec, greedy);
  for (size_t i = 0; i < a.size(); ++i) {
    check_valid(*plain.engine, a[i]);
    CHECK(a[i].tokens == b[i].tokens);
  }
  // Each prompt alone gives the same output as in the batch.
  CHECK(run(*plain.engine, {prompts[3]}, c_plain, greedy)[0].tokens == a[3].tokens);
  const EngineStats s = spec.engine->stats();
  CHECK(s.num_masked_rows > 0);
  CHECK(s.num_draft_tokens > 0);  // drafts were verified under the mask
  MESSAGE("speculative run: " << s.num_draft_tokens << " drafts verified, " << s.num_accepted_draft_tokens
                              << " accepted, " << s.num_constraint_draft_cuts << " cut by the constraint");
  test::check_all_blocks_free(*plain.engine);
  test::check_all_blocks_free(*spec.engine);
}

TEST_CASE("masks prepared beside the forward give the same output as masks computed after it") {
  // prepare_masks on: a helper thread fills each row's mask while the forward runs; off: the
  // engine thread fills it when sampling. A JSON Schema and a whole-output regex (whose masks
  // come from its byte-class index), greedy, 8 sequences batched: the same tokens either way.
  if (!test::have_real_model()) return;
  test::Stack on = test::make_stack("constrained-prepare-on",
                                    "engine:\n  constraint: {plugin: json-schema, prepare_masks: on}\n");
  test::Stack off = test::make_stack("constrained-prepare-off",
                                     "engine:\n  constraint: {plugin: json-schema, prepare_masks: off}\n");
  const char* kSentences = "([A-Z][a-z]{0,15}(,? [a-z]{1,15}){0,12}[.!?] )+";
  const auto prompts = prompts_for(*on.engine);
  SamplingParams greedy;
  greedy.temperature = 0;
  greedy.max_tokens = 48;
  for (const ConstraintSpec spec : {ConstraintSpec{"json_schema", kSchema}, ConstraintSpec{"regex", kSentences}}) {
    INFO("kind " << spec.kind);
    std::shared_ptr<const CompiledConstraint> c_on, c_off;
    REQUIRE(on.engine->compile_constraint(spec, &c_on).is_ok());
    REQUIRE(off.engine->compile_constraint(spec, &c_off).is_ok());
    const auto a = run(*on.engine, prompts, c_on, greedy);
    const auto b = run(*off.engine, prompts, c_off, greedy);
    for (size_t i = 0; i < a.size(); ++i) {
      CHECK(a[i].error.empty());
      CHECK(a[i].tokens == b[i].tokens);
      if (spec.kind == "json_schema" && a[i].reason == FinishReason::kStop) check_valid(*on.engine, a[i]);
      if (spec.kind == "regex") {
        // Every prefix of the output is a prefix of a match: it starts with a capital.
        const std::string text = on.engine->model().tokenizer().decode(a[i].tokens, false);
        REQUIRE(!text.empty());
        CHECK(std::isupper(static_cast<unsigned char>(text[0])));
      }
    }
  }
  const EngineStats s_on = on.engine->stats(), s_off = off.engine->stats();
  CHECK(s_on.num_prepared_masks > 0);
  CHECK(s_on.num_prepared_masks <= s_on.num_masked_rows);
  CHECK(s_off.num_prepared_masks == 0);
  CHECK(s_off.num_masked_rows == s_on.num_masked_rows);
  MESSAGE("prepared " << s_on.num_prepared_masks << " of " << s_on.num_masked_rows << " masked rows beside the forward ("
                      << s_on.constraint_prepare_seconds * 1e3 << " ms there, " << s_on.constraint_seconds * 1e3
                      << " ms of mask work on the engine thread; with prepare_masks off "
                      << s_off.constraint_seconds * 1e3 << " ms)");
  test::check_all_blocks_free(*on.engine);
  test::check_all_blocks_free(*off.engine);
}

TEST_CASE("sampled constrained output (temperature, top-p, n > 1, seed) parses and is reproducible") {
  if (!test::have_real_model()) return;
  test::Stack s = test::make_stack("constrained-sampled", "");
  std::shared_ptr<const CompiledConstraint> c;
  REQUIRE(s.engine->compile_constraint({"json_schema", kSchema}, &c).is_ok());
  const auto prompts = prompts_for(*s.engine);
  SamplingParams p;
  p.temperature = 1.0f;
  p.top_p = 0.9f;
  p.seed = 1234;
  p.has_seed = true;
  p.max_tokens = 120;
  const auto a = run(*s.engine, {prompts[0], prompts[5]}, c, p, 3);
  for (const auto& o : a) check_valid(*s.engine, o);
  CHECK(a[0].tokens != a[1].tokens);  // the samples differ (seed + i)
  const auto b = run(*s.engine, {prompts[0], prompts[5]}, c, p, 3);
  for (size_t i = 0; i < a.size(); ++i) CHECK(a[i].tokens == b[i].tokens);
  test::check_all_blocks_free(*s.engine);
}

TEST_CASE("cancelled constrained requests free their blocks; without the slot constrained requests are refused") {
  if (!test::have_real_model()) return;
  test::Stack s = test::make_stack("constrained-cancel", "");
  std::shared_ptr<const CompiledConstraint> c;
  REQUIRE(s.engine->compile_constraint({"json", ""}, &c).is_ok());
  std::vector<uint64_t> ids;
  for (const auto& prompt : prompts_for(*s.engine)) {
    GenerationRequest r;
    r.prompt = prompt;
    r.params.max_tokens = 200;
    r.constraint = c;
    uint64_t id = 0;
    REQUIRE(s.engine->submit(std::move(r), &id).is_ok());
    ids.push_back(id);
  }
  for (int i = 0; i < 6; ++i) s.engine->step();
  for (uint64_t id : ids) s.engine->cancel(id);
  s.engine->run_until_idle();
  test::check_all_blocks_free(*s.engine);

  std::shared_ptr<const CompiledConstraint> bad;
  const Status st = s.engine->compile_constraint({"json_schema", R"({"type": "object", "properties": {"a": {"type": "nope"}}})"}, &bad);
  CHECK(st.code() == StatusCode::kInvalidArgument);
  CHECK(st.message().find("properties.a.type: unknown type \"nope\"") == 0);

  test::Stack off = test::make_stack("constrained-off", "engine:\n  constraint: {plugin: none}\n");
  CHECK_FALSE(off.engine->has_constraint());
  std::shared_ptr<const CompiledConstraint> none;
  CHECK(off.engine->compile_constraint({"json", ""}, &none).code() == StatusCode::kUnimplemented);
  GenerationRequest r;
  r.prompt = prompts_for(*off.engine)[0];
  r.constraint = c;
  uint64_t id = 0;
  CHECK(off.engine->submit(std::move(r), &id).code() == StatusCode::kUnimplemented);
}
