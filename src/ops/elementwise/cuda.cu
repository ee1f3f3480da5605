// Small CUDA elementwise ops (see cuda.h): residual add, attention output gate (math of attention.h
// output_gate_*), strided row copy, bf16 -> fp32. Grid-stride loops; 8 elements per thread with 16-byte
// accesses over the largest multiple of 8 when every pointer is 16-byte aligned (a scalar kernel handles the
// tail and unaligned buffers). fp32 math, one rounding per output; elementwise, so deterministic.
#include <cstdint>

#include "core/cuda/kernel_utils.cuh"
#include "ops/elementwise/cuda.h"

namespace ds::ops::cuda {
namespace {

using namespace ds::cuda;

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 8192;

unsigned grid_for(int64_t work) { return grid_1d(work, kThreads, kMaxBlocks); }

// Elementwise functors on fp32 values.
struct AddOp {
  __device__ void operator()(float a, float b, float& y) const { y = a + b; }
};
struct GateFwdOp {  // a = o, b = gate
  __device__ void operator()(float o, float g, float& y) const { y = o * sigmoid_fast(g); }
};
struct GateBwdOp {  // (o, gate, dy) -> (dout, dgate)
  __device__ void operator()(float o, float g, float dy, float& dout, float& dgate) const {
    const float s = sigmoid_fast(g);
    dout = dy * s;
    dgate = dy * o * s * (1.0f - s);
  }
};

// y = op(a, b). No __restrict__: y may alias a or b (each element is read before it is written, by the same
// thread).
template <class Op>
__global__ void __launch_bounds__(kThreads)
    binary_vec_kernel(const bf16* a, const bf16* b, bf16* y, int64_t n8, Op op, float* amax) {
  unsigned m = 0;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n8;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    float fa[8], fb[8], fy[8];
    unpack8(reinterpret_cast<const uint4*>(a)[i], fa);
    unpack8(reinterpret_cast<const uint4*>(b)[i], fb);
#pragma unroll
    for (int k = 0; k < 8; ++k) op(fa[k], fb[k], fy[k]);
    const uint4 o = pack8(fy);
    reinterpret_cast<uint4*>(y)[i] = o;
    m = max(m, amax_bits8(o));
  }
  amax_commit(m, amax);
}
template <class Op>
__global__ void __launch_bounds__(kThreads)
    binary_scalar_kernel(const bf16* a, const bf16* b, bf16* y, int64_t begin, int64_t n, Op op, float* amax) {
  unsigned m = 0;
  for (int64_t i = begin + static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    float fy;
    op(__bfloat162float(a[i]), __bfloat162float(b[i]), fy);
    const bf16 o = __float2bfloat16_rn(fy);
    y[i] = o;
    m = max(m, amax_bits(o));
  }
  amax_commit(m, amax);
}

template <class Op>
void launch_binary(const bf16* a, const bf16* b, bf16* y, int64_t n, Op op, float* amax, cudaStream_t stream) {
  int64_t begin = 0;
  if (aligned16(a) && aligned16(b) && aligned16(y) && n >= 8) {
    const int64_t n8 = n / 8;
    binary_vec_kernel<<<grid_for(n8), kThreads, 0, stream>>>(a, b, y, n8, op, amax);
    DS_CUDA_LAUNCH_CHECK();
    begin = n8 * 8;
  }
  if (begin < n) {
    binary_scalar_kernel<<<grid_for(n - begin), kThreads, 0, stream>>>(a, b, y, begin, n, op, amax);
    DS_CUDA_LAUNCH_CHECK();
  }
}

__global__ void __launch_bounds__(kThreads)
    gate_bwd_vec_kernel(const bf16* __restrict__ o, const bf16* __restrict__ gate, const bf16* dy, bf16* dout,
                        bf16* dgate, int64_t n8) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n8;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    float fo[8], fg[8], fd[8], r1[8], r2[8];
    unpack8(reinterpret_cast<const uint4*>(o)[i], fo);
    unpack8(reinterpret_cast<const uint4*>(gate)[i], fg);
    unpack8(reinterpret_cast<const uint4*>(dy)[i], fd);
#pragma unroll
    for (int k = 0; k < 8; ++k) GateBwdOp()(fo[k], fg[k], fd[k], r1[k], r2[k]);
    reinterpret_cast<uint4*>(dout)[i] = pack8(r1);
    reinterpret_cast<uint4*>(dgate)[i] = pack8(r2);
  }
}
__global__ void __launch_bounds__(kThreads)
    gate_bwd_scalar_kernel(const bf16* __restrict__ o, const bf16* __restrict__ gate, const bf16* dy, bf16* dout,
                           bf16* dgate, int64_t begin, int64_t n) {
  for (int64_t i = begin + static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    float r1, r2;
    GateBwdOp()(__bfloat162float(o[i]), __bfloat162float(gate[i]), __bfloat162float(dy[i]), r1, r2);
    dout[i] = __float2bfloat16_rn(r1);
    dgate[i] = __float2bfloat16_rn(r2);
  }
}

// Strided row copy; V = 8 (16-byte) or 1 values per thread. grid x over columns, grid y over rows (looping).
template <int V>
__global__ void __launch_bounds__(kThreads)
    copy_rows_kernel(const bf16* __restrict__ src, int64_t src_stride, bf16* __restrict__ dst, int64_t dst_stride,
                     int64_t rows, int64_t cols) {
  const int64_t c = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) * V;
  if (c >= cols) return;
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    if constexpr (V == 8)
      *reinterpret_cast<uint4*>(dst + r * dst_stride + c) = *reinterpret_cast<const uint4*>(src + r * src_stride + c);
    else
      dst[r * dst_stride + c] = src[r * src_stride + c];
  }
}

__global__ void __launch_bounds__(kThreads)
    bf16_to_f32_vec_kernel(const bf16* __restrict__ x, float* __restrict__ y, int64_t n8) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n8;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    float f[8];
    unpack8(__ldg(reinterpret_cast<const uint4*>(x) + i), f);
    store_f8(y, i, f);
  }
}
__global__ void __launch_bounds__(kThreads)
    bf16_to_f32_scalar_kernel(const bf16* __restrict__ x, float* __restrict__ y, int64_t begin, int64_t n) {
  for (int64_t i = begin + static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * kThreads)
    y[i] = __bfloat162float(x[i]);
}

void check_n(const char* fn, int64_t n) {
  DS_CUDA_REQUIRE(n >= 0, std::string(fn) + ": n must be >= 0, got " + std::to_string(n));
}

}  // namespace

void add(const ds::cuda::bf16* a, const ds::cuda::bf16* b, ds::cuda::bf16* y, int64_t n, cudaStream_t stream,
         float* amax) {
  check_n("add", n);
  if (n == 0) return;
  DS_CUDA_REQUIRE(a && b && y, "add: null pointer argument");
  launch_binary(a, b, y, n, AddOp{}, amax, stream);
}

void output_gate_forward(const ds::cuda::bf16* o, const ds::cuda::bf16* gate, ds::cuda::bf16* y, int64_t n,
                         cudaStream_t stream, float* amax) {
  check_n("output_gate_forward", n);
  if (n == 0) return;
  DS_CUDA_REQUIRE(o && gate && y, "output_gate_forward: null pointer argument");
  launch_binary(o, gate, y, n, GateFwdOp{}, amax, stream);
}

void output_gate_backward(const ds::cuda::bf16* o, const ds::cuda::bf16* gate, const ds::cuda::bf16* dy,
                          ds::cuda::bf16* dout, ds::cuda::bf16* dgate, int64_t n, cudaStream_t stream) {
  check_n("output_gate_backward", n);
  if (n == 0) return;
  DS_CUDA_REQUIRE(o && gate && dy && dout && dgate, "output_gate_backward: null pointer argument");
  int64_t begin = 0;
  if (aligned16(o) && aligned16(gate) && aligned16(dy) && aligned16(dout) && aligned16(dgate) && n >= 8) {
    const int64_t n8 = n / 8;
    gate_bwd_vec_kernel<<<grid_for(n8), kThreads, 0, stream>>>(o, gate, dy, dout, dgate, n8);
    DS_CUDA_LAUNCH_CHECK();
    begin = n8 * 8;
  }
  if (begin < n) {
    gate_bwd_scalar_kernel<<<grid_for(n - begin), kThreads, 0, stream>>>(o, gate, dy, dout, dgate, begin, n);
    DS_CUDA_LAUNCH_CHECK();
  }
}

void copy_rows(const ds::cuda::bf16* src, int64_t src_stride, ds::cuda::bf16* dst, int64_t dst_stride, int64_t rows,
               int64_t cols, cudaStream_t stream) {
  DS_CUDA_REQUIRE(rows >= 0 && cols >= 0 && src_stride >= cols && dst_stride >= cols,
                  "copy_rows: need rows, cols >= 0 and strides >= cols, got rows=" + std::to_string(rows) +
                      " cols=" + std::to_string(cols) + " src_stride=" + std::to_string(src_stride) +
                      " dst_stride=" + std::to_string(dst_stride));
  if (rows == 0 || cols == 0) return;
  DS_CUDA_REQUIRE(src && dst, "copy_rows: null pointer argument");
  const bool vec = cols % 8 == 0 && src_stride % 8 == 0 && dst_stride % 8 == 0 && aligned16(src) && aligned16(dst);
  const int V = vec ? 8 : 1;
  const dim3 grid = grid_cols_rows(cols, V, kThreads, rows);
  if (vec)
    copy_rows_kernel<8><<<grid, kThreads, 0, stream>>>(src, src_stride, dst, dst_stride, rows, cols);
  else
    copy_rows_kernel<1><<<grid, kThreads, 0, stream>>>(src, src_stride, dst, dst_stride, rows, cols);
  DS_CUDA_LAUNCH_CHECK();
}

void bf16_to_f32(const ds::cuda::bf16* x, float* y, int64_t n, cudaStream_t stream) {
  check_n("bf16_to_f32", n);
  if (n == 0) return;
  DS_CUDA_REQUIRE(x && y, "bf16_to_f32: null pointer argument");
  int64_t begin = 0;
  if (aligned16(x) && aligned16(y) && n >= 8) {
    const int64_t n8 = n / 8;
    bf16_to_f32_vec_kernel<<<grid_for(n8), kThreads, 0, stream>>>(x, y, n8);
    DS_CUDA_LAUNCH_CHECK();
    begin = n8 * 8;
  }
  if (begin < n) {
    bf16_to_f32_scalar_kernel<<<grid_for(n - begin), kThreads, 0, stream>>>(x, y, begin, n);
    DS_CUDA_LAUNCH_CHECK();
  }
}

}  // namespace ds::ops::cuda
