// GGUF reader: maps the file read-only and validates every count, length, type and offset
// against the mapped size before reading, so hostile or truncated input yields a GgufError
// (path + problem + byte offset or key/tensor name) instead of a crash.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <limits>
#include <sstream>
#include <type_traits>

#include "tessera/gguf.h"

namespace tessera::gguf {

const char* value_type_name(ValueType t) {
  switch (t) {
    case ValueType::kUint8: return "uint8";
    case ValueType::kInt8: return "int8";
    case ValueType::kUint16: return "uint16";
    case ValueType::kInt16: return "int16";
    case ValueType::kUint32: return "uint32";
    case ValueType::kInt32: return "int32";
    case ValueType::kFloat32: return "float32";
    case ValueType::kBool: return "bool";
    case ValueType::kString: return "string";
    case ValueType::kArray: return "array";
    case ValueType::kUint64: return "uint64";
    case ValueType::kInt64: return "int64";
    case ValueType::kFloat64: return "float64";
  }
  return "unknown";
}

int64_t TensorInfo::num_elements() const {
  int64_t n = 1;
  for (int64_t d : dims) n *= d;
  return n;
}

int64_t TensorInfo::num_rows() const {
  int64_t n = 1;
  for (size_t i = 1; i < dims.size(); ++i) n *= dims[i];
  return n;
}

namespace {

constexpr char kMagic[4] = {'G', 'G', 'U', 'F'};
constexpr uint32_t kMaxDims = 4;  // GGML_MAX_DIMS
constexpr size_t kDefaultAlignment = 32;

// Smallest encodings, used to reject counts that cannot possibly fit in the remaining bytes
// before anything is allocated for them.
constexpr uint64_t kMinKvBytes = 8 + 4 + 1;             // empty key, type, 1-byte value
constexpr uint64_t kMinTensorInfoBytes = 8 + 4 + 8 + 4 + 8;  // empty name, 1 dim, type, offset

bool is_valid_value_type(uint32_t raw) { return raw <= static_cast<uint32_t>(ValueType::kFloat64); }

// Encoded size of one scalar element; 0 for string/array (variable size).
uint64_t scalar_size(ValueType t) {
  switch (t) {
    case ValueType::kUint8: case ValueType::kInt8: case ValueType::kBool: return 1;
    case ValueType::kUint16: case ValueType::kInt16: return 2;
    case ValueType::kUint32: case ValueType::kInt32: case ValueType::kFloat32: return 4;
    case ValueType::kUint64: case ValueType::kInt64: case ValueType::kFloat64: return 8;
    case ValueType::kString: case ValueType::kArray: return 0;
  }
  return 0;
}

bool is_unsigned_type(ValueType t) {
  return t == ValueType::kUint8 || t == ValueType::kUint16 || t == ValueType::kUint32 ||
         t == ValueType::kUint64;
}
bool is_signed_type(ValueType t) {
  return t == ValueType::kInt8 || t == ValueType::kInt16 || t == ValueType::kInt32 ||
         t == ValueType::kInt64;
}
bool is_float_type(ValueType t) { return t == ValueType::kFloat32 || t == ValueType::kFloat64; }

}  // namespace

// Bounds-checked cursor over the mapping. Every read names its byte offset on failure.
class GgufParser {
 public:
  GgufParser(GgufFile& file, const uint8_t* base, size_t size)
      : file_(file), base_(base), size_(size) {}

  void parse();

 private:
  [[noreturn]] void fail(const std::string& what, uint64_t offset) const {
    std::ostringstream os;
    os << file_.path_ << ": " << what << " at byte offset " << offset;
    throw GgufError(os.str());
  }
  [[noreturn]] void fail_no_offset(const std::string& what) const {
    throw GgufError(file_.path_ + ": " + what);
  }

  uint64_t remaining() const { return size_ - pos_; }

  void need(uint64_t n, const char* what) const {
    if (n > remaining()) {
      std::ostringstream os;
      os << "truncated file: " << what << " needs " << n << " bytes but only " << remaining()
         << " remain (file size " << size_ << ")";
      fail(os.str(), pos_);
    }
  }

  template <typename T>
  T read(const char* what) {
    need(sizeof(T), what);
    T v;
    std::memcpy(&v, base_ + pos_, sizeof(T));  // GGUF is little-endian, as is every host we build for
    pos_ += sizeof(T);
    return v;
  }

  std::string read_string(const std::string& what) {
    const uint64_t at = pos_;
    const uint64_t len = read<uint64_t>((what + " length").c_str());
    if (len > remaining()) {
      std::ostringstream os;
      os << what << " length " << len << " exceeds the " << remaining()
         << " bytes left in the file";
      fail(os.str(), at);
    }
    std::string s(reinterpret_cast<const char*>(base_ + pos_), static_cast<size_t>(len));
    pos_ += len;
    return s;
  }

  Value read_value(ValueType type, const std::string& key);
  template <typename Elem, typename Raw>
  void read_array_elems(Value& v, uint64_t count, const std::string& key);
  void parse_header(uint64_t& tensor_count, uint64_t& kv_count);
  void parse_kvs(uint64_t kv_count);
  void apply_alignment();
  void parse_tensor_infos(uint64_t tensor_count);
  void place_tensors();

  GgufFile& file_;
  const uint8_t* base_;
  size_t size_;
  uint64_t pos_ = 0;
  std::vector<uint64_t> tensor_info_offsets_;  // where each tensor's info starts, for errors
};

void GgufParser::parse() {
  uint64_t tensor_count = 0, kv_count = 0;
  parse_header(tensor_count, kv_count);
  parse_kvs(kv_count);
  apply_alignment();
  parse_tensor_infos(tensor_count);
  place_tensors();
}

void GgufParser::parse_header(uint64_t& tensor_count, uint64_t& kv_count) {
  if (size_ < 4) {
    fail_no_offset("file too short to be GGUF (" + std::to_string(size_) +
                   " bytes; the header alone needs 24)");
  }
  if (std::memcmp(base_, kMagic, 4) != 0) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "bad magic %02x %02x %02x %02x (expected \"GGUF\")", base_[0],
                  base_[1], base_[2], base_[3]);
    fail(std::string("not a GGUF file: ") + buf, 0);
  }
  pos_ = 4;
  const uint32_t version = read<uint32_t>("version");
  if (version != 2 && version != 3) {
    std::string what = "unsupported GGUF version " + std::to_string(version) +
                       " (only versions 2 and 3 are supported)";
    // A byte-swapped small version means the file was written big-endian.
    if (version == 0x02000000u || version == 0x03000000u) what += "; the file looks big-endian";
    fail(what, 4);
  }
  file_.version_ = version;
  tensor_count = read<uint64_t>("tensor count");
  kv_count = read<uint64_t>("metadata key/value count");
  if (kv_count > remaining() / kMinKvBytes) {
    fail("metadata key/value count " + std::to_string(kv_count) +
             " cannot fit in the remaining " + std::to_string(remaining()) + " bytes",
         16);
  }
  if (tensor_count > remaining() / kMinTensorInfoBytes) {
    fail("tensor count " + std::to_string(tensor_count) + " cannot fit in the remaining " +
             std::to_string(remaining()) + " bytes",
         8);
  }
}

template <typename Elem, typename Raw>
void GgufParser::read_array_elems(Value& v, uint64_t count, const std::string& key) {
  std::vector<Elem> out;
  out.reserve(static_cast<size_t>(count));  // count was checked against remaining bytes
  for (uint64_t i = 0; i < count; ++i) {
    if constexpr (std::is_same_v<Raw, bool>) {
      const uint64_t at = pos_;
      const uint8_t b = read<uint8_t>("bool array element");
      if (b > 1) fail("key '" + key + "': bool array element " + std::to_string(i) +
                          " has value " + std::to_string(b) + " (expected 0 or 1)", at);
      out.push_back(b != 0);
    } else {
      out.push_back(static_cast<Elem>(read<Raw>("array element")));
    }
  }
  v.data = std::move(out);
}

Value GgufParser::read_value(ValueType type, const std::string& key) {
  Value v;
  v.type = type;
  switch (type) {
    case ValueType::kUint8: v.data = uint64_t{read<uint8_t>("uint8 value")}; break;
    case ValueType::kUint16: v.data = uint64_t{read<uint16_t>("uint16 value")}; break;
    case ValueType::kUint32: v.data = uint64_t{read<uint32_t>("uint32 value")}; break;
    case ValueType::kUint64: v.data = uint64_t{read<uint64_t>("uint64 value")}; break;
    case ValueType::kInt8: v.data = int64_t{read<int8_t>("int8 value")}; break;
    case ValueType::kInt16: v.data = int64_t{read<int16_t>("int16 value")}; break;
    case ValueType::kInt32: v.data = int64_t{read<int32_t>("int32 value")}; break;
    case ValueType::kInt64: v.data = int64_t{read<int64_t>("int64 value")}; break;
    case ValueType::kFloat32: v.data = double{read<float>("float32 value")}; break;
    case ValueType::kFloat64: v.data = double{read<double>("float64 value")}; break;
    case ValueType::kBool: {
      const uint64_t at = pos_;
      const uint8_t b = read<uint8_t>("bool value");
      if (b > 1) fail("key '" + key + "': bool value " + std::to_string(b) + " is not 0 or 1", at);
      v.data = b != 0;
      break;
    }
    case ValueType::kString: v.data = read_string("string value of key '" + key + "'"); break;
    case ValueType::kArray: {
      const uint64_t type_at = pos_;
      const uint32_t raw_elem = read<uint32_t>("array element type");
      if (!is_valid_value_type(raw_elem)) {
        fail("key '" + key + "': unknown array element type " + std::to_string(raw_elem), type_at);
      }
      const auto elem = static_cast<ValueType>(raw_elem);
      if (elem == ValueType::kArray) {
        fail("key '" + key + "': nested arrays are not supported", type_at);
      }
      v.array_type = elem;
      const uint64_t count_at = pos_;
      const uint64_t count = read<uint64_t>("array length");
      // Strings take at least their 8-byte length each.
      const uint64_t min_elem = elem == ValueType::kString ? 8 : scalar_size(elem);
      if (count > remaining() / min_elem) {
        fail("key '" + key + "': array length " + std::to_string(count) + " of " +
                 value_type_name(elem) + " cannot fit in the remaining " +
                 std::to_string(remaining()) + " bytes",
             count_at);
      }
      switch (elem) {
        case ValueType::kUint8: read_array_elems<uint64_t, uint8_t>(v, count, key); break;
        case ValueType::kUint16: read_array_elems<uint64_t, uint16_t>(v, count, key); break;
        case ValueType::kUint32: read_array_elems<uint64_t, uint32_t>(v, count, key); break;
        case ValueType::kUint64: read_array_elems<uint64_t, uint64_t>(v, count, key); break;
        case ValueType::kInt8: read_array_elems<int64_t, int8_t>(v, count, key); break;
        case ValueType::kInt16: read_array_elems<int64_t, int16_t>(v, count, key); break;
        case ValueType::kInt32: read_array_elems<int64_t, int32_t>(v, count, key); break;
        case ValueType::kInt64: read_array_elems<int64_t, int64_t>(v, count, key); break;
        case ValueType::kFloat32: read_array_elems<double, float>(v, count, key); break;
        case ValueType::kFloat64: read_array_elems<double, double>(v, count, key); break;
        case ValueType::kBool: read_array_elems<bool, bool>(v, count, key); break;
        case ValueType::kString: {
          std::vector<std::string> out;
          out.reserve(static_cast<size_t>(count));
          for (uint64_t i = 0; i < count; ++i) {
            out.push_back(read_string("element " + std::to_string(i) + " of key '" + key + "'"));
          }
          v.data = std::move(out);
          break;
        }
        case ValueType::kArray: break;  // rejected above
      }
      break;
    }
  }
  return v;
}

void GgufParser::parse_kvs(uint64_t kv_count) {
  for (uint64_t i = 0; i < kv_count; ++i) {
    const uint64_t key_at = pos_;
    std::string key = read_string("key of metadata entry " + std::to_string(i));
    if (file_.metadata_.count(key) != 0) fail("duplicate metadata key '" + key + "'", key_at);
    const uint64_t type_at = pos_;
    const uint32_t raw_type = read<uint32_t>("value type");
    if (!is_valid_value_type(raw_type)) {
      fail("key '" + key + "': unknown value type " + std::to_string(raw_type), type_at);
    }
    Value v = read_value(static_cast<ValueType>(raw_type), key);
    file_.metadata_.emplace(std::move(key), std::move(v));
  }
}

void GgufParser::apply_alignment() {
  file_.alignment_ = kDefaultAlignment;
  const auto it = file_.metadata_.find("general.alignment");
  if (it == file_.metadata_.end()) return;
  const Value& v = it->second;
  // ggml stores it as uint32; accept any unsigned scalar but keep the value in uint32 range so
  // rounding offsets up to it cannot overflow.
  if (!is_unsigned_type(v.type)) {
    fail_no_offset(std::string("key 'general.alignment' has type ") + value_type_name(v.type) +
                   ", expected an unsigned integer");
  }
  const uint64_t a = std::get<uint64_t>(v.data);
  if (a == 0 || (a & (a - 1)) != 0 || a > (uint64_t{1} << 30)) {
    fail_no_offset("key 'general.alignment' is " + std::to_string(a) +
                   ", expected a power of two no larger than 2^30");
  }
  file_.alignment_ = static_cast<size_t>(a);
}

void GgufParser::parse_tensor_infos(uint64_t tensor_count) {
  file_.tensors_.reserve(static_cast<size_t>(tensor_count));
  tensor_info_offsets_.reserve(static_cast<size_t>(tensor_count));
  for (uint64_t i = 0; i < tensor_count; ++i) {
    const uint64_t info_at = pos_;
    TensorInfo t;
    t.name = read_string("name of tensor " + std::to_string(i));
    if (file_.tensor_index_.count(t.name) != 0) {
      fail("duplicate tensor name '" + t.name + "'", info_at);
    }
    const std::string who = "tensor '" + t.name + "'";
    const uint64_t ndims_at = pos_;
    const uint32_t n_dims = read<uint32_t>("tensor dimension count");
    if (n_dims < 1 || n_dims > kMaxDims) {
      fail(who + ": dimension count " + std::to_string(n_dims) + " is not in 1.." +
               std::to_string(kMaxDims),
           ndims_at);
    }
    int64_t elements = 1;
    for (uint32_t d = 0; d < n_dims; ++d) {
      const uint64_t dim_at = pos_;
      const int64_t dim = read<int64_t>("tensor dimension");
      if (dim <= 0) {
        fail(who + ": dimension " + std::to_string(d) + " is " + std::to_string(dim) +
                 " (must be positive)",
             dim_at);
      }
      if (__builtin_mul_overflow(elements, dim, &elements)) {
        fail(who + ": element count overflows int64", dim_at);
      }
      t.dims.push_back(dim);
    }
    const uint64_t type_at = pos_;
    const uint32_t raw_type = read<uint32_t>("tensor type");
    if (!ggml_type_is_known(raw_type)) {
      fail(who + ": unknown ggml type id " + std::to_string(raw_type), type_at);
    }
    t.type = static_cast<GgmlType>(raw_type);
    const GgmlTypeTraits traits = ggml_type_traits(t.type);
    if (t.dims[0] % traits.block_size != 0) {
      fail(who + ": row length " + std::to_string(t.dims[0]) + " is not a multiple of the " +
               traits.name + " block size " + std::to_string(traits.block_size),
           ndims_at + 4);
    }
    // Bytes = blocks * type_size, checked because type_size can exceed block_size.
    uint64_t bytes = 0;
    if (__builtin_mul_overflow(static_cast<uint64_t>(elements / traits.block_size),
                               static_cast<uint64_t>(traits.type_size), &bytes)) {
      fail(who + ": byte size overflows", type_at);
    }
    t.num_bytes = static_cast<size_t>(bytes);
    const uint64_t offset_at = pos_;
    t.offset = read<uint64_t>("tensor data offset");
    if (t.offset % file_.alignment_ != 0) {
      fail(who + ": data offset " + std::to_string(t.offset) + " is not a multiple of the alignment " +
               std::to_string(file_.alignment_),
           offset_at);
    }
    file_.tensor_index_.emplace(t.name, file_.tensors_.size());
    file_.tensors_.push_back(std::move(t));
    tensor_info_offsets_.push_back(offset_at);
  }
}

void GgufParser::place_tensors() {
  if (file_.tensors_.empty()) return;  // files without tensors (vocab-only) need no data section
  const uint64_t a = file_.alignment_;
  const uint64_t data_start = (pos_ + a - 1) / a * a;  // pos_ <= size_ and a <= 2^30: no overflow
  if (data_start > size_) {
    fail("truncated file: tensor data section should start at " + std::to_string(data_start) +
             " but the file is " + std::to_string(size_) + " bytes",
         pos_);
  }
  const uint64_t data_size = size_ - data_start;
  for (size_t i = 0; i < file_.tensors_.size(); ++i) {
    TensorInfo& t = file_.tensors_[i];
    if (t.offset > data_size || t.num_bytes > data_size - t.offset) {
      fail("tensor '" + t.name + "': data [" + std::to_string(t.offset) + ", +" +
               std::to_string(t.num_bytes) + ") relative to the data section at " +
               std::to_string(data_start) + " extends past the end of the file (size " +
               std::to_string(size_) + ")",
           tensor_info_offsets_[i]);
    }
    t.data = base_ + data_start + t.offset;
  }
  // Overlapping tensors would alias each other's weights: sort by offset and compare neighbours.
  std::vector<size_t> order(file_.tensors_.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t x, size_t y) {
    return file_.tensors_[x].offset < file_.tensors_[y].offset;
  });
  for (size_t k = 1; k < order.size(); ++k) {
    const TensorInfo& prev = file_.tensors_[order[k - 1]];
    const TensorInfo& cur = file_.tensors_[order[k]];
    if (cur.offset < prev.offset + prev.num_bytes) {
      fail("tensor '" + cur.name + "': data at offset " + std::to_string(cur.offset) +
               " overlaps tensor '" + prev.name + "' [" + std::to_string(prev.offset) + ", " +
               std::to_string(prev.offset + prev.num_bytes) + ")",
           tensor_info_offsets_[order[k]]);
    }
  }
  // Writers (llama.cpp's and ours) place each tensor right after the previous one, padded to
  // the alignment. A larger gap means the declared type or shape does not account for the
  // bytes stored: e.g. a Q4_1 tensor relabelled Q4_0 would otherwise be read as valid Q4_0.
  for (size_t k = 0; k < order.size(); ++k) {
    const TensorInfo& t = file_.tensors_[order[k]];
    const uint64_t end = t.offset + t.num_bytes;
    const uint64_t next = k + 1 < order.size() ? file_.tensors_[order[k + 1]].offset : data_size;
    if (next - end >= a) {
      fail("tensor '" + t.name + "': its type " + std::string(ggml_type_name(t.type)) + " and shape give " +
               std::to_string(t.num_bytes) + " bytes, but " + std::to_string(next - t.offset) +
               " bytes lie before the " +
               (k + 1 < order.size() ? "next tensor ('" + file_.tensors_[order[k + 1]].name + "')"
                                     : std::string("end of the file")) +
               "; the type or shape is wrong",
           tensor_info_offsets_[order[k]]);
    }
  }
}

// ---------------------------------------------------------------------------------------------

std::shared_ptr<GgufFile> GgufFile::open(const std::string& path) {
  std::shared_ptr<GgufFile> file(new GgufFile());
  file->path_ = path;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw GgufError("cannot open " + path + ": " + std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    throw GgufError("cannot stat " + path + ": " + std::strerror(err));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    throw GgufError("cannot open " + path + ": not a regular file");
  }
  file->size_ = static_cast<size_t>(st.st_size);
  if (file->size_ == 0) {
    ::close(fd);
    throw GgufError(path + ": empty file (0 bytes), not a GGUF file");
  }
  void* map = ::mmap(nullptr, file->size_, PROT_READ, MAP_PRIVATE, fd, 0);
  const int map_err = errno;
  ::close(fd);  // the mapping keeps the file alive
  if (map == MAP_FAILED) throw GgufError("cannot mmap " + path + ": " + std::strerror(map_err));
  file->mapping_ = map;  // from here the destructor unmaps, also when parsing throws
  GgufParser(*file, static_cast<const uint8_t*>(map), file->size_).parse();
  return file;
}

GgufFile::~GgufFile() {
  if (mapping_ != nullptr) ::munmap(mapping_, size_);
}

const Value* GgufFile::find(std::string_view key) const {
  const auto it = metadata_.find(std::string(key));
  return it == metadata_.end() ? nullptr : &it->second;
}

namespace {

[[noreturn]] void type_mismatch(const std::string& path, std::string_view key, const Value& v,
                                const char* expected) {
  std::string got = value_type_name(v.type);
  if (v.type == ValueType::kArray) got += std::string(" of ") + value_type_name(v.array_type);
  throw GgufError(path + ": key '" + std::string(key) + "' has type " + got + ", expected " +
                  expected);
}

// Any integer value that fits in uint64; nullopt means "not an integer type".
std::optional<uint64_t> as_uint(const std::string& path, std::string_view key, const Value& v) {
  if (is_unsigned_type(v.type)) return std::get<uint64_t>(v.data);
  if (is_signed_type(v.type)) {
    const int64_t x = std::get<int64_t>(v.data);
    if (x < 0) {
      throw GgufError(path + ": key '" + std::string(key) + "' is " + std::to_string(x) +
                      ", expected a non-negative integer");
    }
    return static_cast<uint64_t>(x);
  }
  return std::nullopt;
}

std::optional<int64_t> as_int(const std::string& path, std::string_view key, const Value& v) {
  if (is_signed_type(v.type)) return std::get<int64_t>(v.data);
  if (is_unsigned_type(v.type)) {
    const uint64_t x = std::get<uint64_t>(v.data);
    if (x > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      throw GgufError(path + ": key '" + std::string(key) + "' value " + std::to_string(x) +
                      " does not fit in int64");
    }
    return static_cast<int64_t>(x);
  }
  return std::nullopt;
}

// Floats, and integers widened to double (a scale written as an integer is still a number).
std::optional<double> as_float(const Value& v) {
  if (is_float_type(v.type)) return std::get<double>(v.data);
  if (is_unsigned_type(v.type)) return static_cast<double>(std::get<uint64_t>(v.data));
  if (is_signed_type(v.type)) return static_cast<double>(std::get<int64_t>(v.data));
  return std::nullopt;
}

}  // namespace

std::optional<std::string> GgufFile::opt_string(std::string_view key) const {
  const Value* v = find(key);
  if (v == nullptr) return std::nullopt;
  if (v->type != ValueType::kString) type_mismatch(path_, key, *v, "string");
  return std::get<std::string>(v->data);
}

std::optional<uint64_t> GgufFile::opt_uint(std::string_view key) const {
  const Value* v = find(key);
  if (v == nullptr) return std::nullopt;
  auto r = as_uint(path_, key, *v);
  if (!r) type_mismatch(path_, key, *v, "an integer");
  return r;
}

std::optional<int64_t> GgufFile::opt_int(std::string_view key) const {
  const Value* v = find(key);
  if (v == nullptr) return std::nullopt;
  auto r = as_int(path_, key, *v);
  if (!r) type_mismatch(path_, key, *v, "an integer");
  return r;
}

std::optional<double> GgufFile::opt_float(std::string_view key) const {
  const Value* v = find(key);
  if (v == nullptr) return std::nullopt;
  auto r = as_float(*v);
  if (!r) type_mismatch(path_, key, *v, "a number");
  return r;
}

std::optional<bool> GgufFile::opt_bool(std::string_view key) const {
  const Value* v = find(key);
  if (v == nullptr) return std::nullopt;
  if (v->type != ValueType::kBool) type_mismatch(path_, key, *v, "bool");
  return std::get<bool>(v->data);
}

namespace {
[[noreturn]] void missing_key(const std::string& path, std::string_view key) {
  throw GgufError(path + ": missing metadata key '" + std::string(key) + "'");
}
}  // namespace

std::string GgufFile::get_string(std::string_view key) const {
  auto r = opt_string(key);
  if (!r) missing_key(path_, key);
  return *r;
}

uint64_t GgufFile::get_uint(std::string_view key) const {
  auto r = opt_uint(key);
  if (!r) missing_key(path_, key);
  return *r;
}

double GgufFile::get_float(std::string_view key) const {
  auto r = opt_float(key);
  if (!r) missing_key(path_, key);
  return *r;
}

const std::vector<std::string>* GgufFile::opt_string_array(std::string_view key) const {
  const Value* v = find(key);
  if (v == nullptr) return nullptr;
  if (v->type != ValueType::kArray || v->array_type != ValueType::kString) {
    type_mismatch(path_, key, *v, "array of string");
  }
  return &std::get<std::vector<std::string>>(v->data);
}

std::optional<std::vector<double>> GgufFile::opt_float_array(std::string_view key) const {
  const Value* v = find(key);
  if (v == nullptr) return std::nullopt;
  if (v->type != ValueType::kArray) type_mismatch(path_, key, *v, "array of numbers");
  if (is_float_type(v->array_type)) return std::get<std::vector<double>>(v->data);
  if (is_unsigned_type(v->array_type)) {
    const auto& src = std::get<std::vector<uint64_t>>(v->data);
    return std::vector<double>(src.begin(), src.end());
  }
  if (is_signed_type(v->array_type)) {
    const auto& src = std::get<std::vector<int64_t>>(v->data);
    return std::vector<double>(src.begin(), src.end());
  }
  type_mismatch(path_, key, *v, "array of numbers");
}

std::optional<std::vector<int64_t>> GgufFile::opt_int_array(std::string_view key) const {
  const Value* v = find(key);
  if (v == nullptr) return std::nullopt;
  if (v->type != ValueType::kArray) type_mismatch(path_, key, *v, "array of integers");
  if (is_signed_type(v->array_type)) return std::get<std::vector<int64_t>>(v->data);
  if (is_unsigned_type(v->array_type)) {
    const auto& src = std::get<std::vector<uint64_t>>(v->data);
    std::vector<int64_t> out;
    out.reserve(src.size());
    for (size_t i = 0; i < src.size(); ++i) {
      if (src[i] > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        throw GgufError(path_ + ": key '" + std::string(key) + "' element " + std::to_string(i) +
                        " value " + std::to_string(src[i]) + " does not fit in int64");
      }
      out.push_back(static_cast<int64_t>(src[i]));
    }
    return out;
  }
  type_mismatch(path_, key, *v, "array of integers");
}

const TensorInfo* GgufFile::find_tensor(std::string_view name) const {
  const auto it = tensor_index_.find(name);
  return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

const TensorInfo& GgufFile::tensor(std::string_view name) const {
  const TensorInfo* t = find_tensor(name);
  if (t == nullptr) throw GgufError(path_ + ": missing tensor '" + std::string(name) + "'");
  return *t;
}

}  // namespace tessera::gguf
