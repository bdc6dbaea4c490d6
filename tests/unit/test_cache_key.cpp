// The gateway's cache key: which request fields change the output (and so the key) and
// which cannot (and so must not split the cache).
#include <doctest/doctest.h>

#include "tessera/gateway/cache_key.h"

using namespace tessera;

namespace {
SamplingParams greedy() {
  SamplingParams p;
  p.temperature = 0;
  p.max_tokens = 32;
  return p;
}
}  // namespace

TEST_CASE("greedy decoding ignores the sampling knobs, so they do not split the key") {
  SamplingParams a = greedy(), b = greedy();
  b.top_k = 40;
  b.top_p = 0.5f;
  b.min_p = 0.1f;
  b.seed = 7;
  b.has_seed = true;
  b.num_logprobs = 3;  // logprobs never change the tokens
  CHECK(canonical_output_params(a, {}) == canonical_output_params(b, {}));
  CHECK(is_reproducible(a));
}

TEST_CASE("every parameter that changes the output changes the key") {
  const SamplingParams base = greedy();
  const std::string k = canonical_output_params(base, {});
  auto differs = [&](SamplingParams p, std::vector<std::string> stops = {}) {
    return canonical_output_params(p, stops) != k;
  };
  SamplingParams p = base;
  p.max_tokens = 33;
  CHECK(differs(p));
  p = base;
  p.repetition_penalty = 1.1f;
  CHECK(differs(p));
  p = base;
  p.presence_penalty = 0.5f;
  CHECK(differs(p));
  p = base;
  p.frequency_penalty = 0.5f;
  CHECK(differs(p));
  p = base;
  p.ignore_eos = true;
  CHECK(differs(p));
  p = base;
  p.stop_token_ids = {5};
  CHECK(differs(p));
  CHECK(differs(base, {"\n"}));
  p = base;
  p.temperature = 0.7f;
  CHECK(differs(p));
}

TEST_CASE("sampled requests: temperature, top_k, top_p, min_p and the seed all count") {
  SamplingParams a;
  a.temperature = 0.8f;
  a.has_seed = true;
  a.seed = 1;
  CHECK(is_reproducible(a));
  const std::string k = canonical_output_params(a, {});
  for (int field = 0; field < 5; ++field) {
    SamplingParams b = a;
    if (field == 0) b.temperature = 0.9f;
    if (field == 1) b.top_k = 5;
    if (field == 2) b.top_p = 0.9f;
    if (field == 3) b.min_p = 0.05f;
    if (field == 4) b.seed = 2;
    CHECK_MESSAGE(canonical_output_params(b, {}) != k, "field " << field);
  }
  SamplingParams unseeded;
  unseeded.temperature = 0.8f;
  CHECK_FALSE(is_reproducible(unseeded));
}

TEST_CASE("stop strings: order and repeats do not matter, separators cannot forge a key") {
  const SamplingParams p = greedy();
  CHECK(canonical_output_params(p, {"a", "b"}) == canonical_output_params(p, {"b", "a", "a"}));
  CHECK(canonical_output_params(p, {"a;b"}) != canonical_output_params(p, {"a", "b"}));
  CHECK(canonical_output_params(p, {"1:a"}) != canonical_output_params(p, {"a"}));
}
