#include "safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <cstring>
#include <stdexcept>

namespace tessera::safetensors {
namespace {

size_t dtype_size(const std::string& dtype) {
  if (dtype == "F64" || dtype == "I64" || dtype == "U64") return 8;
  if (dtype == "F32" || dtype == "I32" || dtype == "U32") return 4;
  if (dtype == "F16" || dtype == "BF16" || dtype == "I16" || dtype == "U16") return 2;
  if (dtype == "I8" || dtype == "U8" || dtype == "BOOL") return 1;
  return 0;
}

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

}  // namespace

int64_t Tensor::num_elements() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

File::File(const std::string& path) : path_(path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw std::runtime_error(path + ": cannot open: " + std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || st.st_size < 8) {
    ::close(fd);
    throw std::runtime_error(path + ": not a safetensors file (shorter than its header length)");
  }
  size_ = static_cast<size_t>(st.st_size);
  map_ = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  if (map_ == MAP_FAILED) {
    map_ = nullptr;
    throw std::runtime_error(path + ": mmap failed: " + std::strerror(errno));
  }
  const auto* base = static_cast<const uint8_t*>(map_);
  uint64_t header_len = 0;
  std::memcpy(&header_len, base, 8);  // little-endian, as x86 is
  if (header_len > size_ - 8) {
    ::munmap(map_, size_);
    map_ = nullptr;
    throw std::runtime_error(path + ": header length " + std::to_string(header_len) + " runs past the file");
  }
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(reinterpret_cast<const char*>(base + 8), reinterpret_cast<const char*>(base + 8 + header_len));
  } catch (const std::exception& e) {
    ::munmap(map_, size_);
    map_ = nullptr;
    throw std::runtime_error(path + ": header is not JSON: " + e.what());
  }
  const uint8_t* data = base + 8 + header_len;
  const size_t data_size = size_ - 8 - header_len;
  for (auto it = header.begin(); it != header.end(); ++it) {
    if (it.key() == "__metadata__") continue;
    Tensor t;
    t.dtype = it->at("dtype").get<std::string>();
    t.shape = it->at("shape").get<std::vector<int64_t>>();
    const auto offsets = it->at("data_offsets").get<std::vector<uint64_t>>();
    const size_t elem = dtype_size(t.dtype);
    if (offsets.size() != 2 || offsets[0] > offsets[1] || offsets[1] > data_size ||
        (elem && offsets[1] - offsets[0] != elem * static_cast<uint64_t>(t.num_elements()))) {
      ::munmap(map_, size_);
      map_ = nullptr;
      throw std::runtime_error(path + ": tensor '" + it.key() + "' has a bad data range");
    }
    t.data = data + offsets[0];
    t.num_bytes = offsets[1] - offsets[0];
    tensors_.emplace(it.key(), std::move(t));
  }
}

File::~File() {
  if (map_) ::munmap(map_, size_);
  map_ = nullptr;
}

const Tensor* File::find(const std::string& name) const {
  auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : &it->second;
}

const float* File::f32(const std::string& name, const std::vector<int64_t>& shape) const {
  const Tensor* t = find(name);
  if (!t) throw std::runtime_error(path_ + ": tensor '" + name + "' is missing");
  if (t->dtype != "F32") throw std::runtime_error(path_ + ": tensor '" + name + "' is " + t->dtype + ", expected F32");
  if (t->shape != shape)
    throw std::runtime_error(path_ + ": tensor '" + name + "' has shape " + shape_text(t->shape) + ", expected " +
                             shape_text(shape));
  if (reinterpret_cast<uintptr_t>(t->data) % alignof(float) != 0)
    throw std::runtime_error(path_ + ": tensor '" + name + "' is not 4-byte aligned");
  return reinterpret_cast<const float*>(t->data);
}

}  // namespace tessera::safetensors
