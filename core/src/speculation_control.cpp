#include "tessera/speculation_control.h"

#include <algorithm>

namespace tessera {

void AcceptanceEstimate::record(int32_t proposed, int32_t accepted) {
  if (proposed <= 0) return;
  accepted_ = accepted_ * kForget + accepted;
  tried_ = tried_ * kForget + accepted + (accepted < proposed ? 1 : 0);
}

void AcceptanceEstimate::age() {
  accepted_ *= kForget;
  tried_ *= kForget;
}

double AcceptanceEstimate::alpha(double prior) const {
  return (accepted_ + prior * kPriorWeight) / (tried_ + kPriorWeight);
}

void StepTimeModel::record(int32_t num_tokens, double seconds) {
  const double n = num_tokens;
  weight_ = weight_ * kForget + 1;
  sum_n_ = sum_n_ * kForget + n;
  sum_nn_ = sum_nn_ * kForget + n * n;
  sum_t_ = sum_t_ * kForget + seconds;
  sum_nt_ = sum_nt_ * kForget + n * seconds;
}

double StepTimeModel::seconds_per_extra_token() const {
  if (weight_ <= 0) return 0;
  const double mean_n = sum_n_ / weight_, mean_t = sum_t_ / weight_;
  const double var_n = sum_nn_ / weight_ - mean_n * mean_n;
  if (var_n < 0.25) return std::max(0.0, mean_t / 16);  // every step the same size so far
  return std::max(0.0, (sum_nt_ / weight_ - mean_n * mean_t) / var_n);
}

double StepTimeModel::seconds_for(int32_t num_tokens) const {
  if (weight_ <= 0) return 0;
  const double b = seconds_per_extra_token();
  const double mean_n = sum_n_ / weight_, mean_t = sum_t_ / weight_;
  // The fitted line through the means; never below the cost of the tokens alone.
  return std::max(mean_t + b * (num_tokens - mean_n), b * num_tokens);
}

void DraftCostModel::record(int32_t num_tokens, double seconds, int32_t catch_up_tokens) {
  seconds = std::max(0.0, seconds);
  num_tokens = std::max(0, num_tokens);
  if (catch_up_tokens <= 0) {
    tokens_ = tokens_ * kForget + num_tokens;
    seconds_ = seconds_ * kForget + seconds;
    return;
  }
  catch_up_tokens_ = catch_up_tokens_ * kForget + catch_up_tokens;
  catch_up_seconds_ = catch_up_seconds_ * kForget + std::max(0.0, seconds - seconds_per_token() * num_tokens);
}

void DraftCostModel::age() { seconds_ *= kAge; }

double DraftCostModel::seconds_per_token() const { return tokens_ > 0 ? seconds_ / tokens_ : 0; }

double DraftCostModel::seconds_per_catch_up_token() const {
  return catch_up_tokens_ > 0 ? catch_up_seconds_ / catch_up_tokens_ : 0;
}

int32_t choose_num_drafts(double alpha, int32_t max_drafts, int32_t num_rows, double step_seconds,
                          double row_seconds, double draft_token_seconds) {
  if (max_drafts <= 0 || num_rows <= 0 || step_seconds <= 0) return std::max(0, max_drafts);
  const double value = step_seconds / num_rows;  // what one output token costs without drafts
  int32_t k = 0;
  double p = 1;
  while (k < max_drafts) {
    p *= alpha;
    if (p * value < row_seconds + draft_token_seconds) break;
    ++k;
  }
  return k;
}

bool catch_up_pays(double alpha, int32_t k, int32_t remaining_tokens, double token_seconds, double row_seconds,
                   double draft_token_seconds, double catch_up_seconds) {
  if (catch_up_seconds <= 0) return true;
  if (k <= 0 || remaining_tokens <= 0 || token_seconds <= 0) return false;
  double expected_tokens = 1, p = 1;  // per step with k drafts
  for (int32_t j = 0; j < k; ++j) expected_tokens += (p *= alpha);
  const double step_with_drafts = token_seconds + k * (row_seconds + draft_token_seconds);
  const double saved_per_token = token_seconds - step_with_drafts / expected_tokens;
  return saved_per_token * remaining_tokens > catch_up_seconds;
}

}  // namespace tessera
