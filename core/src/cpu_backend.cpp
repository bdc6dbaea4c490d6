#include "tessera/cpu_backend.h"

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <new>

#include "tessera/cpu_kernels.h"
#include "tessera/ggml_types.h"
#include "tessera/huge_buffer.h"

namespace tessera {

CpuBackend::CpuBackend(int num_threads) : pool_(num_threads) {}

void* CpuBackend::allocate(size_t bytes) {
  // At least 64-byte alignment for SIMD loads, huge pages for the large KV pools (see
  // huge_buffer.h); zeroed so unused KV slots hold no garbage.
  return allocate_huge_zeroed(bytes);
}
void CpuBackend::release(void* ptr) { std::free(ptr); }
void CpuBackend::copy_to_device(void* dst, const void* src, size_t bytes) { std::memcpy(dst, src, bytes); }
void CpuBackend::copy_to_host(void* dst, const void* src, size_t bytes) { std::memcpy(dst, src, bytes); }
void CpuBackend::copy_on_device(void* dst, const void* src, size_t bytes) { std::memmove(dst, src, bytes); }

void CpuBackend::rms_norm(float* out, const float* in, const float* weight, int64_t rows,
                          int64_t dim, float eps) {
  // Each row's sum of squares is ggml's: x[i] * x[i] in float, added in double in element
  // order, so norms match llama.cpp's bit for bit. That order is a chain of dependent double
  // adds (~3 cycles each, 2-3 % of a serving profile), so kRowsAtOnce rows run side by side:
  // independent chains the core overlaps, each in its own row's order (the same bits).
  constexpr int64_t kRowsAtOnce = 4;
  const auto normalize = [&](int64_t r, double sum) {
    const float* x = in + r * dim;
    float* y = out + r * dim;
    const float mean = static_cast<float>(sum / static_cast<double>(dim));
    const float scale = 1.0f / std::sqrt(mean + eps);
    for (int64_t i = 0; i < dim; ++i) y[i] = (x[i] * scale) * weight[i];
  };
  pool_.run(rows, [&](int64_t begin, int64_t end, int) {
    int64_t r = begin;
    for (; r + kRowsAtOnce <= end; r += kRowsAtOnce) {
      const float* x = in + r * dim;
      double sum[kRowsAtOnce] = {0.0, 0.0, 0.0, 0.0};
      for (int64_t i = 0; i < dim; ++i)
        for (int64_t k = 0; k < kRowsAtOnce; ++k) {
          const float v = x[k * dim + i];
          sum[k] += static_cast<double>(v * v);
        }
      for (int64_t k = 0; k < kRowsAtOnce; ++k) normalize(r + k, sum[k]);
    }
    for (; r < end; ++r) {
      const float* x = in + r * dim;
      double sum = 0.0;
      for (int64_t i = 0; i < dim; ++i) sum += static_cast<double>(x[i] * x[i]);
      normalize(r, sum);
    }
  });
}

void CpuBackend::rope(float* x, const int32_t* positions, int64_t rows, int32_t num_heads,
                      const RopeParams& p) {
  // theta_i = pos * base^(-2i/rot), built by repeated multiplication in float exactly like
  // ggml's rope so positions far into the context round the same way.
  const RopeRowsArgs args{x,          positions, num_heads, p.head_dim, p.rotary_dim,
                          p.neox,     p.freq_scale,
                          std::pow(p.freq_base, -2.0f / static_cast<float>(p.rotary_dim))};
  pool_.run(rows, [&](int64_t begin, int64_t end, int) { rope_rows(args, begin, end); });
}

void CpuBackend::silu_mul(float* gate, const float* up, int64_t n) {
  // llama.cpp's SwiGLU uses its vectorized exp on whole groups of 8 and libm's expf on the
  // tail; the FFN width is a multiple of 8 in every supported model, so ggml_expf throughout.
  // A decode batch's few thousand elements take about a microsecond: less than a parallel
  // pass and its barrier would cost, so small inputs stay on the calling thread.
  constexpr int64_t kSerialElements = 8192;
  if (n <= kSerialElements) {
    silu_mul_range(gate, up, 0, n);
    return;
  }
  pool_.run(n, [&](int64_t begin, int64_t end, int) { silu_mul_range(gate, up, begin, end); });
}

bool CpuBackend::gelu_mul(float* gate, const float* up, int64_t n) {
  constexpr int64_t kSerialElements = 8192;  // as silu_mul: small inputs stay on this thread
  if (n <= kSerialElements) {
    gelu_mul_range(gate, up, 0, n);
  } else {
    pool_.run(n, [&](int64_t begin, int64_t end, int) { gelu_mul_range(gate, up, begin, end); });
  }
  return true;
}

void CpuBackend::add(float* inout, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) inout[i] += x[i];
}

void CpuBackend::store_kv(void* pool, KvDtype dtype, const float* src, const int32_t* slots,
                          int64_t rows, int64_t row_elems) {
  const size_t row_bytes = kv_row_bytes(dtype, row_elems);
  for (int64_t r = 0; r < rows; ++r) {
    const float* s = src + r * row_elems;
    void* dst = static_cast<uint8_t*>(pool) + static_cast<size_t>(slots[r]) * row_bytes;
    if (dtype == KvDtype::kF32) {
      std::memcpy(dst, s, row_elems * sizeof(float));
    } else if (dtype == KvDtype::kF16) {
      fp32_to_fp16_row(s, static_cast<uint16_t*>(dst), row_elems);
    } else {
      // Q8_0 blocks of 32 along the row (heads are multiples of 32, so no block straddles
      // two heads), quantized as llama.cpp quantizes a q8_0 KV cache on x86: its run-time
      // quantize_row_q8_0 (inverse scale 127/amax, round half to even; AVX2 when available,
      // the portable version writes the same bytes).
      quantize_activation_row(GgmlType::Q8_0, s, dst, row_elems);
    }
  }
}

namespace {
const ParamSpec kCpuParams[] = {
    {"threads", ParamType::kInt, "0",
     "worker threads including the caller; 0 uses model.threads or all hardware threads", 0,
     kMaxThreadPoolThreads},
};
}  // namespace

Status CpuBackend::create(const PluginConfig& config, const PluginContext&,
                          std::unique_ptr<Backend>* out) {
  const int threads = static_cast<int>(config.get_int("threads", 0));
  try {
    *out = std::make_unique<CpuBackend>(threads);
  } catch (const std::exception& e) {
    return invalid_argument(config.key_path() + ".threads: " + e.what());
  }
  return Status::ok();
}

const PluginManifest* cpu_backend_manifest() {
  static const PluginManifest manifest = {
      TESSERA_PLUGIN_MANIFEST_HEADER,
      PluginKind::kBackend,
      "cpu",
      "0.1.0",
      "CPU backend built into the core: host memory, thread pool, element-wise kernels",
      PluginStatus::kStable,
      kCpuParams,
      sizeof(kCpuParams) / sizeof(kCpuParams[0]),
      &detail::create_plugin<CpuBackend, Backend>,
      &detail::destroy_plugin<Backend>,
      "",   // capabilities: the core's ModelRunner drives it (no ForwardRunnerProvider)
      "",   // needs
      static_cast<uint32_t>(sizeof(ParamSpec))};
  return &manifest;
}

}  // namespace tessera
