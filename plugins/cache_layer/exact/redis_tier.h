// The exact cache's shared tier: one hiredis connection to a Redis server, with bounded
// connect and command timeouts. After a failure the connection is dropped and not retried
// before a backoff (doubling up to a maximum), so a dead Redis costs each request nothing
// but a clock read; the first command after the backoff reconnects. Thread-safe (one mutex:
// the gateway's cache workers share the connection).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "tessera/sdk/cache_layer.h"
#include "tessera/sdk/logger.h"
#include "tessera/sdk/status.h"

struct redisContext;

namespace tessera::exact_cache {

struct RedisOptions {
  std::string host = "127.0.0.1";
  int port = 6379;
  int db = 0;
  std::string password;
  double timeout = 0.1;       // seconds, for connecting and for each command
  double backoff_min = 0.05;  // first wait after a failure
  double backoff_max = 5;     // the wait doubles up to this
  std::string log_name = "cache_layer.exact";  // who the warnings are from
};

// A reply as far as the cache layers read one.
struct RedisReply {
  bool nil = false;
  std::string str;                                    // a bulk string or status
  long long integer = 0;
  std::vector<std::optional<std::string>> elements;   // an array of bulk strings (nil: empty)
};

// redis://[[user]:password@]host[:port][/db]
Status parse_redis_url(const std::string& url, RedisOptions* out);

class RedisTier;
// The tier a cache layer's `redis_url`, `redis_timeout` and `redis_backoff_max` parameters
// describe (the same keys in every layer); *out stays null when redis_url is empty.
Status make_redis_tier(const PluginConfig& config, const std::string& log_name, Logger* logger,
                       std::unique_ptr<RedisTier>* out);

class RedisTier {
 public:
  enum class Result { kHit, kMiss, kError, kDown };
  // `logger` (may be null) hears each failure once, with the backoff that follows.
  RedisTier(RedisOptions options, Logger* logger) : options_(std::move(options)), logger_(logger) {}
  ~RedisTier();
  RedisTier(const RedisTier&) = delete;
  RedisTier& operator=(const RedisTier&) = delete;

  Result get(const std::string& key, std::string* value);
  // SET key value PX ttl_ms: Redis expires the entry itself.
  Result set(const std::string& key, const std::string& value, int64_t ttl_ms);
  // Any command, binary-safe (argv form). kHit: a reply that is not an error, in *reply when
  // given; an error reply or a failed connection counts as a failure like get/set's.
  Result command(const std::vector<std::string>& argv, RedisReply* reply = nullptr);

  // tessera_cache_redis_{errors,skipped,connects}_total and tessera_cache_redis_up.
  void append_metrics(std::vector<CacheMetric>* out) const;

  uint64_t errors() const { return errors_; }           // failed connects and commands
  uint64_t skipped() const { return skipped_; }         // commands not tried: in backoff
  uint64_t connects() const { return connects_; }       // successful (re)connections
  bool up() const { return up_; }

 private:
  bool ensure_connected();  // with mutex_ held
  void fail(const std::string& what);  // with mutex_ held: drop the connection, back off

  RedisOptions options_;
  Logger* logger_;
  std::mutex mutex_;
  redisContext* context_ = nullptr;
  std::chrono::steady_clock::time_point retry_at_{};
  double backoff_ = 0;
  std::atomic<uint64_t> errors_{0}, skipped_{0}, connects_{0};
  std::atomic<bool> up_{false};
};

}  // namespace tessera::exact_cache
