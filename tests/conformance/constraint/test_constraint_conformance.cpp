// Every constraint plugin (the build's and any on TESSERA_PLUGIN_PATH), over a vocabulary of
// one token per printable ASCII character plus an end token and a control token: for "json"
// and a "json_schema", the mask allows the tokens of a valid output at each step and refuses
// ones that break it; accept agrees with the mask and leaves the state unchanged on a refusal;
// the end token is allowed exactly when the output is complete; clone is independent; a bad
// schema is kInvalidArgument; compile is thread-safe.
#include <doctest/doctest.h>

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "support/plugins.h"
#include "tessera/sdk.h"

using namespace tessera;

namespace {

constexpr TokenId kFirstChar = 32;                // ' '
constexpr TokenId kNumChars = 127 - kFirstChar;  // ' ' .. '~'
constexpr TokenId kEnd = kNumChars;
constexpr TokenId kControl = kNumChars + 1;
constexpr int kVocab = kNumChars + 2;

TokenId token_of(char c) { return static_cast<TokenId>(c - kFirstChar); }

struct Vocabulary {
  std::vector<std::string> bytes;
  std::vector<TokenId> end = {kEnd};
  Vocabulary() {
    for (TokenId t = 0; t < kNumChars; ++t) bytes.push_back(std::string(1, static_cast<char>(kFirstChar + t)));
    bytes.push_back("");  // end
    bytes.push_back("");  // control
  }
};

std::vector<uint32_t> mask_of(ConstraintMatcher& m) {
  std::vector<uint32_t> mask((kVocab + 31) / 32, 0);
  REQUIRE(m.fill_mask(mask).is_ok());
  return mask;
}
bool allowed(const std::vector<uint32_t>& mask, TokenId t) { return (mask[t / 32] >> (t % 32)) & 1u; }

// Walks `text` one character at a time: each is allowed by the mask and accepted; a sample of
// characters the mask refuses is refused by accept too, leaving the state unchanged.
void walk(ConstraintMatcher& m, const std::string& text) {
  for (size_t i = 0; i < text.size(); ++i) {
    INFO("at offset " << i << " of " << text);
    const auto mask = mask_of(m);
    CHECK(allowed(mask, token_of(text[i])));
    CHECK_FALSE(allowed(mask, kControl));
    for (char c : std::string("x}]#")) {
      if (allowed(mask, token_of(c))) continue;
      CHECK_FALSE(m.accept(token_of(c)));
      CHECK(mask_of(m) == mask);
    }
    REQUIRE(m.accept(token_of(text[i])));
  }
}

std::unique_ptr<ConstraintMatcher> matcher(Constraint& c, const ConstraintSpec& spec) {
  std::shared_ptr<const CompiledConstraint> compiled;
  const Status status = c.compile(spec, &compiled);
  REQUIRE_MESSAGE(status.is_ok(), status.message());
  std::unique_ptr<ConstraintMatcher> m;
  REQUIRE(compiled->new_matcher(&m).is_ok());
  // The SDK does not promise that a matcher outlives its compiled constraint: keep them all.
  static std::vector<std::shared_ptr<const CompiledConstraint>> keep;
  keep.push_back(compiled);
  return m;
}

}  // namespace

TEST_CASE("every constraint masks, accepts, completes and clones consistently") {
  test::check_no_load_errors();
  const auto names = test::plugin_names(PluginKind::kConstraint);
  REQUIRE(!names.empty());
  const Vocabulary vocab;
  for (const std::string& name : names) {
    INFO("constraint." << name);
    auto c = test::create_plugin<Constraint>(name, test::conformance_params(PluginKind::kConstraint, name, "{}"));
    REQUIRE(c->set_vocabulary(ConstraintVocabulary{vocab.bytes, vocab.end}).is_ok());

    // "json": any object.
    auto m = matcher(*c, {"json", ""});
    {
      const auto first = mask_of(*m);
      CHECK(allowed(first, token_of('{')));
      CHECK_FALSE(allowed(first, token_of('x')));
      CHECK_FALSE(allowed(first, kEnd));
    }
    walk(*m, "{\"a\":");
    auto copy = m->clone();
    walk(*m, "[1,true],\"b\":\"x\"}");
    CHECK(m->is_complete());
    CHECK(allowed(mask_of(*m), kEnd));
    // The clone stayed where it was taken: after '"a":' a value, not the end.
    CHECK_FALSE(copy->is_complete());
    CHECK_FALSE(allowed(mask_of(*copy), kEnd));
    walk(*copy, "null}");
    CHECK(copy->is_complete());

    // "json_schema": an object with a required integer n.
    const ConstraintSpec schema{"json_schema",
                                R"({"type":"object","properties":{"n":{"type":"integer"}},"required":["n"]})"};
    auto s = matcher(*c, schema);
    walk(*s, "{\"n\":");
    CHECK_FALSE(allowed(mask_of(*s), token_of('"')));  // n is an integer, not a string
    walk(*s, "42}");
    CHECK(s->is_complete());
    CHECK(allowed(mask_of(*s), kEnd));

    // A bad schema: kInvalidArgument with a message.
    std::shared_ptr<const CompiledConstraint> bad;
    const Status status = c->compile({"json_schema", R"({"type": 5})"}, &bad);
    CHECK(status.code() == StatusCode::kInvalidArgument);
    CHECK(!status.message().empty());

    // compile from several threads at once (servers compile on their io threads).
    std::atomic<int> failures{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < 4; ++t)
      threads.emplace_back([&] {
        for (int i = 0; i < 10; ++i) {
          std::shared_ptr<const CompiledConstraint> compiled;
          std::unique_ptr<ConstraintMatcher> mm;
          if (!c->compile(schema, &compiled).is_ok() || !compiled->new_matcher(&mm).is_ok()) ++failures;
        }
      });
    for (auto& th : threads) th.join();
    CHECK(failures.load() == 0);
  }
}
