// The AVX2/FMA/F16C build of flash's kernel helpers for tests/unit/test_flash_softmax.cpp
// (compiled with the kernel's flags, see tests/CMakeLists.txt).
#define FLASH_CHECK_NS flash_check_avx2
#include "support/flash_softmax_check.h"
