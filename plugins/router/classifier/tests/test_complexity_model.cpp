// The classifier router's model without a server or an embedding model: text features, the
// fit on data with a known answer, threshold calibration, and the file format's refusals.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <random>

#include "complexity_model.h"

using tessera::router::ComplexityModel;
using tessera::router::Example;

namespace {

float feature(const std::string& prompt, const std::string& name) {
  std::vector<float> x;
  tessera::router::text_features(prompt, &x);
  const auto& names = tessera::router::text_feature_names();
  REQUIRE(x.size() == names.size());
  for (size_t i = 0; i < names.size(); ++i)
    if (names[i] == name) return x[i];
  FAIL("no feature " << name);
  return 0;
}

}  // namespace

TEST_CASE("text features count what they say") {
  CHECK(feature("What is 718 + 964?", "longest_number") == 3.f);
  CHECK(feature("What is 718 + 964?", "log_operators") == doctest::Approx(std::log1p(1.f)));
  CHECK(feature("What is 718 + 964?", "q_what") == 1.f);
  CHECK(feature("  How many letters are in 'Chad'?  ", "q_how_many") == 1.f);
  CHECK(feature("How many letters are in 'Chad'?", "log_quotes") == doctest::Approx(std::log1p(2.f)));
  CHECK(feature("Whatever you say", "q_what") == 0.f);  // a word, not the question word
  CHECK(feature("a well-known word", "log_operators") == 0.f);  // a hyphen inside a word
  CHECK(feature("Write a function in code: def f(x): return x", "q_write_code") == 1.f);
  // Whitespace at the ends does not change anything (chat text ends with a newline).
  std::vector<float> a, b;
  tessera::router::text_features("Is it?", &a);
  tessera::router::text_features("\n Is it?\n", &b);
  CHECK(a == b);
}

TEST_CASE("fit separates labels that one feature decides, and the threshold follows the share") {
  ComplexityModel m;
  m.embedding_dim = 2;
  std::mt19937 rng(3);
  std::normal_distribution<float> noise(0.f, 1.f);
  std::vector<Example> examples;
  std::vector<std::string> prompts;
  for (int i = 0; i < 400; ++i) {
    const bool large = i % 4 == 0;  // a quarter hard
    // The second embedding value carries the label; the first is noise.
    const float e[2] = {noise(rng), (large ? 2.f : -2.f) + 0.5f * noise(rng)};
    examples.push_back({m.features("What is 2 + 2?", e), large});
  }
  tessera::router::fit(examples, {}, &m);
  int correct = 0;
  for (const Example& ex : examples) {
    m.calibration_scores.push_back(m.score(ex.x));
    correct += (m.score(ex.x) >= 0.5f) == ex.large;
  }
  std::sort(m.calibration_scores.begin(), m.calibration_scores.end());
  CHECK(correct >= 396);
  // A quarter of the scores sit at or above the threshold for a 0.25 share.
  const float t = m.threshold_for_large_share(0.25);
  int above = 0;
  for (float s : m.calibration_scores) above += s >= t;
  CHECK(above == 100);
  CHECK(m.threshold_for_large_share(0.0) > m.calibration_scores.back());
  CHECK(m.threshold_for_large_share(1.0) <= m.calibration_scores.front());

  SUBCASE("the file round-trips") {
    m.threshold = t;
    m.heldout.accuracy = 0.9;
    m.heldout.hard_to_small = 0.05;
    ComplexityModel back;
    std::string error;
    REQUIRE(ComplexityModel::from_json(m.to_json(), &back, &error));
    CHECK(back.weights == m.weights);
    CHECK(back.threshold == doctest::Approx(t));
    CHECK(back.heldout.hard_to_small == doctest::Approx(0.05));
    const float e[2] = {0.f, 2.f};
    CHECK(back.score(back.features("What is 2 + 2?", e)) == doctest::Approx(m.score(m.features("What is 2 + 2?", e))));
  }
}

TEST_CASE("a model file with the wrong shape is refused, naming the field") {
  std::string error;
  ComplexityModel out;
  CHECK_FALSE(ComplexityModel::from_json("[]", &out, &error));
  CHECK_FALSE(ComplexityModel::from_json(R"({"format": "other", "version": 1})", &out, &error));
  CHECK(error.find("format") != std::string::npos);
  ComplexityModel m;
  m.mean.assign(m.num_features(), 0.f);
  m.scale.assign(m.num_features(), 1.f);
  m.weights.assign(m.num_features() - 1, 0.f);  // one short
  CHECK_FALSE(ComplexityModel::from_json(m.to_json(), &out, &error));
  CHECK(error.find("weights: expected 16 values") != std::string::npos);
  std::string text = ComplexityModel{}.to_json();
  const auto at = text.find("\"log_chars\"");
  REQUIRE(at != std::string::npos);
  text.replace(at, 11, "\"chars_v0\"");
  CHECK_FALSE(ComplexityModel::from_json(text, &out, &error));
  CHECK(error.find("text_features") != std::string::npos);
}
