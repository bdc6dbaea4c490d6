// GPTQ (Frantar et al. 2022, "GPTQ: Accurate Post-Training Quantization for Generative
// Pre-trained Transformers"): a weight quantized column by column, each column's rounding error
// pushed onto the columns not yet quantized through the inverse Hessian of the layer's output
// error, H = X^T X over calibration activations. The grid of each group is the target GGML
// format's own block (Q4_0: 32 columns; Q4_K: 256-column super-blocks of 32-column sub-blocks),
// its scales chosen by the format's quantizer (importance-weighted with diag(H)) from the
// weights as they stand when GPTQ reaches the group; the output is that format's bytes.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "tessera/quantize.h"

namespace tessera::quant {

// Formats GPTQ can write: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K.
bool gptq_supports(GgmlType type);
std::string gptq_type_names();

// The factor GPTQ updates with: U upper triangular (cols x cols, row-major, float), with
// (H + damp)^-1 = U^T U, H taken in the column order `perm` (perm[position] = column).
struct GptqHessian {
  int64_t cols = 0;
  std::vector<int64_t> perm;
  std::vector<float> u;
  std::vector<float> importance;  // diag(H) per column (original order): the block quantizer's weights
  std::vector<uint8_t> dead;      // columns no calibration activation reached (weights zeroed)
};

// Damps H (damp x its mean diagonal), orders it (act_order: whole `group`-column blocks by
// decreasing sum of diag(H), and columns within a block likewise), and factors it in double
// precision. Throws std::runtime_error naming `what` if H is not positive definite even after
// raising the damping a hundredfold.
GptqHessian gptq_prepare(const std::vector<double>& xtx, int64_t cols, int64_t group,
                         const GptqOptions& options, const std::string& what);

// One weight (rows x cols floats, row-major) into `type` (rows of ggml_row_size(type, cols)
// bytes). Rows are independent and split over `threads` threads.
std::vector<uint8_t> gptq_quantize(GgmlType type, const float* w, int64_t rows, int64_t cols,
                                   const GptqHessian& hessian, const GptqOptions& options,
                                   int threads);

// The format's group size GPTQ uses for `type` (its scale block): 32, or 256 for Q4_K.
int64_t gptq_group_size(GgmlType type);

}  // namespace tessera::quant
