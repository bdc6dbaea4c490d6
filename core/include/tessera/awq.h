// AWQ (Lin et al. 2023, "AWQ: Activation-aware Weight Quantization"): before quantizing, each
// input channel c of a linear layer is multiplied by s_c = mean|x_c|^alpha (alpha searched per
// layer group on calibration activations, minimizing the group's output error), and the
// inverse scale folded into whatever produces that input, so the float model computes the
// same function and the salient channels get finer grids:
//   attn_norm -> q/k/v, ffn_norm -> gate/up (the RMSNorm weight divided by s),
//   attn_v -> attn_output (V's rows divided by s; with GQA one V row feeds several query heads,
//     so those heads share one scale), ffn_up -> ffn_down (up's rows divided by s).
// The file stays a plain GGUF of the same architecture. A clipping ratio is then searched per
// row and 32-column block, and the block quantizer is importance-weighted by diag(H).
#pragma once

#include <map>
#include <string>
#include <vector>

#include "tessera/gguf.h"
#include "tessera/quantize.h"

namespace tessera::quant {

struct AwqFold {
  // The folded f32 data of every tensor the scales change (weights and norm vectors).
  std::map<std::string, std::vector<float>> tensors;
  // Per weight: the per-column factor its columns were multiplied by (its input is divided
  // by it); weights not listed have factor 1.
  std::map<std::string, std::vector<float>> input_scale;
  // Per group ("blk.3.attn_q.weight+k+v", ...): the alpha chosen.
  std::map<std::string, float> alpha;
};

// The scale search and folding for every layer of `file` (tensor types from `plan`). Groups
// whose tensors are missing or lack statistics are left unscaled. `stats` needs covariances.
AwqFold awq_search(const gguf::GgufFile& file, const std::vector<TensorPlan>& plan,
                   const CalibrationStats& stats, const AwqOptions& options, int threads);

// Folds given per-group scales (keyed like AwqFold::alpha, values: the channel scales of the
// group's input) into `file`'s tensors. Used by awq_search and by the tests that check the
// folded float model computes what the original does.
AwqFold awq_fold(const gguf::GgufFile& file, const std::map<std::string, std::vector<float>>& scales);

// One (folded) weight into `type`: per row and 32-column block a clipping ratio chosen to
// minimize e H' e^T (H' the input covariance in the scaled basis, block-diagonal part), then
// the format's importance-weighted quantizer with diag(H'). `scale` empty means all ones.
std::vector<uint8_t> awq_quantize_tensor(GgmlType type, const float* w, int64_t rows, int64_t cols,
                                         const InputStats& input, const std::vector<float>& scale,
                                         const AwqOptions& options, int threads);

}  // namespace tessera::quant
