// cache_layer.exact: answers a request that was answered before, byte for byte. The key is
// the deployment, the canonical output parameters and the rendered prompt (CacheKey); the
// value is the generated tokens. An in-process LRU tier bounded in bytes comes first, an
// optional Redis tier shared by every gateway process second; both honour the TTL.
#include <chrono>
#include <memory>
#include <mutex>

#include "lru_store.h"
#include "redis_tier.h"
#include "tessera/sdk/cache_layer.h"

namespace tessera {
namespace {

const ParamSpec kParams[] = {
    {"ttl", ParamType::kDuration, "10m", "how long an answer stays valid (in both tiers)", 0.001, 365 * 86400.0},
    {"max_bytes", ParamType::kBytes, "64MiB", "byte budget of the in-process tier (LRU beyond it)", 1024,
     64.0 * (1LL << 30)},
    {"only_reproducible", ParamType::kBool, "true",
     "cache only requests whose output is reproducible (temperature 0 or a seed)"},
    {"redis_url", ParamType::kString, "",
     "the shared tier, redis://[:password@]host[:port][/db]; empty: in-process only"},
    {"redis_timeout", ParamType::kDuration, "100ms", "connect and command timeout of the Redis tier", 0.001, 10},
    {"redis_backoff_max", ParamType::kDuration, "5s", "longest wait between reconnection attempts", 0.01, 600},
    {"redis_prefix", ParamType::kString, "\"tessera:exact:\"", "prefix of the Redis keys"},
};

int64_t unix_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

class ExactCache : public CacheLayer {
 public:
  static Status create(const PluginConfig& config, const PluginContext& context, std::unique_ptr<CacheLayer>* out) {
    auto cache = std::make_unique<ExactCache>();
    cache->ttl_ms_ = static_cast<int64_t>(config.get_float("ttl", 600) * 1000.0);
    cache->memory_ = std::make_unique<exact_cache::LruStore>(config.get_int("max_bytes", 64 << 20));
    cache->only_reproducible_ = config.get_bool("only_reproducible", true);
    cache->prefix_ = config.get_string("redis_prefix", "tessera:exact:");
    if (Status st = exact_cache::make_redis_tier(config, "cache_layer.exact", context.logger, &cache->redis_);
        !st.is_ok())
      return st;
    *out = std::move(cache);
    return Status::ok();
  }

  Status lookup(const CacheKey& key, std::optional<CachedResponse>* out) override {
    if (only_reproducible_ && !key.reproducible) {
      ++skipped_;
      return Status::ok();
    }
    const std::string material = exact_cache::key_material(key.model, key.params, key.prompt);
    const int64_t now = unix_ms();
    exact_cache::Entry entry;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (memory_->get(material, now, &entry)) {
        ++hits_memory_;
        *out = to_response(std::move(entry), "memory");
        return Status::ok();
      }
    }
    if (redis_) {
      std::string value, stored_material;
      // A value that is not ours (another writer, a digest collision) or has expired by our
      // clock is a miss.
      if (redis_->get(prefix_ + exact_cache::key_digest(material), &value) == exact_cache::RedisTier::Result::kHit &&
          exact_cache::decode_entry(value, &stored_material, &entry) && stored_material == material &&
          entry.expires_at_ms > now) {
        ++hits_redis_;
        {
          // Later lookups here need not ask Redis; the entry keeps its original expiry.
          std::lock_guard<std::mutex> lock(mutex_);
          memory_->put(material, entry);
        }
        *out = to_response(std::move(entry), "redis");
        return Status::ok();
      }
    }
    ++misses_;
    return Status::ok();
  }

  Status store(const CacheKey& key, const CachedResponse& response) override {
    if (only_reproducible_ && !key.reproducible) return Status::ok();
    const std::string material = exact_cache::key_material(key.model, key.params, key.prompt);
    exact_cache::Entry entry{response.text, response.tokens, response.finish_reason, unix_ms() + ttl_ms_};
    const std::string value = redis_ ? exact_cache::encode_entry(material, entry) : std::string();
    {
      // The in-process tier first: once Redis has the entry, this process has it too.
      std::lock_guard<std::mutex> lock(mutex_);
      if (memory_->put(material, std::move(entry))) ++stores_;
      else ++too_large_;
    }
    // A failed set is counted by the tier (tessera_cache_redis_errors_total); the answer is
    // still served and kept here.
    if (redis_) redis_->set(prefix_ + exact_cache::key_digest(material), value, ttl_ms_);
    return Status::ok();
  }

  void metrics(std::vector<CacheMetric>* out) const override {
    std::lock_guard<std::mutex> lock(mutex_);
    const char* hits_help = "Lookups answered, by tier.";
    out->push_back({"tessera_cache_layer_hits_total", hits_help, true, {{"tier", "memory"}}, double(hits_memory_)});
    out->push_back({"tessera_cache_layer_hits_total", hits_help, true, {{"tier", "redis"}}, double(hits_redis_)});
    out->push_back({"tessera_cache_layer_misses_total", "Lookups that found nothing.", true, {}, double(misses_)});
    out->push_back({"tessera_cache_layer_skipped_total",
                    "Requests not looked up: their output is not reproducible (only_reproducible).", true, {},
                    double(skipped_)});
    out->push_back({"tessera_cache_layer_stores_total", "Answers stored in the in-process tier.", true, {},
                    double(stores_)});
    out->push_back({"tessera_cache_layer_too_large_total", "Answers larger than the whole byte budget (not kept).",
                    true, {}, double(too_large_)});
    out->push_back({"tessera_cache_layer_evictions_total", "Entries evicted to keep the byte budget (LRU).", true, {},
                    double(memory_->evictions())});
    out->push_back({"tessera_cache_layer_expired_total", "Entries dropped because their TTL passed.", true, {},
                    double(memory_->expirations())});
    out->push_back({"tessera_cache_layer_memory_bytes", "Bytes charged to the in-process tier.", false, {},
                    double(memory_->bytes())});
    out->push_back({"tessera_cache_layer_memory_budget_bytes", "The in-process tier's byte budget (max_bytes).",
                    false, {}, double(memory_->max_bytes())});
    out->push_back({"tessera_cache_layer_memory_entries", "Entries in the in-process tier.", false, {},
                    double(memory_->size())});
    if (redis_) redis_->append_metrics(out);
  }

 private:
  static CachedResponse to_response(exact_cache::Entry entry, const char* tier) {
    CachedResponse r;
    r.text = std::move(entry.text);
    r.tokens = std::move(entry.tokens);
    r.finish_reason = entry.finish_reason;
    r.tier = tier;
    return r;
  }

  int64_t ttl_ms_ = 0;
  bool only_reproducible_ = true;
  std::string prefix_;
  mutable std::mutex mutex_;  // memory_ and the counters below
  std::unique_ptr<exact_cache::LruStore> memory_;
  std::unique_ptr<exact_cache::RedisTier> redis_;  // thread-safe itself
  uint64_t hits_memory_ = 0, hits_redis_ = 0, misses_ = 0, skipped_ = 0, stores_ = 0, too_large_ = 0;
};

}  // namespace
}  // namespace tessera

TESSERA_REGISTER_PLUGIN(tessera::ExactCache, tessera::CacheLayer, "exact", "0.1.0",
                        "exact-match response cache: in-process LRU bounded in bytes, optional Redis tier, TTL",
                        tessera::kParams)
