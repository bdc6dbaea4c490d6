// attention.naive's AVX2/FMA/F16C build of its per-head computation (naive_attention_avx2.cpp).
#pragma once

#include <cstdint>
#include <vector>

#include "tessera/sdk/attention.h"

namespace tessera::naive {

// Grows a thread's scratch to hold `needed` floats. Naive attention's scratch is
// O(queries x context), so it must grow with the context; growing to the next power of two
// (at least 64 Ki floats) means a decode step allocates only when the context crosses such a
// boundary, not every step.
inline void ensure_scratch(std::vector<float>& scratch, size_t needed) {
  if (scratch.size() >= needed) return;
  size_t capacity = size_t{1} << 16;
  while (capacity < needed) capacity *= 2;
  scratch.resize(capacity);
}

// Output rows [q_begin, q_end) of `seq` for query head `head`: the same scores, softmax and
// P.V as the portable kernel in naive_attention.cpp, element for element and bit for bit
// (only the loops are vectorized, along the lanes the reference orders already name).
// Requires head_dim % 32 == 0; call only when cpu_has_avx2().
void run_rows_avx2(const AttentionShape& s, const AttentionBatch& batch,
                   const AttentionSequence& seq, int32_t head, int32_t q_begin, int32_t q_end,
                   std::vector<float>& scratch);

}  // namespace tessera::naive
