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
//   4. dW += dlogits^T @ h_c (fp32, beta = 1; chunks in ascending order; the first at beta 0 with dW_overwrite).
// Finally one block sums the per-token losses in a fixed order into loss_out (double).
// Scratch: chunk * V fp32 logits + 2 * N doubles. No atomics anywhere: bitwise reproducible.
//
// opt.fp8_grads (`--fp8-lm-head`, linear_cross_entropy.h; ops/linear/fp8.h for the casts and the GEMM's TN form):
// before the chunks, W is cast transposed to E4M3 Wt [H, V] and h to E4M3 ht [H, N16] (amax passes: atomicMax, exact);
// pass 2 writes each dlogit as its E5M2 code at inv = fp8_inv_scale(|grad_scale|) into the first quarter of its
// fp32 row (byte e of a row covers fp32 element e / 4 <= e: the same in-place argument as for bf16); then
// 3'. dh_c = q(dlogits) . Wt^T (FP8 GEMM, lda 4V), 4'. the codes transposed to dlt [V, chunk16], dW += dlt . ht_c^T
// (FP8 GEMM over the chunk's tokens, zero-padded to 16). Needs V % 16 == 0 and chunk_tokens % 16 == 0.
// Extra scratch: V H + H N16 + V chunk16 bytes and the scale slots.
#include <cuda_fp8.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#include "ops/linear/cuda.h"
#include "ops/linear/fp8.h"
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
  // fp8_grads only: Wt [H, V], ht [H, n16], dlt [V, chunk16] (bytes; the last two only with dW) and the slots
  int64_t n16 = 0, chunk16 = 0;
  size_t wt = 0, ht = 0, dlt = 0, slots = 0;
};

// Slots of the FP8 path's floats, kFp8Slot apart (each on its own 256 bytes, as cuBLASLt's scale pointers want).
enum CeSlot { kAmaxW = 0, kScaleW, kAmaxH, kScaleH, kScaleDl, kNumSlots };

CeLayout ce_layout(int64_t N, int64_t H, int64_t V, int64_t chunk_tokens, bool fp8, bool with_dW) {
  CeLayout l;
  l.chunk = std::max<int64_t>(1, std::min<int64_t>(chunk_tokens, std::max<int64_t>(N, 1)));
  l.logits = 0;
  l.loss = align256(static_cast<size_t>(l.chunk) * static_cast<size_t>(V) * sizeof(float));
  l.zloss = l.loss + align256(static_cast<size_t>(std::max<int64_t>(N, 1)) * sizeof(double));
  l.total = l.zloss + align256(static_cast<size_t>(std::max<int64_t>(N, 1)) * sizeof(double));
  if (fp8) {
    l.n16 = fp8_padded(std::max<int64_t>(N, 1));
    l.chunk16 = fp8_padded(l.chunk);
    l.wt = l.total;
    l.ht = l.wt + align256(static_cast<size_t>(H) * static_cast<size_t>(V));
    l.dlt = l.ht + (with_dW ? align256(static_cast<size_t>(H) * static_cast<size_t>(l.n16)) : 0);
    l.slots = l.dlt + (with_dW ? align256(static_cast<size_t>(V) * static_cast<size_t>(l.chunk16)) : 0);
    l.total = l.slots + align256(kNumSlots * kFp8Slot * sizeof(float));
  }
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

// Four dlogits as E5M2 codes of o * inv (core/fp8.h's cast), packed little-endian.
__device__ __forceinline__ void store_e5m2x4(uint8_t* dst, float inv, float a, float b, float c, float d) {
  const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(a * inv, b * inv), __NV_SATFINITE, __NV_E5M2);
  const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(c * inv, d * inv), __NV_SATFINITE, __NV_E5M2);
  *reinterpret_cast<uint32_t*>(dst) = lo | (hi << 16);
}

// One block per row of the chunk. kVec: V % 4 == 0 (float4 reads, 4 x bf16 writes). kF8 (needs kVec): the dlogits
// as E5M2 codes at inv8 (4 bytes per float4) instead of bf16; block 0 writes the GEMMs' scale 1 / inv8 to *scale8.
template <bool kVec, bool kF8 = false>
__global__ void __launch_bounds__(kRowThreads)
    ce_rows_kernel(float* S, int64_t V, const int32_t* targets, int64_t r0, int64_t ignore_index, double z, double gs,
                   bool want_grad, double* loss_tok, double* z_tok, float inv8 = 1.f, float* scale8 = nullptr) {
  static_assert(kVec || !kF8, "the FP8 dlogits need V % 4 == 0");
  __shared__ float red_m[kRowThreads / 32], red_s[kRowThreads / 32];
  __shared__ float sh_ly, sh_lse, sh_c, sh_cy;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t r = blockIdx.x, n = r0 + r;
  float* row = S + r * V;
  bf16* drow = reinterpret_cast<bf16*>(row);  // the bf16 dlogits of row r: first half of its fp32 row
  uint8_t* qrow = reinterpret_cast<uint8_t*>(row);  // kF8: its E5M2 codes, first quarter
  const int64_t y = targets[n];
  if constexpr (kF8) {
    if (blockIdx.x == 0 && tid == 0) *scale8 = fp8_dequant_scale(inv8);
  }

  if (y == ignore_index || y < 0 || y >= V) {
    if (tid == 0) {
      // A label outside [0, V) that is not ignore_index poisons the loss (labels are validated on the host).
      const double v = (y == ignore_index) ? 0.0 : __longlong_as_double(0x7ff8000000000000LL);
      loss_tok[n] = v;
      z_tok[n] = v;
    }
    if (want_grad) {
      if constexpr (kF8) {
        for (int64_t i = tid; i < V / 4; i += kRowThreads) *reinterpret_cast<uint32_t*>(qrow + 4 * i) = 0u;
      } else if constexpr (kVec) {
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
          if constexpr (kF8) {
            store_e5m2x4(qrow + e, inv8, o0, o1, o2, o3);
          } else {
            store_bf16x4(drow + e, o0, o1, o2, o3);
          }
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

size_t linear_cross_entropy_scratch_bytes(int64_t N, int64_t H, int64_t V, int64_t chunk_tokens, bool fp8_grads,
                                          bool with_dW) {
  DS_CUDA_REQUIRE(N >= 0 && H > 0 && V > 0 && chunk_tokens > 0,
                  "linear_cross_entropy_scratch_bytes: need N >= 0, H > 0, V > 0, chunk_tokens > 0 (N=" +
                      std::to_string(N) + " H=" + std::to_string(H) + " V=" + std::to_string(V) +
                      " chunk_tokens=" + std::to_string(chunk_tokens) + ")");
  return ce_layout(N, H, V, chunk_tokens, fp8_grads, with_dW).total;
}

std::string linear_cross_entropy_fp8_unsupported(int64_t H, int64_t V, int64_t chunk_tokens) {
  if (V % 16 != 0) return "vocab_size " + std::to_string(V) + " is not a multiple of 16";
  if (H % 16 != 0) return "hidden_size " + std::to_string(H) + " is not a multiple of 16";
  if (chunk_tokens % 16 != 0) return "the loss chunk of " + std::to_string(chunk_tokens) + " tokens is not a multiple of 16";
  return {};
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
    if (dW && opt.dW_overwrite) DS_CUDA_CHECK(cudaMemsetAsync(dW, 0, static_cast<size_t>(V * H) * sizeof(float), stream));
    return;
  }
  DS_CUDA_REQUIRE(h != nullptr && W != nullptr && targets != nullptr && scratch != nullptr,
                  "linear_cross_entropy: h, W, targets and scratch must be non-null");
  DS_CUDA_REQUIRE(reinterpret_cast<uintptr_t>(scratch) % 256 == 0,
                  "linear_cross_entropy: scratch must be 256-byte aligned");
  const bool want_grad = dh != nullptr || dW != nullptr;
  const bool f8 = opt.fp8_grads && want_grad;
  if (f8) {
    const std::string why = linear_cross_entropy_fp8_unsupported(H, V, opt.chunk_tokens);
    DS_CUDA_REQUIRE(why.empty(), "linear_cross_entropy: the FP8 lm head (--fp8-lm-head) needs " + why);
    DS_CUDA_REQUIRE(opt.z_loss == 0, "linear_cross_entropy: the FP8 lm head (--fp8-lm-head) needs z_loss 0, got " +
                                         std::to_string(opt.z_loss));
  }
  const CeLayout L = ce_layout(N, H, V, opt.chunk_tokens, f8, dW != nullptr);
  char* base = static_cast<char*>(scratch);
  float* S = reinterpret_cast<float*>(base + L.logits);
  double* loss_tok = reinterpret_cast<double*>(base + L.loss);
  double* z_tok = reinterpret_cast<double*>(base + L.zloss);
  const bool vec = V % 4 == 0;
  const bf16* dl = reinterpret_cast<const bf16*>(S);  // dlogits, bf16 [cn, V] with leading dimension 2V
  const uint8_t* dq = reinterpret_cast<const uint8_t*>(S);  // f8: their E5M2 codes [cn, V], leading dimension 4V
  uint8_t* Wt = reinterpret_cast<uint8_t*>(base + L.wt);
  uint8_t* ht = reinterpret_cast<uint8_t*>(base + L.ht);
  uint8_t* dlt = reinterpret_cast<uint8_t*>(base + L.dlt);
  float* slot = reinterpret_cast<float*>(base + L.slots);
  auto at = [&](CeSlot k) { return slot + k * kFp8Slot; };
  const float inv8 = f8 ? fp8_inv_scale(static_cast<float>(std::fabs(opt.grad_scale)), Fp8Format::E5M2) : 1.f;
  if (f8) {
    if (dh) {
      fp8_amax(W, V, H, H, at(kAmaxW), stream);
      fp8_quantize_transpose(W, V, H, H, at(kAmaxW), Fp8Format::E4M3, Wt, V, at(kScaleW), stream);
    }
    if (dW) {
      fp8_amax(h, N, H, H, at(kAmaxH), stream);
      fp8_quantize_transpose(h, N, H, H, at(kAmaxH), Fp8Format::E4M3, ht, L.n16, at(kScaleH), stream);
    }
  }

  for (int64_t r0 = 0; r0 < N; r0 += L.chunk) {
    const int64_t cn = std::min(L.chunk, N - r0);
    const bf16* hc = h + r0 * H;
    const float dW_beta = r0 == 0 && opt.dW_overwrite ? 0.0f : 1.0f;  // opt.dW_overwrite: the first chunk writes dW
    gemm(false, true, cn, V, H, 1.0f, hc, H, W, H, 0.0f, S, true, V, stream);
    if (f8)
      ce_rows_kernel<true, true><<<static_cast<unsigned>(cn), kRowThreads, 0, stream>>>(
          S, V, targets, r0, opt.ignore_index, opt.z_loss, opt.grad_scale, want_grad, loss_tok, z_tok, inv8,
          at(kScaleDl));
    else if (vec)
      ce_rows_kernel<true><<<static_cast<unsigned>(cn), kRowThreads, 0, stream>>>(
          S, V, targets, r0, opt.ignore_index, opt.z_loss, opt.grad_scale, want_grad, loss_tok, z_tok);
    else
      ce_rows_kernel<false><<<static_cast<unsigned>(cn), kRowThreads, 0, stream>>>(
          S, V, targets, r0, opt.ignore_index, opt.z_loss, opt.grad_scale, want_grad, loss_tok, z_tok);
    DS_CUDA_LAUNCH_CHECK();
    if (f8) {
      // the TN form (ops/linear/fp8.h): dh_c[cn, H] = dq[cn, V] . Wt[H, V]^T; dW[V, H] += dlt[V, c16] . ht_c[H, c16]^T
      const int64_t c16 = fp8_padded(cn);
      if (dh)
        gemm_fp8(Fp8Matrix{dq, cn, V, 4 * V, Fp8Format::E5M2, at(kScaleDl)},
                 Fp8Matrix{Wt, H, V, V, Fp8Format::E4M3, at(kScaleW)}, dh + r0 * H, false, H, 0.0f, false, stream);
      if (dW) {
        fp8_transpose(dq, cn, V, 4 * V, dlt, c16, stream);
        gemm_fp8(Fp8Matrix{dlt, V, c16, c16, Fp8Format::E5M2, at(kScaleDl)},
                 Fp8Matrix{ht + r0, H, c16, L.n16, Fp8Format::E4M3, at(kScaleH)}, dW, true, H, dW_beta, false,
                 stream);
      }
      continue;
    }
    if (dh) gemm(false, false, cn, H, V, 1.0f, dl, 2 * V, W, H, 0.0f, dh + r0 * H, false, H, stream);
    if (dW) gemm(true, false, V, H, cn, 1.0f, dl, 2 * V, hc, H, dW_beta, dW, true, H, stream);
  }
  ce_reduce_kernel<<<1, kReduceThreads, 0, stream>>>(loss_tok, z_tok, N, loss_out);
  DS_CUDA_LAUNCH_CHECK();
}

}  // namespace ds::ops::cuda
