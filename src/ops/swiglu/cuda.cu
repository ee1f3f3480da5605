// CUDA SwiGLU over gate and up rows (the fused [N, 2I] gate|up GEMM output, or two arrays; see cuda.h; math of
// swiglu.h / cpu.cpp):
//   h = silu(g) * u;  dg = dh * u * s * (1 + g (1 - s)),  du = dh * g * s,  s = sigmoid(g).
// One kernel pair takes gate and up as two row-strided arrays (the fused layout: gate = gu, up = gu + I, stride 2I;
// the torch extension: two dense tensors, stride I).
// Grid: x covers the I columns in chunks of 256 threads x V values, y covers rows (looping when N > 65535).
// V = 8 (16-byte loads/stores) when I and the row strides are multiples of 8 and every pointer is 16-byte aligned,
// else V = 1.
// fp32 math, one rounding per output; purely elementwise, so results are deterministic.
#include <cstdint>

#include "core/cuda/kernel_utils.cuh"
#include "ops/swiglu/cuda.h"

namespace ds::ops::cuda {
namespace {

using namespace ds::cuda;

constexpr int kThreads = 256;


// Row t of gate / up starts at t * ld_in, of dgate / dup at t * ld_out; h and dh are dense [N, I].
// FS: the sigmoids by sigmoid_fast_v (core/cuda/kernel_utils.cuh), else one division each: bitwise the same.
template <int V, bool FS>
__global__ void __launch_bounds__(kThreads) swiglu_fwd_kernel(const bf16* __restrict__ gate, const bf16* __restrict__ up,
                                                              int64_t ld_in, bf16* __restrict__ h, int64_t N, int64_t I,
                                                              float* __restrict__ amax) {
  const int64_t c = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) * V;
  if (c >= I) return;
  unsigned m = 0;
  for (int64_t t = blockIdx.y; t < N; t += gridDim.y) {
    float g[V], u[V];
    load_bf<V>(gate + t * ld_in + c, g);
    load_bf<V>(up + t * ld_in + c, u);
    if constexpr (FS) {
      float s[V];
      sigmoid_fast_v<V>(g, s);
#pragma unroll
      for (int k = 0; k < V; ++k) g[k] = g[k] * s[k] * u[k];
    } else {
#pragma unroll
      for (int k = 0; k < V; ++k) g[k] = g[k] * sigmoid_fast(g[k]) * u[k];
    }
    store_bf<V>(h + t * I + c, g);
    if (amax) m = max(m, amax_bits_of<V>(g));
  }
  amax_commit(m, amax);
}

// dgate / dup may be gate / up (in place, the same strides): each thread loads its gate and up values before it
// stores the gradients of the same positions, and no other thread touches them.
template <int V, bool FS>
__global__ void __launch_bounds__(kThreads)
    swiglu_bwd_kernel(const bf16* gate, const bf16* up, int64_t ld_in,  // (not __restrict__: dgate, dup may be them)
                      const bf16* __restrict__ dh, bf16* dgate, bf16* dup, int64_t ld_out,
                      int64_t N, int64_t I, float* __restrict__ amax) {
  const int64_t c = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) * V;
  if (c >= I) return;
  unsigned m = 0;
  for (int64_t t = blockIdx.y; t < N; t += gridDim.y) {
    float g[V], u[V], d[V];
    load_bf<V>(gate + t * ld_in + c, g);
    load_bf<V>(up + t * ld_in + c, u);
    load_bf<V>(dh + t * I + c, d);
    float sv[V];
    if constexpr (FS) {
      sigmoid_fast_v<V>(g, sv);
    } else {
#pragma unroll
      for (int k = 0; k < V; ++k) sv[k] = sigmoid_fast(g[k]);
    }
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const float s = sv[k];
      const float dg = d[k] * u[k] * s * (1.0f + g[k] * (1.0f - s));
      u[k] = d[k] * g[k] * s;  // du
      g[k] = dg;
    }
    store_bf<V>(dgate + t * ld_out + c, g);
    store_bf<V>(dup + t * ld_out + c, u);
    if (amax) m = max(m, max(amax_bits_of<V>(g), amax_bits_of<V>(u)));
  }
  amax_commit(m, amax);
}

dim3 grid_for(int64_t N, int64_t I, int V) { return grid_cols_rows(I, V, kThreads, N); }

template <int V>
void launch_fwd(const bf16* gate, const bf16* up, int64_t ld_in, bf16* h, int64_t N, int64_t I, float* amax,
                cudaStream_t stream) {
  if (ds::cuda::division_sigmoid())
    swiglu_fwd_kernel<V, false><<<grid_for(N, I, V), kThreads, 0, stream>>>(gate, up, ld_in, h, N, I, amax);
  else
    swiglu_fwd_kernel<V, true><<<grid_for(N, I, V), kThreads, 0, stream>>>(gate, up, ld_in, h, N, I, amax);
}

template <int V>
void launch_bwd(const bf16* gate, const bf16* up, int64_t ld_in, const bf16* dh, bf16* dgate, bf16* dup,
                int64_t ld_out, int64_t N, int64_t I, float* amax, cudaStream_t stream) {
  if (ds::cuda::division_sigmoid())
    swiglu_bwd_kernel<V, false><<<grid_for(N, I, V), kThreads, 0, stream>>>(gate, up, ld_in, dh, dgate, dup, ld_out,
                                                                            N, I, amax);
  else
    swiglu_bwd_kernel<V, true><<<grid_for(N, I, V), kThreads, 0, stream>>>(gate, up, ld_in, dh, dgate, dup, ld_out,
                                                                           N, I, amax);
}

void check_shape(const char* fn, int64_t N, int64_t I) {
  DS_CUDA_REQUIRE(N >= 0 && I > 0 && I <= (int64_t(1) << 34), std::string(fn) + ": N must be >= 0 and I > 0, got N=" +
                                                                  std::to_string(N) + " I=" + std::to_string(I));
}

}  // namespace

void swiglu_forward_rows(const bf16* gate, const bf16* up, int64_t ld_in, bf16* h, int64_t N, int64_t I,
                        cudaStream_t stream, float* amax) {
  check_shape("swiglu_forward_rows", N, I);
  if (N == 0) return;
  DS_CUDA_REQUIRE(gate && up && h, "swiglu_forward_rows: null pointer argument");
  DS_CUDA_REQUIRE(ld_in >= I, "swiglu_forward_rows: row stride " + std::to_string(ld_in) + " < I = " + std::to_string(I));
  if (I % 8 == 0 && ld_in % 8 == 0 && aligned16(gate) && aligned16(up) && aligned16(h))
    launch_fwd<8>(gate, up, ld_in, h, N, I, amax, stream);
  else
    launch_fwd<1>(gate, up, ld_in, h, N, I, amax, stream);
  DS_CUDA_LAUNCH_CHECK();
}

void swiglu_backward_rows(const bf16* gate, const bf16* up, int64_t ld_in, const bf16* dh, bf16* dgate, bf16* dup,
                          int64_t ld_out, int64_t N, int64_t I, cudaStream_t stream, float* amax) {
  check_shape("swiglu_backward_rows", N, I);
  if (N == 0) return;
  DS_CUDA_REQUIRE(gate && up && dh && dgate && dup, "swiglu_backward_rows: null pointer argument");
  DS_CUDA_REQUIRE(ld_in >= I && ld_out >= I, "swiglu_backward_rows: row strides " + std::to_string(ld_in) + ", " +
                                                 std::to_string(ld_out) + " must be >= I = " + std::to_string(I));
  if (I % 8 == 0 && ld_in % 8 == 0 && ld_out % 8 == 0 && aligned16(gate) && aligned16(up) && aligned16(dh) &&
      aligned16(dgate) && aligned16(dup))
    launch_bwd<8>(gate, up, ld_in, dh, dgate, dup, ld_out, N, I, amax, stream);
  else
    launch_bwd<1>(gate, up, ld_in, dh, dgate, dup, ld_out, N, I, amax, stream);
  DS_CUDA_LAUNCH_CHECK();
}

void swiglu_forward(const bf16* gu, bf16* h, int64_t N, int64_t I, cudaStream_t stream, float* amax) {
  swiglu_forward_rows(gu, gu + I, 2 * I, h, N, I, stream, amax);
}

void swiglu_backward(const bf16* gu, const bf16* dh, bf16* dgu, int64_t N, int64_t I, cudaStream_t stream,
                     float* amax) {
  swiglu_backward_rows(gu, gu + I, 2 * I, dh, dgu, dgu + I, 2 * I, N, I, stream, amax);
}

}  // namespace ds::ops::cuda
