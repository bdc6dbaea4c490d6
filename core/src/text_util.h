// Small text helpers shared by the core's translation units (not part of the public API).
#pragma once

#include <string>
#include <vector>

namespace tessera::detail {

// items joined by separator: {"a", "b"}, ", " -> "a, b".
inline std::string join(const std::vector<std::string>& items, const char* separator) {
  std::string out;
  for (size_t i = 0; i < items.size(); ++i) {
    if (i) out += separator;
    out += items[i];
  }
  return out;
}

}  // namespace tessera::detail
