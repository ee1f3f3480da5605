#include "ops/elementwise/random.h"

namespace ds::ops::cuda {

namespace {

__device__ __forceinline__ uint64_t mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

__device__ __forceinline__ float unit(uint64_t seed, int64_t i) {
  return static_cast<float>(mix64(seed * 0x632be59bd9b4e019ull + static_cast<uint64_t>(i)) >> 40) * 0x1.0p-24f;
}

template <typename T>
__global__ void fill_kernel(T* x, int64_t n, uint64_t seed, float lo, float hi) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float v = lo + (hi - lo) * unit(seed, i);
    if constexpr (sizeof(T) == 2) x[i] = __float2bfloat16_rn(v);
    else x[i] = v;
  }
}

__global__ void fill_int_kernel(int32_t* x, int64_t n, uint64_t seed, int32_t n_values) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    x[i] = static_cast<int32_t>(mix64(seed ^ (static_cast<uint64_t>(i) * 0xd1b54a32d192ed03ull)) % n_values);
}

int blocks_for(int64_t n) { return static_cast<int>(std::min<int64_t>(ds::cuda::ceil_div(n, 256), 65536)); }

}  // namespace

void fill_uniform(ds::cuda::bf16* x, int64_t n, uint64_t seed, float lo, float hi, cudaStream_t stream) {
  if (n <= 0) return;
  fill_kernel<<<blocks_for(n), 256, 0, stream>>>(x, n, seed, lo, hi);
  DS_CUDA_LAUNCH_CHECK();
}
void fill_uniform(float* x, int64_t n, uint64_t seed, float lo, float hi, cudaStream_t stream) {
  if (n <= 0) return;
  fill_kernel<<<blocks_for(n), 256, 0, stream>>>(x, n, seed, lo, hi);
  DS_CUDA_LAUNCH_CHECK();
}
void fill_uniform_int(int32_t* x, int64_t n, uint64_t seed, int32_t n_values, cudaStream_t stream) {
  if (n <= 0) return;
  DS_CUDA_REQUIRE(n_values > 0, "fill_uniform_int: n_values must be positive");
  fill_int_kernel<<<blocks_for(n), 256, 0, stream>>>(x, n, seed, n_values);
  DS_CUDA_LAUNCH_CHECK();
}

}  // namespace ds::ops::cuda
