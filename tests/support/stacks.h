// Engines built from the default stack with some keys replaced, as the real-model
// integration tests make them, and the KV check they all end with.
#pragma once

#include <doctest/doctest.h>

#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "support/test_env.h"
#include "tessera/config.h"
#include "tessera/engine.h"
#include "tessera/plugin_registry.h"
#include "tessera/sdk.h"
#include "tessera/stack.h"

namespace tessera::test {

struct Stack {
  std::unique_ptr<PluginRegistry> registry;  // outlives the engine: it holds the plugins
  std::unique_ptr<Engine> engine;
};

// Writes `base` (the default stack unless given) with `yaml` (top-level keys, e.g.
// "engine:\n  kv_cache: ...") merged over it through `extends:`, in scratch folder `name`;
// returns the file.
inline std::filesystem::path write_stack_file(const std::string& name, const std::string& yaml,
                                              const std::string& base = "configs/smollm2-cpu.yaml") {
  const auto path = scratch_dir(name) / "stack.yaml";
  std::ofstream(path) << "extends: " << (source_dir() / base).string() << "\n" << yaml;
  return path;
}

inline Stack make_stack(const std::string& name, const std::string& yaml,
                        const std::string& base = "configs/smollm2-cpu.yaml") {
  const auto path = write_stack_file(name, yaml, base);
  Stack s;
  s.registry = std::make_unique<PluginRegistry>();
  s.registry->scan_directory(plugin_dir());
  s.engine = build_engine(load_stack_config(path.string(), *s.registry), *s.registry);
  return s;
}

// What a request's events delivered: its tokens and how it ended.
struct Outcome {
  std::vector<TokenId> tokens;
  bool finished = false;
  FinishReason reason = FinishReason::kNone;
  std::string error;
};

// An event callback that records into *o (which must outlive the request).
inline EventCallback record_into(Outcome* o) {
  return [o](const GenerationEvent& ev) {
    for (const auto& t : ev.tokens) o->tokens.push_back(t.token);
    if (ev.finished) {
      o->finished = true;
      o->reason = ev.finish_reason;
      o->error = ev.error.message();
    }
  };
}

// With no live sequence, every KV block and slot is free again.
inline void check_all_blocks_free(Engine& engine) {
  const KvStats kv = engine.stats().kv;
  CHECK(kv.num_used_blocks == 0);
  CHECK(kv.num_slots_reserved == 0);
}

// A sampler that forwards to another one; tests override what they observe or break.
class ForwardingSampler : public Sampler {
 public:
  explicit ForwardingSampler(std::shared_ptr<Sampler> inner) : inner_(std::move(inner)) {}
  Status sample(std::span<float> logits, const SamplingInput& in, SamplerState* state, SampledToken* out) override {
    return inner_->sample(logits, in, state, out);
  }
  Status verify(std::span<const std::span<float>> logits, const DraftView& drafts, const SamplingInput& in,
                SamplerState* state, std::vector<SampledToken>* out) override {
    return inner_->verify(logits, drafts, in, state, out);
  }

 protected:
  std::shared_ptr<Sampler> inner_;
};

}  // namespace tessera::test
