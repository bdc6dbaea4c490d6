// A sentence-embedding model run by Tessera itself: a BERT-style encoder (all-MiniLM-L6-v2
// and other sentence-transformers models) loaded as it ships — a directory with
// model.safetensors (F32), config.json, tokenizer.json and the sentence-transformers files
// (1_Pooling/config.json, sentence_bert_config.json, modules.json). WordPiece tokens →
// encoder → mean pooling over the attention mask → L2 normalization (when modules.json has a
// Normalize module).
//
// The encoder's graph is described by an EncoderArchitecture (tensor names, activation, the
// post-norm residual layout), next to the decoder architectures of model.cpp.
//
// Thread-safety: embed() and encode() may be called from any thread; forwards are
// serialized (one scratch arena, one thread pool), so concurrent callers wait for each other.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "tessera/embedding/wordpiece.h"

namespace tessera {

class ThreadPool;
namespace safetensors {
class File;
}

struct EncoderHparams {
  std::string architecture;  // config.json model_type ("bert")
  int32_t vocab_size = 0;
  int32_t hidden = 0;
  int32_t num_layers = 0;
  int32_t num_heads = 0;
  int32_t ffn = 0;
  int32_t max_positions = 0;
  int32_t type_vocab_size = 0;
  float norm_eps = 1e-12f;
  int32_t max_seq_length = 0;  // sentence_bert_config.json: inputs are truncated to this
  bool mean_pooling = true;    // 1_Pooling: mean over tokens (else the [CLS] token)
  bool normalize = true;       // modules.json has sentence_transformers.models.Normalize
};

class EncoderModel {
 public:
  // `dir` is the model directory; threads <= 0: all hardware threads. Throws
  // std::runtime_error naming the file and what is wrong.
  static std::unique_ptr<EncoderModel> load(const std::string& dir, int threads);
  ~EncoderModel();

  const EncoderHparams& hparams() const { return hp_; }
  const WordPieceTokenizer& tokenizer() const { return *tokenizer_; }
  int32_t dimension() const { return hp_.hidden; }
  // The model's input budget: max_seq_length, else max_position_embeddings.
  int32_t max_tokens() const { return hp_.max_seq_length; }
  const std::string& name() const { return name_; }

  // [CLS] text [SEP], truncated to max_tokens().
  std::vector<int32_t> encode(const std::string& text) const { return tokenizer_->encode(text, max_tokens()); }
  // One embedding of `dimension()` floats per input, in order. Every input must be 1 to
  // max_tokens() ids inside the vocabulary (std::invalid_argument naming the input otherwise).
  std::vector<std::vector<float>> embed(const std::vector<std::vector<int32_t>>& inputs);

 private:
  EncoderModel() = default;
  struct Weights;
  void forward(std::span<const int32_t> ids, float* out);

  std::string name_;
  EncoderHparams hp_;
  std::unique_ptr<WordPieceTokenizer> tokenizer_;
  std::unique_ptr<safetensors::File> file_;
  std::unique_ptr<Weights> w_;
  std::unique_ptr<ThreadPool> pool_;
  std::mutex mutex_;  // forward scratch and pool_
  std::vector<float> x_, q_, k_, v_, ctx_, tmp_, ffn_, scores_;
};

}  // namespace tessera
