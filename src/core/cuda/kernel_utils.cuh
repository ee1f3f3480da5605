// Device helpers and launch helpers shared by the CUDA backends (src/ops/*/cuda.cu). Include from .cu files
// only: everything here is __device__ __forceinline__, a template or an inline host function, so each .cu gets
// the same code it would have with a private copy (the kernels' numerics and launch shapes do not depend on
// where these live).
//
//   host:    aligned / aligned16, grid_1d, grid_cols_rows, Slots / make_slots, next_pow2
//   device:  bf16x8 <-> fp32 (unpack8, pack2, pack8, load_bf<V>, store_bf<V>), fp32x8 access (load_f8, ldg_f8,
//            store_f8), sigmoid_fast, fused FP8 amax (amax_bits, amax_bits8, amax_commit), row_sum<LANES> (warp-slice or block sum in a fixed order)
//   kernels: sum_partials_kernel + launch_sum_partials (fixed-order sum of per-slot partial rows)
//   row-norm family (rmsnorm, gated_rmsnorm, l2norm): RowGeo<LANES>, row_slots, row_load_sumsq, row_acc_zero /
//            _add / _reduce (backward dw accumulators), RowPlan / row_plan, row_dispatch, row_scalar_threads
#pragma once
#include <cstdint>

#include "core/cuda/cuda_utils.h"

namespace ds::cuda {

// ---------------------------------------------------------------------------------------------------------
// Host: alignment, grids, slots.

// p is a multiple of `bytes` (a power of two).
inline bool aligned(const void* p, unsigned bytes) { return (reinterpret_cast<uintptr_t>(p) & (bytes - 1)) == 0; }
inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// Blocks of a 1-D grid-stride loop over `work` items: ceil(work / threads), at least 1, at most max_blocks.
inline unsigned grid_1d(int64_t work, int threads, int64_t max_blocks) {
  int64_t b = (work + threads - 1) / threads;
  if (b < 1) b = 1;
  return static_cast<unsigned>(b < max_blocks ? b : max_blocks);
}

// 2-D grid: x over the cols / V vectors of a row in blocks of `threads`, y over rows (capped at 65535; kernels
// loop over rows beyond).
inline dim3 grid_cols_rows(int64_t cols, int V, int threads, int64_t rows) {
  const int64_t x = (cols / V + threads - 1) / threads;
  const int64_t y = rows < 65535 ? rows : 65535;
  return dim3(static_cast<unsigned>(x), static_cast<unsigned>(y));
}

// Fixed split of n items (rows, tokens) into `count` slots of `per` consecutive items: about
// ceil(n / min_per_slot) slots, at most max_slots. A function of n only, so reductions over slots have a fixed
// order for a given n.
struct Slots {
  int64_t per = 0, count = 0;
};
inline Slots make_slots(int64_t n, int64_t max_slots, int64_t min_per_slot = 1) {
  Slots s;
  if (n <= 0) return s;
  int64_t want = (n + min_per_slot - 1) / min_per_slot;
  if (want > max_slots) want = max_slots;
  s.per = (n + want - 1) / want;
  s.count = (n + s.per - 1) / s.per;
  return s;
}

inline int next_pow2(int v) {
  int p = 1;
  while (p < v) p <<= 1;
  return p;
}

// ---------------------------------------------------------------------------------------------------------
// Device: an FP8 cast's amax fused into the kernel that produces the tensor (--precision fp8; ops/linear/fp8.h).
// The amax is taken over the bf16 values the kernel stores, as |v| in ordered bits: for non-negative floats
// (NaN with its sign cleared included) the uint order is the float order and NaN's bits exceed +inf's, so the max
// of the bits is the amax with NaN winning: bit for bit what ops::cuda::fp8_amax computes over the stored tensor.

// max |v| bits of one bf16 / of eight packed bf16 (a 16-byte vector).
__device__ __forceinline__ unsigned amax_bits(bf16 v) { return (unsigned(__bfloat16_as_ushort(v)) & 0x7fffu) << 16; }
__device__ __forceinline__ unsigned amax_bits8(const uint4& u) {
  const unsigned w[4] = {u.x, u.y, u.z, u.w};
  unsigned m = 0;
#pragma unroll
  for (int k = 0; k < 4; ++k) m = max(m, max((w[k] << 16) & 0x7fff0000u, w[k] & 0x7fff0000u));
  return m;
}
// max |.| bits of V floats as they are stored in bf16 (rounded to nearest even, as store_bf / pack8 round them).
template <int V>
__device__ __forceinline__ unsigned amax_bits_of(const float f[V]) {
  unsigned m = 0;
#pragma unroll
  for (int k = 0; k < V; ++k) m = max(m, amax_bits(__float2bfloat16_rn(f[k])));
  return m;
}
// Folds a thread's max bits into *amax (a device float zeroed before the kernel; null: nothing): the converged
// lanes of the warp reduce, and the leader does an atomicMax only when its value exceeds what *amax already holds.
// Every warp of a kernel hits the same address: unconditional atomics serialise there (an H200 step with one per
// warp ran 17 ms slower at 2B). The value only grows, so a warp whose max is not above a (possibly stale) read of it
// cannot change the result. Max is exact and order-free, so the result is deterministic. 1-D blocks only (the lane
// is threadIdx.x % 32).
__device__ __forceinline__ void amax_commit(unsigned m, float* amax) {
  if (!amax) return;
  const unsigned mask = __activemask();
  m = __reduce_max_sync(mask, m);
  if ((threadIdx.x & 31u) == static_cast<unsigned>(__ffs(mask) - 1)) {
    unsigned* a = reinterpret_cast<unsigned*>(amax);
    if (m > __ldcg(a)) atomicMax(a, m);
  }
}

// ---------------------------------------------------------------------------------------------------------
// Device: bf16 packing (bit-level; RNE rounding through __float2bfloat16_rn).

// Eight packed bf16 (one 16-byte vector) -> eight floats.
__device__ __forceinline__ void unpack8(const uint4& u, float f[8]) {
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(w[i] << 16);
    f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}
__device__ __forceinline__ uint32_t pack2(float a, float b) {
  return static_cast<uint32_t>(__bfloat16_as_ushort(__float2bfloat16_rn(a))) |
         (static_cast<uint32_t>(__bfloat16_as_ushort(__float2bfloat16_rn(b))) << 16);
}
__device__ __forceinline__ uint4 pack8(const float f[8]) {
  return make_uint4(pack2(f[0], f[1]), pack2(f[2], f[3]), pack2(f[4], f[5]), pack2(f[6], f[7]));
}

// V bf16 values at p -> V floats (V = 8: one 16-byte load; V = 1: scalar).
template <int V>
__device__ __forceinline__ void load_bf(const bf16* p, float f[V]) {
  static_assert(V == 8 || V == 1);
  if constexpr (V == 8) {
    const uint4 u = *reinterpret_cast<const uint4*>(p);  // one 16-byte load into registers, then unpack
    unpack8(u, f);
  } else {
    f[0] = __bfloat162float(*p);
  }
}
// V floats -> V bf16 values at p (V = 8: one 16-byte store, 4: one 8-byte store, 1: scalar).
template <int V>
__device__ __forceinline__ void store_bf(bf16* p, const float f[V]) {
  static_assert(V == 8 || V == 4 || V == 1);
  if constexpr (V == 8)
    *reinterpret_cast<uint4*>(p) = pack8(f);
  else if constexpr (V == 4)
    *reinterpret_cast<uint2*>(p) = make_uint2(pack2(f[0], f[1]), pack2(f[2], f[3]));
  else
    *p = __float2bfloat16_rn(f[0]);
}

// Floats 8c .. 8c+7 of p (16-byte aligned; c: any integer type) as two 16-byte accesses: plain loads (any memory
// space), loads through the read-only cache, stores.
template <typename I>
__device__ __forceinline__ void load_f8(const float* p, I c, float f[8]) {
  const float4 a = reinterpret_cast<const float4*>(p)[2 * c];
  const float4 b = reinterpret_cast<const float4*>(p)[2 * c + 1];
  f[0] = a.x, f[1] = a.y, f[2] = a.z, f[3] = a.w, f[4] = b.x, f[5] = b.y, f[6] = b.z, f[7] = b.w;
}
template <typename I>
__device__ __forceinline__ void ldg_f8(const float* p, I c, float f[8]) {
  const float4 a = __ldg(reinterpret_cast<const float4*>(p) + 2 * c);
  const float4 b = __ldg(reinterpret_cast<const float4*>(p) + 2 * c + 1);
  f[0] = a.x, f[1] = a.y, f[2] = a.z, f[3] = a.w, f[4] = b.x, f[5] = b.y, f[6] = b.z, f[7] = b.w;
}
template <typename I>
__device__ __forceinline__ void store_f8(float* p, I c, const float f[8]) {
  reinterpret_cast<float4*>(p)[2 * c] = make_float4(f[0], f[1], f[2], f[3]);
  reinterpret_cast<float4*>(p)[2 * c + 1] = make_float4(f[4], f[5], f[6], f[7]);
}

// sigmoid through the fast exponential (__expf), as the SiLU / gate kernels use it.
__device__ __forceinline__ float sigmoid_fast(float v) { return 1.0f / (1.0f + __expf(-v)); }

// sigmoid_fast of V values, bitwise what V calls of it give, in fewer instructions. nvcc compiles the IEEE division
// 1.0f / d as a fast path (MUFU.RCP r, then r + r (1 - d r) by two FMAs: correctly rounded) where d's exponent
// field is 1 .. 252, and a call of its full division elsewhere, with a branch and a reconvergence barrier around
// every division (which also keeps the scheduler from overlapping one value's arithmetic with the next). Here
// d = 1 + e^-v is in [1, 2^126) unless v < -87.3 or v is NaN: the fast path for all V values, then one branch,
// rarely taken, that redoes the others by the division itself.
template <int V>
__device__ __forceinline__ void sigmoid_fast_v(const float (&v)[V], float (&s)[V]) {
  float d[V];
  bool slow = false;
#pragma unroll
  for (int k = 0; k < V; ++k) {
    d[k] = 1.0f + __expf(-v[k]);
    float r;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(d[k]));
    s[k] = __fmaf_rn(r, -__fmaf_rn(d[k], r, -1.0f), r);
    slow |= !(d[k] < 0x1p126f);
  }
  if (slow) {
#pragma unroll
    for (int k = 0; k < V; ++k)
      if (!(d[k] < 0x1p126f)) s[k] = 1.0f / d[k];
  }
}

// ---------------------------------------------------------------------------------------------------------
// Device: reductions.

// Sum over the threads that share a row: LANES (power of two <= 32) lanes of a warp through shuffles (every
// lane of the warp must call it), or the whole block when LANES == 0 (red: >= 32 floats of shared memory;
// every thread gets the same, fixed-order result).
template <int LANES>
__device__ __forceinline__ float row_sum(float v, float* red) {
  if constexpr (LANES > 0) {
#pragma unroll
    for (int o = LANES / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
  } else {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    const int warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    if ((threadIdx.x & 31) == 0) red[warp] = v;
    __syncthreads();
    float s = 0.f;
    for (int i = 0; i < nw; ++i) s += red[i];
    __syncthreads();  // red is reused by the next call
    return s;
  }
}

// out[c] += sum_{p < P} part[p*ld + c], p in a fixed order: SUB strided sub-sums per column, then in order.
// Block (32, SUB), grid ceil(ncols / 32): use launch_sum_partials.
template <int SUB = 8>
__global__ void sum_partials_kernel(const float* __restrict__ part, int64_t P, int64_t ld, int64_t ncols,
                                    float* __restrict__ out) {
  __shared__ float sm[SUB][33];
  const int64_t col = static_cast<int64_t>(blockIdx.x) * 32 + threadIdx.x;
  float s = 0.f;
  if (col < ncols)
    for (int64_t p = threadIdx.y; p < P; p += SUB) s += part[p * ld + col];
  sm[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && col < ncols) {
    float t = 0.f;
#pragma unroll
    for (int q = 0; q < SUB; ++q) t += sm[q][threadIdx.x];
    out[col] += t;
  }
}
// Launches sum_partials_kernel<SUB> (the caller checks the launch). A template, so that only the .cu files that
// launch it compile the kernel.
template <int SUB = 8>
void launch_sum_partials(const float* part, int64_t P, int64_t ld, int64_t ncols, float* out, cudaStream_t stream) {
  sum_partials_kernel<SUB>
      <<<static_cast<unsigned>((ncols + 31) / 32), dim3(32, SUB), 0, stream>>>(part, P, ld, ncols, out);
}

// ---------------------------------------------------------------------------------------------------------
// Row-norm kernel family (rmsnorm, gated_rmsnorm, l2norm): a row of dim bf16 values is nvec = dim / 8
// sixteen-byte vectors, held in registers, VPT per thread.
//   group kernels (LANES = 1..32): LANES threads per row, kRowGroupBlock / LANES rows per block;
//   block kernels (LANES = 0): one row per block of blockDim threads (<= kRowMaxThreads);
//   scalar kernels (any dim / alignment): one row per block of row_scalar_threads(dim) threads.

constexpr int kRowGroupBlock = 256;    // threads per block for the LANES <= 32 kernels
constexpr int kRowMaxThreads = 512;    // block-per-row kernels: <= 512 threads so 128 registers stay available
constexpr int64_t kRowMaxSlots = 512;  // backward: at most this many row slots (partial dw rows)

// Backward row slots: min(rows, kRowMaxSlots) slots of consecutive rows (a function of rows only).
inline Slots row_slots(int64_t rows) { return make_slots(rows, kRowMaxSlots); }

// Row/lane geometry: LANES > 0: several rows per block; LANES == 0: one row per block (blockDim threads).
template <int LANES>
struct RowGeo {
  int group, lane, stride, groups;
  __device__ RowGeo() {
    if constexpr (LANES > 0) {
      group = threadIdx.x / LANES;
      lane = threadIdx.x % LANES;
      stride = LANES;
      groups = blockDim.x / LANES;
    } else {
      group = 0;
      lane = threadIdx.x;
      stride = blockDim.x;
      groups = 1;
    }
  }
};

// This thread's VPT vectors of row xr (zero where c >= nvec or !valid) into xv; returns their sum of squares
// (fp32; vectors, then elements, in order).
template <int VPT, int LANES>
__device__ __forceinline__ float row_load_sumsq(const uint4* xr, bool valid, int nvec, const RowGeo<LANES>& g,
                                                uint4 (&xv)[VPT]) {
  float ss = 0.f;
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int c = g.lane + i * g.stride;
    xv[i] = (valid && c < nvec) ? xr[c] : make_uint4(0, 0, 0, 0);
    float f[8];
    unpack8(xv[i], f);
#pragma unroll
    for (int k = 0; k < 8; ++k) ss += f[k] * f[k];
  }
  return ss;
}

// Backward dw accumulators in shared memory: acc is this row group's [dim] fp32 row; each thread owns the floats
// of its vectors c = lane + i * stride, so no two threads touch the same element.
template <int VPT, int LANES>
__device__ __forceinline__ void row_acc_zero(float* acc, int nvec, const RowGeo<LANES>& g) {
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int c = g.lane + i * g.stride;
    if (c < nvec) {
      reinterpret_cast<float4*>(acc)[2 * c] = make_float4(0.f, 0.f, 0.f, 0.f);
      reinterpret_cast<float4*>(acc)[2 * c + 1] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
  }
}
// acc[8c .. 8c+7] += f.
__device__ __forceinline__ void row_acc_add(float* acc, int c, const float f[8]) {
  float4* a = reinterpret_cast<float4*>(acc) + 2 * c;
  float4 a0 = a[0], a1 = a[1];
  a0.x += f[0], a0.y += f[1], a0.z += f[2], a0.w += f[3];
  a1.x += f[4], a1.y += f[5], a1.z += f[6], a1.w += f[7];
  a[0] = a0, a[1] = a1;
}
// prow[j] = sum over the row groups q = 0, 1, .. of acc_q[j] = gsum[q * dim + j], in that order (after a
// __syncthreads: every thread reads every group's accumulators).
__device__ __forceinline__ void row_acc_reduce(const float* gsum, int groups, int dim, float* prow) {
  for (int j = threadIdx.x; j < dim; j += blockDim.x) {
    float s = 0.f;
    for (int q = 0; q < groups; ++q) s += gsum[q * dim + j];
    prow[j] = s;
  }
}

// Launch plan for the vector kernels. kind: 0 = scalar fallback, 1 = group (LANES <= 32), 2 = block per row.
struct RowPlan {
  int kind = 0, lanes = 0, vpt = 0, threads = 0;
};
// nvec <= 32: group kernel, LANES = next_pow2(nvec); nvec <= 128 and warp_rows: one warp per row,
// VPT = ceil(nvec / 32); nvec <= max_vpt * kRowMaxThreads: block per row, VPT = ceil(nvec / 256) capped at
// max_vpt, threads = ceil(nvec / VPT) rounded up to a warp; otherwise (or !vec_ok, dim % 8 != 0): scalar.
inline RowPlan row_plan(int64_t dim, bool vec_ok, bool warp_rows, int max_vpt) {
  RowPlan p;
  if (!vec_ok || dim % 8 != 0) return p;
  const int64_t nvec = dim / 8;
  if (nvec <= 32) {
    p.kind = 1, p.lanes = next_pow2(static_cast<int>(nvec)), p.vpt = 1, p.threads = kRowGroupBlock;
  } else if (nvec <= 128 && warp_rows) {
    p.kind = 1, p.lanes = 32, p.vpt = static_cast<int>((nvec + 31) / 32), p.threads = kRowGroupBlock;
  } else if (nvec <= max_vpt * kRowMaxThreads) {
    int vpt = static_cast<int>((nvec + 255) / 256);
    if (vpt > max_vpt) vpt = max_vpt;
    const int64_t t = (nvec + vpt - 1) / vpt;
    p.kind = 2, p.vpt = vpt, p.threads = static_cast<int>((t + 31) / 32 * 32);
  }
  return p;
}

// Calls F<VPT, LANES>::run(p, args...) for the template instance of a (non-scalar) plan.
template <template <int, int> class F, typename... Args>
void row_dispatch(const RowPlan& p, Args&&... args) {
  if (p.kind == 2) {
    switch (p.vpt) {
      case 1:
        F<1, 0>::run(p, args...);
        return;
      case 2:
        F<2, 0>::run(p, args...);
        return;
      case 3:
        F<3, 0>::run(p, args...);
        return;
      default:
        F<4, 0>::run(p, args...);
        return;
    }
  }
  if (p.lanes < 32) {
    switch (p.lanes) {
      case 1:
        F<1, 1>::run(p, args...);
        return;
      case 2:
        F<1, 2>::run(p, args...);
        return;
      case 4:
        F<1, 4>::run(p, args...);
        return;
      case 8:
        F<1, 8>::run(p, args...);
        return;
      default:
        F<1, 16>::run(p, args...);
        return;
    }
  }
  switch (p.vpt) {
    case 1:
      F<1, 32>::run(p, args...);
      return;
    case 2:
      F<2, 32>::run(p, args...);
      return;
    case 3:
      F<3, 32>::run(p, args...);
      return;
    default:
      F<4, 32>::run(p, args...);
      return;
  }
}

// Threads of the scalar row kernels: dim rounded up to a warp, at most 256.
inline int row_scalar_threads(int64_t dim) {
  const int64_t t = (dim + 31) / 32 * 32;
  return static_cast<int>(t < 256 ? t : 256);
}

}  // namespace ds::cuda
