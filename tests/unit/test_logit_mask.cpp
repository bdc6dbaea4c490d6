// The constraint mask applied to a logit row (core/src/kernels/logit_mask.h): the dispatched
// build (AVX2 where the CPU has it) gives the same bits as the portable one and as a plain
// per-token reference, including a vocabulary that is not a multiple of 32 and NaN logits.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/logit_mask.h"

namespace {

bool reference(const std::vector<uint32_t>& allowed, std::vector<float>& row) {
  bool any = false;
  for (size_t t = 0; t < row.size(); ++t) {
    if (allowed[t / 32] >> (t % 32) & 1u) any = true;
    else row[t] = -INFINITY;
  }
  return any;
}

}  // namespace

TEST_CASE("the logit mask keeps exactly the allowed tokens, in every build") {
  std::mt19937 rng(3);
  for (int32_t vocab : {49152, 49155, 31, 1}) {
    for (int density : {0, 1, 2, 3, 4}) {
      INFO("vocab " << vocab << ", density " << density);
      std::vector<uint32_t> allowed((static_cast<size_t>(vocab) + 31) / 32);
      for (uint32_t& w : allowed) {
        // density 0: none; 1: sparse; 2: about half; 3: whole words on and off; 4: all.
        const uint32_t r = static_cast<uint32_t>(rng());
        w = density == 0 ? 0u : density == 1 ? r & static_cast<uint32_t>(rng()) & static_cast<uint32_t>(rng())
          : density == 2 ? r : density == 3 ? (r & 1u ? ~0u : 0u) : ~0u;
      }
      // Bits past the vocabulary's end must not count or be touched.
      if (vocab % 32) allowed.back() |= ~0u << (vocab % 32);
      std::vector<float> row(static_cast<size_t>(vocab));
      for (float& x : row) x = static_cast<float>(static_cast<int32_t>(rng() % 20000) - 10000) / 100.0f;
      row[0] = NAN;
      std::vector<float> expected = row, scalar = row, dispatched = row;
      const bool any = reference(allowed, expected);
      if (vocab % 32 && density == 0) CHECK(!any);
      CHECK(tessera::kernels::apply_logit_mask_scalar(allowed.data(), scalar.data(), vocab) == any);
      CHECK(tessera::kernels::apply_logit_mask(allowed.data(), dispatched.data(), vocab) == any);
      CHECK(std::memcmp(expected.data(), scalar.data(), row.size() * sizeof(float)) == 0);
      CHECK(std::memcmp(expected.data(), dispatched.data(), row.size() * sizeof(float)) == 0);
    }
  }
}
