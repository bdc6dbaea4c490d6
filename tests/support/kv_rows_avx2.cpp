// A fixture, not a test: tessera/sdk/kv_rows.h compiled with -mavx2 -mf16c (see
// tests/CMakeLists.txt), for tests/unit/test_kv_rows.cpp to compare with the portable build
// in its own file. The assertions are there, including that this file really got its AVX2
// path on an AVX2 CPU (built_for_avx2).
#include "tessera/sdk/kv_rows.h"

namespace kv_rows_check {

bool built_for_avx2() { return TESSERA_KV_ROWS_AVX2 != 0; }

void widen_avx2(tessera::KvDtype dtype, const void* row, float* out, int32_t n) {
  tessera::widen_kv_row(dtype, row, out, n);
}

}  // namespace kv_rows_check
