// Shared by the fuzz targets: where a target may write the scratch files its input becomes
// (the GGUF reader and the config loader read files, not memory).
#pragma once

#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

// A property every input must keep. On failure it names the condition and aborts, which
// libFuzzer reports as a crash (saving the input) and a replay run as a failed test.
#define FUZZ_CHECK(cond)                                                                \
  do {                                                                                  \
    if (!(cond)) {                                                                      \
      std::fprintf(stderr, "FUZZ_CHECK failed: %s (%s:%d)\n", #cond, __FILE__, __LINE__); \
      std::abort();                                                                     \
    }                                                                                   \
  } while (0)

namespace tessera::fuzz {

// A per-process scratch folder under $TMPDIR, created once and removed when the process
// exits normally (a replay run or a fuzzing session that ends; a crash keeps it, with the
// input that crashed).
inline const std::filesystem::path& scratch_dir() {
  struct Scratch {
    std::filesystem::path dir;
    Scratch() {
      const char* tmp = std::getenv("TMPDIR");
      dir = std::filesystem::path(tmp && *tmp ? tmp : "/tmp") /
            ("tessera-fuzz-" + std::to_string(::getpid()));
      std::filesystem::create_directories(dir);
    }
    ~Scratch() {
      std::error_code ignored;
      std::filesystem::remove_all(dir, ignored);
    }
  };
  static const Scratch scratch;
  return scratch.dir;
}

// Writes the fuzzer's bytes to scratch_dir()/name, replacing what was there.
inline std::string write_input(const std::string& name, const uint8_t* data, size_t size) {
  const std::filesystem::path path = scratch_dir() / name;
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  return path.string();
}

// The folder a file shipped for the tests lives in: $TESSERA_SHARED_DIR/testdata/tokenizer
// when set (ctest sets it), else the checkout's ../shared.
inline std::filesystem::path shared_testdata() {
  if (const char* s = std::getenv("TESSERA_SHARED_DIR"); s && *s)
    return std::filesystem::path(s) / "testdata";
  return std::filesystem::path(TESSERA_FUZZ_SOURCE_DIR) / ".." / "shared" / "testdata";
}

}  // namespace tessera::fuzz
