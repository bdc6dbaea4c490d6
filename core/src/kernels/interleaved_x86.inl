// The kernels of the interleaved layouts (tessera/interleaved.h) for x86, included three
// times: by interleaved_avx2.cpp (AVX2/FMA/F16C), by interleaved_avxvnni.cpp (the same plus
// AVX-VNNI, TESSERA_X8_VNNI defined) and by interleaved_vnni256.cpp (the VNNI code with
// AVX512-VL's encoding of vpdpbusd), whose functions carry the suffix TESSERA_X8_SUFFIX.
// Q4_1 and Q5_1 against Q8_1 activations, Q4_0, Q5_0 and Q8_0 against Q8_0, Q4_K, Q5_K and
// Q6_K against Q8_K. Lane j of every vector belongs to weight row j of the group and one
// activation word is broadcast to all lanes, so each row's block sum builds up vertically and
// exactly, and is widened, converted and scaled once per 8 rows:
// - Q4_1 / Q4_0 / Q5_0 / Q5_1: vpmaddubsw of the unsigned quants q (0..15, or 0..31 with the
//   fifth bit) against the activations gives sum(q * x) in int16 lanes: 16 products of at
//   most 15 * 127 fit (Q4), 8 of at most 31 * 127 (Q5: widened to int32 every two chunks).
//   With AVX-VNNI one vpdpbusd adds the 4 products of each lane straight into int32. Q4_0's
//   and Q5_0's offset comes off once per block as 8 or 16 * sum(x), with sum(x) of every
//   activation block computed once per call; Q4_1's and Q5_1's min is its own FMA with s_x.
// - Q8_0: signed by signed, vpsignb moving the weight's sign onto the activation
//   (|w| * sign(w) x), widened after every pair of products (2 * 128 * 127 fits int16), or
//   one vpdpbusd with AVX-VNNI.
// The integer sums are exact either way, so both builds give the same bits.
#if defined(__x86_64__) || defined(__i386__)

#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "interleaved_x86_common.h"
#include "quant_blocks.h"

#include "tessera/sdk/kernels/fp_contract_off.h"

#define TESSERA_X8_CAT2(a, b) a##_##b
#define TESSERA_X8_CAT(a, b) TESSERA_X8_CAT2(a, b)
#define TESSERA_X8_FN(name) TESSERA_X8_CAT(name, TESSERA_X8_SUFFIX)
// vpdpbusd on 256-bit vectors: AVX-VNNI's VEX form unless the including file picks another
// (interleaved_vnni256.cpp: AVX512-VL's EVEX form, the same operation).
#ifndef TESSERA_X8_DPBUSD
#define TESSERA_X8_DPBUSD _mm256_dpbusd_avx_epi32
#endif

namespace tessera::kernels {

namespace {

// Activation rows per pass of a group: each unpacked weight vector is used for this many rows.
constexpr int kMaxTokens = 4;
// Weight bytes a pass prefetches ahead: decode streams each weight once per step from DRAM
// or L3 (see quant_avx2.cpp). 8 KiB measured 2-4 % faster batch-1 decode than 4 KiB on a
// 480 MiB-L3 Xeon (docs/cpu-kernels.md); prefetching changes no result.
constexpr size_t kPrefetchBytes = 8192;
// Where a block's prefetch lands. Into L1 for the small blocks; into L2 for the K-quants'
// large ones (Q5_K 1,408 and Q6_K 1,680 bytes per 8 rows: 22-27 lines asked for at once),
// whose burst of L1 prefetches held the core up: batch-1 Q6_K rows from DRAM ran at 10-15
// GB/s per core against 20-21 with L2 prefetches, Q5_K 17-18 against 20, while Q8_0, Q4_0,
// Q4_1 and Q5_0 lost 5-10 % with L2 prefetches (AMD Zen 4, 2026-12-07).
template <class Block>
inline constexpr _mm_hint kPrefetchHint = sizeof(Block) > 1280 ? _MM_HINT_T1 : _MM_HINT_T0;
// Weight bytes per panel: a panel of groups stays in L1 while every chunk of activation rows
// passes over it, so a matrix streams from memory once per matmul.
constexpr size_t kPanelBytes = 16 * 1024;

inline __m256i broadcast_word(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return _mm256_set1_epi32(v);
}

// The empty asm keeps each sum in a register step by step: otherwise GCC reassociates the
// block's integer adds into one tree, hoists all the products and spills them. (Named
// accumulators rather than arrays for the same reason: with arrays GCC kept them on the
// stack.)
#define TESSERA_KEEP(s) __asm__("" : "+x"(s))

// The fifth bits of quant chunk k, half h (bit 2 k + h of each byte of Q5_0x8's qh) at bit 4.
inline __m256i fifth_bits(__m256i qh, int bit) {
  const __m256i m = _mm256_set1_epi8(0x10);
  if (bit <= 4) return _mm256_and_si256(_mm256_slli_epi16(qh, 4 - bit), m);
  return _mm256_and_si256(_mm256_srli_epi16(qh, bit - 4), m);
}

// sum(q * x) over a block of 4-bit quants (with kFifth, 5-bit: qh holds the fifth bits) for
// rows 0..T-1 of the pass, int32 in s0..s3.
template <int T, bool kFifth>
inline void nibble_sums(const uint8_t* qs, const uint8_t* qh_bytes, const int8_t* q0,
                        const int8_t* q1, const int8_t* q2, const int8_t* q3, __m256i& s0,
                        __m256i& s1, __m256i& s2, __m256i& s3) {
  const __m256i low_mask = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i qh = _mm256_setzero_si256();
  if constexpr (kFifth) qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh_bytes));
  __m256i h0 = _mm256_setzero_si256(), h1 = h0, h2 = h0, h3 = h0;
  s0 = s1 = s2 = s3 = h0;
#pragma GCC unroll 4
  for (int k = 0; k < 4; ++k) {
    const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * k));
    __m256i lo = _mm256_and_si256(packed, low_mask);
    __m256i hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low_mask);
    if constexpr (kFifth) {
      lo = _mm256_or_si256(lo, fifth_bits(qh, 2 * k));
      hi = _mm256_or_si256(hi, fifth_bits(qh, 2 * k + 1));
    }
#ifdef TESSERA_X8_VNNI
    (void)ones;
    (void)h0, (void)h1, (void)h2, (void)h3;
#define TESSERA_STEP(h, s, q)                                                           \
    s = TESSERA_X8_DPBUSD(s, lo, broadcast_word(q + 4 * k));                      \
    s = TESSERA_X8_DPBUSD(s, hi, broadcast_word(q + 16 + 4 * k));                 \
    TESSERA_KEEP(s);
    TESSERA_STEP(h0, s0, q0)
    if constexpr (T > 1) { TESSERA_STEP(h1, s1, q1) }
    if constexpr (T > 2) { TESSERA_STEP(h2, s2, q2) }
    if constexpr (T > 3) { TESSERA_STEP(h3, s3, q3) }
#undef TESSERA_STEP
  }
#else
#define TESSERA_STEP(h, q)                                                              \
    h = _mm256_add_epi16(h, _mm256_add_epi16(                                           \
            _mm256_maddubs_epi16(lo, broadcast_word(q + 4 * k)),                       \
            _mm256_maddubs_epi16(hi, broadcast_word(q + 16 + 4 * k))));              \
    TESSERA_KEEP(h);
    TESSERA_STEP(h0, q0)
    if constexpr (T > 1) { TESSERA_STEP(h1, q1) }
    if constexpr (T > 2) { TESSERA_STEP(h2, q2) }
    if constexpr (T > 3) { TESSERA_STEP(h3, q3) }
#undef TESSERA_STEP
    if (k == 3 || (kFifth && k == 1)) {  // widen before int16 could overflow
#define TESSERA_WIDEN(s, h)                                      \
      s = _mm256_add_epi32(s, _mm256_madd_epi16(h, ones));       \
      h = _mm256_setzero_si256();
      TESSERA_WIDEN(s0, h0)
      if constexpr (T > 1) { TESSERA_WIDEN(s1, h1) }
      if constexpr (T > 2) { TESSERA_WIDEN(s2, h2) }
      if constexpr (T > 3) { TESSERA_WIDEN(s3, h3) }
#undef TESSERA_WIDEN
    }
  }
#endif
}

// Each format: its block, its activation block, the offset subtracted from its quants (times
// sum(x)), whether it has a min (times s_x), and sums<T>(...) = sum(q * x) of rows 0..T-1.
template <class B, class X, int kOff, bool kMin, bool kFifth>
struct NibbleFormat {
  using Block = B;
  using XBlock = X;
  static constexpr int kOffset = kOff;
  static constexpr bool kHasMin = kMin;
  static constexpr bool kSubMins = false;
  template <int T>
  static void sums(const Block& b, const XBlock& x0, const XBlock& x1, const XBlock& x2,
                   const XBlock& x3, __m256i& s0, __m256i& s1, __m256i& s2, __m256i& s3) {
    const uint8_t* qh = nullptr;
    if constexpr (kFifth) qh = b.qh;
    nibble_sums<T, kFifth>(b.qs, qh, x0.qs, x1.qs, x2.qs, x3.qs, s0, s1, s2, s3);
  }
};
using Q4_1Format = NibbleFormat<BlockQ4_1x8, BlockQ8_1, 0, true, false>;
using Q4_0Format = NibbleFormat<BlockQ4_0x8, BlockQ8_0, 8, false, false>;
using Q5_0Format = NibbleFormat<BlockQ5_0x8, BlockQ8_0, 16, false, true>;
using Q5_1Format = NibbleFormat<BlockQ5_1x8, BlockQ8_1, 0, true, true>;

struct Q8_0Format {
  using Block = BlockQ8_0x8;
  using XBlock = BlockQ8_0;
  static constexpr int kOffset = 0;
  static constexpr bool kHasMin = false;
  static constexpr bool kSubMins = false;
  template <int T>
  static void sums(const Block& b, const XBlock& x0, const XBlock& x1, const XBlock& x2,
                   const XBlock& x3, __m256i& s0, __m256i& s1, __m256i& s2, __m256i& s3) {
    const __m256i ones = _mm256_set1_epi16(1);
    const int8_t *q0 = x0.qs, *q1 = x1.qs, *q2 = x2.qs, *q3 = x3.qs;
    s0 = s1 = s2 = s3 = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int k = 0; k < 8; ++k) {
      const __m256i wq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.qs + 32 * k));
      const __m256i aw = _mm256_abs_epi8(wq);
#ifdef TESSERA_X8_VNNI
      (void)ones;
#define TESSERA_STEP(s, q)                                                              \
      s = TESSERA_X8_DPBUSD(s, aw, _mm256_sign_epi8(broadcast_word(q + 4 * k), wq)); \
      TESSERA_KEEP(s);
#else
#define TESSERA_STEP(s, q)                                                              \
      s = _mm256_add_epi32(s, _mm256_madd_epi16(                                        \
              _mm256_maddubs_epi16(aw, _mm256_sign_epi8(broadcast_word(q + 4 * k), wq)), \
              ones));                                                                   \
      TESSERA_KEEP(s);
#endif
      TESSERA_STEP(s0, q0)
      if constexpr (T > 1) { TESSERA_STEP(s1, q1) }
      if constexpr (T > 2) { TESSERA_STEP(s2, q2) }
      if constexpr (T > 3) { TESSERA_STEP(s3, q3) }
#undef TESSERA_STEP
    }
  }
};

// Q6_K against Q8_K, per 32-element group g of a super-block: the 6-bit quants (0..63) rebuilt
// from the nibbles and the top 2 bits (bits 2 c of qh moved to bits 4, 5), vpmaddubsw against
// the activations, two chunks summed in int16 (4 products of at most 63 * 128 per lane),
// then vpmaddwd with the 8 rows' scales of the group's two 16-element sub-blocks; the -32
// offset comes off once per super-block as 32 * sum(scale * bsum), bsum the Q8_K block's
// sums of 16 activations.
struct Q6_KFormat {
  using Block = BlockQ6_Kx8;
  using XBlock = BlockQ8_K;
  static constexpr int kOffset = 0;
  static constexpr bool kHasMin = false;
  static constexpr bool kSubMins = false;
  static __m256i top_bits(__m256i qh, int c) {
    const __m256i m = _mm256_set1_epi8(0x30);
    if (c <= 2) return _mm256_and_si256(_mm256_slli_epi16(qh, 4 - 2 * c), m);
    return _mm256_and_si256(_mm256_srli_epi16(qh, 2 * c - 4), m);
  }
  // Row j's scale of sub-block s in int16 lanes 2 j and 2 j + 1.
  static __m256i scales(const int8_t* sc) {
    const __m128i dup = _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    return _mm256_cvtepi8_epi16(
        _mm_shuffle_epi8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc)), dup));
  }
  template <int T>
  static void sums(const Block& b, const XBlock& x0, const XBlock& x1, const XBlock& x2,
                   const XBlock& x3, __m256i& s0, __m256i& s1, __m256i& s2, __m256i& s3) {
    const __m256i low_mask = _mm256_set1_epi8(0x0F);
    const int8_t *q0 = x0.qs, *q1 = x1.qs, *q2 = x2.qs, *q3 = x3.qs;
    __m256i o0 = _mm256_setzero_si256(), o1 = o0, o2 = o0, o3 = o0;
    s0 = s1 = s2 = s3 = o0;
    for (int g = 0; g < kQK_K / 32; ++g) {
      const __m256i sc_lo = scales(b.scales[2 * g]);
      const __m256i sc_hi = scales(b.scales[2 * g + 1]);
#ifdef TESSERA_X8_VNNI
      // vpdpbusd sums each row's 4 products of a chunk into its int32 lane; the 16-element
      // sub-blocks' scales (row j's in lane j) multiply the group's two sums once.
      {
        const __m256i sc32_lo =
            _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b.scales[2 * g])));
        const __m256i sc32_hi =
            _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b.scales[2 * g + 1])));
        __m256i l0 = _mm256_setzero_si256(), l1 = l0, l2 = l0, l3 = l0;
        __m256i h0 = l0, h1 = l0, h2 = l0, h3 = l0;
#pragma GCC unroll 4
        for (int k = 0; k < 4; ++k) {
          const __m256i qh =
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.qh[g] + 32 * (k / 2)));
          const __m256i packed =
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.qs[g] + 32 * k));
          const __m256i lo =
              _mm256_or_si256(_mm256_and_si256(packed, low_mask), top_bits(qh, 2 * (k % 2)));
          const __m256i hi = _mm256_or_si256(
              _mm256_and_si256(_mm256_srli_epi16(packed, 4), low_mask), top_bits(qh, 2 * (k % 2) + 1));
          const int at = 32 * g + 4 * k;
#define TESSERA_STEP(l, h, q)                                                       \
          l = TESSERA_X8_DPBUSD(l, lo, broadcast_word(q + at));                \
          h = TESSERA_X8_DPBUSD(h, hi, broadcast_word(q + at + 16));           \
          TESSERA_KEEP(l);                                                           \
          TESSERA_KEEP(h);
          TESSERA_STEP(l0, h0, q0)
          if constexpr (T > 1) { TESSERA_STEP(l1, h1, q1) }
          if constexpr (T > 2) { TESSERA_STEP(l2, h2, q2) }
          if constexpr (T > 3) { TESSERA_STEP(l3, h3, q3) }
#undef TESSERA_STEP
        }
#define TESSERA_WIDEN(s, l, h)                                                      \
        s = _mm256_add_epi32(s, _mm256_add_epi32(_mm256_mullo_epi32(l, sc32_lo),     \
                                                 _mm256_mullo_epi32(h, sc32_hi)));
        TESSERA_WIDEN(s0, l0, h0)
        if constexpr (T > 1) { TESSERA_WIDEN(s1, l1, h1) }
        if constexpr (T > 2) { TESSERA_WIDEN(s2, l2, h2) }
        if constexpr (T > 3) { TESSERA_WIDEN(s3, l3, h3) }
#undef TESSERA_WIDEN
      }
#else
#pragma GCC unroll 2
      for (int v = 0; v < 2; ++v) {
        const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.qh[g] + 32 * v));
        __m256i l0 = _mm256_setzero_si256(), l1 = l0, l2 = l0, l3 = l0;
        __m256i h0 = l0, h1 = l0, h2 = l0, h3 = l0;
#pragma GCC unroll 2
        for (int kk = 0; kk < 2; ++kk) {
          const int k = 2 * v + kk;
          const __m256i packed =
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.qs[g] + 32 * k));
          const __m256i lo =
              _mm256_or_si256(_mm256_and_si256(packed, low_mask), top_bits(qh, 2 * kk));
          const __m256i hi = _mm256_or_si256(
              _mm256_and_si256(_mm256_srli_epi16(packed, 4), low_mask), top_bits(qh, 2 * kk + 1));
          const int at = 32 * g + 4 * k;
#define TESSERA_STEP(l, h, q)                                                          \
          l = _mm256_add_epi16(l, _mm256_maddubs_epi16(lo, broadcast_word(q + at)));    \
          h = _mm256_add_epi16(h, _mm256_maddubs_epi16(hi, broadcast_word(q + at + 16))); \
          TESSERA_KEEP(l);                                                              \
          TESSERA_KEEP(h);
          TESSERA_STEP(l0, h0, q0)
          if constexpr (T > 1) { TESSERA_STEP(l1, h1, q1) }
          if constexpr (T > 2) { TESSERA_STEP(l2, h2, q2) }
          if constexpr (T > 3) { TESSERA_STEP(l3, h3, q3) }
#undef TESSERA_STEP
        }
#define TESSERA_WIDEN(s, l, h)                                                          \
        s = _mm256_add_epi32(s, _mm256_add_epi32(_mm256_madd_epi16(l, sc_lo),           \
                                                 _mm256_madd_epi16(h, sc_hi)));
        TESSERA_WIDEN(s0, l0, h0)
        if constexpr (T > 1) { TESSERA_WIDEN(s1, l1, h1) }
        if constexpr (T > 2) { TESSERA_WIDEN(s2, l2, h2) }
        if constexpr (T > 3) { TESSERA_WIDEN(s3, l3, h3) }
#undef TESSERA_WIDEN
      }
#endif
      // 2 * scale * bsum per row: vpmaddwd adds the row's two equal lanes.
#define TESSERA_OFFSET(o, x)                                                             \
      o = _mm256_add_epi32(o, _mm256_add_epi32(                                          \
              _mm256_madd_epi16(sc_lo, _mm256_set1_epi16(x.bsums[2 * g])),               \
              _mm256_madd_epi16(sc_hi, _mm256_set1_epi16(x.bsums[2 * g + 1]))));
      TESSERA_OFFSET(o0, x0)
      if constexpr (T > 1) { TESSERA_OFFSET(o1, x1) }
      if constexpr (T > 2) { TESSERA_OFFSET(o2, x2) }
      if constexpr (T > 3) { TESSERA_OFFSET(o3, x3) }
#undef TESSERA_OFFSET
    }
    s0 = _mm256_sub_epi32(s0, _mm256_slli_epi32(o0, 4));
    if constexpr (T > 1) s1 = _mm256_sub_epi32(s1, _mm256_slli_epi32(o1, 4));
    if constexpr (T > 2) s2 = _mm256_sub_epi32(s2, _mm256_slli_epi32(o2, 4));
    if constexpr (T > 3) s3 = _mm256_sub_epi32(s3, _mm256_slli_epi32(o3, 4));
  }
};

// Q4_K against Q8_K, per 32-element sub-block s: Q4_0's nibble sums (16 products of at most
// 15 * 128 fit int16) times the 8 rows' 6-bit scales of s; the mins' term
// sum(min * (bsum 2s + bsum 2s+1)) in n (each min in the low int16 lane of its row's pair, so
// vpmaddwd gives min * bsum exactly), scaled by dmin_w d_x in group_pass.
// Q5_K the same with Q5_0's fifth bits (8 products of at most 31 * 128 per int16 lane).
template <class B, bool kFifth>
struct K4Format {
  using Block = B;
  using XBlock = BlockQ8_K;
  static constexpr int kOffset = 0;
  static constexpr bool kHasMin = false;
  static constexpr bool kSubMins = true;
  template <int T>
  static void sums(const Block& b, const XBlock& x0, const XBlock& x1, const XBlock& x2,
                   const XBlock& x3, __m256i& s0, __m256i& s1, __m256i& s2, __m256i& s3,
                   __m256i& n0, __m256i& n1, __m256i& n2, __m256i& n3) {
    s0 = s1 = s2 = s3 = n0 = n1 = n2 = n3 = _mm256_setzero_si256();
    for (int sb = 0; sb < kQK_K / 32; ++sb) {
      // Row j's scale and min of sub-block sb in int32 lane j (a min's high int16 half is 0).
      const __m256i sc =
          _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b.scales[sb])));
      const __m256i mn =
          _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b.mins[sb])));
      __m256i h0, h1, h2, h3;
      const uint8_t* qh = nullptr;
      if constexpr (kFifth) qh = b.qh[sb];
      nibble_sums<T, kFifth>(b.qs[sb], qh, x0.qs + 32 * sb, x1.qs + 32 * sb, x2.qs + 32 * sb,
                            x3.qs + 32 * sb, h0, h1, h2, h3);
#define TESSERA_SUB(s, h, n, x)                                                            \
      s = _mm256_add_epi32(s, _mm256_mullo_epi32(h, sc));                                  \
      n = _mm256_add_epi32(n, _mm256_madd_epi16(                                           \
              mn, _mm256_set1_epi16(static_cast<int16_t>(x.bsums[2 * sb] + x.bsums[2 * sb + 1]))));
      TESSERA_SUB(s0, h0, n0, x0)
      if constexpr (T > 1) { TESSERA_SUB(s1, h1, n1, x1) }
      if constexpr (T > 2) { TESSERA_SUB(s2, h2, n2, x2) }
      if constexpr (T > 3) { TESSERA_SUB(s3, h3, n3, x3) }
#undef TESSERA_SUB
    }
  }
};

using Q4_KFormat = K4Format<BlockQ4_Kx8, false>;
using Q5_KFormat = K4Format<BlockQ5_Kx8, true>;

// One group of 8 rows against T activation rows.
template <class F, int T>
void group_pass(int64_t nb, const typename F::Block* w, const uint8_t* x, size_t x_stride,
                const XScales* xsc, bool prefetch, float* y, int64_t y_stride, int rows) {
  static_assert(T >= 1 && T <= kMaxTokens);
  using Block = typename F::Block;
  using XBlock = typename F::XBlock;
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  const auto* x0 = reinterpret_cast<const XBlock*>(x);
  const auto* x1 = reinterpret_cast<const XBlock*>(x + (T > 1 ? 1 : 0) * x_stride);
  const auto* x2 = reinterpret_cast<const XBlock*>(x + (T > 2 ? 2 : 0) * x_stride);
  const auto* x3 = reinterpret_cast<const XBlock*>(x + (T > 3 ? 3 : 0) * x_stride);
  const char* wbytes = reinterpret_cast<const char*>(w);
  for (int64_t ib = 0; ib < nb; ++ib) {
    if (prefetch) {
      const char* a = wbytes + ib * sizeof(Block) + kPrefetchBytes;
      for (size_t off = 0; off < sizeof(Block); off += 64) _mm_prefetch(a + off, kPrefetchHint<Block>);
    }
    const Block& b = w[ib];
    __m256i s0, s1, s2, s3, n0, n1, n2, n3;
    if constexpr (F::kSubMins) {
      F::template sums<T>(b, x0[ib], x1[ib], x2[ib], x3[ib], s0, s1, s2, s3, n0, n1, n2, n3);
    } else {
      F::template sums<T>(b, x0[ib], x1[ib], x2[ib], x3[ib], s0, s1, s2, s3);
    }
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b.d)));
    __m256 mw = _mm256_setzero_ps();
    if constexpr (F::kHasMin)
      mw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b.m)));
    if constexpr (F::kSubMins)
      mw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b.dmin)));
#define TESSERA_SCALE(a, acc32, t, mins)                                                       \
    {                                                                                    \
      __m256i isum = acc32;                                                              \
      if constexpr (F::kOffset != 0)                                                     \
        isum = _mm256_sub_epi32(isum, _mm256_set1_epi32(xsc[t].sum[ib]));                \
      a = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_broadcast_ss(xsc[t].d + ib)),         \
                          _mm256_cvtepi32_ps(isum), a);                                  \
      if constexpr (F::kHasMin) a = _mm256_fmadd_ps(mw, _mm256_broadcast_ss(xsc[t].s + ib), a); \
      if constexpr (F::kSubMins)                                                         \
        a = _mm256_fnmadd_ps(_mm256_mul_ps(mw, _mm256_broadcast_ss(xsc[t].d + ib)),      \
                             _mm256_cvtepi32_ps(mins), a);                               \
    }
    TESSERA_SCALE(a0, s0, 0, n0)
    if constexpr (T > 1) TESSERA_SCALE(a1, s1, 1, n1)
    if constexpr (T > 2) TESSERA_SCALE(a2, s2, 2, n2)
    if constexpr (T > 3) TESSERA_SCALE(a3, s3, 3, n3)
#undef TESSERA_SCALE
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

#undef TESSERA_KEEP

template <class F>
void matmul_x8(int64_t nb, const typename F::Block* w, int64_t w_rows, const uint8_t* x,
               size_t x_stride, int64_t x_rows, float* y, int64_t y_stride) {
  using Block = typename F::Block;
  using PassFn = void (*)(int64_t, const Block*, const uint8_t*, size_t, const XScales*, bool,
                          float*, int64_t, int);
  constexpr PassFn kPasses[kMaxTokens] = {&group_pass<F, 1>, &group_pass<F, 2>,
                                          &group_pass<F, 3>, &group_pass<F, 4>};
  thread_local XScaleTables tables;
  tables.fill<F>(nb, x, x_stride, x_rows);
  const int64_t groups = (w_rows + 7) / 8;
  const size_t group_bytes = static_cast<size_t>(nb) * sizeof(Block);
  const int64_t panel_groups = std::max<int64_t>(1, static_cast<int64_t>(kPanelBytes / group_bytes));
  for (int64_t p0 = 0; p0 < groups; p0 += panel_groups) {
    const int64_t p1 = std::min(groups, p0 + panel_groups);
    for (int64_t t0 = 0; t0 < x_rows; t0 += kMaxTokens) {
      const int tt = static_cast<int>(std::min<int64_t>(kMaxTokens, x_rows - t0));
      XScales xsc[kMaxTokens];
      for (int t = 0; t < tt; ++t) xsc[t] = tables.row<F>(nb, t0 + t);
      // Prefetching ahead pays when the weights come from DRAM, i.e. when each group is read
      // once per call; with several activation chunks per panel the later chunks find it in L1.
      const bool prefetch = t0 == 0;
      for (int64_t g = p0; g < p1; ++g) {
        const int rows = static_cast<int>(std::min<int64_t>(8, w_rows - 8 * g));
        kPasses[tt - 1](nb, w + g * nb, x + t0 * x_stride, x_stride, xsc, prefetch,
                        y + t0 * y_stride + 8 * g, y_stride, rows);
      }
    }
  }
}

}  // namespace

void TESSERA_X8_FN(matmul_q4_1x8)(int64_t nb, const BlockQ4_1x8* w, int64_t w_rows, const uint8_t* x,
                        size_t x_stride, int64_t x_rows, float* y, int64_t y_stride) {
  matmul_x8<Q4_1Format>(nb, w, w_rows, x, x_stride, x_rows, y, y_stride);
}

void TESSERA_X8_FN(matmul_q4_0x8)(int64_t nb, const BlockQ4_0x8* w, int64_t w_rows, const uint8_t* x,
                        size_t x_stride, int64_t x_rows, float* y, int64_t y_stride) {
  matmul_x8<Q4_0Format>(nb, w, w_rows, x, x_stride, x_rows, y, y_stride);
}

void TESSERA_X8_FN(matmul_q5_0x8)(int64_t nb, const BlockQ5_0x8* w, int64_t w_rows, const uint8_t* x,
                        size_t x_stride, int64_t x_rows, float* y, int64_t y_stride) {
  matmul_x8<Q5_0Format>(nb, w, w_rows, x, x_stride, x_rows, y, y_stride);
}

void TESSERA_X8_FN(matmul_q5_1x8)(int64_t nb, const BlockQ5_1x8* w, int64_t w_rows, const uint8_t* x,
                        size_t x_stride, int64_t x_rows, float* y, int64_t y_stride) {
  matmul_x8<Q5_1Format>(nb, w, w_rows, x, x_stride, x_rows, y, y_stride);
}

void TESSERA_X8_FN(matmul_q8_0x8)(int64_t nb, const BlockQ8_0x8* w, int64_t w_rows, const uint8_t* x,
                        size_t x_stride, int64_t x_rows, float* y, int64_t y_stride) {
  matmul_x8<Q8_0Format>(nb, w, w_rows, x, x_stride, x_rows, y, y_stride);
}

void TESSERA_X8_FN(matmul_q4_kx8)(int64_t nb, const BlockQ4_Kx8* w, int64_t w_rows, const uint8_t* x,
                        size_t x_stride, int64_t x_rows, float* y, int64_t y_stride) {
  matmul_x8<Q4_KFormat>(nb, w, w_rows, x, x_stride, x_rows, y, y_stride);
}

void TESSERA_X8_FN(matmul_q5_kx8)(int64_t nb, const BlockQ5_Kx8* w, int64_t w_rows, const uint8_t* x,
                        size_t x_stride, int64_t x_rows, float* y, int64_t y_stride) {
  matmul_x8<Q5_KFormat>(nb, w, w_rows, x, x_stride, x_rows, y, y_stride);
}

void TESSERA_X8_FN(matmul_q6_kx8)(int64_t nb, const BlockQ6_Kx8* w, int64_t w_rows, const uint8_t* x,
                        size_t x_stride, int64_t x_rows, float* y, int64_t y_stride) {
  matmul_x8<Q6_KFormat>(nb, w, w_rows, x, x_stride, x_rows, y, y_stride);
}

}  // namespace tessera::kernels

#endif  // x86
