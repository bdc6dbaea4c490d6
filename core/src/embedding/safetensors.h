// A read-only view of a .safetensors file (8-byte little-endian header length, a JSON header
// naming each tensor's dtype, shape and byte range, then the data), memory-mapped.
// Internal to core/src/embedding.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace tessera::safetensors {

struct Tensor {
  std::string dtype;            // "F32", "F16", "BF16", "I64", ...
  std::vector<int64_t> shape;   // row-major, outermost first
  const uint8_t* data = nullptr;
  size_t num_bytes = 0;
  int64_t num_elements() const;
};

class File {
 public:
  // Throws std::runtime_error naming the file on a malformed header or a range past the end.
  explicit File(const std::string& path);
  ~File();
  File(const File&) = delete;
  File& operator=(const File&) = delete;

  const std::string& path() const { return path_; }
  // nullptr when absent.
  const Tensor* find(const std::string& name) const;
  // The tensor as F32 with exactly `shape`; throws naming the tensor otherwise.
  const float* f32(const std::string& name, const std::vector<int64_t>& shape) const;

 private:
  std::string path_;
  void* map_ = nullptr;
  size_t size_ = 0;
  std::map<std::string, Tensor> tensors_;
};

}  // namespace tessera::safetensors
