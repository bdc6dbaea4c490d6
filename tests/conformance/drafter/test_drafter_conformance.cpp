// Every drafter plugin: proposes at most max_drafts tokens per request, from the vocabulary
// of the sequence, in one call for many sequences, and tolerates settle/forget for any id.
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
