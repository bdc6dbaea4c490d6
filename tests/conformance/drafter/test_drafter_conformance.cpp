// Every drafter plugin: proposes at most max_drafts tokens per request, from the vocabulary
// of the sequence, in one call for many sequences, and tolerates settle/forget for any id
// (draft-model and layer-skip, which need a stack, on a real one in
// tests/integration/test_draft_model.cpp).
// Then drafter.ngram's own rules: the longest suffix match in [min_ngram, max_ngram], the most
// recent among equally long ones, the continuation cut at max_drafts and at the sequence end,
// and its schema (bad num_draft_tokens / min_ngram > max_ngram refused naming the key).
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "support/plugins.h"
#include "tessera/sdk.h"

using namespace tessera;

namespace {

struct Seq {
  SequenceInfo info;
  std::vector<TokenId> tokens;
  Draft draft;
  Seq(SeqId id, std::vector<TokenId> t) : tokens(std::move(t)) {
    info.id = id;
    info.num_prompt_tokens = static_cast<int32_t>(tokens.size());
    info.num_computed_tokens = info.num_prompt_tokens;
    info.tokens = tokens;
  }
};

std::vector<std::vector<TokenId>> propose(Drafter& d, std::vector<Seq>& seqs, int32_t max_drafts) {
  std::vector<DraftRequest> requests;
  for (Seq& s : seqs) {
    s.draft.clear();
    requests.push_back({&s.info, max_drafts, &s.draft});
  }
  REQUIRE(d.propose(requests).is_ok());
  std::vector<std::vector<TokenId>> out;
  for (Seq& s : seqs) out.push_back(s.draft.tokens);
  return out;
}

}  // namespace

TEST_CASE("every drafter keeps the propose contract") {
  const auto names = test::plugin_names(PluginKind::kDrafter);
  REQUIRE(!names.empty());
  for (const std::string& name : names) {
    INFO("drafter." << name);
    if (name == "draft-model" || name == "layer-skip") {
      // They run a model through the stack's model host, which exists only inside a stack:
      // outside one they are refused, clearly. Their propose contract is checked on a real
      // stack in tests/integration/test_draft_model.cpp.
      const PluginInfo* info = test::plugin_registry().find(PluginKind::kDrafter, name);
      REQUIRE(info != nullptr);
      const PluginConfig config = validate_plugin_params(
          *info->manifest, "engine.drafter", name == "draft-model" ? "{model: draft.gguf}" : "{layers: '0-3'}");
      CHECK_THROWS_WITH(test::plugin_registry().create<Drafter>(name, config, PluginContext{&host_logger(), ""}),
                        doctest::Contains("engine.drafter: needs the stack's model host"));
      continue;
    }
    auto d = test::create_plugin<Drafter>(name, "{}");
    std::vector<Seq> seqs;
    seqs.emplace_back(1, std::vector<TokenId>{5, 6, 7, 8, 5, 6, 7, 8, 5, 6});
    seqs.emplace_back(2, std::vector<TokenId>{1});
    seqs.emplace_back(3, std::vector<TokenId>{9, 9, 9, 9, 9, 9, 9, 9});
    for (int32_t max : {1, 3, 8}) {
      const auto out = propose(*d, seqs, max);
      for (size_t i = 0; i < seqs.size(); ++i) {
        CHECK(out[i].size() <= static_cast<size_t>(max));
        CHECK((seqs[i].draft.q.empty() || seqs[i].draft.q.size() % out[i].size() == 0));
      }
    }
    d->on_drafts_settled(1, 3, 1);
    d->on_drafts_settled(12345, 2, 0);  // unknown ids are fine
    d->forget(1);
    d->forget(12345);
  }
}

TEST_CASE("ngram proposes what followed the longest, most recent suffix match") {
  auto d = test::create_plugin<Drafter>("ngram", "{min_ngram: 1, max_ngram: 3}");
  std::vector<Seq> seqs;
  // Suffix [2, 3]: found at 1..2 (followed by 4 5 6) and at 6..7 (followed by 9 2 3); the
  // length-3 suffix [1, 2, 3]... only at 0..2, so that one wins: propose 4 5 6.
  seqs.emplace_back(1, std::vector<TokenId>{1, 2, 3, 4, 5, 6, 7, 2, 3, 9, 1, 2, 3});
  // Only length-1 matches of 7: the most recent (position 4) is followed by 8.
  seqs.emplace_back(2, std::vector<TokenId>{7, 1, 2, 3, 7, 8, 4, 7});
  // No earlier occurrence of the last token: nothing.
  seqs.emplace_back(3, std::vector<TokenId>{1, 2, 3, 4});
  // The continuation runs to the end of the sequence at most: 10 11 then the suffix itself.
  seqs.emplace_back(4, std::vector<TokenId>{10, 11, 10, 11});
  const auto out = propose(*d, seqs, 3);
  CHECK(out[0] == std::vector<TokenId>{4, 5, 6});
  CHECK(out[1] == std::vector<TokenId>{8, 4, 7});
  CHECK(out[2].empty());
  CHECK(out[3] == std::vector<TokenId>{10, 11});
  CHECK(seqs[0].draft.q.empty());  // deterministic: q is one-hot

  // max_drafts cuts the continuation.
  CHECK(propose(*d, seqs, 1)[0] == std::vector<TokenId>{4});

  // min_ngram 2: a single-token match is not enough.
  auto strict = test::create_plugin<Drafter>("ngram", "{min_ngram: 2, max_ngram: 3}");
  const auto strict_out = propose(*strict, seqs, 3);
  CHECK(strict_out[0] == std::vector<TokenId>{4, 5, 6});
  CHECK(strict_out[1].empty());
}

TEST_CASE("ngram's parameters are validated with the key named") {
  const PluginInfo* info = test::plugin_registry().find(PluginKind::kDrafter, "ngram");
  REQUIRE(info != nullptr);
  for (const char* yaml : {"{num_draft_tokens: -1}", "{num_draft_tokens: 1000}", "{num_draft_tokens: abc}"}) {
    INFO(yaml);
    CHECK_THROWS_WITH(validate_plugin_params(*info->manifest, "engine.drafter", yaml),
                      doctest::Contains("engine.drafter.num_draft_tokens"));
  }
  CHECK_THROWS_WITH(validate_plugin_params(*info->manifest, "engine.drafter", "{min_ngram: 0}"),
                    doctest::Contains("engine.drafter.min_ngram"));
  const PluginConfig config = validate_plugin_params(*info->manifest, "engine.drafter", "{min_ngram: 4, max_ngram: 2}");
  CHECK_THROWS_WITH(test::plugin_registry().create<Drafter>("ngram", config, PluginContext{&host_logger(), ""}),
                    doctest::Contains("engine.drafter.min_ngram: must not exceed max_ngram (2), got 4"));
}

// drafter.suffix: the longest suffix match, continuations ranked by how many occurrences of
// the match agree, the draft length bounded by spec_factor × match length and by
// min_token_prob, and finished requests' outputs matched by later ones (the global cache,
// bounded in tokens, oldest dropped first).
TEST_CASE("suffix drafts the continuation most occurrences of the longest match agree on") {
  auto d = test::create_plugin<Drafter>("suffix", "{min_match: 1, max_match: 4, global_cache_tokens: 0}");
  std::vector<Seq> seqs;
  // [1 2] occurs three times before the suffix: followed by 3 3 4 twice and by 7 once, so
  // 3 then 3 (2 of 3 agree on each; the running share 2/3 > 0.1), then 4.
  seqs.emplace_back(1, std::vector<TokenId>{1, 2, 3, 3, 4, 9, 1, 2, 7, 8, 1, 2, 3, 3, 4, 5, 1, 2});
  // The longest match wins over more frequent shorter ones: [8 5 6] occurs once (followed by
  // 11), [5 6] alone three more times (followed by 10).
  seqs.emplace_back(2, std::vector<TokenId>{5, 6, 10, 5, 6, 10, 5, 6, 10, 8, 5, 6, 11, 8, 5, 6});
  // The last token never occurred before: nothing.
  seqs.emplace_back(3, std::vector<TokenId>{1, 2, 3, 4});
  const auto out = propose(*d, seqs, 8);
  // Match length 2 with spec_factor 1: at most 2 drafts.
  CHECK(out[0] == std::vector<TokenId>{3, 3});
  CHECK(out[1] == std::vector<TokenId>{11, 8, 5});  // match length 3: three drafts
  CHECK(out[2].empty());
  CHECK(seqs[0].draft.q.empty());  // deterministic: q is one-hot

  // A larger spec_factor lets the same match draft further (up to max_drafts), until the
  // occurrences agreeing so far run into the end of the sequence (3 3 4, then the most recent
  // of the tied 5 / 9, then 1 2 and the end).
  auto eager = test::create_plugin<Drafter>("suffix", "{min_match: 1, max_match: 4, spec_factor: 4, global_cache_tokens: 0}");
  CHECK(propose(*eager, seqs, 8)[0] == std::vector<TokenId>{3, 3, 4, 5, 1, 2});
  CHECK(propose(*eager, seqs, 3)[0] == std::vector<TokenId>{3, 3, 4});
  // min_token_prob 0.7: the first step's agreement (2 of 3) is already too low.
  auto strict = test::create_plugin<Drafter>("suffix", "{min_match: 1, max_match: 4, min_token_prob: 0.7, global_cache_tokens: 0}");
  CHECK(propose(*strict, seqs, 8)[0].empty());
  // min_match 3: the length-2 match of sequence 1 is not enough, sequence 2's length-3 is.
  auto longer = test::create_plugin<Drafter>("suffix", "{min_match: 3, max_match: 4, global_cache_tokens: 0}");
  const auto longer_out = propose(*longer, seqs, 8);
  CHECK(longer_out[0].empty());
  CHECK(longer_out[1] == std::vector<TokenId>{11, 8, 5});
}

TEST_CASE("suffix follows the sequence as it grows and matches earlier requests' outputs") {
  auto d = test::create_plugin<Drafter>("suffix", "{min_match: 2, max_match: 8, spec_factor: 4, global_cache_tokens: 12}");
  // Request 1: prompt 1 2 3, output 40 41 42 43 44 45 (as committed step by step).
  std::vector<Seq> first;
  first.emplace_back(1, std::vector<TokenId>{1, 2, 3});
  for (TokenId t : {40, 41, 42, 43, 44, 45}) {
    first[0].tokens.push_back(t);
    first[0].info.tokens = first[0].tokens;
    CHECK(propose(*d, first, 4)[0].empty());  // nothing repeats inside request 1
  }
  d->forget(1);  // finished: its output enters the global cache

  // Request 2 ends with 41 42: request 1's output continues 43 44 45.
  std::vector<Seq> second;
  second.emplace_back(2, std::vector<TokenId>{7, 8, 41, 42});
  CHECK(propose(*d, second, 8)[0] == std::vector<TokenId>{43, 44, 45});
  // A match inside the sequence itself competes: the local match of [9 41 42] continues for
  // five certain tokens (50 51 9 41 42), the global one of [41 42] for three (43 44 45), so
  // the local candidate has the larger expected accepted length and wins.
  second[0].tokens = {9, 41, 42, 50, 51, 9, 41, 42};
  second[0].info.tokens = second[0].tokens;
  CHECK(propose(*d, second, 8)[0] == std::vector<TokenId>{50, 51, 9, 41, 42});

  // The cache holds 12 tokens: two more 6-token outputs push request 1's out.
  for (SeqId id : {3, 4}) {
    std::vector<Seq> other;
    other.emplace_back(id, std::vector<TokenId>{1});
    other[0].tokens.insert(other[0].tokens.end(), {60, 61, 62, 63, 64, 65});
    other[0].info.tokens = other[0].tokens;
    propose(*d, other, 4);
    d->forget(id);
  }
  std::vector<Seq> third;
  third.emplace_back(5, std::vector<TokenId>{7, 8, 41, 42});
  CHECK(propose(*d, third, 8)[0].empty());
  third[0].tokens = {7, 61, 62};
  third[0].info.tokens = third[0].tokens;
  CHECK(propose(*d, third, 8)[0] == std::vector<TokenId>{63, 64, 65});
}

TEST_CASE("suffix's parameters are validated with the key named") {
  const PluginInfo* info = test::plugin_registry().find(PluginKind::kDrafter, "suffix");
  REQUIRE(info != nullptr);
  for (const char* yaml : {"{num_draft_tokens: 0}", "{min_match: 0}", "{spec_factor: 0}", "{min_token_prob: 2}",
                           "{global_cache_tokens: -1}"}) {
    INFO(yaml);
    CHECK_THROWS_WITH(validate_plugin_params(*info->manifest, "engine.drafter", yaml),
                      doctest::Contains("engine.drafter."));
  }
  const PluginConfig config = validate_plugin_params(*info->manifest, "engine.drafter", "{min_match: 9, max_match: 4}");
  CHECK_THROWS_WITH(test::plugin_registry().create<Drafter>("suffix", config, PluginContext{&host_logger(), ""}),
                    doctest::Contains("engine.drafter.min_match: must not exceed max_match (4), got 9"));
}
