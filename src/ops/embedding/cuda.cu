// CUDA embedding lookup and deterministic backward (see cuda.h; math of embedding.h / cpu.cpp).
// Forward: out[n, :] = table[ids[n], :]; grid x over H in chunks of 256 threads x V values, grid y over tokens
// (looping beyond 65535); V = 8 (16-byte copies) when H % 8 == 0 and table/out are 16-byte aligned, else V = 1.
// Backward: one block row per unique id (grid y, looping), threads over H columns (8 per thread when aligned:
// one 16-byte dout load and two float4 dtable accesses). Each column starts from dtable[id, c] and adds the
// id's tokens one by one in the host-given order (ascending position), exactly the CPU reference's order; the
// position indices are fetched 8 at a time so the dout loads of a batch are in flight together. No atomics:
// every dtable element has one owner thread, so results are deterministic.
#include <cstdint>

#include "core/cuda/kernel_utils.cuh"
#include "ops/embedding/cuda.h"

namespace ds::ops::cuda {
namespace {

using namespace ds::cuda;

constexpr int kThreads = 256;
constexpr int kBatch = 8;

template <int V>
__global__ void __launch_bounds__(kThreads)
    embed_fwd_kernel(const int32_t* __restrict__ ids, const bf16* __restrict__ table, bf16* __restrict__ out, int64_t N,
                     int64_t H) {
  const int64_t c = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) * V;
  if (c >= H) return;
  for (int64_t n = blockIdx.y; n < N; n += gridDim.y) {
    const int64_t id = ids[n];
    if constexpr (V == 8)
      *reinterpret_cast<uint4*>(out + n * H + c) = __ldg(reinterpret_cast<const uint4*>(table + id * H + c));
    else
      out[n * H + c] = table[id * H + c];
  }
}

__device__ __forceinline__ void add_bf8(float a[8], const uint4& u) {
  float f[8];
  unpack8(u, f);
#pragma unroll
  for (int k = 0; k < 8; ++k) a[k] += f[k];
}

template <int V>
__global__ void __launch_bounds__(kThreads)
    embed_bwd_kernel(const int32_t* __restrict__ uniq_ids, const int32_t* __restrict__ starts,
                     const int32_t* __restrict__ positions, int64_t U, const bf16* __restrict__ dout,
                     float* __restrict__ dtable, int64_t H) {
  const int64_t c = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) * V;
  if (c >= H) return;
  for (int64_t u = blockIdx.y; u < U; u += gridDim.y) {
    const int64_t id = uniq_ids[u];
    const int64_t p0 = starts[u], p1 = starts[u + 1];
    float* dst = dtable + id * H + c;
    float acc[V];
    if constexpr (V == 8) {
      load_f8(dst, 0, acc);
    } else {
      acc[0] = dst[0];
    }
    for (int64_t p = p0; p < p1; p += kBatch) {
      const int m = p1 - p < kBatch ? static_cast<int>(p1 - p) : kBatch;
      int64_t pos[kBatch];
#pragma unroll
      for (int k = 0; k < kBatch; ++k) pos[k] = k < m ? positions[p + k] : 0;
      if constexpr (V == 8) {
        uint4 v[kBatch];
#pragma unroll
        for (int k = 0; k < kBatch; ++k)
          v[k] = k < m ? __ldg(reinterpret_cast<const uint4*>(dout + pos[k] * H + c)) : make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int k = 0; k < kBatch; ++k)
          if (k < m) add_bf8(acc, v[k]);
      } else {
        float v[kBatch];
#pragma unroll
        for (int k = 0; k < kBatch; ++k) v[k] = k < m ? __bfloat162float(dout[pos[k] * H + c]) : 0.f;
#pragma unroll
        for (int k = 0; k < kBatch; ++k)
          if (k < m) acc[0] += v[k];
      }
    }
    if constexpr (V == 8) {
      store_f8(dst, 0, acc);
    } else {
      dst[0] = acc[0];
    }
  }
}

dim3 grid_for(int64_t rows, int64_t H, int V) { return grid_cols_rows(H, V, kThreads, rows); }

}  // namespace

void embedding_forward(const int32_t* ids, const ds::cuda::bf16* table, ds::cuda::bf16* out, int64_t N, int64_t H,
                       cudaStream_t stream) {
  DS_CUDA_REQUIRE(N >= 0 && H > 0, "embedding_forward: N must be >= 0 and H > 0, got N=" + std::to_string(N) +
                                       " H=" + std::to_string(H));
  if (N == 0) return;
  DS_CUDA_REQUIRE(ids && table && out, "embedding_forward: null pointer argument");
  if (H % 8 == 0 && aligned16(table) && aligned16(out))
    embed_fwd_kernel<8><<<grid_for(N, H, 8), kThreads, 0, stream>>>(ids, table, out, N, H);
  else
    embed_fwd_kernel<1><<<grid_for(N, H, 1), kThreads, 0, stream>>>(ids, table, out, N, H);
  DS_CUDA_LAUNCH_CHECK();
}

void embedding_backward(const int32_t* uniq_ids, const int32_t* starts, const int32_t* positions, int64_t U,
                        const ds::cuda::bf16* dout, float* dtable, int64_t H, cudaStream_t stream) {
  DS_CUDA_REQUIRE(U >= 0 && H > 0, "embedding_backward: U must be >= 0 and H > 0, got U=" + std::to_string(U) +
                                       " H=" + std::to_string(H));
  if (U == 0) return;
  DS_CUDA_REQUIRE(uniq_ids && starts && positions && dout && dtable, "embedding_backward: null pointer argument");
  if (H % 8 == 0 && aligned16(dout) && aligned16(dtable))
    embed_bwd_kernel<8><<<grid_for(U, H, 8), kThreads, 0, stream>>>(uniq_ids, starts, positions, U, dout, dtable, H);
  else
    embed_bwd_kernel<1><<<grid_for(U, H, 1), kThreads, 0, stream>>>(uniq_ids, starts, positions, U, dout, dtable, H);
  DS_CUDA_LAUNCH_CHECK();
}

}  // namespace ds::ops::cuda
