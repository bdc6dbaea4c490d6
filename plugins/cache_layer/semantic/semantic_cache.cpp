// cache_layer.semantic: answers a request whose prompt means the same as one answered before.
// The gateway embeds the request's text (its messages' contents, or the completions prompt)
// with the `embedding:` model; the nearest cached prompt of the same partition (tenant +
// deployment + output parameters) answers when its cosine similarity reaches `threshold`, or,
// with learned_thresholds, when vCache's per-entry decision exploits (threshold_learner.h).
// In-process tier: SemanticStore (HNSW per partition, TTL, entry and byte bounds). Shared
// tier (redis_url): every entry as JSON under <prefix><partition digest>:<uid>, and per
// partition a sorted set of uids scored by expiry; a lookup first copies the partition's
// entries this process has not seen into its own index (tier "redis" on their first hit).
#include <chrono>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <unordered_map>

#include "lru_store.h"
#include "redis_tier.h"
#include "semantic_store.h"
#include "tessera/sdk/cache_layer.h"

namespace tessera {
namespace {

using semantic_cache::Entry;
using semantic_cache::Observation;

const ParamSpec kParams[] = {
    {"threshold", ParamType::kFloat, "0.9", "cosine similarity at or above which a cached answer is used", 0, 1},
    {"ttl", ParamType::kDuration, "1h", "how long an answer stays valid", 0.001, 365 * 86400.0},
    {"max_entries", ParamType::kInt, "100000", "most entries kept (least recently used beyond it)", 1, 1 << 30},
    {"max_bytes", ParamType::kBytes, "256MiB", "byte budget of the entries (LRU beyond it)", 4096,
     64.0 * (1LL << 30)},
    {"only_reproducible", ParamType::kBool, "true",
     "cache only requests whose output is reproducible (temperature 0 or a seed)"},
    {"learned_thresholds", ParamType::kBool, "false",
     "per-entry thresholds learned online under the error bound `delta` (vCache) instead of `threshold`"},
    {"delta", ParamType::kFloat, "0.01", "learned thresholds: the bound on the rate of wrong cached answers", 1e-6,
     0.5},
    {"min_observations", ParamType::kInt, "6",
     "learned thresholds: observations an entry needs before it decides on its own (before: the layer's pooled "
     "observations)",
     2, 10000},
    {"seed", ParamType::kInt, "0", "learned thresholds: seed of the explore/exploit draws", 0, 1LL << 62},
    {"redis_url", ParamType::kString, "",
     "the shared tier, redis://[:password@]host[:port][/db]; empty: in-process only"},
    {"redis_timeout", ParamType::kDuration, "100ms", "connect and command timeout of the Redis tier", 0.001, 10},
    {"redis_backoff_max", ParamType::kDuration, "5s", "longest wait between reconnection attempts", 0.01, 600},
    {"redis_prefix", ParamType::kString, "\"tessera:semantic:\"", "prefix of the Redis keys"},
};

constexpr size_t kMaxEntryObservations = 256;  // per entry, oldest dropped
constexpr size_t kMaxPooledObservations = 4096;

int64_t unix_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// Similarity buckets of the hit metric, by their lower edge.
const char* similarity_bucket(float s) {
  if (s >= 0.95f) return "0.95-1.00";
  if (s >= 0.90f) return "0.90-0.95";
  if (s >= 0.85f) return "0.85-0.90";
  if (s >= 0.80f) return "0.80-0.85";
  return "<0.80";
}
constexpr const char* kBuckets[] = {"<0.80", "0.80-0.85", "0.85-0.90", "0.90-0.95", "0.95-1.00"};
constexpr const char* kTiers[] = {"memory", "redis"};

void push_bounded(std::vector<Observation>& v, Observation o, size_t cap) {
  if (v.size() >= cap) v.erase(v.begin());
  v.push_back(o);
}

class SemanticCache : public CacheLayer {
 public:
  static Status create(const PluginConfig& config, const PluginContext& context, std::unique_ptr<CacheLayer>* out) {
    auto cache = std::make_unique<SemanticCache>();
    cache->threshold_ = static_cast<float>(config.get_float("threshold", 0.9));
    cache->ttl_ms_ = static_cast<int64_t>(config.get_float("ttl", 3600) * 1000.0);
    cache->max_entries_ = static_cast<size_t>(config.get_int("max_entries", 100000));
    cache->max_bytes_ = static_cast<size_t>(config.get_int("max_bytes", 256LL << 20));
    cache->only_reproducible_ = config.get_bool("only_reproducible", true);
    cache->learned_ = config.get_bool("learned_thresholds", false);
    cache->learner_ = std::make_unique<semantic_cache::ThresholdLearner>(
        config.get_float("delta", 0.01), static_cast<int>(config.get_int("min_observations", 6)));
    cache->rng_.seed(static_cast<uint64_t>(config.get_int("seed", 0)));
    cache->prefix_ = config.get_string("redis_prefix", "tessera:semantic:");
    if (Status st = exact_cache::make_redis_tier(config, "cache_layer.semantic", context.logger, &cache->redis_);
        !st.is_ok())
      return st;
    if (cache->redis_) {
      std::random_device rd;
      cache->uid_base_ = (uint64_t(rd()) << 32) ^ rd() ^ static_cast<uint64_t>(unix_ms());
    }
    *out = std::move(cache);
    return Status::ok();
  }

  bool needs_embedding() const override { return true; }

  Status lookup(const CacheKey& key, std::optional<CachedResponse>* out) override {
    if (!applies(key)) {
      std::lock_guard<std::mutex> lock(mutex_);
      ++skipped_;
      return Status::ok();
    }
    const std::string part = partition(key);
    if (redis_) pull(part, key.embedding.size());
    std::lock_guard<std::mutex> lock(mutex_);
    SemanticStore& store = store_for(key.embedding.size());
    const auto nb = store.nearest(part, key.embedding, unix_ms());
    Entry* e = nb ? store.find(nb->id) : nullptr;
    if (!e || !accept(*nb, *e)) {
      ++misses_;
      return Status::ok();
    }
    store.touch(nb->id);
    CachedResponse r;
    r.text = e->text;
    r.tokens = e->tokens;
    r.finish_reason = e->finish_reason;
    r.tier = e->from_redis ? "redis" : "memory";
    e->from_redis = false;  // copied here now: later hits are this process's own
    r.similarity = nb->similarity;
    ++hits_[{r.tier, similarity_bucket(nb->similarity)}];
    *out = std::move(r);
    return Status::ok();
  }

  Status store(const CacheKey& key, const CachedResponse& response) override {
    if (!applies(key)) return Status::ok();
    std::unique_lock<std::mutex> lock(mutex_);
    SemanticStore& store = store_for(key.embedding.size());
    const std::string part = partition(key);
    const int64_t now = unix_ms();
    if (learned_) {
      // The request was explored (or nothing was near): what the model said tells whether the
      // nearest entry's answer would have been right at this similarity.
      if (const auto nb = store.nearest(part, key.embedding, now)) {
        Entry* e = store.find(nb->id);
        const Observation o{nb->similarity, e->tokens == response.tokens};
        push_bounded(e->observations, o, kMaxEntryObservations);
        push_bounded(pooled_, o, kMaxPooledObservations);
        ++(o.correct ? observed_correct_ : observed_wrong_);
        if (o.correct) return Status::ok();  // the entry already holds this answer
      }
    }
    Entry e;
    e.partition = part;
    e.prompt = key.prompt;
    e.embedding.assign(key.embedding.begin(), key.embedding.end());
    e.text = response.text;
    e.tokens = response.tokens;
    e.finish_reason = response.finish_reason;
    e.expires_at_ms = now + ttl_ms_;
    std::string value;
    if (redis_) {
      e.uid = std::to_string(uid_base_) + "-" + std::to_string(++uid_serial_);
      seen_[e.uid] = e.expires_at_ms;
      value = encode_entry(e);
    }
    const std::string uid = e.uid;
    if (store.insert(std::move(e))) ++stores_;
    else ++too_large_;
    if (redis_) {
      lock.unlock();  // Redis round trips without the store's lock
      push(part, uid, value, now);
    }
    return Status::ok();
  }

  void metrics(std::vector<CacheMetric>* out) const override {
    std::lock_guard<std::mutex> lock(mutex_);
    const char* hits_help = "Lookups answered, by tier.";
    for (const char* tier : kTiers) {
      uint64_t n = 0;
      for (const char* b : kBuckets) n += count(tier, b);
      out->push_back({"tessera_cache_layer_hits_total", hits_help, true, {{"tier", tier}}, double(n)});
    }
    for (const char* tier : kTiers)
      for (const char* b : kBuckets)
        out->push_back({"tessera_cache_semantic_hits_total",
                        "Semantic cache hits by tier and by the cosine similarity of the matched prompt.", true,
                        {{"tier", tier}, {"similarity", b}}, double(count(tier, b))});
    out->push_back({"tessera_cache_layer_misses_total", "Lookups that found nothing.", true, {}, double(misses_)});
    out->push_back({"tessera_cache_layer_skipped_total",
                    "Requests not looked up: output not reproducible, or no embedding.", true, {}, double(skipped_)});
    out->push_back({"tessera_cache_layer_stores_total", "Answers stored in the in-process tier.", true, {},
                    double(stores_)});
    out->push_back({"tessera_cache_layer_too_large_total", "Answers larger than the whole byte budget (not kept).",
                    true, {}, double(too_large_)});
    const semantic_cache::SemanticStore* s = store_.get();
    out->push_back({"tessera_cache_layer_evictions_total", "Entries evicted to keep the bounds (LRU).", true, {},
                    s ? double(s->evictions()) : 0.0});
    out->push_back({"tessera_cache_layer_expired_total", "Entries dropped because their TTL passed.", true, {},
                    s ? double(s->expirations()) : 0.0});
    out->push_back({"tessera_cache_layer_memory_bytes", "Bytes charged to the in-process tier.", false, {},
                    s ? double(s->bytes()) : 0.0});
    out->push_back({"tessera_cache_layer_memory_budget_bytes", "The in-process tier's byte budget (max_bytes).",
                    false, {}, double(max_bytes_)});
    out->push_back({"tessera_cache_layer_memory_entries", "Entries in the in-process tier.", false, {},
                    s ? double(s->size()) : 0.0});
    out->push_back({"tessera_cache_semantic_partitions", "Partitions (tenant x deployment x parameters) with entries.",
                    false, {}, s ? double(s->num_partitions()) : 0.0});
    if (redis_) {
      redis_->append_metrics(out);
      out->push_back({"tessera_cache_semantic_pulled_total",
                      "Entries copied from the Redis tier into this process's index.", true, {}, double(pulled_)});
    }
    if (learned_) {
      out->push_back({"tessera_cache_semantic_explorations_total",
                      "Learned thresholds: near matches sent to the model to learn from.", true, {},
                      double(explorations_)});
      out->push_back({"tessera_cache_semantic_observations_total",
                      "Learned thresholds: explored answers compared with the nearest entry's.", true,
                      {{"correct", "true"}}, double(observed_correct_)});
      out->push_back({"tessera_cache_semantic_observations_total",
                      "Learned thresholds: explored answers compared with the nearest entry's.", true,
                      {{"correct", "false"}}, double(observed_wrong_)});
    }
  }

 private:
  using SemanticStore = semantic_cache::SemanticStore;

  bool applies(const CacheKey& key) const {
    return !key.embedding.empty() && (!only_reproducible_ || key.reproducible);
  }

  // Tenants, deployments and output parameters never share entries. Unit separators keep the
  // parts apart (none of them contains one).
  static std::string partition(const CacheKey& key) {
    return key.tenant + '\x1f' + key.model + '\x1f' + key.params;
  }

  // The store is sized by the first embedding seen (the gateway's model fixes it).
  SemanticStore& store_for(size_t dimension) {
    if (!store_) store_ = std::make_unique<SemanticStore>(static_cast<int>(dimension), max_entries_, max_bytes_);
    return *store_;
  }

  // Whether the nearest entry answers: the static threshold, or vCache's draw.
  bool accept(const semantic_cache::Neighbor& nb, const Entry& e) {
    if (!learned_) return nb.similarity >= threshold_;
    const bool own = static_cast<int>(e.observations.size()) >= learner_->min_observations();
    const double tau = learner_->explore_probability(nb.similarity, own ? e.observations : pooled_);
    if (std::uniform_real_distribution<double>(0, 1)(rng_) <= tau) {
      ++explorations_;
      return false;
    }
    return true;
  }

  std::string index_key(const std::string& part) const { return prefix_ + exact_cache::key_digest(part); }

  // The shared tier: the entry, its uid in the partition's set (score: expiry), the set's own
  // expiry pushed out, and members past their expiry trimmed. A failure is counted by the tier.
  void push(const std::string& part, const std::string& uid, const std::string& value, int64_t now) {
    const std::string index = index_key(part);
    const std::string ttl = std::to_string(ttl_ms_);
    if (redis_->command({"SET", index + ":" + uid, value, "PX", ttl}) != exact_cache::RedisTier::Result::kHit)
      return;
    redis_->command({"ZADD", index, std::to_string(now + ttl_ms_), uid});
    redis_->command({"PEXPIRE", index, ttl});
    redis_->command({"ZREMRANGEBYSCORE", index, "-inf", std::to_string(now)});
  }

  // Copies the partition's live entries this process has not seen into its index. A value
  // that does not decode, or belongs to another partition (a digest collision), is skipped.
  void pull(const std::string& part, size_t dimension) {
    const int64_t now = unix_ms();
    exact_cache::RedisReply uids;
    const std::string index = index_key(part);
    // Scores are expiry times, so with one TTL newer entries score higher: ask only for those
    // past the highest score pulled before, less a margin for clocks that disagree.
    int64_t from = now;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (auto it = pulled_until_.find(part); it != pulled_until_.end()) from = std::max(from, it->second - 2000);
    }
    if (redis_->command({"ZRANGEBYSCORE", index, std::to_string(from), "+inf", "WITHSCORES"}, &uids) !=
        exact_cache::RedisTier::Result::kHit)
      return;
    std::vector<std::string> wanted = {"MGET"};
    {
      std::lock_guard<std::mutex> lock(mutex_);
      int64_t& until = pulled_until_[part];
      for (size_t i = 0; i + 1 < uids.elements.size(); i += 2) {
        const auto& u = uids.elements[i];
        if (const auto& score = uids.elements[i + 1]) until = std::max<int64_t>(until, std::atoll(score->c_str()));
        if (u && !seen_.count(*u)) wanted.push_back(index + ":" + *u);
      }
    }
    if (wanted.size() == 1) return;
    exact_cache::RedisReply values;
    if (redis_->command(wanted, &values) != exact_cache::RedisTier::Result::kHit) return;
    std::lock_guard<std::mutex> lock(mutex_);
    SemanticStore& store = store_for(dimension);
    for (const auto& v : values.elements) {
      Entry e;
      if (!v || !decode_entry(*v, &e) || e.partition != part || e.expires_at_ms <= now ||
          e.embedding.size() != dimension || seen_.count(e.uid))
        continue;
      seen_[e.uid] = e.expires_at_ms;
      if (store.insert(std::move(e))) ++pulled_;
    }
    // Forget uids past their expiry, so the set stays as large as the live entries.
    if (seen_.size() > 2 * store.max_entries())
      for (auto it = seen_.begin(); it != seen_.end();) it = it->second <= now ? seen_.erase(it) : std::next(it);
  }

  uint64_t count(const char* tier, const char* bucket) const {
    auto it = hits_.find({tier, bucket});
    return it == hits_.end() ? 0 : it->second;
  }

  float threshold_ = 0.9f;
  int64_t ttl_ms_ = 0;
  size_t max_entries_ = 0, max_bytes_ = 0;
  bool only_reproducible_ = true;
  bool learned_ = false;
  std::unique_ptr<semantic_cache::ThresholdLearner> learner_;
  mutable std::mutex mutex_;  // everything below
  std::mt19937_64 rng_;
  std::unique_ptr<SemanticStore> store_;
  std::vector<Observation> pooled_;  // every entry's observations, for entries with too few
  std::map<std::pair<std::string, std::string>, uint64_t> hits_;  // (tier, bucket)
  uint64_t misses_ = 0, skipped_ = 0, stores_ = 0, too_large_ = 0, explorations_ = 0;
  uint64_t observed_correct_ = 0, observed_wrong_ = 0;
  std::string prefix_;
  std::unique_ptr<exact_cache::RedisTier> redis_;  // thread-safe itself
  uint64_t uid_base_ = 0, uid_serial_ = 0, pulled_ = 0;
  std::unordered_map<std::string, int64_t> seen_;  // uids in this process's index (or refused), with expiry
  std::unordered_map<std::string, int64_t> pulled_until_;  // per partition: the highest expiry pulled
};

}  // namespace
}  // namespace tessera

TESSERA_REGISTER_PLUGIN(tessera::SemanticCache, tessera::CacheLayer, "semantic", "0.1.0",
                        "semantic response cache: cosine >= threshold over an HNSW index per tenant, TTL, bounded, "
                        "optional vCache-style learned per-entry thresholds, optional Redis tier",
                        tessera::kParams)
