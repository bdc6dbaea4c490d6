// Internal: GGML block layouts and the entry points of the SIMD kernels. The structs mirror
// ggml's block_* types byte for byte so GGUF tensor data can be read in place; fp16 fields
// are kept as raw uint16_t bits (converted with fp16_to_fp32 / F16C), never as a C++ half type.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace tessera::kernels {

inline constexpr int kQK4_0 = 32;
inline constexpr int kQK4_1 = 32;
inline constexpr int kQK5_0 = 32;
inline constexpr int kQK5_1 = 32;
inline constexpr int kQK8_0 = 32;
inline constexpr int kQK8_1 = 32;
inline constexpr int kQK_K = 256;     // super-block size of the K-quants
inline constexpr int kKScaleSize = 12;  // packed 6-bit scales/mins of Q4_K

struct BlockQ4_0 {
  uint16_t d;               // fp16 scale
  uint8_t qs[kQK4_0 / 2];   // element j in the low nibble of qs[j], element j+16 in the high
};
static_assert(sizeof(BlockQ4_0) == 18, "must match ggml's block_q4_0");

struct BlockQ4_1 {
  uint16_t d;               // fp16 scale
  uint16_t m;               // fp16 block minimum
  uint8_t qs[kQK4_1 / 2];   // same nibble order as Q4_0
};
static_assert(sizeof(BlockQ4_1) == 20, "must match ggml's block_q4_1");

// The 5-bit formats are the 4-bit ones plus a 32-bit mask of fifth bits: bit j of qh (read as
// a little-endian uint32) is bit 4 of element j, for all 32 elements of the block.
struct BlockQ5_0 {
  uint16_t d;               // fp16 scale; values are d * (q - 16), q in [0, 31]
  uint8_t qh[4];            // fifth bits, element j at bit j
  uint8_t qs[kQK5_0 / 2];   // low 4 bits in Q4_0's nibble order
};
static_assert(sizeof(BlockQ5_0) == 22, "must match ggml's block_q5_0");

struct BlockQ5_1 {
  uint16_t d;               // fp16 scale; values are d * q + m, q in [0, 31]
  uint16_t m;               // fp16 block minimum
  uint8_t qh[4];            // fifth bits, as Q5_0
  uint8_t qs[kQK5_1 / 2];   // low 4 bits, as Q5_0
};
static_assert(sizeof(BlockQ5_1) == 24, "must match ggml's block_q5_1");

struct BlockQ8_0 {
  uint16_t d;               // fp16 scale
  int8_t qs[kQK8_0];
};
static_assert(sizeof(BlockQ8_0) == 34, "must match ggml's block_q8_0");

struct BlockQ8_1 {
  uint16_t d;               // fp16 scale
  uint16_t s;               // fp16 of d * sum(qs): lets Q4_1's min term skip a pass over qs
  int8_t qs[kQK8_1];
};
static_assert(sizeof(BlockQ8_1) == 36, "must match ggml's block_q8_1");

struct BlockQ4_K {
  uint16_t d;                      // fp16 super-block scale of the 6-bit scales
  uint16_t dmin;                   // fp16 super-block scale of the 6-bit mins
  uint8_t scales[kKScaleSize];     // 8 scales + 8 mins, 6 bits each, packed
  uint8_t qs[kQK_K / 2];           // 4-bit quants
};
static_assert(sizeof(BlockQ4_K) == 144, "must match ggml's block_q4_K");

// Q4_K plus a fifth bit per quant: element 32 s + l (sub-block s, 0 <= l < 32) has its low 4
// bits where Q4_K keeps them and its fifth bit at bit s of qh[l].
struct BlockQ5_K {
  uint16_t d;                      // fp16 super-block scale of the 6-bit scales
  uint16_t dmin;                   // fp16 super-block scale of the 6-bit mins
  uint8_t scales[kKScaleSize];     // as Q4_K
  uint8_t qh[kQK_K / 8];           // fifth bits
  uint8_t qs[kQK_K / 2];           // low 4 bits, in Q4_K's nibble order
};
static_assert(sizeof(BlockQ5_K) == 176, "must match ggml's block_q5_K");

struct BlockQ6_K {
  uint8_t ql[kQK_K / 2];      // low 4 bits of the quants
  uint8_t qh[kQK_K / 4];      // high 2 bits of the quants
  int8_t scales[kQK_K / 16];  // 8-bit scales, one per 16 elements
  uint16_t d;                 // fp16 super-block scale
};
static_assert(sizeof(BlockQ6_K) == 210, "must match ggml's block_q6_K");

// Activation format of the K-quant dots: unlike Q8_0 the scale is a full float, and the sums
// of each 16 quants are stored so the Q4_K min term and the Q6_K -32 offset need no pass
// over qs.
struct BlockQ8_K {
  float d;                        // scale (1 / iscale; 0 for an all-zero block)
  int8_t qs[kQK_K];               // quants
  int16_t bsums[kQK_K / 16];      // sum of qs[16 j .. 16 j + 15]
};
static_assert(sizeof(BlockQ8_K) == 292, "must match ggml's block_q8_K");

// Block b of 8 interleaved Q4_1 rows (see tessera/interleaved.h): the rows' scales and mins,
// then their quants 4 bytes at a time, so byte 32 k + 4 j + i is byte 4 k + i of row j's qs.
struct BlockQ4_1x8 {
  uint16_t d[8];
  uint16_t m[8];
  uint8_t qs[8 * kQK4_1 / 2];
};
static_assert(sizeof(BlockQ4_1x8) == 8 * sizeof(BlockQ4_1), "interleaving adds no bytes");

// Block b of 8 interleaved Q4_0 / Q8_0 rows (tessera/interleaved.h): the rows' scales, then
// their quants 4 bytes at a time, so byte 32 k + 4 j + i is byte 4 k + i of row j's qs.
struct BlockQ4_0x8 {
  uint16_t d[8];
  uint8_t qs[8 * kQK4_0 / 2];
};
static_assert(sizeof(BlockQ4_0x8) == 8 * sizeof(BlockQ4_0), "interleaving adds no bytes");

struct BlockQ8_0x8 {
  uint16_t d[8];
  int8_t qs[8 * kQK8_0];
};
static_assert(sizeof(BlockQ8_0x8) == 8 * sizeof(BlockQ8_0), "interleaving adds no bytes");

// Q5_0: the quant nibbles as Q4_0x8; the 8 rows' 256 fifth bits reordered so that bit
// 2 k + h of byte 4 j + i is the fifth bit of element 16 h + 4 k + i of row j, i.e. of the
// nibble at byte 4 j + i of quant chunk k (h = 0 the low nibble, 1 the high one).
struct BlockQ5_0x8 {
  uint16_t d[8];
  uint8_t qh[32];
  uint8_t qs[8 * kQK5_0 / 2];
};
static_assert(sizeof(BlockQ5_0x8) == 8 * sizeof(BlockQ5_0), "interleaving adds no bytes");

// Q5_1: Q4_1x8's scales and mins, Q5_0x8's fifth bits and nibbles.
struct BlockQ5_1x8 {
  uint16_t d[8];
  uint16_t m[8];
  uint8_t qh[32];
  uint8_t qs[8 * kQK5_1 / 2];
};
static_assert(sizeof(BlockQ5_1x8) == 8 * sizeof(BlockQ5_1), "interleaving adds no bytes");

// Super-block b of 8 interleaved Q6_K rows. Each row's 256 6-bit quants q (0..63, value
// q - 32) sit in 8 groups of 32 elements laid out as Q4_0x8's blocks: the low 4 bits in qs[g]
// (byte 32 k + 4 j + i: element 4 k + i of group g of row j in the low nibble, 16 + 4 k + i in
// the high one), the top 2 bits in qh[g], where bits 2 c, 2 c + 1 of byte 32 v + 4 j + i belong
// to the nibble at byte 4 j + i of chunk k = 2 v + c / 2, half c % 2. scales[s][j]: row j's
// scale of its 16 elements 16 s .. 16 s + 15.
struct BlockQ6_Kx8 {
  uint16_t d[8];
  int8_t scales[kQK_K / 16][8];
  uint8_t qs[kQK_K / 32][128];
  uint8_t qh[kQK_K / 32][64];
};
static_assert(sizeof(BlockQ6_Kx8) == 8 * sizeof(BlockQ6_K), "interleaving adds no bytes");

// Super-block b of 8 interleaved Q4_K rows: the rows' fp16 d and dmin, their 6-bit scales and
// mins unpacked (scales[s][j]: row j's scale of its elements 32 s .. 32 s + 31), and per
// 32-element sub-block s the quants in Q4_0x8's nibble layout. 32 bytes more than 8 rows of
// Q4_K (the 6-bit fields of 16 bytes each row unpacked to bytes).
struct BlockQ4_Kx8 {
  uint16_t d[8];
  uint16_t dmin[8];
  uint8_t scales[kQK_K / 32][8];
  uint8_t mins[kQK_K / 32][8];
  uint8_t qs[kQK_K / 32][128];
};
static_assert(sizeof(BlockQ4_Kx8) == 8 * sizeof(BlockQ4_K) + 32);

// Super-block b of 8 interleaved Q5_K rows: Q4_Kx8 plus, per 32-element sub-block s, the
// rows' fifth bits in Q5_0x8's order (bit 2 k + h of byte 4 j + i of qh[s] is the fifth bit of
// element 16 h + 4 k + i of sub-block s of row j). 32 bytes more than 8 rows of Q5_K.
struct BlockQ5_Kx8 {
  uint16_t d[8];
  uint16_t dmin[8];
  uint8_t scales[kQK_K / 32][8];
  uint8_t mins[kQK_K / 32][8];
  uint8_t qh[kQK_K / 32][32];
  uint8_t qs[kQK_K / 32][128];
};
static_assert(sizeof(BlockQ5_Kx8) == 8 * sizeof(BlockQ5_K) + 32);

// ggml's nearest_int: adding 1.5 * 2^23 leaves round(fval) (to nearest, ties to even, in the
// default rounding mode) in the low mantissa bits. Valid for |fval| < 2^22. The addition must
// be a separate float operation (callers include tessera/fp_contract_off.h).
inline int nearest_int(float fval) {
  const float val = fval + 12582912.0f;
  int32_t i;
  std::memcpy(&i, &val, sizeof i);
  return (i & 0x007fffff) - 0x00400000;
}

// Unpacks scale/min j (0..7) of a Q4_K super-block: the first four are the low 6 bits of
// bytes 0-3 / 4-7; the last four take 4 bits from bytes 8-11 and their top 2 bits from the
// spare high bits of bytes 0-7.
inline void get_scale_min_k4(int j, const uint8_t* q, uint8_t* d, uint8_t* m) {
  if (j < 4) {
    *d = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *d = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j - 0] >> 6) << 4);
  }
}

// AVX2/FMA/F16C kernels (quant_avx2.cpp). Only call after cpu_has_avx2() returned true: the
// translation unit is compiled with -mavx2 and may use those instructions anywhere.
float vec_dot_q4_0_q8_0_avx2(int64_t n, const void* w, const void* x);
float vec_dot_q4_1_q8_1_avx2(int64_t n, const void* w, const void* x);
float vec_dot_q5_0_q8_0_avx2(int64_t n, const void* w, const void* x);
float vec_dot_q5_1_q8_1_avx2(int64_t n, const void* w, const void* x);
float vec_dot_q8_0_q8_0_avx2(int64_t n, const void* w, const void* x);
float vec_dot_q4_k_q8_k_avx2(int64_t n, const void* w, const void* x);
float vec_dot_q5_k_q8_k_avx2(int64_t n, const void* w, const void* x);
float vec_dot_q6_k_q8_k_avx2(int64_t n, const void* w, const void* x);
float vec_dot_f16_avx2(int64_t n, const void* w, const void* x);
float vec_dot_f32_avx2(int64_t n, const void* w, const void* x);

// llama.cpp's run-time Q8_0 / Q8_1 activation quantization (see quant_ref.cpp) on 8 lanes;
// same bytes as the scalar version. to_half converts the scales (fp32_to_fp16).
void quantize_activations_q8_avx2(const float* x, void* y, int64_t n, bool q8_1,
                                  uint16_t (*to_half)(float));
// ggml's quantize_row_q8_K_ref (which its x86 build runs for the K-quants' activations), same
// bytes; an all-zero block gets zero bsums as the scalar version writes them.
void quantize_row_q8_k_avx2(const float* x, void* y, int64_t n);

// Tile kernel: y[t * y_stride + r] = vec_dot(weight row r, activation row t) for r < w_rows,
// t < x_rows, each element bit-identical to the single-dot kernel of its type. Returns false
// (computing nothing) for a type without a tile kernel.
inline constexpr int kTileF32 = 0;
inline constexpr int kTileF16 = 1;
inline constexpr int kTileQ4_0 = 2;
inline constexpr int kTileQ4_1 = 3;
inline constexpr int kTileQ5_0 = 6;
inline constexpr int kTileQ8_0 = 8;
bool vec_dot_tile_avx2(int type, int64_t n, const void* w, size_t w_stride, int64_t w_rows,
                       const void* x, size_t x_stride, int64_t x_rows, float* y,
                       int64_t y_stride);

// The interleaved matmuls (interleaved_x86.inl), built three times: *_avx2 (AVX2/FMA/F16C),
// *_avxvnni (plus AVX-VNNI) and *_vnni256 (the VNNI code with AVX512-VL's vpdpbusd),
// bit-identical. Rows [0, w_rows) of the 8-row groups starting at
// w, against x_rows activation rows x_stride bytes apart, in the order of tessera/interleaved.h;
// nb counts blocks (256-element super-blocks for the K-quants). Q4_1 / Q5_1 take Q8_1
// activations, Q4_0 / Q5_0 / Q8_0 Q8_0, the K-quants Q8_K.
#define TESSERA_DECLARE_X8(suffix)                                                             \
  void matmul_q4_1x8_##suffix(int64_t nb, const BlockQ4_1x8* w, int64_t w_rows, const uint8_t* x, \
                              size_t x_stride, int64_t x_rows, float* y, int64_t y_stride);     \
  void matmul_q4_0x8_##suffix(int64_t nb, const BlockQ4_0x8* w, int64_t w_rows, const uint8_t* x, \
                              size_t x_stride, int64_t x_rows, float* y, int64_t y_stride);     \
  void matmul_q5_0x8_##suffix(int64_t nb, const BlockQ5_0x8* w, int64_t w_rows, const uint8_t* x, \
                              size_t x_stride, int64_t x_rows, float* y, int64_t y_stride);     \
  void matmul_q5_1x8_##suffix(int64_t nb, const BlockQ5_1x8* w, int64_t w_rows, const uint8_t* x, \
                              size_t x_stride, int64_t x_rows, float* y, int64_t y_stride);     \
  void matmul_q8_0x8_##suffix(int64_t nb, const BlockQ8_0x8* w, int64_t w_rows, const uint8_t* x, \
                              size_t x_stride, int64_t x_rows, float* y, int64_t y_stride);     \
  void matmul_q4_kx8_##suffix(int64_t nb, const BlockQ4_Kx8* w, int64_t w_rows, const uint8_t* x, \
                              size_t x_stride, int64_t x_rows, float* y, int64_t y_stride);     \
  void matmul_q5_kx8_##suffix(int64_t nb, const BlockQ5_Kx8* w, int64_t w_rows, const uint8_t* x, \
                              size_t x_stride, int64_t x_rows, float* y, int64_t y_stride);     \
  void matmul_q6_kx8_##suffix(int64_t nb, const BlockQ6_Kx8* w, int64_t w_rows, const uint8_t* x, \
                              size_t x_stride, int64_t x_rows, float* y, int64_t y_stride);
TESSERA_DECLARE_X8(avx2)
TESSERA_DECLARE_X8(avxvnni)
TESSERA_DECLARE_X8(vnni256)
#undef TESSERA_DECLARE_X8

// matmul_interleaved's x86 part with one kernel set, chosen by the caller (tests compare the
// two): type_id a GgmlType with an interleaved layout, nb its blocks per row.
void matmul_x8_avx2(int type_id, int64_t nb, const void* packed, int64_t w_rows, const uint8_t* x,
                    size_t x_stride, int64_t x_rows, float* y, int64_t y_stride);
void matmul_x8_avxvnni(int type_id, int64_t nb, const void* packed, int64_t w_rows,
                       const uint8_t* x, size_t x_stride, int64_t x_rows, float* y,
                       int64_t y_stride);
// Only after cpu_has_avx512_vnni().
void matmul_x8_vnni256(int type_id, int64_t nb, const void* packed, int64_t w_rows,
                       const uint8_t* x, size_t x_stride, int64_t x_rows, float* y,
                       int64_t y_stride);

// The same on 512-bit vectors with AVX512-VNNI (interleaved_avx512.cpp): two groups per pass,
// bit-identical to the two above. Only call after cpu_has_avx512_vnni().
void matmul_x8_avx512(int type_id, int64_t nb, const void* packed, int64_t w_rows,
                      const uint8_t* x, size_t x_stride, int64_t x_rows, float* y,
                      int64_t y_stride);
// True when cpu_has_avx2() and the CPU and OS have AVX-512 F/BW/VL and AVX512-VNNI, unless the
// environment sets TESSERA_NO_AVX512 (to compare the builds).
bool cpu_has_avx512_vnni();
// Activation rows from which matmul_interleaved takes the 512-bit kernels.
// (At one row, batch-1 decode, they measured ~4 % slower: the 256-bit ones stay.)
inline constexpr int64_t kAvx512MinTokens = 2;

// tessera::cpu_has_avx_vnni() (SDK ggml_types.h) chooses between the two 256-bit builds, and
// cpu_has_avx512_vnni() whether the 512-bit one runs instead.

}  // namespace tessera::kernels
