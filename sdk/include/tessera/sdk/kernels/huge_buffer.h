// Large buffers on transparent huge pages where the kernel offers them (Linux THP in
// "madvise" mode, the default of many distributions). Decode streams the ~90 MiB of weights
// and reads KV rows scattered over a pool of hundreds of MiB once per step; with 4 KiB pages
// nearly every weight page and KV row costs a TLB miss and a page walk, with 2 MiB pages the
// 1.5k-entry L2 TLB covers 3 GiB. Elsewhere this is an ordinary aligned allocation.
#pragma once

#include "tessera/sdk/kernels/version.h"

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>
#include <utility>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace tessera {

inline constexpr size_t kHugePageBytes = size_t{2} << 20;

// Zeroed bytes, 2 MiB aligned when at least one huge page long (so THP can back them), else
// 64-byte aligned. Returns nullptr when out of memory. Free with std::free.
inline void* allocate_huge_zeroed(size_t bytes) {
  const bool huge = bytes >= kHugePageBytes;
  const size_t align = huge ? kHugePageBytes : 64;
  const size_t rounded = bytes == 0 ? align : (bytes + align - 1) / align * align;
  void* p = std::aligned_alloc(align, rounded);
  if (p == nullptr) return nullptr;
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  // Advice only: where THP is off or no huge page is free the pages stay 4 KiB.
  if (huge) madvise(p, rounded, MADV_HUGEPAGE);
#endif
  std::memset(p, 0, rounded);  // touches every page now, so the step loop never faults
  return p;
}

// An owned, movable byte buffer from allocate_huge_zeroed.
class HugeBuffer {
 public:
  HugeBuffer() = default;
  explicit HugeBuffer(size_t bytes)
      : data_(static_cast<uint8_t*>(allocate_huge_zeroed(bytes))), size_(bytes) {
    if (data_ == nullptr) throw std::bad_alloc();
  }
  HugeBuffer(HugeBuffer&& o) noexcept
      : data_(std::exchange(o.data_, nullptr)), size_(std::exchange(o.size_, 0)) {}
  HugeBuffer& operator=(HugeBuffer&& o) noexcept {
    if (this != &o) {
      std::free(data_);
      data_ = std::exchange(o.data_, nullptr);
      size_ = std::exchange(o.size_, 0);
    }
    return *this;
  }
  HugeBuffer(const HugeBuffer&) = delete;
  HugeBuffer& operator=(const HugeBuffer&) = delete;
  ~HugeBuffer() { std::free(data_); }

  uint8_t* data() { return data_; }
  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }

 private:
  uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace tessera
