// Replaces the global operator new/delete of a test binary (include it in exactly one
// translation unit). Every allocation of the process, the plugins' included (they resolve
// operator new to the executable's), first calls the test's hook
//   void before_heap_allocation(std::size_t size);
// which may count it, or throw std::bad_alloc to inject an allocation failure.
#pragma once

#include <cstddef>
#include <cstdlib>
#include <new>

void before_heap_allocation(std::size_t size);

namespace tessera::test::detail {
inline void* heap_allocate(std::size_t size, std::size_t align) {
  before_heap_allocation(size);
  void* p = align <= alignof(std::max_align_t) ? std::malloc(size ? size : 1)
                                                : std::aligned_alloc(align, (size + align - 1) / align * align);
  if (p == nullptr) throw std::bad_alloc();
  return p;
}
}  // namespace tessera::test::detail

void* operator new(std::size_t size) {
  return tessera::test::detail::heap_allocate(size, alignof(std::max_align_t));
}
void* operator new[](std::size_t size) {
  return tessera::test::detail::heap_allocate(size, alignof(std::max_align_t));
}
void* operator new(std::size_t size, std::align_val_t align) {
  return tessera::test::detail::heap_allocate(size, static_cast<std::size_t>(align));
}
void* operator new[](std::size_t size, std::align_val_t align) {
  return tessera::test::detail::heap_allocate(size, static_cast<std::size_t>(align));
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
