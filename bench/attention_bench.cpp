// bench_attention: time and scratch memory of every attention plugin (naive, flash, ...) at
// 2048 tokens of context, for a whole 2048-token prefill and for one decode query, on a
// SmolLM2-135M-shaped layer (9 query heads, 3 KV heads, head_dim 64, f16 paged cache).
//
//   bench_attention [--threads N] [--context N] [--repeat N] [--batch N] [--plugin NAME]
//                   [--params YAML] [--decode-only] [--decode-queries N] [--dtype f16|f32|q8_0]
//                   [--plugin-dir DIR]
//
// --dtype stores K and V of the cache in that type (default f16; q8_0: ggml Q8_0 blocks, as
// kv_cache dtype: q8_0 stores them).
//
// --batch N times the decode case as N sequences of `context` tokens each with one query (a
// serving step of N concurrent clients); the prefill case stays one sequence. --plugin NAME
// times only that plugin (no naive oracle, so no max |diff|), with --params its parameters
// (e.g. '{tile_size: 32}'); --decode-only skips prefill.
// --decode-queries N gives each decode sequence N queries, the last N positions of its context
// (a speculative verification step: the next token and N - 1 drafts).
//
// Each row gives the median wall time and the median process CPU time of the calls (on a
// shared machine other jobs preempt this one: CPU time leaves their turns out).
//
// Plugins are loaded from the build's plugin folder (or --plugin-dir / TESSERA_PLUGIN_DIR).
#include <algorithm>
#include <chrono>
#include <ctime>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "tessera/config.h"
#include "tessera/cpu_kernels.h"
#include "tessera/ggml_types.h"
#include "tessera/plugin_registry.h"
#include "tessera/sdk/attention.h"
#include "tessera/sdk/kv_cache.h"
#include "tessera/thread_pool.h"

#ifndef TESSERA_BENCH_PLUGIN_DIR
#define TESSERA_BENCH_PLUGIN_DIR "build/plugins"
#endif

namespace {

using namespace tessera;

struct Options {
  int threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  int context = 2048;
  int repeat = 3;
  int batch = 1;
  int decode_queries = 1;
  bool decode_only = false;
  KvDtype dtype = KvDtype::kF16;
  std::string only;
  std::string params = "{}";
  std::string plugin_dir;
};

Options parse_args(int argc, char** argv) {
  Options o;
  const char* env = std::getenv("TESSERA_PLUGIN_DIR");
  o.plugin_dir = env && *env ? env : TESSERA_BENCH_PLUGIN_DIR;
  for (int i = 1; i < argc; ++i) {
    auto value = [&](const char* flag) -> const char* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", flag);
        std::exit(2);
      }
      return argv[++i];
    };
    if (!std::strcmp(argv[i], "--threads")) o.threads = std::atoi(value("--threads"));
    else if (!std::strcmp(argv[i], "--context")) o.context = std::atoi(value("--context"));
    else if (!std::strcmp(argv[i], "--repeat")) o.repeat = std::atoi(value("--repeat"));
    else if (!std::strcmp(argv[i], "--batch")) o.batch = std::atoi(value("--batch"));
    else if (!std::strcmp(argv[i], "--plugin")) o.only = value("--plugin");
    else if (!std::strcmp(argv[i], "--params")) o.params = value("--params");
    else if (!std::strcmp(argv[i], "--decode-only")) o.decode_only = true;
    else if (!std::strcmp(argv[i], "--decode-queries")) o.decode_queries = std::atoi(value("--decode-queries"));
    else if (!std::strcmp(argv[i], "--dtype")) {
      const std::string name = value("--dtype");
      if (!parse_kv_dtype(name, &o.dtype)) {
        std::fprintf(stderr, "--dtype: f16, f32 or q8_0, got '%s'\n", name.c_str());
        std::exit(2);
      }
    }
    else if (!std::strcmp(argv[i], "--plugin-dir")) o.plugin_dir = value("--plugin-dir");
    else {
      std::fprintf(stderr,
                   "usage: %s [--threads N] [--context N] [--repeat N] [--batch N] "
                   "[--plugin NAME [--params YAML]] [--decode-only] [--decode-queries N] [--dtype f16|f32|q8_0] "
                   "[--plugin-dir DIR]\n",
                   argv[0]);
      std::exit(2);
    }
  }
  o.threads = std::max(1, o.threads);
  o.context = std::max(1, o.context);
  o.repeat = std::max(1, o.repeat);
  o.batch = std::max(1, o.batch);
  o.decode_queries = std::clamp(o.decode_queries, 1, o.context);
  return o;
}

// One layer's K/V pool holding `batch` sequences of `context` tokens in shuffled blocks;
// sequence i's block table starts at table[i * blocks_per_seq].
struct Pool {
  AttentionShape shape;
  std::vector<uint8_t> k, v;  // rows stored as shape.k_dtype / v_dtype
  std::vector<int32_t> table;
  int blocks_per_seq = 0;
};

Pool make_pool(int context, int batch, KvDtype dtype, std::mt19937& rng) {
  Pool p;
  p.shape = {9, 3, 64, 0.125f, 16, dtype, dtype};
  p.blocks_per_seq = (context + p.shape.block_size - 1) / p.shape.block_size;
  const int num_blocks = p.blocks_per_seq * batch;
  p.table.resize(num_blocks);
  std::iota(p.table.begin(), p.table.end(), 0);
  std::shuffle(p.table.begin(), p.table.end(), rng);
  const size_t n = static_cast<size_t>(num_blocks) * p.shape.block_size * p.shape.num_kv_heads *
                   p.shape.head_dim;
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  const int64_t d = p.shape.head_dim;
  const size_t row_bytes = kv_row_bytes(dtype, d);
  std::vector<float> row(d);
  for (auto* pool : {&p.k, &p.v}) {
    pool->resize(n / d * row_bytes);
    for (size_t r = 0; r < n / d; ++r) {
      for (float& x : row) x = unit(rng);
      uint8_t* dst = pool->data() + r * row_bytes;
      if (dtype == KvDtype::kF32) std::memcpy(dst, row.data(), row_bytes);
      else if (dtype == KvDtype::kF16) fp32_to_fp16_row(row.data(), reinterpret_cast<uint16_t*>(dst), d);
      else quantize_activation_row(GgmlType::Q8_0, row.data(), dst, d);
    }
  }
  return p;
}

// Median wall time of `repeat` forward calls, in milliseconds, after one warm-up call that
// also sizes the kernel's scratch. A warm-up slower than a second is the measurement (the
// naive prefill takes tens of seconds; scratch sizing is noise next to that).
// `num_seqs` sequences of `num_queries` queries each (the last ones of `context` tokens).
// *cpu_ms: the median process CPU time (all threads) of the same calls — on a shared machine
// whose other jobs preempt this one, wall time includes their turns, CPU time does not.
double time_forward(AttentionKernel& kernel, const Pool& pool, int num_seqs, int num_queries,
                    int context, Executor& executor, int repeat, std::vector<float>* out,
                    double* cpu_ms) {
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  std::vector<float> q(static_cast<size_t>(num_seqs) * num_queries * pool.shape.num_heads *
                       pool.shape.head_dim);
  for (float& x : q) x = 3.0f * unit(rng);
  out->assign(q.size(), 0.0f);
  std::vector<AttentionSequence> seqs;
  for (int i = 0; i < num_seqs; ++i)
    seqs.push_back({i * num_queries, num_queries, context,
                    pool.table.data() + static_cast<size_t>(i) * pool.blocks_per_seq});
  AttentionBatch batch;
  batch.sequences = seqs;
  batch.q = q.data();
  batch.k_pool = pool.k.data();
  batch.v_pool = pool.v.data();
  batch.out = out->data();
  std::vector<double> ms, cpu;
  const auto cpu_now = [] {
    timespec ts{};
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec * 1e-6;
  };
  for (int r = 0; r <= repeat; ++r) {
    const double cpu_start = cpu_now();
    const auto start = std::chrono::steady_clock::now();
    Status st = kernel.forward(pool.shape, batch, executor);
    const auto end = std::chrono::steady_clock::now();
    if (r > 0) cpu.push_back(cpu_now() - cpu_start);
    if (!st.is_ok()) {
      std::fprintf(stderr, "forward failed: %s\n", st.message().c_str());
      std::exit(1);
    }
    const double elapsed = std::chrono::duration<double, std::milli>(end - start).count();
    if (r > 0 || elapsed > 1000.0) ms.push_back(elapsed);
    if (r == 0 && elapsed > 1000.0) break;
  }
  std::sort(ms.begin(), ms.end());
  std::sort(cpu.begin(), cpu.end());
  *cpu_ms = cpu.empty() ? 0.0 : cpu[cpu.size() / 2];
  return ms[ms.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  const Options opt = parse_args(argc, argv);
  PluginRegistry registry;
  registry.scan_directory(opt.plugin_dir);
  for (const auto& e : registry.load_errors())
    std::fprintf(stderr, "warning: %s: %s\n", e.library_path.c_str(), e.message.c_str());
  const auto plugins = registry.list(PluginKind::kAttention);
  if (plugins.empty()) {
    std::fprintf(stderr, "no attention plugins in %s (build attention-naive, attention-flash)\n",
                 opt.plugin_dir.c_str());
    return 1;
  }

  std::mt19937 rng(1);
  const Pool pool = make_pool(opt.context, opt.batch, opt.dtype, rng);
  ThreadPool executor(opt.threads);
  PluginContext context;
  context.logger = &host_logger();
  std::printf("attention: %d heads, %d KV heads, head_dim %d, %s cache, block %d; context %d; "
              "%d threads; median of %d; decode batch %d\n",
              pool.shape.num_heads, pool.shape.num_kv_heads, pool.shape.head_dim, kv_dtype_name(opt.dtype),
              pool.shape.block_size, opt.context, opt.threads, opt.repeat, opt.batch);
  std::printf("%-10s %-8s %8s %12s %12s %16s %14s\n", "plugin", "case", "queries", "time ms", "cpu ms",
              "scratch B/thread", "max |diff|");

  // The naive kernel is the oracle: run it first, and report every other kernel's largest
  // difference from it.
  std::vector<const PluginInfo*> ordered(plugins.begin(), plugins.end());
  std::stable_partition(ordered.begin(), ordered.end(),
                        [](const PluginInfo* p) { return p->name() == "naive"; });
  std::vector<float> reference_prefill, reference_decode;
  for (const PluginInfo* info : ordered) {
    if (!opt.only.empty() && info->name() != opt.only) continue;
    const PluginConfig config = validate_plugin_params(*info->manifest, "engine.attention",
                                                       opt.only.empty() ? "{}" : opt.params);
    auto kernel = registry.create<AttentionKernel>(info->name(), config, context);
    for (const bool decode : {false, true}) {
      if (opt.decode_only && !decode) continue;
      const int num_queries = decode ? opt.decode_queries : opt.context;
      const int num_seqs = decode ? opt.batch : 1;
      std::vector<float> out;
      double cpu_ms = 0.0;
      const double ms = time_forward(*kernel, pool, num_seqs, num_queries, opt.context, executor,
                                     opt.repeat, &out, &cpu_ms);
      std::vector<float>& ref = decode ? reference_decode : reference_prefill;
      double diff = 0.0;
      if (ref.empty()) ref = out;
      else
        for (size_t i = 0; i < out.size(); ++i) diff = std::max(diff, double(std::abs(out[i] - ref[i])));
      std::printf("%-10s %-8s %8d %12.3f %12.3f %16zu %14.2e\n", info->name().c_str(),
                  decode ? "decode" : "prefill", num_queries * num_seqs, ms, cpu_ms,
                  kernel->scratch_bytes(pool.shape, num_queries, opt.context), diff);
    }
  }
  return 0;
}
