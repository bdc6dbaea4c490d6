// AVX2/FMA/F16C dot products. They follow ggml's x86 kernels (ggml-cpu/arch/x86/quants.c and
// ggml_vec_dot_f16/f32 with GGML_SIMD on AVX2) step for step: the same integer product
// sequence, the same per-block FMA into one 8-lane float accumulator, the same horizontal-sum
// order. Float addition is not associative, so matching the order is what keeps our logits
// within rounding noise of llama.cpp's rather than merely close.
//
// This file is compiled with -mavx2 -mfma -mf16c; nothing here may run before cpu_has_avx2().
#if defined(__x86_64__) || defined(__i386__)

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "quant_blocks.h"

// ggml is C compiled in ISO mode, where GCC does not fuse a*b+c into an FMA; GCC's C++ default
// would, changing the rounding of e.g. the Q4_1 min term. Keep every float operation separate.
#include "tessera/sdk/kernels/fp_contract_off.h"

namespace tessera::kernels {

namespace {

inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }

// 32 nibbles -> 32 bytes: low nibbles (elements 0..15) in the low 128-bit lane, high nibbles
// (elements 16..31) in the high lane, matching the Q4 element order.
inline __m256i bytes_from_nibbles_32(const uint8_t* rsi) {
  const __m128i tmp = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rsi));
  const __m256i bytes = _mm256_set_m128i(_mm_srli_epi16(tmp, 4), tmp);
  const __m256i low_mask = _mm256_set1_epi8(0xF);
  return _mm256_and_si256(low_mask, bytes);
}

// The 32 bits of a Q5 qh mask -> 32 bytes, 0xFF where the bit is set and 0 where not (byte k
// from bit k). Each byte is broadcast to the 8 lanes that need it, every bit but the wanted one
// is forced on, and the compare with all-ones tests the remaining bit.
inline __m256i bytes_from_bits_32(const uint8_t* qh) {
  uint32_t bits;
  __builtin_memcpy(&bits, qh, sizeof bits);
  const __m256i spread = _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL,
                                           0x0101010101010101LL, 0);
  const __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(bits)), spread);
  const __m256i others = _mm256_set1_epi64x(0x7fbfdfeff7fbfdfeLL);  // byte b: all bits but b mod 8
  return _mm256_cmpeq_epi8(_mm256_or_si256(bytes, others), _mm256_set1_epi64x(-1));
}

// Sum of adjacent int16 pairs -> 8 int32 -> 8 floats.
inline __m256 sum_i16_pairs_float(const __m256i x) {
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i summed_pairs = _mm256_madd_epi16(ones, x);
  return _mm256_cvtepi32_ps(summed_pairs);
}

// ax unsigned, sy signed. maddubs saturates to int16, but with |ax| <= 128 and |sy| <= 127
// two products stay within range (worst case 2*128*127 = 32512).
inline __m256 mul_sum_us8_pairs_float(const __m256i ax, const __m256i sy) {
  const __m256i dot = _mm256_maddubs_epi16(ax, sy);
  return sum_i16_pairs_float(dot);
}

// Signed x signed: maddubs needs one unsigned operand, so move x's sign onto y.
inline __m256 mul_sum_i8_pairs_float(const __m256i x, const __m256i y) {
  const __m256i ax = _mm256_sign_epi8(x, x);
  const __m256i sy = _mm256_sign_epi8(y, x);
  return mul_sum_us8_pairs_float(ax, sy);
}

// ggml's hsum_float_8: high lane + low lane, then pairwise.
inline float hsum_float_8(const __m256 x) {
  __m128 res = _mm256_extractf128_ps(x, 1);
  res = _mm_add_ps(res, _mm256_castps256_ps128(x));
  res = _mm_add_ps(res, _mm_movehl_ps(res, res));
  res = _mm_add_ss(res, _mm_movehdup_ps(res));
  return _mm_cvtss_f32(res);
}

// ggml's GGML_F32x8_REDUCE over 4 accumulators: (s0+s2) + (s1+s3), then lanes via hadd.
inline float reduce_4x8(__m256 s[4]) {
  s[0] = _mm256_add_ps(s[0], s[2]);
  s[1] = _mm256_add_ps(s[1], s[3]);
  s[0] = _mm256_add_ps(s[0], s[1]);
  const __m128 t0 = _mm_add_ps(_mm256_castps256_ps128(s[0]), _mm256_extractf128_ps(s[0], 1));
  const __m128 t1 = _mm_hadd_ps(t0, t0);
  return _mm_cvtss_f32(_mm_hadd_ps(t1, t1));
}

// ggml's GGML_F32_STEP / GGML_F32_EPR on AVX2: 4 accumulators of 8 floats.
constexpr int64_t kStep = 32;
constexpr int64_t kEpr = 8;

}  // namespace

float vec_dot_q4_0_q8_0_avx2(int64_t n, const void* w, const void* xv) {
  const auto* x = static_cast<const BlockQ4_0*>(w);
  const auto* y = static_cast<const BlockQ8_0*>(xv);
  const int64_t nb = n / kQK8_0;
  __m256 acc = _mm256_setzero_ps();
  const __m256i off = _mm256_set1_epi8(8);
  for (int64_t ib = 0; ib < nb; ++ib) {
    const __m256 d = _mm256_set1_ps(half_to_float(x[ib].d) * half_to_float(y[ib].d));
    const __m256i qx = _mm256_sub_epi8(bytes_from_nibbles_32(x[ib].qs), off);
    const __m256i qy = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(y[ib].qs));
    const __m256 q = mul_sum_i8_pairs_float(qx, qy);
    acc = _mm256_fmadd_ps(d, q, acc);
  }
  return hsum_float_8(acc);
}

float vec_dot_q4_1_q8_1_avx2(int64_t n, const void* w, const void* xv) {
  const auto* x = static_cast<const BlockQ4_1*>(w);
  const auto* y = static_cast<const BlockQ8_1*>(xv);
  const int64_t nb = n / kQK8_1;
  __m256 acc = _mm256_setzero_ps();
  // The min term is a scalar per block (m_w * s_x); ggml keeps it out of the vector
  // accumulator and adds it once at the end.
  float summs = 0.0f;
  for (int64_t ib = 0; ib < nb; ++ib) {
    const float d0 = half_to_float(x[ib].d);
    const float d1 = half_to_float(y[ib].d);
    summs += half_to_float(x[ib].m) * half_to_float(y[ib].s);
    const __m256 d0d1 = _mm256_mul_ps(_mm256_set1_ps(d0), _mm256_set1_ps(d1));
    // Q4_1 nibbles are unsigned, so they feed maddubs directly without the sign trick.
    const __m256i qx = bytes_from_nibbles_32(x[ib].qs);
    const __m256i qy = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(y[ib].qs));
    const __m256 xy = mul_sum_us8_pairs_float(qx, qy);
    acc = _mm256_fmadd_ps(d0d1, xy, acc);
  }
  return hsum_float_8(acc) + summs;
}

// Q5_0: q - 16 as a signed byte is the nibble with 0xF0 or'ed in where the fifth bit is clear
// (nibble - 16 in two's complement) and the bare nibble where it is set.
inline __m256i q5_0_signed_bytes(const BlockQ5_0* b) {
  const __m256i fifth =
      _mm256_andnot_si256(bytes_from_bits_32(b->qh), _mm256_set1_epi8(static_cast<char>(0xF0)));
  return _mm256_or_si256(bytes_from_nibbles_32(b->qs), fifth);
}

float vec_dot_q5_0_q8_0_avx2(int64_t n, const void* w, const void* xv) {
  const auto* x = static_cast<const BlockQ5_0*>(w);
  const auto* y = static_cast<const BlockQ8_0*>(xv);
  const int64_t nb = n / kQK8_0;
  __m256 acc = _mm256_setzero_ps();
  for (int64_t ib = 0; ib < nb; ++ib) {
    const __m256 d = _mm256_set1_ps(half_to_float(x[ib].d) * half_to_float(y[ib].d));
    const __m256i qx = q5_0_signed_bytes(&x[ib]);
    const __m256i qy = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(y[ib].qs));
    const __m256 q = mul_sum_i8_pairs_float(qx, qy);
    acc = _mm256_fmadd_ps(d, q, acc);
  }
  return hsum_float_8(acc);
}

// Q5_1: unsigned 0..31 quants (nibble | 0x10 where the bit is set) straight into maddubs; the
// min term is Q4_1's scalar running sum.
float vec_dot_q5_1_q8_1_avx2(int64_t n, const void* w, const void* xv) {
  const auto* x = static_cast<const BlockQ5_1*>(w);
  const auto* y = static_cast<const BlockQ8_1*>(xv);
  const int64_t nb = n / kQK8_1;
  __m256 acc = _mm256_setzero_ps();
  float summs = 0.0f;
  const __m256i bit4 = _mm256_set1_epi8(0x10);
  for (int64_t ib = 0; ib < nb; ++ib) {
    const __m256 dx = _mm256_set1_ps(half_to_float(x[ib].d));
    summs += half_to_float(x[ib].m) * half_to_float(y[ib].s);
    const __m256i fifth = _mm256_and_si256(bytes_from_bits_32(x[ib].qh), bit4);
    const __m256i qx = _mm256_or_si256(bytes_from_nibbles_32(x[ib].qs), fifth);
    const __m256 dy = _mm256_set1_ps(half_to_float(y[ib].d));
    const __m256i qy = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(y[ib].qs));
    const __m256 q = mul_sum_us8_pairs_float(qx, qy);
    acc = _mm256_fmadd_ps(q, _mm256_mul_ps(dx, dy), acc);
  }
  return hsum_float_8(acc) + summs;
}

float vec_dot_q8_0_q8_0_avx2(int64_t n, const void* w, const void* xv) {
  const auto* x = static_cast<const BlockQ8_0*>(w);
  const auto* y = static_cast<const BlockQ8_0*>(xv);
  const int64_t nb = n / kQK8_0;
  __m256 acc = _mm256_setzero_ps();
  for (int64_t ib = 0; ib < nb; ++ib) {
    const __m256 d = _mm256_set1_ps(half_to_float(x[ib].d) * half_to_float(y[ib].d));
    const __m256i qx = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[ib].qs));
    const __m256i qy = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(y[ib].qs));
    const __m256 q = mul_sum_i8_pairs_float(qx, qy);
    acc = _mm256_fmadd_ps(d, q, acc);
  }
  return hsum_float_8(acc);
}

// ---- K-quants x Q8_K (ggml's AVX2 ggml_vec_dot_q4_K_q8_K / ggml_vec_dot_q6_K_q8_K) -----------
//
// One 8-lane int32 sum per 256-element super-block, converted to float and FMA'd with the
// broadcast d_w * d_x into a single float accumulator; hsum_float_8 at the end. The lane an
// integer product lands in is fixed by the maddubs/madd pairing below, and it matters: the
// per-lane int32 -> float conversion and the FMA round per lane, so a different pairing (the
// scalar reference's element mod 8 lanes, say) gives the same value only up to rounding.

namespace {

// Q4_K's 12 packed scale bytes -> 16 bytes: the 8 6-bit scales, then the 8 6-bit mins (the
// same values get_scale_min_k4 yields), done with 32-bit masks as ggml does.
inline __m128i q4_k_scales_and_mins(const uint8_t* packed) {
  uint32_t u[4];
  __builtin_memcpy(u, packed, 12);
  constexpr uint32_t k6 = 0x3f3f3f3f;  // low 6 bits of each byte
  constexpr uint32_t k4 = 0x0f0f0f0f;
  constexpr uint32_t k2 = 0x03030303;
  const uint32_t mins_lo = u[1] & k6;                                  // mins 0-3
  u[3] = ((u[2] >> 4) & k4) | (((u[1] >> 6) & k2) << 4);               // mins 4-7
  u[1] = (u[2] & k4) | (((u[0] >> 6) & k2) << 4);                      // scales 4-7
  u[2] = mins_lo;
  u[0] &= k6;                                                          // scales 0-3
  return _mm_loadu_si128(reinterpret_cast<const __m128i*>(u));
}

// pshufb control that copies int16 element k of each 128-bit lane to all 8 of its elements.
inline __m256i broadcast_i16_control(int k) {
  return _mm256_set1_epi16(static_cast<short>(((2 * k + 1) << 8) | (2 * k)));
}

// pshufb control: bytes 0-7 <- byte 2k, bytes 8-15 <- byte 2k+1 (the int8 scales of the two
// 16-element halves of a 32-byte chunk of Q6_K quants).
inline __m128i pair_of_scales_control(int k) {
  constexpr long long kOnes = 0x0101010101010101LL;
  return _mm_set_epi64x(kOnes * (2 * k + 1), kOnes * (2 * k));
}

// min_s * (sum of q8 over sub-block s) for sub-blocks 2k, 2k+1 summed in int32 lane k: the Q8_K
// bsums pairs give the per-32 sums (int16; |sum| <= 32 * 127 fits), times the 6-bit mins (the
// upper half of sc_mn).
inline __m128i k4_mins_dot(__m256i sc_mn, const BlockQ8_K& y) {
  const __m256i bsums = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(y.bsums));
  const __m128i q8_32 = _mm_hadd_epi16(_mm256_castsi256_si128(bsums), _mm256_extracti128_si256(bsums, 1));
  return _mm_madd_epi16(_mm256_extracti128_si256(sc_mn, 1), q8_32);
}

}  // namespace

float vec_dot_q4_k_q8_k_avx2(int64_t n, const void* w, const void* xv) {
  const auto* x = static_cast<const BlockQ4_K*>(w);
  const auto* y = static_cast<const BlockQ8_K*>(xv);
  const int64_t nb = n / kQK_K;
  const __m256i low4 = _mm256_set1_epi8(0xF);
  __m256 acc = _mm256_setzero_ps();
  // The min term: 4 float lanes, each the sum over super-blocks of -dmin_w * d_x times
  // (min_2k * sum of q8 over sub-block 2k + min_2k+1 * ... over 2k+1).
  __m128 acc_m = _mm_setzero_ps();
  for (int64_t i = 0; i < nb; ++i) {
    const float d = y[i].d * half_to_float(x[i].d);
    const float dmin = -y[i].d * half_to_float(x[i].dmin);
    const __m256i sc_mn = _mm256_cvtepu8_epi16(q4_k_scales_and_mins(x[i].scales));

    const __m128i mins_dot = k4_mins_dot(sc_mn, y[i]);
    acc_m = _mm_fmadd_ps(_mm_set1_ps(dmin), _mm_cvtepi32_ps(mins_dot), acc_m);

    const __m128i sc128 = _mm256_castsi256_si128(sc_mn);
    const __m256i scales = _mm256_set_m128i(sc128, sc128);
    const uint8_t* q4 = x[i].qs;
    const int8_t* q8 = y[i].qs;
    __m256i sumi = _mm256_setzero_si256();
    for (int j = 0; j < kQK_K / 64; ++j) {
      // 32 bytes of nibbles: low nibbles are sub-block 2j, high nibbles sub-block 2j+1.
      const __m256i scale_lo = _mm256_shuffle_epi8(scales, broadcast_i16_control(2 * j));
      const __m256i scale_hi = _mm256_shuffle_epi8(scales, broadcast_i16_control(2 * j + 1));
      const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q4));
      q4 += 32;
      const __m256i q4_lo = _mm256_and_si256(bits, low4);
      const __m256i q4_hi = _mm256_and_si256(_mm256_srli_epi16(bits, 4), low4);
      // maddubs cannot saturate: two products of a nibble and an int8 are within +-3840.
      const __m256i q8_lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q8));
      q8 += 32;
      const __m256i p_lo = _mm256_madd_epi16(scale_lo, _mm256_maddubs_epi16(q4_lo, q8_lo));
      const __m256i q8_hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q8));
      q8 += 32;
      const __m256i p_hi = _mm256_madd_epi16(scale_hi, _mm256_maddubs_epi16(q4_hi, q8_hi));
      sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(p_lo, p_hi));
    }
    acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
  }
  // (m0 + m2) + (m1 + m3), then the 8-lane sum: ggml's order.
  acc_m = _mm_add_ps(acc_m, _mm_movehl_ps(acc_m, acc_m));
  acc_m = _mm_add_ss(acc_m, _mm_movehdup_ps(acc_m));
  return hsum_float_8(acc) + _mm_cvtss_f32(acc_m);
}

// ggml's AVX2 Q5_K dot: Q4_K's with the fifth bits moved to bit 4 of each quant, and the min
// term summed in one float, `summs += dmin * isum` per super-block, rounded after the multiply
// and after the add (ggml's C is not contracted into an FMA, as in the Q4_1 / Q5_1 dots).
float vec_dot_q5_k_q8_k_avx2(int64_t n, const void* w, const void* xv) {
  const auto* x = static_cast<const BlockQ5_K*>(w);
  const auto* y = static_cast<const BlockQ8_K*>(xv);
  const int64_t nb = n / kQK_K;
  const __m256i low4 = _mm256_set1_epi8(0xF);
  __m256 acc = _mm256_setzero_ps();
  float summs = 0.0f;
  for (int64_t i = 0; i < nb; ++i) {
    const float d = y[i].d * half_to_float(x[i].d);
    const float dmin = -y[i].d * half_to_float(x[i].dmin);
    const __m256i sc_mn = _mm256_cvtepu8_epi16(q4_k_scales_and_mins(x[i].scales));

    const __m128i prod = k4_mins_dot(sc_mn, y[i]);
    __m128i isum = _mm_add_epi32(prod, _mm_shuffle_epi32(prod, 0x4E));
    isum = _mm_add_epi32(isum, _mm_shuffle_epi32(isum, 0xB1));  // exact: any order
    summs = std::fma(dmin, static_cast<float>(_mm_cvtsi128_si32(isum)), summs);

    const __m128i sc128 = _mm256_castsi256_si128(sc_mn);
    const __m256i scales = _mm256_set_m128i(sc128, sc128);
    const __m256i hbits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[i].qh));
    const uint8_t* q5 = x[i].qs;
    const int8_t* q8 = y[i].qs;
    __m256i sumi = _mm256_setzero_si256();
    for (int j = 0; j < kQK_K / 64; ++j) {
      const __m256i scale_lo = _mm256_shuffle_epi8(scales, broadcast_i16_control(2 * j));
      const __m256i scale_hi = _mm256_shuffle_epi8(scales, broadcast_i16_control(2 * j + 1));
      const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q5));
      q5 += 32;
      // Fifth bits of sub-blocks 2j and 2j+1 (bits 2j, 2j+1 of each qh byte) to bit 4.
      const __m256i fifth = _mm256_set1_epi8(0x10);
      const __m256i h_lo = (2 * j <= 4)
          ? _mm256_and_si256(_mm256_slli_epi16(hbits, 4 - 2 * j), fifth)
          : _mm256_and_si256(_mm256_srli_epi16(hbits, 2 * j - 4), fifth);
      const __m256i h_hi = (2 * j + 1 <= 4)
          ? _mm256_and_si256(_mm256_slli_epi16(hbits, 3 - 2 * j), fifth)
          : _mm256_and_si256(_mm256_srli_epi16(hbits, 2 * j - 3), fifth);
      const __m256i q5_lo = _mm256_or_si256(_mm256_and_si256(bits, low4), h_lo);
      const __m256i q5_hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(bits, 4), low4), h_hi);
      // maddubs cannot saturate: two products of a 5-bit quant and an int8 are within +-7936.
      const __m256i q8_lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q8));
      q8 += 32;
      const __m256i p_lo = _mm256_madd_epi16(scale_lo, _mm256_maddubs_epi16(q5_lo, q8_lo));
      const __m256i q8_hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q8));
      q8 += 32;
      const __m256i p_hi = _mm256_madd_epi16(scale_hi, _mm256_maddubs_epi16(q5_hi, q8_hi));
      sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(p_lo, p_hi));
    }
    acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
  }
  return hsum_float_8(acc) + summs;
}

float vec_dot_q6_k_q8_k_avx2(int64_t n, const void* w, const void* xv) {
  const auto* x = static_cast<const BlockQ6_K*>(w);
  const auto* y = static_cast<const BlockQ8_K*>(xv);
  const int64_t nb = n / kQK_K;
  const __m256i low2 = _mm256_set1_epi8(3);
  const __m256i low4 = _mm256_set1_epi8(15);
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i < nb; ++i) {
    const float d = y[i].d * half_to_float(x[i].d);
    const uint8_t* ql = x[i].ql;
    const uint8_t* qh = x[i].qh;
    const int8_t* q8 = y[i].qs;

    // The quants are used unsigned (0..63, as maddubs needs) and the -32 offset is taken off
    // afterwards in one go: 32 * sum over 16-groups of scale * bsum, in the same lanes.
    const __m256i bsums = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(y[i].bsums));
    const __m128i scales = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x[i].scales));
    const __m256i offset =
        _mm256_slli_epi32(_mm256_madd_epi16(bsums, _mm256_cvtepi8_epi16(scales)), 5);

    __m256i sumi = _mm256_setzero_si256();
    int is = 0;
    for (int j = 0; j < kQK_K / 128; ++j) {
      const __m256i lo_a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql));
      const __m256i lo_b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 32));
      const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh));
      ql += 64;
      qh += 32;
      // Bits 0-1, 2-3, 4-5, 6-7 of qh are the top two bits of elements l, l+32, l+64, l+96;
      // move each pair to bits 4-5 (16-bit shifts are safe: the masks drop what crosses bytes).
      const __m256i h0 = _mm256_slli_epi16(_mm256_and_si256(hi, low2), 4);
      const __m256i h1 = _mm256_slli_epi16(_mm256_and_si256(hi, _mm256_set1_epi8(12)), 2);
      const __m256i h2 = _mm256_and_si256(hi, _mm256_set1_epi8(48));
      const __m256i h3 = _mm256_srli_epi16(_mm256_and_si256(hi, _mm256_set1_epi8(-64)), 2);
      const __m256i q0 = _mm256_or_si256(_mm256_and_si256(lo_a, low4), h0);
      const __m256i q1 = _mm256_or_si256(_mm256_and_si256(lo_b, low4), h1);
      const __m256i q2 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(lo_a, 4), low4), h2);
      const __m256i q3 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(lo_b, 4), low4), h3);

      const __m256i y0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q8));
      const __m256i y1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q8 + 32));
      const __m256i y2 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q8 + 64));
      const __m256i y3 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q8 + 96));
      q8 += 128;

      // maddubs: two products of <= 63 and |int8| <= 128 stay within int16.
      __m256i p0 = _mm256_maddubs_epi16(q0, y0);
      __m256i p1 = _mm256_maddubs_epi16(q1, y1);
      __m256i p2 = _mm256_maddubs_epi16(q2, y2);
      __m256i p3 = _mm256_maddubs_epi16(q3, y3);
      p0 = _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_shuffle_epi8(scales, pair_of_scales_control(is + 0))), p0);
      p1 = _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_shuffle_epi8(scales, pair_of_scales_control(is + 1))), p1);
      p2 = _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_shuffle_epi8(scales, pair_of_scales_control(is + 2))), p2);
      p3 = _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_shuffle_epi8(scales, pair_of_scales_control(is + 3))), p3);
      is += 4;
      sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(p0, p1));
      sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(p2, p3));
    }
    sumi = _mm256_sub_epi32(sumi, offset);
    acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
  }
  return hsum_float_8(acc);
}

namespace {

// F32 / F16 weights: one weight row against T activation rows per pass. Each output is
// ggml_vec_dot_f32/f16 with GGML_SIMD on AVX2: four 8-float accumulators per 32 elements,
// GGML_F32x8_REDUCE, and the tail accumulated in double on top of the reduced float. What the
// rows share is the weight chunk, loaded (and for F16 converted) once for T tokens instead of
// T times: that halves the loads per FMA at T = 3, where the single dot (T = 1), with two
// loads per FMA, is load-bound. Twelve accumulators and the weight chunk fit the sixteen ymm
// registers; a fourth token would spill.
constexpr int kFloatTileT = 3;

template <bool kHalf>
inline __m256 load8(const void* p, int64_t i) {
  if constexpr (kHalf)
    return _mm256_cvtph_ps(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + i)));
  else
    return _mm256_loadu_ps(static_cast<const float*>(p) + i);
}

template <bool kHalf>
inline float load1(const void* p, int64_t i) {
  if constexpr (kHalf)
    return half_to_float(static_cast<const uint16_t*>(p)[i]);
  else
    return static_cast<const float*>(p)[i];
}

// `prefetch`, when not null, is another weight row of the same length pulled into L2 while
// this one is computed, one kStep at a time (see run_float_tiles); it changes no result.
template <bool kHalf, int T>
void float_row_tile(int64_t n, const void* w, const uint8_t* x, size_t x_stride, float* y,
                    int64_t y_stride, const void* prefetch = nullptr) {
  constexpr int64_t kElementBytes = kHalf ? 2 : 4;
  const int64_t np = n & ~(kStep - 1);
  __m256 sum[T][4];
  for (int t = 0; t < T; ++t)
    for (int j = 0; j < 4; ++j) sum[t][j] = _mm256_setzero_ps();
  for (int64_t i = 0; i < np; i += kStep) {
    if (prefetch != nullptr) {
      const char* line = static_cast<const char*>(prefetch) + i * kElementBytes;
      for (int64_t b = 0; b < kStep * kElementBytes; b += 64) _mm_prefetch(line + b, _MM_HINT_T1);
    }
    for (int j = 0; j < 4; ++j) {
      const __m256 aw = load8<kHalf>(w, i + j * kEpr);
      for (int t = 0; t < T; ++t)
        sum[t][j] = _mm256_fmadd_ps(aw, load8<kHalf>(x + t * x_stride, i + j * kEpr), sum[t][j]);
    }
  }
  for (int t = 0; t < T; ++t) {
    const void* xt = x + t * x_stride;
    double sumf = reduce_4x8(sum[t]);
    for (int64_t i = np; i < n; ++i)
      sumf += static_cast<double>(load1<kHalf>(w, i) * load1<kHalf>(xt, i));
    y[t * y_stride] = static_cast<float>(sumf);
  }
}

}  // namespace

// The single dots are the tile's one-token case, so tile and dot cannot drift apart.
float vec_dot_f16_avx2(int64_t n, const void* w, const void* xv) {
  float y;
  float_row_tile<true, 1>(n, w, static_cast<const uint8_t*>(xv), 0, &y, 0);
  return y;
}

float vec_dot_f32_avx2(int64_t n, const void* w, const void* xv) {
  float y;
  float_row_tile<false, 1>(n, w, static_cast<const uint8_t*>(xv), 0, &y, 0);
  return y;
}

// ---- tiles: several weight rows x several activation rows per pass -----------------------
//
// Every output element of a tile is computed with exactly the operation sequence of the
// matching vec_dot_*_avx2 above (same per-block integer products, the same scalar scale
// product broadcast into one FMA per block into its own 8-lane accumulator, the same final
// horizontal sum), so y[t][r] is bit-identical to vec_dot(w_r, x_t). What the tile saves is
// work shared between elements: each weight block is unpacked once for all T activation rows
// and each activation block is loaded once for all R weight rows, and their fp16 scales are
// converted once.

namespace {

// Activation scales of one chunk of up to kTileT activation rows, converted from fp16 once per
// chunk: for block ib, xsc[8 * ib + t] = d of row t and xsc[8 * ib + 4 + t] = s of row t (Q8_1;
// unused for Q8_0). Lanes of missing rows are 0.
constexpr int kTileT = 4;

// The fp16 pair (d, m) or (d, s) at p as floats in lanes 0 and 1.
inline __m128 half_pair(const uint16_t* p) {
  int32_t bits;
  __builtin_memcpy(&bits, p, sizeof bits);
  return _mm_cvtph_ps(_mm_cvtsi32_si128(bits));
}

// Bytes ahead of the current position that the kernels prefetch. Decode reads each
// weight byte once per token, from DRAM: without prefetching a thread waits on memory at
// ~5 GB/s; the hardware prefetcher alone restarts at every 4 KiB page. About 1 us of reading
// ahead covers the DRAM latency at the kernel's consumption rate.
constexpr int kPrefetchBytes = 4096;

// Prefetches the cache lines `ahead` bytes past the `consumed` bytes of a pass over `bytes`
// contiguous weight bytes starting at p (rows of one matrix are contiguous, so reading ahead
// runs into the next pass's rows). Prefetching past the end of a mapping cannot fault.
inline void prefetch_ahead(const uint8_t* p, size_t consumed, size_t step) {
  const char* a = reinterpret_cast<const char*>(p) + consumed + kPrefetchBytes;
  for (size_t o = 0; o < step; o += 64) _mm_prefetch(a + o, _MM_HINT_T0);
}

// Per weight row r, the 4 products d_w(r) * d_x(t) of a block go to dd[4r..4r+3] (each the
// same float product vec_dot forms) and are broadcast back from memory into the FMA; this
// keeps the multiply-and-broadcast work off the ports the integer dot uses.
template <int R, int T>
void tile_q4_1_q8_1(int64_t nb, const uint8_t* w, size_t w_stride, const uint8_t* x,
                    size_t x_stride, const float* xsc, float* y, int64_t y_stride) {
  __m256 acc[R][T];
  __m128 summs[R];  // lane t: the min terms m_w * s_x of row t, summed in block order
  for (int r = 0; r < R; ++r) {
    summs[r] = _mm_setzero_ps();
    for (int t = 0; t < T; ++t) acc[r][t] = _mm256_setzero_ps();
  }
  alignas(16) float dd[R * 4];
  constexpr size_t kStepBytes = R * sizeof(BlockQ4_1);
  for (int64_t ib = 0; ib < nb; ++ib) {
    if (w_stride == nb * sizeof(BlockQ4_1)) prefetch_ahead(w, ib * kStepBytes, kStepBytes);
    const __m128 xd = _mm_load_ps(xsc + 8 * ib);
    const __m128 xs = _mm_load_ps(xsc + 8 * ib + 4);
    __m256i qx[R];
    for (int r = 0; r < R; ++r) {
      const auto* b = reinterpret_cast<const BlockQ4_1*>(w + r * w_stride) + ib;
      const __m128 dm = half_pair(&b->d);
      _mm_store_ps(dd + 4 * r, _mm_mul_ps(_mm_shuffle_ps(dm, dm, 0x00), xd));
      summs[r] = _mm_add_ps(summs[r], _mm_mul_ps(_mm_shuffle_ps(dm, dm, 0x55), xs));
      qx[r] = bytes_from_nibbles_32(b->qs);
    }
    for (int t = 0; t < T; ++t) {
      const auto* b = reinterpret_cast<const BlockQ8_1*>(x + t * x_stride) + ib;
      const __m256i qy = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b->qs));
      for (int r = 0; r < R; ++r) {
        const __m256 xy = mul_sum_us8_pairs_float(qx[r], qy);
        acc[r][t] = _mm256_fmadd_ps(_mm256_broadcast_ss(dd + 4 * r + t), xy, acc[r][t]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    alignas(16) float m[4];
    _mm_store_ps(m, summs[r]);
    for (int t = 0; t < T; ++t) y[t * y_stride + r] = hsum_float_8(acc[r][t]) + m[t];
  }
}

// The 2 x 4 tile (prefill and batched decode spend most of their time here), written with
// named accumulators: the generic template's arrays made GCC store all 8 accumulators back to
// the stack every block and spill the scale addresses. Two more savings, each measured on an
// L1-resident microbenchmark (min of 30, TSC ticks per block pair: 2.34 -> 2.09):
// - each scale product d_w * d_x is formed in registers as broadcast(d_w) * broadcast(d_x) —
//   the same float product in every lane — instead of a 4-lane product stored to the stack
//   and broadcast back;
// - the nibbles are unpacked from one 128-bit broadcast load with a per-lane shift (0 for
//   the low lane, 4 for the high) and a mask, instead of shift + insert + mask.
// Same operations per element as the template (and so as vec_dot_q4_1_q8_1_avx2).
void tile_q4_1_q8_1_2x4(int64_t nb, const uint8_t* w, size_t w_stride, const uint8_t* x,
                        size_t x_stride, const float* xsc, float* y, int64_t y_stride) {
  __m256 a00 = _mm256_setzero_ps(), a01 = a00, a02 = a00, a03 = a00;
  __m256 a10 = a00, a11 = a00, a12 = a00, a13 = a00;
  __m128 summs0 = _mm_setzero_ps(), summs1 = summs0;
  const auto* w0 = reinterpret_cast<const BlockQ4_1*>(w);
  const auto* w1 = reinterpret_cast<const BlockQ4_1*>(w + w_stride);
  const auto* x0 = reinterpret_cast<const BlockQ8_1*>(x);
  const auto* x1 = reinterpret_cast<const BlockQ8_1*>(x + x_stride);
  const auto* x2 = reinterpret_cast<const BlockQ8_1*>(x + 2 * x_stride);
  const auto* x3 = reinterpret_cast<const BlockQ8_1*>(x + 3 * x_stride);
  const __m256i low_mask = _mm256_set1_epi8(0xF);
  const __m256i lane_shift = _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4);
  const auto nibbles = [&](const uint8_t* qs) {
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
    return _mm256_and_si256(_mm256_srlv_epi32(_mm256_broadcastsi128_si256(packed), lane_shift),
                            low_mask);
  };
  const bool prefetch = w_stride == nb * sizeof(BlockQ4_1);
  for (int64_t ib = 0; ib < nb; ++ib) {
    if (prefetch) prefetch_ahead(w, ib * 2 * sizeof(BlockQ4_1), 2 * sizeof(BlockQ4_1));
    const float* xd = xsc + 8 * ib;  // d_x of the 4 rows, then s_x of the 4 rows
    const __m128 xs = _mm_load_ps(xd + 4);
    const __m128 dm0 = half_pair(&w0[ib].d);
    const __m128 dm1 = half_pair(&w1[ib].d);
    summs0 = _mm_add_ps(summs0, _mm_mul_ps(_mm_shuffle_ps(dm0, dm0, 0x55), xs));
    summs1 = _mm_add_ps(summs1, _mm_mul_ps(_mm_shuffle_ps(dm1, dm1, 0x55), xs));
    const __m256 d0 = _mm256_broadcastss_ps(dm0);
    const __m256 d1 = _mm256_broadcastss_ps(dm1);
    const __m256i q0 = nibbles(w0[ib].qs);
    const __m256i q1 = nibbles(w1[ib].qs);
#define TESSERA_TILE_STEP(xb, t, acc0, acc1)                                                \
    {                                                                                      \
      const __m256i qy = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb[ib].qs)); \
      const __m256 dx = _mm256_broadcast_ss(xd + t);                                      \
      acc0 = _mm256_fmadd_ps(_mm256_mul_ps(d0, dx), mul_sum_us8_pairs_float(q0, qy), acc0); \
      acc1 = _mm256_fmadd_ps(_mm256_mul_ps(d1, dx), mul_sum_us8_pairs_float(q1, qy), acc1); \
    }
    TESSERA_TILE_STEP(x0, 0, a00, a10)
    TESSERA_TILE_STEP(x1, 1, a01, a11)
    TESSERA_TILE_STEP(x2, 2, a02, a12)
    TESSERA_TILE_STEP(x3, 3, a03, a13)
#undef TESSERA_TILE_STEP
  }
  alignas(16) float m0[4], m1[4];
  _mm_store_ps(m0, summs0);
  _mm_store_ps(m1, summs1);
  y[0] = hsum_float_8(a00) + m0[0];
  y[1] = hsum_float_8(a10) + m1[0];
  y[y_stride] = hsum_float_8(a01) + m0[1];
  y[y_stride + 1] = hsum_float_8(a11) + m1[1];
  y[2 * y_stride] = hsum_float_8(a02) + m0[2];
  y[2 * y_stride + 1] = hsum_float_8(a12) + m1[2];
  y[3 * y_stride] = hsum_float_8(a03) + m0[3];
  y[3 * y_stride + 1] = hsum_float_8(a13) + m1[3];
}

// One activation row (decode): the fp16 pairs (d_w, m_w) and (d_x, s_x) are widened together
// and multiplied in one instruction, giving d_w * d_x in lane 0 (broadcast into the FMA) and
// m_w * s_x in lane 1, which is summed in block order in lane 1 of `summs` (lane 0 there is
// never read). Same products, same order as vec_dot_q4_1_q8_1_avx2.
template <int R>
void row_q4_1_q8_1(int64_t nb, const uint8_t* w, size_t w_stride, const uint8_t* x, float* y,
                   int64_t) {
  __m256 acc[R];
  __m128 summs[R];
  for (int r = 0; r < R; ++r) {
    acc[r] = _mm256_setzero_ps();
    summs[r] = _mm_setzero_ps();
  }
  const auto* xb = reinterpret_cast<const BlockQ8_1*>(x);
  // The R rows are R * w_stride contiguous bytes, consumed R blocks per step.
  constexpr size_t kStepBytes = R * sizeof(BlockQ4_1);
  for (int64_t ib = 0; ib < nb; ++ib) {
    if (w_stride == nb * sizeof(BlockQ4_1)) prefetch_ahead(w, ib * kStepBytes, kStepBytes);
    const __m128 ds = half_pair(&xb[ib].d);
    const __m256i qy = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb[ib].qs));
    for (int r = 0; r < R; ++r) {
      const auto* b = reinterpret_cast<const BlockQ4_1*>(w + r * w_stride) + ib;
      const __m128 prod = _mm_mul_ps(half_pair(&b->d), ds);
      summs[r] = _mm_add_ps(summs[r], prod);
      const __m256 xy = mul_sum_us8_pairs_float(bytes_from_nibbles_32(b->qs), qy);
      acc[r] = _mm256_fmadd_ps(_mm256_broadcastss_ps(prod), xy, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r)
    y[r] = hsum_float_8(acc[r]) + _mm_cvtss_f32(_mm_movehdup_ps(summs[r]));
}

// Q4_0, Q5_0 and Q8_0 weights against Q8_0 activations differ only in how a weight block
// becomes 32 signed bytes.
template <class Block>
inline __m256i signed_weight_bytes(const Block* b);
template <>
inline __m256i signed_weight_bytes<BlockQ4_0>(const BlockQ4_0* b) {
  return _mm256_sub_epi8(bytes_from_nibbles_32(b->qs), _mm256_set1_epi8(8));
}
template <>
inline __m256i signed_weight_bytes<BlockQ5_0>(const BlockQ5_0* b) {
  return q5_0_signed_bytes(b);
}
template <>
inline __m256i signed_weight_bytes<BlockQ8_0>(const BlockQ8_0* b) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b->qs));
}

template <class Block, int R, int T>
void tile_x_q8_0(int64_t nb, const uint8_t* w, size_t w_stride, const uint8_t* x,
                 size_t x_stride, const float* xsc, float* y, int64_t y_stride) {
  __m256 acc[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm256_setzero_ps();
  alignas(16) float dd[R * 4];
  constexpr size_t kStepBytes = R * sizeof(Block);
  for (int64_t ib = 0; ib < nb; ++ib) {
    if (w_stride == nb * sizeof(Block)) prefetch_ahead(w, ib * kStepBytes, kStepBytes);
    const __m128 xd = _mm_load_ps(xsc + 8 * ib);
    __m256i ax[R], qx[R];
    for (int r = 0; r < R; ++r) {
      const auto* b = reinterpret_cast<const Block*>(w + r * w_stride) + ib;
      _mm_store_ps(dd + 4 * r, _mm_mul_ps(_mm_set1_ps(half_to_float(b->d)), xd));
      qx[r] = signed_weight_bytes(b);
      ax[r] = _mm256_sign_epi8(qx[r], qx[r]);
    }
    for (int t = 0; t < T; ++t) {
      const auto* b = reinterpret_cast<const BlockQ8_0*>(x + t * x_stride) + ib;
      const __m256i qy = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b->qs));
      for (int r = 0; r < R; ++r) {
        const __m256 q = mul_sum_us8_pairs_float(ax[r], _mm256_sign_epi8(qy, qx[r]));
        acc[r][t] = _mm256_fmadd_ps(_mm256_broadcast_ss(dd + 4 * r + t), q, acc[r][t]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) y[t * y_stride + r] = hsum_float_8(acc[r][t]);
}

// One activation row against R Q4_0 / Q8_0 weight rows: vec_dot_q8_0_q8_0_avx2's (and
// vec_dot_q4_0_q8_0_avx2's) sequence per row — the scalar product d_w * d_x broadcast into
// one FMA per block, ggml's sign trick for the signed bytes — with the activation block
// loaded once for the R rows and the weights prefetched ahead.
template <class Block, int R>
void row_x_q8_0(int64_t nb, const uint8_t* w, size_t w_stride, const uint8_t* x, float* y) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const auto* xb = reinterpret_cast<const BlockQ8_0*>(x);
  constexpr size_t kStepBytes = R * sizeof(Block);
  for (int64_t ib = 0; ib < nb; ++ib) {
    if (w_stride == nb * sizeof(Block)) prefetch_ahead(w, ib * kStepBytes, kStepBytes);
    const float dx = half_to_float(xb[ib].d);
    const __m256i qy = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb[ib].qs));
    for (int r = 0; r < R; ++r) {
      const auto* b = reinterpret_cast<const Block*>(w + r * w_stride) + ib;
      const __m256 d = _mm256_set1_ps(half_to_float(b->d) * dx);
      const __m256i qx = signed_weight_bytes(b);
      const __m256 q = mul_sum_us8_pairs_float(_mm256_sign_epi8(qx, qx), _mm256_sign_epi8(qy, qx));
      acc[r] = _mm256_fmadd_ps(d, q, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) y[r] = hsum_float_8(acc[r]);
}

using TileFn = void (*)(int64_t, const uint8_t*, size_t, const uint8_t*, size_t, const float*,
                        float*, int64_t);

// Weight rows per tile; the tile functions exist for 1..kTileT activation rows.
constexpr int kTileR = 2;

template <int R, int T>
struct Q41 {
  static constexpr TileFn fn = &tile_q4_1_q8_1<R, T>;
};
template <>
struct Q41<2, 4> {
  static constexpr TileFn fn = &tile_q4_1_q8_1_2x4;
};
template <int R, int T>
struct Q40 {
  static constexpr TileFn fn = &tile_x_q8_0<BlockQ4_0, R, T>;
};
template <int R, int T>
struct Q50 {
  static constexpr TileFn fn = &tile_x_q8_0<BlockQ5_0, R, T>;
};
template <int R, int T>
struct Q80 {
  static constexpr TileFn fn = &tile_x_q8_0<BlockQ8_0, R, T>;
};

// Fills xsc (see above) for activation rows [0, tt) of a chunk.
template <class XBlock>
void chunk_scales(int64_t nb, const uint8_t* x, size_t x_stride, int tt, float* xsc) {
  for (int64_t ib = 0; ib < nb; ++ib) {
    float* o = xsc + 8 * ib;
    for (int t = 0; t < kTileT; ++t) {
      if (t < tt) {
        const auto* b = reinterpret_cast<const XBlock*>(x + t * x_stride) + ib;
        o[t] = half_to_float(b->d);
        if constexpr (sizeof(XBlock) == sizeof(BlockQ8_1)) {
          o[4 + t] = half_to_float(reinterpret_cast<const BlockQ8_1*>(b)->s);
        } else {
          o[4 + t] = 0.0f;
        }
      } else {
        o[t] = o[4 + t] = 0.0f;
      }
    }
  }
}

// One-row (decode) kernels over rows [0, w_rows): 4 rows per pass, then singles.
template <class XBlock, class WBlock>
void run_rows(int64_t nb, const uint8_t* w, size_t w_stride, int64_t w_rows, const uint8_t* x,
              float* y) {
  int64_t r = 0;
  if constexpr (sizeof(XBlock) == sizeof(BlockQ8_1)) {
    for (; r + 4 <= w_rows; r += 4) row_q4_1_q8_1<4>(nb, w + r * w_stride, w_stride, x, y + r, 0);
    for (; r < w_rows; ++r) row_q4_1_q8_1<1>(nb, w + r * w_stride, w_stride, x, y + r, 0);
  } else {
    for (; r + 4 <= w_rows; r += 4) row_x_q8_0<WBlock, 4>(nb, w + r * w_stride, w_stride, x, y + r);
    for (; r < w_rows; ++r) row_x_q8_0<WBlock, 1>(nb, w + r * w_stride, w_stride, x, y + r);
  }
}

// Weight bytes per panel of the batched loop: a panel of weight rows is brought into L1 once
// and used for every chunk of activation rows before the next panel, so a weight matrix
// streams from memory once per matmul at any batch size (with activation chunks outermost, a
// matrix larger than the caches, like the 28 MiB output projection, streamed once per chunk).
constexpr size_t kPanelBytes = 16 * 1024;

template <template <int, int> class K, class XBlock, class WBlock>
void run_tiles(int64_t n, const uint8_t* w, size_t w_stride, int64_t w_rows, const uint8_t* x,
               size_t x_stride, int64_t x_rows, float* y, int64_t y_stride) {
  static constexpr TileFn full[kTileT] = {K<kTileR, 1>::fn, K<kTileR, 2>::fn, K<kTileR, 3>::fn,
                                          K<kTileR, 4>::fn};
  static constexpr TileFn single[kTileT] = {K<1, 1>::fn, K<1, 2>::fn, K<1, 3>::fn, K<1, 4>::fn};
  const int64_t nb = n / 32;
  if (x_rows == 1) {
    run_rows<XBlock, WBlock>(nb, w, w_stride, w_rows, x, y);
    return;
  }
  // The scale table of every chunk of kTileT activation rows, filled once per call.
  const int64_t num_chunks = (x_rows + kTileT - 1) / kTileT;
  thread_local std::vector<float> scales;
  const size_t chunk_floats = static_cast<size_t>(8 * nb);
  if (scales.size() < chunk_floats * num_chunks) scales.resize(chunk_floats * num_chunks);
  for (int64_t c = 0; c < num_chunks; ++c) {
    const int tt = static_cast<int>(std::min<int64_t>(kTileT, x_rows - c * kTileT));
    chunk_scales<XBlock>(nb, x + c * kTileT * x_stride, x_stride, tt, scales.data() + c * chunk_floats);
  }
  const int64_t panel_rows =
      std::max<int64_t>(kTileR, static_cast<int64_t>(kPanelBytes / w_stride) / kTileR * kTileR);
  for (int64_t p0 = 0; p0 < w_rows; p0 += panel_rows) {
    const int64_t p1 = std::min(w_rows, p0 + panel_rows);
    for (int64_t c = 0; c < num_chunks; ++c) {
      const int64_t t0 = c * kTileT;
      const int tt = static_cast<int>(std::min<int64_t>(kTileT, x_rows - t0));
      const uint8_t* xt = x + t0 * x_stride;
      const float* xsc = scales.data() + c * chunk_floats;
      float* yt = y + t0 * y_stride;
      int64_t r = p0;
      for (; r + kTileR <= p1; r += kTileR)
        full[tt - 1](nb, w + r * w_stride, w_stride, xt, x_stride, xsc, yt + r, y_stride);
      for (; r < p1; ++r)
        single[tt - 1](nb, w + r * w_stride, w_stride, xt, x_stride, xsc, yt + r, y_stride);
    }
  }
}

}  // namespace

// ggml's quantize_row_q8_K_ref on 8 lanes, the same bytes: amax is order-free; the sign comes
// from the first element of that magnitude (the reference's strict `>` scan); each
// q = min(127, round-half-even(iscale * x)) with the product rounded once (vcvtps2dq in the
// default rounding mode is nearest_int for |v| <= 127); bsums from the int32 lanes.
void quantize_row_q8_k_avx2(const float* x, void* yv, int64_t n) {
  auto* y = static_cast<BlockQ8_K*>(yv);
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  for (int64_t i = 0; i < n / kQK_K; ++i, x += kQK_K) {
    __m256 vmax = _mm256_setzero_ps();
    for (int j = 0; j < kQK_K; j += 8)
      vmax = _mm256_max_ps(vmax, _mm256_and_ps(_mm256_loadu_ps(x + j), abs_mask));
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    const float amax = _mm_cvtss_f32(m);
    if (amax == 0.0f) {
      y[i].d = 0.0f;
      __builtin_memset(y[i].qs, 0, sizeof y[i].qs);
      __builtin_memset(y[i].bsums, 0, sizeof y[i].bsums);
      continue;
    }
    int first = 0;
    while (std::fabs(x[first]) != amax) ++first;
    const float iscale = -127.0f / x[first];
    const __m256 vscale = _mm256_set1_ps(iscale);
    const __m256i limit = _mm256_set1_epi32(127);
    for (int j = 0; j < kQK_K; j += 16) {
      const __m256i a = _mm256_min_epi32(
          _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + j), vscale)), limit);
      const __m256i b = _mm256_min_epi32(
          _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + j + 8), vscale)), limit);
      // 16 int32 -> int8 in order (packs interleave the 128-bit lanes; the permute undoes it).
      const __m256i w = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8);
      const __m128i q8 = _mm_packs_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(y[i].qs + j), q8);
      __m256i s = _mm256_add_epi32(a, b);
      __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
      y[i].bsums[j / 16] = static_cast<int16_t>(_mm_cvtsi128_si32(s4));
    }
    y[i].d = 1 / iscale;
  }
}

void quantize_activations_q8_avx2(const float* x, void* y, int64_t n, bool q8_1,
                                  uint16_t (*to_half)(float)) {
  // Per block of 32: amax, d = amax / 127, id = 127 / amax (0 for an all-zero block), then
  // q = round-half-even(x * id) — the scalar reference's operations, 8 lanes at a time (the
  // max is exact in any order). The fp16 scales go through the caller's converter.
  const __m256 sign_bit = _mm256_set1_ps(-0.0f);
  const int64_t nb = n / 32;
  const size_t block_bytes = q8_1 ? sizeof(BlockQ8_1) : sizeof(BlockQ8_0);
  auto* out = static_cast<uint8_t*>(y);
  for (int64_t ib = 0; ib < nb; ++ib) {
    const float* xb = x + ib * 32;
    __m256 v[4];
    __m256 maxv = _mm256_setzero_ps();
    for (int k = 0; k < 4; ++k) {
      v[k] = _mm256_loadu_ps(xb + 8 * k);
      maxv = _mm256_max_ps(maxv, _mm256_andnot_ps(sign_bit, v[k]));
    }
    __m128 m = _mm_max_ps(_mm256_extractf128_ps(maxv, 1), _mm256_castps256_ps128(maxv));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    const float amax = _mm_cvtss_f32(m);
    const float d = amax / 127.0f;
    const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
    const __m256 mul = _mm256_set1_ps(id);
    __m256i q[4];
    for (int k = 0; k < 4; ++k)
      q[k] = _mm256_cvtps_epi32(
          _mm256_round_ps(_mm256_mul_ps(v[k], mul), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    uint8_t* blk = out + ib * block_bytes;
    int8_t* qs = reinterpret_cast<int8_t*>(blk + (q8_1 ? 4 : 2));
    // Pack 32 int32 -> 32 int8 (values are within [-127, 127], so saturation never applies),
    // then undo the 128-bit lane interleave of the packs.
    const __m256i p01 = _mm256_packs_epi32(q[0], q[1]);
    const __m256i p23 = _mm256_packs_epi32(q[2], q[3]);
    __m256i p = _mm256_packs_epi16(p01, p23);
    p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(qs), p);
    // vcvtps2ph rounds to nearest even like to_half for every non-NaN float (a NaN scale,
    // from a NaN input, goes through to_half for its canonical NaN); one instruction instead
    // of a call per block.
    const auto half_of = [to_half](float f) {
      return f == f ? static_cast<uint16_t>(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT)) : to_half(f);
    };
    const uint16_t dh = half_of(d);
    __builtin_memcpy(blk, &dh, sizeof dh);
    if (q8_1) {
      // Sum of the 32 quants (exact in int32).
      const __m256i s16 = _mm256_madd_epi16(_mm256_add_epi16(_mm256_packs_epi32(q[0], q[1]),
                                                              _mm256_packs_epi32(q[2], q[3])),
                                            _mm256_set1_epi16(1));
      __m128i s = _mm_add_epi32(_mm256_castsi256_si128(s16), _mm256_extracti128_si256(s16, 1));
      s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
      s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
      const uint16_t sh = half_of(d * static_cast<float>(_mm_cvtsi128_si32(s)));
      __builtin_memcpy(blk + 2, &sh, sizeof sh);
    }
  }
}

namespace {

// Panels of weight rows as in run_tiles: a panel stays in L1 while every chunk of three
// activation rows passes over it, and each chunk stays in L1 across the panel's rows.
// With more than one chunk only the first pass over a panel reads DRAM; the second pass,
// which runs from cache, pulls the next panel into L2, so that DRAM keeps streaming while
// the later passes compute instead of idling until the next panel's first pass. Into L2, not
// L1, where the next panel would evict the current one. (F32 576 x 92,160, 9 tokens, 2
// threads, half the rows per call: ~20.5 -> ~15.5 ms; an L1 hint, or prefetching during the
// first pass, gained nothing. AVX2 EPYC, 2026-12-06.)
template <bool kHalf>
void run_float_tiles(int64_t n, const uint8_t* w, size_t w_stride, int64_t w_rows,
                     const uint8_t* x, size_t x_stride, int64_t x_rows, float* y,
                     int64_t y_stride) {
  using Fn = void (*)(int64_t, const void*, const uint8_t*, size_t, float*, int64_t, const void*);
  static constexpr Fn by_tokens[kFloatTileT] = {float_row_tile<kHalf, 1>,
                                                float_row_tile<kHalf, 2>,
                                                float_row_tile<kHalf, 3>};
  const int64_t panel_rows = std::max<int64_t>(1, static_cast<int64_t>(kPanelBytes / w_stride));
  for (int64_t p0 = 0; p0 < w_rows; p0 += panel_rows) {
    const int64_t p1 = std::min(w_rows, p0 + panel_rows);
    for (int64_t t0 = 0; t0 < x_rows; t0 += kFloatTileT) {
      const int tt = static_cast<int>(std::min<int64_t>(kFloatTileT, x_rows - t0));
      for (int64_t r = p0; r < p1; ++r) {
        const int64_t ahead = r + panel_rows;
        const uint8_t* next = t0 == kFloatTileT && ahead < w_rows ? w + ahead * w_stride : nullptr;
        by_tokens[tt - 1](n, w + r * w_stride, x + t0 * x_stride, x_stride,
                          y + t0 * y_stride + r, y_stride, next);
      }
    }
  }
}

}  // namespace

bool vec_dot_tile_avx2(int type, int64_t n, const void* w, size_t w_stride, int64_t w_rows,
                       const void* x, size_t x_stride, int64_t x_rows, float* y,
                       int64_t y_stride) {
  const auto* wb = static_cast<const uint8_t*>(w);
  const auto* xb = static_cast<const uint8_t*>(x);
  switch (type) {
    case kTileQ4_1:
      run_tiles<Q41, BlockQ8_1, BlockQ4_1>(n, wb, w_stride, w_rows, xb, x_stride, x_rows, y, y_stride);
      return true;
    case kTileQ4_0:
      run_tiles<Q40, BlockQ8_0, BlockQ4_0>(n, wb, w_stride, w_rows, xb, x_stride, x_rows, y, y_stride);
      return true;
    case kTileQ5_0:
      run_tiles<Q50, BlockQ8_0, BlockQ5_0>(n, wb, w_stride, w_rows, xb, x_stride, x_rows, y, y_stride);
      return true;
    case kTileQ8_0:
      run_tiles<Q80, BlockQ8_0, BlockQ8_0>(n, wb, w_stride, w_rows, xb, x_stride, x_rows, y, y_stride);
      return true;
    case kTileF32:
      run_float_tiles<false>(n, wb, w_stride, w_rows, xb, x_stride, x_rows, y, y_stride);
      return true;
    case kTileF16:
      run_float_tiles<true>(n, wb, w_stride, w_rows, xb, x_stride, x_rows, y, y_stride);
      return true;
    default:
      return false;
  }
}

}  // namespace tessera::kernels

#endif  // x86
