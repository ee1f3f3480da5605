// Kernels of tests/cuda_large_util.h. Every reduction writes one partial per block (block sums in a fixed order)
// and the host adds the partials in order: deterministic results.
#include "cuda_large_util.h"

#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace ds::test::cuda {
namespace {

using ::ds::cuda::bf16;

constexpr int kThreads = 256;
constexpr int kMaxBlocks = 4096;

__device__ __forceinline__ uint64_t mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// One warp per row; lane l holds elements l, l + 32, ... (dim / 32 of them, at most 32).
__global__ void unit_rows_kernel(bf16* x, int64_t rows, int dim, uint64_t seed) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  float v[32];
  const int per = dim / 32;
  for (int64_t r = blockIdx.x * static_cast<int64_t>(blockDim.x / 32) + threadIdx.x / 32; r < rows; r += warps) {
    float s = 0;
    for (int j = 0; j < per; ++j) {
      const uint64_t i = static_cast<uint64_t>(r) * dim + lane + 32 * j;
      const float u = static_cast<float>(mix64(seed * 0x632be59bd9b4e019ull + i) >> 40) * 0x1.0p-24f;
      v[j] = 2.0f * u - 1.0f;
      s += v[j] * v[j];
    }
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    const float inv = rsqrtf(s + 1e-6f);
    for (int j = 0; j < per; ++j) x[r * dim + lane + 32 * j] = __float2bfloat16_rn(v[j] * inv);
  }
}

__device__ __forceinline__ float as_f32(bf16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float as_f32(float x) { return x; }

// Block sums of a warp-then-block reduction, in a fixed order.
template <typename T>
__device__ T block_sum(T x, T* shared) {
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  if ((threadIdx.x & 31) == 0) shared[threadIdx.x / 32] = x;
  __syncthreads();
  T total = 0;
  if (threadIdx.x == 0)
    for (int w = 0; w < kThreads / 32; ++w) total += shared[w];
  __syncthreads();
  return total;
}

// partial[3 b .. 3 b + 2] = (sum (got - ref)^2, sum ref^2, non-finite count) of block b.
template <typename T>
__global__ void rel_l2_kernel(const T* got, const T* ref, int64_t n, double* partial) {
  __shared__ double sh[kThreads / 32];
  double num = 0, den = 0, bad = 0;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const double x = as_f32(got[i]), y = as_f32(ref[i]);
    if (!isfinite(x) || !isfinite(y)) {
      bad += 1;
      continue;
    }
    num += (x - y) * (x - y);
    den += y * y;
  }
  num = block_sum(num, sh);
  den = block_sum(den, sh);
  bad = block_sum(bad, sh);
  if (threadIdx.x == 0) {
    partial[3 * blockIdx.x] = num;
    partial[3 * blockIdx.x + 1] = den;
    partial[3 * blockIdx.x + 2] = bad;
  }
}

template <typename T>
__global__ void nonfinite_kernel(const T* x, int64_t n, unsigned long long* partial) {
  __shared__ unsigned long long sh[kThreads / 32];
  unsigned long long bad = 0;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    bad += isfinite(as_f32(x[i])) ? 0 : 1;
  bad = block_sum(bad, sh);
  if (threadIdx.x == 0) partial[blockIdx.x] = bad;
}

__global__ void diff_kernel(const uint32_t* a, const uint32_t* b, int64_t n, unsigned long long* partial) {
  __shared__ unsigned long long sh[kThreads / 32];
  unsigned long long diff = 0;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    diff += a[i] != b[i] ? 1 : 0;
  diff = block_sum(diff, sh);
  if (threadIdx.x == 0) partial[blockIdx.x] = diff;
}

int blocks_for(int64_t n) {
  return static_cast<int>(std::clamp<int64_t>(::ds::cuda::ceil_div(n, kThreads), 1, kMaxBlocks));
}

// Device partials of a reduction, freed on scope exit; down() waits for the stream.
template <typename T>
struct Partials {
  explicit Partials(size_t n) : n(n) { DS_CUDA_CHECK(cudaMalloc(&p, n * sizeof(T))); }
  ~Partials() { cudaFree(p); }
  Partials(const Partials&) = delete;
  Partials& operator=(const Partials&) = delete;
  std::vector<T> down(cudaStream_t stream) const {
    std::vector<T> h(n);
    DS_CUDA_CHECK(cudaMemcpyAsync(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost, stream));
    DS_CUDA_CHECK(cudaStreamSynchronize(stream));
    return h;
  }
  T* p = nullptr;
  size_t n;
};

template <typename T>
double rel_l2_impl(const T* got, const T* ref, int64_t n, cudaStream_t stream) {
  if (n <= 0) return 0;
  const int blocks = blocks_for(n);
  Partials<double> part(3 * static_cast<size_t>(blocks));
  rel_l2_kernel<T><<<blocks, kThreads, 0, stream>>>(got, ref, n, part.p);
  DS_CUDA_LAUNCH_CHECK();
  const std::vector<double> h = part.down(stream);
  double num = 0, den = 0, bad = 0;
  for (int b = 0; b < blocks; ++b) num += h[3 * b], den += h[3 * b + 1], bad += h[3 * b + 2];
  if (bad > 0) return INFINITY;
  if (num == 0) return 0;
  return std::sqrt(num) / std::max(std::sqrt(den), 1e-300);
}

template <typename T>
int64_t nonfinite_impl(const T* x, int64_t n, cudaStream_t stream) {
  if (n <= 0) return 0;
  const int blocks = blocks_for(n);
  Partials<unsigned long long> part(static_cast<size_t>(blocks));
  nonfinite_kernel<T><<<blocks, kThreads, 0, stream>>>(x, n, part.p);
  DS_CUDA_LAUNCH_CHECK();
  int64_t bad = 0;
  for (unsigned long long b : part.down(stream)) bad += static_cast<int64_t>(b);
  return bad;
}

}  // namespace

void fill_unit_rows(bf16* x, int64_t rows, int64_t dim, uint64_t seed, cudaStream_t stream) {
  DS_CUDA_REQUIRE(dim > 0 && dim % 32 == 0 && dim <= 1024, "fill_unit_rows: dim must be a multiple of 32, <= 1024");
  if (rows <= 0) return;
  const int blocks = static_cast<int>(std::min<int64_t>(::ds::cuda::ceil_div(rows, kThreads / 32), 65536));
  unit_rows_kernel<<<blocks, kThreads, 0, stream>>>(x, rows, static_cast<int>(dim), seed);
  DS_CUDA_LAUNCH_CHECK();
}

double rel_l2(const bf16* got, const bf16* ref, int64_t n, cudaStream_t stream) {
  return rel_l2_impl(got, ref, n, stream);
}
double rel_l2(const float* got, const float* ref, int64_t n, cudaStream_t stream) {
  return rel_l2_impl(got, ref, n, stream);
}
int64_t count_nonfinite(const bf16* x, int64_t n, cudaStream_t stream) { return nonfinite_impl(x, n, stream); }
int64_t count_nonfinite(const float* x, int64_t n, cudaStream_t stream) { return nonfinite_impl(x, n, stream); }

namespace {
__global__ void scale_kernel(float* x, int64_t n, float s) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    x[i] *= s;
}
}  // namespace

void scale(float* x, int64_t n, float s, cudaStream_t stream) {
  if (n == 0) return;
  scale_kernel<<<blocks_for(n), kThreads, 0, stream>>>(x, n, s);
  DS_CUDA_LAUNCH_CHECK();
}

bool same_bytes(const void* a, const void* b, size_t bytes, cudaStream_t stream) {
  DS_CUDA_REQUIRE(bytes % 4 == 0, "same_bytes: bytes must be a multiple of 4");
  const int64_t n = static_cast<int64_t>(bytes / 4);
  if (n == 0) return true;
  const int blocks = blocks_for(n);
  Partials<unsigned long long> part(static_cast<size_t>(blocks));
  diff_kernel<<<blocks, kThreads, 0, stream>>>(static_cast<const uint32_t*>(a), static_cast<const uint32_t*>(b), n,
                                               part.p);
  DS_CUDA_LAUNCH_CHECK();
  for (unsigned long long d : part.down(stream))
    if (d) return false;
  return true;
}

}  // namespace ds::test::cuda
