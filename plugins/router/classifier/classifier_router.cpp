// router.classifier: sends easy prompts to a small deployment and hard ones to a large one.
// A logistic regression (trained by `tessera router train`, weights in a JSON file) scores a
// prompt's complexity from a few counted text features and the prompt's sentence embedding
// (the one the gateway computes per request, shared with the semantic cache); a score at or
// above the threshold goes large. The threshold is the file's, an explicit `threshold`, or
// the one that sent `target_large_share` of the training prompts to the large model.
#include <atomic>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>

#include "complexity_model.h"
#include "tessera/sdk/router.h"

namespace tessera {
namespace {

const ParamSpec kParams[] = {
    {"model", ParamType::kString, nullptr,
     "the trained router file (`tessera router train --out`), relative to the config file's folder"},
    {"small", ParamType::kString, nullptr, "the deployment that serves easy prompts"},
    {"large", ParamType::kString, nullptr, "the deployment that serves hard prompts"},
    {"target_large_share", ParamType::kFloat, nullptr,
     "share of prompts to send to `large`, calibrated on the file's training scores (instead of its threshold)", 0.0,
     1.0, nullptr, true},
    {"threshold", ParamType::kFloat, nullptr, "score (P(large)) at or above which a prompt goes to `large`", 0.0, 1.0,
     nullptr, true},
};

class ClassifierRouter : public Router {
 public:
  static Status create(const PluginConfig& config, const PluginContext& context, std::unique_ptr<Router>* out) {
    auto r = std::make_unique<ClassifierRouter>();
    r->small_ = config.get_string("small");
    r->large_ = config.get_string("large");
    if (r->small_ == r->large_) return invalid_argument("large: must differ from small (both '" + r->small_ + "')");
    std::filesystem::path path = config.get_string("model");
    if (path.is_relative() && !context.config_file.empty())
      path = std::filesystem::path(context.config_file).parent_path() / path;
    std::ifstream in(path);
    if (!in) return invalid_argument("model: cannot read '" + path.string() + "' (train one with `tessera router train`)");
    std::stringstream text;
    text << in.rdbuf();
    std::string error;
    if (!router::ComplexityModel::from_json(text.str(), &r->model_, &error))
      return invalid_argument("model: '" + path.string() + "': " + error);
    if (config.has("threshold") && config.has("target_large_share"))
      return invalid_argument("threshold: give either threshold or target_large_share, not both");
    if (config.has("threshold")) {
      r->model_.threshold = static_cast<float>(config.get_float("threshold"));
      r->model_.target_large_share = -1;
    } else if (config.has("target_large_share")) {
      if (r->model_.calibration_scores.empty())
        return invalid_argument("target_large_share: the model file has no calibration_scores to calibrate with");
      r->model_.target_large_share = config.get_float("target_large_share");
      r->model_.threshold = r->model_.threshold_for_large_share(r->model_.target_large_share);
    }
    *out = std::move(r);
    return Status::ok();
  }

  Status configure(std::span<const std::string> deployments) override {
    for (const auto& [key, name] : {std::pair<const char*, const std::string*>{"small", &small_}, {"large", &large_}}) {
      bool found = false;
      for (const auto& d : deployments) found |= d == *name;
      if (!found) {
        std::string names;
        for (const auto& d : deployments) names += (names.empty() ? "" : ", ") + d;
        return invalid_argument(std::string(key) + ": no deployment named '" + *name + "' (deployments: " + names + ")");
      }
    }
    return Status::ok();
  }

  bool needs_embedding() const override { return model_.embedding_dim > 0; }

  Status route(const RouteRequest& request, std::string* deployment) override {
    if (model_.embedding_dim > 0 && request.embedding.size() != static_cast<size_t>(model_.embedding_dim)) {
      // No embedding (a token-id prompt, or the embedding failed): without half of its
      // features the score means nothing, so the request gets the model that answers best.
      ++fallbacks_;
      *deployment = large_;
      return Status::ok();
    }
    const std::vector<float> x = model_.features(request.prompt, request.embedding);
    *deployment = model_.score(x) >= model_.threshold ? large_ : small_;
    return Status::ok();
  }

  void metrics(std::vector<RouterMetric>* out) const override {
    const router::HeldoutFigures& h = model_.heldout;
    auto gauge = [out](const char* name, const char* help, double v,
                       std::vector<std::pair<std::string, std::string>> labels = {}) {
      out->push_back({name, help, false, std::move(labels), v});
    };
    gauge("tessera_router_threshold", "score at or above which a prompt goes to the large deployment",
          model_.threshold);
    gauge("tessera_router_heldout_examples", "held-out prompts the router file was evaluated on (training)",
          static_cast<double>(h.num_examples));
    gauge("tessera_router_heldout_accuracy", "held-out accuracy of the router file (at its own threshold)",
          h.accuracy);
    gauge("tessera_router_heldout_small_share", "held-out share routed to the small deployment", h.small_share);
    gauge("tessera_router_heldout_misroute_rate",
          "held-out misroutes as a share of all held-out prompts: hard_to_small = labelled large, sent small",
          h.hard_to_small, {{"kind", "hard_to_small"}});
    gauge("tessera_router_heldout_misroute_rate",
          "held-out misroutes as a share of all held-out prompts: hard_to_small = labelled large, sent small",
          h.easy_to_large, {{"kind", "easy_to_large"}});
    gauge("tessera_router_heldout_cost_saved", "held-out cost saved vs always calling the large deployment",
          h.cost_saved);
    out->push_back({"tessera_router_fallbacks_total",
                    "requests sent to the large deployment because their prompt had no embedding", true, {},
                    static_cast<double>(fallbacks_.load())});
  }

 private:
  router::ComplexityModel model_;
  std::string small_, large_;
  std::atomic<uint64_t> fallbacks_{0};
};

}  // namespace
}  // namespace tessera

TESSERA_REGISTER_PLUGIN(tessera::ClassifierRouter, tessera::Router, "classifier", "0.1.0",
                        "complexity classifier (text features + embedding, logistic regression): small or large",
                        tessera::kParams)
