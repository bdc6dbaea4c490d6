// attention.flash's inner kernel compiled with AVX-512 F/BW/VL besides AVX2/FMA/F16C (see
// CMakeLists.txt): the AVX2 build's operations with the query rows of a score loop kept in
// zmm registers and 16-lane P * V, so its results are the AVX2 build's bits. Only reached
// after cpu_has_avx512().
#include "flash_kernel_impl.h"

namespace tessera::flash {
void run_task_avx512(const AttentionShape& shape, const AttentionBatch& batch, const Task& task,
                     const Layout& layout, float* scratch, const Task* following) {
  run_task_impl(shape, batch, task, layout, scratch, following);
}
}  // namespace tessera::flash
