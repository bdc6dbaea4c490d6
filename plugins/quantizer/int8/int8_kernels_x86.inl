// The W8A8 matmul for x86, compiled twice (int8_kernels_avx2.cpp, int8_kernels_avxvnni.cpp)
// with TESSERA_INT8_SUFFIX naming the build and TESSERA_INT8_VNNI set for AVX-VNNI.
//
// Per 4 columns: one 32-byte load of the weight chunk (4 columns x 8 rows, int8x8 layout in
// int8_kernels.h) and, per token, a broadcast of its 4 activation bytes. The 4 products of
// each lane are added into that lane's (that row's) int32 sum:
//   AVX-VNNI: vpdpbusd(acc, x + 128 (u8), w (s8)), one instruction; the 128 * sum(w) it adds
//             is subtracted at the end with the row sums.
//   AVX2:     vpmaddubsw(|w| (u8), sign(x, w) (s8)) -> int16 pairs (|products| <= 2 * 127 * 127,
//             no saturation), vpmaddwd with ones -> int32, vpaddd.
// A tile is 8 rows x NT tokens: each weight chunk is loaded once for NT tokens. Small tiles
// (decode) keep several independent accumulators along k, so the loop is not bound by the
// latency of one dependency chain.
#include <immintrin.h>

#include <cstring>

#include "int8_kernels.h"

#define TESSERA_INT8_CAT2(a, b) a##_##b
#define TESSERA_INT8_CAT(a, b) TESSERA_INT8_CAT2(a, b)
#define TESSERA_INT8_NAME(name) TESSERA_INT8_CAT(name, TESSERA_INT8_SUFFIX)

namespace tessera::int8_w8a8 {
namespace {

inline __m256i broadcast_word(const uint8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return _mm256_set1_epi32(v);
}

// acc[t] += the 8 rows' products with token t over the 4 columns of chunk `w`.
template <int NT>
inline void add_chunk(__m256i w, const uint8_t* const* x, int64_t c, __m256i* acc) {
#if defined(TESSERA_INT8_VNNI)
  for (int t = 0; t < NT; ++t) acc[t] = _mm256_dpbusd_avx_epi32(acc[t], broadcast_word(x[t] + c), w);
#else
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i abs_w = _mm256_abs_epi8(w);
  for (int t = 0; t < NT; ++t) {
    const __m256i signed_x = _mm256_sign_epi8(broadcast_word(x[t] + c), w);
    acc[t] = _mm256_add_epi32(acc[t], _mm256_madd_epi16(_mm256_maddubs_epi16(abs_w, signed_x), ones));
  }
#endif
}

// One group of 8 rows (`group`, its scales and row sums) times NT tokens starting at token t0.
template <int NT>
void tile(const int8_t* group, const float* scale, const int32_t* row_sum, int64_t kp,
          const Activations& xs, int64_t t0, float* y, int64_t y_stride, int64_t valid_rows) {
  // Independent accumulators along k for small tiles (NT * KU chains in flight).
  constexpr int KU = NT >= 4 ? 1 : (NT == 1 ? 4 : 2);
  const uint8_t* x[NT];
  for (int t = 0; t < NT; ++t) x[t] = xs.q + (t0 + t) * xs.stride;
  __m256i acc[KU][NT];
  for (int u = 0; u < KU; ++u)
    for (int t = 0; t < NT; ++t) acc[u][t] = _mm256_setzero_si256();
  for (int64_t c = 0; c < kp; c += 4 * KU) {
    for (int u = 0; u < KU; ++u) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(group + (c + 4 * u) * 8));
      add_chunk<NT>(w, x, c + 4 * u, acc[u]);
    }
  }
  const __m256 row_scale = _mm256_loadu_ps(scale);
#if defined(TESSERA_INT8_VNNI)
  const __m256i surplus = _mm256_slli_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row_sum)), 7);
#else
  (void)row_sum;
#endif
  for (int t = 0; t < NT; ++t) {
    __m256i sum = acc[0][t];
    for (int u = 1; u < KU; ++u) sum = _mm256_add_epi32(sum, acc[u][t]);
#if defined(TESSERA_INT8_VNNI)
    sum = _mm256_sub_epi32(sum, surplus);
#endif
    const __m256 out = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(sum), row_scale),
                                     _mm256_set1_ps(xs.scale[t0 + t]));
    float* dst = y + (t0 + t) * y_stride;
    if (valid_rows == kGroupRows) {
      _mm256_storeu_ps(dst, out);
    } else {
      alignas(32) float tmp[kGroupRows];
      _mm256_store_ps(tmp, out);
      std::memcpy(dst, tmp, static_cast<size_t>(valid_rows) * sizeof(float));
    }
  }
}

}  // namespace

void TESSERA_INT8_NAME(gemm)(const PackedWeight& w, int64_t row_begin, int64_t row_end,
                             const Activations& x, int64_t num_tokens, float* y, int64_t y_stride) {
  const int64_t kp = w.padded_cols;
  for (int64_t r = row_begin; r < row_end; r += kGroupRows) {
    const int8_t* group = w.groups + r * kp;  // r is a multiple of 8: group r / 8
    const int64_t valid = std::min<int64_t>(kGroupRows, row_end - r);
    int64_t t = 0;
    for (; t + 4 <= num_tokens; t += 4)
      tile<4>(group, w.scale + r, w.row_sum + r, kp, x, t, y + r, y_stride, valid);
    switch (num_tokens - t) {
      case 3: tile<3>(group, w.scale + r, w.row_sum + r, kp, x, t, y + r, y_stride, valid); break;
      case 2: tile<2>(group, w.scale + r, w.row_sum + r, kp, x, t, y + r, y_stride, valid); break;
      case 1: tile<1>(group, w.scale + r, w.row_sum + r, kp, x, t, y + r, y_stride, valid); break;
      default: break;
    }
  }
}

#if !defined(TESSERA_INT8_VNNI)
// Same bytes as quantize_token_scalar: the max is exact in any order, x * (127 / amax) is one
// rounding, and vcvtps2dq rounds to nearest even as nearbyint does in the default mode.
float quantize_token_avx2(const float* x, int64_t cols, int64_t padded, bool offset_128, uint8_t* out) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 vmax = _mm256_setzero_ps();
  int64_t c = 0;
  for (; c + 8 <= cols; c += 8) vmax = _mm256_max_ps(vmax, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + c)));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vmax);
  float amax = 0.0f;
  for (float v : lanes) amax = std::max(amax, v);
  for (; c < cols; ++c) amax = std::max(amax, std::fabs(x[c]));
  const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
  const __m256 vinv = _mm256_set1_ps(inv);
  const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
  const __m256i offset = _mm256_set1_epi32(offset_128 ? 128 : 0);
  alignas(32) int32_t q[8];
  for (c = 0; c + 8 <= cols; c += 8) {
    __m256i v = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + c), vinv));
    v = _mm256_add_epi32(_mm256_min_epi32(_mm256_max_epi32(v, lo), hi), offset);
    _mm256_store_si256(reinterpret_cast<__m256i*>(q), v);
    for (int i = 0; i < 8; ++i) out[c + i] = static_cast<uint8_t>(q[i]);
  }
  const int32_t off = offset_128 ? 128 : 0;
  for (; c < cols; ++c) out[c] = static_cast<uint8_t>(round_clamp(x[c] * inv) + off);
  for (; c < padded; ++c) out[c] = static_cast<uint8_t>(off);
  return amax / 127.0f;
}
#endif

}  // namespace tessera::int8_w8a8
