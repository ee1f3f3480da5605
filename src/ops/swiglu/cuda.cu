// CUDA SwiGLU over the fused [N, 2I] gate|up GEMM output (see cuda.h; math of swiglu.h / cpu.cpp):
//   h = silu(g) * u;  dg = dh * u * s * (1 + g (1 - s)),  du = dh * g * s,  s = sigmoid(g).
// Grid: x covers the I columns in chunks of 256 threads x V values, y covers rows (looping when N > 65535).
// V = 8 (16-byte loads/stores) when I % 8 == 0 and every pointer is 16-byte aligned, else V = 1.
// fp32 math, one rounding per output; purely elementwise, so results are deterministic.
#include <cstdint>

#include "ops/swiglu/cuda.h"

namespace ds::ops::cuda {
namespace {

using ds::cuda::bf16;

constexpr int kThreads = 256;

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// V bf16 values <-> V floats (V = 8: one 16-byte access; V = 1: scalar).
template <int V>
__device__ __forceinline__ void load_bf(const bf16* p, float f[V]) {
  if constexpr (V == 8) {
    const uint4 u = *reinterpret_cast<const uint4*>(p);
    const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      f[2 * i] = __uint_as_float(w[i] << 16);
      f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
  } else {
    f[0] = __bfloat162float(*p);
  }
}
__device__ __forceinline__ uint32_t pack2(float a, float b) {
  return static_cast<uint32_t>(__bfloat16_as_ushort(__float2bfloat16_rn(a))) |
         (static_cast<uint32_t>(__bfloat16_as_ushort(__float2bfloat16_rn(b))) << 16);
}
template <int V>
__device__ __forceinline__ void store_bf(bf16* p, const float f[V]) {
  if constexpr (V == 8) {
    *reinterpret_cast<uint4*>(p) =
        make_uint4(pack2(f[0], f[1]), pack2(f[2], f[3]), pack2(f[4], f[5]), pack2(f[6], f[7]));
  } else {
    *p = __float2bfloat16_rn(f[0]);
  }
}

__device__ __forceinline__ float sigmoidf_(float v) { return 1.0f / (1.0f + __expf(-v)); }

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
    for (int k = 0; k < V; ++k) g[k] = g[k] * sigmoidf_(g[k]) * u[k];
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
      const float s = sigmoidf_(g[k]);
      const float dg = d[k] * u[k] * s * (1.0f + g[k] * (1.0f - s));
      u[k] = d[k] * g[k] * s;  // du
      g[k] = dg;
    }
    store_bf<V>(dgu + t * 2 * I + c, g);
    store_bf<V>(dgu + t * 2 * I + I + c, u);
  }
}

dim3 grid_for(int64_t N, int64_t I, int V) {
  const int64_t cols = (I / V + kThreads - 1) / kThreads;
  const int64_t rows = N < 65535 ? N : 65535;
  return dim3(static_cast<unsigned>(cols), static_cast<unsigned>(rows));
}

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
