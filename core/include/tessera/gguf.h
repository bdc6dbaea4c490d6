// GGUF (v2/v3) reader over mmap and a writer for test models.
//
// The reader validates everything it reads (magic, version, counts, string and array
// lengths, tensor dims, types, offsets, sizes, alignment) against the file size before it
// touches the bytes, so a malformed or truncated file becomes a GgufError naming the file,
// what was wrong and the byte offset, never a crash or an out-of-bounds read.
#pragma once

#include "tessera/atomic_file.h"

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "tessera/ggml_types.h"

namespace tessera::gguf {

class GgufError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Metadata value types as numbered by the GGUF spec.
enum class ValueType : uint32_t {
  kUint8 = 0, kInt8 = 1, kUint16 = 2, kInt16 = 3, kUint32 = 4, kInt32 = 5,
  kFloat32 = 6, kBool = 7, kString = 8, kArray = 9, kUint64 = 10, kInt64 = 11, kFloat64 = 12,
};
const char* value_type_name(ValueType t);

// One metadata value. Scalars are widened to the variant's types; arrays keep their element
// type and hold their elements widened the same way (strings as std::string).
struct Value {
  ValueType type = ValueType::kUint8;
  ValueType array_type = ValueType::kUint8;  // element type when type == kArray
  std::variant<uint64_t, int64_t, double, bool, std::string,
               std::vector<uint64_t>, std::vector<int64_t>, std::vector<double>,
               std::vector<bool>, std::vector<std::string>>
      data;
};

struct TensorInfo {
  std::string name;
  std::vector<int64_t> dims;   // ggml order: dims[0] is the contiguous (row) dimension
  GgmlType type = GgmlType::F32;
  uint64_t offset = 0;         // relative to the start of the data section
  size_t num_bytes = 0;
  const uint8_t* data = nullptr;  // points into the mapping; valid while the GgufFile lives

  int64_t num_elements() const;
  int64_t num_rows() const;    // product of dims[1..]
};

class GgufFile {
 public:
  // Maps and validates the file; throws GgufError with the path and the problem.
  static std::shared_ptr<GgufFile> open(const std::string& path);
  ~GgufFile();
  GgufFile(const GgufFile&) = delete;
  GgufFile& operator=(const GgufFile&) = delete;

  const std::string& path() const { return path_; }
  uint32_t version() const { return version_; }
  size_t alignment() const { return alignment_; }
  size_t file_size() const { return size_; }

  const std::map<std::string, Value>& metadata() const { return metadata_; }
  const Value* find(std::string_view key) const;

  // Typed getters. The `get_*` forms throw GgufError naming the key when it is missing or of
  // another type; the `opt_*` forms return nullopt when missing and throw on a type mismatch.
  // Integer getters accept any integer type whose value fits.
  std::string get_string(std::string_view key) const;
  uint64_t get_uint(std::string_view key) const;
  double get_float(std::string_view key) const;
  std::optional<std::string> opt_string(std::string_view key) const;
  std::optional<uint64_t> opt_uint(std::string_view key) const;
  std::optional<int64_t> opt_int(std::string_view key) const;
  std::optional<double> opt_float(std::string_view key) const;
  std::optional<bool> opt_bool(std::string_view key) const;
  // Array getters: return nullptr when missing, throw on wrong element type.
  const std::vector<std::string>* opt_string_array(std::string_view key) const;
  std::optional<std::vector<double>> opt_float_array(std::string_view key) const;
  std::optional<std::vector<int64_t>> opt_int_array(std::string_view key) const;

  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  const TensorInfo* find_tensor(std::string_view name) const;
  // Throws GgufError naming the tensor when missing.
  const TensorInfo& tensor(std::string_view name) const;

 private:
  GgufFile() = default;
  std::string path_;
  uint32_t version_ = 0;
  size_t alignment_ = 32;
  size_t size_ = 0;
  void* mapping_ = nullptr;
  std::map<std::string, Value> metadata_;
  std::vector<TensorInfo> tensors_;
  std::map<std::string, size_t, std::less<>> tensor_index_;
  friend class GgufParser;
};

// Writes GGUF v3 files: `tessera quantize` and tests (tiny models, malformed files) use it.
class GgufWriter {
 public:
  void set_alignment(size_t alignment);
  void add_string(const std::string& key, const std::string& value);
  void add_uint32(const std::string& key, uint32_t value);
  void add_int32(const std::string& key, int32_t value);
  void add_uint64(const std::string& key, uint64_t value);
  void add_float32(const std::string& key, float value);
  void add_bool(const std::string& key, bool value);
  void add_string_array(const std::string& key, const std::vector<std::string>& values);
  void add_float32_array(const std::string& key, const std::vector<float>& values);
  void add_int32_array(const std::string& key, const std::vector<int32_t>& values);
  // Any value as read by GgufFile (copying metadata from one file to another).
  void add_value(const std::string& key, const Value& value);
  // `data` must hold exactly ggml_row_size(type, dims[0]) * rows bytes.
  void add_tensor(const std::string& name, std::vector<int64_t> dims, GgmlType type,
                  std::vector<uint8_t> data);
  // Convenience: quantizes f32 values into `type` (any type quantize_row supports).
  void add_tensor_f32(const std::string& name, std::vector<int64_t> dims, GgmlType type,
                      const std::vector<float>& values);
  // Serializes to bytes (tests corrupt these) or to a file (atomically, see write_file_atomic);
  // throws GgufError on I/O failure.
  std::vector<uint8_t> to_bytes() const;
  void write(const std::string& path) const;

 private:
  struct Kv { std::string key; Value value; };
  struct PendingTensor { std::string name; std::vector<int64_t> dims; GgmlType type; std::vector<uint8_t> data; };
  size_t alignment_ = 32;
  std::vector<Kv> kvs_;
  std::vector<PendingTensor> tensors_;
};

// tessera::write_file_atomically (tessera/atomic_file.h) with its failure as a GgufError
// ("cannot write PATH: reason"): the temporary file is removed and `path` left as it was.
using WriteFn = tessera::WriteFn;
void write_file_atomic(const std::string& path, const std::function<void(const WriteFn& put)>& produce);

}  // namespace tessera::gguf
