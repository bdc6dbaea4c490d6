// router plugins choose the deployment (model engine) that serves a request: by a complexity
// classifier, an A/B split, or prefix-cache affinity. A replicated deployment uses a router
// too, to choose one of its replicas (configure() gets the replica names, route() the
// healthy ones as candidates).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "tessera/sdk/plugin.h"
#include "tessera/sdk/types.h"

namespace tessera {

// A deployment (or a replica of one) that may serve a request now, with the requests it has in
// flight from this gateway. (ABI 2.11)
struct RouteCandidate {
  std::string_view name;
  int32_t in_flight = 0;
};

struct RouteRequest {
  uint64_t request_id = 0;
  std::string_view prompt;            // rendered prompt text
  std::span<const TokenId> tokens;    // its tokens (for affinity by prefix)
  std::string_view user;              // the client's user field, for sticky A/B arms
  // The prompt's embedding (L2-normalized), set for routers with needs_embedding() when the
  // stack has an `embedding:` model and the prompt has text; empty otherwise. The gateway
  // computes it once per request and the semantic cache layers reuse it. (ABI 2.6)
  std::span<const float> embedding;
  // The names route() may choose from now (the healthy replicas of a replicated deployment,
  // with their load), a subset of those configure() was given; empty: any of them. Routers
  // that choose among replicas (prefix-affinity) read it; the others may ignore it. (ABI 2.11)
  std::span<const RouteCandidate> candidates;
};

// One sample of a router's own metrics (Prometheus text); the gateway adds a `router` label.
struct RouterMetric {
  std::string name;  // the full family name, e.g. "tessera_router_heldout_misroute_rate"
  std::string help;
  bool is_counter = false;  // false: a gauge
  std::vector<std::pair<std::string, std::string>> labels;
  double value = 0;
};

class Router {
 public:
  virtual ~Router() = default;
  // Called once with the configured deployment names; fails if the router's parameters
  // name a deployment that does not exist.
  virtual Status configure(std::span<const std::string> deployments) = 0;
  // Thread-safe. Writes the chosen deployment name.
  virtual Status route(const RouteRequest& request, std::string* deployment) = 0;
  // Whether route() reads RouteRequest::embedding. Such a router is called on the gateway's
  // embedding thread, never on an HTTP I/O thread (an embedding is a model forward). (ABI 2.6)
  virtual bool needs_embedding() const { return false; }
  // Thread-safe. Appends the router's own metrics (e.g. its training's held-out figures). (ABI 2.6)
  virtual void metrics(std::vector<RouterMetric>* out) const { (void)out; }
};

template <> struct PluginKindOf<Router> {
  static constexpr PluginKind value = PluginKind::kRouter;
};

}  // namespace tessera
