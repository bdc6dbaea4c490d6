#include <doctest/doctest.h>

#include "lru_store.h"
#include "redis_tier.h"

using namespace tessera;
using namespace tessera::exact_cache;

namespace {
Entry make_entry(size_t text_bytes, size_t num_tokens, int64_t expires_at_ms = 1'000'000) {
  Entry e;
  e.text.assign(text_bytes, 'x');
  e.tokens.assign(num_tokens, 7);
  e.expires_at_ms = expires_at_ms;
  return e;
}
}  // namespace

TEST_CASE("an entry is charged its key twice, its text, its tokens and the fixed overhead") {
  const Entry e = make_entry(100, 10);
  CHECK(entry_bytes("abcd", e) == 2 * 4 + 100 + 10 * 4 + kEntryOverheadBytes);
  LruStore store(1 << 20);
  REQUIRE(store.put("abcd", e));
  CHECK(store.bytes() == entry_bytes("abcd", e));
  // Replacing an entry re-charges it instead of adding to it.
  REQUIRE(store.put("abcd", make_entry(10, 1)));
  CHECK(store.bytes() == entry_bytes("abcd", make_entry(10, 1)));
  CHECK(store.size() == 1);
}

TEST_CASE("the byte budget evicts the least recently used entries, never the newest") {
  const int64_t one = entry_bytes("k0", make_entry(200, 0));
  LruStore store(3 * one);  // room for exactly three
  for (int i = 0; i < 3; ++i) REQUIRE(store.put("k" + std::to_string(i), make_entry(200, 0)));
  CHECK(store.bytes() == 3 * one);
  Entry out;
  REQUIRE(store.get("k0", 0, &out));  // k0 is now the most recent; k1 the least
  REQUIRE(store.put("k3", make_entry(200, 0)));
  CHECK(store.evictions() == 1);
  CHECK_FALSE(store.get("k1", 0, &out));
  CHECK(store.get("k0", 0, &out));
  CHECK(store.get("k2", 0, &out));
  CHECK(store.get("k3", 0, &out));
  CHECK(store.bytes() == 3 * one);
  CHECK(store.bytes() <= store.max_bytes());
}

TEST_CASE("an entry larger than the whole budget is refused and evicts nothing") {
  LruStore store(1024);
  REQUIRE(store.put("small", make_entry(10, 0)));
  CHECK_FALSE(store.put("big", make_entry(4096, 0)));
  Entry out;
  CHECK(store.get("small", 0, &out));
  CHECK(store.evictions() == 0);
}

TEST_CASE("an expired entry is a miss and gives its bytes back") {
  LruStore store(1 << 20);
  REQUIRE(store.put("k", make_entry(50, 5, /*expires_at_ms=*/1000)));
  Entry out;
  CHECK(store.get("k", 999, &out));
  CHECK(out.text.size() == 50);
  CHECK_FALSE(store.get("k", 1000, &out));
  CHECK(store.expirations() == 1);
  CHECK(store.bytes() == 0);
  CHECK(store.size() == 0);
}

TEST_CASE("key material separates its parts unambiguously") {
  // Moving text between the parts changes the material.
  CHECK(key_material("a", "b|c", "d") != key_material("a", "b", "c|d"));
  CHECK(key_material("ab", "", "c") != key_material("a", "b", "c"));
  CHECK(key_material("m", "p", "x") == key_material("m", "p", "x"));
  CHECK(key_digest(key_material("m", "p", "x")).size() == 32);
  CHECK(key_digest("a") != key_digest("b"));
}

TEST_CASE("a Redis value round-trips and anything else is refused") {
  Entry e = make_entry(3, 2, 12345);
  e.finish_reason = FinishReason::kLength;
  std::string material;
  Entry back;
  REQUIRE(decode_entry(encode_entry("mat", e), &material, &back));
  CHECK(material == "mat");
  CHECK(back.text == e.text);
  CHECK(back.tokens == e.tokens);
  CHECK(back.finish_reason == FinishReason::kLength);
  CHECK(back.expires_at_ms == 12345);
  CHECK_FALSE(decode_entry("not json", &material, &back));
  CHECK_FALSE(decode_entry(R"({"k":"m"})", &material, &back));
  CHECK_FALSE(decode_entry(R"({"k":"m","x":"","t":[],"f":99,"e":0})", &material, &back));
}

TEST_CASE("redis URLs: host, port, database and password; bad ones name the problem") {
  RedisOptions o;
  REQUIRE(parse_redis_url("redis://10.0.0.5:6380/2", &o).is_ok());
  CHECK(o.host == "10.0.0.5");
  CHECK(o.port == 6380);
  CHECK(o.db == 2);
  RedisOptions p;
  REQUIRE(parse_redis_url("redis://:s3cret@localhost", &p).is_ok());
  CHECK(p.password == "s3cret");
  CHECK(p.port == 6379);
  RedisOptions bad;
  CHECK(parse_redis_url("http://x", &bad).message().find("redis_url") == 0);
  CHECK(parse_redis_url("redis://x:99999", &bad).message().find("port") != std::string::npos);
  CHECK(parse_redis_url("redis://:6379", &bad).message().find("no host") != std::string::npos);
}
