// The interleaved kernels for AVX2/FMA/F16C (see interleaved_x86.inl); called only after
// cpu_has_avx2().
#define TESSERA_X8_SUFFIX avx2
#include "interleaved_x86.inl"
