// router.ab-split: a live A/B test of deployments. Each arm is a deployment with a weight;
// a request goes to arm i with probability weight_i / sum of weights. Sticky: the same end
// user (the request's `user`, else its API key) always lands on the same arm, so one user
// never sees both stacks; a request without either is placed by its id.
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "tessera/sdk/router.h"

namespace tessera {
namespace {

const ParamSpec kParams[] = {
    {"arms", ParamType::kStringMap, nullptr,
     "deployment name -> weight (a positive number), e.g. {continuous: 50, chunked: 50}"},
    {"sticky", ParamType::kBool, "true", "the same user always gets the same arm"},
    {"salt", ParamType::kString, "", "mixed into the user hash: change it to reshuffle users between arms"},
};

// FNV-1a 64 then a splitmix64 finalizer: FNV alone leaves the high bits poorly mixed for
// short keys, and the arm is picked from the high bits.
uint64_t hash64(std::string_view s) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (unsigned char c : s) {
    h ^= c;
    h *= 0x100000001b3ULL;
  }
  h ^= h >> 30;
  h *= 0xbf58476d1ce4e5b9ULL;
  h ^= h >> 27;
  h *= 0x94d049bb133111ebULL;
  h ^= h >> 31;
  return h;
}

class AbSplitRouter : public Router {
 public:
  static Status create(const PluginConfig& config, const PluginContext&, std::unique_ptr<Router>* out) {
    auto r = std::make_unique<AbSplitRouter>();
    r->sticky_ = config.get_bool("sticky", true);
    r->salt_ = config.get_string("salt", "");
    const auto arms = config.get_string_map("arms");
    if (arms.size() < 1) return invalid_argument("arms: give at least one deployment with a weight");
    double total = 0;
    for (const auto& [name, text] : arms) {
      char* end = nullptr;
      const double w = std::strtod(text.c_str(), &end);
      if (text.empty() || end != text.c_str() + text.size() || !(w > 0) || !std::isfinite(w))
        return invalid_argument("arms." + name + ": expected a positive weight, got '" + text + "'");
      total += w;
      r->arms_.push_back({name, total});
    }
    for (auto& a : r->arms_) a.cumulative /= total;
    r->arms_.back().cumulative = 1.0;
    *out = std::move(r);
    return Status::ok();
  }

  Status configure(std::span<const std::string> deployments) override {
    for (const Arm& a : arms_) {
      bool found = false;
      for (const auto& d : deployments) found |= d == a.deployment;
      if (!found) {
        std::string names;
        for (const auto& d : deployments) names += (names.empty() ? "" : ", ") + d;
        return invalid_argument("arms." + a.deployment + ": no deployment of that name (deployments: " + names + ")");
      }
    }
    return Status::ok();
  }

  Status route(const RouteRequest& request, std::string* deployment) override {
    const uint64_t h = sticky_ && !request.user.empty()
                           ? hash64(salt_ + "\x1f" + std::string(request.user))
                           : hash64(salt_ + "\x1e" + std::to_string(request.request_id));
    const double u = static_cast<double>(h >> 11) * 0x1.0p-53;  // uniform in [0, 1)
    for (const Arm& a : arms_) {
      if (u < a.cumulative) {
        *deployment = a.deployment;
        return Status::ok();
      }
    }
    *deployment = arms_.back().deployment;
    return Status::ok();
  }

 private:
  struct Arm {
    std::string deployment;
    double cumulative;  // share of [0, 1) up to and including this arm
  };
  std::vector<Arm> arms_;  // in name order (the config map's), so the split does not depend on YAML order
  bool sticky_ = true;
  std::string salt_;
};

}  // namespace
}  // namespace tessera

TESSERA_REGISTER_PLUGIN(tessera::AbSplitRouter, tessera::Router, "ab-split", "0.1.0",
                        "weighted A/B split over deployments, sticky per user", tessera::kParams)
