// Reproducible random inputs for the conformance suites.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

namespace tessera::test {

// n normally distributed floats (mean 0, standard deviation `scale`) from `seed`.
inline std::vector<float> random_floats(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

}  // namespace tessera::test
