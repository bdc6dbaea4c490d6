// Include first in a translation unit whose float arithmetic must run exactly as written:
// the compiler may not fuse a * b + c into one FMA on its own (C++ compilers do by default,
// ggml's C build does not), so every rounding step is the one the source — and the reference
// it matches — names. Explicit fma()/_mm256_fmadd_ps calls still fuse.
#pragma once

#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif
