// The interleaved kernels with AVX-VNNI's vpdpbusd for the 4-product sums (see
// interleaved_x86.inl); called only after cpu_has_avx2() and cpu_has_avx_vnni(). Same results
// as the AVX2 build, bit for bit: only exact integer sums change instruction.
#define TESSERA_X8_SUFFIX avxvnni
#define TESSERA_X8_VNNI 1
#include "interleaved_x86.inl"
