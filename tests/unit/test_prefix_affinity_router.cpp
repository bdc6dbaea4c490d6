// router.prefix-affinity: the same prompt prefix always reaches the same replica; distinct
// prefixes spread over all of them; only candidates are chosen (an unhealthy replica is not);
// a replica leaving moves only its own keys (rendezvous hashing); the load bound sends a
// request to the least loaded replica once its own is max_imbalance requests ahead.
#include <doctest/doctest.h>

#include <map>
#include <string>
#include <vector>

#include "support/plugins.h"
#include "tessera/sdk.h"

using namespace tessera;

namespace {

const std::vector<std::string> kReplicas = {"local", "10.0.0.1:50071", "10.0.0.2:50071"};

std::vector<TokenId> prompt(int prefix, int suffix, int prefix_len = 300) {
  std::vector<TokenId> t;
  for (int i = 0; i < prefix_len; ++i) t.push_back(1000 + prefix * 7 + i);
  for (int i = 0; i < 20; ++i) t.push_back(50000 + suffix * 13 + i);
  return t;
}

std::string route(Router& r, const std::vector<TokenId>& tokens, const std::vector<RouteCandidate>& candidates = {}) {
  RouteRequest request;
  request.tokens = tokens;
  request.candidates = candidates;
  std::string chosen;
  const Status st = r.route(request, &chosen);
  REQUIRE_MESSAGE(st.is_ok(), st.message());
  return chosen;
}

std::vector<RouteCandidate> candidates(const std::vector<std::string>& names, const std::vector<int32_t>& load) {
  std::vector<RouteCandidate> out;
  for (size_t i = 0; i < names.size(); ++i) out.push_back({names[i], load[i]});
  return out;
}

}  // namespace

TEST_CASE("prefix-affinity keeps a prefix on one replica and spreads distinct prefixes") {
  auto r = test::create_plugin<Router>("prefix-affinity", "{prefix_tokens: 256}");
  REQUIRE(r->configure(kReplicas).is_ok());
  std::map<std::string, int> per_replica;
  for (int p = 0; p < 300; ++p) {
    const std::string first = route(*r, prompt(p, 0));
    ++per_replica[first];
    // Prompts that differ only after the first 256 tokens stay together.
    for (int s = 1; s < 4; ++s) CHECK(route(*r, prompt(p, s)) == first);
  }
  REQUIRE(per_replica.size() == 3);
  for (const auto& [name, n] : per_replica) {
    INFO(name << " got " << n << " of 300 prefixes");
    CHECK(n > 60);  // an even split is 100; rendezvous hashing of 300 keys stays well above 60
  }
}

TEST_CASE("prefix-affinity chooses only candidates, and a replica leaving moves only its keys") {
  auto r = test::create_plugin<Router>("prefix-affinity", "{}");
  REQUIRE(r->configure(kReplicas).is_ok());
  const auto all = candidates(kReplicas, {0, 0, 0});
  const std::vector<std::string> staying = {kReplicas[0], kReplicas[2]};  // the candidates view these names
  const auto without_second = candidates(staying, {0, 0});
  int moved = 0, owned = 0;
  for (int p = 0; p < 200; ++p) {
    const std::string before = route(*r, prompt(p, 0), all);
    const std::string after = route(*r, prompt(p, 0), without_second);
    CHECK(after != kReplicas[1]);
    if (before == kReplicas[1]) ++owned;
    else if (before != after) ++moved;
  }
  CHECK(owned > 0);
  CHECK(moved == 0);  // keys of the replicas that stayed did not move
  RouteRequest unknown;
  const std::vector<RouteCandidate> stranger = {{"10.9.9.9:1", 0}};
  unknown.candidates = stranger;
  std::string chosen;
  CHECK(r->route(unknown, &chosen).code() == StatusCode::kInvalidArgument);
}

TEST_CASE("prefix-affinity's load bound sends a request to the least loaded replica") {
  auto r = test::create_plugin<Router>("prefix-affinity", "{max_imbalance: 2}");
  REQUIRE(r->configure(kReplicas).is_ok());
  const auto tokens = prompt(42, 0);
  const std::string home = route(*r, tokens, candidates(kReplicas, {0, 0, 0}));
  std::vector<int32_t> load(3, 1);
  for (size_t i = 0; i < kReplicas.size(); ++i)
    if (kReplicas[i] == home) load[i] = 3;  // 2 ahead: still within the bound
  CHECK(route(*r, tokens, candidates(kReplicas, load)) == home);
  for (size_t i = 0; i < kReplicas.size(); ++i)
    if (kReplicas[i] == home) load[i] = 4;  // 3 ahead: the least loaded serves
  const std::string moved = route(*r, tokens, candidates(kReplicas, load));
  CHECK(moved != home);
  std::vector<RouterMetric> metrics;
  r->metrics(&metrics);
  bool found = false;
  for (const RouterMetric& m : metrics)
    if (m.name == "tessera_router_load_overrides_total") {
      found = true;
      CHECK(m.value == 1);
    }
  CHECK(found);
}
