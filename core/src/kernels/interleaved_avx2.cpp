// AVX2 kernel of the interleaved Q4_1 layout (tessera/interleaved.h). Lane j of every vector
// belongs to weight row j of the group: one vpmaddubsw of 32 unpacked quants (4 per row)
// against one activation word broadcast to all lanes gives each row's partial sums in its own
// two int16 lanes, so the 32-element block sum builds up vertically and exactly (8 products of
// at most 2 * 15 * 127 fit int16), and is widened, converted and scaled once per 8 rows.
//
// Compiled with -mavx2 -mfma -mf16c; called only after cpu_has_avx2().
#if defined(__x86_64__) || defined(__i386__)

#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "quant_blocks.h"

#include "tessera/fp_contract_off.h"

namespace tessera::kernels {

namespace {

// Activation rows per pass of a group: each unpacked weight vector is used for this many rows.
constexpr int kMaxTokens = 4;
// Weight bytes a pass prefetches ahead: decode streams each weight once per step from DRAM
// (see quant_avx2.cpp).
constexpr size_t kPrefetchBytes = 4096;
// Weight bytes per panel: a panel of groups stays in L1 while every chunk of activation rows
// passes over it, so a matrix streams from memory once per matmul.
constexpr size_t kPanelBytes = 16 * 1024;

inline __m256i broadcast_word(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return _mm256_set1_epi32(v);
}

// One group of 8 rows against T activation rows. xsc[t]: (d_x, s_x) floats per block of row t.
// Named accumulators rather than arrays: with arrays GCC kept them on the stack.
template <int T>
void group_pass(int64_t nb, const BlockQ4_1x8* w, const uint8_t* x, size_t x_stride,
                const float* const* xsc, bool prefetch, float* y, int64_t y_stride, int rows) {
  static_assert(T >= 1 && T <= 4);
  const __m256i low_mask = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  const auto* x0 = reinterpret_cast<const BlockQ8_1*>(x);
  const auto* x1 = reinterpret_cast<const BlockQ8_1*>(x + (T > 1 ? 1 : 0) * x_stride);
  const auto* x2 = reinterpret_cast<const BlockQ8_1*>(x + (T > 2 ? 2 : 0) * x_stride);
  const auto* x3 = reinterpret_cast<const BlockQ8_1*>(x + (T > 3 ? 3 : 0) * x_stride);
  const float* c0 = xsc[0];
  const float* c1 = xsc[T > 1 ? 1 : 0];
  const float* c2 = xsc[T > 2 ? 2 : 0];
  const float* c3 = xsc[T > 3 ? 3 : 0];
  const char* wbytes = reinterpret_cast<const char*>(w);
  for (int64_t ib = 0; ib < nb; ++ib) {
    if (prefetch) {
      const char* a = wbytes + ib * sizeof(BlockQ4_1x8) + kPrefetchBytes;
      _mm_prefetch(a, _MM_HINT_T0);
      _mm_prefetch(a + 64, _MM_HINT_T0);
      _mm_prefetch(a + 128, _MM_HINT_T0);
    }
    const BlockQ4_1x8& b = w[ib];
    __m256i s0 = _mm256_setzero_si256(), s1 = s0, s2 = s0, s3 = s0;
    const int8_t* q0 = x0[ib].qs;
    const int8_t* q1 = x1[ib].qs;
    const int8_t* q2 = x2[ib].qs;
    const int8_t* q3 = x3[ib].qs;
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) {
      const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.qs + 32 * k));
      const __m256i lo = _mm256_and_si256(packed, low_mask);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low_mask);
      // Row t's two products of this chunk go into its int16 sums (exact: see above). The
      // empty asm keeps each sum in a register step by step: otherwise GCC reassociates the
      // block's 32 integer adds into one tree, hoists all 32 products and spills them.
#define TESSERA_X8_STEP(s, q)                                                          \
      s = _mm256_add_epi16(s, _mm256_add_epi16(                                        \
              _mm256_maddubs_epi16(lo, broadcast_word(q + 4 * k)),                    \
              _mm256_maddubs_epi16(hi, broadcast_word(q + 16 + 4 * k))));           \
      __asm__("" : "+x"(s));
      TESSERA_X8_STEP(s0, q0)
      if constexpr (T > 1) { TESSERA_X8_STEP(s1, q1) }
      if constexpr (T > 2) { TESSERA_X8_STEP(s2, q2) }
      if constexpr (T > 3) { TESSERA_X8_STEP(s3, q3) }
#undef TESSERA_X8_STEP
    }
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b.d)));
    const __m256 mw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b.m)));
#define TESSERA_X8_SCALE(a, s, c)                                                       \
    a = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_broadcast_ss(c + 2 * ib)),             \
                        _mm256_cvtepi32_ps(_mm256_madd_epi16(s, ones)), a);             \
    a = _mm256_fmadd_ps(mw, _mm256_broadcast_ss(c + 2 * ib + 1), a);
    TESSERA_X8_SCALE(a0, s0, c0)
    if constexpr (T > 1) { TESSERA_X8_SCALE(a1, s1, c1) }
    if constexpr (T > 2) { TESSERA_X8_SCALE(a2, s2, c2) }
    if constexpr (T > 3) { TESSERA_X8_SCALE(a3, s3, c3) }
#undef TESSERA_X8_SCALE
  }
  const __m256 acc[4] = {a0, a1, a2, a3};
  for (int t = 0; t < T; ++t) {
    if (rows == 8) {
      _mm256_storeu_ps(y + t * y_stride, acc[t]);
    } else {
      alignas(32) float out[8];
      _mm256_store_ps(out, acc[t]);
      std::copy(out, out + rows, y + t * y_stride);
    }
  }
}

using PassFn = void (*)(int64_t, const BlockQ4_1x8*, const uint8_t*, size_t, const float* const*,
                        bool, float*, int64_t, int);
constexpr PassFn kPasses[kMaxTokens] = {&group_pass<1>, &group_pass<2>, &group_pass<3>,
                                        &group_pass<4>};

}  // namespace

void matmul_q4_1x8_avx2(int64_t nb, const BlockQ4_1x8* w, int64_t w_rows, const uint8_t* x,
                        size_t x_stride, int64_t x_rows, float* y, int64_t y_stride) {
  // (d_x, s_x) of every activation block as floats, converted once per call.
  thread_local std::vector<float> scales;
  const size_t row_floats = static_cast<size_t>(2 * nb);
  if (scales.size() < row_floats * x_rows) scales.resize(row_floats * x_rows);
  for (int64_t t = 0; t < x_rows; ++t) {
    const auto* xb = reinterpret_cast<const BlockQ8_1*>(x + t * x_stride);
    float* o = scales.data() + t * row_floats;
    for (int64_t ib = 0; ib < nb; ++ib) {
      o[2 * ib] = _cvtsh_ss(xb[ib].d);
      o[2 * ib + 1] = _cvtsh_ss(xb[ib].s);
    }
  }
  const int64_t groups = (w_rows + 7) / 8;
  const size_t group_bytes = static_cast<size_t>(nb) * sizeof(BlockQ4_1x8);
  const int64_t panel_groups = std::max<int64_t>(1, static_cast<int64_t>(kPanelBytes / group_bytes));
  // Prefetching ahead pays when the weights come from DRAM, i.e. when each group is read once
  // per call; with several activation chunks per panel the later chunks find it in L1.
  for (int64_t p0 = 0; p0 < groups; p0 += panel_groups) {
    const int64_t p1 = std::min(groups, p0 + panel_groups);
    for (int64_t t0 = 0; t0 < x_rows; t0 += kMaxTokens) {
      const int tt = static_cast<int>(std::min<int64_t>(kMaxTokens, x_rows - t0));
      const float* xsc[kMaxTokens];
      for (int t = 0; t < tt; ++t) xsc[t] = scales.data() + (t0 + t) * row_floats;
      const bool prefetch = t0 == 0;
      for (int64_t g = p0; g < p1; ++g) {
        const int rows = static_cast<int>(std::min<int64_t>(8, w_rows - 8 * g));
        kPasses[tt - 1](nb, w + g * nb, x + t0 * x_stride, x_stride, xsc, prefetch,
                        y + t0 * y_stride + 8 * g, y_stride, rows);
      }
    }
  }
}

}  // namespace tessera::kernels

#endif  // x86
