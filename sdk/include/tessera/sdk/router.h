// router plugins choose the deployment (model engine) that serves a request: by a complexity
// classifier, an A/B split, or prefix-cache affinity.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "tessera/sdk/plugin.h"
#include "tessera/sdk/types.h"

namespace tessera {

struct RouteRequest {
  uint64_t request_id = 0;
  std::string_view prompt;            // rendered prompt text
  std::span<const TokenId> tokens;    // its tokens (for affinity by prefix)
  std::string_view user;              // the client's user field, for sticky A/B arms
};

class Router {
 public:
  virtual ~Router() = default;
  // Called once with the configured deployment names; fails if the router's parameters
  // name a deployment that does not exist.
  virtual Status configure(std::span<const std::string> deployments) = 0;
  // Thread-safe. Writes the chosen deployment name.
  virtual Status route(const RouteRequest& request, std::string* deployment) = 0;
};

template <> struct PluginKindOf<Router> {
  static constexpr PluginKind value = PluginKind::kRouter;
};

}  // namespace tessera
