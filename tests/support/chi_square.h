// Pearson's chi-square goodness-of-fit test, for tests that check a sampler's output
// distribution. The p-value is the upper regularized incomplete gamma function Q(df/2, x/2)
// (Numerical Recipes' series and continued fraction), so no statistics library is needed.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

namespace tessera::test {

inline double upper_regularized_gamma(double a, double x) {
  if (x <= 0) return 1.0;
  const double gln = std::lgamma(a);
  if (x < a + 1) {  // series for P, then Q = 1 - P
    double sum = 1.0 / a, term = sum;
    for (int n = 1; n < 1000; ++n) {
      term *= x / (a + n);
      sum += term;
      if (std::fabs(term) < std::fabs(sum) * 1e-15) break;
    }
    return 1.0 - sum * std::exp(-x + a * std::log(x) - gln);
  }
  // Lentz's continued fraction for Q.
  double b = x + 1 - a, c = 1e300, d = 1 / b, h = d;
  for (int i = 1; i < 1000; ++i) {
    const double an = -i * (i - a);
    b += 2;
    d = an * d + b;
    if (std::fabs(d) < 1e-300) d = 1e-300;
    c = b + an / c;
    if (std::fabs(c) < 1e-300) c = 1e-300;
    d = 1 / d;
    const double delta = d * c;
    h *= delta;
    if (std::fabs(delta - 1) < 1e-15) break;
  }
  return std::exp(-x + a * std::log(x) - gln) * h;
}

struct ChiSquare {
  double statistic = 0;
  int degrees_of_freedom = 0;
  double p_value = 1;
};

// Observed counts against expected probabilities (summing to 1). Categories expected fewer
// than 5 times are pooled into one, as the test's approximation requires; a count observed
// where the probability is 0 makes the statistic infinite (p = 0).
inline ChiSquare chi_square(const std::vector<int64_t>& observed, const std::vector<double>& expected_p) {
  int64_t n = 0;
  for (int64_t o : observed) n += o;
  ChiSquare r;
  double pooled_obs = 0, pooled_exp = 0;
  int categories = 0;
  for (size_t i = 0; i < observed.size(); ++i) {
    const double e = expected_p[i] * static_cast<double>(n);
    if (e == 0) {
      if (observed[i] > 0) return {INFINITY, 0, 0.0};
      continue;
    }
    if (e < 5) {
      pooled_obs += static_cast<double>(observed[i]);
      pooled_exp += e;
      continue;
    }
    r.statistic += (observed[i] - e) * (observed[i] - e) / e;
    ++categories;
  }
  if (pooled_exp > 0) {
    r.statistic += (pooled_obs - pooled_exp) * (pooled_obs - pooled_exp) / pooled_exp;
    ++categories;
  }
  r.degrees_of_freedom = categories - 1;
  r.p_value = r.degrees_of_freedom > 0 ? upper_regularized_gamma(r.degrees_of_freedom / 2.0, r.statistic / 2.0) : 1.0;
  return r;
}

}  // namespace tessera::test

namespace tessera::test {

// Two samples of equal size from one categorical distribution? (chi-square test of
// homogeneity: sum (a - b)^2 / (a + b) over categories seen in either, df = categories - 1.)
// Categories with fewer than 10 draws in both samples together are pooled.
inline ChiSquare chi_square_two_sample(const std::vector<int64_t>& a, const std::vector<int64_t>& b) {
  ChiSquare r;
  double pooled_a = 0, pooled_b = 0;
  int categories = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double x = static_cast<double>(a[i]), y = static_cast<double>(b[i]);
    if (x + y == 0) continue;
    if (x + y < 10) {
      pooled_a += x;
      pooled_b += y;
      continue;
    }
    r.statistic += (x - y) * (x - y) / (x + y);
    ++categories;
  }
  if (pooled_a + pooled_b > 0) {
    r.statistic += (pooled_a - pooled_b) * (pooled_a - pooled_b) / (pooled_a + pooled_b);
    ++categories;
  }
  r.degrees_of_freedom = categories - 1;
  r.p_value = r.degrees_of_freedom > 0 ? upper_regularized_gamma(r.degrees_of_freedom / 2.0, r.statistic / 2.0) : 1.0;
  return r;
}

}  // namespace tessera::test
