#include "complexity_model.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cctype>
#include <cmath>

namespace tessera::router {
namespace {

using nlohmann::json;

bool starts_with_word(std::string_view text, std::string_view word) {
  if (text.size() < word.size()) return false;
  for (size_t i = 0; i < word.size(); ++i)
    if (std::tolower(static_cast<unsigned char>(text[i])) != word[i]) return false;
  return text.size() == word.size() || !std::isalpha(static_cast<unsigned char>(text[word.size()]));
}

bool contains_ci(std::string_view text, std::string_view needle) {
  if (needle.size() > text.size()) return false;
  for (size_t i = 0; i + needle.size() <= text.size(); ++i) {
    size_t k = 0;
    while (k < needle.size() && std::tolower(static_cast<unsigned char>(text[i + k])) == needle[k]) ++k;
    if (k == needle.size()) return true;
  }
  return false;
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

float log1pf_count(size_t n) { return std::log1p(static_cast<float>(n)); }

}  // namespace

const std::vector<std::string>& text_feature_names() {
  static const std::vector<std::string> names = {
      "log_chars",     "log_words",     "digit_share",  "log_numbers",    "longest_number",
      "log_operators", "log_code_marks", "log_quotes",  "upper_share",    "log_sentences",
      "q_how_many",    "q_what",        "q_which",      "q_why_explain",  "q_write_code",
      "q_yes_no"};
  return names;
}

void text_features(std::string_view prompt, std::vector<float>* out) {
  const std::string_view t = trim(prompt);
  size_t words = 0, digits = 0, numbers = 0, longest = 0, run = 0, operators = 0, code = 0, quotes = 0;
  size_t upper = 0, letters = 0, sentences = 0;
  bool in_word = false;
  for (size_t i = 0; i < t.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(t[i]);
    const bool space = std::isspace(c) != 0;
    if (!space && !in_word) ++words;
    in_word = !space;
    if (std::isdigit(c)) {
      ++digits;
      if (run++ == 0) ++numbers;
      longest = std::max(longest, run);
    } else {
      run = 0;
    }
    if (std::isalpha(c)) {
      ++letters;
      upper += std::isupper(c) != 0;
    }
    // Arithmetic and comparison symbols: '-' only between digits or spaces (not in words).
    if (c == '+' || c == '*' || c == '/' || c == '=' || c == '^' || c == '%' || c == '<' || c == '>') ++operators;
    if (c == '-' && i > 0 && i + 1 < t.size() && !std::isalpha(static_cast<unsigned char>(t[i - 1])) &&
        !std::isalpha(static_cast<unsigned char>(t[i + 1])))
      ++operators;
    if (c == '{' || c == '}' || c == ';' || c == '`' || c == '(' || c == '[') ++code;
    if (c == '"' || c == '\'') ++quotes;
    if ((c == '.' || c == '?' || c == '!') && (i + 1 == t.size() || std::isspace(static_cast<unsigned char>(t[i + 1]))))
      ++sentences;
  }
  for (std::string_view marker : {"def ", "function", "#include", "=>", "return ", "class ", "select "})
    code += contains_ci(t, marker) ? 2 : 0;
  const float n = static_cast<float>(std::max<size_t>(1, t.size()));
  out->push_back(log1pf_count(t.size()));
  out->push_back(log1pf_count(words));
  out->push_back(static_cast<float>(digits) / n);
  out->push_back(log1pf_count(numbers));
  out->push_back(static_cast<float>(std::min<size_t>(longest, 12)));
  out->push_back(log1pf_count(operators));
  out->push_back(log1pf_count(code));
  out->push_back(log1pf_count(quotes));
  out->push_back(letters ? static_cast<float>(upper) / static_cast<float>(letters) : 0.f);
  out->push_back(log1pf_count(sentences));
  out->push_back(contains_ci(t, "how many") || contains_ci(t, "how much") ? 1.f : 0.f);
  out->push_back(starts_with_word(t, "what") ? 1.f : 0.f);
  out->push_back(starts_with_word(t, "which") || starts_with_word(t, "on which") ? 1.f : 0.f);
  out->push_back(starts_with_word(t, "why") || starts_with_word(t, "explain") || starts_with_word(t, "describe") ? 1.f
                                                                                                                : 0.f);
  out->push_back((starts_with_word(t, "write") || starts_with_word(t, "implement")) &&
                         (contains_ci(t, "code") || contains_ci(t, "function") || contains_ci(t, "program"))
                     ? 1.f
                     : 0.f);
  bool yes_no = false;
  for (std::string_view w : {"is", "are", "does", "do", "can", "was", "will"}) yes_no |= starts_with_word(t, w);
  out->push_back(yes_no ? 1.f : 0.f);
}

std::vector<float> ComplexityModel::features(std::string_view prompt, std::span<const float> embedding) const {
  std::vector<float> x;
  x.reserve(num_features());
  text_features(prompt, &x);
  if (embedding_dim > 0) x.insert(x.end(), embedding.begin(), embedding.begin() + embedding_dim);
  return x;
}

float ComplexityModel::score(std::span<const float> x) const {
  double z = bias;
  for (size_t i = 0; i < weights.size() && i < x.size(); ++i) z += weights[i] * (x[i] - mean[i]) * scale[i];
  return static_cast<float>(1.0 / (1.0 + std::exp(-z)));
}

float ComplexityModel::threshold_for_large_share(double share) const {
  if (calibration_scores.empty()) return threshold;
  if (share <= 0) return std::nextafter(1.0f, 2.0f);  // above every score: nothing goes large
  if (share >= 1) return 0.0f;
  // The k-th largest score is the threshold that sends k prompts (ties included) to large.
  const size_t n = calibration_scores.size();
  const size_t k = std::max<size_t>(1, static_cast<size_t>(std::lround(share * static_cast<double>(n))));
  return calibration_scores[n - k];
}

namespace {

json figures_json(const HeldoutFigures& h) {
  return {{"num_examples", h.num_examples},
          {"num_large_labels", h.num_large_labels},
          {"accuracy", h.accuracy},
          {"small_share", h.small_share},
          {"misroute_hard_to_small", h.hard_to_small},
          {"misroute_easy_to_large", h.easy_to_large},
          {"misroute_hard_to_small_of_hard", h.hard_to_small_of_hard},
          {"cost_saved_vs_always_large", h.cost_saved},
          {"quality", h.quality},
          {"quality_always_large", h.quality_always_large},
          {"quality_always_small", h.quality_always_small}};
}

}  // namespace

std::string ComplexityModel::to_json() const {
  json j = {{"format", "tessera-router-classifier"},
            {"version", 1},
            {"text_features", text_feature_names()},
            {"embedding_dim", embedding_dim},
            {"embedding_model", embedding_model},
            {"mean", mean},
            {"scale", scale},
            {"weights", weights},
            {"bias", bias},
            {"threshold", threshold},
            {"target_large_share", target_large_share},
            {"small_cost", small_cost},
            {"calibration_scores", calibration_scores},
            {"trained_on", trained_on},
            {"heldout", figures_json(heldout)}};
  return j.dump(1);
}

bool ComplexityModel::from_json(const std::string& text, ComplexityModel* out, std::string* error) {
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    *error = "not a JSON object";
    return false;
  }
  if (j.value("format", "") != "tessera-router-classifier" || j.value("version", 0) != 1) {
    *error = "format: expected \"tessera-router-classifier\" version 1 (a file written by `tessera router train`)";
    return false;
  }
  try {
    if (j.at("text_features").get<std::vector<std::string>>() != text_feature_names()) {
      *error = "text_features: the file was trained on a different feature set than this build computes; retrain it";
      return false;
    }
    ComplexityModel m;
    m.embedding_dim = j.at("embedding_dim").get<int>();
    m.embedding_model = j.value("embedding_model", "");
    m.mean = j.at("mean").get<std::vector<float>>();
    m.scale = j.at("scale").get<std::vector<float>>();
    m.weights = j.at("weights").get<std::vector<float>>();
    m.bias = j.at("bias").get<float>();
    m.threshold = j.at("threshold").get<float>();
    m.target_large_share = j.value("target_large_share", -1.0);
    m.small_cost = j.value("small_cost", 0.5);
    m.calibration_scores = j.value("calibration_scores", std::vector<float>{});
    std::sort(m.calibration_scores.begin(), m.calibration_scores.end());
    m.trained_on = j.value("trained_on", "");
    if (m.embedding_dim < 0) {
      *error = "embedding_dim: expected >= 0, got " + std::to_string(m.embedding_dim);
      return false;
    }
    const size_t n = m.num_features();
    for (const auto& [name, v] : {std::pair<const char*, size_t>{"mean", m.mean.size()},
                                  {"scale", m.scale.size()},
                                  {"weights", m.weights.size()}})
      if (v != n) {
        *error = std::string(name) + ": expected " + std::to_string(n) + " values (" +
                 std::to_string(text_feature_names().size()) + " text features + embedding_dim " +
                 std::to_string(m.embedding_dim) + "), got " + std::to_string(v);
        return false;
      }
    if (const auto h = j.find("heldout"); h != j.end() && h->is_object()) {
      HeldoutFigures& f = m.heldout;
      f.num_examples = h->value("num_examples", int64_t{0});
      f.num_large_labels = h->value("num_large_labels", int64_t{0});
      f.accuracy = h->value("accuracy", 0.0);
      f.small_share = h->value("small_share", 0.0);
      f.hard_to_small = h->value("misroute_hard_to_small", 0.0);
      f.easy_to_large = h->value("misroute_easy_to_large", 0.0);
      f.hard_to_small_of_hard = h->value("misroute_hard_to_small_of_hard", 0.0);
      f.cost_saved = h->value("cost_saved_vs_always_large", 0.0);
      f.quality = h->value("quality", -1.0);
      f.quality_always_large = h->value("quality_always_large", -1.0);
      f.quality_always_small = h->value("quality_always_small", -1.0);
    }
    *out = std::move(m);
  } catch (const json::exception& e) {
    *error = std::string("a field is missing or has the wrong type: ") + e.what();
    return false;
  }
  return true;
}

void fit(const std::vector<Example>& examples, const TrainOptions& options, ComplexityModel* model) {
  const size_t d = model->num_features();
  const size_t n = examples.size();
  model->mean.assign(d, 0.f);
  model->scale.assign(d, 1.f);
  for (const Example& e : examples)
    for (size_t k = 0; k < d; ++k) model->mean[k] += e.x[k] / static_cast<float>(n);
  std::vector<double> var(d, 0.0);
  for (const Example& e : examples)
    for (size_t k = 0; k < d; ++k) var[k] += std::pow(e.x[k] - model->mean[k], 2) / static_cast<double>(n);
  // A constant feature keeps scale 1 (its standardized value is 0 anyway).
  for (size_t k = 0; k < d; ++k) model->scale[k] = var[k] > 1e-12 ? static_cast<float>(1.0 / std::sqrt(var[k])) : 1.f;

  std::vector<std::vector<float>> z(n, std::vector<float>(d));
  for (size_t i = 0; i < n; ++i)
    for (size_t k = 0; k < d; ++k) z[i][k] = (examples[i].x[k] - model->mean[k]) * model->scale[k];
  size_t num_large = 0;
  for (const Example& e : examples) num_large += e.large;
  // Balanced class weights: each label carries half of the loss.
  const double w_large = num_large ? 0.5 * static_cast<double>(n) / static_cast<double>(num_large) : 1.0;
  const double w_small = num_large < n ? 0.5 * static_cast<double>(n) / static_cast<double>(n - num_large) : 1.0;

  std::vector<double> w(d, 0.0), m1(d + 1, 0.0), m2(d + 1, 0.0), grad(d + 1);
  double b = 0;
  const double beta1 = 0.9, beta2 = 0.999, eps = 1e-8;
  for (int it = 1; it <= options.iterations; ++it) {
    std::fill(grad.begin(), grad.end(), 0.0);
    for (size_t i = 0; i < n; ++i) {
      double s = b;
      for (size_t k = 0; k < d; ++k) s += w[k] * z[i][k];
      const double p = 1.0 / (1.0 + std::exp(-s));
      const double g = (p - (examples[i].large ? 1.0 : 0.0)) * (examples[i].large ? w_large : w_small);
      for (size_t k = 0; k < d; ++k) grad[k] += g * z[i][k];
      grad[d] += g;
    }
    for (size_t k = 0; k <= d; ++k) {
      grad[k] /= static_cast<double>(n);
      if (k < d) grad[k] += options.l2 * w[k];
      m1[k] = beta1 * m1[k] + (1 - beta1) * grad[k];
      m2[k] = beta2 * m2[k] + (1 - beta2) * grad[k] * grad[k];
      const double step = options.learning_rate * (m1[k] / (1 - std::pow(beta1, it))) /
                          (std::sqrt(m2[k] / (1 - std::pow(beta2, it))) + eps);
      if (k < d) w[k] -= step;
      else b -= step;
    }
  }
  model->weights.assign(w.begin(), w.end());
  model->bias = static_cast<float>(b);
}

}  // namespace tessera::router
