// CUDA partial half-split RoPE, in place (see cuda.h; math of rope.h / cpu.cpp). For pair (x1 = x[i],
// x2 = x[i + half]), i < half = rotary_dim / 2, with c = cos_t[n, i], s = sin_t[n, i] (s negated for inverse):
//   x1' = x1 c - x2 s,  x2' = x2 c + x1 s.
// One thread per V consecutive pairs of one head (grid-stride over N*H*half/V units); V = 8 (16-byte bf16 and
// 2x float4 table accesses) when half % 8 == 0, head_dim % 8 == 0 and x, cos_t, sin_t are 16-byte aligned,
// else V = 1. Dims >= rotary_dim are untouched. fp32 math, one rounding per output.
#include <cstdint>

#include "core/cuda/kernel_utils.cuh"
#include "ops/rope/cuda.h"

namespace ds::ops::cuda {
namespace {

using namespace ds::cuda;

constexpr int kThreads = 256;

template <int V>
__device__ __forceinline__ void load_f(const float* p, float f[V]) {
  if constexpr (V == 8)
    ldg_f8(p, 0, f);
  else
    f[0] = __ldg(p);
}

template <int V>
__global__ void __launch_bounds__(kThreads)
    rope_kernel(bf16* __restrict__ x, int64_t H, int64_t head_dim, int64_t half, const float* __restrict__ cos_t,
                const float* __restrict__ sin_t, float sgn, int64_t units) {
  const int64_t upr = half / V;  // units per head row
  for (int64_t u = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; u < units;
       u += static_cast<int64_t>(gridDim.x) * kThreads) {
    const int64_t row = u / upr, i0 = (u - row * upr) * V, n = row / H;
    bf16* xv = x + row * head_dim;
    float x1[V], x2[V], c[V], s[V];
    load_bf<V>(xv + i0, x1);
    load_bf<V>(xv + half + i0, x2);
    load_f<V>(cos_t + n * half + i0, c);
    load_f<V>(sin_t + n * half + i0, s);
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const float sk = sgn * s[k];
      const float a = x1[k] * c[k] - x2[k] * sk;
      x2[k] = x2[k] * c[k] + x1[k] * sk;
      x1[k] = a;
    }
    store_bf<V>(xv + i0, x1);
    store_bf<V>(xv + half + i0, x2);
  }
}

}  // namespace

void rope_apply(ds::cuda::bf16* x, int64_t N, int64_t H, int64_t head_dim, int64_t rotary_dim, const float* cos_t,
                const float* sin_t, bool inverse, cudaStream_t stream) {
  DS_CUDA_REQUIRE(N >= 0 && H > 0 && head_dim > 0,
                  "rope_apply: need N >= 0, H > 0, head_dim > 0, got N=" + std::to_string(N) +
                      " H=" + std::to_string(H) + " head_dim=" + std::to_string(head_dim));
  DS_CUDA_REQUIRE(rotary_dim > 0 && rotary_dim % 2 == 0 && rotary_dim <= head_dim,
                  "rope_apply: rotary_dim (" + std::to_string(rotary_dim) +
                      ") must be positive, even and <= head_dim (" + std::to_string(head_dim) + ")");
  if (N == 0) return;
  DS_CUDA_REQUIRE(x && cos_t && sin_t, "rope_apply: null pointer argument");
  const int64_t half = rotary_dim / 2;
  const float sgn = inverse ? -1.0f : 1.0f;
  const bool vec = half % 8 == 0 && head_dim % 8 == 0 && aligned16(x) && aligned16(cos_t) && aligned16(sin_t);
  const int V = vec ? 8 : 1;
  const int64_t units = N * H * (half / V);
  int64_t blocks = (units + kThreads - 1) / kThreads;
  if (blocks > (int64_t(1) << 20)) blocks = int64_t(1) << 20;
  if (vec)
    rope_kernel<8>
        <<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(x, H, head_dim, half, cos_t, sin_t, sgn, units);
  else
    rope_kernel<1>
        <<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(x, H, head_dim, half, cos_t, sin_t, sgn, units);
  DS_CUDA_LAUNCH_CHECK();
}

}  // namespace ds::ops::cuda
