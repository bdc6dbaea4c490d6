// tessera router train: fits the classifier router (plugins/router/classifier) on labelled
// JSONL ({"prompt": ..., "label": "small"|"large"}, optionally "small_correct" and
// "large_correct" booleans), holds out a stratified split, calibrates the threshold to a
// target share of large-model calls, and writes the router file with its held-out figures.
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "../../plugins/router/classifier/complexity_model.h"
#include "cmd_router.h"
#include "commands.h"
#include "tessera/atomic_file.h"
#include "tessera/config.h"
#include "tessera/embedding/encoder_model.h"

namespace tessera::cli {
namespace {

using nlohmann::json;

struct TrainArgs {
  std::string data;
  std::string out;
  std::string heldout_out;  // optional: the held-out rows, as read, for serving-side evaluation
  double target_large_share = -1;
  double test_fraction = 0.25;
  uint64_t seed = 15;
  std::string embedding_model = "all-MiniLM-L6-v2";
  bool no_embedding = false;
  int threads = 2;
  double small_cost = 0.5;
  double l2 = 1e-2;
  int iterations = 400;
};

struct Row {
  std::string line;  // the JSONL line as read
  std::string prompt;
  bool large = false;
  std::optional<bool> small_correct, large_correct;
};

std::vector<Row> read_rows(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw CommandError("--data: cannot read '" + path + "'");
  std::vector<Row> rows;
  std::string line;
  for (int n = 1; std::getline(in, line); ++n) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string where = path + ":" + std::to_string(n) + ": ";
    json j = json::parse(line, nullptr, false);
    if (j.is_discarded() || !j.is_object()) throw CommandError(where + "expected a JSON object per line");
    Row r;
    r.line = line;
    if (!j.contains("prompt") || !j["prompt"].is_string() || j["prompt"].get<std::string>().empty())
      throw CommandError(where + "prompt: expected a non-empty string");
    r.prompt = j["prompt"].get<std::string>();
    const std::string label = j.contains("label") && j["label"].is_string() ? j["label"].get<std::string>() : "";
    if (label != "small" && label != "large")
      throw CommandError(where + "label: expected \"small\" or \"large\", got " +
                         (j.contains("label") ? j["label"].dump() : std::string("nothing")));
    r.large = label == "large";
    for (const auto& [key, field] : {std::pair<const char*, std::optional<bool>*>{"small_correct", &r.small_correct},
                                     {"large_correct", &r.large_correct}}) {
      if (!j.contains(key)) continue;
      if (!j[key].is_boolean()) throw CommandError(where + key + ": expected true or false, got " + j[key].dump());
      *field = j[key].get<bool>();
    }
    rows.push_back(std::move(r));
  }
  if (rows.size() < 10) throw CommandError("--data: '" + path + "' has " + std::to_string(rows.size()) +
                                           " examples; at least 10 are needed to hold some out");
  return rows;
}

router::HeldoutFigures evaluate(const router::ComplexityModel& model, const std::vector<Row>& rows,
                                const std::vector<std::vector<float>>& x, const std::vector<size_t>& idx,
                                float threshold) {
  router::HeldoutFigures f;
  size_t correct = 0, small = 0, hard_small = 0, easy_large = 0, hard = 0;
  size_t q = 0, q_large = 0, q_small = 0, q_known = 0;
  for (size_t i : idx) {
    const bool to_large = model.score(x[i]) >= threshold;
    correct += to_large == rows[i].large;
    small += !to_large;
    hard += rows[i].large;
    hard_small += rows[i].large && !to_large;
    easy_large += !rows[i].large && to_large;
    if (rows[i].small_correct && rows[i].large_correct) {
      ++q_known;
      q += to_large ? *rows[i].large_correct : *rows[i].small_correct;
      q_large += *rows[i].large_correct;
      q_small += *rows[i].small_correct;
    }
  }
  const double n = static_cast<double>(idx.size());
  f.num_examples = static_cast<int64_t>(idx.size());
  f.num_large_labels = static_cast<int64_t>(hard);
  f.accuracy = correct / n;
  f.small_share = small / n;
  f.hard_to_small = hard_small / n;
  f.easy_to_large = easy_large / n;
  f.hard_to_small_of_hard = hard ? static_cast<double>(hard_small) / static_cast<double>(hard) : 0;
  // Cost per prompt relative to always-large: small calls cost small_cost, large ones 1.
  f.cost_saved = f.small_share * (1.0 - model.small_cost);
  if (q_known == idx.size()) {
    f.quality = static_cast<double>(q) / n;
    f.quality_always_large = static_cast<double>(q_large) / n;
    f.quality_always_small = static_cast<double>(q_small) / n;
  }
  return f;
}

void print_figures(const char* title, const router::HeldoutFigures& f) {
  std::printf("%s: %lld prompts (%lld labelled large)\n", title, static_cast<long long>(f.num_examples),
              static_cast<long long>(f.num_large_labels));
  std::printf("  accuracy              %.3f\n", f.accuracy);
  std::printf("  share sent to small   %.3f\n", f.small_share);
  std::printf("  cost saved vs large   %.3f\n", f.cost_saved);
  std::printf("  misroute hard->small  %.3f of all (%.3f of the hard prompts)\n", f.hard_to_small,
              f.hard_to_small_of_hard);
  std::printf("  misroute easy->large  %.3f of all\n", f.easy_to_large);
  if (f.quality >= 0)
    std::printf("  quality (answered correctly) %.3f routed, %.3f always-large, %.3f always-small\n", f.quality,
                f.quality_always_large, f.quality_always_small);
}

void run_train(const TrainArgs& a) {
  std::vector<Row> rows = read_rows(a.data);
  // Stratified split: the held-out part keeps the label mix of the whole set.
  std::mt19937_64 rng(a.seed);
  std::vector<size_t> by_label[2];
  for (size_t i = 0; i < rows.size(); ++i) by_label[rows[i].large].push_back(i);
  std::vector<size_t> train, test;
  for (auto& v : by_label) {
    std::shuffle(v.begin(), v.end(), rng);
    const size_t k = static_cast<size_t>(std::lround(a.test_fraction * static_cast<double>(v.size())));
    test.insert(test.end(), v.begin(), v.begin() + static_cast<std::ptrdiff_t>(k));
    train.insert(train.end(), v.begin() + static_cast<std::ptrdiff_t>(k), v.end());
  }
  std::sort(train.begin(), train.end());
  std::sort(test.begin(), test.end());
  size_t train_large = 0;
  for (size_t i : train) train_large += rows[i].large;
  if (train_large == 0 || train_large == train.size())
    throw CommandError("--data: the training split has only one label; both \"small\" and \"large\" are needed");

  router::ComplexityModel model;
  model.small_cost = a.small_cost;
  model.trained_on = a.data;
  std::vector<std::vector<float>> emb(rows.size());
  if (!a.no_embedding) {
    const std::string dir = resolve_model_dir(a.embedding_model, "");
    auto encoder = EncoderModel::load(dir, a.threads);
    model.embedding_dim = encoder->dimension();
    model.embedding_model = encoder->name();
    std::fprintf(stderr, "embedding %zu prompts with %s\n", rows.size(), encoder->name().c_str());
    for (size_t i = 0; i < rows.size(); i += 32) {
      std::vector<std::vector<int32_t>> ids;
      for (size_t k = i; k < std::min(rows.size(), i + 32); ++k) ids.push_back(encoder->encode(rows[k].prompt));
      auto out = encoder->embed(ids);
      for (size_t k = 0; k < out.size(); ++k) emb[i + k] = std::move(out[k]);
    }
  }
  std::vector<std::vector<float>> x(rows.size());
  for (size_t i = 0; i < rows.size(); ++i) x[i] = model.features(rows[i].prompt, emb[i]);

  std::vector<router::Example> examples;
  for (size_t i : train) examples.push_back({x[i], rows[i].large});
  router::TrainOptions options;
  options.l2 = a.l2;
  options.iterations = a.iterations;
  router::fit(examples, options, &model);

  for (size_t i : train) model.calibration_scores.push_back(model.score(x[i]));
  std::sort(model.calibration_scores.begin(), model.calibration_scores.end());
  // Without a target, send as many to large as the training labels ask for.
  model.target_large_share = a.target_large_share >= 0
                                 ? a.target_large_share
                                 : static_cast<double>(train_large) / static_cast<double>(train.size());
  model.threshold = model.threshold_for_large_share(model.target_large_share);

  std::printf("data %s: %zu examples, %zu for training, %zu held out (seed %llu)\n", a.data.c_str(), rows.size(),
              train.size(), test.size(), static_cast<unsigned long long>(a.seed));
  std::printf("features: %zu text + %d embedding (%s)\n", router::text_feature_names().size(), model.embedding_dim,
              model.embedding_dim ? model.embedding_model.c_str() : "none");
  std::printf("threshold %.4f (target large share %.3f, calibrated on the training split); small cost %.2f of large\n",
              model.threshold, model.target_large_share, model.small_cost);
  print_figures("training split", evaluate(model, rows, x, train, model.threshold));
  model.heldout = evaluate(model, rows, x, test, model.threshold);
  print_figures("held out", model.heldout);
  std::printf("held-out sweep (threshold calibrated on training):\n");
  std::printf("  large share  accuracy  to small  cost saved  hard->small  easy->large  quality\n");
  for (double s : {0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8, 1.0}) {
    const router::HeldoutFigures f = evaluate(model, rows, x, test, model.threshold_for_large_share(s));
    std::printf("  %11.2f  %8.3f  %8.3f  %10.3f  %11.3f  %11.3f  %7.3f\n", s, f.accuracy, f.small_share, f.cost_saved,
                f.hard_to_small, f.easy_to_large, f.quality);
  }
  // Whole files or none: a router file cut short would be refused by the plugin at startup.
  const auto write = [](const std::string& option, const std::string& path, const std::string& contents) {
    try {
      write_file_atomically(path, contents);
    } catch (const std::exception& e) {
      throw CommandError(option + ": cannot write '" + path + "': " + e.what());
    }
    std::printf("wrote %s\n", path.c_str());
  };
  write("--out", a.out, model.to_json() + "\n");
  if (!a.heldout_out.empty()) {
    // The same rows the held-out figures come from, so a served router can be scored on them
    // (bench/router_eval.py) without reproducing this split.
    std::string held;
    for (size_t i : test) held += rows[i].line + "\n";
    write("--heldout-out", a.heldout_out, held);
  }
}

}  // namespace

void add_router_command(CLI::App& app) {
  auto* router = app.add_subcommand("router", "train the classifier router");
  router->require_subcommand(1);
  auto* train = router->add_subcommand("train", "fit router.classifier on labelled JSONL and report held-out figures");
  auto a = std::make_shared<TrainArgs>();
  train->add_option("--data", a->data, "labelled JSONL: {\"prompt\": ..., \"label\": \"small\"|\"large\"} per line")
      ->required();
  train->add_option("--out", a->out, "the router file to write (the plugin's `model`)")->required();
  train->add_option("--heldout-out", a->heldout_out, "also write the held-out rows (JSONL, as read) to this file");
  train->add_option("--target-large-share", a->target_large_share,
                    "share of prompts to send to the large model (default: the training labels' share)")
      ->check(CLI::Range(0.0, 1.0));
  train->add_option("--test-fraction", a->test_fraction, "share held out for the reported figures")
      ->check(CLI::Range(0.05, 0.9));
  train->add_option("--seed", a->seed, "the split's seed");
  train->add_option("--embedding-model", a->embedding_model, "sentence-embedding model (as `embedding.model.path`)");
  train->add_flag("--no-embedding", a->no_embedding, "text features only (the router then needs no embedding model)");
  train->add_option("--threads", a->threads, "embedding threads")->check(CLI::PositiveNumber);
  train->add_option("--small-cost", a->small_cost, "a small call's cost relative to a large one's (default 0.5)")
      ->check(CLI::Range(0.0, 1.0));
  train->add_option("--l2", a->l2, "ridge penalty on the standardized weights")->check(CLI::NonNegativeNumber);
  train->add_option("--iterations", a->iterations, "gradient steps")->check(CLI::PositiveNumber);
  train->callback([a] { run_train(*a); });
}

}  // namespace tessera::cli
