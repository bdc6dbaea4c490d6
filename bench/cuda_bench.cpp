// bench_cuda: the CUDA runner on synthetic Llama-3-8B-shaped weights in bf16 (random, made on
// the device: a 16 GB file cannot travel to the GPU machine).
//
// Measures, and writes as JSON (--out):
//   - HBM read bandwidth (a streaming read kernel over 4 GiB) and the batch-1 decode roofline
//     (tokens/s if every step only streamed the weights at that bandwidth);
//   - batch-1 decode tokens/s and its fraction of the measured and of the nominal (4.8 TB/s)
//     roofline;
//   - decode throughput at batch 64 and 256 (decode only, and end to end with the prefill);
//   - prefill tokens/s of one 2048-token prompt;
//   - a batch sweep: step time per batch size, and the batch at which decode becomes
//     compute-bound (the first batch whose step takes >= 2x the batch-1 step, i.e. weight
//     streaming no longer dominates), beside the roofline ridge point (peak bf16 FLOP/s over
//     bandwidth).
// Decode steps sample on the device (greedy) and use CUDA graphs, like a serving decode loop.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "cuda_runner.h"
#include "tessera/sdk/kernels/cuda.h"

namespace tc = tessera::cuda;

namespace {

struct Args {
  std::string out = "bench_cuda.json";
  int layers = 32;
  int prompt = 128;
  int steps = 32;
  int prefill_len = 2048;
  std::vector<int> sweep = {1, 2, 4, 8, 16, 32, 64, 128, 256, 384, 512};
  double peak_tflops = 989.0;  // H100/H200 SXM dense bf16
  double nominal_gbps = 4800.0;
  std::string dump;  // --dump DIR: only write kernel inputs/outputs for the PyTorch check
};

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

std::vector<int> parse_list(const std::string& s) {
  std::vector<int> v;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) v.push_back(std::atoi(item.c_str()));
  return v;
}

// Mean time of `fn` (enqueued on `stream`) over `reps` runs after a warm-up, by CUDA events.
template <class Fn>
double time_us(cudaStream_t stream, int reps, Fn fn) {
  fn();
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  cudaEventRecord(a, stream);
  for (int i = 0; i < reps; ++i) fn();
  cudaEventRecord(b, stream);
  tc::check(cudaEventSynchronize(b), "micro timing");
  float ms = 0;
  cudaEventElapsedTime(&ms, a, b);
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return 1e3 * ms / reps;
}

double measure_bandwidth_gbps() {
  const size_t bytes = 4ull << 30;
  void* buf = nullptr;
  float* sink = nullptr;
  tc::check(cudaMalloc(&buf, bytes), "cudaMalloc (probe)");
  tc::check(cudaMalloc(reinterpret_cast<void**>(&sink), sizeof(float) * tc::kProbeBlocks), "cudaMalloc");
  tc::check(cudaMemset(buf, 1, bytes), "cudaMemset");
  const double us = time_us(nullptr, 10, [&] { tc::read_bandwidth_probe(buf, bytes, sink, nullptr); });
  cudaFree(buf);
  cudaFree(sink);
  return static_cast<double>(bytes) / (us * 1e-6) / 1e9;
}

// Sequences with their own block ranges in the pool.
struct Batch {
  std::vector<std::vector<int32_t>> tokens;
  std::vector<std::vector<int32_t>> tables;
  std::vector<int32_t> computed;
};

Batch make_batch(int n, int prompt, int max_len, int block_size, int vocab, uint32_t seed) {
  Batch b;
  const int blocks = (max_len + block_size - 1) / block_size;
  uint64_t x = seed;
  for (int i = 0; i < n; ++i) {
    std::vector<int32_t> t(prompt);
    for (auto& v : t) {
      x = x * 6364136223846793005ull + 1442695040888963407ull;
      v = static_cast<int32_t>((x >> 33) % static_cast<uint64_t>(vocab));
    }
    b.tokens.push_back(t);
    std::vector<int32_t> table(blocks);
    for (int k = 0; k < blocks; ++k) table[k] = i * blocks + k;
    b.tables.push_back(table);
    b.computed.push_back(0);
  }
  return b;
}

// Prefills every prompt in chunks of at most max_rows tokens (no logits except the last row
// of each prompt, sampled greedily and appended). Returns seconds.
double prefill(tc::CudaRunner& runner, Batch& b, int max_rows) {
  const double t0 = now();
  size_t i = 0;
  while (i < b.tokens.size()) {
    std::vector<tessera::ForwardSequence> seqs;
    std::vector<size_t> who;
    int rows = 0;
    while (i < b.tokens.size()) {
      const int left = static_cast<int>(b.tokens[i].size()) - b.computed[i];
      const int take = std::min(left, max_rows - rows);
      if (take <= 0) break;
      tessera::ForwardSequence s;
      s.tokens = b.tokens[i].data() + b.computed[i];
      s.num_tokens = take;
      s.start_position = b.computed[i];
      s.block_table = b.tables[i];
      s.num_logit_rows = take == left ? 1 : 0;
      seqs.push_back(s);
      who.push_back(i);
      rows += take;
      b.computed[i] += take;
      if (take == left) ++i;
      else break;
    }
    std::vector<tc::SampleParams> params;
    for (const auto& s : seqs)
      if (s.num_logit_rows) params.push_back({});
    std::vector<int32_t> out;
    const tessera::Status st = runner.forward_sample(seqs, params, &out);
    if (!st.is_ok()) throw std::runtime_error(st.message());
    size_t k = 0;
    for (size_t j = 0; j < seqs.size(); ++j)
      if (seqs[j].num_logit_rows) b.tokens[who[j]].push_back(out[k++]);
  }
  return now() - t0;
}

// `steps` greedy decode steps for all sequences together. Returns seconds (after one warm-up
// step that captures the graph).
double decode(tc::CudaRunner& runner, Batch& b, int steps) {
  std::vector<tessera::ForwardSequence> seqs(b.tokens.size());
  std::vector<tc::SampleParams> params(b.tokens.size());
  std::vector<int32_t> out;
  double t0 = 0;
  for (int step = 0; step <= steps; ++step) {
    if (step == 1) t0 = now();
    for (size_t i = 0; i < b.tokens.size(); ++i) {
      auto& s = seqs[i];
      const int32_t pos = static_cast<int32_t>(b.tokens[i].size()) - 1;
      s.tokens = b.tokens[i].data() + pos;
      s.num_tokens = 1;
      s.start_position = pos;
      s.block_table = b.tables[i];
      s.num_logit_rows = 1;
    }
    const tessera::Status st = runner.forward_sample(seqs, params, &out);
    if (!st.is_ok()) throw std::runtime_error(st.message());
    for (size_t i = 0; i < b.tokens.size(); ++i) b.tokens[i].push_back(out[i]);
  }
  return now() - t0;
}

// ---- --dump DIR: kernel inputs and outputs for tools/gpu/torch_kernel_check.py ----
struct Dumper {
  std::string dir;
  std::ostringstream meta;
  bool first = true;
  template <class T>
  void write(const std::string& name, const std::vector<T>& v, const char* dtype, std::vector<int64_t> shape) {
    std::ofstream f(dir + "/" + name + ".bin", std::ios::binary);
    f.write(reinterpret_cast<const char*>(v.data()), static_cast<std::streamsize>(sizeof(T) * v.size()));
    meta << (first ? "" : ",") << "\"" << name << "\":{\"dtype\":\"" << dtype << "\",\"shape\":[";
    for (size_t i = 0; i < shape.size(); ++i) meta << (i ? "," : "") << shape[i];
    meta << "]}";
    first = false;
  }
};

template <class T>
T* to_device(const std::vector<T>& v) {
  T* p = nullptr;
  tc::check(cudaMalloc(reinterpret_cast<void**>(&p), sizeof(T) * std::max<size_t>(v.size(), 1)), "cudaMalloc");
  tc::check(cudaMemcpy(p, v.data(), sizeof(T) * v.size(), cudaMemcpyHostToDevice), "upload");
  return p;
}
template <class T>
std::vector<T> to_host(const T* p, size_t n) {
  std::vector<T> v(n);
  tc::check(cudaDeviceSynchronize(), "sync");
  tc::check(cudaMemcpy(v.data(), p, sizeof(T) * n, cudaMemcpyDeviceToHost), "download");
  return v;
}

std::vector<float> randu(size_t n, uint64_t seed, float lo = -1, float hi = 1) {
  std::vector<float> v(n);
  uint64_t x = seed * 0x9e3779b97f4a7c15ull + 1;
  for (auto& f : v) {
    x ^= x << 13; x ^= x >> 7; x ^= x << 17;
    f = lo + (hi - lo) * static_cast<float>((x >> 40) & 0xFFFFFF) / 16777216.0f;
  }
  return v;
}

uint16_t f32_to_bf16_bits(float f) {  // round to nearest even
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

int dump_kernels(const std::string& dir) {
  Dumper d{dir, {}, true};
  // rms_norm
  {
    const int rows = 8, dim = 4096;
    auto x = randu(rows * dim, 1, -3, 3), w = randu(dim, 2, 0.5f, 1.5f);
    float *dx = to_device(x), *dw = to_device(w), *dy = to_device(std::vector<float>(rows * dim));
    tc::rms_norm(dy, dx, dw, rows, dim, 1e-5f, nullptr);
    d.write("rms_x", x, "f32", {rows, dim});
    d.write("rms_w", w, "f32", {dim});
    d.write("rms_out", to_host(dy, rows * dim), "f32", {rows, dim});
  }
  // rope, both styles
  {
    const int rows = 6, heads = 32, hd = 128;
    auto x = randu(rows * heads * hd, 3);
    std::vector<int32_t> pos = {0, 1, 100, 1000, 4095, 8000};
    int32_t* dp = to_device(pos);
    d.write("rope_x", x, "f32", {rows, heads, hd});
    d.write("rope_pos", pos, "i32", {rows});
    // The launcher's theta scale (same expression as tessera::cuda::rope and the CPU backend).
    d.write("rope_theta_scale", std::vector<float>{std::pow(500000.0f, -2.0f / static_cast<float>(hd))}, "f32", {1});
    for (int neox = 0; neox < 2; ++neox) {
      float* dx = to_device(x);
      tc::rope(dx, dp, rows, heads, hd, hd, 500000.0f, 1.0f, neox != 0, nullptr);
      d.write(neox ? "rope_neox_out" : "rope_pairs_out", to_host(dx, x.size()), "f32", {rows, heads, hd});
    }
  }
  // silu_mul
  {
    const int n = 14336 * 2;
    auto g = randu(n, 4, -8, 8), u = randu(n, 5, -2, 2);
    float *dg = to_device(g), *du = to_device(u);
    tc::silu_mul(dg, du, n, nullptr);
    d.write("silu_gate", g, "f32", {n});
    d.write("silu_up", u, "f32", {n});
    d.write("silu_out", to_host(dg, n), "f32", {n});
  }
  // bf16 GEMV (1, 3 and 8 tokens)
  {
    const int rows = 1024, cols = 4096;
    auto wf = randu(static_cast<size_t>(rows) * cols, 6);
    std::vector<uint16_t> wb(wf.size());
    for (size_t i = 0; i < wf.size(); ++i) wb[i] = f32_to_bf16_bits(wf[i]);
    uint16_t* dw = to_device(wb);
    d.write("gemv_w_bf16", wb, "bf16", {rows, cols});
    for (int nt : {1, 3, 8}) {
      auto x = randu(static_cast<size_t>(nt) * cols, 7 + nt);
      float *dx = to_device(x), *dy = to_device(std::vector<float>(static_cast<size_t>(nt) * rows));
      tc::gemv(tc::kBF16, dw, rows, cols, dx, nt, dy, nullptr);
      d.write("gemv_x" + std::to_string(nt), x, "f32", {nt, cols});
      d.write("gemv_y" + std::to_string(nt), to_host(dy, static_cast<size_t>(nt) * rows), "f32", {nt, rows});
    }
  }
  // attention over a paged f16 pool, Llama-3-8B heads: prefill chunk + decode rows
  {
    const int heads = 32, kvh = 8, hd = 128, bs = 16;
    const std::vector<std::pair<int, int>> seqs = {{100, 100}, {1, 700}, {17, 300}, {1, 33}};
    int rows = 0, blocks = 0;
    for (auto [nq, ctx] : seqs) { rows += nq; blocks += (ctx + bs - 1) / bs; }
    std::vector<int32_t> ids(blocks);
    for (int i = 0; i < blocks; ++i) ids[i] = (i * 7919) % blocks;  // a permutation (7919 prime)
    const size_t pool = static_cast<size_t>(blocks) * bs * kvh * hd;
    auto kf = randu(pool, 11), vf = randu(pool, 12), q = randu(static_cast<size_t>(rows) * heads * hd, 13);
    std::vector<uint16_t> kh(pool), vh(pool);
    float* conv = to_device(kf);
    uint16_t* dk = nullptr;
    uint16_t* dv = nullptr;
    tc::check(cudaMalloc(reinterpret_cast<void**>(&dk), 2 * pool), "cudaMalloc");
    tc::check(cudaMalloc(reinterpret_cast<void**>(&dv), 2 * pool), "cudaMalloc");
    tc::convert_f32(conv, dk, pool, false, nullptr);
    float* conv2 = to_device(vf);
    tc::convert_f32(conv2, dv, pool, false, nullptr);
    kh = to_host(dk, pool);
    vh = to_host(dv, pool);
    int32_t* dt = to_device(ids);
    float* dq = to_device(q);
    float* dout = to_device(std::vector<float>(q.size()));
    std::vector<tc::AttnSeq> hs;
    std::vector<int32_t> meta;  // (num_queries, context_len, first block index) per sequence
    int row = 0, blk = 0;
    for (auto [nq, ctx] : seqs) {
      hs.push_back({row, nq, ctx, 0, dt + blk});
      meta.insert(meta.end(), {nq, ctx, blk});
      row += nq;
      blk += (ctx + bs - 1) / bs;
    }
    const tc::AttnShape sh{heads, kvh, hd, 1.0f / std::sqrt(float(hd)), bs, true};
    std::vector<tc::AttnWork> work(tc::count_prefill_work(sh, hs.data(), hs.size()));
    tc::plan_prefill(sh, hs.data(), hs.size(), work.data());
    tc::AttnSeq* dseq = to_device(hs);
    tc::AttnWork* dwork = to_device(work);
    tc::attention_prefill(sh, dseq, dwork, work.size(), dq, dk, dv, dout, nullptr);
    d.write("attn_q", q, "f32", {rows, heads, hd});
    d.write("attn_k_pool", kh, "f16", {blocks, bs, kvh, hd});
    d.write("attn_v_pool", vh, "f16", {blocks, bs, kvh, hd});
    d.write("attn_block_ids", ids, "i32", {blocks});
    d.write("attn_seqs", meta, "i32", {static_cast<int64_t>(seqs.size()), 3});
    d.write("attn_prefill_out", to_host(dout, q.size()), "f32", {rows, heads, hd});
    // decode: the sequences with one query
    std::vector<tc::AttnSeq> dec;
    for (const auto& s : hs)
      if (s.num_queries == 1) dec.push_back(s);
    tc::AttnSeq* ddec = to_device(dec);
    float* dout2 = to_device(std::vector<float>(q.size()));
    void* scratch = nullptr;
    tc::check(cudaMalloc(&scratch, tc::decode_scratch_bytes(sh, dec.size(), 8)), "cudaMalloc");
    tc::attention_decode(sh, ddec, dec.size(), 8, dq, dk, dv, dout2, scratch, nullptr);
    d.write("attn_decode_out", to_host(dout2, q.size()), "f32", {rows, heads, hd});
  }
  // greedy sampling
  {
    const int rows = 16, vocab = 128256;
    auto l = randu(static_cast<size_t>(rows) * vocab, 21, -10, 10);
    std::vector<tc::SampleParams> p(rows);
    float* dl = to_device(l);
    tc::SampleParams* dp = to_device(p);
    int32_t* dout = to_device(std::vector<int32_t>(rows));
    tc::sample_rows(dl, rows, vocab, dp, dout, nullptr);
    d.write("sample_logits", l, "f32", {rows, vocab});
    d.write("sample_greedy", to_host(dout, rows), "i32", {rows});
  }
  std::ofstream(dir + "/meta.json") << "{" << d.meta.str() << "}\n";
  std::printf("kernel dumps written to %s (device memory of this mode is not freed: it exits)\n", dir.c_str());
  return 0;
}

// Each kernel of a batch-1 decode step on its own (layer 0's weights, back-to-back launches
// of one kernel, so each time includes its launch but not a graph's dependency gaps): where a
// step's time goes. Writes a JSON object; prints a table.
std::string micro_kernels(const tc::DeviceModel& m, const tc::ModelShape& s, double bw_gbps, cudaStream_t stream) {
  const int reps = 50;
  const auto& l = m.layers[0];
  const int64_t d = s.embedding_dim, ffn = s.ffn_dim, qd = int64_t(s.num_heads) * s.head_dim,
                kvd = int64_t(s.num_kv_heads) * s.head_dim;
  const int64_t widest = std::max({d, ffn, qd, int64_t(s.vocab_size)});
  float *x = nullptr, *y = nullptr, *y2 = nullptr, *y3 = nullptr;
  for (float** p : {&x, &y, &y2, &y3}) {
    tc::check(cudaMalloc(reinterpret_cast<void**>(p), sizeof(float) * widest * 8), "cudaMalloc (micro)");
    tc::fill_random(*p, tc::kF32, widest * 8, 1.0f, 5, stream);
  }
  std::ostringstream js;
  bool first = true;
  auto report = [&](const std::string& name, double us, double bytes) {
    const double gbps = bytes > 0 ? bytes / (us * 1e-6) / 1e9 : 0;
    std::printf("  %-34s %8.1f us", name.c_str(), us);
    if (bytes > 0) std::printf("  %7.0f GB/s (%4.1f%% of probe)", gbps, 100 * gbps / bw_gbps);
    std::printf("\n");
    js << (first ? "" : ",") << "\"" << name << "\":{\"us\":" << us << ",\"gbps\":" << gbps << "}";
    first = false;
  };
  auto mbytes = [](const tc::DeviceMatrix& w) { return double(tc::format_row_bytes(w.format, w.cols)) * w.rows; };
  std::printf("batch-1 kernels alone (layer 0, %d reps each):\n", reps);
  double unfused = 0, fused = 0;
  for (const auto* w : {&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down, &m.output}) {
    const char* name = w == &l.wq ? "gemv q" : w == &l.wk ? "gemv k" : w == &l.wv ? "gemv v" : w == &l.wo ? "gemv o"
                       : w == &l.w_gate ? "gemv gate" : w == &l.w_up ? "gemv up" : w == &l.w_down ? "gemv down"
                                                                                                 : "gemv output";
    const double us = time_us(stream, reps, [&] { tc::gemv(w->format, w->data, w->rows, w->cols, x, 1, y, stream); });
    report(name, us, mbytes(*w));
    if (w != &m.output) unfused += us;
  }
  for (int nt : {2, 4, 8}) {
    const double us = time_us(stream, reps, [&] {
      tc::gemv(l.w_gate.format, l.w_gate.data, l.w_gate.rows, l.w_gate.cols, x, nt, y, stream);
    });
    report("gemv gate, " + std::to_string(nt) + " tokens", us, mbytes(l.w_gate));
  }
  {
    const tc::GemvTarget qkv[3] = {{l.wq.data, l.wq.rows, y, nullptr}, {l.wk.data, l.wk.rows, y2, nullptr},
                                   {l.wv.data, l.wv.rows, y3, nullptr}};
    const double us = time_us(stream, reps, [&] { tc::gemv_multi(l.wq.format, qkv, 3, d, x, 1, stream); });
    report("fused q/k/v", us, mbytes(l.wq) + mbytes(l.wk) + mbytes(l.wv));
    fused += us;
    const tc::GemvTarget o{l.wo.data, l.wo.rows, y2, y2};
    const double uo = time_us(stream, reps, [&] { tc::gemv_multi(l.wo.format, &o, 1, qd, x, 1, stream); });
    report("fused o + residual", uo, mbytes(l.wo));
    fused += uo;
    const double ug = time_us(stream, reps, [&] {
      tc::gemv_swiglu(l.w_gate.format, l.w_gate.data, l.w_up.data, ffn, d, x, 1, y, stream);
    });
    report("fused gate/up + silu", ug, mbytes(l.w_gate) + mbytes(l.w_up));
    fused += ug;
    // One layer's GEMVs in order (eager launches, no graph), without and with programmatic
    // dependent launch: what PDL hides between dependent kernels.
    for (bool pdl : {false, true}) {
      tc::set_programmatic_launch(pdl);
      const tc::GemvTarget o2{l.wo.data, l.wo.rows, y3, y3};
      const tc::GemvTarget dn2{l.w_down.data, l.w_down.rows, y3, y3};
      const double us = time_us(stream, reps, [&] {
        tc::gemv_multi(l.wq.format, qkv, 3, d, x, 1, stream);
        tc::gemv_multi(l.wo.format, &o2, 1, qd, y, 1, stream);
        tc::gemv_swiglu(l.w_gate.format, l.w_gate.data, l.w_up.data, ffn, d, y3, 1, y, stream);
        tc::gemv_multi(l.w_down.format, &dn2, 1, ffn, y, 1, stream);
      });
      tc::set_programmatic_launch(false);
      report(pdl ? "layer GEMVs in order, PDL" : "layer GEMVs in order", us,
             mbytes(l.wq) + mbytes(l.wk) + mbytes(l.wv) + mbytes(l.wo) + mbytes(l.w_gate) + mbytes(l.w_up) +
                 mbytes(l.w_down));
    }
    const tc::GemvTarget dn{l.w_down.data, l.w_down.rows, y2, y2};
    const double ud = time_us(stream, reps, [&] { tc::gemv_multi(l.w_down.format, &dn, 1, ffn, x, 1, stream); });
    report("fused down + residual", ud, mbytes(l.w_down));
    fused += ud;
  }
  const double rms = time_us(stream, reps, [&] { tc::rms_norm(y, x, l.attn_norm, 1, d, s.rms_eps, stream); });
  report("rms_norm", rms, 0);
  const double add = time_us(stream, reps, [&] { tc::add(y, x, d, stream); });
  report("add", add, 0);
  const double silu = time_us(stream, reps, [&] { tc::silu_mul(y, x, ffn, stream); });
  report("silu_mul", silu, 0);
  int32_t* ints = nullptr;
  tc::check(cudaMalloc(reinterpret_cast<void**>(&ints), 4096), "cudaMalloc (micro)");
  tc::check(cudaMemset(ints, 0, 4096), "cudaMemset");
  void* pool = nullptr;
  const size_t pool_bytes = size_t(64) * 16 * kvd * 2;
  tc::check(cudaMalloc(&pool, 2 * pool_bytes), "cudaMalloc (micro pool)");
  tc::check(cudaMemset(pool, 0, 2 * pool_bytes), "cudaMemset");
  void* vpool = static_cast<uint8_t*>(pool) + pool_bytes;
  const double rope2 = time_us(stream, reps, [&] {
    tc::rope(y, ints, 1, s.num_heads, s.head_dim, s.rope.rotary_dim, s.rope.freq_base, 1.0f, false, stream);
    tc::rope(y2, ints, 1, s.num_kv_heads, s.head_dim, s.rope.rotary_dim, s.rope.freq_base, 1.0f, false, stream);
    tc::store_kv(pool, true, y2, ints, 1, kvd, stream);
    tc::store_kv(vpool, true, y3, ints, 1, kvd, stream);
  });
  report("rope q, rope k, store k, store v", rope2, 0);
  const double rsk = time_us(stream, reps, [&] {
    tc::rope_store_kv(y, y2, y3, ints, ints, 1, s.num_heads, s.num_kv_heads, s.head_dim, s.rope.rotary_dim,
                      s.rope.freq_base, 1.0f, false, pool, vpool, true, stream);
  });
  report("rope_store_kv", rsk, 0);
  // Decode attention of one sequence over 160 tokens (the benchmark's context).
  {
    std::vector<int32_t> table(10);
    for (int i = 0; i < 10; ++i) table[i] = i;
    int32_t* dt = to_device(table);
    std::vector<tc::AttnSeq> seq = {{0, 1, 160, 0, dt}};
    tc::AttnSeq* dseq = to_device(seq);
    const tc::AttnShape sh{s.num_heads, s.num_kv_heads, s.head_dim, 0.088f, 16, true};
    const int splits = tc::choose_decode_splits(sh, 1, 2048, 132);
    void* scratch = nullptr;
    tc::check(cudaMalloc(&scratch, tc::decode_scratch_bytes(sh, 1, splits)), "cudaMalloc (micro)");
    const double att = time_us(stream, reps, [&] {
      tc::attention_decode(sh, dseq, 1, splits, y, pool, vpool, y2, scratch, stream);
    });
    report("attention_decode (context 160, " + std::to_string(splits) + " splits)", att, 0);
    unfused += att;
    fused += att;
    cudaFree(scratch);
  }
  std::vector<tc::SampleParams> prm(1);
  tc::SampleParams* dprm = to_device(prm);
  const double samp = time_us(stream, reps, [&] { tc::sample_rows(y, 1, s.vocab_size, dprm, ints, stream); });
  report("sample_rows (greedy, 1 row)", samp, 0);
  // Per-step sums of the layer kernels (x num_layers), unfused and fused.
  unfused = s.num_layers * (unfused + 2 * rms + 2 * add + silu + rope2);
  fused = s.num_layers * (fused + 2 * rms + rsk);
  std::printf("  sum over %d layers: unfused %.0f us, fused %.0f us (kernels alone, no graph gaps)\n",
              s.num_layers, unfused, fused);
  js << ",\"layers_sum_unfused_us\":" << unfused << ",\"layers_sum_fused_us\":" << fused;
  for (void* p : {static_cast<void*>(x), static_cast<void*>(y), static_cast<void*>(y2), static_cast<void*>(y3),
                  static_cast<void*>(ints), pool})
    cudaFree(p);
  return "{" + js.str() + "}";
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--out") a.out = v;
    else if (k == "--layers") a.layers = std::atoi(v.c_str());
    else if (k == "--prompt") a.prompt = std::atoi(v.c_str());
    else if (k == "--steps") a.steps = std::atoi(v.c_str());
    else if (k == "--prefill") a.prefill_len = std::atoi(v.c_str());
    else if (k == "--sweep") a.sweep = parse_list(v);
    else if (k == "--peak-tflops") a.peak_tflops = std::atof(v.c_str());
    else if (k == "--dump") a.dump = v;
    else {
      std::fprintf(stderr, "unknown option %s\n", k.c_str());
      return 2;
    }
  }
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    std::printf("SKIPPED: no CUDA device\n");
    return 77;
  }
  try {
    if (!a.dump.empty()) return dump_kernels(a.dump);
    cudaDeviceProp prop{};
    cudaGetDeviceProperties(&prop, 0);
    std::printf("device: %s, %d SMs, %.1f GiB\n", prop.name, prop.multiProcessorCount,
                prop.totalGlobalMem / double(1 << 30));
    const double bw = measure_bandwidth_gbps();
    std::printf("HBM read bandwidth (probe): %.0f GB/s\n", bw);

    tc::ModelShape shape;  // Llama-3-8B
    shape.vocab_size = 128256;
    shape.embedding_dim = 4096;
    shape.num_layers = a.layers;
    shape.num_heads = 32;
    shape.num_kv_heads = 8;
    shape.head_dim = 128;
    shape.ffn_dim = 14336;
    shape.rms_eps = 1e-5f;
    shape.rope.head_dim = 128;
    shape.rope.rotary_dim = 128;
    shape.rope.freq_base = 500000.0f;
    cudaStream_t stream = nullptr;
    tc::check(cudaStreamCreate(&stream), "stream");
    double t0 = now();
    std::shared_ptr<tc::DeviceModel> model = tc::DeviceModel::synthetic(shape, tc::kBF16, 42, stream);
    std::printf("synthetic bf16 weights: %.2f GB in %.1f s\n", model->weight_bytes / 1e9, now() - t0);

    const int max_batch = std::max(256, *std::max_element(a.sweep.begin(), a.sweep.end()));
    // Sweep sequences hold prompt + steps tokens; the prefill test one long prompt. Each batch
    // reuses the pool from block 0.
    const int decode_len = a.prompt + a.steps + 2;
    const int max_len = std::max(decode_len, a.prefill_len + 2);
    const int block_size = 16;
    const int decode_blocks = (decode_len + block_size - 1) / block_size;
    const int max_rows = std::max(2048, a.prefill_len);
    tessera::KvLayout layout{block_size,
                             std::max(max_batch * decode_blocks, (max_len + block_size - 1) / block_size),
                             tessera::KvDtype::kF16, tessera::KvDtype::kF16};
    tc::RunnerOptions options;  // the defaults: fused GEMVs, per-format crossover, PDL on sm_90
    options.graph_max_batch = max_batch;
    tc::CudaRunner runner(model, layout, max_rows, max_len, options, 0);
    std::printf("KV pool: %.2f GB\n", runner.kv_pool_bytes() / 1e9);

    // Bytes a batch-1 decode step must read at least: every layer matrix and the output matrix
    // (the embedding row and the KV cache are negligible at this context).
    const double hidden = shape.embedding_dim;
    const double per_layer = 2.0 * (hidden * hidden * 2 + hidden * 1024 * 2 + 3 * hidden * shape.ffn_dim);
    const double step_bytes = per_layer * shape.num_layers + 2.0 * shape.vocab_size * hidden;
    const double flops_per_token = step_bytes;  // 2 FLOP per bf16 weight (2 bytes)
    const double roofline_tps = bw * 1e9 / step_bytes;
    const double nominal_tps = a.nominal_gbps * 1e9 / step_bytes;

    std::ostringstream sweep_json;
    double step1 = 0;
    int compute_bound_batch = -1;
    double b64_decode = 0, b64_e2e = 0, b256_decode = 0, b256_e2e = 0, b1_tps = 0;
    for (size_t k = 0; k < a.sweep.size(); ++k) {
      const int n = a.sweep[k];
      Batch b = make_batch(n, a.prompt, decode_len, block_size, shape.vocab_size, 7 + n);
      const double tp = prefill(runner, b, max_rows);
      const double td = decode(runner, b, a.steps);
      const double step_ms = td / a.steps * 1e3;
      const double tps = n * a.steps / td;
      const double e2e = n * (a.steps + 1) / (tp + td);
      if (n == 1) { step1 = step_ms; b1_tps = tps; }
      if (n == 64) { b64_decode = tps; b64_e2e = e2e; }
      if (n == 256) { b256_decode = tps; b256_e2e = e2e; }
      if (compute_bound_batch < 0 && step1 > 0 && step_ms >= 2.0 * step1) compute_bound_batch = n;
      std::printf("batch %4d: prefill %7.1f ms, decode step %7.2f ms, %9.0f tok/s decode, %9.0f tok/s end to end\n",
                  n, tp * 1e3, step_ms, tps, e2e);
      sweep_json << (k ? "," : "") << "{\"batch\":" << n << ",\"prefill_ms\":" << tp * 1e3
                 << ",\"decode_step_ms\":" << step_ms << ",\"decode_tok_s\":" << tps
                 << ",\"end_to_end_tok_s\":" << e2e << "}";
    }

    // Where a batch-1 step goes, kernel by kernel.
    const std::string micro_json = micro_kernels(*model, shape, bw, stream);

    // A/B of the small-batch decode paths, side by side: the unfused GEMVs (kernels 1.3's
    // step), the fused ones, and the GEMV/cuBLAS crossover (gemv_max_tokens).
    std::ostringstream ab_json;
    {
      struct Variant { const char* name; bool fused; int gemv_max; bool pdl; int splits; };
      const Variant variants[] = {{"unfused, gemv<=8", false, 8, false, 0}, {"fused, gemv<=8", true, 8, false, 0},
                                  {"fused, gemv<=1", true, 1, false, 0},    {"fused, auto, no PDL", true, -1, false, 0},
                                  {"fused, auto, PDL", true, -1, true, 0},  {"auto, PDL, 2 splits", true, -1, true, 2},
                                  {"auto, PDL, 8 splits", true, -1, true, 8}};
      const int ab_batches[] = {1, 2, 4, 8, 16};
      const int ab_seqs = 16;
      tessera::KvLayout ab_layout{block_size, ab_seqs * decode_blocks, tessera::KvDtype::kF16, tessera::KvDtype::kF16};
      std::printf("decode step (ms) by path and batch:\n  %-22s", "path");
      for (int n : ab_batches) std::printf(" %8d", n);
      std::printf("\n");
      bool first_variant = true;
      for (const Variant& v : variants) {
        tc::RunnerOptions o;
        o.fused_gemv = v.fused;
        o.gemv_max_tokens = v.gemv_max;
        o.programmatic_launch = v.pdl;
        o.decode_splits = v.splits;
        o.graph_max_batch = ab_seqs;
        // The main runner's context limit, so the automatic split count is the same.
        tc::CudaRunner r(model, ab_layout, ab_seqs * a.prompt, max_len, o, 0);
        std::printf("  %-22s", v.name);
        bool wrote = false;
        try {
        ab_json << (first_variant ? "" : ",") << "{\"path\":\"" << v.name << "\",\"step_ms\":{";
        first_variant = false;
        for (size_t k = 0; k < sizeof(ab_batches) / sizeof(ab_batches[0]); ++k) {
          const int n = ab_batches[k];
          Batch b = make_batch(n, a.prompt, decode_len, block_size, shape.vocab_size, 7 + n);
          prefill(r, b, ab_seqs * a.prompt);
          const double step_ms = decode(r, b, a.steps) / a.steps * 1e3;
          std::printf(" %8.2f", step_ms);
          ab_json << (k ? "," : "") << "\"" << n << "\":" << step_ms;
          wrote = true;
        }
        } catch (const std::exception& e) {
          std::printf(" failed: %s", e.what());
          ab_json << (wrote ? "," : "") << "\"error\":1";
        }
        ab_json << "}}";
        std::printf("\n");
      }
    }

    // The cuBLAS path at decode batch sizes: one layer's seven matmuls (x converted to bf16 per
    // matmul, f32 output), alone, against the weights' bytes and the FLOPs.
    std::ostringstream gemm_json;
    {
      const auto& l = model->layers[0];
      float *gx = nullptr, *gy = nullptr;
      const size_t n = size_t(256) * shape.ffn_dim;
      tc::check(cudaMalloc(reinterpret_cast<void**>(&gx), sizeof(float) * n), "cudaMalloc (gemm)");
      tc::check(cudaMalloc(reinterpret_cast<void**>(&gy), sizeof(float) * n), "cudaMalloc (gemm)");
      tc::fill_random(gx, tc::kF32, n, 1.0f, 9, runner.stream());
      double layer_bytes = 0, layer_flop_per_tok = 0;
      for (const auto* w : {&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down}) {
        layer_bytes += 2.0 * w->rows * w->cols;
        layer_flop_per_tok += 2.0 * w->rows * w->cols;
      }
      std::printf("one layer's matmuls on the cuBLAS path (x converted per matmul):\n");
      bool first_gemm = true;
      for (int ntok : {16, 64, 256}) {
        const double us = time_us(runner.stream(), 20, [&] {
          for (const auto* w : {&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down})
            runner.matmul(*w, gx, ntok, gy);
        });
        const double gbps = layer_bytes / (us * 1e-6) / 1e9, tflops = layer_flop_per_tok * ntok / (us * 1e-6) / 1e12;
        std::printf("  %4d tokens: %7.1f us  %6.0f GB/s of weights (%4.1f%% of probe)  %5.0f TFLOP/s\n", ntok, us, gbps,
                    100 * gbps / bw, tflops);
        gemm_json << (first_gemm ? "" : ",") << "\"" << ntok << "\":{\"us\":" << us << ",\"gbps\":" << gbps
                  << ",\"tflops\":" << tflops << "}";
        first_gemm = false;
      }
      cudaFree(gx);
      cudaFree(gy);
    }

    // One 2048-token prompt, prefilled as one chunk (twice; the second is reported).
    double prefill_s = 0;
    for (int rep = 0; rep < 2; ++rep) {
      Batch b = make_batch(1, a.prefill_len, max_len, block_size, shape.vocab_size, 99 + rep);
      prefill_s = prefill(runner, b, max_rows);
    }
    const double prefill_tps = a.prefill_len / prefill_s;
    std::printf("prefill %d tokens: %.1f ms, %.0f tok/s (%.0f TFLOP/s on the matmuls)\n", a.prefill_len,
                prefill_s * 1e3, prefill_tps, prefill_tps * flops_per_token / 1e12);
    std::printf("batch-1 decode: %.1f tok/s = %.1f%% of the measured roofline (%.1f tok/s), %.1f%% of nominal\n",
                b1_tps, 100 * b1_tps / roofline_tps, roofline_tps, 100 * b1_tps / nominal_tps);
    const double ridge = a.peak_tflops * 1e12 / (bw * 1e9);  // FLOP per byte = tokens per step
    std::printf("decode becomes compute-bound at batch %d (step >= 2x batch 1); roofline ridge at batch ~%.0f\n",
                compute_bound_batch, ridge);

    std::ofstream f(a.out);
    f << "{\"device\":\"" << prop.name << "\",\"sms\":" << prop.multiProcessorCount << ",\"layers\":" << a.layers
      << ",\"weights_bytes\":" << model->weight_bytes << ",\"bytes_per_decode_step\":" << step_bytes
      << ",\"bandwidth_probe_gbps\":" << bw << ",\"nominal_gbps\":" << a.nominal_gbps
      << ",\"roofline_tok_s_measured_bw\":" << roofline_tps << ",\"roofline_tok_s_nominal\":" << nominal_tps
      << ",\"decode_b1_tok_s\":" << b1_tps << ",\"decode_b1_step_ms\":" << step1
      << ",\"decode_b1_fraction_of_roofline\":" << b1_tps / roofline_tps
      << ",\"decode_b1_fraction_of_nominal\":" << b1_tps / nominal_tps
      << ",\"decode_b64_tok_s\":" << b64_decode << ",\"end_to_end_b64_tok_s\":" << b64_e2e
      << ",\"decode_b256_tok_s\":" << b256_decode << ",\"end_to_end_b256_tok_s\":" << b256_e2e
      << ",\"prompt_len\":" << a.prompt << ",\"new_tokens\":" << a.steps + 1
      << ",\"prefill_len\":" << a.prefill_len << ",\"prefill_ms\":" << prefill_s * 1e3
      << ",\"prefill_tok_s\":" << prefill_tps << ",\"compute_bound_batch\":" << compute_bound_batch
      << ",\"ridge_batch_theory\":" << ridge << ",\"graphs_captured\":" << runner.num_captured_graphs()
      << ",\"sweep\":[" << sweep_json.str() << "],\"micro_b1\":" << micro_json << ",\"decode_ab\":["
      << ab_json.str() << "],\"layer_gemm\":{" << gemm_json.str() << "}}\n";
    std::printf("wrote %s\n", a.out.c_str());
    cudaStreamDestroy(stream);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_cuda: %s\n", e.what());
    return 1;
  }
  return 0;
}
