// Model quantization (`tessera quantize`): rewrites a GGUF model with its weights in another
// GGML block type, choosing each tensor's type by llama-quantize's rules, and writes the file
// atomically. Weights of any readable type (F32, F16, BF16 or an already quantized type) are
// dequantized to f32 first, as llama-quantize --allow-requantize does.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "tessera/ggml_types.h"
#include "tessera/gguf.h"

namespace tessera::quant {

// Per weight tensor (by GGUF name), per column: the mean of the squared activations that
// multiply it (llama.cpp's imatrix). Stored as llama-imatrix's GGUF format: tensors
// "<name>.in_sum2" (sums of x^2, cols floats) and "<name>.counts" (the number of rows summed).
struct ImportanceMatrix {
  struct Entry {
    std::vector<double> sum_sq;  // per column
    int64_t count = 0;           // activation rows accumulated
  };
  std::map<std::string, Entry> entries;
  std::vector<std::string> datasets;  // calibration files it was collected on
  int64_t chunk_count = 0;
  int64_t chunk_size = 0;

  // Mean squared activation per column; empty when the tensor has no entry.
  std::vector<float> mean(const std::string& tensor) const;
  // Atomic write; throws GgufError naming the path on failure.
  void write(const std::string& path) const;
  // Reads a file written by write() or by llama-imatrix; throws GgufError naming the path.
  static ImportanceMatrix read(const std::string& path);
};

// Activation statistics of the distinct inputs of the weight matmuls, for the quantizers that
// model a layer's output error (gptq, awq). Weights that multiply the same activations (q/k/v
// after attn_norm, gate/up after ffn_norm) share one input, so one covariance serves the group.
struct InputStats {
  std::vector<std::string> weights;  // GGUF names of the weights fed by this input, in call order
  int64_t cols = 0;
  int64_t count = 0;                 // activation rows accumulated
  std::vector<double> sum_abs;       // per column: sum of |x| (AWQ's activation magnitude)
  std::vector<double> sum_sq;        // per column: sum of x^2 (the imatrix)
  std::vector<double> xtx;           // cols x cols, row-major, symmetric: sum of x x^T
};

struct CalibrationStats {
  std::vector<InputStats> inputs;
  std::map<std::string, size_t> input_of;  // weight name -> index into inputs
  const InputStats* find(const std::string& weight) const {
    auto it = input_of.find(weight);
    return it == input_of.end() ? nullptr : &inputs[it->second];
  }
};

// The target types `tessera quantize --type` accepts (and their llama.cpp general.file_type).
// Returns false for a name that is none of them.
bool parse_target_type(const std::string& name, GgmlType* type);
std::string target_type_names();  // "F32, F16, BF16, Q4_0, ..." for error messages
uint32_t llama_file_type(GgmlType target);

struct TensorPlan {
  std::string name;
  GgmlType from = GgmlType::F32;
  GgmlType to = GgmlType::F32;
  const char* why = "";  // one phrase: "target", "1-D: kept", "output: Q6_K", ...
};

// llama-quantize's choice for each tensor of `file` when the target is `target`:
//  - only tensors of 2 or more dims whose name ends in "weight" and has no "_norm." are
//    quantized (norms, biases, rope factors stay as they are);
//  - the output projection (or, when the model has none, the token embedding it is tied to)
//    becomes Q6_K, or Q8_0 when its rows are not a multiple of 256 or the target is Q8_0 —
//    unless `pure`, when it gets the target like every other weight (and float targets never
//    change it);
//  - with an importance matrix and a Q4_0 / Q5_0 target, the ffn_down weights of layers
//    below block_count / 8 become Q4_1 / Q5_1 (not when `pure`);
//  - a row length the target's block does not divide falls back: Q4_K -> Q5_0, Q6_K -> Q8_0;
//    where even that does not fit (llama.cpp: F16) it throws std::invalid_argument naming the
//    tensor, its row length and the block size.
std::vector<TensorPlan> plan_tensors(const gguf::GgufFile& file, GgmlType target, bool pure,
                                     bool with_importance = false);

enum class QuantMethod { kRtn, kImportance, kGptq, kAwq };

struct GptqOptions {
  double damp = 0.01;      // added to H's diagonal, as a fraction of its mean diagonal
  int block_size = 128;    // lazy-update block (columns); raised to the format's group if larger
  bool act_order = false;  // columns (whole format blocks) in decreasing order of diag(H)
};

struct AwqOptions {
  int alpha_grid = 10;        // alpha searched over {0, 1/n, ..., 1}
  float fixed_alpha = -1.0f;  // >= 0: no search, this alpha everywhere
  bool clip = true;           // search a clipping ratio per row and 32-column block
  int search_rows = 32;       // rows per weight the alpha search evaluates (evenly spaced)
};

struct QuantizeOptions {
  std::string input;
  std::string output;
  GgmlType target = GgmlType::Q4_0;
  bool pure = false;
  QuantMethod method = QuantMethod::kRtn;
  // kImportance: the per-column weights; kGptq / kAwq: used for the tensors `stats` lacks a
  // covariance for (the tied output embedding). Null: round to nearest.
  const ImportanceMatrix* importance = nullptr;
  const CalibrationStats* stats = nullptr;  // kGptq / kAwq: required, with covariances
  GptqOptions gptq;
  AwqOptions awq;
  int threads = 1;
};

struct QuantizeResult {
  std::vector<TensorPlan> plan;
  size_t input_bytes = 0;   // file sizes
  size_t output_bytes = 0;
  int64_t weighted_tensors = 0;  // tensors quantized with an importance entry
  int64_t hessian_tensors = 0;   // tensors quantized by gptq / awq from their input covariance
};

// Quantizes options.input into options.output (written to a temporary file in the output's
// directory, fsync'ed and renamed: a failure leaves no output file). Progress: (tensors done,
// total). Throws GgufError / std::runtime_error naming the file, tensor or argument.
QuantizeResult quantize_model(const QuantizeOptions& options,
                              const std::function<void(size_t, size_t)>& progress = {});

// One tensor's data converted to `to` (rows of tensor.dims[0] elements), rows split over
// `threads` threads; `importance` null or dims[0] floats. Throws naming the tensor when the
// source type cannot be read or the target cannot be written.
std::vector<uint8_t> convert_tensor(const gguf::TensorInfo& tensor, GgmlType to,
                                    const float* importance, int threads);

}  // namespace tessera::quant
