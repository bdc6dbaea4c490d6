// quantizer.int8's kernels with AVX-VNNI's vpdpbusd (see int8_kernels_x86.inl); called only
// after cpu_has_avx_vnni(). Same results as the AVX2 build: the integer sums are exact.
#define TESSERA_INT8_SUFFIX avxvnni
#define TESSERA_INT8_VNNI 1
#include "int8_kernels_x86.inl"
