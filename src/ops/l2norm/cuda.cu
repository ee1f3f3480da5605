// CUDA l2norm y = x / sqrt(sum(x^2) + eps), forward/backward over strided rows (see cuda.h; math of l2norm.h /
// cpu.cpp: FLA l2norm_fwd, fp32 math, one rounding per output).
//
// Kernel shapes from dim (nvec = dim / 8 sixteen-byte vectors per row), as the RMSNorm kernels:
//   nvec <= 32   LANES = next_pow2(nvec) threads per row, 256/LANES rows per block, one vector per thread
//                (Qwen3.5 q/k heads d = 128: 16 lanes, 16 rows per block);
//   nvec <= 128  one warp per row, 2..4 vectors per thread;
//   nvec <= 2048 one block per row, up to 4 vectors per thread, <= 512 threads;
//   otherwise, or when dim, a stride or a pointer does not allow 16-byte access: scalar block-per-row kernels.
// Row r = t*heads + h lives at x + t*x_stride + h*dim (backward: dx + t*dx_stride + h*dim).
#include <cstdint>

#include "core/cuda/kernel_utils.cuh"
#include "ops/l2norm/cuda.h"

namespace ds::ops::cuda {
namespace {

using namespace ds::cuda;

template <int VPT, int LANES>
__global__ void __launch_bounds__(LANES > 0 ? kRowGroupBlock : kRowMaxThreads)
    l2_fwd_vec(const bf16* __restrict__ x, int64_t x_stride, bf16* __restrict__ y, float* __restrict__ rnorm,
               int64_t rows, int64_t heads, int dim, float eps) {
  __shared__ float red[32];
  const RowGeo<LANES> g;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * g.groups + g.group;
  const bool valid = row < rows;
  const int nvec = dim >> 3;
  const int64_t rr = valid ? row : 0;
  const uint4* xr = reinterpret_cast<const uint4*>(x + (rr / heads) * x_stride + (rr % heads) * dim);
  uint4 xv[VPT];
  const float ss = row_sum<LANES>(row_load_sumsq(xr, valid, nvec, g, xv), red);
  const float rn = 1.0f / sqrtf(ss + eps);
  if (!valid) return;
  if (g.lane == 0) rnorm[row] = rn;
  uint4* yr = reinterpret_cast<uint4*>(y + row * dim);
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int c = g.lane + i * g.stride;
    if (c < nvec) {
      float f[8];
      unpack8(xv[i], f);
#pragma unroll
      for (int k = 0; k < 8; ++k) f[k] *= rn;
      yr[c] = pack8(f);
    }
  }
}

// dx = rnorm * (dy - y * (dy . y)).
template <int VPT, int LANES>
__global__ void __launch_bounds__(LANES > 0 ? kRowGroupBlock : kRowMaxThreads)
    l2_bwd_vec(const bf16* __restrict__ y, const float* __restrict__ rnorm, const bf16* __restrict__ dy,
               bf16* __restrict__ dx, int64_t dx_stride, int64_t rows, int64_t heads, int dim) {
  __shared__ float red[32];
  const RowGeo<LANES> g;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * g.groups + g.group;
  const bool valid = row < rows;
  const int nvec = dim >> 3;
  const int64_t rr = valid ? row : 0;
  const uint4* yr = reinterpret_cast<const uint4*>(y + rr * dim);
  const uint4* dyr = reinterpret_cast<const uint4*>(dy + rr * dim);
  uint4 yv[VPT], dv[VPT];
  float dot = 0.f;
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int c = g.lane + i * g.stride;
    const bool in = valid && c < nvec;
    yv[i] = in ? yr[c] : make_uint4(0, 0, 0, 0);
    dv[i] = in ? dyr[c] : make_uint4(0, 0, 0, 0);
    float yf[8], df[8];
    unpack8(yv[i], yf);
    unpack8(dv[i], df);
#pragma unroll
    for (int k = 0; k < 8; ++k) dot += df[k] * yf[k];
  }
  dot = row_sum<LANES>(dot, red);
  if (!valid) return;
  const float rn = rnorm[row];
  uint4* dxr = reinterpret_cast<uint4*>(dx + (row / heads) * dx_stride + (row % heads) * dim);
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int c = g.lane + i * g.stride;
    if (c < nvec) {
      float yf[8], df[8];
      unpack8(yv[i], yf);
      unpack8(dv[i], df);
#pragma unroll
      for (int k = 0; k < 8; ++k) df[k] = rn * (df[k] - yf[k] * dot);
      dxr[c] = pack8(df);
    }
  }
}

// ---- scalar fallback ----
__global__ void l2_fwd_scalar(const bf16* __restrict__ x, int64_t x_stride, bf16* __restrict__ y,
                              float* __restrict__ rnorm, int64_t heads, int64_t dim, float eps) {
  __shared__ float red[32];
  const int64_t row = blockIdx.x;
  const bf16* xr = x + (row / heads) * x_stride + (row % heads) * dim;
  float ss = 0.f;
  for (int64_t j = threadIdx.x; j < dim; j += blockDim.x) {
    const float v = __bfloat162float(xr[j]);
    ss += v * v;
  }
  ss = row_sum<0>(ss, red);
  const float rn = 1.0f / sqrtf(ss + eps);
  if (threadIdx.x == 0) rnorm[row] = rn;
  for (int64_t j = threadIdx.x; j < dim; j += blockDim.x)
    y[row * dim + j] = __float2bfloat16_rn(__bfloat162float(xr[j]) * rn);
}

__global__ void l2_bwd_scalar(const bf16* __restrict__ y, const float* __restrict__ rnorm, const bf16* __restrict__ dy,
                              bf16* __restrict__ dx, int64_t dx_stride, int64_t heads, int64_t dim) {
  __shared__ float red[32];
  const int64_t row = blockIdx.x;
  const bf16* yr = y + row * dim;
  const bf16* dyr = dy + row * dim;
  float dot = 0.f;
  for (int64_t j = threadIdx.x; j < dim; j += blockDim.x) dot += __bfloat162float(dyr[j]) * __bfloat162float(yr[j]);
  dot = row_sum<0>(dot, red);
  const float rn = rnorm[row];
  bf16* dxr = dx + (row / heads) * dx_stride + (row % heads) * dim;
  for (int64_t j = threadIdx.x; j < dim; j += blockDim.x)
    dxr[j] = __float2bfloat16_rn(rn * (__bfloat162float(dyr[j]) - __bfloat162float(yr[j]) * dot));
}

// Vector kernel plan (core/cuda/kernel_utils.cuh): warp-per-row kernels in both directions, up to 4 vectors per
// thread.
RowPlan plan_for(int64_t dim, bool vec_ok) { return row_plan(dim, vec_ok, true, 4); }

template <int VPT, int LANES>
struct FwdLauncher {
  static void run(const RowPlan& p, const bf16* x, int64_t x_stride, bf16* y, float* rnorm, int64_t rows, int64_t heads,
                  int64_t dim, float eps, cudaStream_t stream) {
    const int64_t groups = LANES > 0 ? p.threads / LANES : 1;
    l2_fwd_vec<VPT, LANES><<<static_cast<unsigned>((rows + groups - 1) / groups), p.threads, 0, stream>>>(
        x, x_stride, y, rnorm, rows, heads, static_cast<int>(dim), eps);
  }
};
template <int VPT, int LANES>
struct BwdLauncher {
  static void run(const RowPlan& p, const bf16* y, const float* rnorm, const bf16* dy, bf16* dx, int64_t dx_stride,
                  int64_t rows, int64_t heads, int64_t dim, cudaStream_t stream) {
    const int64_t groups = LANES > 0 ? p.threads / LANES : 1;
    l2_bwd_vec<VPT, LANES><<<static_cast<unsigned>((rows + groups - 1) / groups), p.threads, 0, stream>>>(
        y, rnorm, dy, dx, dx_stride, rows, heads, static_cast<int>(dim));
  }
};

void check_shape(const char* fn, int64_t tokens, int64_t heads, int64_t dim, int64_t stride) {
  DS_CUDA_REQUIRE(tokens >= 0 && heads > 0 && dim > 0 && dim <= (int64_t(1) << 30),
                  std::string(fn) + ": tokens must be >= 0, heads > 0 and dim in (0, 2^30], got tokens=" +
                      std::to_string(tokens) + " heads=" + std::to_string(heads) + " dim=" + std::to_string(dim));
  DS_CUDA_REQUIRE(stride >= heads * dim, std::string(fn) + ": row stride " + std::to_string(stride) +
                                             " is smaller than heads*dim = " + std::to_string(heads * dim));
}

}  // namespace

void l2norm_forward(const ds::cuda::bf16* x, int64_t x_stride, ds::cuda::bf16* y, float* rnorm, int64_t tokens,
                    int64_t heads, int64_t dim, float eps, cudaStream_t stream) {
  check_shape("l2norm_forward", tokens, heads, dim, x_stride);
  const int64_t rows = tokens * heads;
  if (rows == 0) return;
  DS_CUDA_REQUIRE(x && y && rnorm, "l2norm_forward: null pointer argument");
  const bool vec_ok = aligned16(x) && aligned16(y) && x_stride % 8 == 0;
  const RowPlan p = plan_for(dim, vec_ok);
  if (p.kind == 0)
    l2_fwd_scalar<<<static_cast<unsigned>(rows), row_scalar_threads(dim), 0, stream>>>(x, x_stride, y, rnorm, heads,
                                                                                       dim, eps);
  else
    row_dispatch<FwdLauncher>(p, x, x_stride, y, rnorm, rows, heads, dim, eps, stream);
  DS_CUDA_LAUNCH_CHECK();
}

void l2norm_backward(const ds::cuda::bf16* y, const float* rnorm, const ds::cuda::bf16* dy, ds::cuda::bf16* dx,
                     int64_t dx_stride, int64_t tokens, int64_t heads, int64_t dim, cudaStream_t stream) {
  check_shape("l2norm_backward", tokens, heads, dim, dx_stride);
  const int64_t rows = tokens * heads;
  if (rows == 0) return;
  DS_CUDA_REQUIRE(y && rnorm && dy && dx, "l2norm_backward: null pointer argument");
  const bool vec_ok = aligned16(y) && aligned16(dy) && aligned16(dx) && dx_stride % 8 == 0;
  const RowPlan p = plan_for(dim, vec_ok);
  if (p.kind == 0)
    l2_bwd_scalar<<<static_cast<unsigned>(rows), row_scalar_threads(dim), 0, stream>>>(y, rnorm, dy, dx, dx_stride,
                                                                                       heads, dim);
  else
    row_dispatch<BwdLauncher>(p, y, rnorm, dy, dx, dx_stride, rows, heads, dim, stream);
  DS_CUDA_LAUNCH_CHECK();
}

}  // namespace ds::ops::cuda
