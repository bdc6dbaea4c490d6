// What makes two generation requests answerable by one cached response: the deployment, the
// prompt as the model sees it (chat rendered through the template) and every parameter that
// changes the output, in one canonical text so that field order, defaults spelled out and
// parameters that cannot matter do not split the cache.
#pragma once

#include <string>
#include <vector>

#include "tessera/sdk/types.h"

namespace tessera {

// The output-changing parameters as `name=value;` text in a fixed order. Greedy decoding
// (temperature 0) ignores temperature, top_k, top_p, min_p and the seed, so they are left
// out then; penalties, max_tokens, ignore_eos, stop token ids and stop strings always count.
// Stop strings keep their order-insensitive identity (sorted, duplicates dropped).
std::string canonical_output_params(const SamplingParams& params, const std::vector<std::string>& stop_strings);

// Whether the same request always gets the same output: greedy, or sampled with a seed.
bool is_reproducible(const SamplingParams& params);

}  // namespace tessera
