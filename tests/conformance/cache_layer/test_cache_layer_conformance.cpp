// Every cache_layer plugin (the build's and any on TESSERA_PLUGIN_PATH), with its in-process
// tier only: a stored response is found again for the same key, with its text, tokens and
// finish reason, and not for another prompt or model (nor, in similarity layers, another
// tenant); an entry older than `ttl` is
// gone; a `max_bytes` budget smaller than what was stored evicts the oldest entries and keeps
// the newest; lookups and stores from several threads at once keep these answers. Layers that
// need an embedding get one per prompt (distinct prompts: near-orthogonal vectors).
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "support/plugins.h"
#include "tessera/sdk.h"

using namespace tessera;

namespace {

// A unit vector per prompt text (64 dimensions: two prompts' cosine is about 0 +- 0.13).
std::vector<float> embedding_of(const std::string& prompt) {
  std::mt19937 rng(static_cast<uint32_t>(std::hash<std::string>{}(prompt)));
  std::normal_distribution<float> dist;
  std::vector<float> v(64);
  double norm = 0.0;
  for (float& x : v) {
    x = dist(rng);
    norm += static_cast<double>(x) * x;
  }
  for (float& x : v) x = static_cast<float>(x / std::sqrt(norm));
  return v;
}

struct Key {
  std::vector<float> embedding;
  CacheKey key;
  Key(const std::string& prompt, bool with_embedding, const std::string& model = "m", const std::string& tenant = "") {
    key.model = model;
    key.prompt = prompt;
    key.params = "temperature=0";
    key.tenant = tenant;
    if (with_embedding) {
      embedding = embedding_of(prompt);
      key.embedding = embedding;
    }
  }
};

CachedResponse response(const std::string& text) {
  CachedResponse r;
  r.text = text;
  r.tokens = {1, 2, 3, static_cast<TokenId>(text.size())};
  r.finish_reason = FinishReason::kLength;
  return r;
}

std::optional<CachedResponse> lookup(CacheLayer& layer, const Key& k) {
  std::optional<CachedResponse> out;
  REQUIRE(layer.lookup(k.key, &out).is_ok());
  return out;
}

}  // namespace

TEST_CASE("every cache layer keeps the hit, miss, expiry, byte-bound and thread-safety contracts") {
  test::check_no_load_errors();
  const auto names = test::plugin_names(PluginKind::kCacheLayer);
  REQUIRE(!names.empty());
  for (const std::string& name : names) {
    INFO("cache_layer." << name);
    const std::string base = test::conformance_params(PluginKind::kCacheLayer, name, "{}");
    auto layer = test::create_plugin<CacheLayer>(name, base);
    const bool emb = layer->needs_embedding();

    // Hit: what was stored; misses: another prompt, another model, another tenant.
    const Key k("What is the capital of France?", emb);
    CHECK_FALSE(lookup(*layer, k).has_value());
    REQUIRE(layer->store(k.key, response("Paris.")).is_ok());
    const auto hit = lookup(*layer, k);
    REQUIRE(hit.has_value());
    CHECK(hit->text == "Paris.");
    CHECK(hit->tokens == response("Paris.").tokens);
    CHECK(hit->finish_reason == FinishReason::kLength);
    CHECK(hit->similarity > 0.99f);
    CHECK_FALSE(lookup(*layer, Key("Name a prime number larger than 100.", emb)).has_value());
    CHECK_FALSE(lookup(*layer, Key("What is the capital of France?", emb, "other-model")).has_value());
    // Layers that match by similarity keep tenants apart (CacheKey::tenant); an exact layer
    // may answer another tenant's identical request.
    if (emb) CHECK_FALSE(lookup(*layer, Key("What is the capital of France?", emb, "m", "tenant-b")).has_value());

    // Thread safety: 4 threads store and look up their own keys at once; each finds its own.
    std::atomic<int> wrong{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < 4; ++t)
      threads.emplace_back([&, t] {
        for (int i = 0; i < 50; ++i) {
          const std::string prompt = "thread " + std::to_string(t) + " prompt " + std::to_string(i);
          Key key(prompt, emb);
          if (!layer->store(key.key, response("answer " + prompt)).is_ok()) ++wrong;
          std::optional<CachedResponse> out;
          if (!layer->lookup(key.key, &out).is_ok() || !out || out->text != "answer " + prompt) ++wrong;
        }
      });
    for (auto& th : threads) th.join();
    CHECK(wrong.load() == 0);

    // TTL: with ttl 0.2s an entry is found at first and is gone once that has passed (polled:
    // the machine may be slow, so only "gone within a minute" is asserted).
    if (test::has_param(PluginKind::kCacheLayer, name, "ttl")) {
      auto short_lived = test::create_plugin<CacheLayer>(name, "{ttl: 0.2s}");
      const Key e("expiring prompt", emb);
      const auto stored_at = std::chrono::steady_clock::now();
      REQUIRE(short_lived->store(e.key, response("soon gone")).is_ok());
      const auto first = lookup(*short_lived, e);
      if (std::chrono::steady_clock::now() - stored_at < std::chrono::milliseconds(150)) CHECK(first.has_value());
      const auto deadline = stored_at + std::chrono::seconds(60);
      bool expired = false;
      while (!expired && std::chrono::steady_clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
        expired = !lookup(*short_lived, e).has_value();
      }
      CHECK_MESSAGE(expired, "an entry with ttl 0.2s was still found after 60s");
      CHECK(std::chrono::steady_clock::now() - stored_at >= std::chrono::milliseconds(200));
    } else {
      MESSAGE("cache_layer." << name << " has no 'ttl' parameter: expiry not checked");
    }

    // Byte bound: 40 responses of 1000 bytes into 8 KiB; the newest is kept, the oldest not.
    if (test::has_param(PluginKind::kCacheLayer, name, "max_bytes")) {
      auto small = test::create_plugin<CacheLayer>(name, "{max_bytes: 8KiB}");
      std::vector<Key> keys;
      for (int i = 0; i < 40; ++i) {
        keys.emplace_back("bounded prompt " + std::to_string(i), emb);
        REQUIRE(small->store(keys.back().key, response(std::string(1000, 'a' + i % 26))).is_ok());
      }
      int kept = 0;
      for (const Key& key : keys) kept += lookup(*small, key).has_value();
      CHECK(kept < 9);  // 9 responses of 1000 bytes do not fit in 8 KiB with their keys
      CHECK(lookup(*small, keys.back()).has_value());
      CHECK_FALSE(lookup(*small, keys.front()).has_value());
    } else {
      MESSAGE("cache_layer." << name << " has no 'max_bytes' parameter: byte bound not checked");
    }
    std::vector<CacheMetric> metrics;
    layer->metrics(&metrics);
    for (const CacheMetric& m : metrics) CHECK(!m.name.empty());
  }
}
