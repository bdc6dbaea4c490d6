#include "semantic_store.h"

#include <hnswlib/hnswlib.h>
#include <nlohmann/json.hpp>

#include <algorithm>

namespace tessera::semantic_cache {
namespace {
constexpr size_t kInitialCapacity = 16;  // per partition; doubled when full
constexpr size_t kHnswM = 16, kEfConstruction = 100, kEfSearch = 32;
}  // namespace

struct SemanticStore::Partition {
  std::unique_ptr<hnswlib::HierarchicalNSW<float>> index;
  std::vector<uint64_t> label_to_id;  // 0: free (deleted in the index)
  std::vector<size_t> free_labels;
  size_t live = 0;
};

SemanticStore::SemanticStore(int dimension, size_t max_entries, size_t max_bytes)
    : space_(std::make_unique<hnswlib::InnerProductSpace>(static_cast<size_t>(dimension))),
      dimension_(dimension),
      max_entries_(std::max<size_t>(1, max_entries)),
      max_bytes_(max_bytes) {}

SemanticStore::~SemanticStore() = default;

size_t SemanticStore::charge(const Entry& e) const {
  return e.partition.size() + e.prompt.size() + e.text.size() + e.tokens.size() * sizeof(TokenId) +
         2 * static_cast<size_t>(dimension_) * sizeof(float) + e.observations.capacity() * sizeof(Observation) + 256;
}

std::optional<Neighbor> SemanticStore::nearest(const std::string& partition, std::span<const float> query,
                                               int64_t now_ms) {
  auto it = partitions_.find(partition);
  if (it == partitions_.end() || static_cast<int>(query.size()) != dimension_) return std::nullopt;
  while (true) {
    Partition& p = *it->second;
    if (p.live == 0) return std::nullopt;
    // A few candidates, so one expired entry does not hide the next one.
    auto found = p.index->searchKnn(query.data(), std::min<size_t>(4, p.live));
    std::vector<std::pair<float, size_t>> ranked;
    while (!found.empty()) {
      ranked.emplace_back(found.top().first, found.top().second);
      found.pop();
    }
    std::sort(ranked.begin(), ranked.end());  // smallest distance (1 − cosine) first
    bool dropped = false;
    for (const auto& [distance, label] : ranked) {
      const uint64_t id = p.label_to_id[label];
      Slot& slot = entries_.at(id);
      if (slot.entry.expires_at_ms <= now_ms) {
        ++expirations_;
        erase(id);
        dropped = true;
        break;  // the partition may be gone now: search again
      }
      return Neighbor{id, 1.0f - distance};
    }
    if (!dropped) return std::nullopt;
    it = partitions_.find(partition);
    if (it == partitions_.end()) return std::nullopt;
  }
}

uint64_t SemanticStore::insert(Entry entry) {
  const size_t bytes = charge(entry);
  if (bytes > max_bytes_ || static_cast<int>(entry.embedding.size()) != dimension_) return 0;
  while (!lru_.empty() && (entries_.size() + 1 > max_entries_ || bytes_ + bytes > max_bytes_)) {
    ++evictions_;
    erase(lru_.back());
  }
  auto& slot_partition = partitions_[entry.partition];
  if (!slot_partition) {
    slot_partition = std::make_unique<Partition>();
    slot_partition->index = std::make_unique<hnswlib::HierarchicalNSW<float>>(space_.get(), kInitialCapacity, kHnswM,
                                                                              kEfConstruction);
    slot_partition->index->setEf(kEfSearch);
  }
  Partition& p = *slot_partition;
  size_t label;
  if (!p.free_labels.empty()) {
    label = p.free_labels.back();  // hnswlib overwrites a deleted label's vector in place
    p.free_labels.pop_back();
  } else {
    label = p.label_to_id.size();
    if (label >= p.index->max_elements_) p.index->resizeIndex(std::max<size_t>(kInitialCapacity, 2 * label));
    p.label_to_id.push_back(0);
  }
  const uint64_t id = next_id_++;
  p.index->addPoint(entry.embedding.data(), label);
  p.label_to_id[label] = id;
  ++p.live;
  lru_.push_front(id);
  Slot slot{std::move(entry), bytes, label, lru_.begin()};
  entries_.emplace(id, std::move(slot));
  bytes_ += bytes;
  return id;
}

Entry* SemanticStore::find(uint64_t id) {
  auto it = entries_.find(id);
  return it == entries_.end() ? nullptr : &it->second.entry;
}

void SemanticStore::touch(uint64_t id) {
  auto it = entries_.find(id);
  if (it != entries_.end()) lru_.splice(lru_.begin(), lru_, it->second.lru);
}

void SemanticStore::erase(uint64_t id) {
  auto it = entries_.find(id);
  if (it == entries_.end()) return;
  Slot& slot = it->second;
  auto pit = partitions_.find(slot.entry.partition);
  if (pit != partitions_.end()) {
    Partition& p = *pit->second;
    p.index->markDelete(slot.label);
    p.label_to_id[slot.label] = 0;
    p.free_labels.push_back(slot.label);
    if (--p.live == 0) partitions_.erase(pit);  // an empty tenant costs nothing
  }
  bytes_ -= slot.bytes;
  lru_.erase(slot.lru);
  entries_.erase(it);
}

std::string encode_entry(const Entry& e) {
  nlohmann::json j = {{"partition", e.partition}, {"prompt", e.prompt},     {"embedding", e.embedding},
                      {"text", e.text},           {"tokens", e.tokens},     {"finish", static_cast<int>(e.finish_reason)},
                      {"expires_at_ms", e.expires_at_ms}, {"uid", e.uid}};
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

bool decode_entry(const std::string& value, Entry* e) {
  try {
    const nlohmann::json j = nlohmann::json::parse(value);
    e->partition = j.at("partition").get<std::string>();
    e->prompt = j.at("prompt").get<std::string>();
    e->embedding = j.at("embedding").get<std::vector<float>>();
    e->text = j.at("text").get<std::string>();
    e->tokens = j.at("tokens").get<std::vector<TokenId>>();
    e->finish_reason = static_cast<FinishReason>(j.at("finish").get<int>());
    e->expires_at_ms = j.at("expires_at_ms").get<int64_t>();
    e->uid = j.at("uid").get<std::string>();
    e->observations.clear();
    e->from_redis = true;
    return !e->embedding.empty();
  } catch (const std::exception&) {
    return false;
  }
}

}  // namespace tessera::semantic_cache
