// cache_layer.semantic on a labelled set of paraphrase / non-paraphrase pairs
// (bench/make_paraphrase_pairs.py), through the real plugin (loaded from the build's plugin
// folder) and the real embedding model (EncoderModel, as `tessera serve` runs it).
//
// Each pair (label, sentence1, sentence2) stands for two requests. The cached answer of a
// request is its meaning: sentence1's answer is the pair's id, and sentence2's is the same id
// when the pair is a paraphrase, another one when not; so a hit is right exactly when it
// returns the answer the request would have got from the model.
//
//   static τ   all sentence1 answered and cached (one tenant), then every sentence2 looked up:
//              hit rate (hits / lookups), false-hit rate (wrong hits / hits), paraphrases
//              recalled, wrong answers per lookup;
//   learned δ  the same cache, sentence2 requests in a random order through vCache's decision:
//              a miss (explore) asks the "model" (the label) and stores the answer, from which
//              the plugin learns; wrong answers per lookup vs δ.
//
//   bench_semantic_cache --pairs /tmp/pairs.tsv [--model DIR] [--threads N] [--json out.json]
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "tessera/config.h"
#include "tessera/embedding/encoder_model.h"
#include "tessera/plugin_registry.h"
#include "tessera/sdk/cache_layer.h"

using namespace tessera;

namespace {

struct Pair {
  int label = 0;
  std::string kind, a, b;
  std::vector<float> ea, eb;
};

struct Counts {
  int lookups = 0, hits = 0, wrong = 0, right = 0, positives = 0;
};

std::vector<Pair> read_pairs(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error(path + ": cannot open");
  std::vector<Pair> pairs;
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    std::stringstream ss(line);
    Pair p;
    std::string label;
    std::getline(ss, label, '\t');
    std::getline(ss, p.kind, '\t');
    std::getline(ss, p.a, '\t');
    std::getline(ss, p.b, '\t');
    p.label = std::stoi(label);
    pairs.push_back(std::move(p));
  }
  return pairs;
}

CacheKey key_of(const std::vector<float>& embedding, const std::string& prompt) {
  CacheKey k;
  k.model = "bench";
  k.prompt = prompt;
  k.reproducible = true;
  k.embedding = embedding;
  return k;
}

CachedResponse answer(int meaning) {
  CachedResponse r;
  r.tokens = {meaning};
  r.text = std::to_string(meaning);
  return r;
}

std::shared_ptr<CacheLayer> make_layer(PluginRegistry& registry, const std::string& yaml) {
  const PluginInfo* info = registry.find(PluginKind::kCacheLayer, "semantic");
  if (!info) throw std::runtime_error("cache_layer.semantic is not in the plugin folder (build cache_layer-semantic)");
  const PluginConfig config = validate_plugin_params(*info->manifest, "gateway.cache[0]", yaml);
  PluginContext context;
  context.logger = &host_logger();
  return registry.create<CacheLayer>("semantic", config, context);
}

// sentence2 of pair i means what sentence1 means when the pair is a paraphrase.
int meaning_b(const std::vector<Pair>& pairs, size_t i) {
  return pairs[i].label ? static_cast<int>(i) : static_cast<int>(pairs.size() + i);
}

void fill_cache(CacheLayer& layer, const std::vector<Pair>& pairs) {
  for (size_t i = 0; i < pairs.size(); ++i) layer.store(key_of(pairs[i].ea, pairs[i].a), answer(static_cast<int>(i)));
}

Counts run_static(PluginRegistry& registry, const std::vector<Pair>& pairs, double tau) {
  char yaml[160];
  std::snprintf(yaml, sizeof yaml, "{threshold: %.2f, max_entries: 1000000, max_bytes: 4GiB}", tau);
  auto layer = make_layer(registry, yaml);
  fill_cache(*layer, pairs);
  Counts c;
  for (size_t i = 0; i < pairs.size(); ++i) {
    std::optional<CachedResponse> hit;
    layer->lookup(key_of(pairs[i].eb, pairs[i].b), &hit);
    ++c.lookups;
    c.positives += pairs[i].label;
    if (!hit) continue;
    ++c.hits;
    (hit->tokens == std::vector<TokenId>{meaning_b(pairs, i)} ? c.right : c.wrong)++;
  }
  return c;
}

Counts run_learned(PluginRegistry& registry, const std::vector<Pair>& pairs, double delta, int seed) {
  char yaml[200];
  std::snprintf(yaml, sizeof yaml,
                "{learned_thresholds: true, delta: %g, seed: %d, max_entries: 1000000, max_bytes: 4GiB}", delta, seed);
  auto layer = make_layer(registry, yaml);
  fill_cache(*layer, pairs);
  std::vector<size_t> order(pairs.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::shuffle(order.begin(), order.end(), std::mt19937(seed));
  Counts c;
  for (size_t i : order) {
    const CacheKey key = key_of(pairs[i].eb, pairs[i].b);
    std::optional<CachedResponse> hit;
    layer->lookup(key, &hit);
    ++c.lookups;
    c.positives += pairs[i].label;
    if (hit) {
      ++c.hits;
      (hit->tokens == std::vector<TokenId>{meaning_b(pairs, i)} ? c.right : c.wrong)++;
    } else {
      layer->store(key, answer(meaning_b(pairs, i)));  // the model's answer, learned from
    }
  }
  return c;
}

nlohmann::json row(const Counts& c) {
  return {{"lookups", c.lookups},
          {"hits", c.hits},
          {"wrong_hits", c.wrong},
          {"hit_rate", double(c.hits) / c.lookups},
          {"false_hit_rate", c.hits ? double(c.wrong) / c.hits : 0.0},
          {"wrong_per_lookup", double(c.wrong) / c.lookups},
          {"paraphrase_recall", c.positives ? double(c.right) / c.positives : 0.0}};
}

}  // namespace

int main(int argc, char** argv) {
  std::string pairs_path, model = "all-MiniLM-L6-v2", json_path;
  std::string plugin_dir = TESSERA_BENCH_PLUGIN_DIR;
  int threads = 2, seeds = 5;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i], v = argv[i + 1];
    if (a == "--pairs") pairs_path = v;
    else if (a == "--model") model = v;
    else if (a == "--threads") threads = std::stoi(v);
    else if (a == "--json") json_path = v;
    else if (a == "--plugin-dir") plugin_dir = v;
    else if (a == "--seeds") seeds = std::stoi(v);
    else {
      std::fprintf(stderr, "unknown option %s\n", a.c_str());
      return 2;
    }
  }
  if (pairs_path.empty()) {
    std::fprintf(stderr, "usage: bench_semantic_cache --pairs FILE.tsv [--model DIR] [--threads N] [--json OUT]\n");
    return 2;
  }
  std::vector<Pair> pairs = read_pairs(pairs_path);
  auto encoder = EncoderModel::load(resolve_model_dir(model, ""), threads);
  const auto t0 = std::chrono::steady_clock::now();
  for (Pair& p : pairs) {
    auto e = encoder->embed({encoder->encode(p.a), encoder->encode(p.b)});
    p.ea = std::move(e[0]);
    p.eb = std::move(e[1]);
  }
  const double embed_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  int positives = 0;
  for (const Pair& p : pairs) positives += p.label;
  std::printf("%zu pairs (%d paraphrases) from %s; embedded %zu sentences in %.1f s (%.1f ms each, %d threads)\n",
              pairs.size(), positives, pairs_path.c_str(), 2 * pairs.size(), embed_s,
              1000 * embed_s / (2 * pairs.size()), threads);

  PluginRegistry registry;
  registry.scan_directory(plugin_dir);
  nlohmann::json out = {{"pairs", pairs.size()}, {"paraphrases", positives}, {"embed_ms_per_sentence",
                                                                             1000 * embed_s / (2 * pairs.size())}};
  std::printf("\nstatic threshold: all sentence1 cached, every sentence2 looked up\n");
  std::printf("%6s %9s %15s %18s %17s\n", "tau", "hit rate", "false-hit rate", "paraphrase recall", "wrong / lookup");
  for (double tau : {0.80, 0.85, 0.90, 0.95}) {
    const Counts c = run_static(registry, pairs, tau);
    nlohmann::json r = row(c);
    r["tau"] = tau;
    out["static"].push_back(r);
    std::printf("%6.2f %9.3f %15.3f %18.3f %17.3f\n", tau, r["hit_rate"].get<double>(),
                r["false_hit_rate"].get<double>(), r["paraphrase_recall"].get<double>(),
                r["wrong_per_lookup"].get<double>());
  }
  std::printf("\nlearned thresholds (vCache), sentence2 in random order, mean of %d seeds\n", seeds);
  std::printf("%6s %9s %15s %17s %9s\n", "delta", "hit rate", "false-hit rate", "wrong / lookup", "<= delta");
  for (double delta : {0.01, 0.02, 0.05, 0.10}) {
    Counts sum;
    for (int s = 0; s < seeds; ++s) {
      const Counts c = run_learned(registry, pairs, delta, s + 1);
      sum.lookups += c.lookups, sum.hits += c.hits, sum.wrong += c.wrong, sum.right += c.right;
      sum.positives += c.positives;
    }
    nlohmann::json r = row(sum);
    r["delta"] = delta;
    r["seeds"] = seeds;
    out["learned"].push_back(r);
    std::printf("%6.2f %9.3f %15.3f %17.4f %9s\n", delta, r["hit_rate"].get<double>(),
                r["false_hit_rate"].get<double>(), r["wrong_per_lookup"].get<double>(),
                r["wrong_per_lookup"].get<double>() <= delta ? "yes" : "NO");
  }
  if (!json_path.empty()) std::ofstream(json_path) << out.dump(1) << "\n";
  return 0;
}
