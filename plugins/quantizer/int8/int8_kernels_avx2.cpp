// quantizer.int8's kernels for AVX2 (see int8_kernels_x86.inl); called only after cpu_has_avx2().
#define TESSERA_INT8_SUFFIX avx2
#include "int8_kernels_x86.inl"
