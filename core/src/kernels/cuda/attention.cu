// cuda-flash: causal attention over the paged KV pool with an online softmax.
//
// Both kernels stream K/V in tiles of kTile positions read through the block table into shared
// memory (widened to f32 once per CTA) and share them between all query rows of the CTA: the
// query heads of one KV head (GQA) times a few query positions. Per row a warp keeps the
// running max, running sum and the unnormalized output in registers (lane owns dims
// lane, lane + 32, ...); scores are computed one key per lane.
//   prefill: one CTA per work item (sequence, KV head, run of query positions); causal mask
//            per row. Handles any mix of prompt chunks and decode rows.
//   decode:  flash-decoding: grid (split, KV head, sequence); each CTA covers 1/num_splits of
//            the context, writes (max, sum, output) partials, and a second kernel combines.
// CUDA cores only (no tensor-core MMA yet): see the plugin README.
#include <algorithm>
#include <stdexcept>
#include <string>

#include "common.cuh"

namespace tessera::cuda {
namespace {

constexpr int kTile = 32;        // key positions per tile (one per lane when scoring)
constexpr int kWarps = 4;
constexpr int kRowsPerWarp = kAttnRowsPerCta / kWarps;

template <int D>
struct RowState {
  float m[kRowsPerWarp];
  float l[kRowsPerWarp];
  float acc[kRowsPerWarp][D / 32];
};

template <int D>
struct Smem {
  float q[kAttnRowsPerCta][D];
  float k[kTile][D + 1];  // +1: lanes read different keys at the same dim without conflicts
  float v[kTile][D];
  int32_t qpos[kAttnRowsPerCta];
  int64_t key_offset[kTile];  // element offset of each tile key's row in the pool (-1: none)
};

// Loads `nrows` query rows (row r: token row q_row[r], head q_head[r]) into shared memory,
// rounded to f16 when the cache is f16 (as the CPU kernels do).
template <int D>
__device__ void load_queries(Smem<D>& s, const float* q, int32_t num_heads, const int32_t* q_row,
                             const int32_t* q_head, int nrows, bool kv_f16) {
  for (int i = threadIdx.x; i < nrows * D; i += blockDim.x) {
    const int r = i / D, d = i % D;
    float v = q[(static_cast<int64_t>(q_row[r]) * num_heads + q_head[r]) * D + d];
    if (kv_f16) v = __half2float(__float2half_rn(v));
    s.q[r][d] = v;
  }
}

template <int D>
__device__ void init_state(RowState<D>& st) {
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    st.m[i] = -INFINITY;
    st.l[i] = 0.0f;
#pragma unroll
    for (int k = 0; k < D / 32; ++k) st.acc[i][k] = 0.0f;
  }
}

// Attends rows [0, nrows) of s.q to keys [key_begin, key_end), each row r masked to keys
// <= s.qpos[r]. Row r belongs to warp r % kWarps, slot r / kWarps.
template <int D>
__device__ void attend(Smem<D>& s, RowState<D>& st, int nrows, int key_begin, int key_end,
                       const AttnShape& sh, int kv_head, const int32_t* block_table,
                       const void* k_pool, const void* v_pool) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t row_stride = static_cast<int64_t>(sh.num_kv_heads) * D;
  for (int t0 = key_begin; t0 < key_end; t0 += kTile) {
    __syncthreads();  // previous tile fully consumed
    if (threadIdx.x < kTile) {
      const int t = t0 + threadIdx.x;
      int64_t off = -1;
      if (t < key_end) {
        const int64_t slot = static_cast<int64_t>(block_table[t / sh.block_size]) * sh.block_size +
                             t % sh.block_size;
        off = slot * row_stride + static_cast<int64_t>(kv_head) * D;
      }
      s.key_offset[threadIdx.x] = off;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < kTile * D; i += blockDim.x) {
      const int j = i / D, d = i % D;
      const int64_t off = s.key_offset[j];
      float kv = 0.0f, vv = 0.0f;
      if (off >= 0) {
        if (sh.kv_f16) {
          kv = __half2float(static_cast<const __half*>(k_pool)[off + d]);
          vv = __half2float(static_cast<const __half*>(v_pool)[off + d]);
        } else {
          kv = static_cast<const float*>(k_pool)[off + d];
          vv = static_cast<const float*>(v_pool)[off + d];
        }
      }
      s.k[j][d] = kv;
      s.v[j][d] = vv;
    }
    __syncthreads();
#pragma unroll
    for (int slot = 0; slot < kRowsPerWarp; ++slot) {
      const int r = warp + kWarps * slot;
      if (r >= nrows) break;
      const int t = t0 + lane;
      const bool visible = t < key_end && t <= s.qpos[r];
      float score = -INFINITY;
      if (visible) {
        float dot = 0.0f;
#pragma unroll 16
        for (int d = 0; d < D; ++d) dot = fmaf(s.q[r][d], s.k[lane][d], dot);
        score = dot * sh.scale;
      }
      const float tile_max = warp_max(score);
      if (tile_max == -INFINITY) continue;  // every key of the tile is masked for this row
      const float m_new = fmaxf(st.m[slot], tile_max);
      const float corr = expf(st.m[slot] - m_new);  // 0 on the first visible tile
      const float p = visible ? expf(score - m_new) : 0.0f;
      st.l[slot] = st.l[slot] * corr + warp_sum(p);
      st.m[slot] = m_new;
#pragma unroll
      for (int k = 0; k < D / 32; ++k) st.acc[slot][k] *= corr;
#pragma unroll 8
      for (int j = 0; j < kTile; ++j) {
        const float pj = __shfl_sync(0xffffffffu, p, j);
#pragma unroll
        for (int k = 0; k < D / 32; ++k) st.acc[slot][k] = fmaf(pj, s.v[j][lane + 32 * k], st.acc[slot][k]);
      }
    }
  }
}

template <int D>
__global__ void __launch_bounds__(kWarps * 32)
prefill_kernel(AttnShape sh, const AttnSeq* seqs, const AttnWork* work, const float* q,
               const void* k_pool, const void* v_pool, float* out) {
  __shared__ Smem<D> s;
  __shared__ int32_t q_row[kAttnRowsPerCta], q_head[kAttnRowsPerCta];
  const AttnWork w = work[blockIdx.x];
  const AttnSeq seq = seqs[w.seq];
  const int group = sh.num_heads / sh.num_kv_heads;
  const int kv_head = w.head_begin / group;
  const int nrows = w.num_queries * w.num_heads;
  const int first_pos = seq.context_len - seq.num_queries;
  if (threadIdx.x < nrows) {
    const int r = threadIdx.x;
    const int qi = w.first_query + r / w.num_heads;
    q_row[r] = seq.query_start + qi;
    q_head[r] = w.head_begin + r % w.num_heads;
    s.qpos[r] = first_pos + qi;
  }
  __syncthreads();
  load_queries<D>(s, q, sh.num_heads, q_row, q_head, nrows, sh.kv_f16);
  RowState<D> st;
  init_state<D>(st);
  const int key_end = first_pos + w.first_query + w.num_queries;  // last query's position + 1
  attend<D>(s, st, nrows, 0, key_end, sh, kv_head, seq.block_table, k_pool, v_pool);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int slot = 0; slot < kRowsPerWarp; ++slot) {
    const int r = warp + kWarps * slot;
    if (r >= nrows) break;
    const float inv = st.l[slot] > 0.0f ? 1.0f / st.l[slot] : 0.0f;
    float* o = out + (static_cast<int64_t>(q_row[r]) * sh.num_heads + q_head[r]) * D;
#pragma unroll
    for (int k = 0; k < D / 32; ++k) o[lane + 32 * k] = st.acc[slot][k] * inv;
  }
}

// Partials: [seq][head][split] x (m, l, acc[D]).
template <int D>
__global__ void __launch_bounds__(kWarps * 32)
decode_split_kernel(AttnShape sh, const AttnSeq* seqs, int num_splits, const float* q,
                    const void* k_pool, const void* v_pool, float* partials) {
  __shared__ Smem<D> s;
  __shared__ int32_t q_row[kAttnRowsPerCta], q_head[kAttnRowsPerCta];
  const int split = blockIdx.x, kv_head = blockIdx.y, si = blockIdx.z;
  allow_dependent_launch();
  grid_dependency_wait();
  const AttnSeq seq = seqs[si];
  const int group = sh.num_heads / sh.num_kv_heads;  // <= kAttnRowsPerCta (checked on launch)
  const int ctx = seq.context_len;
  const int chunk = ((ctx + num_splits - 1) / num_splits + kTile - 1) / kTile * kTile;
  const int key_begin = min(ctx, split * chunk), key_end = min(ctx, key_begin + chunk);
  if (threadIdx.x < group) {
    q_row[threadIdx.x] = seq.query_start;
    q_head[threadIdx.x] = kv_head * group + threadIdx.x;
    s.qpos[threadIdx.x] = ctx - 1;
  }
  __syncthreads();
  RowState<D> st;
  init_state<D>(st);
  if (key_begin < key_end) {
    load_queries<D>(s, q, sh.num_heads, q_row, q_head, group, sh.kv_f16);
    attend<D>(s, st, group, key_begin, key_end, sh, kv_head, seq.block_table, k_pool, v_pool);
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int slot = 0; slot < kRowsPerWarp; ++slot) {
    const int r = warp + kWarps * slot;
    if (r >= group) break;
    float* p = partials + ((static_cast<int64_t>(si) * sh.num_heads + q_head[r]) * num_splits + split) * (D + 2);
    if (lane == 0) { p[0] = st.m[slot]; p[1] = st.l[slot]; }
#pragma unroll
    for (int k = 0; k < D / 32; ++k) p[2 + lane + 32 * k] = st.acc[slot][k];
  }
}

template <int D>
__global__ void decode_combine_kernel(AttnShape sh, const AttnSeq* seqs, int num_splits,
                                      const float* partials, float* out) {
  const int head = blockIdx.x, si = blockIdx.y, d = threadIdx.x;
  allow_dependent_launch();
  grid_dependency_wait();
  const float* p = partials + (static_cast<int64_t>(si) * sh.num_heads + head) * num_splits * (D + 2);
  float m = -INFINITY;
  for (int k = 0; k < num_splits; ++k) m = fmaxf(m, p[k * (D + 2)]);
  float l = 0.0f, acc = 0.0f;
  if (m != -INFINITY) {
    for (int k = 0; k < num_splits; ++k) {
      const float mk = p[k * (D + 2)];
      if (mk == -INFINITY) continue;
      const float c = expf(mk - m);
      l += p[k * (D + 2) + 1] * c;
      acc += p[k * (D + 2) + 2 + d] * c;
    }
  }
  out[(static_cast<int64_t>(seqs[si].query_start) * sh.num_heads + head) * D + d] = l > 0.0f ? acc / l : 0.0f;
}

void check_shape(const AttnShape& sh) {
  if (!attention_supported(sh.head_dim))
    throw std::runtime_error("cuda-flash: head_dim " + std::to_string(sh.head_dim) +
                             " is not supported (64 or 128)");
  if (sh.num_kv_heads <= 0 || sh.num_heads % sh.num_kv_heads != 0)
    throw std::runtime_error("cuda-flash: num_heads must be a multiple of num_kv_heads");
}

}  // namespace

bool attention_supported(int32_t head_dim) { return head_dim == 64 || head_dim == 128; }

int32_t count_prefill_work(const AttnShape& sh, const AttnSeq* seqs, int32_t num_seqs) {
  const int group = sh.num_heads / sh.num_kv_heads;
  const int gc = std::min(group, kAttnRowsPerCta);
  const int per = kAttnRowsPerCta / gc;  // query positions per item
  const int chunks = (group + gc - 1) / gc;
  int32_t n = 0;
  for (int32_t i = 0; i < num_seqs; ++i)
    n += sh.num_kv_heads * chunks * ((seqs[i].num_queries + per - 1) / per);
  return n;
}

void plan_prefill(const AttnShape& sh, const AttnSeq* seqs, int32_t num_seqs, AttnWork* work) {
  const int group = sh.num_heads / sh.num_kv_heads;
  const int gc = std::min(group, kAttnRowsPerCta);
  const int per = kAttnRowsPerCta / gc;
  int32_t n = 0;
  // Longest (latest, most keys) query runs first so the tail of a causal prefill overlaps.
  for (int32_t i = 0; i < num_seqs; ++i)
    for (int32_t q0 = ((seqs[i].num_queries + per - 1) / per - 1) * per; q0 >= 0; q0 -= per)
      for (int kvh = 0; kvh < sh.num_kv_heads; ++kvh)
        for (int h0 = 0; h0 < group; h0 += gc)
          work[n++] = AttnWork{i, q0, std::min(per, seqs[i].num_queries - q0), kvh * group + h0,
                               std::min(gc, group - h0)};
}

void attention_prefill(const AttnShape& sh, const AttnSeq* seqs, const AttnWork* work,
                       int32_t num_work, const float* q, const void* k_pool, const void* v_pool,
                       float* out, cudaStream_t stream) {
  check_shape(sh);
  if (num_work <= 0) return;
  if (sh.head_dim == 64)
    prefill_kernel<64><<<num_work, kWarps * 32, 0, stream>>>(sh, seqs, work, q, k_pool, v_pool, out);
  else
    prefill_kernel<128><<<num_work, kWarps * 32, 0, stream>>>(sh, seqs, work, q, k_pool, v_pool, out);
  check_launch("attention_prefill");
}

size_t decode_scratch_bytes(const AttnShape& sh, int32_t num_seqs, int32_t num_splits) {
  return sizeof(float) * static_cast<size_t>(num_seqs) * sh.num_heads * num_splits * (sh.head_dim + 2);
}

int32_t choose_decode_splits(const AttnShape& sh, int32_t num_seqs, int32_t max_context, int32_t num_sms) {
  const int64_t ctas = static_cast<int64_t>(std::max(1, num_seqs)) * sh.num_kv_heads;
  // Enough CTAs for two per SM, down to one KV tile per split: at small batches a decode step
  // is latency-bound, and each extra tile a CTA walks costs more than an empty split (an
  // H200 batch-1 step: 2 splits over a 160-token context cost 0.76 ms more than 16).
  int64_t splits = (2 * static_cast<int64_t>(num_sms) + ctas - 1) / ctas;
  splits = std::min<int64_t>(splits, std::max(1, (max_context + kTile - 1) / kTile));
  return static_cast<int32_t>(std::clamp<int64_t>(splits, 1, 64));
}

void attention_decode(const AttnShape& sh, const AttnSeq* seqs, int32_t num_seqs, int32_t num_splits,
                      const float* q, const void* k_pool, const void* v_pool, float* out, void* scratch,
                      cudaStream_t stream) {
  check_shape(sh);
  if (sh.num_heads / sh.num_kv_heads > kAttnRowsPerCta)
    throw std::runtime_error("cuda-flash decode: more than 16 query heads per KV head");
  if (num_seqs <= 0) return;
  const dim3 grid(num_splits, sh.num_kv_heads, num_seqs);
  const dim3 cgrid(sh.num_heads, num_seqs);
  float* partials = static_cast<float*>(scratch);
  if (sh.head_dim == 64) {
    launch(decode_split_kernel<64>, grid, dim3(kWarps * 32), stream, sh, seqs, num_splits, q, k_pool, v_pool, partials);
    launch(decode_combine_kernel<64>, cgrid, dim3(64), stream, sh, seqs, num_splits, partials, out);
  } else {
    launch(decode_split_kernel<128>, grid, dim3(kWarps * 32), stream, sh, seqs, num_splits, q, k_pool, v_pool,
           partials);
    launch(decode_combine_kernel<128>, cgrid, dim3(128), stream, sh, seqs, num_splits, partials, out);
  }
  check_launch("attention_decode");
}

}  // namespace tessera::cuda
