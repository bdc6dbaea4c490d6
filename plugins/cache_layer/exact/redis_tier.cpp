#include "redis_tier.h"

#include <hiredis/hiredis.h>

#include <algorithm>
#include <charconv>
#include <cmath>


namespace tessera::exact_cache {

Status parse_redis_url(const std::string& url, RedisOptions* out) {
  const std::string scheme = "redis://";
  if (url.rfind(scheme, 0) != 0)
    return invalid_argument("redis_url: expected redis://[:password@]host[:port][/db], got '" + url + "'");
  std::string rest = url.substr(scheme.size());
  if (auto at = rest.rfind('@'); at != std::string::npos) {
    std::string auth = rest.substr(0, at);
    rest = rest.substr(at + 1);
    auto colon = auth.find(':');
    out->password = colon == std::string::npos ? auth : auth.substr(colon + 1);
  }
  std::string db;
  if (auto slash = rest.find('/'); slash != std::string::npos) {
    db = rest.substr(slash + 1);
    rest = rest.substr(0, slash);
  }
  std::string port;
  if (auto colon = rest.rfind(':'); colon != std::string::npos) {
    port = rest.substr(colon + 1);
    rest = rest.substr(0, colon);
  }
  if (rest.empty()) return invalid_argument("redis_url: no host in '" + url + "'");
  out->host = rest;
  auto number = [&](const std::string& text, int lo, int hi, int* value, const char* what) -> Status {
    int v = 0;
    auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
    if (ec != std::errc() || end != text.data() + text.size() || v < lo || v > hi)
      return invalid_argument(std::string("redis_url: ") + what + " must be an integer in " + std::to_string(lo) +
                              ".." + std::to_string(hi) + ", got '" + text + "'");
    *value = v;
    return Status::ok();
  };
  if (!port.empty())
    if (Status st = number(port, 1, 65535, &out->port, "the port"); !st.is_ok()) return st;
  if (!db.empty())
    if (Status st = number(db, 0, 1 << 20, &out->db, "the database"); !st.is_ok()) return st;
  return Status::ok();
}

Status make_redis_tier(const PluginConfig& config, const std::string& log_name, Logger* logger,
                       std::unique_ptr<RedisTier>* out) {
  const std::string url = config.get_string("redis_url", "");
  if (url.empty()) return Status::ok();
  RedisOptions options;
  if (Status st = parse_redis_url(url, &options); !st.is_ok()) return st;
  options.timeout = config.get_float("redis_timeout", 0.1);
  options.backoff_max = config.get_float("redis_backoff_max", 5);
  options.backoff_min = std::min(options.backoff_min, options.backoff_max);
  options.log_name = log_name;
  *out = std::make_unique<RedisTier>(options, logger);
  return Status::ok();
}

void RedisTier::append_metrics(std::vector<CacheMetric>* out) const {
  out->push_back({"tessera_cache_redis_errors_total", "Failed Redis connects and commands.", true, {},
                  double(errors_)});
  out->push_back({"tessera_cache_redis_skipped_total",
                  "Redis commands not tried because the tier was backing off after an error.", true, {},
                  double(skipped_)});
  out->push_back({"tessera_cache_redis_connects_total", "Successful (re)connections to Redis.", true, {},
                  double(connects_)});
  out->push_back({"tessera_cache_redis_up", "1 while the Redis connection is up.", false, {}, up_ ? 1.0 : 0.0});
}

namespace {
timeval to_timeval(double seconds) {
  timeval tv;
  tv.tv_sec = static_cast<time_t>(seconds);
  tv.tv_usec = static_cast<suseconds_t>(std::lround((seconds - static_cast<double>(tv.tv_sec)) * 1e6));
  return tv;
}

struct Reply {
  redisReply* r = nullptr;
  ~Reply() {
    if (r) freeReplyObject(r);
  }
};
}  // namespace

RedisTier::~RedisTier() {
  if (context_) redisFree(context_);
}

void RedisTier::fail(const std::string& what) {
  ++errors_;
  up_ = false;
  if (context_) {
    redisFree(context_);
    context_ = nullptr;
  }
  backoff_ = backoff_ == 0 ? options_.backoff_min : std::min(backoff_ * 2, options_.backoff_max);
  retry_at_ = std::chrono::steady_clock::now() +
              std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(backoff_));
  if (logger_)
    logger_->log(LogLevel::kWarn, options_.log_name + ": redis " + options_.host + ":" + std::to_string(options_.port) +
                                      ": " + what + "; retrying in " + std::to_string(backoff_) + " s");
}

bool RedisTier::ensure_connected() {
  if (context_) return true;
  if (std::chrono::steady_clock::now() < retry_at_) {
    ++skipped_;
    return false;
  }
  const timeval tv = to_timeval(options_.timeout);
  context_ = redisConnectWithTimeout(options_.host.c_str(), options_.port, tv);
  if (!context_ || context_->err) {
    fail(std::string("cannot connect: ") + (context_ ? context_->errstr : "out of memory"));
    return false;
  }
  redisSetTimeout(context_, tv);
  auto command_ok = [&](redisReply* r) {
    Reply reply{r};
    return r && r->type != REDIS_REPLY_ERROR;
  };
  if (!options_.password.empty() &&
      !command_ok(static_cast<redisReply*>(redisCommand(context_, "AUTH %s", options_.password.c_str())))) {
    fail("AUTH failed");
    return false;
  }
  if (options_.db != 0 && !command_ok(static_cast<redisReply*>(redisCommand(context_, "SELECT %d", options_.db)))) {
    fail("SELECT " + std::to_string(options_.db) + " failed");
    return false;
  }
  ++connects_;
  backoff_ = 0;
  up_ = true;
  return true;
}

RedisTier::Result RedisTier::get(const std::string& key, std::string* value) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!ensure_connected()) return Result::kDown;
  Reply reply{static_cast<redisReply*>(redisCommand(context_, "GET %b", key.data(), key.size()))};
  if (!reply.r) {
    fail(std::string("GET failed: ") + context_->errstr);
    return Result::kError;
  }
  if (reply.r->type == REDIS_REPLY_NIL) return Result::kMiss;
  if (reply.r->type != REDIS_REPLY_STRING) {
    fail("GET answered an unexpected reply type " + std::to_string(reply.r->type));
    return Result::kError;
  }
  value->assign(reply.r->str, reply.r->len);
  return Result::kHit;
}

RedisTier::Result RedisTier::set(const std::string& key, const std::string& value, int64_t ttl_ms) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!ensure_connected()) return Result::kDown;
  Reply reply{static_cast<redisReply*>(redisCommand(context_, "SET %b %b PX %lld", key.data(), key.size(),
                                                    value.data(), value.size(), static_cast<long long>(ttl_ms)))};
  if (!reply.r) {
    fail(std::string("SET failed: ") + context_->errstr);
    return Result::kError;
  }
  if (reply.r->type == REDIS_REPLY_ERROR) {
    fail(std::string("SET refused: ") + std::string(reply.r->str, reply.r->len));
    return Result::kError;
  }
  return Result::kHit;
}

RedisTier::Result RedisTier::command(const std::vector<std::string>& argv, RedisReply* out) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!ensure_connected()) return Result::kDown;
  std::vector<const char*> args;
  std::vector<size_t> lens;
  for (const std::string& a : argv) {
    args.push_back(a.data());
    lens.push_back(a.size());
  }
  Reply reply{static_cast<redisReply*>(
      redisCommandArgv(context_, static_cast<int>(args.size()), args.data(), lens.data()))};
  const std::string name = argv.empty() ? "command" : argv[0];
  if (!reply.r) {
    fail(name + " failed: " + context_->errstr);
    return Result::kError;
  }
  if (reply.r->type == REDIS_REPLY_ERROR) {
    fail(name + " refused: " + std::string(reply.r->str, reply.r->len));
    return Result::kError;
  }
  if (out) {
    *out = RedisReply{};
    out->nil = reply.r->type == REDIS_REPLY_NIL;
    if (reply.r->type == REDIS_REPLY_STRING || reply.r->type == REDIS_REPLY_STATUS)
      out->str.assign(reply.r->str, reply.r->len);
    if (reply.r->type == REDIS_REPLY_INTEGER) out->integer = reply.r->integer;
    if (reply.r->type == REDIS_REPLY_ARRAY)
      for (size_t i = 0; i < reply.r->elements; ++i) {
        const redisReply* e = reply.r->element[i];
        if (e->type == REDIS_REPLY_STRING) out->elements.emplace_back(std::string(e->str, e->len));
        else out->elements.emplace_back(std::nullopt);
      }
  }
  return Result::kHit;
}

}  // namespace tessera::exact_cache
