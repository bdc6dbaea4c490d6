// cache_layer plugins answer a request without the model: exact match on the normalized
// request, or semantic match on an embedding. The gateway chains them in config order in
// front of each deployment; a hit in any layer never reaches a model. The gateway calls
// lookup and store on its own worker threads, never on an HTTP I/O thread, so a layer may
// block on its shared tier (with bounded timeouts).
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "tessera/sdk/plugin.h"
#include "tessera/sdk/types.h"

namespace tessera {

struct CacheKey {
  std::string model;        // deployment the request targets
  std::string prompt;       // normalized prompt text (chat rendered through the template)
  std::string params;       // canonical text of the sampling parameters that change output
  // Whether the output is reproducible (greedy, or a fixed seed): layers cache other
  // requests only when configured to.
  bool reproducible = true;
  std::span<const float> embedding;  // set for layers with needs_embedding()
  // Whose cache this is: a digest of the API key, else the request's `user`, else empty (one
  // shared tenant). Layers that match by similarity keep tenants apart.
  std::string tenant;
};

struct CachedResponse {
  std::string text;
  std::vector<TokenId> tokens;  // what the model generated (replayed through the gateway)
  FinishReason finish_reason = FinishReason::kStop;
  std::string tier;             // set by lookup: where the hit came from ("memory", "redis")
  float similarity = 1.0f;      // set by lookup: cosine of the hit's prompt to the request's (exact: 1)
};

// One sample of a layer's own metrics (Prometheus text format). `name` is the full metric
// name (e.g. "tessera_cache_redis_errors_total"); the gateway adds a `layer` label.
struct CacheMetric {
  std::string name;
  std::string help;
  bool is_counter = true;  // false: a gauge
  std::vector<std::pair<std::string, std::string>> labels;
  double value = 0;
};

class CacheLayer {
 public:
  virtual ~CacheLayer() = default;
  // Whether lookups need CacheKey::embedding (the gateway computes it once per request).
  virtual bool needs_embedding() const { return false; }
  // Thread-safe. Sets *out on a hit, leaves it empty on a miss. A failing shared tier is a
  // miss (counted in the layer's metrics), not an error.
  virtual Status lookup(const CacheKey& key, std::optional<CachedResponse>* out) = 0;
  // Thread-safe. Stores a finished response.
  virtual Status store(const CacheKey& key, const CachedResponse& response) = 0;
  // Thread-safe. Appends the layer's metrics (hits by tier, bytes, evictions, tier errors).
  virtual void metrics(std::vector<CacheMetric>* out) const { (void)out; }
};

template <> struct PluginKindOf<CacheLayer> {
  static constexpr PluginKind value = PluginKind::kCacheLayer;
};

}  // namespace tessera
