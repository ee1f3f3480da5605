// CUDA AdamW over the flat fp32 master buffer, bf16 copy, and a deterministic sum of squares (see cuda.h;
// math of adamw.h / cpu.cpp, torch.optim.AdamW semantics):
//   g = grad * grad_scale;  p *= 1 - lr*wd;  m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2;
//   p -= (lr / (1-b1^t)) * m / (sqrt(v) / sqrt(1-b2^t) + eps)
// The step constants are computed on the host in double (as the CPU reference), the update in fp32.
// Elementwise kernels are grid-stride loops; 4 elements per thread (float4, and an 8-byte bf16x4 store) when
// every pointer allows it, else scalar. sum_squares: a fixed grid (a function of n only) in which each block
// sums a fixed contiguous chunk of elements in double (thread-strided, then a fixed shuffle/shared-memory tree)
// into scratch[block]; a single block then sums the partials in a fixed order and writes *out.
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "core/cuda/kernel_utils.cuh"
#include "ops/adamw/bf16_state.h"
#include "ops/adamw/cuda.h"
#include "ops/adamw/q8_state.h"

namespace ds::ops::cuda {
namespace {

using namespace ds::cuda;

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 4096;     // elementwise grids (grid-stride beyond)
// The AdamW updates' grids: one pass of short-lived blocks up to 2^28 threads (grid-stride beyond), so that a
// kernel on a higher-priority stream takes the SMs as the update's blocks retire (the updates run on the engine's
// low-priority side stream, overlapped with the step: model/gpu_model.cpp).
constexpr int64_t kMaxUpdateBlocks = int64_t{1} << 20;
constexpr int64_t kSumChunk = 16384;     // elements per sum_squares block at least
constexpr int64_t kMaxSumBlocks = 1024;  // at most this many partials

struct AdamConsts {
  float b1, b2, decay, step_size, inv_sqrt_bc2, eps, gs;
};

// A gradient read as fp32: an fp32 gradient as it is, a bf16 one (uint16_t bits; --gradients bf16) widened exactly.
// grad4: elements 4i .. 4i + 3 (the pointer aligned to vec_align<G>).
template <typename G>
constexpr size_t vec_align = 4 * sizeof(G);
__device__ __forceinline__ float grad1(const float* g, int64_t i) { return g[i]; }
__device__ __forceinline__ float grad1(const uint16_t* g, int64_t i) { return bf16_state::widen(g[i]); }
__device__ __forceinline__ float4 grad4(const float* g, int64_t i) { return __ldg(reinterpret_cast<const float4*>(g) + i); }
__device__ __forceinline__ float4 grad4(const uint16_t* g, int64_t i) {
  const ushort4 u = __ldg(reinterpret_cast<const ushort4*>(g) + i);
  return make_float4(bf16_state::widen(u.x), bf16_state::widen(u.y), bf16_state::widen(u.z), bf16_state::widen(u.w));
}

__device__ __forceinline__ float adam_one(float& p, float g, float& m, float& v, const AdamConsts& k) {
  g *= k.gs;
  float pp = p * k.decay;
  const float mm = k.b1 * m + (1.0f - k.b1) * g;
  const float vv = k.b2 * v + (1.0f - k.b2) * g * g;
  pp -= k.step_size * mm / (sqrtf(vv) * k.inv_sqrt_bc2 + k.eps);
  p = pp, m = mm, v = vv;
  return pp;
}

template <typename G>
__global__ void __launch_bounds__(kThreads)
    adamw_vec4_kernel(float* __restrict__ param, const G* __restrict__ grad, float* __restrict__ m,
                      float* __restrict__ v, bf16* __restrict__ pb, int64_t n4, AdamConsts k) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n4;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    float4 p = reinterpret_cast<float4*>(param)[i];
    const float4 g = grad4(grad, i);
    float4 mm = reinterpret_cast<float4*>(m)[i];
    float4 vv = reinterpret_cast<float4*>(v)[i];
    adam_one(p.x, g.x, mm.x, vv.x, k);
    adam_one(p.y, g.y, mm.y, vv.y, k);
    adam_one(p.z, g.z, mm.z, vv.z, k);
    adam_one(p.w, g.w, mm.w, vv.w, k);
    reinterpret_cast<float4*>(param)[i] = p;
    reinterpret_cast<float4*>(m)[i] = mm;
    reinterpret_cast<float4*>(v)[i] = vv;
    if (pb) reinterpret_cast<uint2*>(pb)[i] = make_uint2(pack2(p.x, p.y), pack2(p.z, p.w));
  }
}

// Elements [begin, n) one per thread (the whole buffer when unaligned, or the tail after the vector part).
template <typename G>
__global__ void __launch_bounds__(kThreads)
    adamw_scalar_kernel(float* __restrict__ param, const G* __restrict__ grad, float* __restrict__ m,
                        float* __restrict__ v, bf16* __restrict__ pb, int64_t begin, int64_t n, AdamConsts k) {
  for (int64_t i = begin + static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    float p = param[i], mm = m[i], vv = v[i];
    adam_one(p, grad1(grad, i), mm, vv, k);
    param[i] = p, m[i] = mm, v[i] = vv;
    if (pb) pb[i] = __float2bfloat16_rn(p);
  }
}

// The lean mode (bf16_state.h): 4 elements per thread (8-byte bf16 loads/stores, a float4 gradient) when every
// pointer allows it, else one.
template <typename G>
__global__ void __launch_bounds__(kThreads)
    adamw_bf16_vec4_kernel(uint16_t* __restrict__ param, const G* __restrict__ grad, uint16_t* __restrict__ m,
                           uint16_t* __restrict__ v, int64_t n4, int64_t index0, bf16_state::Consts k) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n4;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    ushort4 p = reinterpret_cast<ushort4*>(param)[i], mm = reinterpret_cast<ushort4*>(m)[i],
            vv = reinterpret_cast<ushort4*>(v)[i];
    const float4 g = grad4(grad, i);
    const uint64_t e = static_cast<uint64_t>(index0 + 4 * i);
    bf16_state::update(p.x, g.x, mm.x, vv.x, k, e);
    bf16_state::update(p.y, g.y, mm.y, vv.y, k, e + 1);
    bf16_state::update(p.z, g.z, mm.z, vv.z, k, e + 2);
    bf16_state::update(p.w, g.w, mm.w, vv.w, k, e + 3);
    reinterpret_cast<ushort4*>(param)[i] = p;
    reinterpret_cast<ushort4*>(m)[i] = mm;
    reinterpret_cast<ushort4*>(v)[i] = vv;
  }
}
template <typename G>
__global__ void __launch_bounds__(kThreads)
    adamw_bf16_scalar_kernel(uint16_t* __restrict__ param, const G* __restrict__ grad, uint16_t* __restrict__ m,
                             uint16_t* __restrict__ v, int64_t begin, int64_t n, int64_t index0, bf16_state::Consts k) {
  for (int64_t i = begin + static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * kThreads)
    bf16_state::update(param[i], grad1(grad, i), m[i], v[i], k, static_cast<uint64_t>(index0 + i));
}

// The 8-bit state (q8_state.h): one warp per quantization block, lane l on the block's elements 8l .. 8l + 7 (a
// 16-byte bf16 load, two float4 gradient loads and 8-byte code loads where the whole group is in range and every
// pointer is aligned, else element by element); the block's new absmax of m and r by warp shuffles (fmaxf: exact in
// any order), so no block-wide barrier inside the work. Each CUDA block takes kQ8BlocksPerCta consecutive
// quantization blocks and exits: short-lived blocks let a kernel on a higher-priority stream take the SMs as they
// free up (the update runs on the engine's low-priority side stream, model/gpu_model.cpp). The tables are copied
// to shared memory once per CUDA block (770 floats, and the codes' bucket tables: 2736 bytes).
static_assert(q8_state::kBlock == 32 * 8, "a quantization block is one warp of 8 elements per lane");
constexpr int kQ8WarpsPerCta = kThreads / 32;
constexpr int64_t kQ8BlocksPerCta = 4 * kQ8WarpsPerCta;  // each warp takes 4 quantization blocks
static_assert(kQ8BlocksPerCta == q8_state::kPartialBlocks, "a partial (and a chunk_mask byte) is one CUDA block's work");
__constant__ float c_q8_m_mag[128] = {DS_Q8_M_MAGNITUDES};
__constant__ float c_q8_m_thr[127] = {DS_Q8_M_THRESHOLDS};
__constant__ float c_q8_r_val[256] = {DS_Q8_R_VALUES};
__constant__ float c_q8_r_thr[255] = {DS_Q8_R_THRESHOLDS};
// The codes' bucket tables (q8_state.h count_below_bucketed), copied to shared memory by 32-bit words.
struct alignas(16) Q8Buckets {
  std::array<uint8_t, q8_state::kMBuckets> m;
  std::array<uint8_t, q8_state::kRBuckets> r;
};
static_assert(q8_state::kMBuckets % 4 == 0 && q8_state::kRBuckets % 4 == 0, "the bucket tables copy by words");
__device__ const Q8Buckets g_q8_buckets = {q8_state::kMBucketLo, q8_state::kRBucketLo};

__device__ __forceinline__ bool dev_aligned(const void* p, unsigned bytes) {
  return (reinterpret_cast<uintptr_t>(p) & (bytes - 1)) == 0;
}
__device__ __forceinline__ void load8_grad(const float* g, float* x) {
  const float4 a = __ldg(reinterpret_cast<const float4*>(g)), b = __ldg(reinterpret_cast<const float4*>(g) + 1);
  x[0] = a.x, x[1] = a.y, x[2] = a.z, x[3] = a.w, x[4] = b.x, x[5] = b.y, x[6] = b.z, x[7] = b.w;
}
__device__ __forceinline__ void load8_grad(const uint16_t* g, float* x) {
  const uint4 a = __ldg(reinterpret_cast<const uint4*>(g));
  const uint32_t w[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    x[2 * j] = bf16_state::widen(static_cast<uint16_t>(w[j] & 0xffffu));
    x[2 * j + 1] = bf16_state::widen(static_cast<uint16_t>(w[j] >> 16));
  }
}

// The gradients' sums of squares in this partition (cuda.h sum_squares_partials): one partial per CUDA block's
// kQ8BlocksPerCta quantization blocks; each lane adds its elements' squares in double (fma), in element order and
// then block order, then a warp xor tree, then the warps in order. The update below (partials given) and
// sum_squares_partials_kernel run exactly these operations on the same values, so their partials are bitwise equal.
__device__ __forceinline__ void sq_add(double& s, float g) {
  s = __fma_rn(static_cast<double>(g), static_cast<double>(g), s);
}
// Block sum of a double in a fixed tree (shuffles, then warp results in order); valid in thread 0.
__device__ __forceinline__ double block_sum(double s) {
  __shared__ double red[kThreads / 32];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = s;
  __syncthreads();
  double t = 0.0;
  if (threadIdx.x == 0)
    for (int i = 0; i < kThreads / 32; ++i) t += red[i];
  return t;
}
// The CUDA block's partial from every thread's s (block_sum), valid in thread 0, with every thread past the sum
// before the next group's block_sum writes its shared array again.
__device__ __forceinline__ double q8_cta_sum(double s) {
  const double total = block_sum(s);
  __syncthreads();
  return total;
}

template <typename G>
__global__ void __launch_bounds__(kThreads)
    sum_squares_partials_kernel(const G* __restrict__ x, int64_t n, int64_t index0, int64_t nblocks,
                                double* __restrict__ partials) {
  namespace Q = q8_state;
  const int t = threadIdx.x, lane = t & 31;
  const int64_t c0 = index0 / Q::kBlock;
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * kQ8BlocksPerCta; base < nblocks;
       base += static_cast<int64_t>(gridDim.x) * kQ8BlocksPerCta) {
    double s = 0.0;
    for (int64_t b = base + (t >> 5); b < base + kQ8BlocksPerCta && b < nblocks; b += kQ8WarpsPerCta) {
      const int64_t i0 = (c0 + b) * Q::kBlock + 8 * lane - index0;
      if (i0 >= 0 && i0 + 8 <= n && dev_aligned(x + i0, 16)) {
        float g[8];
        load8_grad(x + i0, g);
#pragma unroll
        for (int j = 0; j < 8; ++j) sq_add(s, g[j]);
      } else {
#pragma unroll
        for (int j = 0; j < 8; ++j)
          if (i0 + j >= 0 && i0 + j < n) sq_add(s, grad1(x, i0 + j));
      }
    }
    const double total = q8_cta_sum(s);
    if (t == 0) partials[base / kQ8BlocksPerCta] = total;
  }
}

// kSearch: the codes by q8_state.h's binary search (q8_binary_search(), cuda.h), else by the bucketed count.
template <typename G, bool kSearch>
__global__ void __launch_bounds__(kThreads)
    adamw_8bit_kernel(uint16_t* __restrict__ param, const G* __restrict__ grad, uint8_t* __restrict__ m_code,
                      uint8_t* __restrict__ v_code, float* __restrict__ m_absmax, float* __restrict__ v_absmax,
                      int64_t n, int64_t index0, int64_t nblocks, bf16_state::Consts k, double* __restrict__ partials,
                      const uint8_t* __restrict__ chunk_mask, uint8_t mask_want) {
  namespace Q = q8_state;
  const bool zero_grads = grad == nullptr;  // the gradients taken as zero, not read
  // The thresholds padded with kBucketSpan x +infinity for the bucketed count.
  __shared__ float m_mag[128], m_thr[127 + Q::kBucketSpan], r_val[256], r_thr[255 + Q::kBucketSpan];
  __shared__ __align__(16) uint8_t lo_s[sizeof(Q8Buckets)];
  const int t = threadIdx.x, lane = t & 31;
  if (t < 128) m_mag[t] = c_q8_m_mag[t];
  if (t < 127) m_thr[t] = c_q8_m_thr[t];
  r_val[t] = c_q8_r_val[t];
  if (t < 255) r_thr[t] = c_q8_r_thr[t];
  if (t < Q::kBucketSpan) m_thr[127 + t] = r_thr[255 + t] = INFINITY;
  for (int i = t; i < static_cast<int>(sizeof(Q8Buckets) / 4); i += kThreads)
    reinterpret_cast<uint32_t*>(lo_s)[i] = reinterpret_cast<const uint32_t*>(&g_q8_buckets)[i];
  __syncthreads();
  const Q::Tables tab{m_mag, m_thr, r_val, r_thr};
  const Q::BucketTables bt{lo_s + offsetof(Q8Buckets, m), lo_s + offsetof(Q8Buckets, r)};
  const int64_t c0 = index0 / Q::kBlock;
  // Quantization blocks b, b + warps, ... of this CUDA block's kQ8BlocksPerCta (a grid-stride loop beyond the
  // grid's cap: 2^31 - 1 CUDA blocks).
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * kQ8BlocksPerCta; base < nblocks;
       base += static_cast<int64_t>(gridDim.x) * kQ8BlocksPerCta) {
    if (chunk_mask && chunk_mask[base / kQ8BlocksPerCta] != mask_want) continue;  // uniform over the CUDA block
    double s = 0.0;  // the gradients' sum of squares (partials given): sum_squares_partials_kernel's operations
    for (int64_t b = base + (t >> 5); b < base + kQ8BlocksPerCta && b < nblocks; b += kQ8WarpsPerCta) {
      const int64_t i0 = (c0 + b) * Q::kBlock + 8 * lane - index0;  // this lane's first element of the range
      const float scale_m = m_absmax[b], scale_r = v_absmax[b];
      float mm[8], rr[8];
      const bool vec = i0 >= 0 && i0 + 8 <= n && dev_aligned(param + i0, 16) &&
                       (zero_grads || dev_aligned(grad + i0, 16)) &&
                       dev_aligned(m_code + i0, 8) && dev_aligned(v_code + i0, 8);
      if (vec) {
        float g[8];
        if (zero_grads) {
#pragma unroll
          for (int j = 0; j < 8; ++j) g[j] = 0.0f;
        } else {
          load8_grad(grad + i0, g);
        }
        if (partials) {
#pragma unroll
          for (int j = 0; j < 8; ++j) sq_add(s, g[j]);
        }
        uint4 pw = *reinterpret_cast<const uint4*>(param + i0);
        const uint2 mc = *reinterpret_cast<const uint2*>(m_code + i0), vc = *reinterpret_cast<const uint2*>(v_code + i0);
        uint32_t pv[4] = {pw.x, pw.y, pw.z, pw.w};
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const uint8_t cm = static_cast<uint8_t>(((j < 4 ? mc.x : mc.y) >> (8 * (j & 3))) & 0xffu);
          const uint8_t cv = static_cast<uint8_t>(((j < 4 ? vc.x : vc.y) >> (8 * (j & 3))) & 0xffu);
          uint16_t p = static_cast<uint16_t>((pv[j >> 1] >> (16 * (j & 1))) & 0xffffu);
          Q::update_element(p, g[j], Q::dequantize_m(cm, scale_m, tab), Q::dequantize_r(cv, scale_r, tab), k,
                            static_cast<uint64_t>(index0 + i0 + j), mm[j], rr[j]);
          pv[j >> 1] = (j & 1) ? (pv[j >> 1] & 0xffffu) | (static_cast<uint32_t>(p) << 16)
                               : (pv[j >> 1] & 0xffff0000u) | p;
        }
        pw = make_uint4(pv[0], pv[1], pv[2], pv[3]);
        *reinterpret_cast<uint4*>(param + i0) = pw;
      } else {
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const int64_t i = i0 + j;
          mm[j] = 0.0f, rr[j] = 0.0f;
          if (i >= 0 && i < n) {
            const float g = zero_grads ? 0.0f : grad1(grad, i);
            if (partials) sq_add(s, g);
            Q::update_element(param[i], g, Q::dequantize_m(m_code[i], scale_m, tab),
                              Q::dequantize_r(v_code[i], scale_r, tab), k, static_cast<uint64_t>(index0 + i), mm[j],
                              rr[j]);
          }
        }
      }
      float am = 0.0f, ar = 0.0f;
#pragma unroll
      for (int j = 0; j < 8; ++j) am = fmaxf(am, fabsf(mm[j])), ar = fmaxf(ar, rr[j]);
      for (int o = 16; o > 0; o >>= 1) {  // every lane has read the old scales above before lane 0 writes
        am = fmaxf(am, __shfl_xor_sync(0xffffffffu, am, o));
        ar = fmaxf(ar, __shfl_xor_sync(0xffffffffu, ar, o));
      }
      am = Q::block_scale(am);
      ar = Q::block_scale(ar);
      auto encode_m = [&](float m) { return kSearch ? Q::encode_m(Q::normalized(m, am), tab)
                                                    : Q::encode_m(Q::normalized(m, am), tab, bt); };
      auto encode_r = [&](float r) { return kSearch ? Q::encode_r(Q::normalized(r, ar), tab)
                                                    : Q::encode_r(Q::normalized(r, ar), tab, bt); };
      if (vec) {
        uint32_t cm[2] = {0, 0}, cv[2] = {0, 0};
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          cm[j >> 2] |= static_cast<uint32_t>(encode_m(mm[j])) << (8 * (j & 3));
          cv[j >> 2] |= static_cast<uint32_t>(encode_r(rr[j])) << (8 * (j & 3));
        }
        *reinterpret_cast<uint2*>(m_code + i0) = make_uint2(cm[0], cm[1]);
        *reinterpret_cast<uint2*>(v_code + i0) = make_uint2(cv[0], cv[1]);
      } else {
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const int64_t i = i0 + j;
          if (i >= 0 && i < n) m_code[i] = encode_m(mm[j]), v_code[i] = encode_r(rr[j]);
        }
      }
      if (lane == 0) m_absmax[b] = am, v_absmax[b] = ar;
    }
    if (partials) {  // uniform over the CUDA block: the barriers in q8_cta_sum are safe
      const double total = q8_cta_sum(s);
      if (t == 0) partials[base / kQ8BlocksPerCta] = total;
    }
  }
}

__global__ void __launch_bounds__(kThreads)
    accumulate_grad_bf16_kernel(uint16_t* __restrict__ acc, const float* __restrict__ g, int64_t n, uint64_t key,
                                int64_t index0) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * kThreads)
    acc[i] = bf16_state::accumulate_grad(acc[i], g[i], key, static_cast<uint64_t>(index0 + i));
}

__global__ void __launch_bounds__(kThreads)
    to_bf16_vec4_kernel(const float* __restrict__ x, bf16* __restrict__ y, int64_t n4) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n4;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    const float4 a = __ldg(reinterpret_cast<const float4*>(x) + i);
    reinterpret_cast<uint2*>(y)[i] = make_uint2(pack2(a.x, a.y), pack2(a.z, a.w));
  }
}
__global__ void __launch_bounds__(kThreads)
    to_bf16_scalar_kernel(const float* __restrict__ x, bf16* __restrict__ y, int64_t begin, int64_t n) {
  for (int64_t i = begin + static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * kThreads)
    y[i] = __float2bfloat16_rn(x[i]);
}

__global__ void __launch_bounds__(kThreads) widen_bf16_kernel(const uint16_t* __restrict__ x, float* __restrict__ y,
                                                             int64_t n) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * kThreads)
    y[i] = bf16_state::widen(x[i]);
}

// Block b sums elements [b*chunk, min(n, (b+1)*chunk)).
template <typename G>
__global__ void __launch_bounds__(kThreads)
    sumsq_partial_kernel(const G* __restrict__ x, int64_t n, int64_t chunk, bool vec4, double* __restrict__ part) {
  const int64_t b0 = static_cast<int64_t>(blockIdx.x) * chunk;
  const int64_t b1 = b0 + chunk < n ? b0 + chunk : n;
  double s = 0.0;
  if (vec4) {  // chunk % 4 == 0 and x vec_align<G>-aligned: 4 at a time over [b0, b1 rounded down to 4), then the tail
    const int64_t e4 = b0 + (b1 - b0) / 4 * 4;
    for (int64_t i = b0 / 4 + threadIdx.x; i < e4 / 4; i += kThreads) {
      const float4 a = grad4(x, i);
      s += static_cast<double>(a.x) * a.x + static_cast<double>(a.y) * a.y + static_cast<double>(a.z) * a.z +
           static_cast<double>(a.w) * a.w;
    }
    for (int64_t i = e4 + threadIdx.x; i < b1; i += kThreads) s += static_cast<double>(grad1(x, i)) * grad1(x, i);
  } else {
    for (int64_t i = b0 + threadIdx.x; i < b1; i += kThreads) s += static_cast<double>(grad1(x, i)) * grad1(x, i);
  }
  s = block_sum(s);
  if (threadIdx.x == 0) part[blockIdx.x] = s;
}

__global__ void __launch_bounds__(kThreads)
    sumsq_final_kernel(const double* __restrict__ part, int64_t P, double* __restrict__ out) {
  double s = 0.0;
  for (int64_t i = threadIdx.x; i < P; i += kThreads) s += part[i];
  s = block_sum(s);
  if (threadIdx.x == 0) *out = s;
}

unsigned grid_for(int64_t work) { return grid_1d(work, kThreads, kMaxBlocks); }
unsigned update_grid(int64_t work) { return grid_1d(work, kThreads, kMaxUpdateBlocks); }

struct SumPlan {
  int64_t chunk = 0, blocks = 0;
};
SumPlan sum_plan(int64_t n) {
  SumPlan p;
  if (n <= 0) return p;
  int64_t chunk = (n + kMaxSumBlocks - 1) / kMaxSumBlocks;
  if (chunk < kSumChunk) chunk = kSumChunk;
  chunk = (chunk + 3) / 4 * 4;
  p.chunk = chunk;
  p.blocks = (n + chunk - 1) / chunk;
  return p;
}

// The updates over either gradient type G (float, or uint16_t: bf16 bits); the public overloads below.
template <typename G>
void adamw_update_t(float* param, const G* grad, float* m, float* v, ds::cuda::bf16* param_bf16, int64_t n,
                    const ds::ops::AdamWParams& p, cudaStream_t stream) {
  DS_CUDA_REQUIRE(n >= 0, "adamw_update: n must be >= 0, got " + std::to_string(n));
  DS_CUDA_REQUIRE(p.step >= 1, "adamw_update: step must be >= 1 (1-based), got " + std::to_string(p.step));
  if (n == 0) return;
  DS_CUDA_REQUIRE(param && grad && m && v, "adamw_update: null pointer argument");
  const double bc1 = 1.0 - std::pow(p.beta1, static_cast<double>(p.step));
  const double bc2 = 1.0 - std::pow(p.beta2, static_cast<double>(p.step));
  AdamConsts k;
  k.b1 = static_cast<float>(p.beta1);
  k.b2 = static_cast<float>(p.beta2);
  k.decay = static_cast<float>(1.0 - p.lr * p.weight_decay);
  k.step_size = static_cast<float>(p.lr / bc1);
  k.inv_sqrt_bc2 = static_cast<float>(1.0 / std::sqrt(bc2));
  k.eps = static_cast<float>(p.eps);
  k.gs = static_cast<float>(p.grad_scale);
  const bool vec = aligned(param, 16) && aligned(grad, vec_align<G>) && aligned(m, 16) && aligned(v, 16) &&
                   (param_bf16 == nullptr || aligned(param_bf16, 8));
  int64_t begin = 0;
  if (vec && n >= 4) {
    const int64_t n4 = n / 4;
    adamw_vec4_kernel<<<update_grid(n4), kThreads, 0, stream>>>(param, grad, m, v, param_bf16, n4, k);
    DS_CUDA_LAUNCH_CHECK();
    begin = n4 * 4;
  }
  if (begin < n) {
    adamw_scalar_kernel<<<update_grid(n - begin), kThreads, 0, stream>>>(param, grad, m, v, param_bf16, begin, n, k);
    DS_CUDA_LAUNCH_CHECK();
  }
}

template <typename G>
void adamw_update_bf16_t(ds::cuda::bf16* param, const G* grad, ds::cuda::bf16* m, ds::cuda::bf16* v, int64_t n,
                         const ds::ops::AdamWParams& p, int64_t index0, cudaStream_t stream) {
  DS_CUDA_REQUIRE(n >= 0 && index0 >= 0, "adamw_update_bf16: n and index0 must be >= 0");
  DS_CUDA_REQUIRE(p.step >= 1, "adamw_update_bf16: step must be >= 1 (1-based), got " + std::to_string(p.step));
  if (n == 0) return;
  DS_CUDA_REQUIRE(param && grad && m && v, "adamw_update_bf16: null pointer argument");
  const bf16_state::Consts k = bf16_state::consts(p);
  auto* pu = reinterpret_cast<uint16_t*>(param);
  auto* mu = reinterpret_cast<uint16_t*>(m);
  auto* vu = reinterpret_cast<uint16_t*>(v);
  int64_t begin = 0;
  if (aligned(param, 8) && aligned(m, 8) && aligned(v, 8) && aligned(grad, vec_align<G>) && n >= 4) {
    const int64_t n4 = n / 4;
    adamw_bf16_vec4_kernel<<<update_grid(n4), kThreads, 0, stream>>>(pu, grad, mu, vu, n4, index0, k);
    DS_CUDA_LAUNCH_CHECK();
    begin = n4 * 4;
  }
  if (begin < n) {
    adamw_bf16_scalar_kernel<<<update_grid(n - begin), kThreads, 0, stream>>>(pu, grad, mu, vu, begin, n, index0, k);
    DS_CUDA_LAUNCH_CHECK();
  }
}

template <typename G>
void adamw_update_8bit_t(ds::cuda::bf16* param, const G* grad, uint8_t* m_code, uint8_t* v_code, float* m_absmax,
                         float* v_absmax, int64_t n, const ds::ops::AdamWParams& p, int64_t index0, cudaStream_t stream,
                         double* partials, const uint8_t* chunk_mask, uint8_t mask_want) {
  DS_CUDA_REQUIRE(n >= 0 && index0 >= 0, "adamw_update_8bit: n and index0 must be >= 0");
  DS_CUDA_REQUIRE(p.step >= 1, "adamw_update_8bit: step must be >= 1 (1-based), got " + std::to_string(p.step));
  if (n == 0) return;
  DS_CUDA_REQUIRE(param && m_code && v_code && m_absmax && v_absmax, "adamw_update_8bit: null pointer argument");
  const int64_t nb = q8_state::num_blocks(index0, n);
  const unsigned grid = grid_1d(nb, static_cast<int>(kQ8BlocksPerCta), 0x7fffffff);
  auto* kernel = q8_binary_search() ? adamw_8bit_kernel<G, true> : adamw_8bit_kernel<G, false>;
  kernel<<<grid, kThreads, 0, stream>>>(reinterpret_cast<uint16_t*>(param), grad, m_code, v_code, m_absmax, v_absmax, n,
                                        index0, nb, bf16_state::consts(p), partials, chunk_mask, mask_want);
  DS_CUDA_LAUNCH_CHECK();
}

template <typename G>
void sum_squares_partials_t(const G* x, int64_t n, int64_t index0, double* partials, cudaStream_t stream) {
  DS_CUDA_REQUIRE(n >= 0 && index0 >= 0, "sum_squares_partials: n and index0 must be >= 0");
  if (n == 0) return;
  DS_CUDA_REQUIRE(x && partials, "sum_squares_partials: null pointer argument");
  const int64_t nb = q8_state::num_blocks(index0, n);
  sum_squares_partials_kernel<<<grid_1d(nb, static_cast<int>(kQ8BlocksPerCta), 0x7fffffff), kThreads, 0, stream>>>(
      x, n, index0, nb, partials);
  DS_CUDA_LAUNCH_CHECK();
}

template <typename G>
void sum_squares_t(const G* x, int64_t n, double* out, void* scratch, cudaStream_t stream) {
  DS_CUDA_REQUIRE(n >= 0, "sum_squares: n must be >= 0, got " + std::to_string(n));
  DS_CUDA_REQUIRE(out != nullptr, "sum_squares: out is null");
  if (n == 0) {
    DS_CUDA_CHECK(cudaMemsetAsync(out, 0, sizeof(double), stream));  // all-zero bits = 0.0
    return;
  }
  DS_CUDA_REQUIRE(x != nullptr, "sum_squares: x is null");
  DS_CUDA_REQUIRE(scratch != nullptr, "sum_squares: scratch is null (need sum_squares_scratch_bytes)");
  const SumPlan sp = sum_plan(n);
  double* part = static_cast<double*>(scratch);
  sumsq_partial_kernel<<<static_cast<unsigned>(sp.blocks), kThreads, 0, stream>>>(x, n, sp.chunk,
                                                                                   aligned(x, vec_align<G>), part);
  DS_CUDA_LAUNCH_CHECK();
  sumsq_final_kernel<<<1, kThreads, 0, stream>>>(part, sp.blocks, out);
  DS_CUDA_LAUNCH_CHECK();
}

const uint16_t* bits(const ds::cuda::bf16* x) { return reinterpret_cast<const uint16_t*>(x); }

}  // namespace

void adamw_update(float* param, const float* grad, float* m, float* v, ds::cuda::bf16* param_bf16, int64_t n,
                  const ds::ops::AdamWParams& p, cudaStream_t stream) {
  adamw_update_t(param, grad, m, v, param_bf16, n, p, stream);
}
void adamw_update(float* param, const ds::cuda::bf16* grad, float* m, float* v, ds::cuda::bf16* param_bf16, int64_t n,
                  const ds::ops::AdamWParams& p, cudaStream_t stream) {
  adamw_update_t(param, bits(grad), m, v, param_bf16, n, p, stream);
}
void adamw_update_bf16(ds::cuda::bf16* param, const float* grad, ds::cuda::bf16* m, ds::cuda::bf16* v, int64_t n,
                       const ds::ops::AdamWParams& p, int64_t index0, cudaStream_t stream) {
  adamw_update_bf16_t(param, grad, m, v, n, p, index0, stream);
}
void adamw_update_bf16(ds::cuda::bf16* param, const ds::cuda::bf16* grad, ds::cuda::bf16* m, ds::cuda::bf16* v,
                       int64_t n, const ds::ops::AdamWParams& p, int64_t index0, cudaStream_t stream) {
  adamw_update_bf16_t(param, bits(grad), m, v, n, p, index0, stream);
}
void adamw_update_8bit(ds::cuda::bf16* param, const float* grad, uint8_t* m_code, uint8_t* v_code, float* m_absmax,
                       float* v_absmax, int64_t n, const ds::ops::AdamWParams& p, int64_t index0, cudaStream_t stream,
                       double* partials, const uint8_t* chunk_mask, uint8_t mask_want) {
  adamw_update_8bit_t(param, grad, m_code, v_code, m_absmax, v_absmax, n, p, index0, stream, partials, chunk_mask,
                      mask_want);
}
void adamw_update_8bit(ds::cuda::bf16* param, const ds::cuda::bf16* grad, uint8_t* m_code, uint8_t* v_code,
                       float* m_absmax, float* v_absmax, int64_t n, const ds::ops::AdamWParams& p, int64_t index0,
                       cudaStream_t stream, double* partials, const uint8_t* chunk_mask, uint8_t mask_want) {
  adamw_update_8bit_t(param, bits(grad), m_code, v_code, m_absmax, v_absmax, n, p, index0, stream, partials,
                      chunk_mask, mask_want);
}

int64_t sum_squares_partials_count(int64_t index0, int64_t n) { return q8_state::num_chunks(index0, n); }
void sum_squares_partials(const float* x, int64_t n, int64_t index0, double* partials, cudaStream_t stream) {
  sum_squares_partials_t(x, n, index0, partials, stream);
}
void sum_squares_partials(const ds::cuda::bf16* x, int64_t n, int64_t index0, double* partials, cudaStream_t stream) {
  sum_squares_partials_t(bits(x), n, index0, partials, stream);
}
void sum_partials(const double* partials, int64_t count, double* out, cudaStream_t stream) {
  DS_CUDA_REQUIRE(count >= 0 && out != nullptr && (count == 0 || partials != nullptr),
                  "sum_partials: bad arguments");
  if (count == 0) {
    DS_CUDA_CHECK(cudaMemsetAsync(out, 0, sizeof(double), stream));
    return;
  }
  sumsq_final_kernel<<<1, kThreads, 0, stream>>>(partials, count, out);
  DS_CUDA_LAUNCH_CHECK();
}

void accumulate_grad_bf16(ds::cuda::bf16* acc, const float* g, int64_t n, uint64_t key, int64_t index0,
                          cudaStream_t stream) {
  DS_CUDA_REQUIRE(n >= 0 && index0 >= 0, "accumulate_grad_bf16: n and index0 must be >= 0");
  if (n == 0) return;
  DS_CUDA_REQUIRE(acc && g, "accumulate_grad_bf16: null pointer argument");
  accumulate_grad_bf16_kernel<<<grid_for(n), kThreads, 0, stream>>>(reinterpret_cast<uint16_t*>(acc), g, n, key,
                                                                    index0);
  DS_CUDA_LAUNCH_CHECK();
}

void widen_bf16(const ds::cuda::bf16* x, float* y, int64_t n, cudaStream_t stream) {
  DS_CUDA_REQUIRE(n >= 0, "widen_bf16: n must be >= 0, got " + std::to_string(n));
  if (n == 0) return;
  DS_CUDA_REQUIRE(x && y, "widen_bf16: null pointer argument");
  widen_bf16_kernel<<<grid_for(n), kThreads, 0, stream>>>(reinterpret_cast<const uint16_t*>(x), y, n);
  DS_CUDA_LAUNCH_CHECK();
}

void to_bf16(const float* x, ds::cuda::bf16* y, int64_t n, cudaStream_t stream) {
  DS_CUDA_REQUIRE(n >= 0, "to_bf16: n must be >= 0, got " + std::to_string(n));
  if (n == 0) return;
  DS_CUDA_REQUIRE(x && y, "to_bf16: null pointer argument");
  int64_t begin = 0;
  if (aligned(x, 16) && aligned(y, 8) && n >= 4) {
    const int64_t n4 = n / 4;
    to_bf16_vec4_kernel<<<grid_for(n4), kThreads, 0, stream>>>(x, y, n4);
    DS_CUDA_LAUNCH_CHECK();
    begin = n4 * 4;
  }
  if (begin < n) {
    to_bf16_scalar_kernel<<<grid_for(n - begin), kThreads, 0, stream>>>(x, y, begin, n);
    DS_CUDA_LAUNCH_CHECK();
  }
}

size_t sum_squares_scratch_bytes(int64_t n) { return static_cast<size_t>(sum_plan(n).blocks) * sizeof(double); }

void sum_squares(const float* x, int64_t n, double* out, void* scratch, cudaStream_t stream) {
  sum_squares_t(x, n, out, scratch, stream);
}
void sum_squares(const ds::cuda::bf16* x, int64_t n, double* out, void* scratch, cudaStream_t stream) {
  sum_squares_t(bits(x), n, out, scratch, stream);
}

}  // namespace ds::ops::cuda
