// A Llama-family model loaded from GGUF: hyperparameters, tokenizer and weights prepared by
// the configured quantizer. Architectures are described by a small table (tensor names,
// metadata prefix, RoPE style), not by forks of the runner.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "tessera/gguf.h"
#include "tessera/sdk/backend.h"
#include "tessera/sdk/forward.h"
#include "tessera/sdk/quantizer.h"
#include "tessera/tokenizer.h"

namespace tessera {

struct ModelHparams {
  std::string architecture;  // "llama", "qwen2", ...
  int32_t vocab_size = 0;
  int32_t embedding_dim = 0;
  int32_t num_layers = 0;
  int32_t num_heads = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  int32_t ffn_dim = 0;
  int32_t context_length = 0;  // trained context
  float rms_eps = 1e-5f;
  RopeParams rope;
};

struct LayerWeights {
  std::vector<float> attn_norm;
  std::vector<float> ffn_norm;
  std::unique_ptr<PreparedWeight> wq, wk, wv, wo;
  std::vector<float> bq, bk, bv;  // Qwen2-style q/k/v biases; empty when absent
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
  // The model as plain SDK data (raw GGUF weights, norms), for device runners
  // (ForwardRunnerProvider). Points into this model; valid while it lives.
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
