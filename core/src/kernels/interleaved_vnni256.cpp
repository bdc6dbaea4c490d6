// The interleaved kernels with AVX512-VNNI's vpdpbusd on 256-bit vectors (EVEX-encoded, the
// AVX512-VL form) for the 4-product sums (see interleaved_x86.inl): the AVX-VNNI build's code
// for CPUs that have AVX512-VNNI but not the VEX-encoded AVX-VNNI (AMD Zen 4, Intel Ice Lake
// and Sapphire Rapids servers). Called only after cpu_has_avx2() and cpu_has_avx512_vnni(),
// where fewer than kAvx512MinTokens rows would not fill the 512-bit kernels (batch-1 decode).
// Same results as the AVX2 build, bit for bit: only exact integer sums change instruction.
#define TESSERA_X8_SUFFIX vnni256
#define TESSERA_X8_VNNI 1
#define TESSERA_X8_DPBUSD _mm256_dpbusd_epi32
#include "interleaved_x86.inl"
