// Conformance of every attention plugin: each one, loaded by name from the build's plugin
// folder, is compared with a straightforward double-precision reference on random Q/K/V
// pools read through shuffled block tables — several GQA ratios, head sizes and block sizes
// (1, 8, 16 and 2048, the contiguous case), mixed batches of prompt chunks and decodes, f32
// and f16 caches — and every kernel is compared with the naive oracle.
//
// Tolerances (absolute; V lies in [-1, 1], so outputs do too):
//  - f32 cache: 1e-5. Only float summation order differs from the reference.
//  - f16 cache: 1e-3. Q is rounded to f16 in every kernel and in the reference; naive also
//    rounds each softmax probability to f16 (relative error <= 2^-11, so <= 4.9e-4 on an
//    output), while flash keeps them in f32 (its probabilities are final only at the end).
#include <doctest/doctest.h>

#include <algorithm>
#include <cstring>
#include <cmath>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "support/plugins.h"
#include "tessera/sdk/forward.h"
#include "support/test_env.h"
#include "tessera/config.h"
#include "tessera/ggml_types.h"
#include "tessera/plugin_registry.h"
#include "tessera/sdk/attention.h"
#include "tessera/thread_pool.h"

namespace {

using namespace tessera;

constexpr double kTolF32 = 1e-5;
constexpr double kTolF16 = 1e-3;

std::shared_ptr<AttentionKernel> make_kernel(const std::string& name, const std::string& yaml) {
  return test::create_plugin<AttentionKernel>(name, yaml);
}

// The host kernels: this suite hands them host pointers. Kernels that compute on a device
// (DeviceAttentionKernel, e.g. cuda-flash) are checked by tests/cuda on a GPU.
std::vector<std::string> attention_plugins() {
  std::vector<std::string> names;
  for (const std::string& name : test::plugin_names(PluginKind::kAttention)) {
    const bool on_device = dynamic_cast<DeviceAttentionKernel*>(make_kernel(name, "{}").get()) != nullptr;
    // What the manifest declares is what the stack check trusts (SDK 2.6).
    CHECK_MESSAGE(on_device == test::declares(PluginKind::kAttention, name, kCapabilityDeviceAttention),
                  "attention." << name << ": DeviceAttentionKernel implemented and capability "
                               "'device_attention' declared must agree");
    if (!on_device) names.push_back(name);
  }
  std::string list;
  for (const std::string& n : names) list += (list.empty() ? "" : ", ") + n;
  MESSAGE("host attention plugins under test: " << list);
  return names;
}

bool has_param(const std::string& plugin, const std::string& param) {
  return test::has_param(PluginKind::kAttention, plugin, param);
}

// One random batch: Q rows, K/V pools, sequences with shuffled block tables.
struct Problem {
  AttentionShape shape;
  std::vector<AttentionSequence> sequences;
  std::vector<std::vector<int32_t>> tables;
  std::vector<float> q;
  std::vector<float> k_wide, v_wide;    // pool contents as stored, widened to float
  std::vector<uint16_t> k_half, v_half; // the f16 pools
  std::vector<uint8_t> k_q8, v_q8;      // the Q8_0 pools (ggml blocks of 32 per head row)
  int32_t num_rows = 0;

  static const void* pool(KvDtype t, const std::vector<float>& wide, const std::vector<uint16_t>& half,
                          const std::vector<uint8_t>& q8) {
    if (t == KvDtype::kF16) return half.data();
    if (t == KvDtype::kQ8_0) return q8.data();
    return wide.data();
  }
  const void* k_pool() const { return pool(shape.k_dtype, k_wide, k_half, k_q8); }
  const void* v_pool() const { return pool(shape.v_dtype, v_wide, v_half, v_q8); }
  AttentionBatch batch(float* out) const {
    AttentionBatch b;
    b.sequences = sequences;
    b.q = q.data();
    b.k_pool = k_pool();
    b.v_pool = v_pool();
    b.out = out;
    return b;
  }
};

struct SeqSpec {
  int32_t context_len;
  int32_t num_queries;
};

// K stored as k_dtype, V as v_dtype; k_wide / v_wide hold what the pools hold, as floats.
Problem make_problem(std::mt19937& rng, int32_t num_heads, int32_t num_kv_heads, int32_t head_dim,
                     int32_t block_size, KvDtype k_dtype, KvDtype v_dtype,
                     const std::vector<SeqSpec>& specs, float q_scale = 3.0f) {
  Problem p;
  p.shape = {num_heads, num_kv_heads, head_dim, 1.0f / std::sqrt(static_cast<float>(head_dim)),
             block_size, k_dtype, v_dtype};
  int32_t num_blocks = 3;  // a few blocks nobody uses, so tables never cover the whole pool
  for (const SeqSpec& s : specs) num_blocks += (s.context_len + block_size - 1) / block_size;
  std::vector<int32_t> ids(num_blocks);
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  size_t next_block = 0;
  for (const SeqSpec& s : specs) {
    std::vector<int32_t> table;
    for (int32_t b = 0; b < (s.context_len + block_size - 1) / block_size; ++b)
      table.push_back(ids[next_block++]);
    p.tables.push_back(std::move(table));
  }
  for (size_t i = 0; i < specs.size(); ++i) {
    p.sequences.push_back({p.num_rows, specs[i].num_queries, specs[i].context_len,
                           p.tables[i].data()});
    p.num_rows += specs[i].num_queries;
  }
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  const size_t pool_size = static_cast<size_t>(num_blocks) * block_size * num_kv_heads * head_dim;
  for (auto* wide : {&p.k_wide, &p.v_wide}) {
    wide->resize(pool_size);
    for (float& x : *wide) x = unit(rng);
  }
  struct PoolRefs { KvDtype dtype; std::vector<float>* wide; std::vector<uint16_t>* half; std::vector<uint8_t>* q8; };
  for (const PoolRefs& r : {PoolRefs{k_dtype, &p.k_wide, &p.k_half, &p.k_q8},
                            PoolRefs{v_dtype, &p.v_wide, &p.v_half, &p.v_q8}}) {
    if (r.dtype == KvDtype::kF16) {
      r.half->resize(pool_size);
      for (size_t i = 0; i < pool_size; ++i) {
        (*r.half)[i] = fp32_to_fp16((*r.wide)[i]);
        (*r.wide)[i] = fp16_to_fp32((*r.half)[i]);
      }
    } else if (r.dtype == KvDtype::kQ8_0) {
      // Each head row quantized as the CPU backend's store_kv does, then read back.
      const size_t rows = pool_size / head_dim, row_bytes = kv_row_bytes(KvDtype::kQ8_0, head_dim);
      r.q8->resize(rows * row_bytes);
      for (size_t i = 0; i < rows; ++i) {
        REQUIRE(quantize_activation_row(GgmlType::Q8_0, r.wide->data() + i * head_dim,
                                        r.q8->data() + i * row_bytes, head_dim));
        REQUIRE(dequantize_row(GgmlType::Q8_0, r.q8->data() + i * row_bytes, r.wide->data() + i * head_dim,
                               head_dim));
      }
    }
  }
  p.q.resize(static_cast<size_t>(p.num_rows) * num_heads * head_dim);
  for (float& x : p.q) x = q_scale * unit(rng);
  return p;
}

Problem make_problem(std::mt19937& rng, int32_t num_heads, int32_t num_kv_heads, int32_t head_dim,
                     int32_t block_size, KvDtype dtype, const std::vector<SeqSpec>& specs,
                     float q_scale = 3.0f) {
  return make_problem(rng, num_heads, num_kv_heads, head_dim, block_size, dtype, dtype, specs, q_scale);
}

// Kernels round to f16 what meets an f16 pool (Q before K, probabilities before V), so an f16
// pool on either side gets the f16 tolerance; Q8_0 pools are read exactly (what the reference
// reads), so they get f32's.
double tolerance(const AttentionShape& s) {
  return s.k_dtype == KvDtype::kF16 || s.v_dtype == KvDtype::kF16 ? kTolF16 : kTolF32;
}

// Attention in double precision, straight from the definition. With an f16 cache Q is taken
// at f16 precision, as every kernel does (the cache's precision is part of the semantics).
std::vector<double> reference(const Problem& p) {
  const AttentionShape& s = p.shape;
  const int32_t d = s.head_dim;
  const int32_t group = s.num_heads / s.num_kv_heads;
  std::vector<double> out(static_cast<size_t>(p.num_rows) * s.num_heads * d, 0.0);
  std::vector<double> scores, q(d);
  for (const AttentionSequence& seq : p.sequences) {
    auto kv_index = [&](int32_t pos, int32_t kv_head) {
      const int64_t slot =
          static_cast<int64_t>(seq.block_table[pos / s.block_size]) * s.block_size + pos % s.block_size;
      return (slot * s.num_kv_heads + kv_head) * d;
    };
    for (int32_t i = 0; i < seq.num_queries; ++i) {
      const int32_t visible = seq.context_len - seq.num_queries + i + 1;
      // A sliding window hides positions [0, first) (AttentionShape::sliding_window).
      const int32_t first = attention_window_begin(s, visible - 1);
      for (int32_t h = 0; h < s.num_heads; ++h) {
        const int32_t kv_head = h / group;
        const float* qf = p.q.data() + (static_cast<size_t>(seq.query_start + i) * s.num_heads + h) * d;
        for (int32_t k = 0; k < d; ++k)
          q[k] = s.k_dtype == KvDtype::kF16 ? fp16_to_fp32(fp32_to_fp16(qf[k])) : qf[k];
        scores.assign(visible, 0.0);
        double max = -std::numeric_limits<double>::infinity();
        for (int32_t j = first; j < visible; ++j) {
          const float* krow = p.k_wide.data() + kv_index(j, kv_head);
          double dot = 0.0;
          for (int32_t k = 0; k < d; ++k) dot += q[k] * krow[k];
          scores[j] = dot * s.scale;
          max = std::max(max, scores[j]);
        }
        double sum = 0.0;
        for (int32_t j = first; j < visible; ++j) sum += (scores[j] = std::exp(scores[j] - max));
        double* o = out.data() + (static_cast<size_t>(seq.query_start + i) * s.num_heads + h) * d;
        for (int32_t j = first; j < visible; ++j) {
          const float* vrow = p.v_wide.data() + kv_index(j, kv_head);
          for (int32_t k = 0; k < d; ++k) o[k] += scores[j] / sum * vrow[k];
        }
      }
    }
  }
  return out;
}

std::vector<float> run_kernel(AttentionKernel& kernel, const Problem& p, Executor& executor) {
  // NaN everywhere first: a row the kernel forgets to write fails every comparison.
  std::vector<float> out(static_cast<size_t>(p.num_rows) * p.shape.num_heads * p.shape.head_dim,
                         std::numeric_limits<float>::quiet_NaN());
  Status st = kernel.forward(p.shape, p.batch(out.data()), executor);
  REQUIRE_MESSAGE(st.is_ok(), st.message());
  return out;
}

template <class A, class B>
double max_abs_diff(const std::vector<A>& a, const std::vector<B>& b) {
  REQUIRE(a.size() == b.size());
  double worst = 0.0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double diff = std::abs(static_cast<double>(a[i]) - static_cast<double>(b[i]));
    if (!(diff <= worst)) worst = std::isnan(diff) ? std::numeric_limits<double>::infinity() : diff;
  }
  return worst;
}

// A mixed batch: decodes, prompt chunks (the tail of a longer context) and whole prompts,
// context lengths 1..300; always one single-token sequence and one of 300 tokens.
std::vector<SeqSpec> random_batch(std::mt19937& rng) {
  std::vector<SeqSpec> specs = {{1, 1}, {300, 1}};
  std::uniform_int_distribution<int32_t> ctx_dist(1, 300);
  for (int n = 0; n < 5; ++n) {
    const int32_t ctx = ctx_dist(rng);
    switch (n % 3) {
      case 0: specs.push_back({ctx, 1}); break;                                          // decode
      case 1: specs.push_back({ctx, std::uniform_int_distribution<int32_t>(1, std::min(ctx, 48))(rng)}); break;
      case 2: specs.push_back({std::min(ctx, 96), std::min(ctx, 96)}); break;           // whole prompt
    }
  }
  specs.push_back({257, 257});  // a whole prompt crossing several tiles and blocks
  std::shuffle(specs.begin(), specs.end(), rng);
  return specs;
}

// Kernel configurations under test: every plugin with its defaults, plus tile variants of
// kernels that have tiles (odd sizes exercise partial tiles and tiles straddling blocks).
struct KernelCase {
  std::string plugin;
  std::string params;
};
std::vector<KernelCase> kernel_cases() {
  std::vector<KernelCase> cases;
  for (const std::string& name : attention_plugins()) {
    cases.push_back({name, "{}"});
    if (has_param(name, "tile_size")) {
      cases.push_back({name, "{tile_size: 16}"});
      if (has_param(name, "query_tile")) {
        cases.push_back({name, "{tile_size: 7, query_tile: 5}"});
        cases.push_back({name, "{tile_size: 1, query_tile: 1}"});
      }
    }
    if (has_param(name, "simd")) {  // the portable build too, whatever this CPU has
      cases.push_back({name, "{simd: off}"});
      if (has_param(name, "tile_size")) cases.push_back({name, "{simd: off, tile_size: 7}"});
    }
  }
  return cases;
}

TEST_CASE("attention plugins: naive and flash are registered") {
  const auto names = attention_plugins();
  for (const auto& e : test::plugin_registry().load_errors()) MESSAGE("load error: ", e.library_path, ": ", e.message);
  CHECK(std::find(names.begin(), names.end(), "naive") != names.end());
  CHECK(std::find(names.begin(), names.end(), "flash") != names.end());
}

TEST_CASE("attention plugins match a double-precision reference") {
  ThreadPool one(1), three(3);
  std::mt19937 rng(1234);
  const auto cases = kernel_cases();
  std::vector<std::shared_ptr<AttentionKernel>> kernels;
  for (const KernelCase& c : cases) kernels.push_back(make_kernel(c.plugin, c.params));

  struct HeadShape { int32_t heads, kv_heads; };
  for (HeadShape hs : {HeadShape{4, 4}, HeadShape{6, 2}, HeadShape{8, 2}}) {  // GQA 1, 3, 4
    for (int32_t head_dim : {64, 32}) {
      for (int32_t block_size : {1, 8, 16, 2048}) {
        for (KvDtype dtype : {KvDtype::kF32, KvDtype::kF16, KvDtype::kQ8_0}) {
          const Problem p = make_problem(rng, hs.heads, hs.kv_heads, head_dim, block_size, dtype,
                                         random_batch(rng));
          const std::vector<double> want = reference(p);
          const double tol = tolerance(p.shape);
          std::vector<float> naive_out;
          for (size_t k = 0; k < cases.size(); ++k) {
            CAPTURE(cases[k].plugin);
            CAPTURE(cases[k].params);
            CAPTURE(hs.heads);
            CAPTURE(hs.kv_heads);
            CAPTURE(head_dim);
            CAPTURE(block_size);
            CAPTURE(kv_dtype_name(dtype));
            // Thread count must not matter; alternate it to cover both without doubling time.
            Executor& executor = (k + block_size) % 2 ? three : one;
            const std::vector<float> got = run_kernel(*kernels[k], p, executor);
            CHECK(max_abs_diff(got, want) <= tol);
            if (cases[k].plugin == "naive" && cases[k].params == "{}") naive_out = got;
            else if (!naive_out.empty()) CHECK(max_abs_diff(got, naive_out) <= tol);
          }
        }
      }
    }
  }
}

TEST_CASE("attention plugins: peaked softmax, long prompt, many threads") {
  // Large scores make the running maximum jump between tiles (the rescaling path) and leave
  // most probabilities near zero.
  ThreadPool pool(4);
  std::mt19937 rng(99);
  for (KvDtype dtype : {KvDtype::kF32, KvDtype::kF16, KvDtype::kQ8_0}) {
    const Problem p = make_problem(rng, 8, 2, 64, 16, dtype, {{300, 300}, {200, 1}, {5, 5}},
                                   /*q_scale=*/12.0f);
    const std::vector<double> want = reference(p);
    for (const KernelCase& c : kernel_cases()) {
      CAPTURE(c.plugin);
      CAPTURE(c.params);
      CAPTURE(kv_dtype_name(dtype));
      auto kernel = make_kernel(c.plugin, c.params);
      CHECK(max_abs_diff(run_kernel(*kernel, p, pool), want) <= tolerance(p.shape));
    }
  }
}

TEST_CASE("attention plugins: a sliding window (Gemma 3's local layers) matches the reference") {
  // Windows shorter than a tile, than a block, than most contexts, and longer than all of
  // them (= plain causal attention); decodes, chunks and whole prompts in one batch.
  ThreadPool pool(3);
  std::mt19937 rng(512);
  for (int32_t window : {1, 5, 37, 512}) {
    for (KvDtype dtype : {KvDtype::kF32, KvDtype::kF16}) {
      for (int32_t block_size : {1, 16}) {
        Problem p = make_problem(rng, 4, 1, 64, block_size, dtype, random_batch(rng));
        p.shape.sliding_window = window;
        const std::vector<double> want = reference(p);
        for (const KernelCase& c : kernel_cases()) {
          CAPTURE(c.plugin);
          CAPTURE(c.params);
          CAPTURE(window);
          CAPTURE(kv_dtype_name(dtype));
          CAPTURE(block_size);
          auto kernel = make_kernel(c.plugin, c.params);
          CHECK(max_abs_diff(run_kernel(*kernel, p, pool), want) <= tolerance(p.shape));
        }
      }
    }
  }
  // A window of 5 really hides the rest: the 300-token decode differs from full attention.
  Problem p = make_problem(rng, 4, 1, 64, 16, KvDtype::kF32, {{300, 1}});
  auto naive = make_kernel("naive", "{}");
  const std::vector<float> full = run_kernel(*naive, p, pool);
  p.shape.sliding_window = 5;
  CHECK(max_abs_diff(run_kernel(*naive, p, pool), full) > 1e-3);
}

TEST_CASE("attention plugins: an empty batch is a no-op, and calls can repeat") {
  ThreadPool pool(2);
  std::mt19937 rng(7);
  for (const KernelCase& c : kernel_cases()) {
    CAPTURE(c.plugin);
    auto kernel = make_kernel(c.plugin, c.params);
    Problem empty = make_problem(rng, 4, 2, 32, 8, KvDtype::kF32, {});
    CHECK(kernel->forward(empty.shape, empty.batch(nullptr), pool).is_ok());
    // Scratch grown for a big batch must serve a smaller one afterwards, and vice versa.
    for (int32_t ctx : {250, 3, 120}) {
      const Problem p = make_problem(rng, 4, 2, 32, 8, KvDtype::kF32, {{ctx, ctx}, {ctx, 1}});
      CHECK(max_abs_diff(run_kernel(*kernel, p, pool), reference(p)) <= kTolF32);
    }
  }
}

TEST_CASE("attention plugins: K and V in different dtypes (q8_0 K with f16 V, f16 K with q8_0 V)") {
  ThreadPool pool(3);
  std::mt19937 rng(2024);
  for (auto [k_dtype, v_dtype] : {std::pair{KvDtype::kQ8_0, KvDtype::kF16}, std::pair{KvDtype::kF16, KvDtype::kQ8_0},
                                  std::pair{KvDtype::kQ8_0, KvDtype::kF32}}) {
    const Problem p = make_problem(rng, 6, 2, 64, 16, k_dtype, v_dtype, random_batch(rng));
    const std::vector<double> want = reference(p);
    for (const KernelCase& c : kernel_cases()) {
      CAPTURE(c.plugin);
      CAPTURE(c.params);
      CAPTURE(kv_dtype_name(k_dtype));
      CAPTURE(kv_dtype_name(v_dtype));
      auto kernel = make_kernel(c.plugin, c.params);
      CHECK(max_abs_diff(run_kernel(*kernel, p, pool), want) <= tolerance(p.shape));
    }
  }
}

TEST_CASE("attention plugins: a q8_0 pool gives the bits of an f32 pool holding its values") {
  // Widening Q8_0 is exact (d * q needs 18 significand bits) and Q stays f32 against it, so a
  // kernel must compute over a q8_0 pool exactly what it computes over the dequantized
  // values stored as f32, on every path (flash widens q8_0 rows in registers in decode and
  // into a tile for prompt rows).
  ThreadPool pool(2);
  std::mt19937 rng(31337);
  for (const KernelCase& c : kernel_cases()) {
    CAPTURE(c.plugin);
    CAPTURE(c.params);
    auto kernel = make_kernel(c.plugin, c.params);
    Problem q8 = make_problem(rng, 9, 3, 64, 16, KvDtype::kQ8_0, random_batch(rng));
    Problem f32 = q8;
    f32.shape.k_dtype = f32.shape.v_dtype = KvDtype::kF32;  // k_wide / v_wide: the dequantized values
    f32.sequences = q8.sequences;
    const std::vector<float> a = run_kernel(*kernel, q8, pool);
    const std::vector<float> b = run_kernel(*kernel, f32, pool);
    CHECK(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
  }
}

TEST_CASE("attention plugins refuse a q8_0 pool whose head_dim is not a multiple of 32") {
  ThreadPool pool(1);
  std::mt19937 rng(5);
  Problem p = make_problem(rng, 4, 2, 16, 8, KvDtype::kF32, {{4, 4}});
  p.shape.k_dtype = KvDtype::kQ8_0;
  for (const std::string name : {"naive", "flash"}) {
    std::vector<float> out(static_cast<size_t>(p.num_rows) * p.shape.num_heads * p.shape.head_dim);
    const Status st = make_kernel(name, "{}")->forward(p.shape, p.batch(out.data()), pool);
    CHECK(st.code() == StatusCode::kInvalidArgument);
    CHECK(st.message().find("q8_0") != std::string::npos);
  }
}

TEST_CASE("attention.flash: scratch memory does not grow with the context") {
  AttentionShape shape{9, 3, 64, 0.125f, 16, KvDtype::kF16, KvDtype::kF16};
  auto flash = make_kernel("flash", "{}");
  auto naive = make_kernel("naive", "{}");
  const size_t at_2k = flash->scratch_bytes(shape, 2048, 2048);
  CHECK(flash->scratch_bytes(shape, 2048, 1 << 20) == at_2k);
  CHECK(flash->scratch_bytes(shape, 1 << 16, 1 << 20) == at_2k);
  CHECK(flash->scratch_bytes(shape, 1, 2048) < at_2k);  // a decode needs one query's rows
  CHECK(at_2k < 256 * 1024);
  CHECK(naive->scratch_bytes(shape, 2048, 2048) >= size_t{2048} * 2048 * sizeof(float));
  MESSAGE("scratch per thread at 2048 queries x 2048 context: flash ", at_2k, " B, naive ",
          naive->scratch_bytes(shape, 2048, 2048), " B");
}

}  // namespace

TEST_CASE("attention.naive: the AVX2 build gives the portable build's bits") {
  // naive is the oracle whose reduction orders mirror llama.cpp's; its vectorized build only
  // runs the same operations in vector lanes, so outputs must agree exactly, not within a tol.
  if (!cpu_has_avx2()) {
    MESSAGE("CPU lacks AVX2/FMA/F16C: only the portable build exists here");
    return;
  }
  ThreadPool pool(3);
  std::mt19937 rng(4242);
  auto simd = make_kernel("naive", "{}");
  auto portable = make_kernel("naive", "{simd: off}");
  for (KvDtype dtype : {KvDtype::kF32, KvDtype::kF16, KvDtype::kQ8_0}) {
    for (int32_t block_size : {1, 16}) {
      for (float q_scale : {3.0f, 40.0f}) {  // 40: probabilities underflow to exactly 0
        Problem p = make_problem(rng, 9, 3, 64, block_size, dtype, random_batch(rng), q_scale);
        p.shape.sliding_window = block_size == 16 ? 37 : 0;  // and with a sliding window
        const std::vector<float> a = run_kernel(*simd, p, pool);
        const std::vector<float> b = run_kernel(*portable, p, pool);
        CAPTURE(kv_dtype_name(dtype));
        CAPTURE(block_size);
        CAPTURE(q_scale);
        CHECK(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
      }
    }
  }
}

TEST_CASE("attention.flash: the AVX-512 build gives the AVX2 build's bits") {
  // The AVX-512 build keeps a score loop's query rows in zmm registers and runs P * V 16 lanes
  // at a time, but each lane performs the AVX2 build's operations in its order, so the outputs
  // must agree exactly. head_dim 64 and 128 take the zmm score loop, 96 the AVX2 one inside the
  // AVX-512 build; 9/3 heads put three query heads on a KV head, 8/4 two, 4/4 one (whose scores
  // are never the zmm loop's). Prompts, a few decodes, and enough decodes for whole-sequence
  // tasks, with and without a sliding window.
  if (!cpu_has_avx512()) {
    MESSAGE("CPU lacks AVX-512 F/BW/VL: only the AVX2 and portable builds run here");
    return;
  }
  ThreadPool pool(2);
  std::mt19937 rng(5150);
  auto wide = make_kernel("flash", "{simd: auto, tile_size: 16}");
  auto avx2 = make_kernel("flash", "{simd: avx2, tile_size: 16}");
  const std::vector<SeqSpec> many_decodes = {{70, 1}, {83, 1}, {5, 1}, {129, 1}, {64, 1},
                                             {65, 1}, {1, 1}, {200, 1}, {17, 1}, {128, 1}};
  for (KvDtype dtype : {KvDtype::kF32, KvDtype::kF16, KvDtype::kQ8_0}) {
    for (int32_t head_dim : {64, 96, 128}) {
      for (const auto [heads, kv_heads] : {std::pair{9, 3}, std::pair{8, 4}, std::pair{4, 4}}) {
        for (int32_t window : {0, 37}) {
          for (int batch = 0; batch < 2; ++batch) {
            Problem p = make_problem(rng, heads, kv_heads, head_dim, 16, dtype,
                                     batch == 0 ? random_batch(rng) : many_decodes);
            p.shape.sliding_window = window;
            const std::vector<float> a = run_kernel(*wide, p, pool);
            const std::vector<float> b = run_kernel(*avx2, p, pool);
            CAPTURE(kv_dtype_name(dtype));
            CAPTURE(head_dim);
            CAPTURE(heads);
            CAPTURE(window);
            CAPTURE(batch);
            CHECK(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
            CHECK(max_abs_diff(a, reference(p)) <= tolerance(p.shape));
          }
        }
      }
    }
  }
  // Mixed pools (K q8_0, V f16) go through widened tiles on every path.
  Problem mixed = make_problem(rng, 9, 3, 64, 16, KvDtype::kQ8_0, KvDtype::kF16, random_batch(rng));
  const std::vector<float> a = run_kernel(*wide, mixed, pool);
  const std::vector<float> b = run_kernel(*avx2, mixed, pool);
  CHECK(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

TEST_CASE("attention.flash: one-query tasks (K/V read in place, heads split) give the tiled path's bits") {
  // Decode rows skip the widened K/V tile and, in small batches, run one task per query head;
  // both only reorganize work, so each output row must be bit-identical to the tiled loop's.
  // query_tile 1 sends every prompt row through the one-query path; query_tile 64 keeps
  // prompt rows on the tiled path; a batch of decodes alone (1 and 2 sequences on 2 threads)
  // is split per head, which a decode mixed into a prompt batch is not.
  ThreadPool pool(2);
  std::mt19937 rng(777);
  for (KvDtype dtype : {KvDtype::kF32, KvDtype::kF16, KvDtype::kQ8_0}) {
    for (const std::string simd : {"auto", "avx2", "off"}) {
      auto one_query = make_kernel("flash", "{query_tile: 1, tile_size: 16, simd: " + simd + "}");
      auto tiled = make_kernel("flash", "{query_tile: 64, tile_size: 16, simd: " + simd + "}");
      CAPTURE(kv_dtype_name(dtype));
      CAPTURE(simd);
      const Problem prompts = make_problem(rng, 9, 3, 64, 16, dtype, {{150, 40}, {33, 33}});
      const std::vector<float> a = run_kernel(*one_query, prompts, pool);
      const std::vector<float> b = run_kernel(*tiled, prompts, pool);
      CHECK(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
      for (int batch_size : {4, 10}) {
        CAPTURE(batch_size);
        // Four decodes together are 12 (sequence, KV head) tasks, enough for 2 threads: not
        // split. Ten together are 30: one task per sequence, all its KV heads. Each decode alone
        // is 3 tasks: split per query head. Its row must not change.
        const Problem decodes = make_problem(
            rng, 9, 3, 64, 16, dtype,
            batch_size == 4 ? std::vector<SeqSpec>{{70, 1}, {83, 1}, {5, 1}, {129, 1}}
                            : std::vector<SeqSpec>{{70, 1}, {83, 1}, {5, 1}, {129, 1}, {64, 1},
                                                   {65, 1}, {1, 1}, {200, 1}, {17, 1}, {128, 1}});
        const std::vector<float> together = run_kernel(*tiled, decodes, pool);
        CHECK(max_abs_diff(together, reference(decodes)) <= tolerance(decodes.shape));
        const size_t row = static_cast<size_t>(decodes.shape.num_heads) * decodes.shape.head_dim;
        for (size_t i = 0; i < decodes.sequences.size(); ++i) {
          Problem alone = decodes;  // same pools and tables, one sequence, its query row only
          alone.sequences = {decodes.sequences[i]};
          alone.sequences[0].query_start = 0;
          alone.q.assign(decodes.q.begin() + i * row, decodes.q.begin() + (i + 1) * row);
          alone.num_rows = 1;
          const std::vector<float> split = run_kernel(*tiled, alone, pool);
          CAPTURE(i);
          CHECK(std::memcmp(split.data(), together.data() + i * row, row * sizeof(float)) == 0);
        }
      }
    }
  }
}
