// tessera eval: perplexity of a stack over a text corpus, and how far its next-token
// distributions are from a reference's (KL divergence, top-1 agreement, Δp).
//
// The method is llama-perplexity's, so the two report the same number on the same file:
// the corpus is tokenized once (BOS first when the model adds one), cut into chunks of
// n_ctx tokens, each chunk's first token is replaced by BOS (when the model adds one) and the
// chunk is evaluated from an empty cache; only the second half is scored: the logits at
// positions j in [n_ctx/2, n_ctx - 1) against token j + 1. Log-probabilities use a double
// sum of exps as llama-perplexity's log_softmax does.
//
// The reference is a second stack evaluated on the same chunks in the same run
// (--reference-config) or log-probabilities saved by an earlier run (--save-logits, then
// --reference-logits), which is llama-perplexity's --kl-divergence-base in two steps;
// --reference-logits also reads the base file llama-perplexity writes itself
// (--kl-divergence-base FILE --save-all-logits), so the reference can be llama.cpp's.
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <numeric>
#include <sstream>
#include <string>
#include <vector>

#include "bench.h"
#include "commands.h"
#include "stack_loader.h"
#include "tessera/config.h"
#include "tessera/model_runner.h"
#include "tessera/plugin_registry.h"
#include "tessera/stack.h"
#include "tessera/tokenizer.h"

namespace tessera::cli {
namespace {

struct EvalOptions {
  std::string config;
  std::string reference_config;
  std::string corpus;
  int ctx = 512;
  int chunks = 0;  // 0: every full chunk of the corpus
  std::string save_logits;
  std::string reference_logits;
  std::string json_path;
  std::string html_path;
  int greedy = 0;  // tokens of greedy continuation compared per chunk (needs reference_config)
  bool quiet = false;
  std::string prompt_logprobs;  // JSONL of prompts: print each prompt token's logprob instead
};

// One stack set up to evaluate chunks of n_ctx tokens from an empty cache. Members are
// destroyed in reverse order: the runner, then the plugins and model, then the registry that
// loaded them (it must outlive every object it created).
struct EvalStack {
  std::unique_ptr<PluginRegistry> registry;
  StackConfig config;
  EngineComponents components;
  KvLayout layout;
  std::vector<int32_t> block_table;
  std::unique_ptr<ForwardRunner> runner;

  const Model& model() const { return *components.model; }
};

std::unique_ptr<EvalStack> load_eval_stack(const std::string& config_path, int n_ctx, bool quiet) {
  auto s = std::make_unique<EvalStack>();
  s->registry = std::make_unique<PluginRegistry>();
  s->registry->scan_default_paths();
  s->config = load_stack_config(config_path.empty() ? default_config_path() : config_path, *s->registry);
  Model::ProgressFn progress;
  if (!quiet) progress = [](size_t done, size_t total) { print_progress("loading model", done, total); };
  s->components = build_engine_components(s->config, *s->registry, progress);
  const ModelHparams& hp = s->model().hparams();
  if (n_ctx > hp.context_length)
    throw CommandError("--ctx " + std::to_string(n_ctx) + " exceeds the model's trained context (" +
                       std::to_string(hp.context_length) + " tokens)");
  // One sequence of n_ctx tokens, laid out by the stack's own kv_cache plugin (its dtype and
  // block size are what is being evaluated).
  const KvModelShape shape{hp.num_layers, hp.num_kv_heads, hp.head_dim, n_ctx, 1};
  Status st = s->components.kv_cache->configure(shape, &s->layout);
  if (!st.is_ok()) throw CommandError(s->config.file + ": " + st.message());
  const int32_t blocks = (n_ctx + s->layout.block_size - 1) / s->layout.block_size;
  if (blocks > s->layout.num_blocks)
    throw CommandError(s->config.file + ": the KV cache holds " + std::to_string(s->layout.num_blocks) +
                       " blocks, one chunk of " + std::to_string(n_ctx) + " tokens needs " +
                       std::to_string(blocks));
  s->block_table.resize(blocks);
  std::iota(s->block_table.begin(), s->block_table.end(), 0);
  auto& c = s->components;
  // As the engine does: a device backend may bring its own runner.
  if (auto* provider = dynamic_cast<ForwardRunnerProvider*>(c.backend.get())) {
    st = provider->create_forward_runner(c.model->forward_view(), s->layout, n_ctx, n_ctx, *c.attention,
                                         &s->runner);
    if (!st.is_ok() && st.code() != StatusCode::kUnimplemented)
      throw CommandError("engine.backend: " + st.message());
  }
  if (!s->runner)
    s->runner = std::make_unique<ModelRunner>(*c.model, *c.backend, *c.quantizer, *c.attention, s->layout, n_ctx);
  return s;
}

// Log-probabilities of `rows` logit rows, in place: x - max - log(sum exp(x - max)), the sum
// in double (llama-perplexity's log_softmax).
void log_softmax_rows(float* logits, int64_t rows, int32_t vocab) {
  for (int64_t r = 0; r < rows; ++r) {
    float* x = logits + r * vocab;
    const float mx = *std::max_element(x, x + vocab);
    double sum = 0;
    for (int32_t v = 0; v < vocab; ++v) sum += std::exp(static_cast<double>(x[v] - mx));
    const float log_sum = static_cast<float>(std::log(sum));
    for (int32_t v = 0; v < vocab; ++v) x[v] = x[v] - mx - log_sum;
  }
}

// Evaluates one chunk and leaves the log-probabilities of rows [first, n_ctx) in *logp
// ((n_ctx - first) x vocab; the last row predicts nothing and is unused).
void eval_chunk(EvalStack& s, const std::vector<TokenId>& tokens, int32_t first, std::vector<float>* logp) {
  const auto n_ctx = static_cast<int32_t>(tokens.size());
  const ForwardSequence seq{tokens.data(), n_ctx, 0, s.block_table, n_ctx - first};
  const Status st = s.runner->forward({&seq, 1}, logp);
  if (!st.is_ok()) throw CommandError(s.config.file + ": forward pass failed: " + st.message());
  log_softmax_rows(logp->data(), n_ctx - first, s.runner->vocab_size());
}

TokenId argmax(const float* row, int32_t vocab) {
  return static_cast<TokenId>(std::max_element(row, row + vocab) - row);
}

// `n` greedy tokens after `prompt`, from an empty cache: the prompt in one forward pass, then
// one token per pass.
std::vector<TokenId> greedy_continuation(EvalStack& s, const TokenId* prompt, int32_t prompt_len, int32_t n,
                                         std::vector<float>* logits) {
  const int32_t vocab = s.runner->vocab_size();
  std::vector<TokenId> out;
  out.reserve(n);
  const ForwardSequence first{prompt, prompt_len, 0, s.block_table, 1};
  Status st = s.runner->forward({&first, 1}, logits);
  for (int32_t i = 0; st.is_ok(); ++i) {
    out.push_back(argmax(logits->data(), vocab));
    if (i + 1 == n) break;
    const ForwardSequence step{&out.back(), 1, prompt_len + i, s.block_table, 1};
    st = s.runner->forward({&step, 1}, logits);
  }
  if (!st.is_ok()) throw CommandError(s.config.file + ": forward pass failed: " + st.message());
  return out;
}

// ---- saved reference log-probabilities --------------------------------------------------
//
// Little-endian binary: a 40-byte header, the evaluated token ids (int32, n_chunks x n_ctx,
// BOS substitutions included), then per chunk (n_ctx - 1 - first) rows of vocab float32
// log-probabilities. f32 so that a reuse is exact: a stack against its own saved file has
// KLD 0.
constexpr char kLogitsMagic[8] = {'T', 'S', 'L', 'O', 'G', 'P', 'R', 'B'};
constexpr uint32_t kLogitsVersion = 1;

struct LogitsHeader {
  char magic[8];
  uint32_t version;
  uint32_t vocab;
  uint32_t n_ctx;
  uint32_t first;
  uint32_t n_chunks;
  uint32_t reserved;
  uint64_t data_rows;  // n_chunks * (n_ctx - 1 - first)
};
static_assert(sizeof(LogitsHeader) == 40);

class LogitsWriter {
 public:
  LogitsWriter(const std::string& path, uint32_t vocab, uint32_t n_ctx, uint32_t first, uint32_t n_chunks,
               const std::vector<TokenId>& tokens)
      : path_(path), tmp_(path + ".tmp"), out_(tmp_, std::ios::binary | std::ios::trunc) {
    if (!out_) throw CommandError("--save-logits: cannot write '" + path + "'");
    LogitsHeader h{};
    std::memcpy(h.magic, kLogitsMagic, 8);
    h.version = kLogitsVersion;
    h.vocab = vocab;
    h.n_ctx = n_ctx;
    h.first = first;
    h.n_chunks = n_chunks;
    h.data_rows = static_cast<uint64_t>(n_chunks) * (n_ctx - 1 - first);
    out_.write(reinterpret_cast<const char*>(&h), sizeof h);
    out_.write(reinterpret_cast<const char*>(tokens.data()), static_cast<std::streamsize>(tokens.size() * 4));
  }
  ~LogitsWriter() {
    if (!done_) {
      out_.close();
      std::error_code ec;
      std::filesystem::remove(tmp_, ec);
    }
  }
  void write_rows(const float* rows, size_t count) {
    out_.write(reinterpret_cast<const char*>(rows), static_cast<std::streamsize>(count * sizeof(float)));
  }
  // Written to a temporary file and renamed: no half-written reference is left behind.
  void finish() {
    out_.close();
    if (!out_) throw CommandError("--save-logits: writing '" + path_ + "' failed");
    std::filesystem::rename(tmp_, path_);
    done_ = true;
  }

 private:
  std::string path_, tmp_;
  std::ofstream out_;
  bool done_ = false;
};

// llama-perplexity's --kl-divergence-base file (tools/perplexity/perplexity.cpp): "_logits_",
// uint32 n_ctx, int32 n_vocab, int32 n_chunk, the corpus's token ids (int32, n_chunk x n_ctx,
// as tokenized: the BOS it substitutes for each chunk's first token is not stored), then per
// chunk (n_ctx - 1 - n_ctx/2) rows of nv = 2 * ((n_vocab + 1) / 2) + 4 uint16: two floats
// (scale, min_log_prob), then per token q with log p = scale * q + min_log_prob (q = 0 for
// everything at or below 16 nats under the top logit).
constexpr char kLlamaLogitsMagic[8] = {'_', 'l', 'o', 'g', 'i', 't', 's', '_'};

class LogitsReader {
 public:
  // Reads either format: Tessera's (--save-logits) or llama-perplexity's base file.
  LogitsReader(const std::string& path, uint32_t vocab, uint32_t n_ctx, uint32_t first,
               const std::vector<TokenId>& tokens, uint32_t n_chunks)
      : vocab_(vocab), in_(path, std::ios::binary) {
    const std::string what = "--reference-logits '" + path + "': ";
    if (!in_) throw CommandError(what + "cannot open the file");
    char magic[8] = {};
    in_.read(magic, 8);
    if (in_ && std::memcmp(magic, kLlamaLogitsMagic, 8) == 0) {
      open_llama(path, what, n_ctx, tokens, n_chunks);
      return;
    }
    in_.seekg(0);
    LogitsHeader h{};
    in_.read(reinterpret_cast<char*>(&h), sizeof h);
    if (!in_ || std::memcmp(h.magic, kLogitsMagic, 8) != 0)
      throw CommandError(what + "neither a file written by tessera eval --save-logits nor a "
                                "llama-perplexity --kl-divergence-base file");
    if (h.version != kLogitsVersion)
      throw CommandError(what + "format version " + std::to_string(h.version) + ", expected " +
                         std::to_string(kLogitsVersion));
    if (h.vocab != vocab)
      throw CommandError(what + "made with a vocabulary of " + std::to_string(h.vocab) + " tokens, this model has " +
                         std::to_string(vocab));
    if (h.n_ctx != n_ctx || h.first != first)
      throw CommandError(what + "made with --ctx " + std::to_string(h.n_ctx) + ", this run uses --ctx " +
                         std::to_string(n_ctx));
    if (h.n_chunks < n_chunks)
      throw CommandError(what + "holds " + std::to_string(h.n_chunks) + " chunks, this run evaluates " +
                         std::to_string(n_chunks));
    const auto expected_size = sizeof h + static_cast<uint64_t>(h.n_chunks) * n_ctx * 4 +
                               h.data_rows * vocab * sizeof(float);
    std::error_code ec;
    if (h.data_rows != static_cast<uint64_t>(h.n_chunks) * (n_ctx - 1 - first) ||
        std::filesystem::file_size(path, ec) != expected_size)
      throw CommandError(what + "truncated or corrupt (size does not match its header)");
    std::vector<TokenId> saved(static_cast<size_t>(h.n_chunks) * n_ctx);
    in_.read(reinterpret_cast<char*>(saved.data()), static_cast<std::streamsize>(saved.size() * 4));
    if (!std::equal(tokens.begin(), tokens.end(), saved.begin()))
      throw CommandError(what + "made from different text (its token ids differ from this corpus's)");
  }
  bool llama_format() const { return !llama_row_.empty(); }
  // `count` floats: count / vocab rows of log-probabilities, in the order they were scored.
  void read_rows(float* rows, size_t count) {
    if (llama_row_.empty()) {
      in_.read(reinterpret_cast<char*>(rows), static_cast<std::streamsize>(count * sizeof(float)));
      if (!in_) throw CommandError("--reference-logits: read failed");
      return;
    }
    for (size_t r = 0; r < count / vocab_; ++r) {
      in_.read(reinterpret_cast<char*>(llama_row_.data()),
               static_cast<std::streamsize>(llama_row_.size() * sizeof(uint16_t)));
      if (!in_) throw CommandError("--reference-logits: read failed");
      float scale, min_log_prob;
      std::memcpy(&scale, llama_row_.data(), sizeof scale);
      std::memcpy(&min_log_prob, llama_row_.data() + 2, sizeof min_log_prob);
      const uint16_t* q = llama_row_.data() + 4;
      float* out = rows + r * vocab_;
      for (uint32_t v = 0; v < vocab_; ++v) out[v] = scale * static_cast<float>(q[v]) + min_log_prob;
    }
  }

 private:
  void open_llama(const std::string& path, const std::string& what, uint32_t n_ctx,
                  const std::vector<TokenId>& tokens, uint32_t n_chunks) {
    uint32_t file_ctx = 0;
    int32_t file_vocab = 0, file_chunks = 0;
    in_.read(reinterpret_cast<char*>(&file_ctx), 4);
    in_.read(reinterpret_cast<char*>(&file_vocab), 4);
    in_.read(reinterpret_cast<char*>(&file_chunks), 4);
    if (!in_ || file_vocab <= 0 || file_chunks <= 0 || file_ctx < 4)
      throw CommandError(what + "llama-perplexity base file with a broken header");
    if (static_cast<uint32_t>(file_vocab) != vocab_)
      throw CommandError(what + "made with a vocabulary of " + std::to_string(file_vocab) +
                         " tokens, this model has " + std::to_string(vocab_));
    if (file_ctx != n_ctx)
      throw CommandError(what + "made with llama-perplexity -c " + std::to_string(file_ctx) +
                         ", this run uses --ctx " + std::to_string(n_ctx));
    if (static_cast<uint32_t>(file_chunks) < n_chunks)
      throw CommandError(what + "holds " + std::to_string(file_chunks) + " chunks, this run evaluates " +
                         std::to_string(n_chunks) + " (pass --chunks " + std::to_string(file_chunks) + ")");
    const uint64_t nv = 2 * ((static_cast<uint64_t>(file_vocab) + 1) / 2) + 4;
    const uint64_t rows = static_cast<uint64_t>(file_chunks) * (n_ctx - 1 - n_ctx / 2);
    const uint64_t expected_size = 20 + static_cast<uint64_t>(file_chunks) * n_ctx * 4 + rows * nv * 2;
    std::error_code ec;
    if (std::filesystem::file_size(path, ec) != expected_size)
      throw CommandError(what + "truncated or corrupt (size does not match its header)");
    std::vector<TokenId> saved(static_cast<size_t>(file_chunks) * n_ctx);
    in_.read(reinterpret_cast<char*>(saved.data()), static_cast<std::streamsize>(saved.size() * 4));
    // Every chunk's first token was replaced by BOS before evaluation here, and is stored
    // unreplaced there; the rest must be the same ids.
    for (size_t i = 0; i < tokens.size(); ++i) {
      if (i % n_ctx == 0) continue;
      if (tokens[i] != saved[i])
        throw CommandError(what + "made from different text (token " + std::to_string(i) + " is " +
                           std::to_string(saved[i]) + " there and " + std::to_string(tokens[i]) +
                           " here)");
    }
    llama_row_.resize(nv);
  }

  uint32_t vocab_;
  std::ifstream in_;
  std::vector<uint16_t> llama_row_;  // llama-perplexity format: one encoded row
};

// ---- statistics ---------------------------------------------------------------------------

struct PplAccumulator {
  double sum = 0, sum2 = 0;
  size_t n = 0;
  void add(double nll) {
    sum += nll;
    sum2 += nll * nll;
    ++n;
  }
  double mean() const { return n ? sum / static_cast<double>(n) : 0; }
  double ppl() const { return std::exp(mean()); }
  // llama-perplexity's uncertainty: PPL x standard error of the mean NLL.
  double ppl_error() const {
    if (n < 2) return 0;
    const double m = mean();
    const double var = (sum2 / static_cast<double>(n) - m * m) / static_cast<double>(n - 1);
    return ppl() * std::sqrt(std::max(0.0, var));
  }
};

using bench::fmt;

double quantile(const std::vector<double>& sorted, double q) { return bench::percentile(sorted, q); }

std::string fmt_g(double v, int precision) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*g", precision, v);
  return buf;
}

// --prompt-logprobs: the offline counterpart of /v1/completions' echo + logprobs. Each JSONL
// line is {"id", "prompt": text} (tokenized as /v1/completions does: special tokens parsed,
// BOS as the model asks) or {"id", "tokens": [ids]}; each prompt is evaluated in one forward
// pass from an empty cache (no scheduler, chunking or prefix cache) and printed as
// {"id", "tokens", "token_logprobs": [null, logprob of token i given tokens < i, ...]}.
void run_prompt_logprobs(const EvalOptions& opt) {
  std::ifstream in(opt.prompt_logprobs);
  if (!in) throw CommandError("--prompt-logprobs: cannot open '" + opt.prompt_logprobs + "'");
  struct Item {
    nlohmann::json id;
    std::vector<TokenId> tokens;
    std::string text;
    bool has_text = false;
  };
  std::vector<Item> items;
  std::string line;
  for (int line_no = 1; std::getline(in, line); ++line_no) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string where = opt.prompt_logprobs + ":" + std::to_string(line_no) + ": ";
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const std::exception& e) {
      throw CommandError(where + "invalid JSON: " + e.what());
    }
    Item item;
    item.id = j.value("id", nlohmann::json(items.size()));
    if (j.contains("prompt") && j["prompt"].is_string()) {
      item.text = j["prompt"].get<std::string>();
      item.has_text = true;
    } else if (j.contains("tokens") && j["tokens"].is_array()) {
      for (const auto& t : j["tokens"]) {
        if (!t.is_number_integer()) throw CommandError(where + "\"tokens\": expected token ids");
        item.tokens.push_back(t.get<TokenId>());
      }
    } else {
      throw CommandError(where + "expected \"prompt\": text or \"tokens\": [ids]");
    }
    items.push_back(std::move(item));
  }
  if (items.empty()) throw CommandError("--prompt-logprobs: '" + opt.prompt_logprobs + "' holds no prompt");
  // The stack is sized for the longest prompt: load it once with the model's context, then
  // tokenize, then evaluate.
  auto probe = load_eval_stack(opt.config, 8, opt.quiet);
  const Tokenizer& tok = probe->model().tokenizer();
  int32_t longest = 1;
  for (Item& item : items) {
    if (item.has_text) item.tokens = tok.encode(item.text, /*add_special=*/true, /*parse_special=*/true);
    for (TokenId t : item.tokens)
      if (t < 0 || t >= tok.vocab_size())
        throw CommandError("--prompt-logprobs: token id " + std::to_string(t) + " is outside the vocabulary");
    if (item.tokens.empty()) throw CommandError("--prompt-logprobs: an empty prompt");
    longest = std::max(longest, static_cast<int32_t>(item.tokens.size()));
  }
  probe.reset();
  auto s = load_eval_stack(opt.config, std::max(8, longest), /*quiet=*/true);
  const int32_t vocab = s->runner->vocab_size();
  std::vector<float> logp;
  std::ofstream file;
  if (!opt.json_path.empty() && opt.json_path != "-") {
    file.open(opt.json_path);
    if (!file) throw CommandError("--json: cannot write '" + opt.json_path + "'");
  }
  std::ostream& out = file.is_open() ? static_cast<std::ostream&>(file) : std::cout;
  for (const Item& item : items) {
    const auto n = static_cast<int32_t>(item.tokens.size());
    const std::vector<int32_t> table(s->block_table.begin(),
                                     s->block_table.begin() + (n + s->layout.block_size - 1) / s->layout.block_size);
    const ForwardSequence seq{item.tokens.data(), n, 0, table, n};
    const Status st = s->runner->forward({&seq, 1}, &logp);
    if (!st.is_ok()) throw CommandError(s->config.file + ": forward pass failed: " + st.message());
    log_softmax_rows(logp.data(), n, vocab);
    nlohmann::json lps = nlohmann::json::array({nullptr});
    for (int32_t i = 1; i < n; ++i) lps.push_back(logp[static_cast<size_t>(i - 1) * vocab + item.tokens[i]]);
    out << nlohmann::json{{"id", item.id}, {"tokens", item.tokens}, {"token_logprobs", lps}}.dump() << "\n";
  }
  out.flush();
}

void run_eval(const EvalOptions& opt) {
  if (!opt.prompt_logprobs.empty()) return run_prompt_logprobs(opt);
  if (opt.corpus.empty()) throw CommandError("eval: give --corpus FILE (or --prompt-logprobs FILE)");
  if (opt.ctx < 8) throw CommandError("--ctx: at least 8 tokens, got " + std::to_string(opt.ctx));
  if (opt.greedy > 0 && opt.reference_config.empty())
    throw CommandError("--greedy needs --reference-config (a saved reference holds no continuations)");
  if (opt.greedy > opt.ctx / 2)
    throw CommandError("--greedy " + std::to_string(opt.greedy) + ": at most --ctx / 2 = " +
                       std::to_string(opt.ctx / 2) + " tokens (the continuation follows the first half of a chunk)");
  const std::string text = read_text_file(opt.corpus, "--corpus");
  auto test = load_eval_stack(opt.config, opt.ctx, opt.quiet);
  std::unique_ptr<EvalStack> ref;
  if (!opt.reference_config.empty()) {
    ref = load_eval_stack(opt.reference_config, opt.ctx, opt.quiet);
    if (ref->runner->vocab_size() != test->runner->vocab_size())
      throw CommandError("--reference-config: the reference model has a vocabulary of " +
                         std::to_string(ref->runner->vocab_size()) + " tokens, the evaluated model " +
                         std::to_string(test->runner->vocab_size()));
  }
  const Tokenizer& tok = test->model().tokenizer();
  const int32_t vocab = test->runner->vocab_size();
  const auto n_ctx = static_cast<int32_t>(opt.ctx);
  const int32_t first = n_ctx / 2;
  // llama-perplexity: common_tokenize(text, add_special = true); BOS per chunk when added.
  const std::vector<TokenId> all = tok.encode(text, /*add_special=*/true, /*parse_special=*/false);
  const bool add_bos = tok.add_bos() && tok.bos_id() >= 0;
  const auto available = static_cast<int32_t>(all.size() / static_cast<size_t>(n_ctx));
  if (available < 1)
    throw CommandError("--corpus '" + opt.corpus + "': " + std::to_string(all.size()) +
                       " tokens, shorter than one chunk of --ctx " + std::to_string(n_ctx) + " tokens");
  const int32_t n_chunks = opt.chunks > 0 ? std::min(opt.chunks, available) : available;
  std::vector<TokenId> tokens(all.begin(), all.begin() + static_cast<ptrdiff_t>(n_chunks) * n_ctx);
  if (add_bos)
    for (int32_t c = 0; c < n_chunks; ++c) tokens[static_cast<size_t>(c) * n_ctx] = tok.bos_id();

  std::unique_ptr<LogitsReader> reader;
  if (!opt.reference_logits.empty())
    reader = std::make_unique<LogitsReader>(opt.reference_logits, vocab, n_ctx, first, tokens, n_chunks);
  std::unique_ptr<LogitsWriter> writer;
  if (!opt.save_logits.empty())
    writer = std::make_unique<LogitsWriter>(opt.save_logits, vocab, n_ctx, first, n_chunks, tokens);
  const bool compare = ref || reader;

  PplAccumulator ppl_test, ppl_ref;
  std::vector<double> chunk_ppl;
  std::vector<double> kld, delta_p;
  double sum_kld = 0, sum_kld2 = 0, sum_dp = 0, sum_dp2 = 0;
  size_t same_top = 0;
  double greedy_prefix_sum = 0;  // per chunk: matching leading tokens / opt.greedy
  int32_t greedy_identical = 0;
  std::vector<float> logp, logp_ref;
  // llama-perplexity's base file codes every log-probability at or below 16 nats under the top
  // one as that floor, and its KL divergence leaves reference terms at or below -16 out; so
  // does this one with such a reference (with Tessera's f32 references every term counts).
  const float kld_floor = reader && reader->llama_format() ? -16.0f : -INFINITY;
  const size_t scored_rows = static_cast<size_t>(n_ctx - 1 - first);
  if (compare) logp_ref.resize(scored_rows * vocab);
  for (int32_t c = 0; c < n_chunks; ++c) {
    const std::vector<TokenId> chunk(tokens.begin() + static_cast<ptrdiff_t>(c) * n_ctx,
                                     tokens.begin() + static_cast<ptrdiff_t>(c + 1) * n_ctx);
    eval_chunk(*test, chunk, first, &logp);
    if (writer) writer->write_rows(logp.data(), scored_rows * vocab);
    if (ref) {
      eval_chunk(*ref, chunk, first, &logp_ref);
    } else if (reader) {
      reader->read_rows(logp_ref.data(), scored_rows * vocab);
    }
    PplAccumulator this_chunk;
    for (size_t r = 0; r < scored_rows; ++r) {
      const TokenId next = chunk[first + r + 1];
      const float* lt = logp.data() + r * vocab;
      ppl_test.add(-static_cast<double>(lt[next]));
      this_chunk.add(-static_cast<double>(lt[next]));
      if (!compare) continue;
      const float* lr = logp_ref.data() + r * vocab;
      ppl_ref.add(-static_cast<double>(lr[next]));
      double k = 0;
      for (int32_t v = 0; v < vocab; ++v) {
        if (lr[v] == lt[v]) continue;  // exactly 0; also keeps -inf - -inf out of the sum
        if (lr[v] <= kld_floor) continue;
        k += std::exp(static_cast<double>(lr[v])) * (static_cast<double>(lr[v]) - lt[v]);
      }
      kld.push_back(k);
      sum_kld += k;
      sum_kld2 += k * k;
      const double dp = std::exp(static_cast<double>(lt[next])) - std::exp(static_cast<double>(lr[next]));
      delta_p.push_back(dp);
      sum_dp += dp;
      sum_dp2 += dp * dp;
      if (std::max_element(lt, lt + vocab) - lt == std::max_element(lr, lr + vocab) - lr) ++same_top;
    }
    chunk_ppl.push_back(this_chunk.ppl());
    if (opt.greedy > 0) {
      // Both stacks continue the chunk's first half greedily; how long do they agree?
      const std::vector<TokenId> a = greedy_continuation(*test, chunk.data(), first, opt.greedy, &logp);
      const std::vector<TokenId> b = greedy_continuation(*ref, chunk.data(), first, opt.greedy, &logp_ref);
      const auto same = std::mismatch(a.begin(), a.end(), b.begin()).first - a.begin();
      greedy_prefix_sum += static_cast<double>(same) / opt.greedy;
      greedy_identical += same == opt.greedy;
    }
    if (!opt.quiet) print_progress("evaluating", static_cast<size_t>(c + 1), static_cast<size_t>(n_chunks));
  }
  if (writer) writer->finish();

  // ---- report ----
  const size_t n = ppl_test.n;
  const std::string model_name = test->model().name();
  nlohmann::json j;
  j["corpus"] = opt.corpus;
  j["config"] = test->config.file;
  j["model"] = model_name;
  j["kv_dtype"] = {{"k", kv_dtype_name(test->layout.k_dtype)}, {"v", kv_dtype_name(test->layout.v_dtype)}};
  j["n_ctx"] = n_ctx;
  j["chunks"] = n_chunks;
  j["corpus_tokens"] = all.size();
  j["scored_tokens"] = n;
  j["ppl"] = ppl_test.ppl();
  j["ppl_error"] = ppl_test.ppl_error();
  j["nll_mean"] = ppl_test.mean();
  j["chunk_ppl"] = chunk_ppl;
  std::vector<std::vector<std::string>> rows;
  rows.push_back({"PPL", fmt(ppl_test.ppl(), 4) + " ± " + fmt(ppl_test.ppl_error(), 4)});
  if (compare) {
    std::sort(kld.begin(), kld.end());
    std::vector<double> dp_sorted = delta_p;
    std::sort(dp_sorted.begin(), dp_sorted.end());
    const double nd = static_cast<double>(n);
    const double kld_mean = sum_kld / nd;
    const double kld_err = n > 1 ? std::sqrt(std::max(0.0, (sum_kld2 / nd - kld_mean * kld_mean) / (nd - 1))) : 0;
    const double dp_mean = sum_dp / nd;
    const double dp_rms = std::sqrt(sum_dp2 / nd);
    const double top1 = static_cast<double>(same_top) / nd;
    j["reference"] = {{"source", ref ? ref->config.file : opt.reference_logits},
                      {"ppl", ppl_ref.ppl()},
                      {"ppl_error", ppl_ref.ppl_error()},
                      {"nll_mean", ppl_ref.mean()}};
    j["ppl_ratio"] = ppl_test.ppl() / ppl_ref.ppl();
    j["kld"] = {{"mean", kld_mean},       {"stderr", kld_err},           {"median", quantile(kld, 0.5)},
                {"p99", quantile(kld, 0.99)}, {"p99_9", quantile(kld, 0.999)}, {"max", kld.back()},
                {"min", kld.front()}};
    j["top1_agreement"] = top1;
    j["delta_p"] = {{"mean", dp_mean},
                    {"rms", dp_rms},
                    {"min", dp_sorted.front()},
                    {"p1", quantile(dp_sorted, 0.01)},
                    {"p5", quantile(dp_sorted, 0.05)},
                    {"p25", quantile(dp_sorted, 0.25)},
                    {"median", quantile(dp_sorted, 0.5)},
                    {"p75", quantile(dp_sorted, 0.75)},
                    {"p95", quantile(dp_sorted, 0.95)},
                    {"p99", quantile(dp_sorted, 0.99)},
                    {"max", dp_sorted.back()}};
    rows.push_back({"reference PPL", fmt(ppl_ref.ppl(), 4) + " ± " + fmt(ppl_ref.ppl_error(), 4)});
    rows.push_back({"PPL / reference PPL", fmt(ppl_test.ppl() / ppl_ref.ppl(), 5)});
    rows.push_back({"KLD mean", fmt_g(kld_mean, 6) + " ± " + fmt_g(kld_err, 3)});
    rows.push_back({"KLD median", fmt_g(quantile(kld, 0.5), 6)});
    rows.push_back({"KLD 99%", fmt_g(quantile(kld, 0.99), 6)});
    rows.push_back({"KLD 99.9%", fmt_g(quantile(kld, 0.999), 6)});
    rows.push_back({"KLD max", fmt_g(kld.back(), 6)});
    rows.push_back({"same top-1", fmt(100 * top1, 3) + " %"});
    if (opt.greedy > 0) {
      j["greedy"] = {{"tokens", opt.greedy},
                     {"chunks", n_chunks},
                     {"mean_agreeing_prefix", greedy_prefix_sum / n_chunks},
                     {"identical", greedy_identical}};
      rows.push_back({"greedy " + std::to_string(opt.greedy) + "-token agreement",
                      fmt(100 * greedy_prefix_sum / n_chunks, 1) + " % (" + std::to_string(greedy_identical) + "/" +
                          std::to_string(n_chunks) + " identical)"});
    }
    rows.push_back({"Δp mean", fmt(100 * dp_mean, 4) + " %"});
    rows.push_back({"Δp RMS", fmt(100 * dp_rms, 4) + " %"});
    rows.push_back({"Δp 1% / 99%", fmt(100 * quantile(dp_sorted, 0.01), 3) + " % / " +
                                       fmt(100 * quantile(dp_sorted, 0.99), 3) + " %"});
    rows.push_back({"Δp min / max", fmt(100 * dp_sorted.front(), 3) + " % / " + fmt(100 * dp_sorted.back(), 3) + " %"});
  }
  if (!opt.quiet) {
    std::fprintf(stderr, "%s (K %s, V %s cache) on %s: %d chunks of %d tokens, %zu tokens scored\n",
                 model_name.c_str(), kv_dtype_name(test->layout.k_dtype), kv_dtype_name(test->layout.v_dtype),
                 opt.corpus.c_str(), n_chunks, n_ctx, n);
  }
  bench::print_table({"metric", "value"}, rows);
  if (!opt.json_path.empty()) {
    if (opt.json_path == "-") std::printf("%s\n", j.dump(2).c_str());
    else bench::write_json(opt.json_path, j);
  }
  if (!opt.html_path.empty()) {
    std::vector<std::string> sections;
    sections.push_back("<p>" + bench::html_escape(model_name + " (" + test->config.file + "), corpus " + opt.corpus +
                                                  ", " + std::to_string(n_chunks) + " chunks of " +
                                                  std::to_string(n_ctx) + " tokens, " + std::to_string(n) +
                                                  " tokens scored") +
                       "</p>");
    sections.push_back(bench::html_table({"metric", "value"}, rows));
    std::vector<bench::Bar> bars;
    for (size_t c = 0; c < chunk_ppl.size(); ++c) bars.push_back({"chunk " + std::to_string(c), chunk_ppl[c], 0, 0});
    sections.push_back(bench::svg_bar_chart("perplexity per chunk", "PPL", bars, ppl_test.ppl()));
    if (compare) {
      // KLD distribution: the quantiles as bars (log-spread values are easier to read so).
      std::vector<bench::Bar> kb;
      for (double q : {0.5, 0.9, 0.95, 0.99, 0.999})
        kb.push_back({"KLD " + fmt(100 * q, 1) + "%", quantile(kld, q), 0, 0});
      kb.push_back({"KLD max", kld.back(), 0, 0});
      sections.push_back(bench::svg_bar_chart("KL divergence per token vs the reference", "KLD (nats)", kb,
                                              sum_kld / static_cast<double>(n)));
    }
    bench::write_html(opt.html_path, "tessera eval: " + model_name, sections);
  }
}

}  // namespace

void add_eval_command(CLI::App& app) {
  auto opt = std::make_shared<EvalOptions>();
  CLI::App* cmd = app.add_subcommand(
      "eval", "perplexity over a text corpus (llama-perplexity's method) and KL divergence against a reference");
  cmd->add_option("-c,--config", opt->config, "stack YAML to evaluate (default: configs/smollm2-cpu.yaml)");
  cmd->add_option("-f,--corpus", opt->corpus, "text file to evaluate on");
  cmd->add_option("--prompt-logprobs", opt->prompt_logprobs,
                  "JSONL of prompts ({\"id\", \"prompt\": text} or {\"id\", \"tokens\": [ids]}): print every "
                  "prompt token's logprob, one JSON line per prompt (the offline /v1/completions echo + logprobs)");
  cmd->add_option("--ctx", opt->ctx, "tokens per chunk (n_ctx); the second half of each is scored")
      ->capture_default_str();
  cmd->add_option("--chunks", opt->chunks, "evaluate at most N chunks (0: all)")->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  auto* rc = cmd->add_option("-r,--reference-config", opt->reference_config,
                             "reference stack YAML evaluated on the same chunks (KLD, top-1, Δp)");
  auto* rl = cmd->add_option("--reference-logits", opt->reference_logits,
                             "reference log-probabilities saved by --save-logits, or llama-perplexity's "
                             "--kl-divergence-base file (instead of --reference-config)");
  rc->excludes(rl);
  cmd->add_option("--save-logits", opt->save_logits,
                  "save the evaluated stack's log-probabilities to FILE, for later --reference-logits");
  cmd->add_option("--greedy", opt->greedy,
                  "also continue each chunk's first half greedily for N tokens with both stacks and report "
                  "how long they agree (needs --reference-config)")
      ->capture_default_str()->check(CLI::NonNegativeNumber);
  cmd->add_option("--json", opt->json_path, "write the results as JSON to FILE ('-': stdout)");
  cmd->add_option("--html", opt->html_path, "write an HTML report to FILE");
  cmd->add_flag("-q,--quiet", opt->quiet, "no progress output");
  cmd->callback([opt] { run_eval(*opt); });
}

}  // namespace tessera::cli
