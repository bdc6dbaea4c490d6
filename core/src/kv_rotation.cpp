#include "tessera/kv_rotation.h"

#include <cmath>

namespace tessera {

int32_t kv_k_rotation_block(int32_t head_dim) {
  if (head_dim <= 0 || head_dim % 64 != 0) return 0;
  return head_dim & -head_dim;  // the lowest set bit: the largest power of two dividing it
}

int32_t kv_v_rotation_block(int32_t head_dim) {
  return head_dim > 0 && head_dim % 64 == 0 ? 64 : 0;
}

void hadamard_rotate(float* x, int64_t blocks, int32_t block) {
  const float norm = 1.0f / std::sqrt(static_cast<float>(block));
  for (int64_t b = 0; b < blocks; ++b, x += block) {
    // Stage `half`: elements j and j + half of each 2 * half group become (a + c, a - c),
    // which builds H_2n = [[H_n, H_n], [H_n, -H_n]] from the stages before. The first three
    // stages (within each 8 elements) are unrolled; the later ones are loops over contiguous
    // elements the compiler vectorizes. The runner rotates every Q, K and V row of a layer,
    // so this is kept to a few hundred nanoseconds per token and layer.
    int32_t half = 1;
    if (block >= 8) {
      for (int32_t i = 0; i < block; i += 8) {
        float* v = x + i;
        const float s0 = v[0] + v[1], d0 = v[0] - v[1], s1 = v[2] + v[3], d1 = v[2] - v[3];
        const float s2 = v[4] + v[5], d2 = v[4] - v[5], s3 = v[6] + v[7], d3 = v[6] - v[7];
        const float t0 = s0 + s1, t1 = d0 + d1, t2 = s0 - s1, t3 = d0 - d1;
        const float t4 = s2 + s3, t5 = d2 + d3, t6 = s2 - s3, t7 = d2 - d3;
        v[0] = t0 + t4, v[1] = t1 + t5, v[2] = t2 + t6, v[3] = t3 + t7;
        v[4] = t0 - t4, v[5] = t1 - t5, v[6] = t2 - t6, v[7] = t3 - t7;
      }
      half = 8;
    }
    for (; half < block; half *= 2)
      for (int32_t i = 0; i < block; i += 2 * half) {
        float* lo = x + i;
        float* hi = x + i + half;
        for (int32_t j = 0; j < half; ++j) {
          const float a = lo[j], c = hi[j];
          lo[j] = a + c;
          hi[j] = a - c;
        }
      }
    for (int32_t i = 0; i < block; ++i) x[i] *= norm;
  }
}

}  // namespace tessera
