// The interleaved kernels (tessera/interleaved.h) on 512-bit vectors with AVX512-VNNI: two
// 8-row groups side by side, lanes 0-7 the first group's rows and lanes 8-15 the second's, so
// every instruction does the work of two in the 256-bit builds (interleaved_x86.inl). Called
// only after cpu_has_avx512_vnni(). The integer block sums are exact and each row's float
// steps (convert, scale, fused add) are the 256-bit builds' in the same order, so the results
// are theirs bit for bit; the unit test compares them.
//
// What differs from the 256-bit builds, and why it gives the same sums:
// - Q8_0: AVX-512 has no vpsignb, so the signed weights go unsigned instead, w + 128 (an xor
//   with 0x80), and 128 * sum(x) comes off once per block as Q4_0's offset 8 * sum(x) does.
// - A 16-row pass covers two groups; a trailing group of fewer than 16 rows goes to the
//   256-bit kernels, which give the same bits.
#if defined(__x86_64__) || defined(__i386__)

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <utility>
#include <vector>

#include "interleaved_x86_common.h"
#include "quant_blocks.h"
#include "tessera/sdk/kernels/ggml_types.h"

#include "tessera/sdk/kernels/fp_contract_off.h"

namespace tessera::kernels {

namespace {

// Activation rows per pass: each unpacked weight vector is used for this many rows. 32 zmm
// registers hold 8 rows' float and int accumulators with room for the unpacking; formats with
// more accumulators per row (F::kPassTokens) take fewer.
constexpr int kMaxTokens = 8;
// Prefetch distance for weights streamed from DRAM (the 256-bit builds moved to 8 KiB, measured
// on their batch-1 decode; this build kept 4 KiB, not re-measured), and as in those builds the
// weight bytes of a panel that stays in L1 while every chunk of activation rows passes over it.
constexpr size_t kPrefetchBytes = 4096;
constexpr size_t kPanelBytes = 16 * 1024;

// Keeps a sum in a register step by step (see interleaved_x86.inl: GCC otherwise
// reassociates the block's adds into a tree and spills the products).
#define TESSERA_KEEP(s) __asm__("" : "+v"(s))

inline __m512i broadcast_word(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return _mm512_set1_epi32(v);
}

// 32 bytes of each group as one vector: the first group's in lanes 0-7.
inline __m512i load_pair(const void* first, const void* second) {
  return _mm512_inserti64x4(
      _mm512_castsi256_si512(_mm256_loadu_si256(static_cast<const __m256i*>(first))),
      _mm256_loadu_si256(static_cast<const __m256i*>(second)), 1);
}

// 8 fp16 values of each group as 16 floats.
inline __m512 halves_pair(const uint16_t* first, const uint16_t* second) {
  const __m256i h = _mm256_inserti128_si256(
      _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(first))),
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(second)), 1);
  return _mm512_cvtph_ps(h);
}

// 8 bytes of each group as 16 int32 lanes (unsigned or signed).
inline __m512i bytes_pair_u32(const uint8_t* first, const uint8_t* second) {
  const __m128i b = _mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(first)),
                                       _mm_loadl_epi64(reinterpret_cast<const __m128i*>(second)));
  return _mm512_cvtepu8_epi32(b);
}
inline __m512i bytes_pair_i32(const int8_t* first, const int8_t* second) {
  const __m128i b = _mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(first)),
                                       _mm_loadl_epi64(reinterpret_cast<const __m128i*>(second)));
  return _mm512_cvtepi8_epi32(b);
}

// The fifth bits of quant chunk k, half h (bit 2 k + h of each byte of qh) at bit 4.
inline __m512i fifth_bits(__m512i qh, int bit) {
  const __m512i m = _mm512_set1_epi8(0x10);
  if (bit <= 4) return _mm512_and_si512(_mm512_slli_epi16(qh, 4 - bit), m);
  return _mm512_and_si512(_mm512_srli_epi16(qh, bit - 4), m);
}

// sum(q * x) over a 32-element block of 4-bit quants (kFifth: 5-bit, the fifth bits in
// qh0 / qh1) of both groups, for rows 0..T-1 of the pass, int32 in s[t].
template <int T, bool kFifth>
inline void nibble_sums(const uint8_t* qs0, const uint8_t* qs1, const uint8_t* qh0,
                        const uint8_t* qh1, const int8_t* const* q, __m512i (&s)[T]) {
  const __m512i low_mask = _mm512_set1_epi8(0x0F);
  __m512i qh = _mm512_setzero_si512();
  if constexpr (kFifth) qh = load_pair(qh0, qh1);
#pragma GCC unroll 8
  for (int t = 0; t < T; ++t) s[t] = _mm512_setzero_si512();
#pragma GCC unroll 4
  for (int k = 0; k < 4; ++k) {
    const __m512i packed = load_pair(qs0 + 32 * k, qs1 + 32 * k);
    __m512i lo = _mm512_and_si512(packed, low_mask);
    __m512i hi = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low_mask);
    if constexpr (kFifth) {
      lo = _mm512_or_si512(lo, fifth_bits(qh, 2 * k));
      hi = _mm512_or_si512(hi, fifth_bits(qh, 2 * k + 1));
    }
#pragma GCC unroll 8
    for (int t = 0; t < T; ++t) {
      s[t] = _mm512_dpbusd_epi32(s[t], lo, broadcast_word(q[t] + 4 * k));
      s[t] = _mm512_dpbusd_epi32(s[t], hi, broadcast_word(q[t] + 16 + 4 * k));
      TESSERA_KEEP(s[t]);
    }
  }
}

// Each format as in interleaved_x86.inl: block, activation block, offset (times sum(x)),
// whether it has a min (times s_x) or sub-block mins (K-quants), and sums<T>.
template <class B, class X, int kOff, bool kMin, bool kFifth>
struct NibbleFormat {
  using Block = B;
  using XBlock = X;
  static constexpr int kOffset = kOff;
  static constexpr bool kHasMin = kMin;
  static constexpr bool kSubMins = false;
  static constexpr int kPassTokens = 8;
  template <int T>
  static void sums(const Block& b0, const Block& b1, const XBlock* const* x, __m512i (&s)[T],
                   __m512i (&)[T]) {
    const uint8_t *qh0 = nullptr, *qh1 = nullptr;
    if constexpr (kFifth) qh0 = b0.qh, qh1 = b1.qh;
    const int8_t* q[T];
#pragma GCC unroll 8
    for (int t = 0; t < T; ++t) q[t] = x[t]->qs;
    nibble_sums<T, kFifth>(b0.qs, b1.qs, qh0, qh1, q, s);
  }
  static __m512 min_scales(const Block& b0, const Block& b1) {
    if constexpr (kMin) return halves_pair(b0.m, b1.m);
    return _mm512_setzero_ps();
  }
};
using Q4_1Format = NibbleFormat<BlockQ4_1x8, BlockQ8_1, 0, true, false>;
using Q4_0Format = NibbleFormat<BlockQ4_0x8, BlockQ8_0, 8, false, false>;
using Q5_0Format = NibbleFormat<BlockQ5_0x8, BlockQ8_0, 16, false, true>;
using Q5_1Format = NibbleFormat<BlockQ5_1x8, BlockQ8_1, 0, true, true>;

// Q8_0: sum((w + 128) * x) by vpdpbusd, less 128 * sum(x) (the offset), = sum(w * x).
struct Q8_0Format {
  using Block = BlockQ8_0x8;
  using XBlock = BlockQ8_0;
  static constexpr int kOffset = 128;
  static constexpr bool kHasMin = false;
  static constexpr bool kSubMins = false;
  static constexpr int kPassTokens = 8;
  template <int T>
  static void sums(const Block& b0, const Block& b1, const XBlock* const* x, __m512i (&s)[T],
                   __m512i (&)[T]) {
    const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
#pragma GCC unroll 8
    for (int t = 0; t < T; ++t) s[t] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int k = 0; k < 8; ++k) {
      const __m512i wu = _mm512_xor_si512(load_pair(b0.qs + 32 * k, b1.qs + 32 * k), flip);
#pragma GCC unroll 8
      for (int t = 0; t < T; ++t) {
        s[t] = _mm512_dpbusd_epi32(s[t], wu, broadcast_word(x[t]->qs + 4 * k));
        TESSERA_KEEP(s[t]);
      }
    }
  }
  static __m512 min_scales(const Block&, const Block&) { return _mm512_setzero_ps(); }
};

// Q4_K / Q5_K against Q8_K as in interleaved_x86.inl: per 32-element sub-block the nibble sums
// times the rows' 6-bit scales, and the mins' term sum(min * (bsum 2s + bsum 2s+1)) in n,
// scaled by dmin_w d_x in the pass. (The 256-bit builds get min * bsum from vpmaddwd on the
// min in an int16 lane; here an int32 multiply, the same exact product.)
template <class B, bool kFifth>
struct K4Format {
  using Block = B;
  using XBlock = BlockQ8_K;
  static constexpr int kOffset = 0;
  static constexpr bool kHasMin = false;
  static constexpr bool kSubMins = true;
  static constexpr int kPassTokens = 4;
  template <int T>
  static void sums(const Block& b0, const Block& b1, const XBlock* const* xb, __m512i (&s)[T],
                   __m512i (&n)[T]) {
#pragma GCC unroll 8
    for (int t = 0; t < T; ++t) s[t] = n[t] = _mm512_setzero_si512();
    for (int sb = 0; sb < kQK_K / 32; ++sb) {
      const __m512i sc = bytes_pair_u32(b0.scales[sb], b1.scales[sb]);
      const __m512i mn = bytes_pair_u32(b0.mins[sb], b1.mins[sb]);
      const int8_t* qsb[T];
#pragma GCC unroll 8
      for (int t = 0; t < T; ++t) qsb[t] = xb[t]->qs + 32 * sb;
      __m512i h[T];
      const uint8_t *qh0 = nullptr, *qh1 = nullptr;
      if constexpr (kFifth) qh0 = b0.qh[sb], qh1 = b1.qh[sb];
      nibble_sums<T, kFifth>(b0.qs[sb], b1.qs[sb], qh0, qh1, qsb, h);
#pragma GCC unroll 8
      for (int t = 0; t < T; ++t) {
        s[t] = _mm512_add_epi32(s[t], _mm512_mullo_epi32(h[t], sc));
        n[t] = _mm512_add_epi32(
            n[t], _mm512_mullo_epi32(mn, _mm512_set1_epi32(xb[t]->bsums[2 * sb] +
                                                           xb[t]->bsums[2 * sb + 1])));
      }
    }
  }
  static __m512 min_scales(const Block& b0, const Block& b1) {
    return halves_pair(b0.dmin, b1.dmin);
  }
};
using Q4_KFormat = K4Format<BlockQ4_Kx8, false>;
using Q5_KFormat = K4Format<BlockQ5_Kx8, true>;

// Q6_K against Q8_K as in interleaved_x86.inl's AVX-VNNI build: per 32-element group the
// 6-bit quants (0..63) against the activations by vpdpbusd, per 16-element sub-block, times
// the rows' signed scales; the -32 offset as 32 * sum(scale * bsum) per super-block.
struct Q6_KFormat {
  using Block = BlockQ6_Kx8;
  using XBlock = BlockQ8_K;
  static constexpr int kOffset = 0;
  static constexpr bool kHasMin = false;
  static constexpr bool kSubMins = false;
  static constexpr int kPassTokens = 4;
  static __m512i top_bits(__m512i qh, int c) {
    const __m512i m = _mm512_set1_epi8(0x30);
    if (c <= 2) return _mm512_and_si512(_mm512_slli_epi16(qh, 4 - 2 * c), m);
    return _mm512_and_si512(_mm512_srli_epi16(qh, 2 * c - 4), m);
  }
  template <int T>
  static void sums(const Block& b0, const Block& b1, const XBlock* const* xb, __m512i (&s)[T],
                   __m512i (&)[T]) {
    const __m512i low_mask = _mm512_set1_epi8(0x0F);
    __m512i o[T];
#pragma GCC unroll 8
    for (int t = 0; t < T; ++t) s[t] = o[t] = _mm512_setzero_si512();
    for (int g = 0; g < kQK_K / 32; ++g) {
      const __m512i sc_lo = bytes_pair_i32(b0.scales[2 * g], b1.scales[2 * g]);
      const __m512i sc_hi = bytes_pair_i32(b0.scales[2 * g + 1], b1.scales[2 * g + 1]);
      __m512i l[T], h[T];
#pragma GCC unroll 8
      for (int t = 0; t < T; ++t) l[t] = h[t] = _mm512_setzero_si512();
#pragma GCC unroll 4
      for (int k = 0; k < 4; ++k) {
        const __m512i qh = load_pair(b0.qh[g] + 32 * (k / 2), b1.qh[g] + 32 * (k / 2));
        const __m512i packed = load_pair(b0.qs[g] + 32 * k, b1.qs[g] + 32 * k);
        const __m512i lo =
            _mm512_or_si512(_mm512_and_si512(packed, low_mask), top_bits(qh, 2 * (k % 2)));
        const __m512i hi =
            _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(packed, 4), low_mask),
                            top_bits(qh, 2 * (k % 2) + 1));
        const int at = 32 * g + 4 * k;
#pragma GCC unroll 8
        for (int t = 0; t < T; ++t) {
          l[t] = _mm512_dpbusd_epi32(l[t], lo, broadcast_word(xb[t]->qs + at));
          h[t] = _mm512_dpbusd_epi32(h[t], hi, broadcast_word(xb[t]->qs + at + 16));
          TESSERA_KEEP(l[t]);
          TESSERA_KEEP(h[t]);
        }
      }
#pragma GCC unroll 8
      for (int t = 0; t < T; ++t) {
        s[t] = _mm512_add_epi32(s[t], _mm512_add_epi32(_mm512_mullo_epi32(l[t], sc_lo),
                                                       _mm512_mullo_epi32(h[t], sc_hi)));
        // scale * bsum of both sub-blocks (the 256-bit builds count it twice by vpmaddwd
        // and take 16 times; here once and 32 times).
        o[t] = _mm512_add_epi32(
            o[t], _mm512_add_epi32(
                      _mm512_mullo_epi32(sc_lo, _mm512_set1_epi32(xb[t]->bsums[2 * g])),
                      _mm512_mullo_epi32(sc_hi, _mm512_set1_epi32(xb[t]->bsums[2 * g + 1]))));
      }
    }
#pragma GCC unroll 8
    for (int t = 0; t < T; ++t) s[t] = _mm512_sub_epi32(s[t], _mm512_slli_epi32(o[t], 5));
  }
  static __m512 min_scales(const Block&, const Block&) { return _mm512_setzero_ps(); }
};

// Two groups of 8 rows (w0, w1) against T activation rows; y gets all 16 rows.
template <class F, int T>
void pair_pass(int64_t nb, const typename F::Block* w0, const typename F::Block* w1,
               const uint8_t* x, size_t x_stride, const XScales* xsc, bool prefetch, float* y,
               int64_t y_stride) {
  static_assert(T >= 1 && T <= F::kPassTokens && F::kPassTokens <= kMaxTokens);
  using Block = typename F::Block;
  using XBlock = typename F::XBlock;
  __m512 a[T];
  const XBlock* xr[T];
#pragma GCC unroll 8
  for (int t = 0; t < T; ++t) {
    a[t] = _mm512_setzero_ps();
    xr[t] = reinterpret_cast<const XBlock*>(x + t * x_stride);
  }
  const char* bytes0 = reinterpret_cast<const char*>(w0);
  const char* bytes1 = reinterpret_cast<const char*>(w1);
  for (int64_t ib = 0; ib < nb; ++ib) {
    if (prefetch) {
      const size_t at = ib * sizeof(Block) + kPrefetchBytes;
      for (size_t off = 0; off < sizeof(Block); off += 64) {
        _mm_prefetch(bytes0 + at + off, _MM_HINT_T0);
        _mm_prefetch(bytes1 + at + off, _MM_HINT_T0);
      }
    }
    const XBlock* xb[T];
#pragma GCC unroll 8
    for (int t = 0; t < T; ++t) xb[t] = xr[t] + ib;
    __m512i s[T], n[T];
    F::template sums<T>(w0[ib], w1[ib], xb, s, n);
    const __m512 dw = halves_pair(w0[ib].d, w1[ib].d);
    const __m512 mw = F::min_scales(w0[ib], w1[ib]);
#pragma GCC unroll 8
    for (int t = 0; t < T; ++t) {
      __m512i isum = s[t];
      if constexpr (F::kOffset != 0)
        isum = _mm512_sub_epi32(isum, _mm512_set1_epi32(xsc[t].sum[ib]));
      const __m512 dx = _mm512_set1_ps(xsc[t].d[ib]);
      a[t] = _mm512_fmadd_ps(_mm512_mul_ps(dw, dx), _mm512_cvtepi32_ps(isum), a[t]);
      if constexpr (F::kHasMin) a[t] = _mm512_fmadd_ps(mw, _mm512_set1_ps(xsc[t].s[ib]), a[t]);
      if constexpr (F::kSubMins)
        a[t] = _mm512_fnmadd_ps(_mm512_mul_ps(mw, dx), _mm512_cvtepi32_ps(n[t]), a[t]);
    }
  }
#pragma GCC unroll 8
  for (int t = 0; t < T; ++t) _mm512_storeu_ps(y + t * y_stride, a[t]);
}

#undef TESSERA_KEEP

// A trailing group of fewer than 16 rows goes to the 256-bit kernels (same bits).
template <class F>
void matmul_x16(int64_t nb, const typename F::Block* w, int64_t w_rows, const uint8_t* x,
                size_t x_stride, int64_t x_rows, float* y, int64_t y_stride, int type_id) {
  using Block = typename F::Block;
  using PassFn = void (*)(int64_t, const Block*, const Block*, const uint8_t*, size_t,
                          const XScales*, bool, float*, int64_t);
  // pair_pass<F, 1> .. pair_pass<F, F::kPassTokens>.
  constexpr auto kPasses = []<int... I>(std::integer_sequence<int, I...>) {
    return std::array<PassFn, sizeof...(I)>{&pair_pass<F, I + 1>...};
  }(std::make_integer_sequence<int, F::kPassTokens>());
  const int64_t pairs = w_rows / 16;
  if (pairs > 0) {
    thread_local XScaleTables tables;
    tables.fill<F>(nb, x, x_stride, x_rows);
    const size_t pair_bytes = 2 * static_cast<size_t>(nb) * sizeof(Block);
    const int64_t panel_pairs =
        std::max<int64_t>(1, static_cast<int64_t>(kPanelBytes / pair_bytes));
    for (int64_t p0 = 0; p0 < pairs; p0 += panel_pairs) {
      const int64_t p1 = std::min(pairs, p0 + panel_pairs);
      for (int64_t t0 = 0; t0 < x_rows; t0 += F::kPassTokens) {
        const int tt = static_cast<int>(std::min<int64_t>(F::kPassTokens, x_rows - t0));
        XScales xsc[kMaxTokens];
        for (int t = 0; t < tt; ++t) xsc[t] = tables.row<F>(nb, t0 + t);
        const bool prefetch = t0 == 0;
        for (int64_t g = p0; g < p1; ++g) {
          const Block* w0 = w + 2 * g * nb;
          kPasses[tt - 1](nb, w0, w0 + nb, x + t0 * x_stride, x_stride, xsc, prefetch,
                          y + t0 * y_stride + 16 * g, y_stride);
        }
      }
    }
  }
  if (16 * pairs < w_rows) {
    const Block* rest = w + 2 * pairs * nb;
    const int64_t rest_rows = w_rows - 16 * pairs;
    if (tessera::cpu_has_avx_vnni())
      matmul_x8_avxvnni(type_id, nb, rest, rest_rows, x, x_stride, x_rows, y + 16 * pairs,
                        y_stride);
    else
      matmul_x8_avx2(type_id, nb, rest, rest_rows, x, x_stride, x_rows, y + 16 * pairs,
                     y_stride);
  }
}

}  // namespace

void matmul_x8_avx512(int type_id, int64_t nb, const void* packed, int64_t w_rows,
                      const uint8_t* x, size_t x_stride, int64_t x_rows, float* y,
                      int64_t y_stride) {
#define TESSERA_X16_CASE(type, F)                                                          \
  case GgmlType::type:                                                                     \
    return matmul_x16<F>(nb, static_cast<const F::Block*>(packed), w_rows, x, x_stride,    \
                         x_rows, y, y_stride, type_id);
  switch (static_cast<GgmlType>(type_id)) {
    TESSERA_X16_CASE(Q4_0, Q4_0Format)
    TESSERA_X16_CASE(Q4_1, Q4_1Format)
    TESSERA_X16_CASE(Q5_0, Q5_0Format)
    TESSERA_X16_CASE(Q5_1, Q5_1Format)
    TESSERA_X16_CASE(Q8_0, Q8_0Format)
    TESSERA_X16_CASE(Q4_K, Q4_KFormat)
    TESSERA_X16_CASE(Q5_K, Q5_KFormat)
    TESSERA_X16_CASE(Q6_K, Q6_KFormat)
    default:
      return;
  }
#undef TESSERA_X16_CASE
}

}  // namespace tessera::kernels

#endif  // x86
