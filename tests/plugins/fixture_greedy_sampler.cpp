// A complete, tiny sampler plugin for the registry and config tests: greedy (argmax) sampling
// and greedy draft verification, with parameters of every ParamType so schema handling can be
// tested end to end. Built several times under different names and SDK ABI versions (see
// CMakeLists.txt). Not a test itself: tests/unit/test_plugin_registry.cpp and
// tests/unit/test_config.cpp load it and assert on what it does.
#include <tessera/sdk.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <numeric>

#ifndef TEST_PLUGIN_NAME
#define TEST_PLUGIN_NAME "test-greedy"
#endif

namespace {

using namespace tessera;

// Live objects, readable through tessera_test_live_objects() so a test can see that the host
// called destroy.
std::atomic<int> g_live_objects{0};

constexpr ParamSpec kParams[] = {
    {"temperature_floor", ParamType::kFloat, "0.0", "ignored; exercises float parsing", 0.0, 10.0},
    {"top_k", ParamType::kInt, "1", "ignored; exercises bounded integers", 1, 1000},
    {"tie_break", ParamType::kEnum, "lowest", "which index wins among equal logits", -INFINITY,
     INFINITY, "lowest|highest"},
    {"scratch", ParamType::kBytes, "1MiB", "ignored; exercises sizes", 0, 1073741824.0},
    {"timeout", ParamType::kDuration, "10s", "ignored; exercises durations", 0, 3600},
    {"label", ParamType::kString, "greedy", "a name for logs"},
    {"verbose", ParamType::kBool, "false", "log every sampled token"},
    {"banned_words", ParamType::kStringList, "[]", "ignored; exercises string lists"},
    {"aliases", ParamType::kStringMap, "{}", "ignored; exercises string maps"},
    {"note", ParamType::kString, nullptr, "optional free text", -INFINITY, INFINITY, nullptr,
     true},
};

class GreedySampler final : public Sampler {
 public:
  GreedySampler(bool prefer_highest, bool verbose, Logger* logger)
      : prefer_highest_(prefer_highest), verbose_(verbose), logger_(logger) {
    ++g_live_objects;
  }
  ~GreedySampler() override { --g_live_objects; }

  static Status create(const PluginConfig& config, const PluginContext& context,
                       std::unique_ptr<Sampler>* out) {
    *out = std::make_unique<GreedySampler>(config.get_string("tie_break") == "highest",
                                           config.get_bool("verbose"), context.logger);
    return Status::ok();
  }

  Status sample(std::span<float> logits, const SamplingInput& input, SamplerState*,
                SampledToken* out) override {
    if (logits.empty()) return invalid_argument("empty logits row");
    fill(logits, input, out);
    if (verbose_ && logger_) logger_->log(LogLevel::kDebug, "sampled " + std::to_string(out->token));
    return Status::ok();
  }

  Status verify(std::span<const std::span<float>> logits, const DraftView& drafts,
                const SamplingInput& input, SamplerState*,
                std::vector<SampledToken>* out) override {
    if (logits.size() != drafts.tokens.size() + 1)
      return invalid_argument("verify needs drafts + 1 rows of logits");
    for (size_t i = 0; i <= drafts.tokens.size(); ++i) {
      if (logits[i].empty()) return invalid_argument("empty logits row");
      SampledToken token;
      fill(logits[i], input, &token);
      out->push_back(std::move(token));
      // Greedy acceptance: stop at the first draft that is not the argmax.
      if (i < drafts.tokens.size() && out->back().token != drafts.tokens[i]) break;
    }
    return Status::ok();
  }

 private:
  void fill(std::span<const float> logits, const SamplingInput& input, SampledToken* out) const {
    size_t best = 0;
    for (size_t i = 1; i < logits.size(); ++i) {
      if (logits[i] > logits[best] || (prefer_highest_ && logits[i] == logits[best])) best = i;
    }
    const float max = logits[best];
    double sum = 0;
    for (float l : logits) sum += std::exp(static_cast<double>(l - max));
    const float log_z = max + static_cast<float>(std::log(sum));
    out->token = static_cast<TokenId>(best);
    out->logprob = logits[best] - log_z;
    out->top.clear();
    int n = input.params ? std::min<int>(input.params->num_logprobs, int(logits.size())) : 0;
    if (n > 0) {
      std::vector<TokenId> ids(logits.size());
      std::iota(ids.begin(), ids.end(), 0);
      std::partial_sort(ids.begin(), ids.begin() + n, ids.end(),
                        [&](TokenId a, TokenId b) { return logits[a] > logits[b]; });
      for (int i = 0; i < n; ++i) out->top.push_back({ids[i], logits[ids[i]] - log_z});
    }
  }

  bool prefer_highest_;
  bool verbose_;
  Logger* logger_;
};

}  // namespace

TESSERA_REGISTER_PLUGIN(GreedySampler, tessera::Sampler, TEST_PLUGIN_NAME, "0.1.0",
                        "greedy test sampler with parameters of every type", kParams)

TESSERA_PLUGIN_EXPORT int tessera_test_live_objects() { return g_live_objects.load(); }
