#include "lru_store.h"

#include <nlohmann/json.hpp>

#include <cstdio>

namespace tessera::exact_cache {

int64_t entry_bytes(const std::string& key, const Entry& e) {
  return 2 * static_cast<int64_t>(key.size()) + static_cast<int64_t>(e.text.size()) +
         static_cast<int64_t>(e.tokens.size() * sizeof(TokenId)) + kEntryOverheadBytes;
}

void LruStore::erase(std::list<Item>::iterator it) {
  bytes_ -= entry_bytes(it->first, it->second);
  index_.erase(it->first);
  lru_.erase(it);
}

bool LruStore::get(const std::string& key, int64_t now_ms, Entry* out) {
  auto found = index_.find(key);
  if (found == index_.end()) return false;
  auto it = found->second;
  if (it->second.expires_at_ms <= now_ms) {
    erase(it);
    ++expirations_;
    return false;
  }
  lru_.splice(lru_.begin(), lru_, it);
  *out = it->second;
  return true;
}

bool LruStore::put(const std::string& key, Entry entry) {
  if (auto found = index_.find(key); found != index_.end()) erase(found->second);
  const int64_t need = entry_bytes(key, entry);
  if (need > max_bytes_) return false;
  while (bytes_ + need > max_bytes_ && !lru_.empty()) {
    erase(std::prev(lru_.end()));
    ++evictions_;
  }
  lru_.emplace_front(key, std::move(entry));
  index_[key] = lru_.begin();
  bytes_ += need;
  return true;
}

std::string key_material(const std::string& model, const std::string& params, const std::string& prompt) {
  std::string out = "v1|";
  for (const std::string* part : {&model, &params, &prompt}) out += std::to_string(part->size()) + ":" + *part + "|";
  return out;
}

namespace {
uint64_t fnv1a(const std::string& s, uint64_t basis) {
  uint64_t h = basis;
  for (unsigned char c : s) {
    h ^= c;
    h *= 0x100000001b3ULL;
  }
  return h;
}
}  // namespace

std::string key_digest(const std::string& material) {
  char buf[33];
  std::snprintf(buf, sizeof buf, "%016llx%016llx", static_cast<unsigned long long>(fnv1a(material, 0xcbf29ce484222325ULL)),
                static_cast<unsigned long long>(fnv1a(material, 0x84222325cbf29ce4ULL)));
  return buf;
}

std::string encode_entry(const std::string& material, const Entry& e) {
  nlohmann::json j = {{"k", material},
                      {"x", e.text},
                      {"t", e.tokens},
                      {"f", static_cast<int>(e.finish_reason)},
                      {"e", e.expires_at_ms}};
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

bool decode_entry(const std::string& value, std::string* material, Entry* e) {
  nlohmann::json j = nlohmann::json::parse(value, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) return false;
  try {
    *material = j.at("k").get<std::string>();
    e->text = j.at("x").get<std::string>();
    e->tokens = j.at("t").get<std::vector<TokenId>>();
    const int f = j.at("f").get<int>();
    if (f < static_cast<int>(FinishReason::kNone) || f > static_cast<int>(FinishReason::kError)) return false;
    e->finish_reason = static_cast<FinishReason>(f);
    e->expires_at_ms = j.at("e").get<int64_t>();
  } catch (const nlohmann::json::exception&) {
    return false;
  }
  return true;
}

}  // namespace tessera::exact_cache
