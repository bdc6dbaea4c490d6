// cache_layer plugins answer a request without the model: exact match on the normalized
// request, or semantic match on an embedding. The gateway chains them in config order; a hit
// in any layer never reaches a model.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "tessera/sdk/plugin.h"
#include "tessera/sdk/types.h"

namespace tessera {

struct CacheKey {
  std::string model;        // deployment / model name the request targets
  std::string prompt;       // normalized prompt text (chat rendered through the template)
  std::string params;       // canonical text of the sampling parameters that change output
  std::span<const float> embedding;  // set for layers with needs_embedding()
};

struct CachedResponse {
  std::string text;
  std::vector<TokenId> tokens;
  FinishReason finish_reason = FinishReason::kStop;
};

class CacheLayer {
 public:
  virtual ~CacheLayer() = default;
  // Whether lookups need CacheKey::embedding (the gateway computes it once per request).
  virtual bool needs_embedding() const { return false; }
  // Thread-safe. Sets *out on a hit, leaves it empty on a miss.
  virtual Status lookup(const CacheKey& key, std::optional<CachedResponse>* out) = 0;
  // Thread-safe. Stores a finished response.
  virtual Status store(const CacheKey& key, const CachedResponse& response) = 0;
};

template <> struct PluginKindOf<CacheLayer> {
  static constexpr PluginKind value = PluginKind::kCacheLayer;
};

}  // namespace tessera
