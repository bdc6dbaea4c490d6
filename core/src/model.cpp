#include "tessera/model.h"

#include <cmath>
#include <cstring>
#include <filesystem>
#include <stdexcept>

#include "tessera/ggml_types.h"

namespace tessera {
namespace {

// What differs between the supported architectures. Everything else (RMSNorm, GQA, a gated
// FFN, tied or untied output, optional q/k/v biases) is shared by the one runner.
struct ArchitectureSpec {
  const char* name;
  bool rope_neox;  // NeoX-style RoPE (rotate halves) instead of adjacent pairs
  FfnActivation ffn = FfnActivation::kSilu;
  // Gemma-style: embeddings times sqrt(embedding_dim), q/k norms, post-attention and
  // post-FFN norms (their tensors are then required).
  bool gemma_norms = false;
  // Layers with sliding-window attention when `<arch>.attention.sliding_window` is set: all but
  // every n-th (llama.cpp's set_swa_pattern(n), n from `attention.sliding_window_pattern`
  // when present), with RoPE base `rope.freq_base_swa` (default local_rope_base).
  int32_t sliding_window_pattern = 0;
  float local_rope_base = 10000.0f;
  // Chat template family (tessera/chat_template.h) for a GGUF without
  // tokenizer.chat_template: Gemma 3's files often ship without one.
  const char* default_chat_template = "";
};

constexpr ArchitectureSpec kArchitectures[] = {
    {"llama", false},
    {"mistral", false},
    {"qwen2", true},
    // llama.cpp: src/models/gemma3.cpp (LLM_ARCH_GEMMA3 uses LLAMA_ROPE_TYPE_NEOX).
    {"gemma3", true, FfnActivation::kGeluTanh, true, 6, 10000.0f, "gemma"},
};

const ArchitectureSpec* find_architecture(const std::string& name) {
  for (const auto& a : kArchitectures)
    if (name == a.name) return &a;
  return nullptr;
}

std::string supported_architectures() {
  std::string s;
  for (const auto& a : kArchitectures) s += (s.empty() ? "" : ", ") + std::string(a.name);
  return s;
}

[[noreturn]] void fail(const gguf::GgufFile& f, const std::string& what) {
  throw std::runtime_error(f.path() + ": " + what);
}

std::string dims_text(const std::vector<int64_t>& dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

// A 1-D tensor (norm weights, biases) converted to float.
std::vector<float> load_vector(const gguf::GgufFile& f, const std::string& name, int64_t n) {
  const gguf::TensorInfo& t = f.tensor(name);
  if (t.dims.size() != 1 || t.dims[0] != n)
    fail(f, "tensor '" + name + "' has shape " + dims_text(t.dims) + ", expected [" +
                std::to_string(n) + "]");
  std::vector<float> out(n);
  if (!dequantize_row(t.type, t.data, out.data(), n))
    fail(f, "tensor '" + name + "' has unsupported type " + ggml_type_name(t.type));
  return out;
}

std::vector<float> load_optional_vector(const gguf::GgufFile& f, const std::string& name,
                                        int64_t n) {
  if (!f.find_tensor(name)) return {};
  return load_vector(f, name, n);
}

}  // namespace

std::shared_ptr<Model> Model::load(const std::string& path, Quantizer& quantizer,
                                   const ProgressFn& progress) {
  auto model = std::shared_ptr<Model>(new Model());
  model->file_ = gguf::GgufFile::open(path);
  const gguf::GgufFile& f = *model->file_;
  ModelHparams& hp = model->hparams_;

  hp.architecture = f.get_string("general.architecture");
  const ArchitectureSpec* arch = find_architecture(hp.architecture);
  if (!arch)
    fail(f, "unsupported architecture '" + hp.architecture + "' (supported: " +
                supported_architectures() + ")");
  const std::string p = hp.architecture + ".";
  auto get_int = [&](const std::string& key) { return static_cast<int32_t>(f.get_uint(p + key)); };
  hp.num_layers = get_int("block_count");
  hp.embedding_dim = get_int("embedding_length");
  hp.ffn_dim = get_int("feed_forward_length");
  hp.num_heads = get_int("attention.head_count");
  hp.num_kv_heads = static_cast<int32_t>(f.opt_uint(p + "attention.head_count_kv").value_or(hp.num_heads));
  hp.context_length = static_cast<int32_t>(f.opt_uint(p + "context_length").value_or(2048));
  hp.rms_eps = static_cast<float>(f.opt_float(p + "attention.layer_norm_rms_epsilon").value_or(1e-5));
  if (hp.num_layers <= 0 || hp.embedding_dim <= 0 || hp.num_heads <= 0 || hp.num_kv_heads <= 0 ||
      hp.ffn_dim <= 0 || hp.num_heads % hp.num_kv_heads != 0 ||
      (hp.embedding_dim % hp.num_heads != 0 && !f.opt_uint(p + "attention.key_length")))
    fail(f, "inconsistent hyperparameters (layers " + std::to_string(hp.num_layers) + ", embedding " +
                std::to_string(hp.embedding_dim) + ", heads " + std::to_string(hp.num_heads) +
                ", kv heads " + std::to_string(hp.num_kv_heads) + ")");
  hp.head_dim = static_cast<int32_t>(
      f.opt_uint(p + "attention.key_length").value_or(hp.embedding_dim / hp.num_heads));
  hp.rope.head_dim = hp.head_dim;
  hp.rope.rotary_dim = static_cast<int32_t>(f.opt_uint(p + "rope.dimension_count").value_or(hp.head_dim));
  hp.rope.freq_base = static_cast<float>(f.opt_float(p + "rope.freq_base").value_or(10000.0));
  hp.rope.neox = arch->rope_neox;
  if (auto type = f.opt_string(p + "rope.scaling.type"); type && *type == "linear") {
    const double factor = f.opt_float(p + "rope.scaling.factor").value_or(1.0);
    if (factor > 0) hp.rope.freq_scale = static_cast<float>(1.0 / factor);
  }
  if (hp.rope.rotary_dim <= 0 || hp.rope.rotary_dim > hp.head_dim || hp.rope.rotary_dim % 2)
    fail(f, "invalid rope.dimension_count " + std::to_string(hp.rope.rotary_dim));
  if (f.find_tensor("rope_freqs.weight"))
    fail(f, "per-dimension RoPE frequency factors (rope_freqs.weight) are not supported yet");
  if (auto v = f.opt_uint(p + "attention.value_length"); v && static_cast<int32_t>(*v) != hp.head_dim)
    fail(f, "attention.value_length " + std::to_string(*v) + " differs from key_length " +
                std::to_string(hp.head_dim) + " (not supported)");
  hp.attention_scale = 1.0f / std::sqrt(static_cast<float>(hp.head_dim));
  hp.ffn_activation = arch->ffn;
  hp.final_logit_softcap = static_cast<float>(f.opt_float(p + "final_logit_softcapping").value_or(0.0));
  if (arch->gemma_norms) hp.embedding_scale = std::sqrt(static_cast<float>(hp.embedding_dim));
  hp.layer_is_local.assign(static_cast<size_t>(hp.num_layers), false);
  hp.rope_local = hp.rope;
  if (arch->sliding_window_pattern > 0) {
    hp.sliding_window = static_cast<int32_t>(f.opt_uint(p + "attention.sliding_window").value_or(0));
    if (hp.sliding_window > 0) {
      const int32_t n = static_cast<int32_t>(
          f.opt_uint(p + "attention.sliding_window_pattern").value_or(arch->sliding_window_pattern));
      for (int32_t l = 0; l < hp.num_layers; ++l) hp.layer_is_local[l] = n == 0 || l % n < n - 1;
      hp.rope_local.freq_base =
          static_cast<float>(f.opt_float(p + "rope.freq_base_swa").value_or(arch->local_rope_base));
      hp.rope_local.freq_scale = 1.0f;  // llama.cpp's rope_freq_scale_train_swa
    }
  }

  model->tokenizer_ = Tokenizer::from_gguf(f);
  hp.vocab_size = model->tokenizer_->vocab_size();
  model->chat_template_ = f.opt_string("tokenizer.chat_template").value_or(arch->default_chat_template);
  model->name_ = std::filesystem::path(path).stem().string();

  // Count the 2-D weights for progress reporting.
  const bool tied = f.find_tensor("output.weight") == nullptr;
  const size_t total = 1 + (tied ? 0 : 1) + 7 * static_cast<size_t>(hp.num_layers);
  const bool gemma_norms = hp.extra_norms = arch->gemma_norms;
  size_t done = 0;
  auto prepare = [&](const std::string& name, int64_t cols, int64_t rows) {
    const gguf::TensorInfo& t = f.tensor(name);
    if (t.dims.size() != 2 || t.dims[0] != cols || t.dims[1] != rows)
      fail(f, "tensor '" + name + "' has shape " + dims_text(t.dims) + ", expected [" +
                  std::to_string(cols) + ", " + std::to_string(rows) + "]");
    if (!quantizer.supports(static_cast<uint32_t>(t.type)))
      fail(f, "tensor '" + name + "' has type " + ggml_type_name(t.type) +
                  ", which the configured quantizer does not support");
    WeightView view{t.name.c_str(), static_cast<uint32_t>(t.type), cols, rows, t.data, t.num_bytes};
    std::unique_ptr<PreparedWeight> w;
    Status st = quantizer.prepare(view, &w);
    if (!st.is_ok()) fail(f, "cannot prepare tensor '" + name + "': " + st.message());
    model->weight_bytes_ += w->num_bytes();
    if (progress) progress(++done, total);
    return w;
  };

  const int64_t d = hp.embedding_dim;
  const int64_t q_dim = static_cast<int64_t>(hp.num_heads) * hp.head_dim;
  const int64_t kv_dim = static_cast<int64_t>(hp.num_kv_heads) * hp.head_dim;
  model->token_embd_ = prepare("token_embd.weight", d, hp.vocab_size);
  if (!tied) model->output_ = prepare("output.weight", d, hp.vocab_size);
  model->output_norm_ = load_vector(f, "output_norm.weight", d);
  model->layers_.resize(hp.num_layers);
  for (int32_t i = 0; i < hp.num_layers; ++i) {
    const std::string b = "blk." + std::to_string(i) + ".";
    LayerWeights& l = model->layers_[i];
    l.attn_norm = load_vector(f, b + "attn_norm.weight", d);
    l.ffn_norm = load_vector(f, b + "ffn_norm.weight", d);
    l.wq = prepare(b + "attn_q.weight", d, q_dim);
    l.wk = prepare(b + "attn_k.weight", d, kv_dim);
    l.wv = prepare(b + "attn_v.weight", d, kv_dim);
    l.wo = prepare(b + "attn_output.weight", q_dim, d);
    l.bq = load_optional_vector(f, b + "attn_q.bias", q_dim);
    l.bk = load_optional_vector(f, b + "attn_k.bias", kv_dim);
    l.bv = load_optional_vector(f, b + "attn_v.bias", kv_dim);
    if (gemma_norms) {
      l.q_norm = load_vector(f, b + "attn_q_norm.weight", hp.head_dim);
      l.k_norm = load_vector(f, b + "attn_k_norm.weight", hp.head_dim);
      l.post_attn_norm = load_vector(f, b + "post_attention_norm.weight", d);
      l.post_ffn_norm = load_vector(f, b + "post_ffw_norm.weight", d);
    }
    l.w_gate = prepare(b + "ffn_gate.weight", d, hp.ffn_dim);
    l.w_up = prepare(b + "ffn_up.weight", d, hp.ffn_dim);
    l.w_down = prepare(b + "ffn_down.weight", hp.ffn_dim, d);
  }
  return model;
}

std::unique_ptr<PreparedWeight> Model::prepare_output_rows(std::span<const int32_t> tokens, Quantizer& quantizer,
                                                           std::vector<uint8_t>* storage) const {
  const gguf::GgufFile& f = *file_;
  const gguf::TensorInfo& t = f.tensor(f.find_tensor("output.weight") ? "output.weight" : "token_embd.weight");
  const int64_t rows = t.num_rows();
  const size_t row_bytes = t.num_bytes / static_cast<size_t>(rows);  // GGUF rows are whole blocks
  storage->resize(row_bytes * tokens.size());
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] < 0 || tokens[i] >= rows)
      throw std::invalid_argument("token " + std::to_string(tokens[i]) + " is outside " + name_ +
                                  "'s vocabulary (0.." + std::to_string(rows - 1) + ")");
    std::memcpy(storage->data() + i * row_bytes, t.data + static_cast<size_t>(tokens[i]) * row_bytes, row_bytes);
  }
  WeightView view{t.name.c_str(), static_cast<uint32_t>(t.type), t.dims[0], static_cast<int64_t>(tokens.size()),
                  storage->data(), storage->size()};
  std::unique_ptr<PreparedWeight> w;
  Status st = quantizer.prepare(view, &w);
  if (!st.is_ok()) throw std::runtime_error("cannot prepare the output head's rows: " + st.message());
  return w;
}

}  // namespace tessera
