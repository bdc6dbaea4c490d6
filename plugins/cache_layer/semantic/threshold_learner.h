// Per-entry similarity thresholds learned online under an error bound δ, after vCache
// (Schroeder et al., "vCache: Verified Semantic Prompt Caching", arXiv 2502.03771).
//
// Each cached entry collects observations (similarity s of a request whose nearest neighbour
// it was, whether the cached answer was the right one for that request). A logistic model
// P(correct | s) = σ(γ (s − t)) is fitted to them by maximum likelihood; the threshold t is
// uncertain (variance by the delta method, or an empirical value when the observations are
// perfectly separated), so for each ε of a grid the cache takes the (1 − ε) upper confidence
// bound t'_ε and the lower bound α_ε = (1 − ε) σ(γ (s − t'_ε)) on the probability that the
// cached answer is right. Exploring (asking the model, and learning from the comparison) with
// probability τ = min_ε [1 − δ / (1 − α_ε)] keeps the probability of a wrong answer at or under δ.
// With fewer than `min_observations` the cache always explores.
#pragma once

#include <span>
#include <vector>

namespace tessera::semantic_cache {

struct Observation {
  float similarity = 0;
  bool correct = false;
};

struct ThresholdFit {
  bool ok = false;
  double t_hat = 1;    // the estimated threshold, in [0, 1]
  double gamma = 0;    // the logistic slope (> 0)
  double var_t = 0;    // the variance of t_hat
};

// Logistic regression of `correct` on `similarity` (Newton's method), t_hat = −β0/β1.
ThresholdFit fit_threshold(std::span<const Observation> observations);

class ThresholdLearner {
 public:
  explicit ThresholdLearner(double delta, int min_observations = 6);
  double delta() const { return delta_; }
  int min_observations() const { return min_observations_; }
  // τ: the probability of exploring a request at `similarity` to the entry whose
  // observations are given (1 with too few observations or a failed fit).
  double explore_probability(double similarity, std::span<const Observation> observations) const;

 private:
  double delta_;
  int min_observations_;
  std::vector<double> epsilons_, z_;  // the ε grid and Φ⁻¹(1 − ε) for each
};

}  // namespace tessera::semantic_cache
