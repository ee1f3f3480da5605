// CUDA gated RMSNorm y = x * rsqrt(mean(x^2)+eps) * w * silu(z), forward/backward (see cuda.h; math of
// gated_rmsnorm.h / cpu.cpp: FLA FusedRMSNormGated, all fp32 inside, one rounding per output).
//
// Same kernel family as the RMSNorm kernels (ops/rmsnorm/cuda.cu), chosen from d (nvec = d / 8 vectors):
//   nvec <= 32   LANES = next_pow2(nvec) threads per row, 256/LANES rows per block, one 16-byte vector of x
//                and of z per thread (Qwen3.5 value heads d = 128: 16 lanes, 16 rows per block; d = 16..256);
//   nvec <= 128  forward only: one warp per row, 2..4 vectors per thread;
//   nvec <= 2048 one block per row, up to 4 vectors per thread (backward: nvec <= 1024, up to 2), <= 512 threads;
//   otherwise, or d % 8 != 0 or unaligned pointers: scalar block-per-row kernels re-reading from L1/L2.
// Backward: fixed slots of rows (a function of rows only); each block keeps x, z, dy of its row in registers,
// w in shared memory, dw accumulators in shared memory (each thread owns fixed columns), reduces its row groups
// in a fixed order and writes one partial row [slot, d]; a second kernel sums the slots in a fixed order and
// ADDS into dw. Deterministic, no atomics.
#include <cstdint>

#include "core/cuda/kernel_utils.cuh"
#include "ops/gated_rmsnorm/cuda.h"

namespace ds::ops::cuda {
namespace {

using namespace ds::cuda;

template <int VPT, int LANES>
__global__ void __launch_bounds__(LANES > 0 ? kRowGroupBlock : kRowMaxThreads)
    grms_fwd_vec(const bf16* __restrict__ x, const bf16* __restrict__ z, const float* __restrict__ w,
                 bf16* __restrict__ y, float* __restrict__ rstd, int64_t rows, int dim, float eps,
                 float* __restrict__ amax) {
  __shared__ float red[32];
  const RowGeo<LANES> g;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * g.groups + g.group;
  const bool valid = row < rows;
  const int nvec = dim >> 3;
  const int64_t off = (valid ? row : 0) * dim;
  const uint4* xr = reinterpret_cast<const uint4*>(x + off);
  const uint4* zr = reinterpret_cast<const uint4*>(z + off);
  uint4 xv[VPT], zv[VPT];
  float ss = 0.f;
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int c = g.lane + i * g.stride;
    const bool in = valid && c < nvec;
    xv[i] = in ? xr[c] : make_uint4(0, 0, 0, 0);
    zv[i] = in ? zr[c] : make_uint4(0, 0, 0, 0);
    float f[8];
    unpack8(xv[i], f);
#pragma unroll
    for (int k = 0; k < 8; ++k) ss += f[k] * f[k];
  }
  ss = row_sum<LANES>(ss, red);
  const float rs = 1.0f / sqrtf(ss / static_cast<float>(dim) + eps);
  if (!valid) return;
  if (g.lane == 0) rstd[row] = rs;
  uint4* yr = reinterpret_cast<uint4*>(y + off);
  unsigned m = 0;
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int c = g.lane + i * g.stride;
    if (c < nvec) {
      float f[8], zf[8], wv[8];
      unpack8(xv[i], f);
      unpack8(zv[i], zf);
      ldg_f8(w, c, wv);
#pragma unroll
      for (int k = 0; k < 8; ++k) f[k] = f[k] * rs * wv[k] * (zf[k] * sigmoid_fast(zf[k]));
      const uint4 o = pack8(f);
      yr[c] = o;
      m = max(m, amax_bits8(o));
    }
  }
  amax_commit(m, amax);
}

template <int VPT, int LANES>
__global__ void __launch_bounds__(LANES > 0 ? kRowGroupBlock : kRowMaxThreads)
    grms_bwd_vec(const bf16* __restrict__ x, const bf16* __restrict__ z, const float* __restrict__ w,
                 const float* __restrict__ rstd, const bf16* __restrict__ dy, bf16* __restrict__ dx,
                 bf16* __restrict__ dz, float* __restrict__ partial, int64_t rows, int dim, int64_t rows_per_slot,
                 float* __restrict__ amax) {
  __shared__ float red[32];
  extern __shared__ float4 smem4[];  // [groups, dim] dw accumulators, then [dim] w
  float* gsum = reinterpret_cast<float*>(smem4);
  const RowGeo<LANES> g;
  const int nvec = dim >> 3;
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * rows_per_slot;
  const int64_t r1 = r0 + rows_per_slot < rows ? r0 + rows_per_slot : rows;
  float* acc = gsum + g.group * dim;
  float* ws = gsum + g.groups * dim;
  for (int j = threadIdx.x; j < dim; j += blockDim.x) ws[j] = w[j];
  row_acc_zero<VPT>(acc, nvec, g);
  __syncthreads();
  const float inv_dim = 1.0f / static_cast<float>(dim);
  const int64_t iters = (r1 - r0 + g.groups - 1) / g.groups;  // uniform over the block
  unsigned m = 0;  // max |dz| bits (the FP8 amax of in_proj_z's output gradient)
  for (int64_t it = 0; it < iters; ++it) {
    const int64_t row = r0 + it * g.groups + g.group;
    const bool valid = row < r1;
    const int64_t off = (valid ? row : r0) * dim;
    const uint4* xr = reinterpret_cast<const uint4*>(x + off);
    const uint4* zr = reinterpret_cast<const uint4*>(z + off);
    const uint4* dyr = reinterpret_cast<const uint4*>(dy + off);
    const float rs = valid ? rstd[valid ? row : r0] : 0.f;
    uint4 xv[VPT], zv[VPT], dv[VPT];
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      const int c = g.lane + i * g.stride;
      const bool in = valid && c < nvec;
      xv[i] = in ? xr[c] : make_uint4(0, 0, 0, 0);
      zv[i] = in ? zr[c] : make_uint4(0, 0, 0, 0);
      dv[i] = in ? dyr[c] : make_uint4(0, 0, 0, 0);
    }
    float dot = 0.f;
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      const int c = g.lane + i * g.stride;
      float xf[8], zf[8], df[8], wv[8];
      unpack8(xv[i], xf);
      unpack8(zv[i], zf);
      unpack8(dv[i], df);
      load_f8(ws, c < nvec ? c : 0, wv);
#pragma unroll
      for (int k = 0; k < 8; ++k) dot += (df[k] * (zf[k] * sigmoid_fast(zf[k])) * wv[k]) * (xf[k] * rs);
    }
    dot = row_sum<LANES>(dot, red);
    const float mean_dot = dot * inv_dim;
    uint4* dxr = reinterpret_cast<uint4*>(dx + off);
    uint4* dzr = reinterpret_cast<uint4*>(dz + off);
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      const int c = g.lane + i * g.stride;
      float xf[8], zf[8], df[8], wv[8];
      unpack8(xv[i], xf);
      unpack8(zv[i], zf);
      unpack8(dv[i], df);
      load_f8(ws, c < nvec ? c : 0, wv);
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const float s = sigmoid_fast(zf[k]);
        const float sz = zf[k] * s;
        const float xh = xf[k] * rs;
        const float dxh = df[k] * sz * wv[k];
        const float dzv = df[k] * xh * wv[k] * s * (1.0f + zf[k] * (1.0f - s));
        xf[k] = rs * (dxh - xh * mean_dot);  // dx
        zf[k] = dzv;                         // dz
        df[k] = df[k] * sz * xh;             // dw contribution
      }
      if (valid && c < nvec) {
        row_acc_add(acc, c, df);
        dxr[c] = pack8(xf);
        const uint4 dzv = pack8(zf);
        dzr[c] = dzv;
        m = max(m, amax_bits8(dzv));
      }
    }
  }
  amax_commit(m, amax);
  float* prow = partial + static_cast<int64_t>(blockIdx.x) * dim;
  __syncthreads();
  row_acc_reduce(gsum, g.groups, dim, prow);
}

// ---- scalar fallback (any d, any alignment) ----
__global__ void grms_fwd_scalar(const bf16* __restrict__ x, const bf16* __restrict__ z, const float* __restrict__ w,
                                bf16* __restrict__ y, float* __restrict__ rstd, int64_t dim, float eps,
                                float* __restrict__ amax) {
  __shared__ float red[32];
  const int64_t off = static_cast<int64_t>(blockIdx.x) * dim;
  float ss = 0.f;
  for (int64_t j = threadIdx.x; j < dim; j += blockDim.x) {
    const float v = __bfloat162float(x[off + j]);
    ss += v * v;
  }
  ss = row_sum<0>(ss, red);
  const float rs = 1.0f / sqrtf(ss / static_cast<float>(dim) + eps);
  if (threadIdx.x == 0) rstd[blockIdx.x] = rs;
  unsigned m = 0;
  for (int64_t j = threadIdx.x; j < dim; j += blockDim.x) {
    const float zv = __bfloat162float(z[off + j]);
    const bf16 o = __float2bfloat16_rn(__bfloat162float(x[off + j]) * rs * w[j] * (zv * sigmoid_fast(zv)));
    y[off + j] = o;
    m = max(m, amax_bits(o));
  }
  amax_commit(m, amax);
}

__global__ void grms_bwd_scalar(const bf16* __restrict__ x, const bf16* __restrict__ z, const float* __restrict__ w,
                                const float* __restrict__ rstd, const bf16* __restrict__ dy, bf16* __restrict__ dx,
                                bf16* __restrict__ dz, float* __restrict__ partial, int64_t rows, int64_t dim,
                                int64_t rows_per_slot, float* __restrict__ amax) {
  __shared__ float red[32];
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * rows_per_slot;
  const int64_t r1 = r0 + rows_per_slot < rows ? r0 + rows_per_slot : rows;
  float* prow = partial + static_cast<int64_t>(blockIdx.x) * dim;
  for (int64_t j = threadIdx.x; j < dim; j += blockDim.x) prow[j] = 0.f;
  const float inv_dim = 1.0f / static_cast<float>(dim);
  unsigned m = 0;
  for (int64_t row = r0; row < r1; ++row) {
    const int64_t off = row * dim;
    const float rs = rstd[row];
    float dot = 0.f;
    for (int64_t j = threadIdx.x; j < dim; j += blockDim.x) {
      const float zv = __bfloat162float(z[off + j]);
      dot += (__bfloat162float(dy[off + j]) * (zv * sigmoid_fast(zv)) * w[j]) * (__bfloat162float(x[off + j]) * rs);
    }
    const float mean_dot = row_sum<0>(dot, red) * inv_dim;
    for (int64_t j = threadIdx.x; j < dim; j += blockDim.x) {
      const float zv = __bfloat162float(z[off + j]), d = __bfloat162float(dy[off + j]);
      const float s = sigmoid_fast(zv), sz = zv * s, xh = __bfloat162float(x[off + j]) * rs;
      const float dxh = d * sz * w[j];
      prow[j] += d * sz * xh;
      const bf16 dzv = __float2bfloat16_rn(d * xh * w[j] * s * (1.0f + zv * (1.0f - s)));
      dz[off + j] = dzv;
      m = max(m, amax_bits(dzv));
      dx[off + j] = __float2bfloat16_rn(rs * (dxh - xh * mean_dot));
    }
  }
  amax_commit(m, amax);
}

// Vector kernel plan (core/cuda/kernel_utils.cuh): warp-per-row kernels forward only. Backward keeps three row
// vectors (x, z, dy) per vector slot: at most 2 per thread, so nothing spills.
RowPlan plan_for(int64_t dim, bool vec_ok, bool backward) { return row_plan(dim, vec_ok, !backward, backward ? 2 : 4); }

template <int VPT, int LANES>
struct FwdLauncher {
  static void run(const RowPlan& p, const bf16* x, const bf16* z, const float* w, bf16* y, float* rstd, int64_t rows,
                  int64_t dim, float eps, float* amax, cudaStream_t stream) {
    const int64_t groups = LANES > 0 ? p.threads / LANES : 1;
    const int64_t blocks = (rows + groups - 1) / groups;
    grms_fwd_vec<VPT, LANES>
        <<<static_cast<unsigned>(blocks), p.threads, 0, stream>>>(x, z, w, y, rstd, rows, static_cast<int>(dim), eps,
                                                                  amax);
  }
};
template <int VPT, int LANES>
struct BwdLauncher {
  static void run(const RowPlan& p, const bf16* x, const bf16* z, const float* w, const float* rstd, const bf16* dy,
                  bf16* dx, bf16* dz, float* partial, int64_t rows, int64_t dim, const Slots& s, float* amax,
                  cudaStream_t stream) {
    if constexpr ((LANES == 32 && VPT > 1) || VPT > 2) {
      DS_CUDA_REQUIRE(false, "gated_rmsnorm_backward: internal error (no backward instance for this plan)");
    } else {
      const size_t smem = static_cast<size_t>((LANES > 0 ? p.threads / LANES : 1) + 1) * dim * sizeof(float);
      if (smem > 48 * 1024)
        DS_CUDA_CHECK(cudaFuncSetAttribute(grms_bwd_vec<VPT, LANES>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(smem)));
      grms_bwd_vec<VPT, LANES><<<static_cast<unsigned>(s.count), p.threads, smem, stream>>>(
          x, z, w, rstd, dy, dx, dz, partial, rows, static_cast<int>(dim), s.per, amax);
    }
  }
};

}  // namespace

void gated_rmsnorm_forward(const ds::cuda::bf16* x, const ds::cuda::bf16* z, const float* w, ds::cuda::bf16* y,
                           float* rstd, int64_t rows, int64_t d, float eps, cudaStream_t stream, float* amax) {
  DS_CUDA_REQUIRE(rows >= 0 && d > 0 && d <= (int64_t(1) << 30),
                  "gated_rmsnorm_forward: rows must be >= 0 and d in (0, 2^30], got rows=" + std::to_string(rows) +
                      " d=" + std::to_string(d));
  if (rows == 0) return;
  DS_CUDA_REQUIRE(x && z && w && y && rstd, "gated_rmsnorm_forward: null pointer argument");
  const bool vec_ok = aligned16(x) && aligned16(z) && aligned16(y) && aligned16(w);
  const RowPlan p = plan_for(d, vec_ok, false);
  if (p.kind == 0)
    grms_fwd_scalar<<<static_cast<unsigned>(rows), row_scalar_threads(d), 0, stream>>>(x, z, w, y, rstd, d, eps, amax);
  else
    row_dispatch<FwdLauncher>(p, x, z, w, y, rstd, rows, d, eps, amax, stream);
  DS_CUDA_LAUNCH_CHECK();
}

size_t gated_rmsnorm_scratch_bytes(int64_t rows, int64_t d) {
  if (rows <= 0 || d <= 0) return 0;
  return static_cast<size_t>(row_slots(rows).count) * static_cast<size_t>(d) * sizeof(float);
}

void gated_rmsnorm_backward(const ds::cuda::bf16* x, const ds::cuda::bf16* z, const float* w, const float* rstd,
                            const ds::cuda::bf16* dy, ds::cuda::bf16* dx, ds::cuda::bf16* dz, float* dw, int64_t rows,
                            int64_t d, void* scratch, cudaStream_t stream, float* amax) {
  DS_CUDA_REQUIRE(rows >= 0 && d > 0 && d <= (int64_t(1) << 30),
                  "gated_rmsnorm_backward: rows must be >= 0 and d in (0, 2^30], got rows=" + std::to_string(rows) +
                      " d=" + std::to_string(d));
  if (rows == 0) return;
  DS_CUDA_REQUIRE(x && z && w && rstd && dy && dx && dz && dw, "gated_rmsnorm_backward: null pointer argument");
  DS_CUDA_REQUIRE(scratch != nullptr, "gated_rmsnorm_backward: scratch is null (need gated_rmsnorm_scratch_bytes)");
  const Slots s = row_slots(rows);
  float* partial = static_cast<float*>(scratch);
  const bool vec_ok = aligned16(x) && aligned16(z) && aligned16(w) && aligned16(dy) && aligned16(dx) && aligned16(dz);
  const RowPlan p = plan_for(d, vec_ok, true);
  if (p.kind == 0)
    grms_bwd_scalar<<<static_cast<unsigned>(s.count), row_scalar_threads(d), 0, stream>>>(x, z, w, rstd, dy, dx, dz,
                                                                                          partial, rows, d, s.per,
                                                                                          amax);
  else
    row_dispatch<BwdLauncher>(p, x, z, w, rstd, dy, dx, dz, partial, rows, d, s, amax, stream);
  DS_CUDA_LAUNCH_CHECK();
  launch_sum_partials(partial, s.count, d, d, dw, stream);
  DS_CUDA_LAUNCH_CHECK();
}

}  // namespace ds::ops::cuda
