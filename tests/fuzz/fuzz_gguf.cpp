// Fuzz target: the GGUF reader (header, metadata, tensor table, offsets, alignment) and the
// tokenizer built from its metadata. Any input must end in a GgufError / runtime_error or a
// file that reads back consistently; a crash, a sanitizer report or another exception type
// (std::length_error, std::bad_alloc, std::out_of_range) is a bug.
#include <cstdint>
#include <stdexcept>

#include "fuzz_support.h"
#include "tessera/gguf.h"
#include "tessera/tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = tessera::fuzz::write_input("input.gguf", data, size);
  std::shared_ptr<tessera::gguf::GgufFile> file;
  try {
    file = tessera::gguf::GgufFile::open(path);
  } catch (const tessera::gguf::GgufError&) {
    return 0;
  }
  // A file that opened must be self-consistent: every tensor's bytes lie inside the file.
  uint64_t checksum = 0;
  for (const auto& t : file->tensors()) {
    if (t.num_bytes == 0) continue;
    checksum += t.data[0] + t.data[t.num_bytes - 1];  // ASan catches an out-of-range pointer
  }
  (void)checksum;
  for (const auto& [key, value] : file->metadata()) (void)file->find(key);
  try {
    auto tokenizer = tessera::Tokenizer::from_gguf(*file);
    const auto ids = tokenizer->encode("Hello, world! 123 <|im_start|>", true, true);
    for (int32_t id : ids)
      FUZZ_CHECK(id >= 0 && id < tokenizer->vocab_size());
    (void)tokenizer->decode(ids, true);
  } catch (const std::runtime_error&) {
  }
  return 0;
}
