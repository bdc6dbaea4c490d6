// Locating the real default model (SmolLM2-135M-Instruct Q4_1) for tests that need it.
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

// True when the model is present; otherwise fails (TESSERA_REQUIRE_MODEL=1) or reports a skip.
inline bool have_real_model() {
  if (std::filesystem::exists(real_model_path())) return true;
  if (env_or("TESSERA_REQUIRE_MODEL", "") == "1")
    FAIL("the real model is missing at " << real_model_path() << " (run scripts/fetch-models.sh)");
  MESSAGE("skipped: real model not found at " << real_model_path() << " (run scripts/fetch-models.sh)");
  return false;
}

}  // namespace tessera::test
