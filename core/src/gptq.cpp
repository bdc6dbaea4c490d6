#include "tessera/gptq.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <stdexcept>

#include "kernels/quant_blocks.h"
#include "tessera/thread_pool.h"

namespace tessera::quant {

namespace {

using kernels::BlockQ4_0;
using kernels::BlockQ4_1;
using kernels::BlockQ4_K;
using kernels::BlockQ5_0;
using kernels::BlockQ5_1;
using kernels::BlockQ8_0;

// One element's grid inside a quantized block: value = a + b * q, q in [qmin, qmax].
struct Grid {
  float a = 0, b = 0;
  int qmin = 0, qmax = 0;
  int q = 0;  // what the block quantizer chose
};

int nibble(const uint8_t* qs, int e) { return e < 16 ? (qs[e] & 0xF) : (qs[e - 16] >> 4); }
void set_nibble(uint8_t* qs, int e, int v) {
  if (e < 16) qs[e] = static_cast<uint8_t>((qs[e] & 0xF0) | v);
  else qs[e - 16] = static_cast<uint8_t>((qs[e - 16] & 0x0F) | (v << 4));
}
int fifth_bit(const uint8_t* qh, int e) {
  uint32_t h;
  std::memcpy(&h, qh, 4);
  return (h >> e) & 1;
}
void set_fifth_bit(uint8_t* qh, int e, int v) {
  uint32_t h;
  std::memcpy(&h, qh, 4);
  h = (h & ~(1u << e)) | (static_cast<uint32_t>(v) << e);
  std::memcpy(qh, &h, 4);
}

// Element e (0 .. group-1) of the group at `block`.
Grid grid_of(GgmlType type, const uint8_t* block, int e) {
  Grid g;
  switch (type) {
    case GgmlType::Q4_0: {
      const auto* x = reinterpret_cast<const BlockQ4_0*>(block) + e / 32;
      const float d = fp16_to_fp32(x->d);
      g = {-8 * d, d, 0, 15, nibble(x->qs, e % 32)};
      break;
    }
    case GgmlType::Q4_1: {
      const auto* x = reinterpret_cast<const BlockQ4_1*>(block) + e / 32;
      g = {fp16_to_fp32(x->m), fp16_to_fp32(x->d), 0, 15, nibble(x->qs, e % 32)};
      break;
    }
    case GgmlType::Q5_0: {
      const auto* x = reinterpret_cast<const BlockQ5_0*>(block) + e / 32;
      const float d = fp16_to_fp32(x->d);
      g = {-16 * d, d, 0, 31, nibble(x->qs, e % 32) | (fifth_bit(x->qh, e % 32) << 4)};
      break;
    }
    case GgmlType::Q5_1: {
      const auto* x = reinterpret_cast<const BlockQ5_1*>(block) + e / 32;
      g = {fp16_to_fp32(x->m), fp16_to_fp32(x->d), 0, 31,
           nibble(x->qs, e % 32) | (fifth_bit(x->qh, e % 32) << 4)};
      break;
    }
    case GgmlType::Q8_0: {
      const auto* x = reinterpret_cast<const BlockQ8_0*>(block) + e / 32;
      g = {0, fp16_to_fp32(x->d), -127, 127, x->qs[e % 32]};
      break;
    }
    case GgmlType::Q4_K: {
      const auto* x = reinterpret_cast<const BlockQ4_K*>(block) + e / 256;
      const int i = e % 256;
      uint8_t sc = 0, m = 0;
      kernels::get_scale_min_k4(i / 32, x->scales, &sc, &m);
      // Each 64 elements share 32 bytes: the low nibbles the first 32, the high the next.
      const uint8_t byte = x->qs[(i / 64) * 32 + i % 32];
      const int q = (i % 64) < 32 ? (byte & 0xF) : (byte >> 4);
      g = {-fp16_to_fp32(x->dmin) * m, fp16_to_fp32(x->d) * sc, 0, 15, q};
      break;
    }
    default:
      throw std::invalid_argument(std::string("gptq: no grid for ") + ggml_type_name(type));
  }
  return g;
}

void set_q(GgmlType type, uint8_t* block, int e, int q) {
  switch (type) {
    case GgmlType::Q4_0:
      set_nibble((reinterpret_cast<BlockQ4_0*>(block) + e / 32)->qs, e % 32, q);
      break;
    case GgmlType::Q4_1:
      set_nibble((reinterpret_cast<BlockQ4_1*>(block) + e / 32)->qs, e % 32, q);
      break;
    case GgmlType::Q5_0: {
      auto* x = reinterpret_cast<BlockQ5_0*>(block) + e / 32;
      set_nibble(x->qs, e % 32, q & 0xF);
      set_fifth_bit(x->qh, e % 32, q >> 4);
      break;
    }
    case GgmlType::Q5_1: {
      auto* x = reinterpret_cast<BlockQ5_1*>(block) + e / 32;
      set_nibble(x->qs, e % 32, q & 0xF);
      set_fifth_bit(x->qh, e % 32, q >> 4);
      break;
    }
    case GgmlType::Q8_0:
      (reinterpret_cast<BlockQ8_0*>(block) + e / 32)->qs[e % 32] = static_cast<int8_t>(q);
      break;
    case GgmlType::Q4_K: {
      auto* x = reinterpret_cast<BlockQ4_K*>(block) + e / 256;
      const int i = e % 256;
      uint8_t& byte = x->qs[(i / 64) * 32 + i % 32];
      byte = (i % 64) < 32 ? static_cast<uint8_t>((byte & 0xF0) | q)
                           : static_cast<uint8_t>((byte & 0x0F) | (q << 4));
      break;
    }
    default:
      throw std::invalid_argument(std::string("gptq: cannot write ") + ggml_type_name(type));
  }
}

double dot(const double* a, const double* b, int64_t n) {
  double lane[4] = {0, 0, 0, 0};
  int64_t k = 0;
  for (; k + 4 <= n; k += 4)
    for (int l = 0; l < 4; ++l) lane[l] += a[k + l] * b[k + l];
  double s = lane[0] + lane[1] + lane[2] + lane[3];
  for (; k < n; ++k) s += a[k] * b[k];
  return s;
}

// In-place lower Cholesky factor of the n x n row-major `a` (upper part left undefined).
bool cholesky_lower(std::vector<double>& a, int64_t n) {
  for (int64_t j = 0; j < n; ++j) {
    double* rj = a.data() + j * n;
    const double s = rj[j] - dot(rj, rj, j);
    if (!(s > 0)) return false;
    rj[j] = std::sqrt(s);
    for (int64_t i = j + 1; i < n; ++i) {
      double* ri = a.data() + i * n;
      ri[j] = (ri[j] - dot(ri, rj, j)) / rj[j];
    }
  }
  return true;
}

}  // namespace

bool gptq_supports(GgmlType type) {
  switch (type) {
    case GgmlType::Q4_0: case GgmlType::Q4_1: case GgmlType::Q5_0: case GgmlType::Q5_1:
    case GgmlType::Q8_0: case GgmlType::Q4_K:
      return true;
    default:
      return false;
  }
}

std::string gptq_type_names() { return "Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K"; }

int64_t gptq_group_size(GgmlType type) { return type == GgmlType::Q4_K ? 256 : 32; }

GptqHessian gptq_prepare(const std::vector<double>& xtx, int64_t cols, int64_t group,
                         const GptqOptions& options, const std::string& what) {
  if (static_cast<int64_t>(xtx.size()) != cols * cols || cols % group != 0)
    throw std::invalid_argument(what + ": covariance of " + std::to_string(xtx.size()) +
                                " values for " + std::to_string(cols) + " columns");
  GptqHessian h;
  h.cols = cols;
  h.importance.resize(static_cast<size_t>(cols));
  h.dead.assign(static_cast<size_t>(cols), 0);
  double mean_diag = 0;
  for (int64_t c = 0; c < cols; ++c) {
    h.importance[c] = static_cast<float>(xtx[c * cols + c]);
    if (xtx[c * cols + c] <= 0) h.dead[c] = 1;
    mean_diag += xtx[c * cols + c];
  }
  mean_diag /= static_cast<double>(cols);
  if (!(mean_diag > 0)) throw std::runtime_error(what + ": no calibration activation reached this weight");

  h.perm.resize(static_cast<size_t>(cols));
  std::iota(h.perm.begin(), h.perm.end(), 0);
  if (options.act_order) {
    // Whole format blocks move, so each group's columns stay together and its scales can be
    // chosen when GPTQ reaches it ("static groups"); inside a block, the larger diag first.
    const int64_t num_groups = cols / group;
    std::vector<int64_t> order(static_cast<size_t>(num_groups));
    std::iota(order.begin(), order.end(), 0);
    std::vector<double> weight(static_cast<size_t>(num_groups), 0.0);
    for (int64_t c = 0; c < cols; ++c) weight[c / group] += xtx[c * cols + c];
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return weight[a] > weight[b]; });
    for (int64_t g = 0; g < num_groups; ++g) {
      auto first = h.perm.begin() + g * group;
      std::iota(first, first + group, order[g] * group);
      std::stable_sort(first, first + group,
                       [&](int64_t a, int64_t b) { return xtx[a * cols + a] > xtx[b * cols + b]; });
    }
  }

  // U with H^-1 = U^T U is the inverse of V, the upper factor of H = V V^T. V comes from the
  // ordinary lower Cholesky factor of H with rows and columns reversed (J H J = L L^T gives
  // V = J L J), so one factorization and one triangular inverse, all in double.
  double damp = options.damp * mean_diag;
  std::vector<double> a;
  for (int attempt = 0;; ++attempt) {
    a.assign(static_cast<size_t>(cols * cols), 0.0);
    for (int64_t i = 0; i < cols; ++i) {
      const int64_t pi = h.perm[cols - 1 - i];
      for (int64_t j = 0; j <= i; ++j) {
        const int64_t pj = h.perm[cols - 1 - j];
        double v = xtx[pi * cols + pj];
        if (i == j) v = (h.dead[pi] ? 1.0 : v) + damp;
        if (h.dead[pi] || h.dead[pj]) v = i == j ? v : 0.0;
        a[i * cols + j] = v;
      }
    }
    if (cholesky_lower(a, cols)) break;
    if (attempt == 2)
      throw std::runtime_error(what + ": the Hessian is not positive definite even with damping " +
                               std::to_string(damp / mean_diag) + " of its mean diagonal");
    damp *= 10;
  }
  // M = L^-1 (lower), row by row: M[i] = (e_i - sum_{k<i} L[i][k] M[k]) / L[i][i].
  std::vector<double> m(static_cast<size_t>(cols * cols), 0.0);
  for (int64_t i = 0; i < cols; ++i) {
    double* mi = m.data() + i * cols;
    const double* li = a.data() + i * cols;
    for (int64_t k = 0; k < i; ++k) {
      const double f = li[k];
      const double* mk = m.data() + k * cols;
      for (int64_t c = 0; c <= k; ++c) mi[c] -= f * mk[c];
    }
    mi[i] += 1.0;
    const double inv = 1.0 / li[i];
    for (int64_t c = 0; c <= i; ++c) mi[c] *= inv;
  }
  // U = V^-1 = J M J.
  h.u.assign(static_cast<size_t>(cols * cols), 0.0f);
  for (int64_t i = 0; i < cols; ++i)
    for (int64_t j = i; j < cols; ++j)
      h.u[i * cols + j] = static_cast<float>(m[(cols - 1 - i) * cols + (cols - 1 - j)]);
  return h;
}

std::vector<uint8_t> gptq_quantize(GgmlType type, const float* w, int64_t rows, int64_t cols,
                                   const GptqHessian& hessian, const GptqOptions& options,
                                   int threads) {
  if (!gptq_supports(type))
    throw std::invalid_argument(std::string("gptq: type ") + ggml_type_name(type) + " is not one of " +
                                gptq_type_names());
  const int64_t group = gptq_group_size(type);
  if (cols % group != 0 || hessian.cols != cols)
    throw std::invalid_argument("gptq: " + std::to_string(cols) + " columns, group " +
                                std::to_string(group) + ", Hessian of " + std::to_string(hessian.cols));
  // Lazy blocks hold whole groups, so a group's scales see every update made before it.
  const int64_t block = std::max<int64_t>(group, (options.block_size + group - 1) / group * group);
  const size_t row_bytes = ggml_row_size(type, cols);
  const size_t group_bytes = ggml_row_size(type, group);
  std::vector<uint8_t> out(row_bytes * static_cast<size_t>(rows));
  const float* u = hessian.u.data();
  const int64_t* perm = hessian.perm.data();

  ThreadPool pool(std::max(1, std::min<int>(threads, static_cast<int>(rows))));
  pool.run(rows, [&](int64_t begin, int64_t end, int) {
    constexpr int64_t kTile = 8;  // rows updated together: each row of U is read once per tile
    std::vector<float> wt(static_cast<size_t>(kTile * cols));
    std::vector<float> err(static_cast<size_t>(kTile * block));
    std::vector<Grid> grid(static_cast<size_t>(kTile * group));
    std::vector<float> orig(static_cast<size_t>(group)), imp(static_cast<size_t>(group));
    for (int64_t r0 = begin; r0 < end; r0 += kTile) {
      const int64_t nr = std::min(kTile, end - r0);
      for (int64_t r = 0; r < nr; ++r)
        for (int64_t p = 0; p < cols; ++p)
          wt[r * cols + p] = hessian.dead[perm[p]] ? 0.0f : w[(r0 + r) * cols + perm[p]];
      for (int64_t i1 = 0; i1 < cols; i1 += block) {
        const int64_t i2 = std::min(cols, i1 + block);
        for (int64_t j = i1; j < i2; ++j) {
          const int64_t base = perm[j - j % group] / group * group;  // the group's first column
          if (j % group == 0) {
            for (int64_t k = 0; k < group; ++k) imp[perm[j + k] - base] = hessian.importance[perm[j + k]];
            for (int64_t r = 0; r < nr; ++r) {
              for (int64_t k = 0; k < group; ++k) orig[perm[j + k] - base] = wt[r * cols + j + k];
              uint8_t* blk = out.data() + (r0 + r) * row_bytes + base / group * group_bytes;
              quantize_weight_row(type, orig.data(), blk, group, imp.data());
              for (int64_t k = 0; k < group; ++k)
                grid[r * group + k] = grid_of(type, blk, static_cast<int>(perm[j + k] - base));
            }
          }
          const float ujj = u[j * cols + j];
          const int e = static_cast<int>(perm[j] - base);
          for (int64_t r = 0; r < nr; ++r) {
            float* wr = wt.data() + r * cols;
            const Grid& g = grid[r * group + j % group];
            int q = g.q;
            if (g.b != 0) q = std::clamp(static_cast<int>(std::nearbyint((wr[j] - g.a) / g.b)), g.qmin, g.qmax);
            set_q(type, out.data() + (r0 + r) * row_bytes + base / group * group_bytes, e, q);
            const float e_j = (wr[j] - (g.a + g.b * static_cast<float>(q))) / ujj;
            const float* uj = u + j * cols;
            for (int64_t k = j + 1; k < i2; ++k) wr[k] -= e_j * uj[k];
            err[r * block + (j - i1)] = e_j;
          }
        }
        // The block's errors onto every later column at once.
        for (int64_t jj = 0; jj < i2 - i1; ++jj) {
          const float* uj = u + (i1 + jj) * cols;
          for (int64_t r = 0; r < nr; ++r) {
            const float e_j = err[r * block + jj];
            float* wr = wt.data() + r * cols;
            for (int64_t k = i2; k < cols; ++k) wr[k] -= e_j * uj[k];
          }
        }
      }
    }
  });
  return out;
}

}  // namespace tessera::quant
