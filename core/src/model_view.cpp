#include "tessera/model.h"

#include <stdexcept>

namespace tessera {
namespace {

WeightView raw_weight(const gguf::GgufFile& f, const std::string& name) {
  const gguf::TensorInfo& t = f.tensor(name);
  return WeightView{t.name.c_str(), static_cast<uint32_t>(t.type), t.dims[0], t.num_rows(), t.data,
                    t.num_bytes};
}

const float* optional(const std::vector<float>& v) { return v.empty() ? nullptr : v.data(); }

}  // namespace

ForwardModelView Model::forward_view() const {
  const gguf::GgufFile& f = *file_;
  const ModelHparams& hp = hparams_;
  // The view describes the plain Llama graph; a device runner handed Gemma's would compute
  // another model without noticing.
  if (!hp.is_llama_graph())
    throw std::runtime_error(f.path() + ": device runners run Llama-family graphs only; " +
                             hp.architecture +
                             " (GeGLU, extra norms, sliding window) needs engine.backend: {plugin: cpu}");
  ForwardModelView v;
  v.vocab_size = hp.vocab_size;
  v.embedding_dim = hp.embedding_dim;
  v.num_layers = hp.num_layers;
  v.num_heads = hp.num_heads;
  v.num_kv_heads = hp.num_kv_heads;
  v.head_dim = hp.head_dim;
  v.ffn_dim = hp.ffn_dim;
  v.rms_eps = hp.rms_eps;
  v.rope = hp.rope;
  v.token_embd = raw_weight(f, "token_embd.weight");
  v.output = f.find_tensor("output.weight") ? raw_weight(f, "output.weight") : v.token_embd;
  v.output_norm = output_norm_.data();
  v.layers.resize(layers_.size());
  for (size_t i = 0; i < layers_.size(); ++i) {
    const std::string b = "blk." + std::to_string(i) + ".";
    const LayerWeights& w = layers_[i];
    ForwardModelView::Layer& l = v.layers[i];
    l.attn_norm = w.attn_norm.data();
    l.ffn_norm = w.ffn_norm.data();
    l.bq = optional(w.bq);
    l.bk = optional(w.bk);
    l.bv = optional(w.bv);
    l.wq = raw_weight(f, b + "attn_q.weight");
    l.wk = raw_weight(f, b + "attn_k.weight");
    l.wv = raw_weight(f, b + "attn_v.weight");
    l.wo = raw_weight(f, b + "attn_output.weight");
    l.w_gate = raw_weight(f, b + "ffn_gate.weight");
    l.w_up = raw_weight(f, b + "ffn_up.weight");
    l.w_down = raw_weight(f, b + "ffn_down.weight");
  }
  return v;
}

}  // namespace tessera
