#include "threshold_learner.h"

#include <algorithm>
#include <cmath>

namespace tessera::semantic_cache {
namespace {

double sigmoid(double z) { return 1.0 / (1.0 + std::exp(-z)); }

// Φ⁻¹(p) by bisection on the normal CDF; called once per grid point at construction.
double normal_quantile(double p) {
  double lo = -40, hi = 40;
  for (int i = 0; i < 200; ++i) {
    const double mid = 0.5 * (lo + hi);
    (0.5 * std::erfc(-mid / std::sqrt(2.0)) < p ? lo : hi) = mid;
  }
  return 0.5 * (lo + hi);
}

// The variance of t_hat when no finite MLE exists (every correct observation lies above every
// wrong one): wide at the minimum of observations and narrowing with more, roughly as vCache's
// empirical table (0.035 at 6 observations, ~0.01 past 30).
double separated_variance(size_t n) { return std::max(0.008, 0.035 * 6.0 / static_cast<double>(n)); }

}  // namespace

ThresholdFit fit_threshold(std::span<const Observation> obs) {
  ThresholdFit fit;
  if (obs.size() < 2) return fit;
  bool any_correct = false, any_wrong = false;
  float min_correct = 2, max_wrong = -2;
  for (const Observation& o : obs) {
    if (o.correct) any_correct = true, min_correct = std::min(min_correct, o.similarity);
    else any_wrong = true, max_wrong = std::max(max_wrong, o.similarity);
  }
  // Only one kind of outcome: all right means any similarity seen so far is enough, all
  // wrong means none is. Both are "separated": the threshold sits at the edge of the data.
  const bool separated = !any_correct || !any_wrong || min_correct > max_wrong;
  if (separated) {
    fit.ok = true;
    fit.t_hat = !any_correct ? 1.0 : !any_wrong ? min_correct : 0.5 * (min_correct + max_wrong);
    fit.t_hat = std::clamp(fit.t_hat, 0.0, 1.0);
    // A steep slope: the data says the change happens within the gap.
    fit.gamma = 100;
    fit.var_t = separated_variance(obs.size());
    return fit;
  }
  // Newton's method on the log-likelihood of logit = b0 + b1 s (a tiny ridge keeps H invertible).
  double b0 = 0, b1 = 0;
  double h00 = 0, h01 = 0, h11 = 0;
  for (int iter = 0; iter < 100; ++iter) {
    double g0 = 0, g1 = 0;
    h00 = h01 = h11 = 1e-9;
    for (const Observation& o : obs) {
      const double s = o.similarity;
      const double p = sigmoid(b0 + b1 * s);
      const double r = (o.correct ? 1.0 : 0.0) - p;
      const double w = p * (1 - p);
      g0 += r, g1 += r * s;
      h00 += w, h01 += w * s, h11 += w * s * s;
    }
    const double det = h00 * h11 - h01 * h01;
    if (!(det > 0)) return fit;
    const double d0 = (h11 * g0 - h01 * g1) / det, d1 = (h00 * g1 - h01 * g0) / det;
    b0 += d0, b1 += d1;
    if (std::fabs(d0) + std::fabs(d1) < 1e-10) break;
  }
  const double gamma = std::max(b1, 1e-6);
  const double det = h00 * h11 - h01 * h01;
  if (!(det > 0)) return fit;
  // Delta method: Var(t) = ∇tᵀ H⁻¹ ∇t with t = −b0/b1, ∇t = (−1/b1, b0/b1²).
  const double c00 = h11 / det, c01 = -h01 / det, c11 = h00 / det;
  const double g0 = -1.0 / gamma, g1 = b0 / (gamma * gamma);
  fit.ok = true;
  fit.gamma = gamma;
  fit.t_hat = std::clamp(-b0 / gamma, 0.0, 1.0);
  fit.var_t = std::max(0.0, g0 * g0 * c00 + 2 * g0 * g1 * c01 + g1 * g1 * c11);
  return fit;
}

ThresholdLearner::ThresholdLearner(double delta, int min_observations)
    : delta_(delta), min_observations_(std::max(2, min_observations)) {
  constexpr int kGrid = 50;
  for (int i = 0; i < kGrid; ++i) {
    const double eps = 1e-6 + (1 - 2e-6) * i / (kGrid - 1);
    epsilons_.push_back(eps);
    z_.push_back(normal_quantile(1 - eps));
  }
}

double ThresholdLearner::explore_probability(double s, std::span<const Observation> obs) const {
  if (static_cast<int>(obs.size()) < min_observations_) return 1;
  const ThresholdFit fit = fit_threshold(obs);
  if (!fit.ok) return 1;
  const double sd = std::sqrt(fit.var_t);
  double tau = 1;
  for (size_t i = 0; i < epsilons_.size(); ++i) {
    const double t_prime = std::clamp(fit.t_hat + z_[i] * sd, 0.0, 1.0);
    const double alpha = (1 - epsilons_[i]) * sigmoid(fit.gamma * (s - t_prime));
    tau = std::min(tau, 1 - delta_ / (1 - alpha));
  }
  return std::clamp(tau, 0.0, 1.0);
}

}  // namespace tessera::semantic_cache
