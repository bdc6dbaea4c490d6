// Host services for plugins that run a second model beside the stack's own (SDK ABI 2.3):
// a draft model for speculative decoding loads a GGUF through the host, which prepares its
// weights with the stack's quantizer and runs it with the stack's backend and a fresh
// instance of the stack's attention kernel, into a paged KV pool the plugin manages itself.
// PluginContext::models points at the stack's ModelHost while the plugin is being created
// (inside its create function): load what you need there and keep the HostModel, which lives
// as long as you hold it, not the host.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "tessera/sdk/forward.h"
#include "tessera/sdk/kv_cache.h"
#include "tessera/sdk/status.h"
#include "tessera/sdk/types.h"

namespace tessera {

// What a plugin may know about a model: enough to check that two models share a vocabulary.
class ModelInfo {
 public:
  virtual ~ModelInfo() = default;
  virtual const std::string& name() const = 0;     // general.name, else the file's stem
  virtual const std::string& path() const = 0;     // the resolved GGUF path
  virtual int32_t vocab_size() const = 0;          // rows of logits
  // The vocabulary entry as stored (GGUF tokenizer.ggml.tokens), for id in [0, vocab_size).
  virtual const std::string& token_text(TokenId id) const = 0;
};

// A model the host loaded for a plugin, with its own KV pool (`kv_layout().num_blocks`
// blocks of `block_size` tokens). The plugin owns the block ids: it allocates them to its
// sequences and passes block tables in ForwardSequence, as the engine does with the target.
class HostModel : public ModelInfo {
 public:
  virtual const KvLayout& kv_layout() const = 0;
  virtual int32_t max_batch_tokens() const = 0;  // most tokens one forward may carry
  virtual int32_t max_context() const = 0;       // positions per sequence
  // Same contract as ForwardRunner::forward: [sum of num_logit_rows][vocab_size] logits in
  // batch order into *logits (resized only when it grows).
  virtual Status forward(std::span<const ForwardSequence> sequences, std::vector<float>* logits) = 0;
  // SDK 2.13: logits for part of the vocabulary only (a frequency-ranked draft vocabulary:
  // FR-Spec, Zhao et al. 2025). A drafter takes the argmax of each logits row, and in a small
  // draft model the output head is a large share of the bytes one forward streams (a third
  // in the default model), so a head of the tokens that are actually drafted makes every
  // draft forward cheaper; verification stays exact whatever the drafts are.
  // After the call forward writes [sum of num_logit_rows][columns->size()] logits, column j
  // holding token (*columns)[j]: `tokens` in their order, without repeats, followed by the
  // model's end-of-generation and control tokens that `tokens` lacks (so drafts can end
  // where the target ends). The head's rows are copied once, here. An empty `tokens`
  // restores the whole vocabulary (columns = all ids). Errors name a token outside the
  // vocabulary and leave the head as it was. Appended with a default for hosts before 2.13.
  virtual Status restrict_logits(std::span<const TokenId> tokens, std::vector<TokenId>* columns) {
    (void)tokens;
    (void)columns;
    return Status(StatusCode::kUnimplemented, "this host computes logits for the whole vocabulary only (needs SDK 2.13)");
  }
};

struct HostModelRequest {
  std::string path;                  // a GGUF file or a model name, resolved like model.path
  int32_t block_size = 16;           // tokens per KV block
  int64_t kv_memory_bytes = 64 << 20;  // the KV pool (rounded down to whole blocks)
  KvDtype kv_dtype = KvDtype::kF16;  // both pools
  int32_t max_batch_tokens = 512;    // scratch rows per forward
};

// SDK 2.8: the stack's own model run through a subset of its layers, for self-speculation
// (Draft & Verify, Zhang et al. 2024; SWIFT, Xia et al. 2025): the listed layers, then the
// final norm and output head. Nothing is loaded or copied: the HostModel runs the target's
// prepared weights, with a KV pool of its own that holds only these layers.
struct TargetLayersRequest {
  std::vector<int32_t> layers;       // ascending, distinct, each in [0, the target's layer count)
  int32_t block_size = 16;           // tokens per KV block
  int64_t kv_memory_bytes = 64 << 20;  // the KV pool (rounded down to whole blocks)
  KvDtype kv_dtype = KvDtype::kF16;  // both pools
  int32_t max_batch_tokens = 512;    // scratch rows per forward
};

class ModelHost {
 public:
  virtual ~ModelHost() = default;
  // The model the stack serves.
  virtual const ModelInfo& target() const = 0;
  // Loads another model. Errors name the file (missing, unsupported architecture or weight
  // type, a KV pool too small for one block per sequence).
  virtual Status load(const HostModelRequest& request, std::unique_ptr<HostModel>* out) = 0;
  // The target through request.layers (SDK 2.8; appended, so 2.3-2.7 plugins see the table
  // they were built with). Errors name the offending layer and the target's layer count.
  virtual Status load_target_layers(const TargetLayersRequest& request, std::unique_ptr<HostModel>* out) {
    (void)request;
    (void)out;
    return Status(StatusCode::kUnimplemented, "this host cannot run the target's layers for a plugin (needs SDK 2.8)");
  }
};

}  // namespace tessera
