// attention.flash's inner kernel compiled with -mavx2 -mfma -mf16c (see CMakeLists.txt). Only
// reached after cpu_has_avx2(), so the plugin still runs on CPUs without these extensions.
#include "flash_kernel_impl.h"

namespace tessera::flash {
void run_task_avx2(const AttentionShape& shape, const AttentionBatch& batch, const Task& task,
                   const Layout& layout, float* scratch, const Task* following) {
  run_task_impl(shape, batch, task, layout, scratch, following);
}
}  // namespace tessera::flash
