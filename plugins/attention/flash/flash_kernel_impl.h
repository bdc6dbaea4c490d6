// The body of attention.flash's inner kernel. Included once by flash_attention.cpp (portable
// build), once by flash_attention_avx2.cpp (compiled with -mavx2 -mfma -mf16c) and once by
// flash_attention_avx512.cpp (the same plus AVX-512 F/BW/VL); everything here has internal
// linkage so the builds never mix. The vector helpers use intrinsics when the including file
// is compiled for AVX2, plain loops otherwise. The AVX-512 build runs the AVX2 build's
// operations, some of them 16 lanes at a time, so the two give the same bits.
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <utility>

#include "flash_kernel.h"
#include "tessera/sdk/kernels/ggml_simd.h"
#include "tessera/sdk/kernels/ggml_types.h"
#include "tessera/sdk/kv_rows.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define TESSERA_FLASH_AVX2 1
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define TESSERA_FLASH_AVX512 1
#endif
#endif

namespace tessera::flash {
namespace {

#if TESSERA_FLASH_AVX2
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// A key's dot product from its two 8-lane partial sums (elements k..k+7 and k+8..k+15 of every
// 16): hsum's first step, lo + hi of (x + y). four_key_scores then finishes four keys at once.
inline __m128 fold(__m256 x, __m256 y) {
  const __m256 v = _mm256_add_ps(x, y);
  return _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
}

// out[0..4) = scale * the dot products of four keys from their folded partial sums t0..t3: a
// 4x4 transpose and (t0 + t2) + (t1 + t3), hsum's remaining steps in its order, so each score
// has the bits dot() gives it.
inline void four_key_scores(__m128 t0, __m128 t1, __m128 t2, __m128 t3, float scale, float* out) {
  _MM_TRANSPOSE4_PS(t0, t1, t2, t3);  // t_j now holds lane j of the four keys
  const __m128 sum = _mm_add_ps(_mm_add_ps(t0, t2), _mm_add_ps(t1, t3));
  _mm_storeu_ps(out, _mm_mul_ps(sum, _mm_set1_ps(scale)));
}
#endif

// K/V elements as floats: a float row as is, an f16 row widened (exactly) on the fly.
inline float widen(float v) { return v; }
inline float widen(uint16_t v) { return fp16_to_fp32(v); }
#if TESSERA_FLASH_AVX2
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
#endif

// A Q8_0 row (tessera/sdk/kv_rows.h) read where it lies, the way the loops below read a float
// or f16 row: `row + k` is k elements on, `row[k]` and load8(row + k) widen elements with
// widen_kv_row's one exact multiply d * q. So a loop computes over a Q8_0 pool in place what
// it computes over a tile widened to f32 scratch, bit for bit, without the scratch's store and
// reload. 8-element loads must not straddle a 32-element block: the loops load at multiples
// of 8 from the row's start, and a Q8_0 head_dim is a multiple of 32.
struct Q8Row {
  const KvBlockQ8_0* blocks;
  int32_t offset;  // in elements
  Q8Row operator+(int32_t n) const { return {blocks, offset + n}; }
  float operator[](int32_t i) const {
    const int32_t e = offset + i;
    const KvBlockQ8_0& b = blocks[e / kKvQ8BlockElems];
    return kv_half_to_float(b.d) * static_cast<float>(b.qs[e % kKvQ8BlockElems]);
  }
};
#if TESSERA_FLASH_AVX2
// The loops below widen 8 elements at a time with load8(row + k, block_scale(row + k)): the
// scale of a Q8_0 block is converted once per 16 or 32 elements instead of once per load, and
// float and f16 rows get an empty scale that costs nothing. A scale serves the loads of the
// 32-element block it was taken from.
struct NoScale {};
template <class T>
inline NoScale block_scale(const T*) { return {}; }
template <class T>
inline __m256 load8(const T* p, NoScale) { return load8(p); }
inline __m256 block_scale(Q8Row r) {
  // F16C's half -> float is exact for every non-NaN half, as kv_half_to_float is.
  return _mm256_set1_ps(_cvtsh_ss(r.blocks[r.offset / kKvQ8BlockElems].d));
}
inline __m256 load8(Q8Row r, __m256 d) {
  const int8_t* q = r.blocks[r.offset / kKvQ8BlockElems].qs + r.offset % kKvQ8BlockElems;
  const __m128i q8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q));
  return _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8)));
}
inline __m256 load8(Q8Row r) { return load8(r, block_scale(r)); }
#endif

#if TESSERA_FLASH_AVX512
// 16 elements at a time: two of the AVX2 build's 8-element loads side by side, lane for lane
// the same values (a Q8_0 block's scale times its quants, an f16 element widened exactly).
// `p` must not straddle a 32-element Q8_0 block: the loops load at multiples of 16.
inline NoScale wide_scale(NoScale s) { return s; }
inline __m512 wide_scale(__m256 d) { return _mm512_broadcastss_ps(_mm256_castps256_ps128(d)); }
inline __m512 load16(const float* p, NoScale) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p, NoScale) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load16(Q8Row r, __m512 d) {
  const int8_t* q = r.blocks[r.offset / kKvQ8BlockElems].qs + r.offset % kKvQ8BlockElems;
  const __m128i q8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  return _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q8)));
}
// fold() of an AVX2 accumulator pair held in one zmm register, a in lanes 0-7 and b in 8-15.
inline __m128 fold16(__m512 acc) {
  return fold(_mm512_castps512_ps256(acc),
              _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc), 1)));
}
#endif

// dot(a, b) over n elements. The portable loop keeps eight independent partial sums so the
// compiler can vectorize it without reassociating (no -ffast-math needed). b may be an f16
// row or a Q8Row: its elements widen exactly, so the result is the same as over a widened copy.
template <class Row>
inline float dot(const float* a, Row b, int32_t n) {
  int32_t k = 0;
  float sum = 0.0f;
#if TESSERA_FLASH_AVX2
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  for (; k + 16 <= n; k += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + k), load8(b + k), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + k + 8), load8(b + k + 8), acc1);
  }
  for (; k + 8 <= n; k += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + k), load8(b + k), acc0);
  sum = hsum(_mm256_add_ps(acc0, acc1));
#else
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (; k + 8 <= n; k += 8)
    for (int32_t l = 0; l < 8; ++l) acc[l] += a[k + l] * widen(b[k + l]);
  sum = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
#endif
  for (; k < n; ++k) sum += a[k] * widen(b[k]);
  return sum;
}

// exp for the online softmax is ggml's (tessera/ggml_simd.h, also used by SiLU and the
// sampler): within 2 ulp of expf, exp(0) exactly 1 (so a row's maximum contributes exactly 1
// to its sum), exp(-inf) = 0, and its 8-lane form returns the scalar form's bits in every lane.
// So a score gets the same bits in a vector lane as in a scalar tail (how many scores a tile
// leaves to the tail depends on the path: the causal mask shortens a prompt row's last tile),
// and the portable build gives the AVX2 build's bits. libm's expf, one call per score, was
// ~4% of a serving profile.
using simd::ggml_expf_inline;

// The largest of s[0..n) (-inf when n == 0). Order does not matter for a maximum: the only
// ties it could break differently are +0 vs -0, which give the same exp(s - max).
inline float row_max(const float* s, int32_t n) {
  float mx = -std::numeric_limits<float>::infinity();
  int32_t c = 0;
#if TESSERA_FLASH_AVX2
  if (n >= 8) {
    __m256 v = _mm256_loadu_ps(s);
    for (c = 8; c + 8 <= n; c += 8) v = _mm256_max_ps(v, _mm256_loadu_ps(s + c));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    mx = _mm_cvtss_f32(h);
  }
#endif
  for (; c < n; ++c) mx = std::max(mx, s[c]);
  return mx;
}

// s[c] = exp(s[c] - max) for c < n, in place; returns the sum of the new s[c] in double.
// The sum was a serial chain of double adds (4 cycles each, a quarter of a decode tile's
// time); now it runs in 8 lanes (two 4-wide double vectors), folded lane j + lane j+4, then
// (l0 + l2) + (l1 + l3), then the tail in sequence — the same order in both builds, so it is
// the same on every path.
inline double exp_sum_row(float* s, int32_t n, float max) {
  int32_t c = 0;
  double sum = 0.0;
#if TESSERA_FLASH_AVX2
  if (n >= 8) {
    const __m256 mx = _mm256_set1_ps(max);
    __m256d acc0 = _mm256_setzero_pd(), acc1 = _mm256_setzero_pd();
    for (; c + 8 <= n; c += 8) {
      const __m256 p = simd::ggml_v_expf(_mm256_sub_ps(_mm256_loadu_ps(s + c), mx));
      _mm256_storeu_ps(s + c, p);
      acc0 = _mm256_add_pd(acc0, _mm256_cvtps_pd(_mm256_castps256_ps128(p)));
      acc1 = _mm256_add_pd(acc1, _mm256_cvtps_pd(_mm256_extractf128_ps(p, 1)));
    }
    const __m256d t = _mm256_add_pd(acc0, acc1);
    const __m128d lo = _mm256_castpd256_pd128(t), hi = _mm256_extractf128_pd(t, 1);
    const __m128d even_odd = _mm_add_pd(lo, hi);  // (l0 + l2, l1 + l3)
    sum = _mm_cvtsd_f64(_mm_add_sd(even_odd, _mm_unpackhi_pd(even_odd, even_odd)));
  }
#else
  if (n >= 8) {
    double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (; c + 8 <= n; c += 8)
      for (int32_t j = 0; j < 8; ++j) {
        s[c + j] = ggml_expf_inline(s[c + j] - max);
        acc[j] += s[c + j];
      }
    sum = ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
  }
#endif
  for (; c < n; ++c) {
    s[c] = ggml_expf_inline(s[c] - max);
    sum += s[c];
  }
  return sum;
}

// scores[c] = dot(q, k_row(c), n) * scale for c < cols — dot()'s exact operations per key,
// but four keys at a time in the AVX2 build: eight independent FMA chains instead of two,
// and the four horizontal sums done as one 4x4 transpose with the same addition tree
// ((s0 + s2) + (s1 + s3) of lo + hi), so every score has dot()'s bits.
template <class KRow>
inline void scores(const float* q, KRow k_row, int32_t cols, int32_t n, float scale,
                   float* out) {
  int32_t c = 0;
#if TESSERA_FLASH_AVX2
  if (n % 8 == 0) {
    for (; c + 4 <= cols; c += 4) {
      const auto k0 = k_row(c);
      const auto k1 = k_row(c + 1);
      const auto k2 = k_row(c + 2);
      const auto k3 = k_row(c + 3);
      __m256 a0 = _mm256_setzero_ps(), b0 = a0, a1 = a0, b1 = a0, a2 = a0, b2 = a0, a3 = a0, b3 = a0;
      int32_t k = 0;
      for (; k + 16 <= n; k += 16) {
        const __m256 qa = _mm256_loadu_ps(q + k), qb = _mm256_loadu_ps(q + k + 8);
        const auto d0 = block_scale(k0 + k), d1 = block_scale(k1 + k);
        a0 = _mm256_fmadd_ps(qa, load8(k0 + k, d0), a0);
        b0 = _mm256_fmadd_ps(qb, load8(k0 + k + 8, d0), b0);
        a1 = _mm256_fmadd_ps(qa, load8(k1 + k, d1), a1);
        b1 = _mm256_fmadd_ps(qb, load8(k1 + k + 8, d1), b1);
        const auto d2 = block_scale(k2 + k), d3 = block_scale(k3 + k);
        a2 = _mm256_fmadd_ps(qa, load8(k2 + k, d2), a2);
        b2 = _mm256_fmadd_ps(qb, load8(k2 + k + 8, d2), b2);
        a3 = _mm256_fmadd_ps(qa, load8(k3 + k, d3), a3);
        b3 = _mm256_fmadd_ps(qb, load8(k3 + k + 8, d3), b3);
      }
      for (; k + 8 <= n; k += 8) {
        const __m256 qa = _mm256_loadu_ps(q + k);
        a0 = _mm256_fmadd_ps(qa, load8(k0 + k), a0);
        a1 = _mm256_fmadd_ps(qa, load8(k1 + k), a1);
        a2 = _mm256_fmadd_ps(qa, load8(k2 + k), a2);
        a3 = _mm256_fmadd_ps(qa, load8(k3 + k), a3);
      }
      four_key_scores(fold(a0, b0), fold(a1, b1), fold(a2, b2), fold(a3, b3), scale, out + c);
    }
  }
#endif
  for (; c < cols; ++c) out[c] = dot(q, k_row(c), n) * scale;
}

// rescale_accumulate for elements [k0, d) only, element by element: what the vector loops
// leave over (all of o in the portable build).
template <class VRow>
inline void rescale_accumulate_tail(float* o, float alpha, const float* p, VRow v_row,
                                    int32_t cols, int32_t k0, int32_t d) {
  if (k0 == d) return;
  if (alpha != 1.0f)
    for (int32_t k = k0; k < d; ++k) o[k] *= alpha;
  for (int32_t c = 0; c < cols; ++c) {
    const float pc = p[c];
    const auto vc = v_row(c);
    for (int32_t k = k0; k < d; ++k) o[k] += pc * widen(vc[k]);
  }
}

// o[0..d) = alpha * o + sum over c < cols of p[c] * v_row(c)[0..d). The AVX2 build keeps a
// 32-float slice of o in registers across all columns. VRow maps a column to its V row
// (float or f16 elements).
template <class VRow>
inline void rescale_accumulate(float* o, float alpha, const float* p, VRow v_row, int32_t cols,
                               int32_t d) {
  int32_t k0 = 0;
#if TESSERA_FLASH_AVX2
  const __m256 a = _mm256_set1_ps(alpha);
  // 64 elements per pass where the head is that wide: 8 independent FMA chains keep both FMA
  // pipes busy (4 chains waited on the FMA latency). Each element's sequence is unchanged.
  for (; k0 + 64 <= d; k0 += 64) {
    __m256 acc[8];
    for (int j = 0; j < 8; ++j) acc[j] = _mm256_mul_ps(a, _mm256_loadu_ps(o + k0 + 8 * j));
    for (int32_t c = 0; c < cols; ++c) {
      const auto vc = v_row(c) + k0;
      const __m256 pc = _mm256_set1_ps(p[c]);
      const auto d0 = block_scale(vc), d1 = block_scale(vc + 32);
      for (int j = 0; j < 4; ++j) acc[j] = _mm256_fmadd_ps(pc, load8(vc + 8 * j, d0), acc[j]);
      for (int j = 4; j < 8; ++j) acc[j] = _mm256_fmadd_ps(pc, load8(vc + 8 * j, d1), acc[j]);
    }
    for (int j = 0; j < 8; ++j) _mm256_storeu_ps(o + k0 + 8 * j, acc[j]);
  }
  for (; k0 + 32 <= d; k0 += 32) {
    __m256 o0 = _mm256_mul_ps(a, _mm256_loadu_ps(o + k0));
    __m256 o1 = _mm256_mul_ps(a, _mm256_loadu_ps(o + k0 + 8));
    __m256 o2 = _mm256_mul_ps(a, _mm256_loadu_ps(o + k0 + 16));
    __m256 o3 = _mm256_mul_ps(a, _mm256_loadu_ps(o + k0 + 24));
    for (int32_t c = 0; c < cols; ++c) {
      const auto vc = v_row(c) + k0;
      const __m256 pc = _mm256_set1_ps(p[c]);
      const auto dv = block_scale(vc);
      o0 = _mm256_fmadd_ps(pc, load8(vc, dv), o0);
      o1 = _mm256_fmadd_ps(pc, load8(vc + 8, dv), o1);
      o2 = _mm256_fmadd_ps(pc, load8(vc + 16, dv), o2);
      o3 = _mm256_fmadd_ps(pc, load8(vc + 24, dv), o3);
    }
    _mm256_storeu_ps(o + k0, o0);
    _mm256_storeu_ps(o + k0 + 8, o1);
    _mm256_storeu_ps(o + k0 + 16, o2);
    _mm256_storeu_ps(o + k0 + 24, o3);
  }
#endif
  rescale_accumulate_tail(o, alpha, p, v_row, cols, k0, d);
}

// dst[i] = src[i] rounded to f16 and widened back (Q at an f16 cache's precision), or copied
// when !half. The library's fp32_to_fp16 / fp16_to_fp32 are out-of-line calls: done per
// element they were ~15% of a 16-sequence decode step. F16C's vcvtps2ph with
// round-to-nearest-even gives fp32_to_fp16's bits for every non-NaN float (subnormal halves
// and overflow to inf included); a NaN stays a NaN, only its payload may differ. Every path
// of a build rounds Q through here, so paths still agree bit for bit.
inline void round_queries(const float* src, float* dst, int32_t n, bool half) {
  if (!half) {
    std::copy(src, src + n, dst);
    return;
  }
  int32_t i = 0;
#if TESSERA_FLASH_AVX2
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm256_cvtps_ph(_mm256_loadu_ps(src + i),
                                                               _MM_FROUND_TO_NEAREST_INT)));
#endif
  for (; i < n; ++i) dst[i] = fp16_to_fp32(fp32_to_fp16(src[i]));
}

// Widens positions [begin, end) of KV head `kv_head` from a pool of `dtype` rows into
// dst[end - begin][head_dim] (exactly: tessera/sdk/kv_rows.h), walking the block table a
// block at a time.
inline void load_tile(const AttentionShape& s, KvDtype dtype, const void* pool,
                      const AttentionSequence& seq, int32_t begin, int32_t end, int32_t kv_head,
                      float* dst) {
  const int32_t d = s.head_dim;
  const auto* base = static_cast<const uint8_t*>(pool);
  const size_t head_bytes = kv_row_bytes(dtype, d);
  const size_t slot_bytes = head_bytes * static_cast<size_t>(s.num_kv_heads);
  for (int32_t pos = begin; pos < end;) {
    const int32_t in_block = pos % s.block_size;
    const int32_t run = std::min(end - pos, s.block_size - in_block);  // rows left in block
    const uint8_t* row = base + kv_row_offset(dtype,
                                              static_cast<int64_t>(seq.block_table[pos / s.block_size]) *
                                                      s.block_size + in_block,
                                              s.num_kv_heads, kv_head, d);
    for (int32_t r = 0; r < run; ++r, dst += d, row += slot_bytes) widen_kv_row(dtype, row, dst, d);
    pos += run;
  }
}

// slots[i] = where position begin + i's rows start in a K or V pool (in the pool's units:
// elements of a float pool, bytes of a Q8_0 one; KV head 0), for positions [begin, end):
// slot * `slot_stride`, the stride being one position's rows of all KV heads. The block table
// is walked a block at a time: the decode loops used to find each row with a division and a
// table lookup per read (perf showed the idivs), and read every row several times.
inline void tile_slots(const AttentionShape& s, const AttentionSequence& seq, int32_t begin,
                       int32_t end, int64_t slot_stride, int64_t* slots) {
  for (int32_t pos = begin; pos < end;) {
    const int32_t in_block = pos % s.block_size;
    const int32_t run = std::min(end - pos, s.block_size - in_block);  // rows left in block
    const int64_t first =
        (static_cast<int64_t>(seq.block_table[pos / s.block_size]) * s.block_size + in_block) *
        slot_stride;
    for (int32_t r = 0; r < run; ++r) *slots++ = first + r * slot_stride;
    pos += run;
  }
}

inline void prefetch_bytes(const void* row, size_t bytes) {
#if TESSERA_FLASH_AVX2
  const char* p = static_cast<const char*>(row);
  for (size_t o = 0; o < bytes; o += 64) _mm_prefetch(p + o, _MM_HINT_T0);
#else
  (void)row;
  (void)bytes;
#endif
}

// Each run of consecutive slots of a decode tile (a KV block's part of it), in order:
// fn(k_bytes, v_bytes, bytes) gets where the run's K rows and its V rows start and how many
// bytes each spans (whole positions, every KV head), and returns false to stop the walk.
// Pool is FloatPool or Q8Pool: base + slot addresses a position in both.
template <class Pool, class Fn>
inline void for_each_run(const Pool& k_pool, const Pool& v_pool, const int64_t* slots,
                         int32_t count, Fn&& fn) {
  constexpr size_t kUnit = sizeof(*k_pool.base);
  for (int32_t c0 = 0; c0 < count;) {
    int32_t c1 = c0 + 1;
    while (c1 < count && slots[c1] == slots[c1 - 1] + k_pool.slot_stride) ++c1;
    const size_t bytes =
        static_cast<size_t>(c1 - c0) * static_cast<size_t>(k_pool.slot_stride) * kUnit;
    if (!fn(reinterpret_cast<const uint8_t*>(k_pool.base + slots[c0]),
            reinterpret_cast<const uint8_t*>(v_pool.base + slots[c0]), bytes))
      return;
    c0 = c1;
  }
}

// Reads every cache line of a decode tile's K rows, then its V rows, with plain loads (a
// byte per line), one run of consecutive slots (a KV block's part of the tile) at a time,
// before the dots touch them; the values are discarded. Each K/V row is read once per token
// and has usually left the cache since the last one. Software prefetches of a whole tile (64
// positions x 3 f16 heads: 768 lines) in one burst stalled as long as the misses they were
// meant to hide; sequential loads over each contiguous run let the hardware prefetchers
// stream it. Whole-sequence decode tasks now use this for a task's first tile only and ask
// for every later tile while computing the one before (PrefetchNextTile: into L2, spread
// over the dot loops, 35-45 % less time from DRAM); a first tile the previous task already
// asked for hits the cache here. `bench_attention --plugin flash
// --decode-only --context 256 --batch 256` (50 MB of f16 K/V, more than the L3): 5.8-6.4 ms
// with the prefetches, 3.6-4.3 ms with these loads (AVX2 EPYC, 32 MiB L3, 2026-12-07); with
// the K/V in L3 (batch 16-64) the two are as fast.
template <class Pool>
inline void stream_tile(const Pool& k_pool, const Pool& v_pool, const int64_t* slots,
                        int32_t count) {
  uint32_t sink = 0;
  for_each_run(k_pool, v_pool, slots, count, [&](const uint8_t* k, const uint8_t* v, size_t bytes) {
    for (const uint8_t* run : {k, v}) {
      // One byte per 64 bytes, and the run's last byte: every line the run spans, whatever
      // its alignment, and nothing past its end (a q8_0 run need not end on a line).
      for (size_t o = 0; o < bytes; o += 64) sink |= run[o];
      sink |= run[bytes - 1];
    }
    return true;
  });
  __asm__ volatile("" : : "r"(sink));  // keeps the loads
}

// One K or V pool as the in-place decode loops read it: at(slot, h) is KV head h's row at a
// tile_slots() entry, prefetch() asks for `heads` consecutive heads' rows from there;
// slot_stride is one position's rows of all KV heads in the pool's units (tile_slots()).
template <class T>
struct FloatPool {  // f32 or f16 elements
  const T* base;
  int32_t head_dim;
  int64_t slot_stride;  // elements
  const T* at(int64_t slot, int32_t kv_head) const {
    return base + slot + static_cast<int64_t>(kv_head) * head_dim;
  }
  void prefetch(int64_t slot, int32_t kv_head, int32_t heads) const {
    prefetch_bytes(at(slot, kv_head), static_cast<size_t>(heads) * head_dim * sizeof(T));
  }
};
struct Q8Pool {
  const uint8_t* base;
  size_t head_bytes;  // one head's row: head_dim / 32 blocks
  int64_t slot_stride;  // bytes
  Q8Row at(int64_t slot, int32_t kv_head) const {
    return {reinterpret_cast<const KvBlockQ8_0*>(base + slot + kv_head * head_bytes), 0};
  }
  void prefetch(int64_t slot, int32_t kv_head, int32_t heads) const {
    prefetch_bytes(base + slot + kv_head * head_bytes, heads * head_bytes);
  }
};

// What a tile step asks for ahead of time while it computes: nothing (NoPrefetch), or the
// next tile's K and V bytes (PrefetchNextTile). next_lines() is called once per key as the
// scores reach it and once per key as the first P * V pass does, so the prefetches are
// spread over the tile's arithmetic instead of issued in one burst (a burst of a whole
// tile's 768 lines fills the core's miss buffers and stalls as long as the misses it hides;
// see stream_tile).
struct NoPrefetch {
  void next_lines() const {}
};
inline constexpr int32_t kMaxTileRuns = 16;  // runs past this many are read on demand
template <class Pool>
struct PrefetchNextTile {
  // The next tile's bytes in the order stream_tile reads them (per run of consecutive slots,
  // its K bytes then its V bytes), handed out a few lines per call in address order, so the
  // hardware sees a stream and the tile's arithmetic hides the misses. Into L2 (T1): L1
  // prefetches of the same lines competed with the current tile's rows and gained a third
  // as much.
  struct Segment {
    const char* begin;
    size_t bytes;
  };
  Segment segments[2 * kMaxTileRuns];
  int32_t num_segments = 0;
  int32_t lines_per_call = 1;
  mutable int32_t segment = 0;
  mutable size_t offset = 0;

  // `calls`: how many next_lines() calls the current tile will make (tile_step_group_calls
  // per KV head), over which the next tile's lines are spread. Calls past the last line do
  // nothing.
  PrefetchNextTile(const Pool& k_pool, const Pool& v_pool, const int64_t* slots, int32_t count,
                   int32_t calls) {
    size_t lines = 0;
    for_each_run(k_pool, v_pool, slots, count, [&](const uint8_t* k, const uint8_t* v, size_t bytes) {
      segments[num_segments++] = {reinterpret_cast<const char*>(k), bytes};
      segments[num_segments++] = {reinterpret_cast<const char*>(v), bytes};
      lines += 2 * ((bytes + 63) / 64);
      return num_segments + 2 <= 2 * kMaxTileRuns;
    });
    if (calls > 0) lines_per_call = static_cast<int32_t>(std::max<size_t>(1, (lines + calls - 1) / calls));
  }
  // lines_per_call lines from the cursor on. A call may reach up to lines_per_call - 1 lines
  // past its segment's end: prefetches never fault, and those lines are usually the next
  // block's. The bookkeeping runs once per call, inside the dot loops, so it is kept short.
  void next_lines() const {
#if TESSERA_FLASH_AVX2
    if (segment >= num_segments) return;
    const char* p = segments[segment].begin + offset;
    for (int32_t i = 0; i < lines_per_call; ++i) _mm_prefetch(p + 64 * i, _MM_HINT_T1);
    offset += 64 * static_cast<size_t>(lines_per_call);
    if (offset >= segments[segment].bytes) {
      ++segment;
      offset = 0;
    }
#endif
  }
};

// The softmax half of a tile step for one row of `cols` scores: the running max m grows to
// cover the tile, the scores become probabilities exp(score - max) in place, the running sum
// l is rescaled and extended. Returns alpha = exp(old max - new max), the factor the row's
// output must be rescaled by; exp(-inf) = 0 also covers the first tile, where nothing is
// accumulated yet.
inline float softmax_row(float* srow, int32_t cols, float* m, double* l) {
  const float new_max = std::max(*m, row_max(srow, cols));
  const float alpha = ggml_expf_inline(*m - new_max);
  const double sum = exp_sum_row(srow, cols, new_max);
  *l = *l * alpha + sum;
  *m = new_max;
  return alpha;
}

// One step of the online softmax for one query row over one K/V tile of `cols` positions:
// scores against k_at(c), the running max m and sum l rescaled, P * V from v_at(c) into o.
// Every path of this kernel (tiled prompt rows, decode rows read in place, whole-sequence
// decode tasks) goes through here or through softmax_tile_step_heads, which performs this
// function's operations for each of its rows, so a row gets the same bits whichever path
// computes it.
template <class KAt, class VAt>
inline void softmax_tile_step(const float* q, KAt k_at, VAt v_at, int32_t cols, int32_t d,
                              float scale, float* srow, float* o, float* m, double* l) {
  scores(q, k_at, cols, d, scale, srow);
  const float alpha = softmax_row(srow, cols, m, l);
  rescale_accumulate(o, alpha, srow, v_at, cols, d);
}

#if TESSERA_FLASH_AVX512
// scores_heads() for n = 16 * NQ with AVX-512: the H query rows stay in registers (H * NQ
// zmm) for the whole tile instead of being read from L1 by every FMA, one zmm accumulator per
// head and key holds what the AVX2 loop keeps in its pair a (lanes 0-7) and b (lanes 8-15),
// so every score is the AVX2 build's (fold16, then the same transpose and sums). A 16-element
// load widens a q8_0 row with half the AVX2 loop's instructions; on the 16-sequence decode
// shape (head_dim 64, 3 heads per KV head) the whole kernel ran ~20 % faster on q8_0 and
// 5-10 % on f16 (plugin README).
template <int H, int NQ, class KAt, class Ahead>
inline void scores_heads_avx512(const float* q, KAt k_at, int32_t cols, float scale, float* out,
                                const Ahead& ahead) {
  constexpr int32_t n = 16 * NQ;
  __m512 qv[H][NQ];
#pragma GCC unroll 4
  for (int h = 0; h < H; ++h)
#pragma GCC unroll 8
    for (int s = 0; s < NQ; ++s) qv[h][s] = _mm512_loadu_ps(q + h * n + 16 * s);
  int32_t c = 0;
  for (; c + 4 <= cols; c += 4) {
    __m128 t[H][4];  // [head][key]: folded partial sums
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      ahead.next_lines();
      const auto kr = k_at(c + j);
      __m512 acc[H];
#pragma GCC unroll 4
      for (int h = 0; h < H; ++h) acc[h] = _mm512_setzero_ps();
#pragma GCC unroll 8
      for (int s = 0; s < NQ; ++s) {
        const __m512 kv = load16(kr + 16 * s, wide_scale(block_scale(kr + 16 * s)));
#pragma GCC unroll 4
        for (int h = 0; h < H; ++h) acc[h] = _mm512_fmadd_ps(qv[h][s], kv, acc[h]);
      }
#pragma GCC unroll 4
      for (int h = 0; h < H; ++h) t[h][j] = fold16(acc[h]);
    }
#pragma GCC unroll 4
    for (int h = 0; h < H; ++h) four_key_scores(t[h][0], t[h][1], t[h][2], t[h][3], scale, out + h * cols + c);
  }
  for (; c < cols; ++c) {
    ahead.next_lines();
    for (int h = 0; h < H; ++h) out[h * cols + c] = dot(q + h * n, k_at(c), n) * scale;
  }
}
#endif

// scores() for H query heads sharing K (GQA): out[h * cols + c] = dot(q + h * n, k_at(c), n)
// * scale. Each K row is loaded (and, from an f16 cache, widened) once for all H heads
// instead of once per head. The per-score operations are scores()'s exactly: accumulator a
// over elements k..k+7 and b over k+8..k+15 of every 16, an 8-element tail into a, then lo +
// hi of (a + b), a 4x4 transpose of four keys' partial sums and (t0 + t2) + (t1 + t3), times
// scale. Two keys x H heads x (a, b) is 12 accumulators for H = 3, plus one widened K vector:
// 13 of the 16 ymm registers; q comes from L1 as the FMAs' memory operand. The AVX-512 build
// takes head_dim 64 and 128 through scores_heads_avx512, with the same bits.
template <int H, class KAt, class Ahead = NoPrefetch>
inline void scores_heads(const float* q, KAt k_at, int32_t cols, int32_t n, float scale,
                         float* out, const Ahead& ahead = {}) {
  int32_t c = 0;
#if TESSERA_FLASH_AVX512
  if (n == 64) return scores_heads_avx512<H, 4>(q, k_at, cols, scale, out, ahead);
  if (n == 128) return scores_heads_avx512<H, 8>(q, k_at, cols, scale, out, ahead);
#endif
#if TESSERA_FLASH_AVX2
  if (n % 8 == 0) {
    for (; c + 4 <= cols; c += 4) {
      __m128 t[H][4];  // [head][key]: folded partial sums
      for (int32_t pair = 0; pair < 4; pair += 2) {
        ahead.next_lines();
        ahead.next_lines();
        const auto k0 = k_at(c + pair);
        const auto k1 = k_at(c + pair + 1);
        __m256 a0[H], b0[H], a1[H], b1[H];
#pragma GCC unroll 4
        for (int h = 0; h < H; ++h) a0[h] = b0[h] = a1[h] = b1[h] = _mm256_setzero_ps();
        int32_t k = 0;
        for (; k + 16 <= n; k += 16) {
          const auto d0 = block_scale(k0 + k), d1 = block_scale(k1 + k);
          __m256 kv = load8(k0 + k, d0);
#pragma GCC unroll 4
          for (int h = 0; h < H; ++h) a0[h] = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * n + k), kv, a0[h]);
          kv = load8(k0 + k + 8, d0);
#pragma GCC unroll 4
          for (int h = 0; h < H; ++h) b0[h] = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * n + k + 8), kv, b0[h]);
          kv = load8(k1 + k, d1);
#pragma GCC unroll 4
          for (int h = 0; h < H; ++h) a1[h] = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * n + k), kv, a1[h]);
          kv = load8(k1 + k + 8, d1);
#pragma GCC unroll 4
          for (int h = 0; h < H; ++h) b1[h] = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * n + k + 8), kv, b1[h]);
        }
        for (; k + 8 <= n; k += 8) {
          const __m256 kv0 = load8(k0 + k), kv1 = load8(k1 + k);
#pragma GCC unroll 4
          for (int h = 0; h < H; ++h) {
            const __m256 qa = _mm256_loadu_ps(q + h * n + k);
            a0[h] = _mm256_fmadd_ps(qa, kv0, a0[h]);
            a1[h] = _mm256_fmadd_ps(qa, kv1, a1[h]);
          }
        }
#pragma GCC unroll 4
        for (int h = 0; h < H; ++h) {
          t[h][pair] = fold(a0[h], b0[h]);
          t[h][pair + 1] = fold(a1[h], b1[h]);
        }
      }
#pragma GCC unroll 4
      for (int h = 0; h < H; ++h) four_key_scores(t[h][0], t[h][1], t[h][2], t[h][3], scale, out + h * cols + c);
    }
    for (; c < cols; ++c) {
      ahead.next_lines();
      for (int h = 0; h < H; ++h) out[h * cols + c] = dot(q + h * n, k_at(c), n) * scale;
    }
    return;
  }
#endif
  (void)c;
  for (int32_t k = 0; k < cols; ++k) ahead.next_lines();
  for (int h = 0; h < H; ++h) scores(q + h * n, k_at, cols, n, scale, out + h * cols);
}

#if TESSERA_FLASH_AVX2
// The vector width of a P * V pass: 8 floats (AVX2) or 16 (AVX-512), with the loads that widen
// a K/V row's elements at that width (load8, load16) and their block scales.
struct Lanes8 {
  using V = __m256;
  static constexpr int32_t kLanes = 8;
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V loadu(const float* p) { return _mm256_loadu_ps(p); }
  static void storeu(float* p, V v) { _mm256_storeu_ps(p, v); }
  template <class Row>
  static auto scale(Row r) { return block_scale(r); }
  template <class Row, class S>
  static V load(Row r, S d) { return load8(r, d); }
};
#if TESSERA_FLASH_AVX512
struct Lanes16 {
  using V = __m512;
  static constexpr int32_t kLanes = 16;
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V loadu(const float* p) { return _mm512_loadu_ps(p); }
  static void storeu(float* p, V v) { _mm512_storeu_ps(p, v); }
  template <class Row>
  static auto scale(Row r) { return wide_scale(block_scale(r)); }
  template <class Row, class S>
  static V load(Row r, S d) { return load16(r, d); }
};
#endif

// One pass of rescale_accumulate_heads over elements [k0, k0 + 4 * L::kLanes) (32 or 64, one
// or two Q8_0 blocks) of H heads: 4 accumulators per head stay in registers across all
// columns; each V vector is loaded (and widened) once for all heads, each probability
// broadcast once per pass. Per element: alpha * o, then one FMA per column in column order,
// whatever the width.
template <class L, int H, class VAt, class Ahead>
inline void rescale_accumulate_pass(float* o, const float* alpha, const float* p, VAt v_at,
                                    int32_t cols, int32_t d, int32_t k0, const Ahead& ahead) {
  typename L::V acc[H][4];
#pragma GCC unroll 4
  for (int h = 0; h < H; ++h) {
    const typename L::V a = L::set1(alpha[h]);
    for (int j = 0; j < 4; ++j) acc[h][j] = L::mul(a, L::loadu(o + h * d + k0 + L::kLanes * j));
  }
  for (int32_t c = 0; c < cols; ++c) {
    if (k0 == 0) ahead.next_lines();
    const auto vc = v_at(c) + k0;  // k0 is a multiple of 32: the pass starts a block
    typename L::V pc[H];
#pragma GCC unroll 4
    for (int h = 0; h < H; ++h) pc[h] = L::set1(p[h * cols + c]);
    const auto d0 = L::scale(vc);
    const auto d1 = L::kLanes > 8 ? L::scale(vc + 32) : d0;  // a 64-element pass's second block
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const typename L::V v = L::load(vc + L::kLanes * j, L::kLanes * j < 32 ? d0 : d1);
#pragma GCC unroll 4
      for (int h = 0; h < H; ++h) acc[h][j] = L::fmadd(pc[h], v, acc[h][j]);
    }
  }
#pragma GCC unroll 4
  for (int h = 0; h < H; ++h)
    for (int j = 0; j < 4; ++j) L::storeu(o + h * d + k0 + L::kLanes * j, acc[h][j]);
}
#endif

// rescale_accumulate() for H heads sharing V: o + h * d = alpha[h] * o + sum over c of
// p[h * cols + c] * v_at(c), each V vector loaded (and widened) once for all H heads. Per
// output element the operations are rescale_accumulate()'s: alpha * o, then one FMA per
// column in column order (its 64-wide and 32-wide loops differ only in how many elements
// they keep in flight), and the same element-wise tail. A 32-float slice of H = 3 heads is
// 12 accumulators, plus 3 broadcast probabilities and one V vector: 16 ymm registers; the
// AVX-512 build takes 64-float slices in as many zmm registers.
template <int H, class VAt, class Ahead = NoPrefetch>
inline void rescale_accumulate_heads(float* o, const float* alpha, const float* p, VAt v_at,
                                     int32_t cols, int32_t d, const Ahead& ahead = {}) {
  int32_t k0 = 0;
#if TESSERA_FLASH_AVX512
  for (; k0 + 64 <= d; k0 += 64) rescale_accumulate_pass<Lanes16, H>(o, alpha, p, v_at, cols, d, k0, ahead);
#endif
#if TESSERA_FLASH_AVX2
  for (; k0 + 32 <= d; k0 += 32) rescale_accumulate_pass<Lanes8, H>(o, alpha, p, v_at, cols, d, k0, ahead);
#endif
  if (k0 == 0)
    for (int32_t c = 0; c < cols; ++c) ahead.next_lines();
  for (int h = 0; h < H; ++h)
    rescale_accumulate_tail(o + h * d, alpha[h], p + h * cols, v_at, cols, k0, d);
}

// softmax_tile_step for H query heads that share K/V (rows q + h * d, o + h * d, m[h], l[h]):
// every row gets softmax_tile_step's operations, but each K/V row is read once for all H.
// srow holds H * cols floats.
template <int H, class KAt, class VAt, class Ahead = NoPrefetch>
inline void softmax_tile_step_heads(const float* q, KAt k_at, VAt v_at, int32_t cols, int32_t d,
                                    float scale, float* srow, float* o, float* m, double* l,
                                    const Ahead& ahead = {}) {
  scores_heads<H>(q, k_at, cols, d, scale, srow, ahead);
  float alpha[H];
  for (int h = 0; h < H; ++h) alpha[h] = softmax_row(srow + h * cols, cols, m + h, l + h);
  rescale_accumulate_heads<H>(o, alpha, srow, v_at, cols, d, ahead);
}

// One tile step for `count` consecutive query heads of one KV head: three at a time (the
// 16-register budget above), then a pair, then a single head through softmax_tile_step
// (whose four-keys-at-a-time scores keep 8 FMA chains busy with one head). How heads are
// chunked changes no bits: each row's operations are softmax_tile_step's either way.
// `ahead` (NoPrefetch, PrefetchNextTile) goes with every group of heads, 2 * cols
// next_lines() calls each (tile_step_group_calls); a lone head asks for its share before it
// starts. It never changes a result.
inline int32_t tile_step_group_calls(int32_t cols, int32_t count) {
  const int32_t groups = count / 3 + (count % 3 != 0 ? 1 : 0);
  return 2 * cols * groups;
}
template <class KAt, class VAt, class Ahead = NoPrefetch>
inline void tile_step_group(const float* q, KAt k_at, VAt v_at, int32_t cols, int32_t d,
                            float scale, float* srow, float* o, float* m, double* l,
                            int32_t count, const Ahead& ahead = {}) {
  int32_t g = 0;
  for (; g + 3 <= count; g += 3)
    softmax_tile_step_heads<3>(q + static_cast<size_t>(g) * d, k_at, v_at, cols, d, scale, srow,
                               o + static_cast<size_t>(g) * d, m + g, l + g, ahead);
  if (count - g == 2) {
    softmax_tile_step_heads<2>(q + static_cast<size_t>(g) * d, k_at, v_at, cols, d, scale, srow,
                               o + static_cast<size_t>(g) * d, m + g, l + g, ahead);
  } else if (count - g == 1) {
    for (int32_t c = 0; c < 2 * cols; ++c) ahead.next_lines();
    softmax_tile_step(q + static_cast<size_t>(g) * d, k_at, v_at, cols, d, scale, srow,
                      o + static_cast<size_t>(g) * d, m + g, l + g);
  }
}

// Calls fn(k_pool, v_pool) with the batch's K and V pools as FloatPool<float>,
// FloatPool<uint16_t> or Q8Pool (K and V of one dtype: the in-place decode paths).
template <class Fn>
inline void with_pools(const AttentionShape& s, const AttentionBatch& batch, Fn&& fn) {
  const int32_t d = s.head_dim;
  const auto floats = [&](auto element) {
    using T = decltype(element);
    const int64_t stride = static_cast<int64_t>(s.num_kv_heads) * d;
    fn(FloatPool<T>{static_cast<const T*>(batch.k_pool), d, stride},
       FloatPool<T>{static_cast<const T*>(batch.v_pool), d, stride});
  };
  switch (s.k_dtype) {
    case KvDtype::kF32: floats(float{}); return;
    case KvDtype::kF16: floats(uint16_t{}); return;
    case KvDtype::kQ8_0: {
      const size_t head_bytes = kv_row_bytes(KvDtype::kQ8_0, d);
      const auto stride = static_cast<int64_t>(s.num_kv_heads * head_bytes);
      fn(Q8Pool{static_cast<const uint8_t*>(batch.k_pool), head_bytes, stride},
         Q8Pool{static_cast<const uint8_t*>(batch.v_pool), head_bytes, stride});
      return;
    }
  }
}

// The online softmax of one query position for query heads [hb, he) (row g: q + g * d,
// o + g * d, m[g], l[g]) over the visible positions [kv_begin, kv_end), reading K and V rows of KV
// head `kv_head` where they lie in the pools. Tiles outermost, so a tile's K/V rows serve every
// head while they are in L1. Each head's operations are those of the tiled loop in
// run_task_impl, in the same order, so the two agree bit for bit. slots has room for kv_tile +
// kPrefetchRows entries.
template <class Pool>
inline void attend_heads(const AttentionShape& s, const AttentionSequence& seq, const Pool& k_pool,
                         const Pool& v_pool, int32_t kv_head, const float* q,
                         float* o, float* m, double* l, float* srow, int64_t* slots, int32_t hb,
                         int32_t he, int32_t kv_tile, int32_t kv_begin, int32_t kv_end) {
  const int32_t d = s.head_dim;
  for (int32_t j0 = kv_begin; j0 < kv_end; j0 += kv_tile) {
    const int32_t cols = std::min(j0 + kv_tile, kv_end) - j0;
    const int32_t ahead = std::min(j0 + cols + kPrefetchRows, kv_end) - j0;
    tile_slots(s, seq, j0, j0 + ahead, k_pool.slot_stride, slots);
    // Decode reads each K/V row once per token, and the weights streamed since the last
    // token have usually pushed them out of cache: ask for this tile's K and V rows (V is used
    // right after the scores) and the next tile's K before the dots run.
    for (int32_t c = 0; c < cols; ++c) {
      k_pool.prefetch(slots[c], kv_head, 1);
      v_pool.prefetch(slots[c], kv_head, 1);
    }
    for (int32_t c = cols; c < ahead; ++c) k_pool.prefetch(slots[c], kv_head, 1);
    // All heads of the range against this tile at once: one K/V read serves them all.
    tile_step_group(q + static_cast<size_t>(hb) * d, [&](int32_t c) { return k_pool.at(slots[c], kv_head); },
                    [&](int32_t c) { return v_pool.at(slots[c], kv_head); }, cols, d, s.scale, srow,
                    o + static_cast<size_t>(hb) * d, m + hb, l + hb, he - hb);
  }
}

void run_task_impl(const AttentionShape& s, const AttentionBatch& batch, const Task& task,
                   const Layout& lay, float* scratch, const Task* following) {
  const AttentionSequence& seq = batch.sequences[task.seq];
  const int32_t d = s.head_dim;
  const int32_t group = s.num_heads / s.num_kv_heads;
  const int32_t num_q = task.q_end - task.q_begin;
  const int32_t hb = task.head_begin, he = task.head_end;
  const int32_t rows = num_q * group;  // row r = query (r / group), head kv_head*group + r % group
  const int64_t q_stride = static_cast<int64_t>(s.num_heads) * d;
  // Query i may see positions [0, first_visible_end + i).
  const int32_t first_visible_end = seq.context_len - seq.num_queries + 1;
  float* q_tile = scratch + lay.q;
  float* o_tile = scratch + lay.o;
  float* m = scratch + lay.m;
  double* l = reinterpret_cast<double*>(scratch + lay.l);
  float* srow = scratch + lay.s;
  float* k_tile = scratch + lay.k;
  float* v_tile = scratch + lay.v;
  int64_t* slots = reinterpret_cast<int64_t*>(scratch + lay.slots);

  // Like the naive kernel (and llama.cpp): with an f16 K cache Q is rounded to f16 before it
  // meets K. The probabilities stay f32 here since they are only final at the end.
  const bool half = s.k_dtype == KvDtype::kF16;
  // Pools with one dtype are read where they lie in decode; mixed pools are widened a tile at
  // a time (exactly, so the bits are those of an f32 pool holding the same values: every path
  // goes through tile_step_group, and Q8Row widens with the same multiply). The portable build
  // widens q8_0 by tiles too: its Q8Row converts the block scale in software for every element
  // read, where a tile converts it once per 32.
#if TESSERA_FLASH_AVX2
  const bool in_place = s.k_dtype == s.v_dtype;
#else
  const bool in_place = s.k_dtype == s.v_dtype && s.k_dtype != KvDtype::kQ8_0;
#endif
  if (task.whole_sequence()) {
    const int32_t kv_end = seq.context_len;  // one query position: the whole context
    const int32_t kv_begin = attention_window_begin(s, kv_end - 1);  // or its window
    // A whole decode sequence (one query position, every head of KV heads [kv_head,
    // kv_head_end)): per tile, the K/V rows of all those KV heads are read in together (they
    // are contiguous; stream_tile), then each group of query heads runs against its KV head.
    for (int32_t kv = task.kv_head; kv < task.kv_head_end; ++kv) {
      const float* src = batch.q + seq.query_start * q_stride + static_cast<int64_t>(kv) * group * d;
      round_queries(src, q_tile + static_cast<size_t>(kv) * group * d, group * d, half);
    }
    const size_t rows_all = static_cast<size_t>(task.kv_head_end) * group;
    std::fill(o_tile, o_tile + rows_all * d, 0.0f);
    std::fill(m, m + rows_all, -std::numeric_limits<float>::infinity());
    std::fill(l, l + rows_all, 0.0);
    const auto run = [&](const auto& k_pool, const auto& v_pool) {
      using Pool = std::decay_t<decltype(k_pool)>;
      int64_t* cur = slots;
      int64_t* next = slots + lay.kv_tile + kPrefetchRows;
      for (int32_t j0 = kv_begin; j0 < kv_end; j0 += lay.kv_tile) {
        const int32_t j1 = std::min(j0 + lay.kv_tile, kv_end);
        if (j0 == kv_begin) {
          // The task reads every KV head, so whole positions: stream the first tile in
          // (stream_tile); each later one was asked for while its predecessor computed.
          tile_slots(s, seq, j0, j1, k_pool.slot_stride, cur);
          stream_tile(k_pool, v_pool, cur, j1 - j0);
        } else {
          std::swap(cur, next);
        }
        const int32_t n1 = std::min(j1 + lay.kv_tile, kv_end);
        int32_t next_count = n1 - j1;
        if (next_count > 0) {
          tile_slots(s, seq, j1, n1, k_pool.slot_stride, next);
        } else if (following != nullptr && following->whole_sequence()) {
          // The last tile: ask for the first tile of this thread's next decode task instead.
          const AttentionSequence& other = batch.sequences[following->seq];
          const int32_t b = attention_window_begin(s, other.context_len - 1);
          const int32_t e = std::min(b + lay.kv_tile, other.context_len);
          tile_slots(s, other, b, e, k_pool.slot_stride, next);
          next_count = e - b;
        }
        const PrefetchNextTile<Pool> ahead(
            k_pool, v_pool, next, next_count,
            (task.kv_head_end - task.kv_head) * tile_step_group_calls(j1 - j0, group));
        for (int32_t kv = task.kv_head; kv < task.kv_head_end; ++kv) {
          const size_t base = static_cast<size_t>(kv) * group;
          // One tile [j0, j1) of attend_heads for this KV head's query heads: same operations.
          tile_step_group(q_tile + base * d, [&](int32_t c) { return k_pool.at(cur[c], kv); },
                          [&](int32_t c) { return v_pool.at(cur[c], kv); }, j1 - j0, d, s.scale,
                          srow, o_tile + base * d, m + base, l + base, group, ahead);
        }
      }
    };
    if (!in_place) {
      for (int32_t j0 = kv_begin; j0 < kv_end; j0 += lay.kv_tile) {
        const int32_t j1 = std::min(j0 + lay.kv_tile, kv_end);
        for (int32_t kv = task.kv_head; kv < task.kv_head_end; ++kv) {
          load_tile(s, s.k_dtype, batch.k_pool, seq, j0, j1, kv, k_tile);
          load_tile(s, s.v_dtype, batch.v_pool, seq, j0, j1, kv, v_tile);
          const size_t base = static_cast<size_t>(kv) * group;
          tile_step_group(
              q_tile + base * d, [&](int32_t c) -> const float* { return k_tile + static_cast<size_t>(c) * d; },
              [&](int32_t c) -> const float* { return v_tile + static_cast<size_t>(c) * d; }, j1 - j0, d,
              s.scale, srow, o_tile + base * d, m + base, l + base, group);
        }
      }
    } else {
      with_pools(s, batch, run);
    }
    for (int32_t kv = task.kv_head; kv < task.kv_head_end; ++kv) {
      float* dst = batch.out + seq.query_start * q_stride + static_cast<int64_t>(kv) * group * d;
      for (int32_t g = 0; g < group; ++g) {
        const size_t r = static_cast<size_t>(kv) * group + g;
        const float inv = static_cast<float>(1.0 / l[r]);
        for (int32_t k = 0; k < d; ++k) dst[g * d + k] = o_tile[r * d + k] * inv;
      }
    }
    return;
  }
  for (int32_t i = 0; i < num_q; ++i) {
    const float* src = batch.q + (seq.query_start + task.q_begin + i) * q_stride +
                       static_cast<int64_t>(task.kv_head) * group * d;
    float* dst = q_tile + static_cast<size_t>(i) * group * d;
    round_queries(src + hb * d, dst + hb * d, (he - hb) * d, half);
  }
  std::fill(o_tile, o_tile + static_cast<size_t>(rows) * d, 0.0f);
  std::fill(m, m + rows, -std::numeric_limits<float>::infinity());
  std::fill(l, l + rows, 0.0);

  const int32_t kv_end = first_visible_end + task.q_end - 1;  // exclusive, for the last query
  // A sliding window: query i sees [window_begin(i), its position]; the first query's begin
  // is the lowest any of them needs.
  const auto window_begin = [&](int32_t i) {
    return attention_window_begin(s, first_visible_end - 1 + task.q_begin + i);
  };
  const int32_t kv_begin = window_begin(0);
  if (num_q == 1 && in_place) {
    // One query position (decode): nothing would reuse a widened tile, so K and V are read
    // where they lie in the pool, f16 and Q8_0 rows widened in registers.
    with_pools(s, batch, [&](const auto& k_pool, const auto& v_pool) {
      attend_heads(s, seq, k_pool, v_pool, task.kv_head, q_tile, o_tile, m, l, srow,
                   slots, hb, he, lay.kv_tile, kv_begin, kv_end);
    });
  } else {
    for (int32_t j0 = kv_begin; j0 < kv_end; j0 += lay.kv_tile) {
      const int32_t j1 = std::min(j0 + lay.kv_tile, kv_end);
      load_tile(s, s.k_dtype, batch.k_pool, seq, j0, j1, task.kv_head, k_tile);
      load_tile(s, s.v_dtype, batch.v_pool, seq, j0, j1, task.kv_head, v_tile);
      for (int32_t i = 0; i < num_q; ++i) {
        // Causal mask: the visible part of this tile is a prefix of it; a sliding window
        // also cuts its front (lo).
        const int32_t lo = std::max(j0, window_begin(i));
        const int32_t cols = std::min(j1, first_visible_end + task.q_begin + i) - lo;
        if (cols <= 0) continue;
        const size_t off = static_cast<size_t>(lo - j0);
        const int32_t r = i * group + hb;  // rows r .. r + (he - hb) are this query's heads
        tile_step_group(
            q_tile + static_cast<size_t>(r) * d,
            [&](int32_t c) -> const float* { return k_tile + (off + c) * d; },
            [&](int32_t c) -> const float* { return v_tile + (off + c) * d; }, cols, d, s.scale,
            srow, o_tile + static_cast<size_t>(r) * d, m + r, l + r, he - hb);
      }
    }
  }

  for (int32_t i = 0; i < num_q; ++i) {
    float* dst = batch.out + (seq.query_start + task.q_begin + i) * q_stride +
                 static_cast<int64_t>(task.kv_head) * group * d;
    for (int32_t g = hb; g < he; ++g) {
      const int32_t r = i * group + g;
      const float inv = static_cast<float>(1.0 / l[r]);  // l >= 1: the max term is exp(0)
      const float* o = o_tile + static_cast<size_t>(r) * d;
      for (int32_t k = 0; k < d; ++k) dst[g * d + k] = o[k] * inv;
    }
  }
}

}  // namespace
}  // namespace tessera::flash
