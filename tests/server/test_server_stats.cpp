// The /v1/stats helpers: histogram quantiles (Prometheus histogram_quantile's interpolation
// over bucket deltas), query parameters, and what a sample takes from ServerMetrics.
#include <doctest/doctest.h>

#include <cmath>

#include "server/stats.h"

using tessera::server::histogram_quantile;
using tessera::server::HistogramSnapshot;
using tessera::server::query_param;

namespace {

// Buckets le=1, le=2, le=4 and +Inf (non-cumulative counts).
const std::vector<double> kBounds = {1, 2, 4};

HistogramSnapshot hist(std::vector<uint64_t> counts) {
  HistogramSnapshot h;
  for (uint64_t c : counts) h.count += c;
  h.counts = std::move(counts);
  return h;
}

}  // namespace

TEST_CASE("histogram_quantile interpolates inside the bucket holding the rank") {
  const HistogramSnapshot h = hist({2, 2, 0, 0});
  // rank 2 of 4 is the top of the first bucket [0, 1].
  CHECK(histogram_quantile(0.5, kBounds, h, nullptr) == doctest::Approx(1.0));
  // rank 3 is half way through (1, 2].
  CHECK(histogram_quantile(0.75, kBounds, h, nullptr) == doctest::Approx(1.5));
  CHECK(histogram_quantile(1.0, kBounds, h, nullptr) == doctest::Approx(2.0));
  // rank 0.4 of the first bucket's 2.
  CHECK(histogram_quantile(0.1, kBounds, h, nullptr) == doctest::Approx(0.2));
}

TEST_CASE("histogram_quantile skips empty buckets and caps the +Inf bucket at the largest bound") {
  CHECK(histogram_quantile(0.5, kBounds, hist({0, 0, 4, 0}), nullptr) == doctest::Approx(3.0));
  CHECK(histogram_quantile(0.99, kBounds, hist({1, 0, 0, 9}), nullptr) == doctest::Approx(4.0));
}

TEST_CASE("histogram_quantile over a window uses the bucket deltas") {
  const HistogramSnapshot earlier = hist({5, 0, 0, 0});
  const HistogramSnapshot later = hist({5, 0, 2, 0});  // the window saw two values in (2, 4]
  CHECK(histogram_quantile(0.5, kBounds, later, &earlier) == doctest::Approx(3.0));
  CHECK(std::isnan(histogram_quantile(0.5, kBounds, earlier, &earlier)));  // nothing in the window
  CHECK(std::isnan(histogram_quantile(0.5, kBounds, hist({0, 0, 0, 0}), nullptr)));
}

TEST_CASE("query_param finds, decodes and misses parameters") {
  CHECK(query_param("/dashboard?key=abc&window=60", "key") == "abc");
  CHECK(query_param("/dashboard?key=abc&window=60", "window") == "60");
  CHECK(query_param("/dashboard?window=60", "key").empty());
  CHECK(query_param("/dashboard", "key").empty());
  CHECK(query_param("/dashboard?key=a%2Bb%20c+d", "key") == "a+b c d");
  CHECK(query_param("/dashboard?keyx=1&key=2", "key") == "2");
  CHECK(query_param("/dashboard?key", "key").empty());
  CHECK(query_param("/dashboard?key=%zz%4", "key") == "%zz%4");  // malformed escapes stay as they are
}

TEST_CASE("a stats sample carries each deployment's, arm's and cache tier's numbers from ServerMetrics") {
  using tessera::EngineStats;
  using tessera::RequestTimings;
  tessera::server::ServerMetrics m;
  RequestTimings t;
  t.arrival = 0;
  t.first_scheduled = 0.02;
  t.first_token = 0.3;
  t.token_times = {0.3, 0.4, 0.5};
  t.finished = 0.5;
  m.observe_deployment("b", t);
  m.count_route("ab", "b");
  m.count_route("ab", "b");
  m.count_route("ab", "a");
  m.observe_arm("ab", "b", t);
  m.count_cache("a", "hit", "redis");
  m.count_cache("a", "miss", "");
  EngineStats ea, eb;
  ea.num_steps = 7;
  eb.num_steps = 11;
  const auto s = tessera::server::take_stats_sample(m, {"a", "b"}, {ea, eb}, 42);
  CHECK(s.time == 42);
  CHECK(s.engine.num_steps == 7);  // the first deployment's, as the unlabelled families
  REQUIRE(s.deployments.size() == 2);
  CHECK(s.deployments[0].engine.num_steps == 7);
  CHECK(s.deployments[1].engine.num_steps == 11);
  CHECK(s.deployments[0].ttft.count == 0);  // "a" served nothing from the model
  CHECK(s.deployments[1].ttft.count == 1);
  CHECK(s.deployments[1].queue_time.sum == doctest::Approx(0.02));
  CHECK(s.deployments[1].tpot.sum == doctest::Approx(0.1));
  REQUIRE(s.arms.size() == 2);
  CHECK(s.arms.at({"ab", "b"}).requests == 2);
  CHECK(s.arms.at({"ab", "b"}).ttft.count == 1);
  CHECK(s.arms.at({"ab", "a"}).requests == 1);
  CHECK(s.arms.at({"ab", "a"}).ttft.count == 0);
  CHECK(s.cache.at({"a", "hit", "redis"}) == 1);
  CHECK(s.cache.at({"a", "miss", ""}) == 1);
}

TEST_CASE("histogram_fraction_at_most is histogram_quantile's inverse inside the buckets") {
  using tessera::server::histogram_fraction_at_most;
  const HistogramSnapshot h = hist({2, 2, 0, 0});
  CHECK(histogram_fraction_at_most(1.0, kBounds, h, nullptr) == doctest::Approx(0.5));
  CHECK(histogram_fraction_at_most(1.5, kBounds, h, nullptr) == doctest::Approx(0.75));
  CHECK(histogram_fraction_at_most(0.2, kBounds, h, nullptr) == doctest::Approx(0.1));
  CHECK(histogram_fraction_at_most(9.0, kBounds, h, nullptr) == doctest::Approx(1.0));
  // The +Inf bucket is never within a target; a window counts only its deltas.
  CHECK(histogram_fraction_at_most(9.0, kBounds, hist({1, 0, 0, 1}), nullptr) == doctest::Approx(0.5));
  const HistogramSnapshot earlier = hist({2, 0, 0, 0});
  CHECK(histogram_fraction_at_most(1.0, kBounds, h, &earlier) == doctest::Approx(0.0));
  CHECK(std::isnan(histogram_fraction_at_most(1.0, kBounds, earlier, &earlier)));
}
