// Portable build of the logit mask and its run-time dispatch.
#include "logit_mask.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "tessera/sdk/kernels/ggml_types.h"

namespace tessera::kernels {

bool apply_logit_mask_avx2(const uint32_t* allowed, float* row, int32_t vocab);

namespace {

// Four bits of a mask word as four all-ones / all-zero lane masks.
struct LaneMasks {
  uint32_t lanes[16][4];
  constexpr LaneMasks() : lanes{} {
    for (int v = 0; v < 16; ++v)
      for (int l = 0; l < 4; ++l) lanes[v][l] = (v >> l) & 1 ? ~0u : 0u;
  }
};
constexpr LaneMasks kLaneMasks;
constexpr uint32_t kNegativeInfinityBits = 0xff800000u;  // -inf as an IEEE-754 float

}  // namespace

bool apply_logit_mask_scalar(const uint32_t* allowed, float* row, int32_t vocab) {
  bool any = false;
  // A word at a time: inside JSON strings most words allow all 32 tokens, at structural
  // positions most allow none. Mixed words (a regex inside a word allows thousands of
  // scattered tokens) go without a branch per token: a mispredicted branch per token cost
  // about three times the whole select.
  for (int32_t base = 0; base < vocab; base += 32) {
    uint32_t word = allowed[static_cast<size_t>(base) >> 5];
    const int32_t n = std::min(32, vocab - base);
    if (n < 32) {
      // Bits past the vocabulary's end are neither tokens nor a reason to call a row non-empty.
      const uint32_t valid = (1u << n) - 1;
      word &= valid;
      if (word == valid) word = ~0u;
    }
    if (word == ~0u) {
      any = true;
    } else if (word == 0) {
      std::fill(row + base, row + base + n, -INFINITY);
    } else {
      any = true;
      uint32_t bits[32];
      std::memcpy(bits, row + base, sizeof(float) * static_cast<size_t>(n));
      for (int g = 0; g < 8; ++g) {
        const uint32_t* keep = kLaneMasks.lanes[(word >> (4 * g)) & 15u];
        uint32_t* x = bits + 4 * g;
        for (int l = 0; l < 4; ++l) x[l] = (x[l] & keep[l]) | (kNegativeInfinityBits & ~keep[l]);
      }
      std::memcpy(row + base, bits, sizeof(float) * static_cast<size_t>(n));
    }
  }
  return any;
}

bool apply_logit_mask(const uint32_t* allowed, float* row, int32_t vocab) {
#if defined(__x86_64__) || defined(__i386__)
  if (cpu_has_avx2()) return apply_logit_mask_avx2(allowed, row, vocab);
#endif
  return apply_logit_mask_scalar(allowed, row, vocab);
}

}  // namespace tessera::kernels
