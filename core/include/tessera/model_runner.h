// Runs the model's forward pass over a flattened batch: each sequence contributes a span of
// consecutive tokens (a prompt chunk, one decode token, or a token plus drafts) whose K/V are
// written into the paged pool before attention reads it through the block tables.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "tessera/model.h"
#include "tessera/sdk/attention.h"
#include "tessera/sdk/backend.h"
#include "tessera/sdk/forward.h"
#include "tessera/sdk/kv_cache.h"
#include "tessera/sdk/quantizer.h"

namespace tessera {

// The SDK type (tessera/sdk/forward.h), so device runners take the same batches.
using RunnerSequence = ForwardSequence;

class ModelRunner final : public ForwardRunner, public LayerGatedForward {
 public:
  // Allocates the KV pool described by `layout` and scratch for `max_batch_tokens` rows.
  // `layers` (ascending, distinct) runs only those layers before the output head, with a KV
  // pool for those alone (a layer-skip draft over the target's own weights); empty: all.
  ModelRunner(const Model& model, Backend& backend, Quantizer& quantizer,
              AttentionKernel& attention, const KvLayout& layout, int32_t max_batch_tokens,
              std::vector<int32_t> layers = {});
  ~ModelRunner() override;
  ModelRunner(const ModelRunner&) = delete;
  ModelRunner& operator=(const ModelRunner&) = delete;

  // Writes [sum of num_logit_rows][vocab_size] logits in batch order into *logits (resized
  // only when it grows).
  Status forward(std::span<const RunnerSequence> sequences, std::vector<float>* logits) override;
  // The same, asking `gate` before each layer's attention reads its KV pool (layer-pipelined
  // decode start, tessera/sdk/forward.h).
  Status forward_gated(std::span<const RunnerSequence> sequences, std::vector<float>* logits,
                       ForwardLayerGate& gate) override;
  // Copies whole blocks (all layers, K and V): copy-on-write after forks.
  void copy_blocks(std::span<const BlockCopy> copies) override;

  // Logits from `output` instead of the model's head (null: the model's): its rows are the
  // logits' columns (a reduced draft vocabulary). Not owned; must outlive its use.
  void set_output(const PreparedWeight* output) { output_ = output; }
  // Columns of a logits row: the vocabulary, or the rows of set_output's head.
  int32_t vocab_size() const override {
    return output_ ? static_cast<int32_t>(output_->rows()) : model_.hparams().vocab_size;
  }
  size_t kv_pool_bytes() const override { return kv_pool_bytes_; }
  const KvLayout& kv_layout() const { return layout_; }
  // Layer indices are the model's (all layers: a layer-subset runner refuses).
  Status read_kv_layer(int32_t layer, std::span<const int32_t> block_table, int32_t num_tokens,
                       uint8_t* k_out, uint8_t* v_out) const override;
  Status write_kv_layer(int32_t layer, std::span<const int32_t> block_table, int32_t num_tokens,
                        const uint8_t* k_in, const uint8_t* v_in) override;

 private:
  Status run_forward(std::span<const RunnerSequence> sequences, std::vector<float>* logits,
                     ForwardLayerGate* gate);
  void ensure_capacity(int32_t num_rows, int32_t num_logit_rows);
  void matmul(const PreparedWeight& w, const float* x, int64_t rows, float* y);
  // Weights that share an input (q/k/v, gate/up): one pass when the quantizer can group them.
  void matmul_group(std::span<const MatmulTarget> targets, const float* x, int64_t rows);
  void add_bias(float* y, const std::vector<float>& bias, int64_t rows);
  // h = rms_norm(h, weight) over num_rows rows when the layer has the norm (Gemma's
  // post-attention and post-FFN norms), before h is added to the residual.
  void post_norm(const std::vector<float>& weight, int32_t num_rows);
  // Checks a read/write_kv_layer call; sets the bytes of one token's K and V rows.
  Status check_kv_transfer(int32_t layer, std::span<const int32_t> block_table, int32_t num_tokens,
                           size_t* k_token_bytes, size_t* v_token_bytes) const;

  const Model& model_;
  Backend& backend_;
  Quantizer& quantizer_;
  const PreparedWeight* output_ = nullptr;  // set_output's head, or null
  GroupedMatmul* grouped_matmul_ = nullptr;  // the quantizer's capability, when it has it
  AttentionKernel& attention_;
  KvLayout layout_;
  AttentionShape attention_shape_;        // global layers
  AttentionShape local_attention_shape_;  // sliding-window layers (hparams.layer_is_local)
  std::vector<int32_t> layers_;           // the model's layers this runner runs, in order
  std::vector<void*> k_pools_, v_pools_;  // one per entry of layers_
  size_t kv_pool_bytes_ = 0;
  size_t k_block_bytes_ = 0;              // bytes of one block in one layer's K pool
  size_t v_block_bytes_ = 0;              // and in its V pool (K and V dtypes may differ)
  // Elements per Hadamard rotation of the rows a q8_0 pool stores (tessera/kv_rotation.h);
  // 0: stored as computed (f32/f16 pools, or a head not a multiple of 64).
  int32_t k_rotation_ = 0;
  int32_t v_rotation_ = 0;

  // Scratch, grown on demand (never shrunk) so the steady state allocates nothing.
  int32_t capacity_rows_ = 0;
  int32_t capacity_logit_rows_ = 0;
  std::vector<float> x_, h_, q_, k_, v_, attn_, gate_, up_, logit_in_;
  std::vector<int32_t> positions_, slots_;
  std::vector<AttentionSequence> attention_sequences_;
};

}  // namespace tessera
