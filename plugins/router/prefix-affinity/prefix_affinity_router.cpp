// router.prefix-affinity: chooses one replica of a deployment so that requests sharing a prompt
// prefix meet the same engine's prefix cache. The key is a hash of the prompt's first
// `prefix_tokens` tokens; each replica gets a rendezvous (highest-random-weight) score for it
// and the highest-scoring healthy one wins, so a replica leaving or joining moves only the
// keys that were its own. Load bounds the affinity: when the chosen replica has more than
// `max_imbalance` requests in flight beyond the least loaded candidate, the least loaded one
// (highest score among equals) serves instead.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "tessera/sdk/router.h"

namespace tessera {
namespace {

const ParamSpec kParams[] = {
    {"prefix_tokens", ParamType::kInt, "256",
     "prompt tokens that make the affinity key: requests whose first prefix_tokens tokens agree "
     "go to the same replica (a shorter prompt is keyed by all of it)",
     1, 1 << 20},
    {"max_imbalance", ParamType::kInt, "4",
     "requests in flight the preferred replica may have beyond the least loaded one before the "
     "least loaded one serves instead (0: always the least loaded)",
     0, 1 << 20},
};

uint64_t mix64(uint64_t h) {
  h ^= h >> 30;
  h *= 0xbf58476d1ce4e5b9ULL;
  h ^= h >> 27;
  h *= 0x94d049bb133111ebULL;
  h ^= h >> 31;
  return h;
}

uint64_t fnv1a(const void* data, size_t size, uint64_t h = 0xcbf29ce484222325ULL) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < size; ++i) {
    h ^= p[i];
    h *= 0x100000001b3ULL;
  }
  return h;
}

class PrefixAffinityRouter : public Router {
 public:
  static Status create(const PluginConfig& config, const PluginContext&, std::unique_ptr<Router>* out) {
    auto r = std::make_unique<PrefixAffinityRouter>();
    r->prefix_tokens_ = static_cast<size_t>(config.get_int("prefix_tokens", 256));
    r->max_imbalance_ = static_cast<int32_t>(config.get_int("max_imbalance", 4));
    *out = std::move(r);
    return Status::ok();
  }

  Status configure(std::span<const std::string> names) override {
    if (names.empty()) return invalid_argument("prefix-affinity: no replicas to route between");
    std::lock_guard<std::mutex> lock(mutex_);
    names_.assign(names.begin(), names.end());
    for (const std::string& n : names_) {
      name_hash_[n] = mix64(fnv1a(n.data(), n.size()));
      routed_[n] = 0;
    }
    return Status::ok();
  }

  Status route(const RouteRequest& request, std::string* chosen) override {
    const size_t n = std::min(prefix_tokens_, request.tokens.size());
    const uint64_t key = n > 0 ? fnv1a(request.tokens.data(), n * sizeof(TokenId))
                               : fnv1a(request.prompt.data(), request.prompt.size());
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<RouteCandidate> all;
    std::span<const RouteCandidate> candidates = request.candidates;
    if (candidates.empty()) {
      for (const std::string& name : names_) all.push_back({name, 0});
      candidates = all;
    }
    const RouteCandidate* best = nullptr;       // the affinity choice
    const RouteCandidate* least = nullptr;      // the least loaded, best score among equals
    uint64_t best_score = 0, least_score = 0;
    for (const RouteCandidate& c : candidates) {
      const auto it = name_hash_.find(std::string(c.name));
      if (it == name_hash_.end())
        return invalid_argument("prefix-affinity: '" + std::string(c.name) + "' is not one of the configured replicas");
      const uint64_t score = mix64(key ^ it->second);
      if (!best || score > best_score) best = &c, best_score = score;
      if (!least || c.in_flight < least->in_flight || (c.in_flight == least->in_flight && score > least_score))
        least = &c, least_score = score;
    }
    if (!best) return unavailable("prefix-affinity: no replica is available");
    const RouteCandidate* pick = best;
    if (best->in_flight > least->in_flight + max_imbalance_) {
      pick = least;
      ++load_overrides_;
    }
    *chosen = std::string(pick->name);
    ++routed_[*chosen];
    return Status::ok();
  }

  void metrics(std::vector<RouterMetric>* out) const override {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& [name, count] : routed_)
      out->push_back({"tessera_router_routed_total", "requests routed to each replica", true, {{"replica", name}},
                      static_cast<double>(count)});
    out->push_back({"tessera_router_load_overrides_total",
                    "requests sent to the least loaded replica instead of their prefix's (load bound)", true, {},
                    static_cast<double>(load_overrides_)});
  }

 private:
  size_t prefix_tokens_ = 256;
  int32_t max_imbalance_ = 4;
  mutable std::mutex mutex_;
  std::vector<std::string> names_;
  std::map<std::string, uint64_t> name_hash_;
  std::map<std::string, uint64_t> routed_;
  uint64_t load_overrides_ = 0;
};

}  // namespace
}  // namespace tessera

TESSERA_REGISTER_PLUGIN(tessera::PrefixAffinityRouter, tessera::Router, "prefix-affinity", "0.1.0",
                        "routes between replicas by a hash of the prompt prefix (rendezvous), bounded by load",
                        tessera::kParams)
