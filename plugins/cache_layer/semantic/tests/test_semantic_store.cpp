// cache_layer.semantic without the plugin loader: the HNSW store (partitions, TTL, entry and
// byte bounds, label reuse) and the learned-threshold decision (fit, exploration, error bound).
#include <doctest/doctest.h>

#include <cmath>
#include <random>

#include "semantic_store.h"
#include "threshold_learner.h"

using namespace tessera;
using namespace tessera::semantic_cache;

namespace {

constexpr int kDim = 8;

std::vector<float> unit(std::vector<float> v) {
  double n = 0;
  for (float x : v) n += double(x) * x;
  for (float& x : v) x = static_cast<float>(x / std::sqrt(n));
  return v;
}

// A unit vector at angle `radians` from e0 in the (e0, e1) plane: cosine to e0 = cos(radians).
std::vector<float> at_angle(double radians, int axis = 1) {
  std::vector<float> v(kDim, 0.0f);
  v[0] = static_cast<float>(std::cos(radians));
  v[axis] = static_cast<float>(std::sin(radians));
  return v;
}

Entry entry(const std::string& partition, std::vector<float> emb, const std::string& text, int64_t expires = 1e15) {
  Entry e;
  e.partition = partition;
  e.prompt = text;
  e.embedding = std::move(emb);
  e.text = text;
  e.tokens = {1, 2, 3};
  e.expires_at_ms = expires;
  return e;
}

}  // namespace

TEST_CASE("nearest finds the most similar entry of the partition, with its cosine") {
  SemanticStore store(kDim, 100, 1 << 20);
  const uint64_t a = store.insert(entry("t1", at_angle(0.0), "a"));
  const uint64_t b = store.insert(entry("t1", at_angle(1.0), "b"));
  store.insert(entry("t2", at_angle(0.3), "other tenant"));
  REQUIRE(a);
  REQUIRE(b);
  auto nb = store.nearest("t1", at_angle(0.2), 0);
  REQUIRE(nb);
  CHECK(nb->id == a);
  CHECK(nb->similarity == doctest::Approx(std::cos(0.2)).epsilon(1e-5));
  nb = store.nearest("t1", at_angle(0.9), 0);
  REQUIRE(nb);
  CHECK(nb->id == b);
  // Another partition never answers, however close.
  CHECK_FALSE(store.nearest("t3", at_angle(0.0), 0));
  nb = store.nearest("t2", at_angle(0.0), 0);
  REQUIRE(nb);
  CHECK(store.find(nb->id)->text == "other tenant");
  CHECK(store.num_partitions() == 2);
}

TEST_CASE("expired entries are dropped on lookup and the next one is found") {
  SemanticStore store(kDim, 100, 1 << 20);
  store.insert(entry("p", at_angle(0.0), "old", /*expires=*/1000));
  const uint64_t fresh = store.insert(entry("p", at_angle(0.5), "fresh", /*expires=*/5000));
  auto nb = store.nearest("p", at_angle(0.0), 2000);
  REQUIRE(nb);
  CHECK(nb->id == fresh);
  CHECK(store.expirations() == 1);
  CHECK(store.size() == 1);
  CHECK_FALSE(store.nearest("p", at_angle(0.0), 6000));
  CHECK(store.size() == 0);
  CHECK(store.num_partitions() == 0);  // an empty partition is removed with its index
}

TEST_CASE("entry bound: least recently used goes first; touched entries stay") {
  SemanticStore store(kDim, 3, 1 << 20);
  const uint64_t a = store.insert(entry("p", at_angle(0.0), "a"));
  const uint64_t b = store.insert(entry("p", at_angle(0.4), "b"));
  const uint64_t c = store.insert(entry("p", at_angle(0.8), "c"));
  store.touch(a);
  const uint64_t d = store.insert(entry("p", at_angle(1.2), "d"));
  CHECK(store.size() == 3);
  CHECK(store.evictions() == 1);
  CHECK(store.find(a));
  CHECK_FALSE(store.find(b));
  CHECK(store.find(c));
  CHECK(store.find(d));
  // b's index label is reused by the next entry; searches never return the evicted one.
  const uint64_t e = store.insert(entry("p", at_angle(0.4, 2), "e"));
  CHECK(store.evictions() == 2);  // c was the least recently used now
  auto nb = store.nearest("p", at_angle(0.4), 0);
  REQUIRE(nb);
  CHECK(nb->id != b);
  CHECK(store.find(e));
}

TEST_CASE("byte bound: entries are charged and evicted to fit; one too big is refused") {
  const SemanticStore probe(kDim, 10, 1 << 20);
  const size_t one = probe.charge(entry("p", at_angle(0), "xxxxxxxxxx"));
  SemanticStore store(kDim, 1000, 3 * one);
  for (int i = 0; i < 10; ++i) REQUIRE(store.insert(entry("p", at_angle(0.1 * i), "xxxxxxxxxx")));
  CHECK(store.size() == 3);
  CHECK(store.bytes() <= 3 * one);
  CHECK(store.evictions() == 7);
  Entry big = entry("p", at_angle(0), std::string(4 * one, 'y'));
  CHECK(store.insert(std::move(big)) == 0);
}

TEST_CASE("a partition's index grows past its initial capacity") {
  SemanticStore store(kDim, 10000, 64 << 20);
  std::mt19937 rng(1);
  std::normal_distribution<float> g;
  std::vector<std::vector<float>> vs;
  for (int i = 0; i < 200; ++i) {
    std::vector<float> v(kDim);
    for (float& x : v) x = g(rng);
    vs.push_back(unit(v));
    REQUIRE(store.insert(entry("p", vs.back(), std::to_string(i))));
  }
  int exact = 0;
  for (int i = 0; i < 200; ++i) {
    auto nb = store.nearest("p", vs[i], 0);
    REQUIRE(nb);
    exact += store.find(nb->id)->text == std::to_string(i);
  }
  CHECK(exact >= 198);  // HNSW is approximate, but a stored point finds itself
}

TEST_CASE("fit_threshold recovers the change point of noisy observations") {
  std::mt19937 rng(7);
  std::uniform_real_distribution<double> u(0.5, 1.0);
  std::vector<Observation> obs;
  for (int i = 0; i < 400; ++i) {
    const double s = u(rng);
    const double p = 1 / (1 + std::exp(-40 * (s - 0.8)));
    obs.push_back({static_cast<float>(s), std::uniform_real_distribution<double>(0, 1)(rng) < p});
  }
  const ThresholdFit fit = fit_threshold(obs);
  REQUIRE(fit.ok);
  CHECK(fit.t_hat == doctest::Approx(0.8).epsilon(0.03));
  CHECK(fit.gamma == doctest::Approx(40).epsilon(0.5));
  CHECK(fit.var_t < 1e-3);
}

TEST_CASE("explore probability: always explores with few observations, rarely far above the threshold") {
  ThresholdLearner learner(0.05);
  std::vector<Observation> few = {{0.9f, true}, {0.7f, false}};
  CHECK(learner.explore_probability(0.99, few) == 1.0);
  std::vector<Observation> many;
  for (int i = 0; i < 60; ++i) many.push_back({0.5f + 0.5f * i / 60.0f, 0.5f + 0.5f * i / 60.0f >= 0.8f});
  const double low = learner.explore_probability(0.6, many);
  const double high = learner.explore_probability(0.99, many);
  CHECK(low > 0.9);   // below the threshold: almost surely explore
  CHECK(high < 0.3);  // well above it: mostly exploit
  CHECK(high < low);
}

TEST_CASE("online: the rate of wrong cached answers stays under delta, and more delta buys more hits") {
  int previous_hits = 0;
  for (double delta : {0.02, 0.05, 0.1}) {
    CAPTURE(delta);
    ThresholdLearner learner(delta);
    std::mt19937_64 rng(42);
    std::uniform_real_distribution<double> u01(0, 1), sim(0.6, 1.0);
    std::vector<Observation> obs;
    int wrong = 0, hits = 0;
    const int n = 4000;
    for (int i = 0; i < n; ++i) {
      const double s = sim(rng);
      const bool correct = s >= 0.85;  // the entry's true threshold
      if (u01(rng) > learner.explore_probability(s, obs)) {
        ++hits;
        wrong += !correct;
      } else {
        obs.push_back({static_cast<float>(s), correct});
      }
    }
    MESSAGE("delta " << delta << ": hit rate " << double(hits) / n << ", wrong answers " << double(wrong) / n);
    CHECK(double(wrong) / n <= delta);
    CHECK(hits > n / 40);  // it does learn to answer (conservatively: the threshold is uncertain)
    CHECK(hits > previous_hits);
    previous_hits = hits;
  }
}

TEST_CASE("the shared tier's encoding round-trips an entry and refuses garbage") {
  Entry e = entry("tenant\x1fmodel\x1fparams", at_angle(0.3), "caf\xc3\xa9 answer");
  e.uid = "123-4";
  e.finish_reason = FinishReason::kLength;
  Entry back;
  REQUIRE(decode_entry(encode_entry(e), &back));
  CHECK(back.partition == e.partition);
  CHECK(back.text == e.text);
  CHECK(back.tokens == e.tokens);
  CHECK(back.embedding == e.embedding);
  CHECK(back.finish_reason == FinishReason::kLength);
  CHECK(back.expires_at_ms == e.expires_at_ms);
  CHECK(back.uid == "123-4");
  CHECK(back.from_redis);
  CHECK_FALSE(decode_entry("{\"partition\": 1}", &back));
  CHECK_FALSE(decode_entry("not json", &back));
}
