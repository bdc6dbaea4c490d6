// The BERT-style encoder behind EncoderModel: F32 weights used in place from the mmapped
// safetensors file, one sequence per forward (no padding, so the attention mask is all ones
// and mean pooling is a plain mean), row-parallel matmuls on a thread pool.
#include "tessera/embedding/encoder_model.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <stdexcept>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "safetensors.h"
#include "tessera/thread_pool.h"

namespace tessera {
namespace {

enum class Activation { kGeluErf };

// An encoder's graph as tensor names: embeddings (token + position + token type, then a
// LayerNorm) and per layer self-attention and a feed-forward block, each followed by
// residual add + LayerNorm (post-norm). Names ending in a module path get ".weight"/".bias".
struct EncoderArchitecture {
  const char* name;  // config.json model_type
  const char* token_embd;
  const char* position_embd;
  const char* type_embd;
  const char* embd_norm;
  const char* layer_prefix;  // + layer index + "."
  const char* q;
  const char* k;
  const char* v;
  const char* attn_out;
  const char* attn_norm;
  const char* ffn_up;
  const char* ffn_down;
  const char* ffn_norm;
  Activation activation;
};

constexpr EncoderArchitecture kEncoderArchitectures[] = {
    {"bert", "embeddings.word_embeddings", "embeddings.position_embeddings", "embeddings.token_type_embeddings",
     "embeddings.LayerNorm", "encoder.layer.", "attention.self.query", "attention.self.key", "attention.self.value",
     "attention.output.dense", "attention.output.LayerNorm", "intermediate.dense", "output.dense",
     "output.LayerNorm", Activation::kGeluErf},
};

nlohmann::json read_json(const std::filesystem::path& path, bool required) {
  std::ifstream in(path);
  if (!in) {
    if (required) throw std::runtime_error(path.string() + ": missing (an embedding model directory needs it)");
    return nlohmann::json::object();
  }
  try {
    return nlohmann::json::parse(in);
  } catch (const std::exception& e) {
    throw std::runtime_error(path.string() + ": not JSON: " + e.what());
  }
}

int32_t get_int(const nlohmann::json& j, const std::string& file, const char* key) {
  auto it = j.find(key);
  if (it == j.end() || !it->is_number_integer() || it->get<int64_t>() <= 0)
    throw std::runtime_error(file + ": " + key + ": expected a positive integer");
  return it->get<int32_t>();
}

// y[t][o] = b[o] + Σ_i w[o][i] x[t][i] for `rows` rows of x. w is [out][in] (PyTorch
// Linear).
struct Linear {
  const float* w = nullptr;
  const float* b = nullptr;
  int32_t in = 0, out = 0;
};

// The portable body: one output row by four tokens per tile, 8 partial sums per dot product.
// GCC does not vectorize this well (it shuffles lanes between the tiles), so x86 with AVX2
// takes linear_range_avx2 below instead; the two differ only in rounding (FMA, sum order).
inline void linear_range_body(const Linear& l, const float* x, int64_t rows, float* y, int64_t o_begin,
                              int64_t o_end) {
  const int32_t n = l.in;
  for (int64_t o = o_begin; o < o_end; ++o) {
    const float* w = l.w + o * n;
    int64_t t = 0;
    for (; t + 4 <= rows; t += 4) {
      const float* x0 = x + (t + 0) * n;
      const float* x1 = x + (t + 1) * n;
      const float* x2 = x + (t + 2) * n;
      const float* x3 = x + (t + 3) * n;
      float a0[8] = {}, a1[8] = {}, a2[8] = {}, a3[8] = {};
      int32_t i = 0;
      for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; ++j) {
          a0[j] += w[i + j] * x0[i + j];
          a1[j] += w[i + j] * x1[i + j];
          a2[j] += w[i + j] * x2[i + j];
          a3[j] += w[i + j] * x3[i + j];
        }
      float s0 = 0, s1 = 0, s2 = 0, s3 = 0;
      for (int j = 0; j < 8; ++j) s0 += a0[j], s1 += a1[j], s2 += a2[j], s3 += a3[j];
      for (; i < n; ++i) s0 += w[i] * x0[i], s1 += w[i] * x1[i], s2 += w[i] * x2[i], s3 += w[i] * x3[i];
      const float bias = l.b ? l.b[o] : 0.0f;
      y[(t + 0) * l.out + o] = s0 + bias;
      y[(t + 1) * l.out + o] = s1 + bias;
      y[(t + 2) * l.out + o] = s2 + bias;
      y[(t + 3) * l.out + o] = s3 + bias;
    }
    for (; t < rows; ++t) {
      const float* xt = x + t * n;
      float a[8] = {};
      int32_t i = 0;
      for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; ++j) a[j] += w[i + j] * xt[i + j];
      float s = 0;
      for (int j = 0; j < 8; ++j) s += a[j];
      for (; i < n; ++i) s += w[i] * xt[i];
      y[t * l.out + o] = s + (l.b ? l.b[o] : 0.0f);
    }
  }
}

#if defined(__x86_64__) || defined(__i386__)
__attribute__((target("avx2,fma"))) inline float hsum_avx2(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Two output rows by four tokens per tile: 6 loads feed 8 FMAs, and the 8 accumulators stay
// in registers. Tokens go in blocks of 16 so that a block's rows of x (16 × in floats: 96 KiB
// for the 1,536-wide FFN input) stay in L2 while every weight row of the range passes over them.
// A long prompt's embedding (the classifier router embeds every routed prompt) was ~25× slower
// with the compiler's vectorization of linear_range_body.
__attribute__((target("avx2,fma"))) void linear_range_avx2(const Linear& l, const float* x, int64_t rows,
                                                          float* y, int64_t o_begin, int64_t o_end) {
  const int32_t n = l.in;
  if (n % 8 != 0) return linear_range_body(l, x, rows, y, o_begin, o_end);
  constexpr int64_t kTokenBlock = 16;
  for (int64_t tb = 0; tb < rows; tb += kTokenBlock) {
    const int64_t te = std::min(rows, tb + kTokenBlock);
    int64_t o = o_begin;
    for (; o + 2 <= o_end; o += 2) {
      const float* w0 = l.w + o * n;
      const float* w1 = w0 + n;
      const float b0 = l.b ? l.b[o] : 0.0f, b1 = l.b ? l.b[o + 1] : 0.0f;
      int64_t t = tb;
      for (; t + 4 <= te; t += 4) {
        const float* x0 = x + t * n;
        const float* x1 = x0 + n;
        const float* x2 = x1 + n;
        const float* x3 = x2 + n;
        __m256 a00 = _mm256_setzero_ps(), a01 = a00, a02 = a00, a03 = a00;
        __m256 a10 = a00, a11 = a00, a12 = a00, a13 = a00;
        for (int32_t i = 0; i < n; i += 8) {
          const __m256 wa = _mm256_loadu_ps(w0 + i), wb = _mm256_loadu_ps(w1 + i);
          __m256 v = _mm256_loadu_ps(x0 + i);
          a00 = _mm256_fmadd_ps(wa, v, a00);
          a10 = _mm256_fmadd_ps(wb, v, a10);
          v = _mm256_loadu_ps(x1 + i);
          a01 = _mm256_fmadd_ps(wa, v, a01);
          a11 = _mm256_fmadd_ps(wb, v, a11);
          v = _mm256_loadu_ps(x2 + i);
          a02 = _mm256_fmadd_ps(wa, v, a02);
          a12 = _mm256_fmadd_ps(wb, v, a12);
          v = _mm256_loadu_ps(x3 + i);
          a03 = _mm256_fmadd_ps(wa, v, a03);
          a13 = _mm256_fmadd_ps(wb, v, a13);
        }
        float* yt = y + t * l.out + o;
        yt[0] = hsum_avx2(a00) + b0, yt[1] = hsum_avx2(a10) + b1;
        yt += l.out;
        yt[0] = hsum_avx2(a01) + b0, yt[1] = hsum_avx2(a11) + b1;
        yt += l.out;
        yt[0] = hsum_avx2(a02) + b0, yt[1] = hsum_avx2(a12) + b1;
        yt += l.out;
        yt[0] = hsum_avx2(a03) + b0, yt[1] = hsum_avx2(a13) + b1;
      }
      for (; t < te; ++t) {
        const float* xt = x + t * n;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0;
        for (int32_t i = 0; i < n; i += 8) {
          const __m256 v = _mm256_loadu_ps(xt + i);
          a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w0 + i), v, a0);
          a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w1 + i), v, a1);
        }
        y[t * l.out + o] = hsum_avx2(a0) + b0;
        y[t * l.out + o + 1] = hsum_avx2(a1) + b1;
      }
    }
    if (o < o_end) linear_range_body(l, x + tb * n, te - tb, y + tb * l.out, o, o_end);
  }
}
#endif

void linear_range_portable(const Linear& l, const float* x, int64_t rows, float* y, int64_t o_begin,
                           int64_t o_end) {
  linear_range_body(l, x, rows, y, o_begin, o_end);
}

// Chosen at run time by a plain branch, not by target_clones: that makes an IFUNC whose
// resolver (instrumented code) runs while the dynamic loader relocates libtessera_core, before
// ThreadSanitizer's runtime is initialized, so every TSan binary crashed at load. (Its
// "arch=haswell" clone was also only taken on CPUs that identify as Haswell, never on newer
// ones with AVX2.)
void linear_range(const Linear& l, const float* x, int64_t rows, float* y, int64_t o_begin, int64_t o_end) {
#if defined(__x86_64__) || defined(__i386__)
  static const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (avx2) return linear_range_avx2(l, x, rows, y, o_begin, o_end);
#endif
  linear_range_portable(l, x, rows, y, o_begin, o_end);
}

void linear(ThreadPool& pool, const Linear& l, const float* x, int64_t rows, float* y) {
  pool.run(l.out, [&](int64_t b, int64_t e, int) { linear_range(l, x, rows, y, b, e); });
}

// x = LayerNorm(x + add) row by row (add may be null), in double for the statistics.
void add_layer_norm(float* x, const float* add, int64_t rows, int32_t d, const float* gamma, const float* beta,
                    float eps) {
  for (int64_t t = 0; t < rows; ++t) {
    float* r = x + t * d;
    if (add)
      for (int32_t i = 0; i < d; ++i) r[i] += add[t * d + i];
    double mean = 0;
    for (int32_t i = 0; i < d; ++i) mean += r[i];
    mean /= d;
    double var = 0;
    for (int32_t i = 0; i < d; ++i) var += (r[i] - mean) * (r[i] - mean);
    var /= d;
    const float inv = static_cast<float>(1.0 / std::sqrt(var + eps));
    for (int32_t i = 0; i < d; ++i) r[i] = (r[i] - static_cast<float>(mean)) * inv * gamma[i] + beta[i];
  }
}

}  // namespace

struct EncoderModel::Weights {
  const EncoderArchitecture* arch = nullptr;
  const float* token_embd = nullptr;
  const float* position_embd = nullptr;
  const float* type_embd = nullptr;
  const float* embd_norm_w = nullptr;
  const float* embd_norm_b = nullptr;
  struct Layer {
    Linear q, k, v, attn_out, ffn_up, ffn_down;
    const float *attn_norm_w, *attn_norm_b, *ffn_norm_w, *ffn_norm_b;
  };
  std::vector<Layer> layers;
};

std::unique_ptr<EncoderModel> EncoderModel::load(const std::string& dir_path, int threads) {
  namespace fs = std::filesystem;
  const fs::path dir(dir_path);
  if (!fs::is_directory(dir))
    throw std::runtime_error(dir_path + ": not a directory (an embedding model is a sentence-transformers folder)");
  auto m = std::unique_ptr<EncoderModel>(new EncoderModel());
  m->name_ = dir.filename().string();
  const std::string config_file = (dir / "config.json").string();
  const nlohmann::json config = read_json(dir / "config.json", true);
  EncoderHparams& hp = m->hp_;
  hp.architecture = config.value("model_type", "");
  const EncoderArchitecture* arch = nullptr;
  for (const auto& a : kEncoderArchitectures)
    if (hp.architecture == a.name) arch = &a;
  if (!arch) throw std::runtime_error(config_file + ": model_type: '" + hp.architecture + "' is not an encoder Tessera runs (bert)");
  if (config.value("hidden_act", "gelu") != "gelu")
    throw std::runtime_error(config_file + ": hidden_act: only \"gelu\" is implemented");
  if (config.value("position_embedding_type", "absolute") != "absolute")
    throw std::runtime_error(config_file + ": position_embedding_type: only \"absolute\" is implemented");
  hp.vocab_size = get_int(config, config_file, "vocab_size");
  hp.hidden = get_int(config, config_file, "hidden_size");
  hp.num_layers = get_int(config, config_file, "num_hidden_layers");
  hp.num_heads = get_int(config, config_file, "num_attention_heads");
  hp.ffn = get_int(config, config_file, "intermediate_size");
  hp.max_positions = get_int(config, config_file, "max_position_embeddings");
  hp.type_vocab_size = get_int(config, config_file, "type_vocab_size");
  hp.norm_eps = config.value("layer_norm_eps", 1e-12f);
  if (hp.hidden % hp.num_heads != 0)
    throw std::runtime_error(config_file + ": hidden_size is not a multiple of num_attention_heads");

  const nlohmann::json st = read_json(dir / "sentence_bert_config.json", false);
  hp.max_seq_length = std::min<int32_t>(st.value("max_seq_length", hp.max_positions), hp.max_positions);
  const nlohmann::json pooling = read_json(dir / "1_Pooling" / "config.json", false);
  hp.mean_pooling = pooling.value("pooling_mode_mean_tokens", true);
  if (!hp.mean_pooling && !pooling.value("pooling_mode_cls_token", false))
    throw std::runtime_error((dir / "1_Pooling" / "config.json").string() +
                             ": only mean and [CLS] pooling are implemented");
  hp.normalize = false;
  for (const auto& module : read_json(dir / "modules.json", false))
    if (module.value("type", "") == "sentence_transformers.models.Normalize") hp.normalize = true;

  m->tokenizer_ = WordPieceTokenizer::from_json_file((dir / "tokenizer.json").string());
  if (m->tokenizer_->vocab_size() != hp.vocab_size)
    throw std::runtime_error((dir / "tokenizer.json").string() + ": " + std::to_string(m->tokenizer_->vocab_size()) +
                             " tokens, config.json says vocab_size " + std::to_string(hp.vocab_size));

  m->file_ = std::make_unique<safetensors::File>((dir / "model.safetensors").string());
  const safetensors::File& f = *m->file_;
  // Checkpoints saved from a task model carry a "bert." prefix.
  const std::string prefix = f.find(std::string(arch->token_embd) + ".weight") ? "" : std::string(arch->name) + ".";
  const int64_t d = hp.hidden, ffn = hp.ffn;
  auto vec = [&](const std::string& name, int64_t n) { return f.f32(prefix + name, {n}); };
  auto lin = [&](const std::string& name, int64_t out, int64_t in) {
    Linear l;
    l.w = f.f32(prefix + name + ".weight", {out, in});
    l.b = vec(name + ".bias", out);
    l.in = static_cast<int32_t>(in);
    l.out = static_cast<int32_t>(out);
    return l;
  };
  auto w = std::make_unique<Weights>();
  w->arch = arch;
  w->token_embd = f.f32(prefix + arch->token_embd + ".weight", {hp.vocab_size, d});
  w->position_embd = f.f32(prefix + arch->position_embd + ".weight", {hp.max_positions, d});
  w->type_embd = f.f32(prefix + arch->type_embd + ".weight", {hp.type_vocab_size, d});
  w->embd_norm_w = vec(std::string(arch->embd_norm) + ".weight", d);
  w->embd_norm_b = vec(std::string(arch->embd_norm) + ".bias", d);
  for (int32_t i = 0; i < hp.num_layers; ++i) {
    const std::string p = arch->layer_prefix + std::to_string(i) + ".";
    Weights::Layer l;
    l.q = lin(p + arch->q, d, d);
    l.k = lin(p + arch->k, d, d);
    l.v = lin(p + arch->v, d, d);
    l.attn_out = lin(p + arch->attn_out, d, d);
    l.ffn_up = lin(p + arch->ffn_up, ffn, d);
    l.ffn_down = lin(p + arch->ffn_down, d, ffn);
    l.attn_norm_w = vec(p + arch->attn_norm + ".weight", d);
    l.attn_norm_b = vec(p + arch->attn_norm + ".bias", d);
    l.ffn_norm_w = vec(p + arch->ffn_norm + ".weight", d);
    l.ffn_norm_b = vec(p + arch->ffn_norm + ".bias", d);
    w->layers.push_back(l);
  }
  m->w_ = std::move(w);
  m->pool_ = std::make_unique<ThreadPool>(threads);
  return m;
}

EncoderModel::~EncoderModel() = default;

std::vector<std::vector<float>> EncoderModel::embed(const std::vector<std::vector<int32_t>>& inputs) {
  for (size_t i = 0; i < inputs.size(); ++i) {
    const auto& ids = inputs[i];
    if (ids.empty() || ids.size() > static_cast<size_t>(max_tokens()))
      throw std::invalid_argument("input " + std::to_string(i) + " has " + std::to_string(ids.size()) +
                                  " tokens; the embedding model takes 1 to " + std::to_string(max_tokens()));
    for (int32_t id : ids)
      if (id < 0 || id >= hp_.vocab_size)
        throw std::invalid_argument("input " + std::to_string(i) + ": token id " + std::to_string(id) +
                                    " is outside the vocabulary [0, " + std::to_string(hp_.vocab_size) + ")");
  }
  std::vector<std::vector<float>> out(inputs.size(), std::vector<float>(hp_.hidden));
  std::lock_guard<std::mutex> lock(mutex_);
  for (size_t i = 0; i < inputs.size(); ++i) forward(inputs[i], out[i].data());
  return out;
}

void EncoderModel::forward(std::span<const int32_t> ids, float* out) {
  const int64_t n = static_cast<int64_t>(ids.size());
  const int32_t d = hp_.hidden, heads = hp_.num_heads, hd = d / heads;
  x_.resize(n * d);
  q_.resize(n * d);
  k_.resize(n * d);
  v_.resize(n * d);
  ctx_.resize(n * d);
  tmp_.resize(n * d);
  ffn_.resize(n * hp_.ffn);
  scores_.resize(static_cast<size_t>(heads) * n * n);

  // Token type 0 for every token: one sentence.
  for (int64_t t = 0; t < n; ++t)
    for (int32_t i = 0; i < d; ++i)
      x_[t * d + i] = w_->token_embd[int64_t(ids[t]) * d + i] + w_->position_embd[t * d + i] + w_->type_embd[i];
  add_layer_norm(x_.data(), nullptr, n, d, w_->embd_norm_w, w_->embd_norm_b, hp_.norm_eps);

  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  for (const Weights::Layer& l : w_->layers) {
    linear(*pool_, l.q, x_.data(), n, q_.data());
    linear(*pool_, l.k, x_.data(), n, k_.data());
    linear(*pool_, l.v, x_.data(), n, v_.data());
    // Bidirectional attention over the whole sequence, one head per task.
    pool_->run(heads, [&](int64_t hb, int64_t he, int) {
      for (int64_t h = hb; h < he; ++h) {
        float* s = scores_.data() + h * n * n;
        for (int64_t i = 0; i < n; ++i) {
          const float* qi = q_.data() + i * d + h * hd;
          float mx = -INFINITY;
          for (int64_t j = 0; j < n; ++j) {
            const float* kj = k_.data() + j * d + h * hd;
            float dot = 0;
            for (int32_t c = 0; c < hd; ++c) dot += qi[c] * kj[c];
            s[i * n + j] = dot * scale;
            mx = std::max(mx, s[i * n + j]);
          }
          float sum = 0;
          for (int64_t j = 0; j < n; ++j) sum += (s[i * n + j] = std::exp(s[i * n + j] - mx));
          float* ci = ctx_.data() + i * d + h * hd;
          for (int32_t c = 0; c < hd; ++c) ci[c] = 0;
          for (int64_t j = 0; j < n; ++j) {
            const float p = s[i * n + j] / sum;
            const float* vj = v_.data() + j * d + h * hd;
            for (int32_t c = 0; c < hd; ++c) ci[c] += p * vj[c];
          }
        }
      }
    });
    linear(*pool_, l.attn_out, ctx_.data(), n, tmp_.data());
    add_layer_norm(x_.data(), tmp_.data(), n, d, l.attn_norm_w, l.attn_norm_b, hp_.norm_eps);
    linear(*pool_, l.ffn_up, x_.data(), n, ffn_.data());
    for (float& g : ffn_) g = 0.5f * g * (1.0f + std::erf(g * static_cast<float>(M_SQRT1_2)));
    linear(*pool_, l.ffn_down, ffn_.data(), n, tmp_.data());
    add_layer_norm(x_.data(), tmp_.data(), n, d, l.ffn_norm_w, l.ffn_norm_b, hp_.norm_eps);
  }

  // Pooling over the attention mask: every token is real here (no padding).
  for (int32_t i = 0; i < d; ++i) out[i] = 0;
  if (hp_.mean_pooling) {
    for (int64_t t = 0; t < n; ++t)
      for (int32_t i = 0; i < d; ++i) out[i] += x_[t * d + i];
    for (int32_t i = 0; i < d; ++i) out[i] /= static_cast<float>(n);
  } else {
    for (int32_t i = 0; i < d; ++i) out[i] = x_[i];
  }
  if (hp_.normalize) {
    double norm = 0;
    for (int32_t i = 0; i < d; ++i) norm += double(out[i]) * out[i];
    const float inv = static_cast<float>(1.0 / std::max(std::sqrt(norm), 1e-12));
    for (int32_t i = 0; i < d; ++i) out[i] *= inv;
  }
}

}  // namespace tessera
