// A decoder model loaded from GGUF: hyperparameters, tokenizer and weights prepared by the
// configured quantizer. Architectures (the Llama family, Gemma 3) are described by a small
// table in model.cpp (RoPE style, FFN activation, extra norms, embedding scale, sliding-window
// layers) that fills ModelHparams and LayerWeights; the one runner reads those, not a fork.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "tessera/gguf.h"
#include "tessera/sdk/backend.h"
#include "tessera/sdk/forward.h"
#include "tessera/sdk/quantizer.h"
#include "tessera/tokenizer.h"

namespace tessera {

enum class FfnActivation { kSilu, kGeluTanh };  // SwiGLU (Llama) or GeGLU (Gemma)

struct ModelHparams {
  std::string architecture;  // "llama", "qwen2", "gemma3", ...
  int32_t vocab_size = 0;
  int32_t embedding_dim = 0;
  int32_t num_layers = 0;
  int32_t num_heads = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  int32_t ffn_dim = 0;
  int32_t context_length = 0;  // trained context
  float rms_eps = 1e-5f;
  RopeParams rope;             // global (full-attention) layers
  // Gemma 3 (llama.cpp's llm_build_gemma3): embeddings scaled by sqrt(embedding_dim), q/k
  // RMSNorm per head, RMSNorm after attention and after the FFN, GeGLU, and every layer but
  // each sliding_window_pattern-th one attending over a window with its own RoPE base.
  float embedding_scale = 1.0f;        // multiplies the looked-up embedding
  float attention_scale = 1.0f;        // scale of Q.K: 1/sqrt(head_dim) (Gemma: query_pre_attn_scalar)
  FfnActivation ffn_activation = FfnActivation::kSilu;
  int32_t sliding_window = 0;          // tokens a local layer sees (0: no local layers)
  RopeParams rope_local;               // RoPE of the local layers
  float final_logit_softcap = 0.0f;    // logits = c * tanh(logits / c) when > 0
  std::vector<bool> layer_is_local;    // per layer: sliding-window attention
  bool extra_norms = false;            // q/k, post-attention and post-FFN norms (Gemma)
  // The plain Llama graph, which ForwardModelView describes to device runners.
  bool is_llama_graph() const {
    return ffn_activation == FfnActivation::kSilu && embedding_scale == 1.0f && !extra_norms &&
           sliding_window == 0 && final_logit_softcap == 0.0f;
  }
};

struct LayerWeights {
  std::vector<float> attn_norm;
  std::vector<float> ffn_norm;
  std::unique_ptr<PreparedWeight> wq, wk, wv, wo;
  std::vector<float> bq, bk, bv;  // Qwen2-style q/k/v biases; empty when absent
  // Gemma 3: RMSNorm of each q/k head (head_dim weights), of the attention output and of the
  // FFN output before they are added to the residual (embedding_dim weights); empty otherwise.
  std::vector<float> q_norm, k_norm, post_attn_norm, post_ffn_norm;
  std::unique_ptr<PreparedWeight> w_gate, w_up, w_down;
};

class Model {
 public:
  // Progress: (tensors prepared, total tensors).
  using ProgressFn = std::function<void(size_t done, size_t total)>;

  // Maps the GGUF, reads hyperparameters and the tokenizer, and prepares each weight
  // through `quantizer`. Throws std::runtime_error (GgufError for file problems) naming the
  // file and what is wrong: unsupported architecture, missing tensor, shape mismatch,
  // weight type the quantizer does not support.
  static std::shared_ptr<Model> load(const std::string& path, Quantizer& quantizer,
                                     const ProgressFn& progress = {});

  const ModelHparams& hparams() const { return hparams_; }
  const Tokenizer& tokenizer() const { return *tokenizer_; }
  const gguf::GgufFile& file() const { return *file_; }
  const std::string& chat_template() const { return chat_template_; }
  const std::string& name() const { return name_; }

  const PreparedWeight& token_embedding() const { return *token_embd_; }
  const PreparedWeight& output() const { return output_ ? *output_ : *token_embd_; }
  const std::vector<float>& output_norm() const { return output_norm_; }
  const std::vector<LayerWeights>& layers() const { return layers_; }
  size_t weight_bytes() const { return weight_bytes_; }
  // The output head's rows for `tokens`, in that order, prepared by `quantizer` as one weight
  // (a reduced draft vocabulary, HostModel::restrict_logits). The rows are copied from the
  // GGUF into *storage, which must outlive the result (a quantizer may keep pointing into
  // it). Throws std::invalid_argument for a token outside the vocabulary.
  std::unique_ptr<PreparedWeight> prepare_output_rows(std::span<const int32_t> tokens, Quantizer& quantizer,
                                                      std::vector<uint8_t>* storage) const;
  // The model as plain SDK data (raw GGUF weights, norms), for device runners
  // (ForwardRunnerProvider). Points into this model; valid while it lives. Throws
  // std::runtime_error for a model that is not the plain Llama graph (hparams.is_llama_graph).
  ForwardModelView forward_view() const;

 private:
  Model() = default;
  std::shared_ptr<gguf::GgufFile> file_;
  ModelHparams hparams_;
  std::unique_ptr<Tokenizer> tokenizer_;
  std::string chat_template_;
  std::string name_;
  std::unique_ptr<PreparedWeight> token_embd_;
  std::unique_ptr<PreparedWeight> output_;  // null when tied to token_embd_
  std::vector<float> output_norm_;
  std::vector<LayerWeights> layers_;
  size_t weight_bytes_ = 0;
};

}  // namespace tessera
