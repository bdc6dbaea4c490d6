// Interleaved Q4_1, Q4_0, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K: the repacking, the scalar kernels (the reference and
// the fallback on CPUs without AVX2) and the run-time dispatch. See tessera/interleaved.h for
// the layouts and the order.
#include "tessera/sdk/kernels/interleaved.h"

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

#include "quant_blocks.h"
#include "tessera/sdk/kernels/ggml_types.h"

// Every float operation as written: the order is the contract the AVX2 kernels match.
#include "tessera/sdk/kernels/fp_contract_off.h"

namespace tessera {

using kernels::BlockQ4_0;
using kernels::BlockQ4_0x8;
using kernels::BlockQ4_1;
using kernels::BlockQ4_1x8;
using kernels::BlockQ5_0;
using kernels::BlockQ5_0x8;
using kernels::BlockQ5_1;
using kernels::BlockQ5_1x8;
using kernels::BlockQ8_0;
using kernels::BlockQ8_0x8;
using kernels::BlockQ8_1;
using kernels::BlockQ4_K;
using kernels::BlockQ4_Kx8;
using kernels::BlockQ5_K;
using kernels::BlockQ5_Kx8;
using kernels::BlockQ6_K;
using kernels::BlockQ6_Kx8;
using kernels::BlockQ8_K;

namespace {

int64_t num_groups(int64_t rows) { return (rows + kInterleaveRows - 1) / kInterleaveRows; }

constexpr int64_t kBlock = 32;  // elements per block of all four types

// Block b of row j of a group: its scale and quant words moved between the GGUF block and the
// interleaved one (to_packed: GGUF -> interleaved). Q5_0's fifth bits are moved separately.
template <typename Block, typename Packed>
void move_block(Block& blk, Packed& o, int j, bool to_packed) {
  constexpr int kWords = sizeof(blk.qs) / 4;
  if (to_packed) {
    o.d[j] = blk.d;
    if constexpr (requires { blk.m; }) o.m[j] = blk.m;
    for (int k = 0; k < kWords; ++k) std::memcpy(o.qs + 32 * k + 4 * j, blk.qs + 4 * k, 4);
  } else {
    blk.d = o.d[j];
    if constexpr (requires { blk.m; }) blk.m = o.m[j];
    for (int k = 0; k < kWords; ++k) std::memcpy(blk.qs + 4 * k, o.qs + 32 * k + 4 * j, 4);
  }
}

// Q5_0's and Q5_1's fifth bits of row j: element 16 h + 4 k + i at bit 2 k + h of byte 4 j + i.
template <typename Block, typename Packed>
void move_fifth_bits(Block& blk, Packed& o, int j, bool to_packed) {
  uint32_t qh = 0;
  if (to_packed) std::memcpy(&qh, blk.qh, 4);
  for (int h = 0; h < 2; ++h) {
    for (int k = 0; k < 4; ++k) {
      for (int i = 0; i < 4; ++i) {
        const int e = 16 * h + 4 * k + i;
        uint8_t& byte = o.qh[4 * j + i];
        const int bit = 2 * k + h;
        if (to_packed) {
          byte = static_cast<uint8_t>(byte | (((qh >> e) & 1u) << bit));
        } else {
          qh |= static_cast<uint32_t>((byte >> bit) & 1u) << e;
        }
      }
    }
  }
  if (!to_packed) std::memcpy(blk.qh, &qh, 4);
}

template <typename Block, typename Packed>
void interleave_as(const void* src, int64_t rows, int64_t cols, void* dst) {
  const int64_t nb = cols / kBlock;
  const auto* in = static_cast<const Block*>(src);
  auto* out = static_cast<Packed*>(dst);
  for (int64_t g = 0; g < num_groups(rows); ++g) {
    for (int64_t b = 0; b < nb; ++b) {
      Packed& o = out[g * nb + b];
      std::memset(&o, 0, sizeof o);  // rows past the end: all zero
      for (int j = 0; j < kInterleaveRows; ++j) {
        const int64_t r = g * kInterleaveRows + j;
        if (r >= rows) break;
        Block blk = in[r * nb + b];
        move_block(blk, o, j, true);
        if constexpr (requires { blk.qh; }) move_fifth_bits(blk, o, j, true);
      }
    }
  }
}

template <typename Block, typename Packed>
void deinterleave_as(const void* packed, int64_t cols, int64_t row, void* dst) {
  const int64_t nb = cols / kBlock;
  const int j = static_cast<int>(row % kInterleaveRows);
  auto* in = static_cast<const Packed*>(packed) + (row / kInterleaveRows) * nb;
  auto* out = static_cast<Block*>(dst);
  for (int64_t b = 0; b < nb; ++b) {
    Packed o = in[b];
    Block blk{};
    move_block(blk, o, j, false);
    if constexpr (requires { blk.qh; }) move_fifth_bits(blk, o, j, false);
    std::memcpy(&out[b], &blk, sizeof blk);
  }
}

// The value of element e (0..31) of row j in an interleaved block, less the min (Q4_1).
template <typename Packed>
int nibble(const Packed& w, int j, int e) {
  const uint8_t q = w.qs[32 * ((e % 16) / 4) + 4 * j + e % 4];
  return e < 16 ? q & 0x0F : q >> 4;
}
int weight_value(const BlockQ4_1x8& w, int j, int e) { return nibble(w, j, e); }
int weight_value(const BlockQ4_0x8& w, int j, int e) { return nibble(w, j, e) - 8; }
int weight_value(const BlockQ5_0x8& w, int j, int e) {
  const int k = (e % 16) / 4, i = e % 4, h = e / 16;
  const uint8_t q = w.qs[32 * k + 4 * j + i];
  const int fifth = (w.qh[4 * j + i] >> (2 * k + h)) & 1;
  return ((h == 0 ? q & 0x0F : q >> 4) | (fifth << 4)) - 16;
}
int weight_value(const BlockQ5_1x8& w, int j, int e) {  // less the min, as Q4_1
  const int k = (e % 16) / 4, i = e % 4, h = e / 16;
  const uint8_t q = w.qs[32 * k + 4 * j + i];
  const int fifth = (w.qh[4 * j + i] >> (2 * k + h)) & 1;
  return (h == 0 ? q & 0x0F : q >> 4) | (fifth << 4);
}
int weight_value(const BlockQ8_0x8& w, int j, int e) { return w.qs[32 * (e / 4) + 4 * j + e % 4]; }

// XBlock: the activation block (Q8_1 for Q4_1, whose min term takes s_x; Q8_0 otherwise).
template <typename Packed, typename XBlock>
void matmul_scalar_as(const void* packed, int64_t cols, int64_t w_rows, const void* x,
                      size_t x_stride, int64_t x_rows, float* y, int64_t y_stride) {
  const int64_t nb = cols / kBlock;
  const auto* groups = static_cast<const Packed*>(packed);
  const auto* xb = static_cast<const uint8_t*>(x);
  for (int64_t r = 0; r < w_rows; ++r) {
    const Packed* w = groups + (r / kInterleaveRows) * nb;
    const int j = static_cast<int>(r % kInterleaveRows);
    for (int64_t t = 0; t < x_rows; ++t) {
      const auto* a = reinterpret_cast<const XBlock*>(xb + t * x_stride);
      float acc = 0.0f;
      for (int64_t b = 0; b < nb; ++b) {
        int32_t isum = 0;
        for (int e = 0; e < kBlock; ++e) isum += weight_value(w[b], j, e) * a[b].qs[e];
        const float dd = fp16_to_fp32(w[b].d[j]) * fp16_to_fp32(a[b].d);
        acc = std::fma(dd, static_cast<float>(isum), acc);
        if constexpr (std::is_same_v<XBlock, BlockQ8_1>)
          acc = std::fma(fp16_to_fp32(w[b].m[j]), fp16_to_fp32(a[b].s), acc);
      }
      y[t * y_stride + r] = acc;
    }
  }
}

// ---- Q6_K: element e's quant q (0..63) in a GGUF block and in an interleaved one.

struct Q6Index {  // where element e of a GGUF Q6_K block keeps its bits
  int ql, low_shift, qh, high_shift;
};
Q6Index q6_index(int e) {
  const int n = e / 128, l = e % 32, quarter = (e % 128) / 32;  // y[l + 32 quarter]
  return {64 * n + l + 32 * (quarter & 1), quarter < 2 ? 0 : 4, 32 * n + l, 2 * quarter};
}
struct Q6PackedIndex {  // where element e of row j of a BlockQ6_Kx8 keeps its bits
  int group, qs, low_shift, qh, high_shift;
};
Q6PackedIndex q6_packed_index(int j, int e) {
  const int w = e % 32, h = w / 16, k = (w % 16) / 4, i = w % 4;
  return {e / 32, 32 * k + 4 * j + i, 4 * h, 32 * (k / 2) + 4 * j + i, 2 * (2 * (k % 2) + h)};
}
int q6_packed_value(const BlockQ6_Kx8& p, int j, int e) {
  const Q6PackedIndex at = q6_packed_index(j, e);
  return ((p.qs[at.group][at.qs] >> at.low_shift) & 0xF) |
         (((p.qh[at.group][at.qh] >> at.high_shift) & 3) << 4);
}

void interleave_q6_k(const void* src, int64_t rows, int64_t cols, void* dst) {
  const int64_t nb = cols / kernels::kQK_K;
  const auto* in = static_cast<const BlockQ6_K*>(src);
  auto* out = static_cast<BlockQ6_Kx8*>(dst);
  for (int64_t g = 0; g < num_groups(rows); ++g) {
    for (int64_t b = 0; b < nb; ++b) {
      BlockQ6_Kx8& o = out[g * nb + b];
      std::memset(&o, 0, sizeof o);  // rows past the end: all zero
      for (int j = 0; j < kInterleaveRows; ++j) {
        const int64_t r = g * kInterleaveRows + j;
        if (r >= rows) break;
        const BlockQ6_K& blk = in[r * nb + b];
        o.d[j] = blk.d;
        for (int sb = 0; sb < kernels::kQK_K / 16; ++sb) o.scales[sb][j] = blk.scales[sb];
        for (int e = 0; e < kernels::kQK_K; ++e) {
          const Q6Index from = q6_index(e);
          const int q = ((blk.ql[from.ql] >> from.low_shift) & 0xF) |
                        (((blk.qh[from.qh] >> from.high_shift) & 3) << 4);
          const Q6PackedIndex at = q6_packed_index(j, e);
          o.qs[at.group][at.qs] = static_cast<uint8_t>(o.qs[at.group][at.qs] | ((q & 0xF) << at.low_shift));
          o.qh[at.group][at.qh] = static_cast<uint8_t>(o.qh[at.group][at.qh] | ((q >> 4) << at.high_shift));
        }
      }
    }
  }
}

void deinterleave_q6_k_row(const void* packed, int64_t cols, int64_t row, void* dst) {
  const int64_t nb = cols / kernels::kQK_K;
  const int j = static_cast<int>(row % kInterleaveRows);
  const auto* in = static_cast<const BlockQ6_Kx8*>(packed) + (row / kInterleaveRows) * nb;
  auto* out = static_cast<BlockQ6_K*>(dst);
  for (int64_t b = 0; b < nb; ++b) {
    BlockQ6_K blk{};
    blk.d = in[b].d[j];
    for (int sb = 0; sb < kernels::kQK_K / 16; ++sb) blk.scales[sb] = in[b].scales[sb][j];
    for (int e = 0; e < kernels::kQK_K; ++e) {
      const int q = q6_packed_value(in[b], j, e);
      const Q6Index at = q6_index(e);
      blk.ql[at.ql] = static_cast<uint8_t>(blk.ql[at.ql] | ((q & 0xF) << at.low_shift));
      blk.qh[at.qh] = static_cast<uint8_t>(blk.qh[at.qh] | ((q >> 4) << at.high_shift));
    }
    std::memcpy(&out[b], &blk, sizeof blk);
  }
}

// acc = fma(d_w * d_x, float(isum), acc) per super-block, isum = sum over the 16 sub-blocks
// of scale * sum((q - 32) * x), exact.
void matmul_q6_k_scalar(const void* packed, int64_t cols, int64_t w_rows, const void* x,
                        size_t x_stride, int64_t x_rows, float* y, int64_t y_stride) {
  const int64_t nb = cols / kernels::kQK_K;
  const auto* groups = static_cast<const BlockQ6_Kx8*>(packed);
  const auto* xb = static_cast<const uint8_t*>(x);
  for (int64_t r = 0; r < w_rows; ++r) {
    const BlockQ6_Kx8* w = groups + (r / kInterleaveRows) * nb;
    const int j = static_cast<int>(r % kInterleaveRows);
    for (int64_t t = 0; t < x_rows; ++t) {
      const auto* a = reinterpret_cast<const BlockQ8_K*>(xb + t * x_stride);
      float acc = 0.0f;
      for (int64_t b = 0; b < nb; ++b) {
        int32_t isum = 0;
        for (int sb = 0; sb < kernels::kQK_K / 16; ++sb) {
          int32_t sub = 0;
          for (int e = 16 * sb; e < 16 * sb + 16; ++e)
            sub += (q6_packed_value(w[b], j, e) - 32) * a[b].qs[e];
          isum += w[b].scales[sb][j] * sub;
        }
        const float dd = fp16_to_fp32(w[b].d[j]) * a[b].d;
        acc = std::fma(dd, static_cast<float>(isum), acc);
      }
      y[t * y_stride + r] = acc;
    }
  }
}

// ---- Q4_K: element e of a GGUF block is the low (e % 64 < 32) or high nibble of
// qs[32 (e / 64) + e % 32], in sub-block e / 32; in a BlockQ4_Kx8, the nibble of sub-block
// e / 32 at Q4_0x8's place for element e % 32.

struct NibbleAt {  // where element e keeps its 4 bits: byte (of sub-block `group`) and shift
  int group, byte, shift;
};
NibbleAt q4_k_packed_at(int j, int e) {
  const int w = e % 32;
  return {e / 32, 32 * ((w % 16) / 4) + 4 * j + w % 4, w < 16 ? 0 : 4};
}
NibbleAt q4_k_at(int e) { return {0, 32 * (e / 64) + e % 32, e % 64 < 32 ? 0 : 4}; }

// Q5_K's fifth bits: element e of a GGUF block at bit e / 32 of qh[e % 32]; in a BlockQ5_Kx8,
// at Q5_0x8's place for element e % 32 in qh[e / 32].
struct BitAt {
  int group, byte, bit;
};
BitAt q5_k_fifth_packed_at(int j, int e) {
  const int w = e % 32;
  return {e / 32, 4 * j + w % 4, 2 * ((w % 16) / 4) + w / 16};
}
BitAt q5_k_fifth_at(int e) { return {0, e % 32, e / 32}; }

// Q4_K and Q5_K share the interleaving of their scales, mins and nibbles; Q5_K adds its
// fifth bits (Packed::qh).
template <typename Block, typename Packed>
void interleave_k4(const void* src, int64_t rows, int64_t cols, void* dst) {
  constexpr bool kFifth = std::is_same_v<Block, BlockQ5_K>;
  const int64_t nb = cols / kernels::kQK_K;
  const auto* in = static_cast<const Block*>(src);
  auto* out = static_cast<Packed*>(dst);
  for (int64_t g = 0; g < num_groups(rows); ++g) {
    for (int64_t b = 0; b < nb; ++b) {
      Packed& o = out[g * nb + b];
      std::memset(&o, 0, sizeof o);  // rows past the end: all zero
      for (int j = 0; j < kInterleaveRows; ++j) {
        const int64_t r = g * kInterleaveRows + j;
        if (r >= rows) break;
        const Block& blk = in[r * nb + b];
        o.d[j] = blk.d;
        o.dmin[j] = blk.dmin;
        for (int sb = 0; sb < kernels::kQK_K / 32; ++sb)
          kernels::get_scale_min_k4(sb, blk.scales, &o.scales[sb][j], &o.mins[sb][j]);
        for (int e = 0; e < kernels::kQK_K; ++e) {
          const NibbleAt from = q4_k_at(e), to = q4_k_packed_at(j, e);
          const int q = (blk.qs[from.byte] >> from.shift) & 0xF;
          uint8_t& byte = o.qs[to.group][to.byte];
          byte = static_cast<uint8_t>(byte | (q << to.shift));
          if constexpr (kFifth) {
            const BitAt hf = q5_k_fifth_at(e), ht = q5_k_fifth_packed_at(j, e);
            const int h = (blk.qh[hf.byte] >> hf.bit) & 1;
            uint8_t& hbyte = o.qh[ht.group][ht.byte];
            hbyte = static_cast<uint8_t>(hbyte | (h << ht.bit));
          }
        }
      }
    }
  }
}

template <typename Block, typename Packed>
void deinterleave_k4_row(const void* packed, int64_t cols, int64_t row, void* dst) {
  constexpr bool kFifth = std::is_same_v<Block, BlockQ5_K>;
  const int64_t nb = cols / kernels::kQK_K;
  const int j = static_cast<int>(row % kInterleaveRows);
  const auto* in = static_cast<const Packed*>(packed) + (row / kInterleaveRows) * nb;
  auto* out = static_cast<Block*>(dst);
  for (int64_t b = 0; b < nb; ++b) {
    Block blk{};
    blk.d = in[b].d[j];
    blk.dmin = in[b].dmin[j];
    // get_scale_min_k4's packing, inverted: 0-3 in the low 6 bits of bytes 0-3 / 4-7, 4-7 in
    // the nibbles of bytes 8-11 and the top 2 bits of bytes 0-7.
    for (int sb = 0; sb < 8; ++sb) {
      const uint8_t sc = in[b].scales[sb][j], mn = in[b].mins[sb][j];
      if (sb < 4) {
        blk.scales[sb] = static_cast<uint8_t>(blk.scales[sb] | sc);
        blk.scales[sb + 4] = static_cast<uint8_t>(blk.scales[sb + 4] | mn);
      } else {
        blk.scales[sb + 4] = static_cast<uint8_t>((sc & 0xF) | ((mn & 0xF) << 4));
        blk.scales[sb - 4] = static_cast<uint8_t>(blk.scales[sb - 4] | ((sc >> 4) << 6));
        blk.scales[sb] = static_cast<uint8_t>(blk.scales[sb] | ((mn >> 4) << 6));
      }
    }
    for (int e = 0; e < kernels::kQK_K; ++e) {
      const NibbleAt to = q4_k_at(e), from = q4_k_packed_at(j, e);
      const int q = (in[b].qs[from.group][from.byte] >> from.shift) & 0xF;
      blk.qs[to.byte] = static_cast<uint8_t>(blk.qs[to.byte] | (q << to.shift));
      if constexpr (kFifth) {
        const BitAt ht = q5_k_fifth_at(e), hf = q5_k_fifth_packed_at(j, e);
        const int h = (in[b].qh[hf.group][hf.byte] >> hf.bit) & 1;
        blk.qh[ht.byte] = static_cast<uint8_t>(blk.qh[ht.byte] | (h << ht.bit));
      }
    }
    std::memcpy(&out[b], &blk, sizeof blk);
  }
}

// Element e's quant (0..15 for Q4_K, 0..31 for Q5_K) of row j in an interleaved super-block.
int k4_packed_value(const BlockQ4_Kx8& p, int j, int e) {
  const NibbleAt at = q4_k_packed_at(j, e);
  return (p.qs[at.group][at.byte] >> at.shift) & 0xF;
}
int k4_packed_value(const BlockQ5_Kx8& p, int j, int e) {
  const NibbleAt at = q4_k_packed_at(j, e);
  const BitAt h = q5_k_fifth_packed_at(j, e);
  return ((p.qs[at.group][at.byte] >> at.shift) & 0xF) | (((p.qh[h.group][h.byte] >> h.bit) & 1) << 4);
}

// Per super-block: isum = sum over the 8 sub-blocks of scale * sum(q * x), imin = sum of
// min * (the sub-block's two Q8_K bsums), both exact;
// acc = fma(d_w * d_x, float(isum), acc); acc = fma(-(dmin_w * d_x), float(imin), acc).
template <typename Packed>
void matmul_k4_scalar(const void* packed, int64_t cols, int64_t w_rows, const void* x,
                      size_t x_stride, int64_t x_rows, float* y, int64_t y_stride) {
  const int64_t nb = cols / kernels::kQK_K;
  const auto* groups = static_cast<const Packed*>(packed);
  const auto* xb = static_cast<const uint8_t*>(x);
  for (int64_t r = 0; r < w_rows; ++r) {
    const Packed* w = groups + (r / kInterleaveRows) * nb;
    const int j = static_cast<int>(r % kInterleaveRows);
    for (int64_t t = 0; t < x_rows; ++t) {
      const auto* a = reinterpret_cast<const BlockQ8_K*>(xb + t * x_stride);
      float acc = 0.0f;
      for (int64_t b = 0; b < nb; ++b) {
        int32_t isum = 0, imin = 0;
        for (int sb = 0; sb < kernels::kQK_K / 32; ++sb) {
          int32_t sub = 0;
          for (int e = 32 * sb; e < 32 * sb + 32; ++e) sub += k4_packed_value(w[b], j, e) * a[b].qs[e];
          isum += w[b].scales[sb][j] * sub;
          imin += w[b].mins[sb][j] * (a[b].bsums[2 * sb] + a[b].bsums[2 * sb + 1]);
        }
        const float dd = fp16_to_fp32(w[b].d[j]) * a[b].d;
        const float md = fp16_to_fp32(w[b].dmin[j]) * a[b].d;
        acc = std::fma(dd, static_cast<float>(isum), acc);
        acc = std::fma(-md, static_cast<float>(imin), acc);
      }
      y[t * y_stride + r] = acc;
    }
  }
}

size_t packed_block_size(GgmlType type) {
  switch (type) {
    case GgmlType::Q4_0: return sizeof(BlockQ4_0x8);
    case GgmlType::Q4_1: return sizeof(BlockQ4_1x8);
    case GgmlType::Q5_0: return sizeof(BlockQ5_0x8);
    case GgmlType::Q5_1: return sizeof(BlockQ5_1x8);
    case GgmlType::Q8_0: return sizeof(BlockQ8_0x8);
    case GgmlType::Q4_K: return sizeof(BlockQ4_Kx8);
    case GgmlType::Q5_K: return sizeof(BlockQ5_Kx8);
    case GgmlType::Q6_K: return sizeof(BlockQ6_Kx8);
    default: return 0;
  }
}

int64_t block_elements(GgmlType type) {
  return type == GgmlType::Q4_K || type == GgmlType::Q5_K || type == GgmlType::Q6_K ? kernels::kQK_K
                                                                                  : kBlock;
}

}  // namespace

size_t interleaved_q4_1_group_size(int64_t cols) {
  return interleaved_group_size(GgmlType::Q4_1, cols);
}

size_t interleaved_q4_1_size(int64_t rows, int64_t cols) {
  return interleaved_size(GgmlType::Q4_1, rows, cols);
}

void interleave_q4_1(const void* src, int64_t rows, int64_t cols, void* dst) {
  interleave_as<BlockQ4_1, BlockQ4_1x8>(src, rows, cols, dst);
}

void deinterleave_q4_1_row(const void* packed, int64_t cols, int64_t row, void* dst) {
  deinterleave_as<BlockQ4_1, BlockQ4_1x8>(packed, cols, row, dst);
}

void matmul_q4_1_interleaved_scalar(const void* packed, int64_t cols, int64_t w_rows,
                                    const void* x, size_t x_stride, int64_t x_rows, float* y,
                                    int64_t y_stride) {
  matmul_scalar_as<BlockQ4_1x8, BlockQ8_1>(packed, cols, w_rows, x, x_stride, x_rows, y, y_stride);
}

void matmul_q4_1_interleaved(const void* packed, int64_t cols, int64_t w_rows, const void* x,
                             size_t x_stride, int64_t x_rows, float* y, int64_t y_stride) {
  matmul_interleaved(GgmlType::Q4_1, packed, cols, w_rows, x, x_stride, x_rows, y, y_stride);
}

bool has_interleaved_layout(GgmlType type) { return packed_block_size(type) != 0; }

size_t interleaved_group_size(GgmlType type, int64_t cols) {
  return static_cast<size_t>(cols / block_elements(type)) * packed_block_size(type);
}

size_t interleaved_size(GgmlType type, int64_t rows, int64_t cols) {
  return static_cast<size_t>(num_groups(rows)) * interleaved_group_size(type, cols);
}

void interleave_rows(GgmlType type, const void* src, int64_t rows, int64_t cols, void* dst) {
  switch (type) {
    case GgmlType::Q4_0: return interleave_as<BlockQ4_0, BlockQ4_0x8>(src, rows, cols, dst);
    case GgmlType::Q4_1: return interleave_q4_1(src, rows, cols, dst);
    case GgmlType::Q5_0: return interleave_as<BlockQ5_0, BlockQ5_0x8>(src, rows, cols, dst);
    case GgmlType::Q5_1: return interleave_as<BlockQ5_1, BlockQ5_1x8>(src, rows, cols, dst);
    case GgmlType::Q8_0: return interleave_as<BlockQ8_0, BlockQ8_0x8>(src, rows, cols, dst);
    case GgmlType::Q4_K: return interleave_k4<BlockQ4_K, BlockQ4_Kx8>(src, rows, cols, dst);
    case GgmlType::Q5_K: return interleave_k4<BlockQ5_K, BlockQ5_Kx8>(src, rows, cols, dst);
    case GgmlType::Q6_K: return interleave_q6_k(src, rows, cols, dst);
    default: return;
  }
}

void deinterleave_row(GgmlType type, const void* packed, int64_t cols, int64_t row, void* dst) {
  switch (type) {
    case GgmlType::Q4_0: return deinterleave_as<BlockQ4_0, BlockQ4_0x8>(packed, cols, row, dst);
    case GgmlType::Q4_1: return deinterleave_q4_1_row(packed, cols, row, dst);
    case GgmlType::Q5_0: return deinterleave_as<BlockQ5_0, BlockQ5_0x8>(packed, cols, row, dst);
    case GgmlType::Q5_1: return deinterleave_as<BlockQ5_1, BlockQ5_1x8>(packed, cols, row, dst);
    case GgmlType::Q8_0: return deinterleave_as<BlockQ8_0, BlockQ8_0x8>(packed, cols, row, dst);
    case GgmlType::Q4_K: return deinterleave_k4_row<BlockQ4_K, BlockQ4_Kx8>(packed, cols, row, dst);
    case GgmlType::Q5_K: return deinterleave_k4_row<BlockQ5_K, BlockQ5_Kx8>(packed, cols, row, dst);
    case GgmlType::Q6_K: return deinterleave_q6_k_row(packed, cols, row, dst);
    default: return;
  }
}

void matmul_interleaved_scalar(GgmlType type, const void* packed, int64_t cols, int64_t w_rows,
                               const void* x, size_t x_stride, int64_t x_rows, float* y,
                               int64_t y_stride) {
  switch (type) {
    case GgmlType::Q4_0:
      return matmul_scalar_as<BlockQ4_0x8, BlockQ8_0>(packed, cols, w_rows, x, x_stride, x_rows, y, y_stride);
    case GgmlType::Q4_1:
      return matmul_q4_1_interleaved_scalar(packed, cols, w_rows, x, x_stride, x_rows, y, y_stride);
    case GgmlType::Q5_0:
      return matmul_scalar_as<BlockQ5_0x8, BlockQ8_0>(packed, cols, w_rows, x, x_stride, x_rows, y, y_stride);
    case GgmlType::Q5_1:
      return matmul_scalar_as<BlockQ5_1x8, BlockQ8_1>(packed, cols, w_rows, x, x_stride, x_rows, y, y_stride);
    case GgmlType::Q8_0:
      return matmul_scalar_as<BlockQ8_0x8, BlockQ8_0>(packed, cols, w_rows, x, x_stride, x_rows, y, y_stride);
    case GgmlType::Q4_K:
      return matmul_k4_scalar<BlockQ4_Kx8>(packed, cols, w_rows, x, x_stride, x_rows, y, y_stride);
    case GgmlType::Q5_K:
      return matmul_k4_scalar<BlockQ5_Kx8>(packed, cols, w_rows, x, x_stride, x_rows, y, y_stride);
    case GgmlType::Q6_K:
      return matmul_q6_k_scalar(packed, cols, w_rows, x, x_stride, x_rows, y, y_stride);
    default: return;
  }
}

bool cpu_has_avx_vnni() {
#if defined(__x86_64__) || defined(__i386__)
  static const bool supported = [] {
    if (!cpu_has_avx2() || std::getenv("TESSERA_NO_AVX_VNNI") != nullptr) return false;
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (!__get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx)) return false;
    return (eax & (1u << 4)) != 0;
  }();
  return supported;
#else
  return false;
#endif
}

#if defined(__x86_64__) || defined(__i386__)
bool cpu_has_avx512() {
  static const bool supported = [] {
    if (!cpu_has_avx2() || std::getenv("TESSERA_NO_AVX512") != nullptr) return false;
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
    const bool f = (ebx & (1u << 16)) != 0, bw = (ebx & (1u << 30)) != 0,
               vl = (ebx & (1u << 31)) != 0;
    if (!(f && bw && vl)) return false;
    // The OS must save the opmask and all 512-bit register state (XCR0 bits 5, 6, 7) besides
    // SSE and AVX (bits 1, 2); cpu_has_avx2() has checked that OSXSAVE is set.
    unsigned lo = 0, hi = 0;
    __asm__("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return (lo & 0xE6u) == 0xE6u;
  }();
  return supported;
}
#else
bool cpu_has_avx512() { return false; }
#endif

#if defined(__x86_64__) || defined(__i386__)
namespace kernels {

bool cpu_has_avx512_vnni() {
  static const bool supported = [] {
    if (!cpu_has_avx512()) return false;
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
    return (ecx & (1u << 11)) != 0;
  }();
  return supported;
}

// One instruction set's interleaved kernels (the AVX2 or AVX-VNNI build of
// interleaved_x86.inl), called through the same switch.
#define TESSERA_X8_KERNELS(suffix)                                                          \
  void matmul_x8_##suffix(int type_id, int64_t nb, const void* packed, int64_t w_rows,       \
                          const uint8_t* xb, size_t x_stride, int64_t x_rows, float* y,      \
                          int64_t y_stride) {                                                \
    switch (static_cast<GgmlType>(type_id)) {                                                                          \
      case GgmlType::Q4_0:                                                                   \
        return matmul_q4_0x8_##suffix(nb, static_cast<const BlockQ4_0x8*>(packed), w_rows, xb, \
                                      x_stride, x_rows, y, y_stride);                        \
      case GgmlType::Q4_1:                                                                   \
        return matmul_q4_1x8_##suffix(nb, static_cast<const BlockQ4_1x8*>(packed), w_rows, xb, \
                                      x_stride, x_rows, y, y_stride);                        \
      case GgmlType::Q5_0:                                                                   \
        return matmul_q5_0x8_##suffix(nb, static_cast<const BlockQ5_0x8*>(packed), w_rows, xb, \
                                      x_stride, x_rows, y, y_stride);                        \
      case GgmlType::Q5_1:                                                                   \
        return matmul_q5_1x8_##suffix(nb, static_cast<const BlockQ5_1x8*>(packed), w_rows, xb, \
                                      x_stride, x_rows, y, y_stride);                        \
      case GgmlType::Q8_0:                                                                   \
        return matmul_q8_0x8_##suffix(nb, static_cast<const BlockQ8_0x8*>(packed), w_rows, xb, \
                                      x_stride, x_rows, y, y_stride);                        \
      case GgmlType::Q4_K:                                                                   \
        return matmul_q4_kx8_##suffix(nb, static_cast<const BlockQ4_Kx8*>(packed), w_rows, xb, \
                                      x_stride, x_rows, y, y_stride);                        \
      case GgmlType::Q5_K:                                                                   \
        return matmul_q5_kx8_##suffix(nb, static_cast<const BlockQ5_Kx8*>(packed), w_rows, xb, \
                                      x_stride, x_rows, y, y_stride);                        \
      case GgmlType::Q6_K:                                                                   \
        return matmul_q6_kx8_##suffix(nb, static_cast<const BlockQ6_Kx8*>(packed), w_rows, xb, \
                                      x_stride, x_rows, y, y_stride);                        \
      default:                                                                               \
        return;                                                                              \
    }                                                                                        \
  }
TESSERA_X8_KERNELS(avx2)
TESSERA_X8_KERNELS(avxvnni)
TESSERA_X8_KERNELS(vnni256)
#undef TESSERA_X8_KERNELS

}  // namespace kernels
#endif

#if defined(__SANITIZE_THREAD__)  // GCC; clang says it with __has_feature
#define TESSERA_TSAN_BUILD 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define TESSERA_TSAN_BUILD 1
#endif
#endif
#ifdef TESSERA_TSAN_BUILD
extern "C" void __tsan_read_range(void* addr, unsigned long size);
extern "C" void __tsan_write_range(void* addr, unsigned long size);
#endif

namespace {

// ThreadSanitizer builds compile the x86 kernel files without its instrumentation
// (core/CMakeLists.txt): checked one vector load at a time, the matmuls took ~85 % of the
// engine tests' time under TSan. Instead the call is checked here as what it touches: every
// weight group and activation row it reads and every output row it writes, as ranges, so a
// race on any of these buffers is still reported (with this function's caller in the stack).
#ifdef TESSERA_TSAN_BUILD
void check_kernel_ranges_for_tsan(GgmlType type, const void* packed, int64_t cols, int64_t w_rows,
                                  const void* x, size_t x_stride, int64_t x_rows, float* y,
                                  int64_t y_stride) {
  const size_t weight_bytes = static_cast<size_t>(num_groups(w_rows)) * interleaved_group_size(type, cols);
  __tsan_read_range(const_cast<void*>(packed), weight_bytes);
  const size_t x_row_bytes = ggml_row_size(vec_dot_type(type), cols);
  for (int64_t t = 0; t < x_rows; ++t) {
    __tsan_read_range(const_cast<uint8_t*>(static_cast<const uint8_t*>(x) + t * x_stride), x_row_bytes);
    __tsan_write_range(y + t * y_stride, static_cast<size_t>(w_rows) * sizeof(float));
  }
}
#else
void check_kernel_ranges_for_tsan(GgmlType, const void*, int64_t, int64_t, const void*, size_t,
                                  int64_t, float*, int64_t) {}
#endif

}  // namespace

void matmul_interleaved(GgmlType type, const void* packed, int64_t cols, int64_t w_rows,
                        const void* x, size_t x_stride, int64_t x_rows, float* y,
                        int64_t y_stride) {
#if defined(__x86_64__) || defined(__i386__)
  if (cpu_has_avx2()) {
    check_kernel_ranges_for_tsan(type, packed, cols, w_rows, x, x_stride, x_rows, y, y_stride);
    const int64_t nb = cols / block_elements(type);
    const auto* xb = static_cast<const uint8_t*>(x);
    const int id = static_cast<int>(type);
    if (x_rows >= kernels::kAvx512MinTokens && kernels::cpu_has_avx512_vnni())
      return kernels::matmul_x8_avx512(id, nb, packed, w_rows, xb, x_stride, x_rows, y, y_stride);
    if (cpu_has_avx_vnni())
      return kernels::matmul_x8_avxvnni(id, nb, packed, w_rows, xb, x_stride, x_rows, y, y_stride);
    // AVX512-VNNI without AVX-VNNI (Zen 4): the same 256-bit VNNI kernels, EVEX-encoded. The
    // AVX2 ones spent 2-3 instructions per 4-product sum where this spends one: batch-1
    // Q6_K rows ran at 10 GB/s per core, a third of the DRAM rate.
    if (kernels::cpu_has_avx512_vnni())
      return kernels::matmul_x8_vnni256(id, nb, packed, w_rows, xb, x_stride, x_rows, y, y_stride);
    return kernels::matmul_x8_avx2(id, nb, packed, w_rows, xb, x_stride, x_rows, y, y_stride);
  }
#endif
  matmul_interleaved_scalar(type, packed, cols, w_rows, x, x_stride, x_rows, y, y_stride);
}

}  // namespace tessera
