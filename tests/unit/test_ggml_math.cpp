// ggml_expf: llama.cpp's vectorized exp evaluated per element. It must stay within its stated
// error of expf over the range softmax and SiLU use, and handle the edges like the vector code.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>

#include "tessera/ggml_types.h"

namespace {
// Distance in units in the last place between two finite floats of the same sign.
int64_t ulp_distance(float a, float b) {
  int32_t ia, ib;
  std::memcpy(&ia, &a, 4);
  std::memcpy(&ib, &b, 4);
  return std::llabs(static_cast<int64_t>(ia) - ib);
}
}  // namespace

TEST_CASE("ggml_expf stays within 2 ulp of expf on [-87, 88]") {
  int64_t worst = 0;
  for (float x = -87.0f; x <= 88.0f; x += 0.001953125f) {
    const float ref = std::exp(x);
    const float got = tessera::ggml_expf(x);
    REQUIRE(std::isfinite(got));
    worst = std::max(worst, ulp_distance(ref, got));
  }
  MESSAGE("worst distance to expf: " << worst << " ulp");
  CHECK(worst <= 2);
  CHECK(tessera::ggml_expf(0.0f) == 1.0f);
}

TEST_CASE("ggml_expf edges: -inf and very negative flush to zero, large overflow to inf") {
  CHECK(tessera::ggml_expf(-std::numeric_limits<float>::infinity()) == 0.0f);
  CHECK(tessera::ggml_expf(-200.0f) == 0.0f);
  CHECK(std::isinf(tessera::ggml_expf(200.0f)));
  // Subnormal results between the two flush points are still produced.
  CHECK(tessera::ggml_expf(-95.0f) > 0.0f);
  CHECK(tessera::ggml_expf(-95.0f) == doctest::Approx(std::exp(-95.0f)).epsilon(1e-3));
}
