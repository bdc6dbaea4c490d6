#include "tessera/token_logprobs.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "tessera/cpu_kernels.h"

namespace tessera {

void fill_token_logprobs(std::span<const float> logits, int32_t num_top, SampledToken* out,
                         std::vector<TokenId>* index) {
  const float max = *std::max_element(logits.begin(), logits.end());
  const double sum = sum_exp_shifted(logits.data(), static_cast<int64_t>(logits.size()), max);
  const float log_norm = max + static_cast<float>(std::log(sum));
  out->logprob = logits[static_cast<size_t>(out->token)] - log_norm;
  out->top.clear();
  if (num_top <= 0) return;
  const size_t k = std::min<size_t>(static_cast<size_t>(num_top), logits.size());
  index->resize(logits.size());
  std::iota(index->begin(), index->end(), 0);
  std::partial_sort(index->begin(), index->begin() + static_cast<std::ptrdiff_t>(k), index->end(),
                    [&](TokenId a, TokenId b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); });
  out->top.reserve(k);
  for (size_t i = 0; i < k; ++i) out->top.push_back({(*index)[i], logits[(*index)[i]] - log_norm});
}

}  // namespace tessera
