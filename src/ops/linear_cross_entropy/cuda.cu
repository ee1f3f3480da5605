// Fused linear + cross-entropy on the GPU (see cuda.h; math of linear_cross_entropy.h).
//
// Per chunk of up to chunk_tokens rows (all rows are processed; ignored ones give zero loss and zero gradient):
//   1. S = h_c @ W^T in fp32 (cuBLASLt, C fp32), S: [cn, V] at the start of the scratch.
//   2. One block per row: pass 1 reads the row once with an online max / sum of exp (fp32, fixed-order block
//      reduction), lse = m + log(sum) and the per-token loss (double) go to per-token arrays. Pass 2 rewrites the
//      row IN PLACE as bf16 dlogits = grad_scale * (softmax * (1 + 2 z lse) - onehot(y)) (the target entry
//      recomputed from the fp32 logit in full precision): the bf16 row r occupies the first half of fp32 row r,
//      so the dlogits matrix is bf16 [cn, V] with leading dimension 2V. The row is walked in tiles in ascending
//      order; each tile is read into registers, the block synchronises, then writes: the bf16 bytes of tile t
//      cover only fp32 elements of tiles <= t, which every thread has already read.
//   3. dh_c = dlogits @ W (bf16 out, fp32 accumulation over V).
//   4. dW += dlogits^T @ h_c (fp32, beta = 1; chunks in ascending order).
// Finally one block sums the per-token losses in a fixed order into loss_out (double).
// Scratch: chunk * V fp32 logits + 2 * N doubles. No atomics anywhere: bitwise reproducible.
#include <algorithm>
#include <cstdint>
#include <string>

#include "ops/linear/cuda.h"
#include "ops/linear_cross_entropy/cuda.h"

namespace ds::ops::cuda {
namespace {

using ds::cuda::bf16;

constexpr int kRowThreads = 512;
constexpr int kUnroll = 4;  // vectors per thread per tile of pass 2
constexpr float kLog2e = 1.4426950408889634f;

size_t align256(size_t b) { return (b + 255) / 256 * 256; }

struct CeLayout {
  int64_t chunk = 0;
  size_t logits = 0, loss = 0, zloss = 0, total = 0;  // byte offsets (logits at 0) and total size
};

CeLayout ce_layout(int64_t N, int64_t V, int64_t chunk_tokens) {
  CeLayout l;
  l.chunk = std::max<int64_t>(1, std::min<int64_t>(chunk_tokens, std::max<int64_t>(N, 1)));
  l.logits = 0;
  l.loss = align256(static_cast<size_t>(l.chunk) * static_cast<size_t>(V) * sizeof(float));
  l.zloss = l.loss + align256(static_cast<size_t>(std::max<int64_t>(N, 1)) * sizeof(double));
  l.total = l.zloss + align256(static_cast<size_t>(std::max<int64_t>(N, 1)) * sizeof(double));
  return l;
}

// Merge of two (max, sum of exp(x - max)) pairs.
__device__ __forceinline__ void lse_combine(float& m, float& s, float m2, float s2) {
  const float mn = fmaxf(m, m2);
  const float a = (m == -INFINITY) ? 0.0f : s * exp2f((m - mn) * kLog2e);
  const float b = (m2 == -INFINITY) ? 0.0f : s2 * exp2f((m2 - mn) * kLog2e);
  m = mn;
  s = a + b;
}

__device__ __forceinline__ void store_bf16x4(bf16* dst, float a, float b, float c, float d) {
  __nv_bfloat162 lo = __floats2bfloat162_rn(a, b), hi = __floats2bfloat162_rn(c, d);
  uint2 u;
  u.x = *reinterpret_cast<uint32_t*>(&lo);
  u.y = *reinterpret_cast<uint32_t*>(&hi);
  *reinterpret_cast<uint2*>(dst) = u;
}

// One block per row of the chunk. kVec: V % 4 == 0 (float4 reads, 4 x bf16 writes).
template <bool kVec>
__global__ void __launch_bounds__(kRowThreads)
    ce_rows_kernel(float* S, int64_t V, const int32_t* targets, int64_t r0, int64_t ignore_index, double z, double gs,
                   bool want_grad, double* loss_tok, double* z_tok) {
  __shared__ float red_m[kRowThreads / 32], red_s[kRowThreads / 32];
  __shared__ float sh_ly, sh_lse, sh_c, sh_cy;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t r = blockIdx.x, n = r0 + r;
  float* row = S + r * V;
  bf16* drow = reinterpret_cast<bf16*>(row);  // the bf16 dlogits of row r: first half of its fp32 row
  const int64_t y = targets[n];

  if (y == ignore_index || y < 0 || y >= V) {
    if (tid == 0) {
      // A label outside [0, V) that is not ignore_index poisons the loss (labels are validated on the host).
      const double v = (y == ignore_index) ? 0.0 : __longlong_as_double(0x7ff8000000000000LL);
      loss_tok[n] = v;
      z_tok[n] = v;
    }
    if (want_grad) {
      if constexpr (kVec) {
        for (int64_t i = tid; i < V / 4; i += kRowThreads) store_bf16x4(drow + 4 * i, 0.f, 0.f, 0.f, 0.f);
      } else {
        for (int64_t i = tid; i < V; i += kRowThreads) drow[i] = __float2bfloat16(0.0f);
      }
    }
    return;
  }
  if (tid == 0) sh_ly = row[y];  // before pass 2 overwrites the row

  // Pass 1: online max / sum of exp per thread.
  float m = -INFINITY, s = 0.0f;
  if constexpr (kVec) {
    const float4* r4 = reinterpret_cast<const float4*>(row);
    const int64_t V4 = V / 4;
#pragma unroll 4
    for (int64_t i = tid; i < V4; i += kRowThreads) {
      const float4 v = r4[i];
      const float mn = fmaxf(m, fmaxf(fmaxf(v.x, v.y), fmaxf(v.z, v.w)));
      const float e = exp2f((v.x - mn) * kLog2e) + exp2f((v.y - mn) * kLog2e) + exp2f((v.z - mn) * kLog2e) +
                      exp2f((v.w - mn) * kLog2e);
      s = s * exp2f((m - mn) * kLog2e) + e;  // m = -inf: exp2f(-inf) = 0, s = 0
      m = mn;
    }
  } else {
    for (int64_t i = tid; i < V; i += kRowThreads) {
      const float x = row[i];
      const float mn = fmaxf(m, x);
      s = s * exp2f((m - mn) * kLog2e) + exp2f((x - mn) * kLog2e);
      m = mn;
    }
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const float m2 = __shfl_xor_sync(0xffffffffu, m, off), s2 = __shfl_xor_sync(0xffffffffu, s, off);
    lse_combine(m, s, m2, s2);
  }
  if (lane == 0) {
    red_m[warp] = m;
    red_s[warp] = s;
  }
  __syncthreads();
  if (tid == 0) {
    float M = red_m[0], Ssum = red_s[0];
    for (int w = 1; w < kRowThreads / 32; ++w) lse_combine(M, Ssum, red_m[w], red_s[w]);
    const double lse = static_cast<double>(M) + log(static_cast<double>(Ssum));
    const double ly = sh_ly;
    const double zl = z * lse * lse;
    loss_tok[n] = lse - ly + zl;
    z_tok[n] = zl;
    const double c = 1.0 + 2.0 * z * lse;
    sh_lse = static_cast<float>(lse);
    sh_c = static_cast<float>(gs * c);
    sh_cy = static_cast<float>(gs * (exp(ly - lse) * c - 1.0));
  }
  __syncthreads();
  if (!want_grad) return;

  // Pass 2: dlogits in place, tile by tile.
  const float nl = -sh_lse * kLog2e, c = sh_c, cy = sh_cy;
  if constexpr (kVec) {
    const float4* r4 = reinterpret_cast<const float4*>(row);
    const int64_t V4 = V / 4;
    constexpr int64_t kTile = int64_t(kRowThreads) * kUnroll;  // float4s per tile
    for (int64_t base = 0; base < V4; base += kTile) {
      float4 v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t i = base + u * kRowThreads + tid;
        if (i < V4) v[u] = r4[i];
      }
      __syncthreads();  // every read of this tile happens before any write that overlaps it
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t i = base + u * kRowThreads + tid;
        if (i < V4) {
          const int64_t e = 4 * i;
          float o0 = c * exp2f(fmaf(v[u].x, kLog2e, nl)), o1 = c * exp2f(fmaf(v[u].y, kLog2e, nl));
          float o2 = c * exp2f(fmaf(v[u].z, kLog2e, nl)), o3 = c * exp2f(fmaf(v[u].w, kLog2e, nl));
          if (y >= e && y < e + 4) {
            const int k = static_cast<int>(y - e);
            o0 = k == 0 ? cy : o0;
            o1 = k == 1 ? cy : o1;
            o2 = k == 2 ? cy : o2;
            o3 = k == 3 ? cy : o3;
          }
          store_bf16x4(drow + e, o0, o1, o2, o3);
        }
      }
    }
  } else {
    constexpr int64_t kTile = int64_t(kRowThreads) * kUnroll;  // elements per tile
    for (int64_t base = 0; base < V; base += kTile) {
      float v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t i = base + u * kRowThreads + tid;
        if (i < V) v[u] = row[i];
      }
      __syncthreads();
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t i = base + u * kRowThreads + tid;
        if (i < V) drow[i] = __float2bfloat16(i == y ? cy : c * exp2f(fmaf(v[u], kLog2e, nl)));
      }
    }
  }
}

// loss_out = {sum loss_tok, sum z_tok}, in a fixed order (strided per-thread sums, then a tree).
constexpr int kReduceThreads = 512;
__global__ void __launch_bounds__(kReduceThreads)
    ce_reduce_kernel(const double* loss_tok, const double* z_tok, int64_t N, double* out) {
  __shared__ double sa[kReduceThreads], sb[kReduceThreads];
  const int tid = threadIdx.x;
  double a = 0, b = 0;
  for (int64_t i = tid; i < N; i += kReduceThreads) {
    a += loss_tok[i];
    b += z_tok[i];
  }
  sa[tid] = a;
  sb[tid] = b;
  for (int st = kReduceThreads / 2; st > 0; st >>= 1) {
    __syncthreads();
    if (tid < st) {
      sa[tid] += sa[tid + st];
      sb[tid] += sb[tid + st];
    }
  }
  if (tid == 0) {
    out[0] = sa[0];
    out[1] = sb[0];
  }
}

}  // namespace

size_t linear_cross_entropy_scratch_bytes(int64_t N, int64_t H, int64_t V, int64_t chunk_tokens) {
  (void)H;
  DS_CUDA_REQUIRE(N >= 0 && V > 0 && chunk_tokens > 0,
                  "linear_cross_entropy_scratch_bytes: need N >= 0, V > 0, chunk_tokens > 0 (N=" + std::to_string(N) +
                      " V=" + std::to_string(V) + " chunk_tokens=" + std::to_string(chunk_tokens) + ")");
  return ce_layout(N, V, chunk_tokens).total;
}

void linear_cross_entropy(const bf16* h, const bf16* W, const int32_t* targets, int64_t N, int64_t H, int64_t V,
                          const ds::ops::LinearCeOptions& opt, double* loss_out, bf16* dh, float* dW, void* scratch,
                          cudaStream_t stream) {
  DS_CUDA_REQUIRE(N >= 0 && H > 0 && V > 0, "linear_cross_entropy: need N >= 0, H > 0, V > 0 (N=" +
                                                std::to_string(N) + " H=" + std::to_string(H) +
                                                " V=" + std::to_string(V) + ")");
  DS_CUDA_REQUIRE(opt.chunk_tokens > 0, "linear_cross_entropy: chunk_tokens must be > 0");
  DS_CUDA_REQUIRE(loss_out != nullptr, "linear_cross_entropy: loss_out is null");
  if (N == 0) {
    DS_CUDA_CHECK(cudaMemsetAsync(loss_out, 0, 2 * sizeof(double), stream));
    return;
  }
  DS_CUDA_REQUIRE(h != nullptr && W != nullptr && targets != nullptr && scratch != nullptr,
                  "linear_cross_entropy: h, W, targets and scratch must be non-null");
  DS_CUDA_REQUIRE(reinterpret_cast<uintptr_t>(scratch) % 256 == 0,
                  "linear_cross_entropy: scratch must be 256-byte aligned");
  const CeLayout L = ce_layout(N, V, opt.chunk_tokens);
  char* base = static_cast<char*>(scratch);
  float* S = reinterpret_cast<float*>(base + L.logits);
  double* loss_tok = reinterpret_cast<double*>(base + L.loss);
  double* z_tok = reinterpret_cast<double*>(base + L.zloss);
  const bool want_grad = dh != nullptr || dW != nullptr;
  const bool vec = V % 4 == 0;
  const bf16* dl = reinterpret_cast<const bf16*>(S);  // dlogits, bf16 [cn, V] with leading dimension 2V

  for (int64_t r0 = 0; r0 < N; r0 += L.chunk) {
    const int64_t cn = std::min(L.chunk, N - r0);
    const bf16* hc = h + r0 * H;
    gemm(false, true, cn, V, H, 1.0f, hc, H, W, H, 0.0f, S, true, V, stream);
    if (vec)
      ce_rows_kernel<true><<<static_cast<unsigned>(cn), kRowThreads, 0, stream>>>(
          S, V, targets, r0, opt.ignore_index, opt.z_loss, opt.grad_scale, want_grad, loss_tok, z_tok);
    else
      ce_rows_kernel<false><<<static_cast<unsigned>(cn), kRowThreads, 0, stream>>>(
          S, V, targets, r0, opt.ignore_index, opt.z_loss, opt.grad_scale, want_grad, loss_tok, z_tok);
    DS_CUDA_LAUNCH_CHECK();
    if (dh) gemm(false, false, cn, H, V, 1.0f, dl, 2 * V, W, H, 0.0f, dh + r0 * H, false, H, stream);
    if (dW) gemm(true, false, V, H, cn, 1.0f, dl, 2 * V, hc, H, 1.0f, dW, true, H, stream);
  }
  ce_reduce_kernel<<<1, kReduceThreads, 0, stream>>>(loss_tok, z_tok, N, loss_out);
  DS_CUDA_LAUNCH_CHECK();
}

}  // namespace ds::ops::cuda
