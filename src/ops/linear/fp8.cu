// FP8 casts of bf16 tensors for the FP8 GEMMs (fp8.h): amax, row-major cast, transposed cast. The cast of one
// element is core/fp8.h's fp8_encode(x * inv) through the hardware's cvt.rn.satfinite (cuda_fp8.h), which the GPU
// tests check bit for bit against the CPU emulation.
#include <cuda_fp8.h>

#include <algorithm>
#include <string>

#include "core/cuda/kernel_utils.cuh"
#include "ops/linear/fp8.h"

namespace ds::ops::cuda {
namespace {

using ds::cuda::bf16;
using ds::cuda::load_bf;

__device__ __forceinline__ uint8_t encode(float v, Fp8Format f) {
  return static_cast<uint8_t>(
      __nv_cvt_float_to_fp8(v, __NV_SATFINITE, f == Fp8Format::E4M3 ? __NV_E4M3 : __NV_E5M2));
}

// Eight bf16 at p (16-byte aligned) cast with `inv`: their codes, packed little-endian into 8 bytes.
__device__ __forceinline__ uint2 encode8(const bf16* p, float inv, Fp8Format f) {
  float v[8];
  load_bf<8>(p, v);
  uint32_t w[2] = {0, 0};
#pragma unroll
  for (int j = 0; j < 8; ++j) w[j / 4] |= uint32_t(encode(v[j] * inv, f)) << (8 * (j % 4));
  return make_uint2(w[0], w[1]);
}

// |x| as ordered bits: for non-negative floats (NaN with the sign cleared included) the uint order is the float order
// and NaN's bits exceed +inf's, so the max of the bits is the amax, NaN winning.
__device__ __forceinline__ unsigned abs_bits(float v) { return __float_as_uint(v) & 0x7fffffffu; }

constexpr int kAmaxThreads = 256;

// vec8: cols % 8 == 0, ld % 8 == 0 and x 16-byte aligned: each thread reads 8 bf16 at a time.
template <bool kVec8>
__global__ void __launch_bounds__(kAmaxThreads) amax_kernel(const bf16* __restrict__ x, int64_t rows, int64_t cols,
                                                            int64_t ld, unsigned* __restrict__ out) {
  unsigned m = 0;
  const int64_t per_row = kVec8 ? cols / 8 : cols;
  const int64_t total = rows * per_row;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / per_row, c = i % per_row;
    if constexpr (kVec8) {
      float v[8];
      load_bf<8>(x + r * ld + c * 8, v);
#pragma unroll
      for (int k = 0; k < 8; ++k) m = max(m, abs_bits(v[k]));
    } else {
      m = max(m, abs_bits(__bfloat162float(x[r * ld + c])));
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(0xffffffffu, m, o));
  __shared__ unsigned warp_max[kAmaxThreads / 32];
  if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = m;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kAmaxThreads / 32; ++w) m = max(m, warp_max[w]);
    atomicMax(out, m);
  }
}

__device__ __forceinline__ float inv_of(const float* amax, Fp8Format f) { return fp8_inv_scale(*amax, f); }

// One thread casts 8 consecutive elements of a row (vec8) or one.
template <bool kVec8>
__global__ void quantize_kernel(const bf16* __restrict__ x, int64_t rows, int64_t cols, int64_t ld,
                                const float* __restrict__ amax, Fp8Format f, uint8_t* __restrict__ q, int64_t ldq,
                                float* __restrict__ scale) {
  const float inv = inv_of(amax, f);
  if (blockIdx.x == 0 && threadIdx.x == 0) *scale = fp8_dequant_scale(inv);
  const int64_t per_row = kVec8 ? cols / 8 : cols;
  const int64_t total = rows * per_row;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / per_row, c = i % per_row;
    if constexpr (kVec8) {
      *reinterpret_cast<uint2*>(q + r * ldq + c * 8) = encode8(x + r * ld + c * 8, inv, f);
    } else {
      q[r * ldq + c] = encode(__bfloat162float(x[r * ld + c]) * inv, f);
    }
  }
}

// 64 x 64 tiles through shared memory: read rows of x (coalesced along c), write rows of qt (coalesced along r).
constexpr int kTile = 64, kTThreads = 256;
__global__ void __launch_bounds__(kTThreads) quantize_transpose_kernel(const bf16* __restrict__ x, int64_t rows,
                                                                       int64_t cols, int64_t ld,
                                                                       const float* __restrict__ amax, Fp8Format f,
                                                                       uint8_t* __restrict__ qt, int64_t ldqt,
                                                                       float* __restrict__ scale) {
  __shared__ uint8_t tile[kTile][kTile + 4];
  const float inv = inv_of(amax, f);
  if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) *scale = fp8_dequant_scale(inv);
  const int64_t r0 = int64_t(blockIdx.x) * kTile, c0 = int64_t(blockIdx.y) * kTile;
#pragma unroll 4
  for (int i = threadIdx.x; i < kTile * kTile; i += kTThreads) {
    const int rr = i / kTile, cc = i % kTile;
    const int64_t r = r0 + rr, c = c0 + cc;
    uint8_t v = 0;  // padding rows (rows <= r < ldqt) cast to zero
    if (r < rows && c < cols) v = encode(__bfloat162float(x[r * ld + c]) * inv, f);
    tile[rr][cc] = v;
  }
  __syncthreads();
#pragma unroll 4
  for (int i = threadIdx.x; i < kTile * kTile; i += kTThreads) {
    const int cc = i / kTile, rr = i % kTile;
    const int64_t r = r0 + rr, c = c0 + cc;
    if (c < cols && r < ldqt) qt[c * ldqt + r] = tile[rr][cc];
  }
}

// The fast path of the transposed cast (cols % 8 == 0, ld % 8 == 0, x 16-byte aligned, ldqt % 4 == 0): a 64 x 64
// tile per block, each thread loading two runs of 8 bf16 (16 bytes) and, when `q` is set, writing their codes
// row-major as 8 bytes (the row-major cast in the same pass); the transposed codes go out as 4-byte words, each the
// codes of 4 consecutive rows in one column. Padding rows (rows <= r < ldqt) are zero codes.
__global__ void __launch_bounds__(kTThreads) quantize_both_kernel(const bf16* __restrict__ x, int64_t rows,
                                                                  int64_t cols, int64_t ld,
                                                                  const float* __restrict__ amax, Fp8Format f,
                                                                  uint8_t* __restrict__ q, int64_t ldq,
                                                                  uint8_t* __restrict__ qt, int64_t ldqt,
                                                                  float* __restrict__ scale) {
  __shared__ __align__(16) uint8_t tile[kTile][kTile + 8];  // rows 8-byte aligned for the 8-byte stores
  const float inv = inv_of(amax, f);
  if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) *scale = fp8_dequant_scale(inv);
  const int64_t r0 = int64_t(blockIdx.x) * kTile, c0 = int64_t(blockIdx.y) * kTile;
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    const int v = threadIdx.x + k * kTThreads;  // one of the tile's 64 rows x 8 runs
    const int rr = v / 8, cc = (v % 8) * 8;
    const int64_t r = r0 + rr, c = c0 + cc;
    uint2 codes = make_uint2(0, 0);  // rows past `rows`: zero codes
    if (r < rows && c < cols) {
      codes = encode8(x + r * ld + c, inv, f);
      if (q) *reinterpret_cast<uint2*>(q + r * ldq + c) = codes;
    }
    *reinterpret_cast<uint2*>(&tile[rr][cc]) = codes;
  }
  __syncthreads();
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int v = threadIdx.x + k * kTThreads;  // one of the tile's 64 columns x 16 words of 4 rows
    const int cc = v / 16, w = v % 16;
    const int64_t c = c0 + cc, r = r0 + 4 * w;
    if (c >= cols || r >= ldqt) continue;
    const uint32_t word = uint32_t(tile[4 * w][cc]) | (uint32_t(tile[4 * w + 1][cc]) << 8) |
                          (uint32_t(tile[4 * w + 2][cc]) << 16) | (uint32_t(tile[4 * w + 3][cc]) << 24);
    *reinterpret_cast<uint32_t*>(qt + c * ldqt + r) = word;
  }
}

int grid_for(int64_t work, int threads) {
  int dev = 0, sms = 132;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(ds::cuda::ceil_div(work, threads), int64_t(sms) * 8)));
}

bool vec8_ok(const void* x, int64_t cols, int64_t ld, int64_t ldq) {
  return cols % 8 == 0 && ld % 8 == 0 && ldq % 8 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0;
}

// 64 x 64 byte tiles: 4-byte words read along a row of q, 4-byte words (4 rows of one column) written along qt's rows.
__global__ void __launch_bounds__(kTThreads) transpose_kernel(const uint8_t* __restrict__ q, int64_t rows,
                                                              int64_t cols, int64_t ldq, uint8_t* __restrict__ qt,
                                                              int64_t ldqt) {
  __shared__ uint8_t tile[kTile][kTile + 4];
  const int64_t r0 = int64_t(blockIdx.x) * kTile, c0 = int64_t(blockIdx.y) * kTile;
  for (int i = threadIdx.x; i < kTile * kTile / 4; i += kTThreads) {
    const int rr = i / (kTile / 4), cw = i % (kTile / 4);
    const int64_t r = r0 + rr, c = c0 + 4 * cw;
    uint32_t w = 0;  // padding rows (rows <= r) and columns past cols: zeros
    if (r < rows && c < cols) w = *reinterpret_cast<const uint32_t*>(q + r * ldq + c);
#pragma unroll
    for (int j = 0; j < 4; ++j) tile[rr][4 * cw + j] = static_cast<uint8_t>(w >> (8 * j));
  }
  __syncthreads();
  for (int i = threadIdx.x; i < kTile * kTile / 4; i += kTThreads) {
    const int cc = i / (kTile / 4), rw = i % (kTile / 4);
    const int64_t c = c0 + cc, r = r0 + 4 * rw;
    if (c >= cols || r >= ldqt) continue;
    uint32_t w = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) w |= uint32_t(tile[4 * rw + j][cc]) << (8 * j);
    *reinterpret_cast<uint32_t*>(qt + c * ldqt + r) = w;
  }
}

}  // namespace

void fp8_transpose(const uint8_t* q, int64_t rows, int64_t cols, int64_t ldq, uint8_t* qt, int64_t ldqt,
                   cudaStream_t stream) {
  DS_CUDA_REQUIRE(rows >= 0 && cols >= 0 && ldq >= cols && ldqt >= rows && cols % 4 == 0 && ldq % 4 == 0 &&
                      ldqt % 4 == 0 && reinterpret_cast<uintptr_t>(q) % 4 == 0 &&
                      reinterpret_cast<uintptr_t>(qt) % 4 == 0,
                  "fp8_transpose: bad shape or alignment");
  const dim3 grid(static_cast<unsigned>(std::max<int64_t>(1, ds::cuda::ceil_div(ldqt, kTile))),
                  static_cast<unsigned>(std::max<int64_t>(1, ds::cuda::ceil_div(cols, kTile))));
  DS_CUDA_REQUIRE(grid.y <= 65535, "fp8_transpose: too many columns");
  transpose_kernel<<<grid, kTThreads, 0, stream>>>(q, rows, cols, ldq, qt, ldqt);
  DS_CUDA_LAUNCH_CHECK();
}

void fp8_amax(const bf16* x, int64_t rows, int64_t cols, int64_t ld, float* amax, cudaStream_t stream) {
  DS_CUDA_REQUIRE(rows >= 0 && cols >= 0 && ld >= cols, "fp8_amax: bad shape (rows " + std::to_string(rows) +
                                                            ", cols " + std::to_string(cols) + ", ld " +
                                                            std::to_string(ld) + ")");
  DS_CUDA_CHECK(cudaMemsetAsync(amax, 0, sizeof(float), stream));
  if (rows == 0 || cols == 0) return;
  unsigned* out = reinterpret_cast<unsigned*>(amax);
  if (vec8_ok(x, cols, ld, 8)) {
    amax_kernel<true><<<grid_for(rows * cols / 8, kAmaxThreads), kAmaxThreads, 0, stream>>>(x, rows, cols, ld, out);
  } else {
    amax_kernel<false><<<grid_for(rows * cols, kAmaxThreads), kAmaxThreads, 0, stream>>>(x, rows, cols, ld, out);
  }
  DS_CUDA_LAUNCH_CHECK();
}

void fp8_quantize(const bf16* x, int64_t rows, int64_t cols, int64_t ld, const float* amax, Fp8Format format,
                  uint8_t* q, int64_t ldq, float* scale, cudaStream_t stream) {
  DS_CUDA_REQUIRE(rows >= 0 && cols >= 0 && ld >= cols && ldq >= cols, "fp8_quantize: bad shape");
  const int threads = 256;
  if (vec8_ok(x, cols, ld, ldq) && reinterpret_cast<uintptr_t>(q) % 8 == 0) {
    quantize_kernel<true><<<grid_for(std::max<int64_t>(rows * cols / 8, 1), threads), threads, 0, stream>>>(
        x, rows, cols, ld, amax, format, q, ldq, scale);
  } else {
    quantize_kernel<false><<<grid_for(std::max<int64_t>(rows * cols, 1), threads), threads, 0, stream>>>(
        x, rows, cols, ld, amax, format, q, ldq, scale);
  }
  DS_CUDA_LAUNCH_CHECK();
}

void fp8_quantize_transpose(const bf16* x, int64_t rows, int64_t cols, int64_t ld, const float* amax,
                            Fp8Format format, uint8_t* qt, int64_t ldqt, float* scale, cudaStream_t stream) {
  fp8_quantize_both(x, rows, cols, ld, amax, format, nullptr, 0, qt, ldqt, scale, nullptr, stream);
}

void fp8_quantize_both(const bf16* x, int64_t rows, int64_t cols, int64_t ld, const float* amax, Fp8Format format,
                       uint8_t* q, int64_t ldq, uint8_t* qt, int64_t ldqt, float* scale_t, float* scale,
                       cudaStream_t stream) {
  DS_CUDA_REQUIRE(rows >= 0 && cols >= 0 && ld >= cols && ldqt >= rows && (!q || ldq >= cols),
                  "fp8_quantize_transpose: bad shape");
  const dim3 grid(static_cast<unsigned>(std::max<int64_t>(1, ds::cuda::ceil_div(ldqt, kTile))),
                  static_cast<unsigned>(std::max<int64_t>(1, ds::cuda::ceil_div(cols, kTile))));
  DS_CUDA_REQUIRE(grid.y <= 65535, "fp8_quantize_transpose: too many columns");
  const bool fast = vec8_ok(x, cols, ld, q ? ldq : 8) && ldqt % 4 == 0 && reinterpret_cast<uintptr_t>(qt) % 4 == 0 &&
                    (!q || reinterpret_cast<uintptr_t>(q) % 8 == 0);
  if (fast) {
    quantize_both_kernel<<<grid, kTThreads, 0, stream>>>(x, rows, cols, ld, amax, format, q, ldq, qt, ldqt, scale_t);
  } else {
    quantize_transpose_kernel<<<grid, kTThreads, 0, stream>>>(x, rows, cols, ld, amax, format, qt, ldqt, scale_t);
    if (q) {
      DS_CUDA_LAUNCH_CHECK();
      fp8_quantize(x, rows, cols, ld, amax, format, q, ldq, scale ? scale : scale_t, stream);
      return;
    }
  }
  DS_CUDA_LAUNCH_CHECK();
  // The row-major cast's scale: the same value (one amax); written by the first block of the fast kernel into
  // scale_t, copied here for a caller that keeps the two apart.
  if (q && scale && scale != scale_t)
    DS_CUDA_CHECK(cudaMemcpyAsync(scale, scale_t, sizeof(float), cudaMemcpyDeviceToDevice, stream));
}

}  // namespace ds::ops::cuda
