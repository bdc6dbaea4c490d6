// `tessera quantize`: tensor type selection (llama-quantize's rules), conversion of each
// tensor over a thread pool, metadata copy and the atomic write.
#include "tessera/quantize.h"

#include <algorithm>
#include <array>
#include <cctype>
#include <cmath>
#include <filesystem>
#include <stdexcept>

#include "tessera/awq.h"
#include "tessera/gptq.h"
#include "tessera/thread_pool.h"

namespace tessera::quant {

namespace {

struct TargetName {
  const char* name;
  GgmlType type;
  uint32_t file_type;  // llama.cpp's llama_ftype
};

// LLAMA_FTYPE_ALL_F32 = 0, MOSTLY_F16 = 1, Q4_0 = 2, Q4_1 = 3, Q8_0 = 7, Q5_0 = 8, Q5_1 = 9,
// Q4_K_S = 14 (the closest name for all-Q4_K weights), Q5_K_S = 16 (likewise), Q6_K = 18,
// BF16 = 32.
constexpr std::array<TargetName, 11> kTargets = {{
    {"F32", GgmlType::F32, 0},   {"F16", GgmlType::F16, 1},   {"BF16", GgmlType::BF16, 32},
    {"Q4_0", GgmlType::Q4_0, 2}, {"Q4_1", GgmlType::Q4_1, 3}, {"Q5_0", GgmlType::Q5_0, 8},
    {"Q5_1", GgmlType::Q5_1, 9}, {"Q8_0", GgmlType::Q8_0, 7}, {"Q4_K", GgmlType::Q4_K, 14},
    {"Q5_K", GgmlType::Q5_K, 16}, {"Q6_K", GgmlType::Q6_K, 18},
}};

bool is_float_type(GgmlType t) {
  return t == GgmlType::F32 || t == GgmlType::F16 || t == GgmlType::BF16;
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// tensor_type_fallback: the type to use when `cols` is not a multiple of t's block. Where
// llama.cpp would fall back to F16 (no 32-element block fits either), this is an error
// instead: a file with silently unquantized weights is not what --type asked for.
GgmlType fallback(const std::string& name, GgmlType t, int64_t cols, const char** why) {
  const int64_t block = ggml_type_traits(t).block_size;
  if (cols % block == 0) return t;
  GgmlType f = t;
  if (t == GgmlType::Q4_K) f = GgmlType::Q5_0;
  if (t == GgmlType::Q5_K) f = GgmlType::Q5_1;
  if (t == GgmlType::Q6_K) f = GgmlType::Q8_0;
  if (cols % ggml_type_traits(f).block_size != 0)
    throw std::invalid_argument("tensor '" + name + "': row length " + std::to_string(cols) +
                                " is not a multiple of the " + ggml_type_name(t) + " block size " +
                                std::to_string(block) +
                                (f != t ? std::string(" nor of its fallback ") + ggml_type_name(f) + "'s " +
                                              std::to_string(ggml_type_traits(f).block_size)
                                        : std::string()));
  *why = "row length not a multiple of the block: fallback";
  return f;
}

}  // namespace

bool parse_target_type(const std::string& name, GgmlType* type) {
  std::string upper = name;
  for (char& c : upper) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  for (const TargetName& t : kTargets) {
    if (upper == t.name) {
      *type = t.type;
      return true;
    }
  }
  return false;
}

std::string target_type_names() {
  std::string s;
  for (const TargetName& t : kTargets) s += (s.empty() ? "" : ", ") + std::string(t.name);
  return s;
}

uint32_t llama_file_type(GgmlType target) {
  for (const TargetName& t : kTargets)
    if (t.type == target) return t.file_type;
  throw std::invalid_argument(std::string("no llama.cpp file type for ") + ggml_type_name(target));
}

std::vector<TensorPlan> plan_tensors(const gguf::GgufFile& file, GgmlType target, bool pure,
                                     bool with_importance) {
  const bool has_output = file.find_tensor("output.weight") != nullptr;
  const std::string arch = file.opt_string("general.architecture").value_or("");
  const int64_t num_layers = static_cast<int64_t>(file.opt_uint(arch + ".block_count").value_or(0));
  // The layer of "blk.N.<name>" (-1 for other names). llama-quantize counts ffn_down weights
  // in layer order whatever the file's order (SmolLM2's file lists blk.10 before blk.2).
  auto layer_of = [](const std::string& name) -> int64_t {
    if (name.rfind("blk.", 0) != 0) return -1;
    size_t end = 4;
    while (end < name.size() && std::isdigit(static_cast<unsigned char>(name[end]))) ++end;
    return end > 4 ? std::stoll(name.substr(4, end - 4)) : -1;
  };
  std::vector<TensorPlan> plan;
  for (const gguf::TensorInfo& t : file.tensors()) {
    TensorPlan p{t.name, t.type, t.type, "kept: not a 2-D weight"};
    const bool quantizable = t.dims.size() >= 2 && ends_with(t.name, "weight") &&
                             t.name.find("_norm.weight") == std::string::npos;
    if (quantizable) {
      p.to = target;
      p.why = "target";
      const bool is_output = t.name == "output.weight" || (!has_output && t.name == "token_embd.weight");
      if (is_output && !pure && !is_float_type(target)) {
        // llama_tensor_get_type_impl's rule for the output tensor.
        if (t.dims[0] % ggml_type_traits(target).block_size != 0 || t.dims[0] % 256 != 0) {
          p.to = GgmlType::Q8_0;
          p.why = "output: Q8_0 (rows not a multiple of 256)";
        } else if (target != GgmlType::Q8_0) {
          p.to = GgmlType::Q6_K;
          p.why = "output: Q6_K";
        }
      }
      // With an importance matrix, llama.cpp keeps the first eighth of the ffn_down weights
      // out of Q4_0 / Q5_0 ("craziness in the first few ffn_down layers"): Q4_1 / Q5_1.
      if (!pure && with_importance && (target == GgmlType::Q4_0 || target == GgmlType::Q5_0) &&
          ends_with(t.name, "ffn_down.weight") && layer_of(t.name) >= 0 &&
          layer_of(t.name) < num_layers / 8) {
        p.to = target == GgmlType::Q4_0 ? GgmlType::Q4_1 : GgmlType::Q5_1;
        p.why = "ffn_down of the first eighth of the layers, with importance: Q4_1 / Q5_1";
      }
      if (!is_float_type(p.to)) p.to = fallback(t.name, p.to, t.dims[0], &p.why);
    }
    plan.push_back(p);
  }
  return plan;
}

std::vector<uint8_t> convert_tensor(const gguf::TensorInfo& tensor, GgmlType to,
                                    const float* importance, int threads) {
  const int64_t cols = tensor.dims[0];
  const int64_t rows = tensor.num_rows();
  const GgmlTypeTraits to_traits = ggml_type_traits(to);
  if (!to_traits.is_known || cols % to_traits.block_size != 0)
    throw std::runtime_error("tensor '" + tensor.name + "': row length " + std::to_string(cols) +
                             " is not a multiple of the " + ggml_type_name(to) + " block size " +
                             std::to_string(to_traits.block_size));
  const size_t src_row = ggml_row_size(tensor.type, cols);
  const size_t dst_row = ggml_row_size(to, cols);
  std::vector<uint8_t> out(dst_row * static_cast<size_t>(rows));
  if (to == tensor.type && importance == nullptr) {
    std::copy(tensor.data, tensor.data + out.size(), out.begin());
    return out;
  }
  // Probe once so an unsupported pair is one clear error, not a failure inside a worker.
  std::vector<float> probe(static_cast<size_t>(cols));
  if (!dequantize_row(tensor.type, tensor.data, probe.data(), cols))
    throw std::runtime_error("tensor '" + tensor.name + "': cannot read its type " +
                             ggml_type_name(tensor.type));
  if (!quantize_weight_row(to, probe.data(), out.data(), cols, importance))
    throw std::runtime_error("tensor '" + tensor.name + "': cannot write type " + ggml_type_name(to));
  ThreadPool pool(std::max(1, std::min<int>(threads, static_cast<int>(rows))));
  pool.run(rows, [&](int64_t begin, int64_t end, int) {
    std::vector<float> f(static_cast<size_t>(cols));
    for (int64_t r = begin; r < end; ++r) {
      dequantize_row(tensor.type, tensor.data + r * src_row, f.data(), cols);
      quantize_weight_row(to, f.data(), out.data() + r * dst_row, cols, importance);
    }
  });
  return out;
}

namespace {

// A float matrix (rows of `cols`) into `to`, rows over `threads` threads.
std::vector<uint8_t> encode_floats(const std::vector<float>& f, int64_t cols, GgmlType to,
                                   const float* importance, int threads) {
  const int64_t rows = static_cast<int64_t>(f.size()) / cols;
  const size_t dst_row = ggml_row_size(to, cols);
  std::vector<uint8_t> out(dst_row * static_cast<size_t>(rows));
  ThreadPool pool(std::max(1, std::min<int>(threads, static_cast<int>(rows))));
  pool.run(rows, [&](int64_t begin, int64_t end, int) {
    for (int64_t r = begin; r < end; ++r)
      quantize_weight_row(to, f.data() + r * cols, out.data() + r * dst_row, cols, importance);
  });
  return out;
}

std::vector<float> dequantize_tensor(const gguf::TensorInfo& t) {
  const int64_t cols = t.dims[0];
  const size_t row_bytes = ggml_row_size(t.type, cols);
  std::vector<float> f(static_cast<size_t>(cols * t.num_rows()));
  for (int64_t r = 0; r < t.num_rows(); ++r) dequantize_row(t.type, t.data + r * row_bytes, f.data() + r * cols, cols);
  return f;
}

// The weights gptq / awq quantize from their input covariance: the transformer blocks' linear
// weights (the tied output embedding is also a lookup table, so it keeps the imatrix path).
const InputStats* covariance_of(const QuantizeOptions& o, const std::string& name) {
  if (o.stats == nullptr || name.rfind("blk.", 0) != 0) return nullptr;
  const InputStats* in = o.stats->find(name);
  return in != nullptr && !in->xtx.empty() && in->count > 0 ? in : nullptr;
}

}  // namespace

QuantizeResult quantize_model(const QuantizeOptions& options,
                              const std::function<void(size_t, size_t)>& progress) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (fs::exists(options.output, ec) && fs::equivalent(options.input, options.output, ec))
    throw std::invalid_argument("OUT (" + options.output + ") is the input file; write to another path");
  auto file = gguf::GgufFile::open(options.input);
  QuantizeResult result;
  result.input_bytes = file->file_size();
  const bool hessian_method = options.method == QuantMethod::kGptq || options.method == QuantMethod::kAwq;
  if (hessian_method && options.stats == nullptr)
    throw std::invalid_argument("--method gptq / awq needs calibration statistics with covariances");
  result.plan = plan_tensors(*file, options.target, options.pure,
                             options.importance != nullptr || hessian_method);

  // Every conversion is checked before any work, so a bad input is one error up front.
  std::vector<float> probe;
  for (size_t i = 0; i < result.plan.size(); ++i) {
    const TensorPlan& p = result.plan[i];
    if (p.to == p.from) continue;
    const gguf::TensorInfo& t = file->tensors()[i];
    probe.resize(static_cast<size_t>(t.dims[0]));
    std::vector<uint8_t> row(ggml_row_size(p.to, t.dims[0]));
    if (!dequantize_row(t.type, t.data, probe.data(), t.dims[0]))
      throw std::runtime_error(options.input + ": tensor '" + t.name + "' is of type " +
                               ggml_type_name(t.type) + ", which tessera quantize cannot read " +
                               "(readable: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K)");
    if (!quantize_weight_row(p.to, probe.data(), row.data(), t.dims[0], nullptr))
      throw std::runtime_error("tensor '" + t.name + "': cannot write type " + ggml_type_name(p.to));
  }

  // GPTQ's factored Hessians, one per (input, group size), computed in parallel up front.
  std::map<std::pair<const InputStats*, int64_t>, GptqHessian> hessians;
  if (options.method == QuantMethod::kGptq) {
    for (size_t i = 0; i < result.plan.size(); ++i) {
      const TensorPlan& p = result.plan[i];
      const InputStats* in = p.to == p.from ? nullptr : covariance_of(options, p.name);
      if (in == nullptr) continue;
      if (!gptq_supports(p.to))
        throw std::invalid_argument("--method gptq writes " + gptq_type_names() + "; tensor '" + p.name +
                                    "' would be " + ggml_type_name(p.to));
      hessians[{in, gptq_group_size(p.to)}];
    }
    std::vector<std::pair<const InputStats*, int64_t>> keys;
    for (const auto& [k, v] : hessians) keys.push_back(k);
    ThreadPool pool(std::max(1, std::min<int>(options.threads, static_cast<int>(keys.size()))));
    pool.run(static_cast<int64_t>(keys.size()), [&](int64_t begin, int64_t end, int) {
      for (int64_t k = begin; k < end; ++k)
        hessians[keys[k]] = gptq_prepare(keys[k].first->xtx, keys[k].first->cols, keys[k].second,
                                         options.gptq, "input of '" + keys[k].first->weights.front() + "'");
    });
  }
  AwqFold fold;
  if (options.method == QuantMethod::kAwq)
    fold = awq_search(*file, result.plan, *options.stats, options.awq, options.threads);

  gguf::GgufWriter writer;
  writer.set_alignment(file->alignment());
  for (const auto& [key, value] : file->metadata()) {
    if (key == "general.file_type" || key == "general.quantization_version") continue;
    writer.add_value(key, value);
  }
  writer.add_uint32("general.quantization_version", 2);  // GGML_QNT_VERSION
  writer.add_uint32("general.file_type", llama_file_type(options.target));

  const auto& tensors = file->tensors();
  for (size_t i = 0; i < tensors.size(); ++i) {
    const gguf::TensorInfo& t = tensors[i];
    const TensorPlan& p = result.plan[i];
    std::vector<float> importance;
    if (options.importance != nullptr && p.to != p.from) {
      importance = options.importance->mean(t.name);
      if (!importance.empty() && static_cast<int64_t>(importance.size()) != t.dims[0])
        throw std::runtime_error("importance matrix entry '" + t.name + "' has " +
                                 std::to_string(importance.size()) + " columns, the tensor " +
                                 std::to_string(t.dims[0]));
      if (!importance.empty()) ++result.weighted_tensors;
    }
    const auto folded = fold.tensors.find(t.name);
    const InputStats* in = p.to == p.from ? nullptr : covariance_of(options, t.name);
    std::vector<uint8_t> data;
    if (in != nullptr && hessian_method) {
      const std::vector<float> f = folded != fold.tensors.end() ? folded->second : dequantize_tensor(t);
      if (options.method == QuantMethod::kGptq) {
        data = gptq_quantize(p.to, f.data(), t.num_rows(), t.dims[0], hessians.at({in, gptq_group_size(p.to)}),
                             options.gptq, options.threads);
      } else {
        const auto s = fold.input_scale.find(t.name);
        data = awq_quantize_tensor(p.to, f.data(), t.num_rows(), t.dims[0], *in,
                                   s == fold.input_scale.end() ? std::vector<float>{} : s->second, options.awq,
                                   options.threads);
      }
      ++result.hessian_tensors;
    } else if (folded != fold.tensors.end()) {  // a folded norm weight or bias
      data = encode_floats(folded->second, t.dims[0], p.to, nullptr, options.threads);
    } else if (p.to == p.from) {
      data.assign(t.data, t.data + t.num_bytes);
    } else {
      data = convert_tensor(t, p.to, importance.empty() ? nullptr : importance.data(), options.threads);
    }
    writer.add_tensor(t.name, t.dims, p.to, std::move(data));
    if (progress) progress(i + 1, tensors.size());
  }
  writer.write(options.output);
  result.output_bytes = static_cast<size_t>(fs::file_size(options.output));
  return result;
}

// ---- importance matrix (llama-imatrix's GGUF format) -----------------------------------------

std::vector<float> ImportanceMatrix::mean(const std::string& tensor) const {
  auto it = entries.find(tensor);
  if (it == entries.end() || it->second.count == 0) return {};
  std::vector<float> m(it->second.sum_sq.size());
  for (size_t c = 0; c < m.size(); ++c)
    m[c] = static_cast<float>(it->second.sum_sq[c] / static_cast<double>(it->second.count));
  return m;
}

void ImportanceMatrix::write(const std::string& path) const {
  gguf::GgufWriter w;
  w.add_string("general.type", "imatrix");
  w.add_string_array("imatrix.datasets", datasets);
  w.add_uint32("imatrix.chunk_count", static_cast<uint32_t>(chunk_count));
  w.add_uint32("imatrix.chunk_size", static_cast<uint32_t>(chunk_size));
  for (const auto& [name, e] : entries) {
    std::vector<float> sums(e.sum_sq.begin(), e.sum_sq.end());
    const auto cols = static_cast<int64_t>(sums.size());
    w.add_tensor_f32(name + ".in_sum2", {cols, 1}, GgmlType::F32, sums);
    w.add_tensor_f32(name + ".counts", {1, 1}, GgmlType::F32, {static_cast<float>(e.count)});
  }
  w.write(path);
}

ImportanceMatrix ImportanceMatrix::read(const std::string& path) {
  auto file = gguf::GgufFile::open(path);
  ImportanceMatrix m;
  if (const auto* d = file->opt_string_array("imatrix.datasets")) m.datasets = *d;
  m.chunk_count = static_cast<int64_t>(file->opt_uint("imatrix.chunk_count").value_or(0));
  m.chunk_size = static_cast<int64_t>(file->opt_uint("imatrix.chunk_size").value_or(0));
  const std::string sums_suffix = ".in_sum2";
  for (const gguf::TensorInfo& t : file->tensors()) {
    if (!ends_with(t.name, sums_suffix)) continue;
    const std::string name = t.name.substr(0, t.name.size() - sums_suffix.size());
    const gguf::TensorInfo* counts = file->find_tensor(name + ".counts");
    if (counts == nullptr || t.type != GgmlType::F32 || counts->type != GgmlType::F32)
      throw gguf::GgufError(path + ": imatrix entry '" + name +
                            "' needs F32 tensors .in_sum2 and .counts");
    if (counts->num_elements() != 1)
      throw gguf::GgufError(path + ": imatrix entry '" + name +
                            "' has several matrices (experts); not supported");
    Entry e;
    const auto* sums = reinterpret_cast<const float*>(t.data);
    e.sum_sq.assign(sums, sums + t.num_elements());
    e.count = std::lround(*reinterpret_cast<const float*>(counts->data));
    m.entries[name] = std::move(e);
  }
  if (m.entries.empty()) throw gguf::GgufError(path + ": no imatrix entries (<name>.in_sum2 tensors)");
  return m;
}

}  // namespace tessera::quant
