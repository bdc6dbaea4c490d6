// The exact cache's in-process tier: entries by key, least recently used first out, bounded
// by an approximate byte budget, each with an absolute expiry time. Not thread-safe (the
// plugin holds a mutex around it).
#pragma once

#include <cstdint>
#include <list>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "tessera/sdk/types.h"

namespace tessera::exact_cache {

struct Entry {
  std::string text;
  std::vector<TokenId> tokens;
  FinishReason finish_reason = FinishReason::kStop;
  int64_t expires_at_ms = 0;  // unix time in milliseconds
};

// Bytes an entry is charged: the key (held twice: the list and the index), the text, the
// tokens and a fixed overhead for the nodes and bookkeeping.
inline constexpr int64_t kEntryOverheadBytes = 128;
int64_t entry_bytes(const std::string& key, const Entry& entry);

class LruStore {
 public:
  explicit LruStore(int64_t max_bytes) : max_bytes_(max_bytes) {}

  // A live entry moves to the front and is copied to *out; an expired one is dropped.
  bool get(const std::string& key, int64_t now_ms, Entry* out);
  // Inserts or replaces, then evicts from the back until the budget holds. An entry larger
  // than the whole budget is not kept (returns false).
  bool put(const std::string& key, Entry entry);

  int64_t bytes() const { return bytes_; }
  int64_t max_bytes() const { return max_bytes_; }
  size_t size() const { return index_.size(); }
  uint64_t evictions() const { return evictions_; }
  uint64_t expirations() const { return expirations_; }

 private:
  using Item = std::pair<std::string, Entry>;
  void erase(std::list<Item>::iterator it);

  int64_t max_bytes_;
  int64_t bytes_ = 0;
  uint64_t evictions_ = 0;
  uint64_t expirations_ = 0;
  std::list<Item> lru_;  // front: most recently used
  std::unordered_map<std::string, std::list<Item>::iterator> index_;
};

// The text a request is stored under: deployment, output parameters and prompt, each
// length-prefixed so no two different requests give the same text.
std::string key_material(const std::string& model, const std::string& params, const std::string& prompt);
// 32 hex digits (two FNV-1a 64 hashes with different bases) naming the material in Redis;
// the stored value repeats the material, so a collision is a miss, never a wrong answer.
std::string key_digest(const std::string& material);

// The Redis value: the material, the entry, as JSON. decode returns false on anything else.
std::string encode_entry(const std::string& material, const Entry& entry);
bool decode_entry(const std::string& value, std::string* material, Entry* entry);

}  // namespace tessera::exact_cache
