// Paths the tests need, passed by ctest through the environment (see tests/CMakeLists.txt).
#pragma once
#include <cstdlib>
#include <filesystem>
#include <string>

namespace tessera::test {

inline std::string env_or(const char* name, const std::string& fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::string(v) : fallback;
}
inline std::filesystem::path source_dir() { return env_or("TESSERA_SOURCE_DIR", "."); }
inline std::filesystem::path build_dir() { return env_or("TESSERA_BUILD_DIR", "build"); }
inline std::filesystem::path plugin_dir() { return env_or("TESSERA_PLUGIN_DIR", "build/plugins"); }
inline std::filesystem::path shared_dir() { return env_or("TESSERA_SHARED_DIR", "../shared"); }
// A fresh scratch directory under the build tree, removed and recreated per call.
inline std::filesystem::path scratch_dir(const std::string& name) {
  auto dir = build_dir() / "test-scratch" / name;
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

}  // namespace tessera::test
