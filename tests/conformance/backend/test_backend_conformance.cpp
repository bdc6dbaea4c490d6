// Every backend plugin (the built-in cpu, the build's and any on TESSERA_PLUGIN_PATH), each op
// against a scalar reference written here in double precision, on the backend's own memory
// (allocate, copy_to_device, op, copy_to_host): allocation is zeroed; copies round-trip;
// rms_norm, rope (adjacent pairs and NeoX halves, partial rotary), silu_mul, gelu_mul (when
// offered), add and store_kv (f32 exact, f16 as the SDK's fp32_to_fp16) match; the executor
// covers [0, n) exactly once; a declared forward_runner capability is implemented. A device
// backend that cannot start here (no GPU) is reported and skipped.
#include <doctest/doctest.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "support/plugins.h"
#include "support/random_data.h"
#include "tessera/sdk.h"
#include "tessera/sdk/kernels/ggml_types.h"

using namespace tessera;
using test::random_floats;

namespace {

// A buffer in the backend's memory, filled from and read back to the host.
class DeviceBuffer {
 public:
  DeviceBuffer(Backend& b, size_t bytes) : b_(b), bytes_(bytes), ptr_(b.allocate(bytes)) { REQUIRE(ptr_ != nullptr); }
  template <class T>
  DeviceBuffer(Backend& b, const std::vector<T>& host) : DeviceBuffer(b, host.size() * sizeof(T)) {
    b_.copy_to_device(ptr_, host.data(), bytes_);
  }
  ~DeviceBuffer() { b_.release(ptr_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  template <class T>
  std::vector<T> read() const {
    std::vector<T> out(bytes_ / sizeof(T));
    b_.copy_to_host(out.data(), ptr_, bytes_);
    return out;
  }
  template <class T>
  T* as() { return static_cast<T*>(ptr_); }

 private:
  Backend& b_;
  size_t bytes_;
  void* ptr_;
};

void check_close(const std::vector<float>& got, const std::vector<double>& want, double rel, double abs) {
  REQUIRE(got.size() == want.size());
  int bad = 0;
  for (size_t i = 0; i < got.size(); ++i)
    if (!(std::fabs(got[i] - want[i]) <= rel * std::fabs(want[i]) + abs) && bad++ < 5)
      FAIL_CHECK("element " << i << ": got " << got[i] << ", reference " << want[i]);
  CHECK(bad == 0);
}

void check_rope(Backend& b, bool neox, int32_t head_dim, int32_t rotary_dim) {
  INFO("rope neox=" << neox << " head_dim=" << head_dim << " rotary_dim=" << rotary_dim);
  constexpr int64_t kRows = 6;
  constexpr int32_t kHeads = 3;
  const std::vector<int32_t> positions = {0, 1, 7, 63, 500, 4000};
  const std::vector<float> x = random_floats(kRows * kHeads * head_dim, 11);
  RopeParams p;
  p.head_dim = head_dim;
  p.rotary_dim = rotary_dim;
  p.freq_base = 10000.0f;
  p.freq_scale = 0.5f;
  p.neox = neox;
  std::vector<double> want(x.begin(), x.end());
  for (int64_t r = 0; r < kRows; ++r)
    for (int32_t h = 0; h < kHeads; ++h)
      for (int32_t i = 0; i < rotary_dim / 2; ++i) {
        const double theta = positions[r] * static_cast<double>(p.freq_scale) *
                             std::pow(static_cast<double>(p.freq_base), -2.0 * i / rotary_dim);
        const int64_t base = (r * kHeads + h) * head_dim;
        const int64_t a = base + (neox ? i : 2 * i);
        const int64_t c = base + (neox ? i + rotary_dim / 2 : 2 * i + 1);
        want[a] = x[a] * std::cos(theta) - x[c] * std::sin(theta);
        want[c] = x[a] * std::sin(theta) + x[c] * std::cos(theta);
      }
  DeviceBuffer dx(b, x);
  DeviceBuffer dpos(b, positions);
  b.rope(dx.as<float>(), dpos.as<int32_t>(), kRows, kHeads, p);
  // float angles at position 4000: theta rounds to ~2e-4 rad, so the values to ~1e-3.
  check_close(dx.read<float>(), want, 1e-3, 2e-3);
}

std::shared_ptr<Backend> create_backend(const std::string& name, std::string* why_not) {
  try {
    return test::create_plugin<Backend>(name, test::conformance_params(PluginKind::kBackend, name, "{}"));
  } catch (const std::exception& e) {
    *why_not = e.what();
    return nullptr;
  }
}

}  // namespace

TEST_CASE("every backend's ops match the scalar reference") {
  test::check_no_load_errors();
  const auto names = test::plugin_names(PluginKind::kBackend);
  REQUIRE(!names.empty());
  int num_checked = 0;
  for (const std::string& name : names) {
    INFO("backend." << name);
    std::string why_not;
    auto b = create_backend(name, &why_not);
    if (!b) {
      // The CPU backend must always start; a device backend needs its device.
      REQUIRE_MESSAGE(name != "cpu", why_not);
      MESSAGE("backend." << name << " skipped: it cannot start on this machine: " << why_not);
      continue;
    }
    ++num_checked;
    CHECK((dynamic_cast<ForwardRunnerProvider*>(b.get()) != nullptr) ==
          test::declares(PluginKind::kBackend, name, kCapabilityForwardRunner));

    // Memory: zeroed on allocation; device -> device copies and round trips keep the bytes.
    {
      DeviceBuffer zero(*b, 4096);
      for (uint8_t v : zero.read<uint8_t>()) REQUIRE(v == 0);
      const std::vector<float> data = random_floats(1000, 3);
      DeviceBuffer src(*b, data);
      DeviceBuffer dst(*b, data.size() * sizeof(float));
      b->copy_on_device(dst.as<void>(), src.as<void>(), data.size() * sizeof(float));
      CHECK(dst.read<float>() == data);
    }

    // rms_norm: out[r] = in[r] / sqrt(mean(in[r]^2) + eps) * weight.
    {
      constexpr int64_t kRows = 5, kDim = 576;
      const std::vector<float> in = random_floats(kRows * kDim, 4, 3.0f), w = random_floats(kDim, 5);
      std::vector<double> want(kRows * kDim);
      for (int64_t r = 0; r < kRows; ++r) {
        double ss = 0.0;
        for (int64_t i = 0; i < kDim; ++i) ss += static_cast<double>(in[r * kDim + i]) * in[r * kDim + i];
        const double scale = 1.0 / std::sqrt(ss / kDim + 1e-5);
        for (int64_t i = 0; i < kDim; ++i) want[r * kDim + i] = in[r * kDim + i] * scale * w[i];
      }
      DeviceBuffer din(*b, in), dw(*b, w), dout(*b, in.size() * sizeof(float));
      b->rms_norm(dout.as<float>(), din.as<float>(), dw.as<float>(), kRows, kDim, 1e-5f);
      check_close(dout.read<float>(), want, 1e-5, 1e-6);
    }

    check_rope(*b, false, 64, 64);
    check_rope(*b, true, 64, 64);
    check_rope(*b, true, 128, 64);

    // silu_mul, gelu_mul (tanh form; the CPU's f16 table rounds to ~1e-3), add.
    {
      const int64_t n = 20000;  // past the CPU backend's serial threshold, and not a multiple of 8
      const std::vector<float> gate = random_floats(n + 3, 6, 4.0f), up = random_floats(n + 3, 7);
      std::vector<double> silu(n + 3), gelu(n + 3), sum(n + 3);
      for (int64_t i = 0; i < n + 3; ++i) {
        const double g = gate[i];
        silu[i] = g / (1.0 + std::exp(-g)) * up[i];
        gelu[i] = 0.5 * g * (1.0 + std::tanh(std::sqrt(2.0 / M_PI) * (g + 0.044715 * g * g * g))) * up[i];
        sum[i] = static_cast<double>(gate[i]) + up[i];
      }
      DeviceBuffer dg(*b, gate), du(*b, up);
      b->silu_mul(dg.as<float>(), du.as<float>(), n + 3);
      check_close(dg.read<float>(), silu, 1e-5, 1e-6);
      DeviceBuffer dg2(*b, gate);
      if (b->gelu_mul(dg2.as<float>(), du.as<float>(), n + 3))
        check_close(dg2.read<float>(), gelu, 2e-3, 2e-3);
      else
        MESSAGE("backend." << name << " does not offer gelu_mul");
      DeviceBuffer da(*b, gate);
      b->add(da.as<float>(), du.as<float>(), n + 3);
      check_close(da.read<float>(), sum, 1e-7, 0.0);
    }

    // store_kv: rows land at their slots, f32 exactly, f16 as fp32_to_fp16 rounds them; the
    // other slots stay zero.
    {
      constexpr int64_t kRows = 4, kElems = 128, kSlots = 16;
      const std::vector<float> src = random_floats(kRows * kElems, 8);
      const std::vector<int32_t> slots = {9, 0, 15, 3};
      DeviceBuffer dsrc(*b, src), dslots(*b, slots);
      DeviceBuffer f32_pool(*b, kSlots * kElems * sizeof(float));
      b->store_kv(f32_pool.as<void>(), KvDtype::kF32, dsrc.as<float>(), dslots.as<int32_t>(), kRows, kElems);
      DeviceBuffer f16_pool(*b, kSlots * kElems * sizeof(uint16_t));
      b->store_kv(f16_pool.as<void>(), KvDtype::kF16, dsrc.as<float>(), dslots.as<int32_t>(), kRows, kElems);
      std::vector<float> want32(kSlots * kElems, 0.0f);
      std::vector<uint16_t> want16(kSlots * kElems, 0);
      for (int64_t r = 0; r < kRows; ++r)
        for (int64_t i = 0; i < kElems; ++i) {
          want32[slots[r] * kElems + i] = src[r * kElems + i];
          want16[slots[r] * kElems + i] = fp32_to_fp16(src[r * kElems + i]);
        }
      CHECK(f32_pool.read<float>() == want32);
      CHECK(f16_pool.read<uint16_t>() == want16);
    }

    // The executor: every index once, whatever the split.
    for (int64_t n : {1, 7, 1000}) {
      std::vector<std::atomic<int>> hits(n);
      std::atomic<int> bad_thread{0};
      const int num_threads = b->executor().num_threads();
      b->executor().run(n, [&](int64_t begin, int64_t end, int thread) {
        if (thread < 0 || thread >= num_threads) ++bad_thread;
        for (int64_t i = begin; i < end; ++i) hits[i]++;
      });
      CHECK(bad_thread.load() == 0);
      for (auto& h : hits) CHECK(h.load() == 1);
    }
    CHECK(b->executor().num_threads() >= 1);
  }
  CHECK(num_checked >= 1);
}
