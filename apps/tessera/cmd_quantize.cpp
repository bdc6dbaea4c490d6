// tessera quantize IN.gguf OUT.gguf --type T [--method rtn|importance] [--calibration FILE]
//
// Rewrites a GGUF model with its weights in another GGML block type (tessera/quantize.h has
// the tensor rules). --method importance first runs the model over a calibration text with
// Tessera's own forward pass, recording per weight and column the mean squared activation
// (llama-imatrix's statistics), and weights each element's error by it while searching block
// scales (ggml's quantize_row_*_impl); --imatrix reads such statistics from a file instead
// (ours or llama-imatrix's GGUF output), --save-imatrix writes them. --method gptq and awq
// record, on the same calibration run, the full covariance of each matmul's input
// (tessera/gptq.h, tessera/awq.h).
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "commands.h"
#include "stack_loader.h"
#include "tessera/calibration.h"
#include "tessera/config.h"
#include "tessera/gptq.h"
#include "tessera/model_runner.h"
#include "tessera/plugin_registry.h"
#include "tessera/quantize.h"
#include "tessera/stack.h"

namespace tessera::cli {
namespace {

struct QuantizeCliOptions {
  std::string input;
  std::string output;
  std::string type;
  std::string method = "rtn";
  std::string calibration;
  std::string imatrix;
  std::string save_imatrix;
  std::string config;  // stack that runs the calibration forward passes
  int ctx = 512;
  int chunks = 0;
  int threads = 0;
  bool pure = false;
  bool quiet = false;
  quant::GptqOptions gptq;
  quant::AwqOptions awq;
  bool awq_no_clip = false;
};

struct Calibration {
  quant::ImportanceMatrix imatrix;
  quant::CalibrationStats stats;  // with covariances, for gptq / awq
};

// Runs the input model over the calibration text in chunks of ctx tokens, each from an empty
// cache (as llama-imatrix does), through an ActivationRecorder around the stack's quantizer.
Calibration collect_calibration(const QuantizeCliOptions& opt, bool covariance) {
  const std::string text = read_text_file(opt.calibration, "--calibration");
  PluginRegistry registry;
  registry.scan_default_paths();
  StackConfig config = load_stack_config(opt.config.empty() ? default_config_path() : opt.config, registry);
  config.model.path = std::filesystem::absolute(opt.input).string();
  EngineComponents c = build_engine_components(config, registry);
  ActivationRecorder recorder(*c.quantizer, covariance);
  Model::ProgressFn progress;
  if (!opt.quiet) progress = [](size_t done, size_t total) { print_progress("loading model", done, total); };
  std::shared_ptr<Model> model = Model::load(config.model.path, recorder, progress);
  const ModelHparams& hp = model->hparams();
  if (opt.ctx < 8 || opt.ctx > hp.context_length)
    throw CommandError("--ctx " + std::to_string(opt.ctx) + ": between 8 and the model's context (" +
                       std::to_string(hp.context_length) + ")");
  KvLayout layout;
  const KvModelShape shape{hp.num_layers, hp.num_kv_heads, hp.head_dim, opt.ctx, 1};
  Status st = c.kv_cache->configure(shape, &layout);
  if (!st.is_ok()) throw CommandError(config.file + ": " + st.message());
  std::vector<int32_t> blocks((opt.ctx + layout.block_size - 1) / layout.block_size);
  std::iota(blocks.begin(), blocks.end(), 0);
  if (static_cast<int32_t>(blocks.size()) > layout.num_blocks)
    throw CommandError(config.file + ": the KV cache is too small for one chunk of --ctx tokens");
  ModelRunner runner(*model, *c.backend, recorder, *c.attention, layout, opt.ctx);

  const Tokenizer& tok = model->tokenizer();
  const std::vector<TokenId> all = tok.encode(text, /*add_special=*/true, /*parse_special=*/false);
  const int64_t available = static_cast<int64_t>(all.size()) / opt.ctx;
  if (available < 1)
    throw CommandError("--calibration '" + opt.calibration + "': " + std::to_string(all.size()) +
                       " tokens, shorter than one chunk of --ctx " + std::to_string(opt.ctx));
  const int64_t n_chunks = opt.chunks > 0 ? std::min<int64_t>(opt.chunks, available) : available;
  const bool add_bos = tok.add_bos() && tok.bos_id() >= 0;
  std::vector<float> logits;
  for (int64_t k = 0; k < n_chunks; ++k) {
    std::vector<TokenId> chunk(all.begin() + k * opt.ctx, all.begin() + (k + 1) * opt.ctx);
    if (add_bos) chunk[0] = tok.bos_id();
    const RunnerSequence seq{chunk.data(), opt.ctx, 0, blocks, 1};
    st = runner.forward({&seq, 1}, &logits);
    if (!st.is_ok()) throw CommandError("calibration forward: " + st.message());
    if (!opt.quiet) print_progress("calibration", static_cast<size_t>(k + 1), static_cast<size_t>(n_chunks));
  }
  Calibration cal;
  cal.imatrix = recorder.importance();
  cal.imatrix.datasets = {opt.calibration};
  cal.imatrix.chunk_count = n_chunks;
  cal.imatrix.chunk_size = opt.ctx;
  if (covariance) cal.stats = recorder.finish_stats();
  return cal;
}

void run_quantize(const QuantizeCliOptions& opt) {
  GgmlType target;
  if (!quant::parse_target_type(opt.type, &target))
    throw CommandError("--type '" + opt.type + "': not a target type; one of " + quant::target_type_names());
  quant::QuantMethod method;
  if (opt.method == "rtn") method = quant::QuantMethod::kRtn;
  else if (opt.method == "importance") method = quant::QuantMethod::kImportance;
  else if (opt.method == "gptq") method = quant::QuantMethod::kGptq;
  else if (opt.method == "awq") method = quant::QuantMethod::kAwq;
  else if (opt.method == "int8")
    throw CommandError("--method int8: W8A8 (per-row int8 weights, per-token int8 activations) is a "
                       "load-time layout, not a GGUF type llama.cpp could read: write the float model "
                       "(--type F32 or F16) and serve it with engine.quantizer: {plugin: int8}");
  else throw CommandError("--method '" + opt.method + "': one of rtn, importance, gptq, awq");
  const bool importance = method == quant::QuantMethod::kImportance;
  const bool hessian = method == quant::QuantMethod::kGptq || method == quant::QuantMethod::kAwq;
  if (importance && opt.calibration.empty() && opt.imatrix.empty())
    throw CommandError("--method importance needs --calibration FILE (or --imatrix FILE)");
  if (hessian && !opt.imatrix.empty())
    throw CommandError("--method " + opt.method + " needs --calibration FILE, not --imatrix: it uses the "
                       "full covariance of each weight's input, of which an imatrix holds only the diagonal");
  if (hessian && opt.calibration.empty())
    throw CommandError("--method " + opt.method + " needs --calibration FILE (text to collect activations on)");
  if (!importance && !hessian && (!opt.calibration.empty() || !opt.imatrix.empty()))
    throw CommandError("--calibration / --imatrix are for --method importance, gptq or awq");
  if (method == quant::QuantMethod::kGptq && !quant::gptq_supports(target))
    throw CommandError("--method gptq --type " + opt.type + ": gptq writes " + quant::gptq_type_names());
  std::error_code ec;
  if (!std::filesystem::is_regular_file(opt.input, ec))
    throw CommandError("IN '" + opt.input + "': no such file");
  const auto t0 = std::chrono::steady_clock::now();
  Calibration cal;
  if (!opt.imatrix.empty()) {
    if (!std::filesystem::is_regular_file(opt.imatrix, ec))
      throw CommandError("--imatrix '" + opt.imatrix + "': no such file");
    cal.imatrix = quant::ImportanceMatrix::read(opt.imatrix);
  } else if (importance || hessian) {
    cal = collect_calibration(opt, hessian);
  }
  if (!opt.save_imatrix.empty()) {
    if (!importance && !hessian) throw CommandError("--save-imatrix is for --method importance, gptq or awq");
    cal.imatrix.write(opt.save_imatrix);
  }
  quant::QuantizeOptions q;
  q.input = opt.input;
  q.output = opt.output;
  q.target = target;
  q.pure = opt.pure;
  q.method = method;
  q.importance = importance || hessian ? &cal.imatrix : nullptr;
  q.stats = hessian ? &cal.stats : nullptr;
  q.gptq = opt.gptq;
  q.awq = opt.awq;
  q.awq.clip = !opt.awq_no_clip;
  q.threads = opt.threads > 0 ? opt.threads : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  std::function<void(size_t, size_t)> progress;
  if (!opt.quiet) progress = [](size_t done, size_t total) { print_progress("quantizing", done, total); };
  const quant::QuantizeResult r = quant::quantize_model(q, progress);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!opt.quiet) {
    std::map<std::string, int> per_type;
    for (const auto& p : r.plan) per_type[ggml_type_name(p.to)]++;
    std::string types;
    for (const auto& [name, n] : per_type) types += " " + name + "×" + std::to_string(n);
    std::fprintf(stderr, "\n%s -> %s: %.1f MiB -> %.1f MiB, tensors:%s%s, %.1f s\n", opt.input.c_str(),
                 opt.output.c_str(), r.input_bytes / 1048576.0, r.output_bytes / 1048576.0, types.c_str(),
                 importance || hessian
                     ? (", " + std::to_string(r.weighted_tensors) + " importance-weighted" +
                        (hessian ? ", " + std::to_string(r.hessian_tensors) + " by " + opt.method : std::string()))
                           .c_str()
                     : "",
                 secs);
  }
}

}  // namespace

void add_quantize_command(CLI::App& app) {
  auto opt = std::make_shared<QuantizeCliOptions>();
  CLI::App* cmd = app.add_subcommand(
      "quantize", "rewrite a GGUF model's weights in another GGML type (llama.cpp loads the result)");
  cmd->add_option("IN", opt->input, "input .gguf (F32, F16, BF16 or quantized weights)")->required();
  cmd->add_option("OUT", opt->output, "output .gguf (written atomically)")->required();
  cmd->add_option("-t,--type", opt->type, "target type: " + quant::target_type_names())->required();
  cmd->add_option("-m,--method", opt->method,
                  "rtn (round to nearest), importance (imatrix-weighted), gptq (Hessian error compensation) "
                  "or awq (activation-aware scales folded into the norms)")
      ->capture_default_str();
  auto* calibration = cmd->add_option("--calibration", opt->calibration,
                  "text to collect activation statistics on (--method importance, gptq, awq); never the evaluation text");
  cmd->add_option("--imatrix", opt->imatrix,
                  "read the statistics from an imatrix GGUF (ours or llama-imatrix's) instead of --calibration")
      ->excludes(calibration);
  cmd->add_option("--save-imatrix", opt->save_imatrix, "write the collected statistics (llama-imatrix's GGUF format)");
  cmd->add_option("-c,--config", opt->config, "stack that runs the calibration (default: configs/smollm2-cpu.yaml)");
  cmd->add_option("--ctx", opt->ctx, "calibration tokens per chunk")->capture_default_str();
  cmd->add_option("--chunks", opt->chunks, "use at most N calibration chunks (0: all)")
      ->capture_default_str()->check(CLI::NonNegativeNumber);
  cmd->add_option("--threads", opt->threads, "threads (0: all hardware threads)")
      ->capture_default_str()->check(CLI::NonNegativeNumber);
  cmd->add_option("--gptq-damp", opt->gptq.damp, "gptq: damping added to H's diagonal, a fraction of its mean")
      ->capture_default_str()->check(CLI::Range(0.0, 1.0));
  cmd->add_option("--gptq-block-size", opt->gptq.block_size, "gptq: columns per lazy update block")
      ->capture_default_str()->check(CLI::Range(1, 65536));
  cmd->add_flag("--act-order", opt->gptq.act_order,
                "gptq: quantize the format's blocks in decreasing order of activation energy");
  cmd->add_option("--awq-grid", opt->awq.alpha_grid, "awq: alpha searched over {0, 1/N, ..., 1}")
      ->capture_default_str()->check(CLI::Range(1, 100));
  cmd->add_option("--awq-alpha", opt->awq.fixed_alpha, "awq: use this alpha everywhere instead of searching")
      ->check(CLI::Range(0.0, 1.0));
  cmd->add_option("--awq-search-rows", opt->awq.search_rows, "awq: rows per weight the alpha search evaluates")
      ->capture_default_str()->check(CLI::Range(1, 1 << 20));
  cmd->add_flag("--awq-no-clip", opt->awq_no_clip, "awq: no clipping search");
  cmd->add_flag("--pure", opt->pure, "the output/tied embedding gets the target type too (llama-quantize --pure)");
  cmd->add_flag("-q,--quiet", opt->quiet, "no progress output");
  cmd->callback([opt] { run_quantize(*opt); });
}

}  // namespace tessera::cli
