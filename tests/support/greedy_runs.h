// Runs prompts through an engine greedily and collects each one's generated token ids: the
// common step of tests that compare outputs across stacks, kernels or backends.
#pragma once

#include <doctest/doctest.h>

#include <cstdint>
#include <vector>

#include "tessera/engine.h"

namespace tessera::test {

// Submits every prompt at once (greedy, exactly max_tokens each: ignore_eos), steps the engine
// until idle, and returns the tokens per prompt in submission order. Errors fail the test.
inline std::vector<std::vector<TokenId>> run_greedy(Engine& engine,
                                                    const std::vector<std::vector<TokenId>>& prompts,
                                                    int32_t max_tokens) {
  std::vector<std::vector<TokenId>> out(prompts.size());
  for (size_t i = 0; i < prompts.size(); ++i) {
    GenerationRequest r;
    r.prompt = prompts[i];
    r.params.temperature = 0;
    r.params.max_tokens = max_tokens;
    r.params.ignore_eos = true;
    r.on_event = [&out, i](const GenerationEvent& ev) {
      for (const auto& t : ev.tokens) out[i].push_back(t.token);
      if (ev.finished) CHECK_MESSAGE(ev.error.is_ok(), ev.error.message());
    };
    uint64_t id = 0;
    REQUIRE(engine.submit(std::move(r), &id).is_ok());
  }
  engine.run_until_idle();
  return out;
}

}  // namespace tessera::test
