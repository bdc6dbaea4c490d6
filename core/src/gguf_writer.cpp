// GGUF v3 writer (little-endian). Tests use it to build tiny models and, by patching the
// returned bytes, malformed files; so it checks its own inputs but deliberately does not
// reject duplicate keys or tensor names (the reader's job is to catch those).
#include <cerrno>
#include <cstdio>
#include <cstring>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include "tessera/gguf.h"

#include "tessera/atomic_file.h"

namespace tessera::gguf {

namespace {

constexpr size_t kDefaultAlignment = 32;

class ByteSink {
 public:
  explicit ByteSink(std::vector<uint8_t>& out) : out_(out) {}
  // resize + memcpy rather than vector::insert: GCC 12 emits false -Wstringop-overflow /
  // -Warray-bounds warnings for inlined inserts into a freshly grown vector.
  void put_raw(const void* p, size_t n) {
    if (n == 0) return;
    const size_t old = out_.size();
    out_.resize(old + n);
    std::memcpy(out_.data() + old, p, n);
  }
  template <typename T>
  void put(T v) {
    put_raw(&v, sizeof(T));  // host is little-endian, like GGUF
  }
  void put_string(const std::string& s) {
    put<uint64_t>(s.size());
    put_raw(s.data(), s.size());
  }
  void put_bytes(const std::vector<uint8_t>& b) { put_raw(b.data(), b.size()); }
  void pad_to(size_t alignment) { out_.resize((out_.size() + alignment - 1) / alignment * alignment, 0); }

 private:
  std::vector<uint8_t>& out_;
};

void put_value(ByteSink& sink, const Value& v) {
  switch (v.type) {
    case ValueType::kUint8: sink.put<uint8_t>(static_cast<uint8_t>(std::get<uint64_t>(v.data))); break;
    case ValueType::kUint16: sink.put<uint16_t>(static_cast<uint16_t>(std::get<uint64_t>(v.data))); break;
    case ValueType::kUint32: sink.put<uint32_t>(static_cast<uint32_t>(std::get<uint64_t>(v.data))); break;
    case ValueType::kUint64: sink.put<uint64_t>(std::get<uint64_t>(v.data)); break;
    case ValueType::kInt8: sink.put<int8_t>(static_cast<int8_t>(std::get<int64_t>(v.data))); break;
    case ValueType::kInt16: sink.put<int16_t>(static_cast<int16_t>(std::get<int64_t>(v.data))); break;
    case ValueType::kInt32: sink.put<int32_t>(static_cast<int32_t>(std::get<int64_t>(v.data))); break;
    case ValueType::kInt64: sink.put<int64_t>(std::get<int64_t>(v.data)); break;
    case ValueType::kFloat32: sink.put<float>(static_cast<float>(std::get<double>(v.data))); break;
    case ValueType::kFloat64: sink.put<double>(std::get<double>(v.data)); break;
    case ValueType::kBool: sink.put<uint8_t>(std::get<bool>(v.data) ? 1 : 0); break;
    case ValueType::kString: sink.put_string(std::get<std::string>(v.data)); break;
    case ValueType::kArray: {
      sink.put<uint32_t>(static_cast<uint32_t>(v.array_type));
      switch (v.array_type) {
        case ValueType::kString: {
          const auto& xs = std::get<std::vector<std::string>>(v.data);
          sink.put<uint64_t>(xs.size());
          for (const auto& s : xs) sink.put_string(s);
          break;
        }
        case ValueType::kFloat32:
        case ValueType::kFloat64: {
          const auto& xs = std::get<std::vector<double>>(v.data);
          sink.put<uint64_t>(xs.size());
          for (double x : xs) {
            if (v.array_type == ValueType::kFloat32) sink.put<float>(static_cast<float>(x));
            else sink.put<double>(x);
          }
          break;
        }
        case ValueType::kBool: {
          const auto& xs = std::get<std::vector<bool>>(v.data);
          sink.put<uint64_t>(xs.size());
          for (bool x : xs) sink.put<uint8_t>(x ? 1 : 0);
          break;
        }
        case ValueType::kUint8: case ValueType::kUint16: case ValueType::kUint32:
        case ValueType::kUint64: {
          const auto& xs = std::get<std::vector<uint64_t>>(v.data);
          sink.put<uint64_t>(xs.size());
          for (uint64_t x : xs) put_value(sink, Value{v.array_type, ValueType::kUint8, x});
          break;
        }
        case ValueType::kInt8: case ValueType::kInt16: case ValueType::kInt32:
        case ValueType::kInt64: {
          const auto& xs = std::get<std::vector<int64_t>>(v.data);
          sink.put<uint64_t>(xs.size());
          for (int64_t x : xs) put_value(sink, Value{v.array_type, ValueType::kUint8, x});
          break;
        }
        default:
          throw GgufError(std::string("GgufWriter: unsupported array element type ") +
                          value_type_name(v.array_type));
      }
      break;
    }
  }
}

std::string dims_to_string(const std::vector<int64_t>& dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

// Validates dims/type and returns the row length's byte size and the number of rows.
void check_shape(const std::string& name, const std::vector<int64_t>& dims, GgmlType type,
                 size_t& row_bytes, int64_t& rows) {
  const GgmlTypeTraits traits = ggml_type_traits(type);
  if (!traits.is_known) {
    throw GgufError("GgufWriter: tensor '" + name + "' has unknown ggml type id " +
                    std::to_string(static_cast<uint32_t>(type)));
  }
  if (dims.empty() || dims.size() > 4) {
    throw GgufError("GgufWriter: tensor '" + name + "' needs 1..4 dims, got " +
                    std::to_string(dims.size()));
  }
  rows = 1;
  for (size_t i = 0; i < dims.size(); ++i) {
    if (dims[i] <= 0) {
      throw GgufError("GgufWriter: tensor '" + name + "' has non-positive dims " +
                      dims_to_string(dims));
    }
    if (i > 0) rows *= dims[i];
  }
  if (dims[0] % traits.block_size != 0) {
    throw GgufError("GgufWriter: tensor '" + name + "' row length " + std::to_string(dims[0]) +
                    " is not a multiple of the " + traits.name + " block size " +
                    std::to_string(traits.block_size));
  }
  row_bytes = ggml_row_size(type, dims[0]);
}

Value scalar(ValueType type, decltype(Value::data) data) {
  Value v;
  v.type = type;
  v.data = std::move(data);
  return v;
}

Value array(ValueType elem, decltype(Value::data) data) {
  Value v;
  v.type = ValueType::kArray;
  v.array_type = elem;
  v.data = std::move(data);
  return v;
}

}  // namespace

void GgufWriter::set_alignment(size_t alignment) {
  if (alignment == 0 || (alignment & (alignment - 1)) != 0 || alignment > (size_t{1} << 30)) {
    throw GgufError("GgufWriter: alignment " + std::to_string(alignment) +
                    " is not a power of two no larger than 2^30");
  }
  alignment_ = alignment;
}

void GgufWriter::add_string(const std::string& key, const std::string& value) {
  kvs_.push_back({key, scalar(ValueType::kString, value)});
}
void GgufWriter::add_uint32(const std::string& key, uint32_t value) {
  kvs_.push_back({key, scalar(ValueType::kUint32, uint64_t{value})});
}
void GgufWriter::add_int32(const std::string& key, int32_t value) {
  kvs_.push_back({key, scalar(ValueType::kInt32, int64_t{value})});
}
void GgufWriter::add_uint64(const std::string& key, uint64_t value) {
  kvs_.push_back({key, scalar(ValueType::kUint64, value)});
}
void GgufWriter::add_float32(const std::string& key, float value) {
  kvs_.push_back({key, scalar(ValueType::kFloat32, double{value})});
}
void GgufWriter::add_bool(const std::string& key, bool value) {
  kvs_.push_back({key, scalar(ValueType::kBool, value)});
}
void GgufWriter::add_string_array(const std::string& key, const std::vector<std::string>& values) {
  kvs_.push_back({key, array(ValueType::kString, values)});
}
void GgufWriter::add_float32_array(const std::string& key, const std::vector<float>& values) {
  kvs_.push_back({key, array(ValueType::kFloat32, std::vector<double>(values.begin(), values.end()))});
}
void GgufWriter::add_int32_array(const std::string& key, const std::vector<int32_t>& values) {
  kvs_.push_back({key, array(ValueType::kInt32, std::vector<int64_t>(values.begin(), values.end()))});
}

void GgufWriter::add_value(const std::string& key, const Value& value) {
  kvs_.push_back({key, value});
}

void GgufWriter::add_tensor(const std::string& name, std::vector<int64_t> dims, GgmlType type,
                            std::vector<uint8_t> data) {
  size_t row_bytes = 0;
  int64_t rows = 0;
  check_shape(name, dims, type, row_bytes, rows);
  const size_t expected = row_bytes * static_cast<size_t>(rows);
  if (data.size() != expected) {
    throw GgufError("GgufWriter: tensor '" + name + "' " + dims_to_string(dims) + " of type " +
                    ggml_type_name(type) + " needs " + std::to_string(expected) +
                    " bytes, got " + std::to_string(data.size()));
  }
  tensors_.push_back({name, std::move(dims), type, std::move(data)});
}

void GgufWriter::add_tensor_f32(const std::string& name, std::vector<int64_t> dims,
                                GgmlType type, const std::vector<float>& values) {
  size_t row_bytes = 0;
  int64_t rows = 0;
  check_shape(name, dims, type, row_bytes, rows);
  if (values.size() != static_cast<size_t>(dims[0] * rows)) {
    throw GgufError("GgufWriter: tensor '" + name + "' " + dims_to_string(dims) + " needs " +
                    std::to_string(dims[0] * rows) + " values, got " +
                    std::to_string(values.size()));
  }
  std::vector<uint8_t> data(row_bytes * static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r) {
    if (!quantize_row(type, values.data() + r * dims[0], data.data() + r * row_bytes, dims[0])) {
      throw GgufError("GgufWriter: tensor '" + name + "': quantize_row does not support type " +
                      ggml_type_name(type));
    }
  }
  tensors_.push_back({name, std::move(dims), type, std::move(data)});
}

std::vector<uint8_t> GgufWriter::to_bytes() const {
  std::vector<uint8_t> out;
  ByteSink sink(out);
  // general.alignment is only needed when it differs from the default; a key the caller added
  // by hand is written as given (tests use that to build inconsistent files).
  bool has_alignment_key = false;
  for (const auto& kv : kvs_) has_alignment_key |= kv.key == "general.alignment";
  const bool write_alignment = alignment_ != kDefaultAlignment && !has_alignment_key;

  sink.put_raw("GGUF", 4);
  sink.put<uint32_t>(3);
  sink.put<uint64_t>(tensors_.size());
  sink.put<uint64_t>(kvs_.size() + (write_alignment ? 1 : 0));
  if (write_alignment) {
    sink.put_string("general.alignment");
    sink.put<uint32_t>(static_cast<uint32_t>(ValueType::kUint32));
    sink.put<uint32_t>(static_cast<uint32_t>(alignment_));
  }
  for (const auto& kv : kvs_) {
    sink.put_string(kv.key);
    sink.put<uint32_t>(static_cast<uint32_t>(kv.value.type));
    put_value(sink, kv.value);
  }
  // Offsets are relative to the data section; each tensor starts aligned, as in ggml.
  uint64_t offset = 0;
  for (const auto& t : tensors_) {
    sink.put_string(t.name);
    sink.put<uint32_t>(static_cast<uint32_t>(t.dims.size()));
    for (int64_t d : t.dims) sink.put<int64_t>(d);
    sink.put<uint32_t>(static_cast<uint32_t>(t.type));
    sink.put<uint64_t>(offset);
    offset += (t.data.size() + alignment_ - 1) / alignment_ * alignment_;
  }
  sink.pad_to(alignment_);
  for (const auto& t : tensors_) {
    sink.put_bytes(t.data);
    sink.pad_to(alignment_);
  }
  return out;
}

void GgufWriter::write(const std::string& path) const {
  const std::vector<uint8_t> bytes = to_bytes();
  write_file_atomic(path, [&](const WriteFn& put) { put(bytes.data(), bytes.size()); });
}

void write_file_atomic(const std::string& path, const std::function<void(const WriteFn& put)>& produce) {
  try {
    write_file_atomically(path, produce);
  } catch (const FileWriteError& e) {
    throw GgufError(e.what());
  }
}

}  // namespace tessera::gguf
