// Every router plugin (the build's and any on TESSERA_PLUGIN_PATH), configured to route
// between two deployments named "blue" and "green" (in-tree routers by the suite; a third
// party's through TESSERA_CONFORMANCE_PARAMS): configure accepts those two and refuses a
// deployment list that lacks them, naming the missing one (a replica router, which takes any
// names, refuses an empty list); route returns one of the configured
// names, for any prompt and user, also when 8 threads route at once.
#include <doctest/doctest.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "support/plugins.h"
#include "support/test_env.h"
#include "tessera/sdk.h"

using namespace tessera;

namespace {

// router.classifier reads a trained model file: a valid one over the text features alone
// (no embedding), whose only weight is the prompt's log length, so that prompts of both
// lengths below reach both deployments. Its accuracy is not what this suite checks.
std::string classifier_model_file() {
  // Written once per process, in the build tree's test scratch folder (as the config tests'
  // files are): nothing is left in /tmp.
  static const std::string path = [] {
    const std::filesystem::path file = test::scratch_dir("conformance-router") / "classifier.json";
    std::vector<float> zeros(16, 0.f), ones(16, 1.f), weights(16, 0.f);
    weights[0] = 1.f;  // log_chars
    std::ofstream out(file);
    out << R"({"format": "tessera-router-classifier", "version": 1, "text_features": [)"
        << R"("log_chars", "log_words", "digit_share", "log_numbers", "longest_number", "log_operators", )"
        << R"("log_code_marks", "log_quotes", "upper_share", "log_sentences", "q_how_many", "q_what", "q_which", )"
        << R"("q_why_explain", "q_write_code", "q_yes_no"], "embedding_dim": 0, "mean": [)";
    for (size_t i = 0; i < zeros.size(); ++i) out << (i ? ", " : "") << zeros[i];
    out << R"(], "scale": [)";
    for (size_t i = 0; i < ones.size(); ++i) out << (i ? ", " : "") << ones[i];
    out << R"(], "weights": [)";
    for (size_t i = 0; i < weights.size(); ++i) out << (i ? ", " : "") << weights[i];
    out << R"(], "bias": -2.6, "threshold": 0.5})";
    return file.string();
  }();
  return path;
}

// Parameters of the in-tree routers that route between blue and green.
std::string default_params(const std::string& name) {
  if (name == "ab-split") return "{arms: {blue: 50, green: 50}}";
  if (name == "classifier") return "{model: '" + classifier_model_file() + "', small: blue, large: green}";
  return "{}";
}

std::string route(Router& r, uint64_t id, const std::string& prompt, const std::string& user) {
  const std::vector<TokenId> tokens = {1, static_cast<TokenId>(id % 1000), 7};
  RouteRequest request{id, prompt, tokens, user};
  std::string deployment;
  const Status status = r.route(request, &deployment);
  if (!status.is_ok()) return "error: " + status.message();
  return deployment;
}

}  // namespace

TEST_CASE("every router refuses unknown deployments and routes to configured ones, thread-safely") {
  test::check_no_load_errors();
  const auto names = test::plugin_names(PluginKind::kRouter);
  REQUIRE(!names.empty());
  const std::vector<std::string> deployments = {"blue", "green"};
  for (const std::string& name : names) {
    INFO("router." << name);
    const std::string params = test::conformance_params(PluginKind::kRouter, name, default_params(name));
    if (name == "prefix-affinity") {
      // It routes between whatever replicas it is given, so only an empty list is refused.
      auto r = test::create_plugin<Router>(name, params);
      const Status status = r->configure(std::vector<std::string>{});
      CHECK_FALSE(status.is_ok());
      CHECK_MESSAGE(status.message().find("no replicas") != std::string::npos, status.message());
    } else {
      // Neither blue nor green exists here: refused, naming what is missing.
      auto r = test::create_plugin<Router>(name, params);
      const std::vector<std::string> others = {"red"};
      const Status status = r->configure(others);
      CHECK_FALSE(status.is_ok());
      const bool names_missing = status.message().find("blue") != std::string::npos ||
                                 status.message().find("green") != std::string::npos;
      CHECK_MESSAGE(names_missing, "configure's refusal does not name the missing deployment: " << status.message());
    }
    auto r = test::create_plugin<Router>(name, params);
    REQUIRE(r->configure(deployments).is_ok());
    std::set<std::string> seen;
    for (uint64_t i = 0; i < 400; ++i) {
      const std::string d = route(*r, i, (i % 5 ? "" : std::string(200, 'x') + " ") + "prompt " + std::to_string(i), i % 3 ? "user-" + std::to_string(i % 17) : "");
      CHECK_MESSAGE((d == "blue" || d == "green"), "route returned '" << d << "'");
      seen.insert(d);
    }
    MESSAGE("router." << name << " used " << seen.size() << " of the 2 deployments over 400 requests");

    // Concurrent calls (the gateway routes from its worker threads).
    std::atomic<int> bad{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < 8; ++t)
      threads.emplace_back([&, t] {
        for (uint64_t i = 0; i < 500; ++i) {
          const std::string d = route(*r, t * 1000 + i, "concurrent prompt " + std::to_string(i), "user-" + std::to_string(t));
          if (d != "blue" && d != "green") ++bad;
        }
      });
    for (auto& th : threads) th.join();
    CHECK(bad.load() == 0);
  }
}
