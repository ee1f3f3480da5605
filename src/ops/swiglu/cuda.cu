// CUDA SwiGLU over the fused [N, 2I] gate|up GEMM output (see cuda.h; math of swiglu.h / cpu.cpp):
//   h = silu(g) * u;  dg = dh * u * s * (1 + g (1 - s)),  du = dh * g * s,  s = sigmoid(g).
// Grid: x covers the I columns in chunks of 256 threads x V values, y covers rows (looping when N > 65535).
// V = 8 (16-byte loads/stores) when I % 8 == 0 and every pointer is 16-byte aligned, else V = 1.
// fp32 math, one rounding per output; purely elementwise, so results are deterministic.
#include <cstdint>

#include "core/cuda/kernel_utils.cuh"
#include "ops/swiglu/cuda.h"

namespace ds::ops::cuda {
namespace {

using namespace ds::cuda;

constexpr int kThreads = 256;

template <int V>
__global__ void __launch_bounds__(kThreads)
    swiglu_fwd_kernel(const bf16* __restrict__ gu, bf16* __restrict__ h, int64_t N, int64_t I) {
  const int64_t c = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) * V;
  if (c >= I) return;
  for (int64_t t = blockIdx.y; t < N; t += gridDim.y) {
    float g[V], u[V];
    load_bf<V>(gu + t * 2 * I + c, g);
    load_bf<V>(gu + t * 2 * I + I + c, u);
#pragma unroll
    for (int k = 0; k < V; ++k) g[k] = g[k] * sigmoid_fast(g[k]) * u[k];
    store_bf<V>(h + t * I + c, g);
  }
}

template <int V>
__global__ void __launch_bounds__(kThreads) swiglu_bwd_kernel(const bf16* __restrict__ gu, const bf16* __restrict__ dh,
                                                              bf16* __restrict__ dgu, int64_t N, int64_t I) {
  const int64_t c = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) * V;
  if (c >= I) return;
  for (int64_t t = blockIdx.y; t < N; t += gridDim.y) {
    float g[V], u[V], d[V];
    load_bf<V>(gu + t * 2 * I + c, g);
    load_bf<V>(gu + t * 2 * I + I + c, u);
    load_bf<V>(dh + t * I + c, d);
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const float s = sigmoid_fast(g[k]);
      const float dg = d[k] * u[k] * s * (1.0f + g[k] * (1.0f - s));
      u[k] = d[k] * g[k] * s;  // du
      g[k] = dg;
    }
    store_bf<V>(dgu + t * 2 * I + c, g);
    store_bf<V>(dgu + t * 2 * I + I + c, u);
  }
}

dim3 grid_for(int64_t N, int64_t I, int V) { return grid_cols_rows(I, V, kThreads, N); }

void check_shape(const char* fn, int64_t N, int64_t I) {
  DS_CUDA_REQUIRE(N >= 0 && I > 0 && I <= (int64_t(1) << 34), std::string(fn) + ": N must be >= 0 and I > 0, got N=" +
                                                                  std::to_string(N) + " I=" + std::to_string(I));
}

}  // namespace

void swiglu_forward(const ds::cuda::bf16* gu, ds::cuda::bf16* h, int64_t N, int64_t I, cudaStream_t stream) {
  check_shape("swiglu_forward", N, I);
  if (N == 0) return;
  DS_CUDA_REQUIRE(gu && h, "swiglu_forward: null pointer argument");
  if (I % 8 == 0 && aligned16(gu) && aligned16(h))
    swiglu_fwd_kernel<8><<<grid_for(N, I, 8), kThreads, 0, stream>>>(gu, h, N, I);
  else
    swiglu_fwd_kernel<1><<<grid_for(N, I, 1), kThreads, 0, stream>>>(gu, h, N, I);
  DS_CUDA_LAUNCH_CHECK();
}

void swiglu_backward(const ds::cuda::bf16* gu, const ds::cuda::bf16* dh, ds::cuda::bf16* dgu, int64_t N, int64_t I,
                     cudaStream_t stream) {
  check_shape("swiglu_backward", N, I);
  if (N == 0) return;
  DS_CUDA_REQUIRE(gu && dh && dgu, "swiglu_backward: null pointer argument");
  if (I % 8 == 0 && aligned16(gu) && aligned16(dh) && aligned16(dgu))
    swiglu_bwd_kernel<8><<<grid_for(N, I, 8), kThreads, 0, stream>>>(gu, dh, dgu, N, I);
  else
    swiglu_bwd_kernel<1><<<grid_for(N, I, 1), kThreads, 0, stream>>>(gu, dh, dgu, N, I);
  DS_CUDA_LAUNCH_CHECK();
}

}  // namespace ds::ops::cuda
