// Optional capabilities for device backends that run the whole forward pass themselves.
//
// The core's ModelRunner drives a forward pass through the Backend's element-wise kernels,
// the Quantizer's matmul and the AttentionKernel, all on host-visible memory. A GPU backend
// cannot run that loop unchanged (the quantizer's matmul reads host memory), so a backend may
// also implement ForwardRunnerProvider: the engine asks it for a runner that implements the
// same forward over the same model and the same paged KV layout, and falls back to the core's
// ModelRunner when the backend does not provide one.
//
// These are separate interfaces, discovered with dynamic_cast, so no existing vtable grows
// and plugins built against an older SDK minor keep working (they simply lack the capability).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "tessera/sdk/attention.h"
#include "tessera/sdk/backend.h"
#include "tessera/sdk/kv_cache.h"
#include "tessera/sdk/quantizer.h"
#include "tessera/sdk/status.h"
#include "tessera/sdk/types.h"

namespace tessera {

// One sequence's share of a forward batch (the core's RunnerSequence is this type).
struct ForwardSequence {
  const TokenId* tokens = nullptr;    // the tokens fed this step
  int32_t num_tokens = 0;
  int32_t start_position = 0;         // position of tokens[0] (= tokens already in the cache)
  std::span<const int32_t> block_table;
  int32_t num_logit_rows = 0;         // the last N fed tokens need logits (0: none)
};

// A Llama-family model as plain data: hyperparameters and the weights as stored in the GGUF
// file (WeightView: GGML type, shape, mapped bytes). Valid only during
// create_forward_runner; a runner copies what it needs (e.g. uploads weights to the device).
struct ForwardModelView {
  int32_t vocab_size = 0;
  int32_t embedding_dim = 0;
  int32_t num_layers = 0;
  int32_t num_heads = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  int32_t ffn_dim = 0;
  float rms_eps = 1e-5f;
  RopeParams rope;

  WeightView token_embd;              // [vocab][embedding_dim]
  WeightView output;                  // [vocab][embedding_dim]; same data as token_embd when tied
  const float* output_norm = nullptr; // embedding_dim floats

  struct Layer {
    const float* attn_norm = nullptr; // embedding_dim floats
    const float* ffn_norm = nullptr;
    const float* bq = nullptr;        // q/k/v biases (Qwen2); null when absent
    const float* bk = nullptr;
    const float* bv = nullptr;
    WeightView wq, wk, wv, wo, w_gate, w_up, w_down;
  };
  std::vector<Layer> layers;
};

// Runs forward passes over a flattened batch, owning the KV pool (same contract as the
// core's ModelRunner).
class ForwardRunner {
 public:
  virtual ~ForwardRunner() = default;
  // Writes [sum of num_logit_rows][vocab_size] logits in batch order into *logits (host
  // memory; resized only when it grows).
  virtual Status forward(std::span<const ForwardSequence> sequences, std::vector<float>* logits) = 0;
  // Copies whole blocks (all layers, K and V): copy-on-write after forks.
  virtual void copy_blocks(std::span<const BlockCopy> copies) = 0;
  virtual int32_t vocab_size() const = 0;
  virtual size_t kv_pool_bytes() const = 0;
  // Disaggregation (SDK 2.9, tessera/sdk/kv_connector.h): layer `layer`'s K and V rows of
  // tokens [0, num_tokens) gathered through `block_table` into token-major payloads of
  // num_tokens * kv_token_bytes(), or scattered back from them. Called from a transfer
  // thread while forward() runs on the engine thread, for blocks no forward touches (held by
  // a finished prefill, or allocated to a sequence waiting for its KV). The default:
  // kUnimplemented (the engine then refuses a prefill or decode role at startup).
  virtual Status read_kv_layer(int32_t layer, std::span<const int32_t> block_table, int32_t num_tokens,
                               uint8_t* k_out, uint8_t* v_out) const {
    (void)layer, (void)block_table, (void)num_tokens, (void)k_out, (void)v_out;
    return Status(StatusCode::kUnimplemented, "this forward runner cannot export KV rows");
  }
  virtual Status write_kv_layer(int32_t layer, std::span<const int32_t> block_table, int32_t num_tokens,
                                const uint8_t* k_in, const uint8_t* v_in) {
    (void)layer, (void)block_table, (void)num_tokens, (void)k_in, (void)v_in;
    return Status(StatusCode::kUnimplemented, "this forward runner cannot import KV rows");
  }
};

// Layer-pipelined decode start (SDK 2.12). A disaggregated decode engine may run a step for a
// sequence whose KV rows are still arriving layer by layer: before the pass reads layer L's
// KV pool, it asks the gate, which returns once every row the batch needs in that layer is in
// place (or the engine gave up on a sequence whose rows stalled; that sequence's results are
// then discarded). Rows of layers above L may still be written by a transfer thread while
// layer L computes: a runner must not read a layer's pool before its gate call.
class ForwardLayerGate {
 public:
  virtual ~ForwardLayerGate() = default;
  // Called on the forward's thread once per layer, ascending (the model's layer index).
  virtual void before_layer(int32_t layer) = 0;
};

// Optional capability of a ForwardRunner (discover with dynamic_cast<LayerGatedForward*>): the
// same forward, with `gate` asked before each layer reads its KV pool. A runner without it is
// only given a sequence once every layer of its KV has landed.
class LayerGatedForward {
 public:
  virtual ~LayerGatedForward() = default;
  virtual Status forward_gated(std::span<const ForwardSequence> sequences, std::vector<float>* logits,
                               ForwardLayerGate& gate) = 0;
};

// Optional capability of a Backend (discover with dynamic_cast<ForwardRunnerProvider*>).
class ForwardRunnerProvider {
 public:
  virtual ~ForwardRunnerProvider() = default;
  // Creates a runner for `model` with a KV pool of `layout` and scratch for
  // `max_batch_tokens` rows, using `attention` (the engine's attention slot). Returns
  // kUnimplemented to let the engine use the core runner instead; any other error is fatal
  // (e.g. a CPU attention kernel configured with a GPU backend).
  virtual Status create_forward_runner(const ForwardModelView& model, const KvLayout& layout,
                                       int32_t max_batch_tokens, int32_t max_context,
                                       AttentionKernel& attention,
                                       std::unique_ptr<ForwardRunner>* out) = 0;
};

// Optional capability of an AttentionKernel that computes on a device: the pointers in
// AttentionBatch (q, pools, out) and every AttentionSequence::block_table are device
// pointers of the backend named here. Kernels without it compute on host memory.
class DeviceAttentionKernel {
 public:
  virtual ~DeviceAttentionKernel() = default;
  virtual const char* device_name() const = 0;  // e.g. "cuda"
};

}  // namespace tessera
