#include "tessera/model_runner.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>

#include "tessera/kv_rotation.h"

namespace tessera {

ModelRunner::ModelRunner(const Model& model, Backend& backend, Quantizer& quantizer,
                         AttentionKernel& attention, const KvLayout& layout,
                         int32_t max_batch_tokens, std::vector<int32_t> layers)
    : model_(model), backend_(backend), quantizer_(quantizer),
      grouped_matmul_(dynamic_cast<GroupedMatmul*>(&quantizer)), attention_(attention),
      layout_(layout), layers_(std::move(layers)) {
  const ModelHparams& hp = model.hparams();
  if (layers_.empty())
    for (int32_t l = 0; l < hp.num_layers; ++l) layers_.push_back(l);
  for (size_t i = 0; i < layers_.size(); ++i) {
    if (layers_[i] < 0 || layers_[i] >= hp.num_layers)
      throw std::invalid_argument("layers: " + std::to_string(layers_[i]) + " is not a layer of " + model.name() +
                                  ", which has " + std::to_string(hp.num_layers) + " (0.." +
                                  std::to_string(hp.num_layers - 1) + ")");
    if (i > 0 && layers_[i] <= layers_[i - 1])
      throw std::invalid_argument("layers: " + std::to_string(layers_[i]) + " follows " +
                                  std::to_string(layers_[i - 1]) + "; list them ascending, each once");
  }
  const auto pooled_layers = static_cast<int64_t>(layers_.size());
  attention_shape_.num_heads = hp.num_heads;
  attention_shape_.num_kv_heads = hp.num_kv_heads;
  attention_shape_.head_dim = hp.head_dim;
  attention_shape_.scale = hp.attention_scale;
  attention_shape_.block_size = layout.block_size;
  attention_shape_.k_dtype = layout.k_dtype;
  attention_shape_.v_dtype = layout.v_dtype;
  for (KvDtype t : {layout.k_dtype, layout.v_dtype})
    if (!kv_dtype_fits(t, hp.head_dim))
      throw std::runtime_error(std::string("KV dtype ") + kv_dtype_name(t) +
                               " needs head_dim to be a multiple of 32, the model's is " +
                               std::to_string(hp.head_dim));
  // A q8_0 pool keeps rows rotated (tessera/kv_rotation.h); f32 and f16 rows are stored as is.
  if (layout.k_dtype == KvDtype::kQ8_0) k_rotation_ = kv_k_rotation_block(hp.head_dim);
  if (layout.v_dtype == KvDtype::kQ8_0) v_rotation_ = kv_v_rotation_block(hp.head_dim);
  local_attention_shape_ = attention_shape_;
  local_attention_shape_.sliding_window = hp.sliding_window;

  const KvModelShape shape{hp.num_layers, hp.num_kv_heads, hp.head_dim, 0, 0};
  k_block_bytes_ = KvLayout::pool_block_bytes(shape, layout.block_size, layout.k_dtype);
  v_block_bytes_ = KvLayout::pool_block_bytes(shape, layout.block_size, layout.v_dtype);
  const size_t k_layer_bytes = k_block_bytes_ * static_cast<size_t>(layout.num_blocks);
  const size_t v_layer_bytes = v_block_bytes_ * static_cast<size_t>(layout.num_blocks);
  const size_t layer_bytes = k_layer_bytes + v_layer_bytes;
  for (int64_t l = 0; l < pooled_layers; ++l) {
    void* k = backend.allocate(k_layer_bytes);
    void* v = backend.allocate(v_layer_bytes);
    if (!k || !v) {
      if (k) backend.release(k);
      if (v) backend.release(v);
      for (void* p : k_pools_) backend.release(p);
      for (void* p : v_pools_) backend.release(p);
      throw std::runtime_error("cannot allocate the KV pool: " +
                               std::to_string(layer_bytes * pooled_layers) + " bytes on " +
                               backend.device_name() + "; lower engine.kv_cache.memory");
    }
    k_pools_.push_back(k);
    v_pools_.push_back(v);
  }
  kv_pool_bytes_ = layer_bytes * static_cast<size_t>(pooled_layers);
  ensure_capacity(std::max(1, max_batch_tokens), 1);
}

ModelRunner::~ModelRunner() {
  for (void* p : k_pools_) backend_.release(p);
  for (void* p : v_pools_) backend_.release(p);
}

void ModelRunner::ensure_capacity(int32_t num_rows, int32_t num_logit_rows) {
  const ModelHparams& hp = model_.hparams();
  if (num_rows > capacity_rows_) {
    const size_t r = static_cast<size_t>(num_rows);
    x_.resize(r * hp.embedding_dim);
    h_.resize(r * hp.embedding_dim);
    q_.resize(r * hp.num_heads * hp.head_dim);
    attn_.resize(r * hp.num_heads * hp.head_dim);
    k_.resize(r * hp.num_kv_heads * hp.head_dim);
    v_.resize(r * hp.num_kv_heads * hp.head_dim);
    gate_.resize(r * hp.ffn_dim);
    up_.resize(r * hp.ffn_dim);
    positions_.resize(r);
    slots_.resize(r);
    capacity_rows_ = num_rows;
  }
  if (num_logit_rows > capacity_logit_rows_) {
    logit_in_.resize(static_cast<size_t>(num_logit_rows) * hp.embedding_dim);
    capacity_logit_rows_ = num_logit_rows;
  }
}

void ModelRunner::matmul(const PreparedWeight& w, const float* x, int64_t rows, float* y) {
  quantizer_.matmul(w, x, rows, y, backend_.executor());
}

void ModelRunner::matmul_group(std::span<const MatmulTarget> targets, const float* x,
                               int64_t rows) {
  if (grouped_matmul_ != nullptr) {
    grouped_matmul_->matmul_group(targets, x, rows, backend_.executor());
    return;
  }
  for (const MatmulTarget& t : targets) matmul(*t.weight, x, rows, t.y);
}

void ModelRunner::add_bias(float* y, const std::vector<float>& bias, int64_t rows) {
  if (bias.empty()) return;
  const int64_t n = static_cast<int64_t>(bias.size());
  for (int64_t r = 0; r < rows; ++r) backend_.add(y + r * n, bias.data(), n);
}

Status ModelRunner::forward(std::span<const RunnerSequence> sequences, std::vector<float>* logits) {
  return run_forward(sequences, logits, nullptr);
}

Status ModelRunner::forward_gated(std::span<const RunnerSequence> sequences, std::vector<float>* logits,
                                  ForwardLayerGate& gate) {
  return run_forward(sequences, logits, &gate);
}

Status ModelRunner::run_forward(std::span<const RunnerSequence> sequences, std::vector<float>* logits,
                                ForwardLayerGate* gate) {
  const ModelHparams& hp = model_.hparams();
  int32_t num_rows = 0;
  int32_t num_logit_rows = 0;
  for (const auto& s : sequences) {
    if (s.num_tokens <= 0 || s.num_logit_rows > s.num_tokens)
      return invalid_argument("runner: a sequence must feed at least one token and request at most that many logit rows");
    const int32_t context = s.start_position + s.num_tokens;
    const int64_t blocks_needed = (context + layout_.block_size - 1) / layout_.block_size;
    if (static_cast<int64_t>(s.block_table.size()) < blocks_needed)
      return internal_error("runner: block table has " + std::to_string(s.block_table.size()) +
                            " blocks, context of " + std::to_string(context) + " tokens needs " +
                            std::to_string(blocks_needed));
    num_rows += s.num_tokens;
    num_logit_rows += s.num_logit_rows;
  }
  if (num_rows == 0) return Status::ok();
  ensure_capacity(num_rows, std::max(1, num_logit_rows));

  // Embeddings, positions, KV slots and the attention view of each sequence.
  const int64_t d = hp.embedding_dim;
  attention_sequences_.clear();
  int32_t row = 0;
  for (const auto& s : sequences) {
    attention_sequences_.push_back({row, s.num_tokens, s.start_position + s.num_tokens,
                                    s.block_table.data()});
    for (int32_t i = 0; i < s.num_tokens; ++i, ++row) {
      const TokenId t = s.tokens[i];
      if (t < 0 || t >= hp.vocab_size)
        return invalid_argument("token id " + std::to_string(t) + " is outside the vocabulary (0.." +
                                std::to_string(hp.vocab_size - 1) + ")");
      float* x = x_.data() + row * d;
      quantizer_.dequantize_row(model_.token_embedding(), t, x);
      if (hp.embedding_scale != 1.0f)  // Gemma: ggml_scale(inp, sqrtf(n_embd))
        for (int64_t i = 0; i < d; ++i) x[i] *= hp.embedding_scale;
      const int32_t pos = s.start_position + i;
      positions_[row] = pos;
      slots_[row] = s.block_table[pos / layout_.block_size] * layout_.block_size +
                    pos % layout_.block_size;
    }
  }

  const int64_t kv_dim = static_cast<int64_t>(hp.num_kv_heads) * hp.head_dim;
  const int64_t q_elems = int64_t{num_rows} * hp.num_heads * hp.head_dim;
  const int64_t kv_elems = int64_t{num_rows} * kv_dim;
  AttentionBatch batch;
  batch.sequences = attention_sequences_;
  batch.q = q_.data();
  batch.out = attn_.data();
  for (size_t pool = 0; pool < layers_.size(); ++pool) {
    const int32_t l = layers_[pool];
    const LayerWeights& w = model_.layers()[l];
    const bool local = hp.layer_is_local[l];
    backend_.rms_norm(h_.data(), x_.data(), w.attn_norm.data(), num_rows, d, hp.rms_eps);
    const MatmulTarget qkv[] = {{w.wq.get(), q_.data()}, {w.wk.get(), k_.data()},
                                {w.wv.get(), v_.data()}};
    matmul_group(qkv, h_.data(), num_rows);
    add_bias(q_.data(), w.bq, num_rows);
    add_bias(k_.data(), w.bk, num_rows);
    add_bias(v_.data(), w.bv, num_rows);
    if (!w.q_norm.empty()) {  // Gemma: each head normalized before RoPE
      backend_.rms_norm(q_.data(), q_.data(), w.q_norm.data(), int64_t{num_rows} * hp.num_heads,
                        hp.head_dim, hp.rms_eps);
      backend_.rms_norm(k_.data(), k_.data(), w.k_norm.data(), int64_t{num_rows} * hp.num_kv_heads,
                        hp.head_dim, hp.rms_eps);
    }
    const RopeParams& rope = local ? hp.rope_local : hp.rope;
    backend_.rope(q_.data(), positions_.data(), num_rows, hp.num_heads, rope);
    backend_.rope(k_.data(), positions_.data(), num_rows, hp.num_kv_heads, rope);
    if (k_rotation_ > 0) {  // the scores are unchanged: (H q) . (H k) = q . k
      hadamard_rotate(q_.data(), q_elems / k_rotation_, k_rotation_);
      hadamard_rotate(k_.data(), kv_elems / k_rotation_, k_rotation_);
    }
    if (v_rotation_ > 0) hadamard_rotate(v_.data(), kv_elems / v_rotation_, v_rotation_);
    backend_.store_kv(k_pools_[pool], layout_.k_dtype, k_.data(), slots_.data(), num_rows, kv_dim);
    backend_.store_kv(v_pools_[pool], layout_.v_dtype, v_.data(), slots_.data(), num_rows, kv_dim);
    // Rows of this layer may still be arriving (a pipelined KV import): the pool is read from
    // here on. The new rows stored above sit past the imported ones, in the same blocks.
    if (gate) gate->before_layer(l);
    batch.k_pool = k_pools_[pool];
    batch.v_pool = v_pools_[pool];
    Status st = attention_.forward(local ? local_attention_shape_ : attention_shape_, batch,
                                   backend_.executor());
    if (!st.is_ok()) return st;
    // Weighted sums of rotated V rows: rotate them back (H is its own inverse).
    if (v_rotation_ > 0) hadamard_rotate(attn_.data(), q_elems / v_rotation_, v_rotation_);
    matmul(*w.wo, attn_.data(), num_rows, h_.data());
    post_norm(w.post_attn_norm, num_rows);
    backend_.add(x_.data(), h_.data(), static_cast<int64_t>(num_rows) * d);

    backend_.rms_norm(h_.data(), x_.data(), w.ffn_norm.data(), num_rows, d, hp.rms_eps);
    const MatmulTarget gate_up[] = {{w.w_gate.get(), gate_.data()}, {w.w_up.get(), up_.data()}};
    matmul_group(gate_up, h_.data(), num_rows);
    const int64_t ffn_elems = static_cast<int64_t>(num_rows) * hp.ffn_dim;
    if (hp.ffn_activation == FfnActivation::kSilu) {
      backend_.silu_mul(gate_.data(), up_.data(), ffn_elems);
    } else if (!backend_.gelu_mul(gate_.data(), up_.data(), ffn_elems)) {
      return invalid_argument(std::string("runner: backend ") + backend_.device_name() +
                              " has no GELU kernel (gelu_mul), which " + hp.architecture + " needs");
    }
    matmul(*w.w_down, gate_.data(), num_rows, h_.data());
    post_norm(w.post_ffn_norm, num_rows);
    backend_.add(x_.data(), h_.data(), static_cast<int64_t>(num_rows) * d);
  }

  // Logits only for the rows that will be sampled.
  if (num_logit_rows == 0) return Status::ok();
  int32_t out_row = 0;
  row = 0;
  for (const auto& s : sequences) {
    const int32_t first = row + s.num_tokens - s.num_logit_rows;
    std::memcpy(logit_in_.data() + static_cast<size_t>(out_row) * d,
                x_.data() + static_cast<size_t>(first) * d,
                sizeof(float) * d * s.num_logit_rows);
    out_row += s.num_logit_rows;
    row += s.num_tokens;
  }
  backend_.rms_norm(logit_in_.data(), logit_in_.data(), model_.output_norm().data(),
                    num_logit_rows, d, hp.rms_eps);
  const PreparedWeight& head = output_ ? *output_ : model_.output();
  const size_t needed = static_cast<size_t>(num_logit_rows) * head.rows();
  if (logits->size() < needed) logits->resize(needed);
  matmul(head, logit_in_.data(), num_logit_rows, logits->data());
  if (hp.final_logit_softcap > 0) {  // llama.cpp: scale by 1/c, tanh, scale by c
    const float c = hp.final_logit_softcap;
    const float inv = 1.0f / c;
    for (size_t i = 0; i < needed; ++i) (*logits)[i] = std::tanh((*logits)[i] * inv) * c;
  }
  return Status::ok();
}

void ModelRunner::post_norm(const std::vector<float>& weight, int32_t num_rows) {
  if (weight.empty()) return;
  const ModelHparams& hp = model_.hparams();
  backend_.rms_norm(h_.data(), h_.data(), weight.data(), num_rows, hp.embedding_dim, hp.rms_eps);
}

void ModelRunner::copy_blocks(std::span<const BlockCopy> copies) {
  for (const BlockCopy& c : copies) {
    for (size_t l = 0; l < k_pools_.size(); ++l) {
      auto* k = static_cast<uint8_t*>(k_pools_[l]);
      auto* v = static_cast<uint8_t*>(v_pools_[l]);
      backend_.copy_on_device(k + c.dst * k_block_bytes_, k + c.src * k_block_bytes_, k_block_bytes_);
      backend_.copy_on_device(v + c.dst * v_block_bytes_, v + c.src * v_block_bytes_, v_block_bytes_);
    }
  }
}

}  // namespace tessera

namespace tessera {

Status ModelRunner::check_kv_transfer(int32_t layer, std::span<const int32_t> block_table, int32_t num_tokens,
                                      size_t* k_token_bytes, size_t* v_token_bytes) const {
  const auto& hp = model_.hparams();
  if (static_cast<int32_t>(layers_.size()) != hp.num_layers)
    return unimplemented("a runner over a subset of the layers holds no complete KV to transfer");
  if (layer < 0 || layer >= hp.num_layers)
    return invalid_argument("KV transfer: layer " + std::to_string(layer) + " is not in [0, " +
                            std::to_string(hp.num_layers) + ")");
  const int64_t needed_blocks = (static_cast<int64_t>(num_tokens) + layout_.block_size - 1) / layout_.block_size;
  if (num_tokens < 0 || needed_blocks > static_cast<int64_t>(block_table.size()))
    return invalid_argument("KV transfer: " + std::to_string(num_tokens) + " tokens need " +
                            std::to_string(needed_blocks) + " blocks, the block table has " +
                            std::to_string(block_table.size()));
  for (int64_t b = 0; b < needed_blocks; ++b)
    if (block_table[b] < 0 || block_table[b] >= layout_.num_blocks)
      return invalid_argument("KV transfer: block " + std::to_string(block_table[b]) + " is outside the pool");
  *k_token_bytes = k_block_bytes_ / static_cast<size_t>(layout_.block_size);
  *v_token_bytes = v_block_bytes_ / static_cast<size_t>(layout_.block_size);
  return Status::ok();
}

// Rows of consecutive tokens in one block are contiguous in the pool ([block][slot][head]),
// so each block is one copy per pool.
Status ModelRunner::read_kv_layer(int32_t layer, std::span<const int32_t> block_table, int32_t num_tokens,
                                  uint8_t* k_out, uint8_t* v_out) const {
  size_t kt = 0, vt = 0;
  if (Status st = check_kv_transfer(layer, block_table, num_tokens, &kt, &vt); !st.is_ok()) return st;
  const auto* k = static_cast<const uint8_t*>(k_pools_[layer]);
  const auto* v = static_cast<const uint8_t*>(v_pools_[layer]);
  for (int32_t t = 0; t < num_tokens; t += layout_.block_size) {
    const size_t n = static_cast<size_t>(std::min(layout_.block_size, num_tokens - t));
    const size_t block = static_cast<size_t>(block_table[t / layout_.block_size]);
    backend_.copy_to_host(k_out + t * kt, k + block * k_block_bytes_, n * kt);
    backend_.copy_to_host(v_out + t * vt, v + block * v_block_bytes_, n * vt);
  }
  return Status::ok();
}

Status ModelRunner::write_kv_layer(int32_t layer, std::span<const int32_t> block_table, int32_t num_tokens,
                                   const uint8_t* k_in, const uint8_t* v_in) {
  size_t kt = 0, vt = 0;
  if (Status st = check_kv_transfer(layer, block_table, num_tokens, &kt, &vt); !st.is_ok()) return st;
  auto* k = static_cast<uint8_t*>(k_pools_[layer]);
  auto* v = static_cast<uint8_t*>(v_pools_[layer]);
  for (int32_t t = 0; t < num_tokens; t += layout_.block_size) {
    const size_t n = static_cast<size_t>(std::min(layout_.block_size, num_tokens - t));
    const size_t block = static_cast<size_t>(block_table[t / layout_.block_size]);
    backend_.copy_to_device(k + block * k_block_bytes_, k_in + t * kt, n * kt);
    backend_.copy_to_device(v + block * v_block_bytes_, v_in + t * vt, n * vt);
  }
  return Status::ok();
}

}  // namespace tessera
