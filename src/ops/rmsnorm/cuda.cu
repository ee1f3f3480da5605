// CUDA RMSNorm forward/backward (see cuda.h; math of rmsnorm.h / cpu.cpp).
//
// Kernel shapes, chosen on the host from dim (nvec = dim / 8 sixteen-byte vectors per row):
//   nvec <= 32          "group" kernels: LANES = next_pow2(nvec) threads per row, 256/LANES rows per block,
//                       one 16-byte vector per thread (q/k norm head_dim 32..256, small hidden sizes);
//   nvec <= 128         forward only: one warp per row, VPT = 2..4 vectors per thread (dim 264..1024);
//   nvec <= 2048        one block per row, VPT = ceil(nvec/256) capped at 4, blockDim = ceil(nvec/VPT)
//                       rounded up to a warp multiple, <= 512 (dim 1032..16384; 2048 -> 256x1, 4096 -> 256x2,
//                       5120 -> 224x3, 8192 -> 256x4);
//   otherwise, or when dim % 8 != 0 or a pointer is not 16-byte aligned: a scalar block-per-row kernel that
//   re-reads the row from global memory (L1/L2) instead of keeping it in registers.
// The whole row lives in registers as packed bf16 (uint4); math is fp32; each output is rounded once.
//
// Backward: one warp-group kernel (nvec <= 32) or block-per-row kernel (otherwise) over a fixed grid of
// "slots" (row ranges, at most kMaxSlots, a function of rows only). Each block loops over its rows, keeps the
// row's x and dy in registers, gamma in shared memory and its dw accumulators in shared memory (fp32, each
// thread owns fixed columns, so no races), sums its row groups in a fixed order and writes one partial row
// [slot, dim] to scratch; a second kernel sums the partials over slots in a fixed order and ADDS into dw.
// No atomics: results are bitwise reproducible for a given (rows, dim). dx may alias dy.
#include <cstdint>

#include "core/cuda/kernel_utils.cuh"
#include "ops/rmsnorm/cuda.h"

namespace ds::ops::cuda {
namespace {

using namespace ds::cuda;

template <int VPT, int LANES>
__global__ void __launch_bounds__(LANES > 0 ? kRowGroupBlock : kRowMaxThreads)
    rms_fwd_vec(const bf16* __restrict__ x, const float* __restrict__ w, bf16* __restrict__ y, float* __restrict__ rstd,
                int64_t rows, int dim, float eps, bool zc, float* __restrict__ amax) {
  __shared__ float red[32];
  const RowGeo<LANES> g;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * g.groups + g.group;
  const bool valid = row < rows;
  const int nvec = dim >> 3;
  const uint4* xr = reinterpret_cast<const uint4*>(x + (valid ? row : 0) * dim);
  uint4 xv[VPT];
  const float ss = row_sum<LANES>(row_load_sumsq(xr, valid, nvec, g, xv), red);
  const float rs = 1.0f / sqrtf(ss / static_cast<float>(dim) + eps);
  if (!valid) return;
  if (g.lane == 0) rstd[row] = rs;
  uint4* yr = reinterpret_cast<uint4*>(y + row * dim);
  unsigned m = 0;
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int c = g.lane + i * g.stride;
    if (c < nvec) {
      float f[8], wv[8];
      unpack8(xv[i], f);
      ldg_f8(w, c, wv);
#pragma unroll
      for (int k = 0; k < 8; ++k) f[k] = f[k] * rs * (zc ? 1.0f + wv[k] : wv[k]);
      const uint4 o = pack8(f);
      yr[c] = o;
      m = max(m, amax_bits8(o));
    }
  }
  amax_commit(m, amax);
}

// dx may alias dy and dres: each thread reads its dy and dres values before writing the same dx values; no one else
// reads them. dres (null: none) is added to dx; amax (null: none) receives max |dx| (kernel_utils.cuh amax_commit).
template <int VPT, int LANES>
__global__ void __launch_bounds__(LANES > 0 ? kRowGroupBlock : kRowMaxThreads)
    rms_bwd_vec(const bf16* __restrict__ x, const float* __restrict__ w, const float* __restrict__ rstd, const bf16* dy,
                bf16* dx, float* __restrict__ partial, int64_t rows, int dim, bool zc, int64_t rows_per_slot,
                const bf16* dres, float* __restrict__ amax) {
  __shared__ float red[32];
  extern __shared__ float4 gsum4[];  // [groups, dim] fp32 dw accumulators, reduced over groups at the end
  float* gsum = reinterpret_cast<float*>(gsum4);
  const RowGeo<LANES> g;
  const int nvec = dim >> 3;
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * rows_per_slot;
  const int64_t r1 = r0 + rows_per_slot < rows ? r0 + rows_per_slot : rows;
  float* acc = gsum + g.group * dim;   // this group's dw accumulator row (each thread owns its columns)
  float* gam = gsum + g.groups * dim;  // gamma = (1 +) w, shared by the groups
  for (int j = threadIdx.x; j < dim; j += blockDim.x) gam[j] = zc ? 1.0f + w[j] : w[j];
  row_acc_zero<VPT>(acc, nvec, g);
  __syncthreads();
  const float inv_dim = 1.0f / static_cast<float>(dim);
  const int64_t iters = (r1 - r0 + g.groups - 1) / g.groups;  // uniform over the block
  unsigned m = 0;
  // A row's x, dy and dres (and rstd) are loaded one iteration ahead, so their DRAM latency overlaps the row before
  // (its reduction's barriers and its stores): the values, and the arithmetic on them, are the same.
  uint4 xv[VPT], dv[VPT], rv[VPT];
  float rs_next = 0.f;
  auto load_row = [&](int64_t it) {
    const int64_t row = r0 + it * g.groups + g.group;
    const bool valid = it < iters && row < r1;
    const int64_t rr = valid ? row : r0;
    const uint4* xr = reinterpret_cast<const uint4*>(x + rr * dim);
    const uint4* dyr = reinterpret_cast<const uint4*>(dy + rr * dim);
    const uint4* rr4 = dres ? reinterpret_cast<const uint4*>(dres + rr * dim) : nullptr;
    rs_next = valid ? rstd[rr] : 0.f;
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      const int c = g.lane + i * g.stride;
      const bool in = valid && c < nvec;
      xv[i] = in ? xr[c] : make_uint4(0, 0, 0, 0);
      dv[i] = in ? dyr[c] : make_uint4(0, 0, 0, 0);
      rv[i] = in && rr4 ? rr4[c] : make_uint4(0, 0, 0, 0);
    }
  };
  if (iters > 0) load_row(0);
  for (int64_t it = 0; it < iters; ++it) {
    const int64_t row = r0 + it * g.groups + g.group;
    const bool valid = row < r1;
    const int64_t rr = valid ? row : r0;
    const float rs = rs_next;
    uint4 xc[VPT], dc[VPT], rc[VPT];
#pragma unroll
    for (int i = 0; i < VPT; ++i) xc[i] = xv[i], dc[i] = dv[i], rc[i] = rv[i];
    if (it + 1 < iters) load_row(it + 1);
    float dot = 0.f;
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      const int c = g.lane + i * g.stride;
      float xf[8], df[8], gm[8];
      unpack8(xc[i], xf);
      unpack8(dc[i], df);
      load_f8(gam, c < nvec ? c : 0, gm);
#pragma unroll
      for (int k = 0; k < 8; ++k) dot += (df[k] * gm[k]) * (xf[k] * rs);
    }
    dot = row_sum<LANES>(dot, red);
    const float mean_dot = dot * inv_dim;
    uint4* dxr = reinterpret_cast<uint4*>(dx + rr * dim);
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      const int c = g.lane + i * g.stride;
      float xf[8], df[8], gm[8], o[8];
      unpack8(xc[i], xf);
      unpack8(dc[i], df);
      load_f8(gam, c < nvec ? c : 0, gm);
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const float xh = xf[k] * rs;
        xf[k] = df[k] * xh;  // dw contribution
        o[k] = rs * (df[k] * gm[k] - xh * mean_dot);
      }
      if (valid && c < nvec) {
        row_acc_add(acc, c, xf);
        if (dres) {
          float rf[8];
          unpack8(rc[i], rf);
#pragma unroll
          for (int k = 0; k < 8; ++k) o[k] += rf[k];
        }
        const uint4 ov = pack8(o);
        dxr[c] = ov;
        m = max(m, amax_bits8(ov));
      }
    }
  }
  amax_commit(m, amax);
  float* prow = partial + static_cast<int64_t>(blockIdx.x) * dim;
  __syncthreads();
  row_acc_reduce(gsum, g.groups, dim, prow);  // the groups' accumulators in a fixed order (one when LANES == 0)
}

// ---- scalar fallback (any dim, any alignment) ----
__global__ void rms_fwd_scalar(const bf16* __restrict__ x, const float* __restrict__ w, bf16* __restrict__ y,
                               float* __restrict__ rstd, int64_t rows, int64_t dim, float eps, bool zc,
                               float* __restrict__ amax) {
  __shared__ float red[32];
  const int64_t row = blockIdx.x;
  const bf16* xr = x + row * dim;
  float ss = 0.f;
  for (int64_t j = threadIdx.x; j < dim; j += blockDim.x) {
    const float v = __bfloat162float(xr[j]);
    ss += v * v;
  }
  ss = row_sum<0>(ss, red);
  const float rs = 1.0f / sqrtf(ss / static_cast<float>(dim) + eps);
  if (threadIdx.x == 0) rstd[row] = rs;
  bf16* yr = y + row * dim;
  unsigned m = 0;
  for (int64_t j = threadIdx.x; j < dim; j += blockDim.x) {
    const bf16 o = __float2bfloat16_rn(__bfloat162float(xr[j]) * rs * (zc ? 1.0f + w[j] : w[j]));
    yr[j] = o;
    m = max(m, amax_bits(o));
  }
  amax_commit(m, amax);
}

// Partial row kept in global memory (each thread owns columns j = tid + k*blockDim, rows in order).
__global__ void rms_bwd_scalar(const bf16* __restrict__ x, const float* __restrict__ w, const float* __restrict__ rstd,
                               const bf16* dy, bf16* dx, float* __restrict__ partial, int64_t rows, int64_t dim,
                               bool zc, int64_t rows_per_slot, const bf16* dres, float* __restrict__ amax) {
  __shared__ float red[32];
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * rows_per_slot;
  const int64_t r1 = r0 + rows_per_slot < rows ? r0 + rows_per_slot : rows;
  float* prow = partial + static_cast<int64_t>(blockIdx.x) * dim;
  for (int64_t j = threadIdx.x; j < dim; j += blockDim.x) prow[j] = 0.f;
  const float inv_dim = 1.0f / static_cast<float>(dim);
  unsigned m = 0;
  for (int64_t row = r0; row < r1; ++row) {
    const bf16* xr = x + row * dim;
    const bf16* dyr = dy + row * dim;
    const float rs = rstd[row];
    float dot = 0.f;
    for (int64_t j = threadIdx.x; j < dim; j += blockDim.x) {
      const float gam = zc ? 1.0f + w[j] : w[j];
      dot += (__bfloat162float(dyr[j]) * gam) * (__bfloat162float(xr[j]) * rs);
    }
    const float mean_dot = row_sum<0>(dot, red) * inv_dim;
    bf16* dxr = dx + row * dim;
    for (int64_t j = threadIdx.x; j < dim; j += blockDim.x) {
      const float gam = zc ? 1.0f + w[j] : w[j];
      const float d = __bfloat162float(dyr[j]), xh = __bfloat162float(xr[j]) * rs;
      prow[j] += d * xh;
      const float r = dres ? __bfloat162float(dres[row * dim + j]) : 0.0f;
      const bf16 o = __float2bfloat16_rn(rs * (d * gam - xh * mean_dot) + r);
      dxr[j] = o;
      m = max(m, amax_bits(o));
    }
  }
  amax_commit(m, amax);
}

// Vector kernel plan (core/cuda/kernel_utils.cuh): warp-per-row kernels forward only, up to 4 vectors per thread.
RowPlan plan_for(int64_t dim, bool vec_ok, bool backward) { return row_plan(dim, vec_ok, !backward, 4); }

template <int VPT, int LANES>
void launch_fwd(const RowPlan& p, const bf16* x, const float* w, bf16* y, float* rstd, int64_t rows, int64_t dim,
                float eps, bool zc, float* amax, cudaStream_t stream) {
  const int64_t groups = LANES > 0 ? p.threads / LANES : 1;
  const int64_t blocks = (rows + groups - 1) / groups;
  rms_fwd_vec<VPT, LANES>
      <<<static_cast<unsigned>(blocks), p.threads, 0, stream>>>(x, w, y, rstd, rows, static_cast<int>(dim), eps, zc,
                                                                amax);
}

template <int VPT, int LANES>
void launch_bwd(const RowPlan& p, const bf16* x, const float* w, const float* rstd, const bf16* dy, bf16* dx,
                float* partial, int64_t rows, int64_t dim, bool zc, const Slots& s, const bf16* dres, float* amax,
                cudaStream_t stream) {
  const size_t smem = static_cast<size_t>((LANES > 0 ? p.threads / LANES : 1) + 1) * dim * sizeof(float);
  if (smem > 48 * 1024)
    DS_CUDA_CHECK(cudaFuncSetAttribute(rms_bwd_vec<VPT, LANES>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(smem)));
  rms_bwd_vec<VPT, LANES><<<static_cast<unsigned>(s.count), p.threads, smem, stream>>>(
      x, w, rstd, dy, dx, partial, rows, static_cast<int>(dim), zc, s.per, dres, amax);
}

template <int VPT, int LANES>
struct FwdLauncher {
  template <typename... A>
  static void run(const RowPlan& p, A... a) {
    launch_fwd<VPT, LANES>(p, a...);
  }
};
template <int VPT, int LANES>
struct BwdLauncher {
  template <typename... A>
  static void run(const RowPlan& p, A... a) {
    if constexpr (LANES == 32 && VPT > 1) {
      DS_CUDA_REQUIRE(false, "rmsnorm_backward: internal error (no warp-per-row backward with VPT > 1)");
    } else {
      launch_bwd<VPT, LANES>(p, a...);
    }
  }
};

}  // namespace

void rmsnorm_forward(const ds::cuda::bf16* x, const float* w, ds::cuda::bf16* y, float* rstd, int64_t rows, int64_t dim,
                     float eps, bool zero_centered, cudaStream_t stream, float* amax) {
  DS_CUDA_REQUIRE(rows >= 0 && dim > 0, "rmsnorm_forward: rows must be >= 0 and dim > 0, got rows=" +
                                            std::to_string(rows) + " dim=" + std::to_string(dim));
  DS_CUDA_REQUIRE(dim <= (int64_t(1) << 30), "rmsnorm_forward: dim too large");
  if (rows == 0) return;
  DS_CUDA_REQUIRE(x && w && y && rstd, "rmsnorm_forward: null pointer argument");
  const bool vec_ok = aligned16(x) && aligned16(y) && aligned16(w);
  const RowPlan p = plan_for(dim, vec_ok, false);
  if (p.kind == 0) {
    rms_fwd_scalar<<<static_cast<unsigned>(rows), row_scalar_threads(dim), 0, stream>>>(x, w, y, rstd, rows, dim, eps,
                                                                                        zero_centered, amax);
  } else {
    row_dispatch<FwdLauncher>(p, x, w, y, rstd, rows, dim, eps, zero_centered, amax, stream);
  }
  DS_CUDA_LAUNCH_CHECK();
}

size_t rmsnorm_scratch_bytes(int64_t rows, int64_t dim) {
  if (rows <= 0 || dim <= 0) return 0;
  return static_cast<size_t>(row_slots(rows).count) * static_cast<size_t>(dim) * sizeof(float);
}

void rmsnorm_backward(const ds::cuda::bf16* x, const float* w, const float* rstd, const ds::cuda::bf16* dy,
                      ds::cuda::bf16* dx, float* dw, int64_t rows, int64_t dim, bool zero_centered, void* scratch,
                      cudaStream_t stream, const ds::cuda::bf16* dres, float* amax) {
  DS_CUDA_REQUIRE(rows >= 0 && dim > 0, "rmsnorm_backward: rows must be >= 0 and dim > 0, got rows=" +
                                            std::to_string(rows) + " dim=" + std::to_string(dim));
  DS_CUDA_REQUIRE(dim <= (int64_t(1) << 30), "rmsnorm_backward: dim too large");
  if (rows == 0) return;
  DS_CUDA_REQUIRE(x && w && rstd && dy && dx && dw, "rmsnorm_backward: null pointer argument");
  DS_CUDA_REQUIRE(scratch != nullptr, "rmsnorm_backward: scratch is null (need rmsnorm_scratch_bytes)");
  const Slots s = row_slots(rows);
  float* partial = static_cast<float*>(scratch);
  const bool vec_ok = aligned16(x) && aligned16(w) && aligned16(dy) && aligned16(dx) && (!dres || aligned16(dres));
  const RowPlan p = plan_for(dim, vec_ok, true);
  if (p.kind == 0) {
    rms_bwd_scalar<<<static_cast<unsigned>(s.count), row_scalar_threads(dim), 0, stream>>>(
        x, w, rstd, dy, dx, partial, rows, dim, zero_centered, s.per, dres, amax);
  } else {
    row_dispatch<BwdLauncher>(p, x, w, rstd, dy, dx, partial, rows, dim, zero_centered, s, dres, amax, stream);
  }
  DS_CUDA_LAUNCH_CHECK();
  launch_sum_partials(partial, s.count, dim, dim, dw, stream);
  DS_CUDA_LAUNCH_CHECK();
}

}  // namespace ds::ops::cuda
