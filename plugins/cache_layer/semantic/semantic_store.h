// The semantic cache's in-process tier: entries (a prompt's embedding and the answer to it)
// grouped in partitions — one per tenant, deployment and output parameters, so a match can
// only ever return an answer given under the same key apart from the prompt — each with its
// own HNSW index (hnswlib, inner product over L2-normalized vectors = cosine). Bounded by a
// number of entries and a byte budget across partitions (least recently used go first),
// and entries expire (TTL). Not thread-safe: the plugin holds one mutex around it.
#pragma once

#include <cstdint>
#include <list>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "threshold_learner.h"
#include "tessera/sdk/types.h"

namespace hnswlib {
template <typename T> class HierarchicalNSW;
class InnerProductSpace;
}  // namespace hnswlib

namespace tessera::semantic_cache {

struct Entry {
  std::string partition;
  std::string prompt;                  // the text that was embedded
  std::vector<float> embedding;        // L2-normalized
  std::string text;
  std::vector<TokenId> tokens;
  FinishReason finish_reason = FinishReason::kStop;
  int64_t expires_at_ms = 0;           // unix time
  std::vector<Observation> observations;  // learned thresholds: how requests near it fared
  bool from_redis = false;             // copied from the shared tier (hits report tier=redis)
  std::string uid;                     // its name in the shared tier (empty without one)
};

// The shared tier's form of an entry: JSON holding everything but from_redis. decode returns
// false on anything malformed (another writer, a truncated value).
std::string encode_entry(const Entry& e);
bool decode_entry(const std::string& value, Entry* e);

struct Neighbor {
  uint64_t id = 0;
  float similarity = 0;
};

class SemanticStore {
 public:
  SemanticStore(int dimension, size_t max_entries, size_t max_bytes);
  ~SemanticStore();
  SemanticStore(const SemanticStore&) = delete;
  SemanticStore& operator=(const SemanticStore&) = delete;

  // The most similar live entry of `partition` to `query` (dimension() floats); entries
  // found expired on the way are dropped.
  std::optional<Neighbor> nearest(const std::string& partition, std::span<const float> query, int64_t now_ms);
  // Adds an entry, evicting least recently used ones until both bounds hold. Returns its id,
  // or 0 when the entry alone exceeds the byte budget (not kept).
  uint64_t insert(Entry entry);
  Entry* find(uint64_t id);      // nullptr when gone
  void touch(uint64_t id);       // mark as most recently used
  void erase(uint64_t id);

  int dimension() const { return dimension_; }
  size_t size() const { return entries_.size(); }
  size_t bytes() const { return bytes_; }
  size_t max_bytes() const { return max_bytes_; }
  size_t max_entries() const { return max_entries_; }
  size_t num_partitions() const { return partitions_.size(); }
  uint64_t evictions() const { return evictions_; }
  uint64_t expirations() const { return expirations_; }
  // What an entry is charged: its strings, tokens, two copies of the embedding (the entry's
  // and the index's), observations, and a fixed 256 bytes of bookkeeping.
  size_t charge(const Entry& e) const;

 private:
  struct Partition;
  struct Slot {
    Entry entry;
    size_t bytes = 0;
    size_t label = 0;  // in its partition's index
    std::list<uint64_t>::iterator lru;
  };

  std::unique_ptr<hnswlib::InnerProductSpace> space_;
  int dimension_;
  size_t max_entries_, max_bytes_;
  size_t bytes_ = 0;
  uint64_t next_id_ = 1;
  uint64_t evictions_ = 0, expirations_ = 0;
  std::unordered_map<uint64_t, Slot> entries_;
  std::unordered_map<std::string, std::unique_ptr<Partition>> partitions_;
  std::list<uint64_t> lru_;  // front: most recently used
};

}  // namespace tessera::semantic_cache
