// Locating the real models (SmolLM2-135M-Instruct Q4_1, the default; Gemma 3 270M Q4_K_M)
// for tests that need them.
// scripts/test.sh fetches it and sets TESSERA_REQUIRE_MODEL=1, so in CI a missing model is a
// failure; on a developer machine without it the tests skip with a message.
#pragma once

#include <doctest/doctest.h>

#include <filesystem>
#include <string>

#include "support/test_env.h"
#include "tessera/config.h"

namespace tessera::test {

inline std::string real_model_path() {
  const std::string explicit_path = env_or("TESSERA_MODEL_PATH", "");
  if (!explicit_path.empty()) return explicit_path;
  return (std::filesystem::path(model_cache_dir()) / "SmolLM2-135M-Instruct.Q4_1.gguf").string();
}

inline std::string gemma_model_path() {
  return (std::filesystem::path(model_cache_dir()) / "gemma-3-270m-q4_k_m.gguf").string();
}

// True when the model file is present; otherwise fails (TESSERA_REQUIRE_MODEL=1) or reports a skip.
inline bool have_model_file(const std::string& path) {
  if (std::filesystem::exists(path)) return true;
  if (env_or("TESSERA_REQUIRE_MODEL", "") == "1")
    FAIL("the real model is missing at " << path << " (run scripts/fetch-models.sh)");
  MESSAGE("skipped: real model not found at " << path << " (run scripts/fetch-models.sh)");
  return false;
}

inline bool have_real_model() { return have_model_file(real_model_path()); }
inline bool have_gemma_model() { return have_model_file(gemma_model_path()); }

}  // namespace tessera::test
