// The classifier router's model: features of a prompt (a few counted from its text, plus its
// sentence embedding) and a logistic regression over them that scores how likely the prompt
// needs the large model. Shared by the plugin (scoring) and `tessera router train`
// (fitting), so both compute the very same features. Plain value types; thread-safe to read.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace tessera::router {

// Features counted from the text, in this order (names are written into the model file, so a
// file from a different feature set is refused rather than misread).
const std::vector<std::string>& text_feature_names();
// Appends text_feature_names().size() values for `prompt` (whitespace at the ends ignored).
void text_features(std::string_view prompt, std::vector<float>* out);

// Held-out figures of a training run, kept in the model file and exported as gauges.
struct HeldoutFigures {
  int64_t num_examples = 0;
  int64_t num_large_labels = 0;
  double accuracy = 0;           // routed as labelled
  double small_share = 0;        // routed to small
  double hard_to_small = 0;      // labelled large, routed small (share of all held-out prompts)
  double easy_to_large = 0;      // labelled small, routed large (share of all held-out prompts)
  double hard_to_small_of_hard = 0;  // the same, as a share of the prompts labelled large
  double cost_saved = 0;         // vs always-large, at the file's small_cost
  double quality = -1;           // share answered correctly by the chosen model (-1: unknown)
  double quality_always_large = -1;
  double quality_always_small = -1;
};

struct ComplexityModel {
  int embedding_dim = 0;        // 0: text features only (the router then needs no embedding)
  std::string embedding_model;  // what produced the training embeddings (informational)
  std::vector<float> mean;      // per feature (text features, then embedding), for standardizing
  std::vector<float> scale;     // 1 / standard deviation
  std::vector<float> weights;
  float bias = 0;
  float threshold = 0.5f;       // score >= threshold -> large
  double target_large_share = -1;  // what `threshold` was calibrated to (-1: not calibrated)
  // Scores of the calibration set (the training split), ascending: a config's
  // target_large_share is turned into a threshold with them.
  std::vector<float> calibration_scores;
  double small_cost = 0.5;      // cost of a small call relative to a large one
  HeldoutFigures heldout;
  std::string trained_on;       // the data file, for the record

  size_t num_features() const { return text_feature_names().size() + static_cast<size_t>(embedding_dim); }
  // The feature vector of a prompt. `embedding` must have embedding_dim values when
  // embedding_dim > 0.
  std::vector<float> features(std::string_view prompt, std::span<const float> embedding) const;
  // P(large) under the logistic regression.
  float score(std::span<const float> features) const;
  // The threshold that sends `share` of the calibration prompts to the large model.
  float threshold_for_large_share(double share) const;

  std::string to_json() const;
  // Parses a model file's text; on failure returns false with *error naming the field.
  static bool from_json(const std::string& text, ComplexityModel* out, std::string* error);
};

// One labelled training example, its features computed.
struct Example {
  std::vector<float> x;
  bool large = false;
};

struct TrainOptions {
  double l2 = 1e-2;   // ridge penalty on the (standardized) weights
  int iterations = 400;
  double learning_rate = 0.1;
};

// Fits mean/scale/weights/bias of `model` (embedding_dim already set) by full-batch gradient
// descent (Adam) on the logistic loss with class weights that balance the two labels (hard
// prompts are the rarer class, and missing them is the costly error).
void fit(const std::vector<Example>& examples, const TrainOptions& options, ComplexityModel* model);

}  // namespace tessera::router
