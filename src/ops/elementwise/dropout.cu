#include "ops/elementwise/dropout.h"

#include <algorithm>

#include "core/rng.h"

namespace ds::ops::cuda {

namespace {

using ds::cuda::bf16;

__global__ void dropout_select_kernel(const bf16* x, bf16* y, int64_t n, uint64_t key, double p) {
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x)
    y[e] = ds::dropout_drops(key, static_cast<uint64_t>(e), p) ? __float2bfloat16_rn(0.0f) : x[e];
}

__global__ void dropout_select_add_kernel(const bf16* d, bf16* dx, int64_t n, uint64_t key, double p) {
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x)
    if (!ds::dropout_drops(key, static_cast<uint64_t>(e), p))
      dx[e] = __float2bfloat16_rn(__bfloat162float(dx[e]) + __bfloat162float(d[e]));
}

unsigned blocks_for(int64_t n) {
  return static_cast<unsigned>(std::min<int64_t>(ds::cuda::ceil_div(n, 256), 65536));
}

}  // namespace

void dropout_select(const bf16* x, bf16* y, int64_t n, uint64_t key, double p, cudaStream_t stream) {
  if (n <= 0) return;
  dropout_select_kernel<<<blocks_for(n), 256, 0, stream>>>(x, y, n, key, p);
  DS_CUDA_LAUNCH_CHECK();
}

void dropout_select_add(const bf16* d, bf16* dx, int64_t n, uint64_t key, double p, cudaStream_t stream) {
  if (n <= 0) return;
  dropout_select_add_kernel<<<blocks_for(n), 256, 0, stream>>>(d, dx, n, key, p);
  DS_CUDA_LAUNCH_CHECK();
}

}  // namespace ds::ops::cuda
