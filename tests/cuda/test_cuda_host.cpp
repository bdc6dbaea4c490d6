// Host-side logic of the CUDA plugins that needs no GPU (runs on every machine where the CUDA
// plugins are built): the prefill work plan covers each (query, head) exactly once, split-K
// choices stay in range, block sizes of the weight formats match the CPU's, and backend.cuda
// fails cleanly (naming the reason) when no device is present.
#include <doctest/doctest.h>

#include <cuda_runtime_api.h>

#include <map>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "tessera/sdk/kernels/cuda.h"
#include "support/plugins.h"
#include "tessera/ggml_types.h"
#include "tessera/sdk/forward.h"

namespace tc = tessera::cuda;

TEST_CASE("plan_prefill covers every (sequence, query, head) once, within one KV head per item") {
  for (auto [heads, kv_heads] : std::vector<std::pair<int, int>>{{9, 3}, {32, 8}, {4, 4}, {40, 2}, {64, 1}}) {
    CAPTURE(heads);
    CAPTURE(kv_heads);
    const tc::AttnShape sh{heads, kv_heads, 64, 0.125f, 16, true};
    std::vector<tc::AttnSeq> seqs = {{0, 37, 37, 0, nullptr}, {37, 1, 80, 0, nullptr}, {38, 20, 100, 0, nullptr},
                                     {58, 5, 5, 0, nullptr}};
    std::vector<tc::AttnWork> work(tc::count_prefill_work(sh, seqs.data(), seqs.size()));
    tc::plan_prefill(sh, seqs.data(), seqs.size(), work.data());
    std::map<std::tuple<int, int, int>, int> seen;
    const int group = heads / kv_heads;
    for (const auto& w : work) {
      CHECK(w.num_queries * w.num_heads <= tc::kAttnRowsPerCta);
      CHECK(w.num_queries >= 1);
      CHECK(w.head_begin / group == (w.head_begin + w.num_heads - 1) / group);  // one KV head
      for (int q = w.first_query; q < w.first_query + w.num_queries; ++q)
        for (int h = w.head_begin; h < w.head_begin + w.num_heads; ++h) ++seen[{w.seq, q, h}];
    }
    size_t expected = 0;
    for (const auto& s : seqs) expected += static_cast<size_t>(s.num_queries) * heads;
    CHECK(seen.size() == expected);
    for (const auto& [key, count] : seen) CHECK(count == 1);
  }
}

TEST_CASE("decode split choice and scratch size") {
  const tc::AttnShape sh{32, 8, 128, 0.088f, 16, true};
  CHECK(tc::choose_decode_splits(sh, 1, 4096, 132) > 1);   // one sequence: split the context
  CHECK(tc::choose_decode_splits(sh, 256, 4096, 132) == 1);  // enough CTAs already
  CHECK(tc::choose_decode_splits(sh, 1, 16, 132) == 1);     // nothing to split
  CHECK(tc::choose_decode_splits(sh, 1, 160, 132) == 5);    // down to one 32-key tile per split
  for (int n : {1, 3, 64, 1000}) {
    const int s = tc::choose_decode_splits(sh, n, 2048, 132);
    CHECK(s >= 1);
    CHECK(s <= 64);
  }
  CHECK(tc::decode_scratch_bytes(sh, 2, 4) == sizeof(float) * 2 * 32 * 4 * 130);
  CHECK(tc::attention_supported(64));
  CHECK(tc::attention_supported(128));
  CHECK_FALSE(tc::attention_supported(80));
}

TEST_CASE("weight formats: row sizes agree with the CPU's GGML tables") {
  for (auto t : {tessera::GgmlType::F32, tessera::GgmlType::F16, tessera::GgmlType::BF16, tessera::GgmlType::Q4_0,
                 tessera::GgmlType::Q4_1, tessera::GgmlType::Q8_0}) {
    CAPTURE(tessera::ggml_type_name(t));
    CHECK(tc::format_supported(static_cast<uint32_t>(t)));
    CHECK(tc::format_row_bytes(static_cast<uint32_t>(t), 4096) == tessera::ggml_row_size(t, 4096));
  }
  CHECK_FALSE(tc::format_supported(static_cast<uint32_t>(tessera::GgmlType::Q4_K)));
}

TEST_CASE("backend.cuda and attention.cuda-flash load; without a GPU the backend says so") {
  auto attention = tessera::test::create_plugin<tessera::AttentionKernel>("cuda-flash", "{}");
  auto* device = dynamic_cast<tessera::DeviceAttentionKernel*>(attention.get());
  REQUIRE(device != nullptr);
  CHECK(std::string(device->device_name()) == "cuda");
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    try {
      tessera::test::create_plugin<tessera::Backend>("cuda", "{}");
      FAIL("backend.cuda was created without a CUDA device");
    } catch (const std::exception& e) {
      CHECK(std::string(e.what()).find("no CUDA device") != std::string::npos);
    }
  } else {
    auto backend = tessera::test::create_plugin<tessera::Backend>("cuda", "{}");
    CHECK(dynamic_cast<tessera::ForwardRunnerProvider*>(backend.get()) != nullptr);
  }
}
