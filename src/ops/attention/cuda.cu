// Causal GQA softmax attention over packed sequences on the GPU (see cuda.h; math of attention.h / cpu.cpp).
//
// All matrix products run on tensor cores through WMMA (bf16 16x16x16 fragments, fp32 accumulation); tiles
// live in shared memory (bf16 rows padded by 8 elements, fp32 rows by 4, against bank conflicts). Each block
// has 8 warps; a warp owns a fixed set of 16x16 output fragments, kept in registers for the whole block.
// Scores are handled in the log2 domain: s2 = (q . k) * scale * log2(e).
//
// Forward, one block per (query tile of 64, q head): loops over the key tiles of its sequence up to the
// diagonal; S = Q K^T (fp32, to shared), an online softmax per row (4 threads per row; running max m and sum l
// in registers, p = exp2(s2 - m_new) rounded to bf16 into shared, the rescale factor alpha to shared),
// O = diag(alpha) O + P V. The O fragments are rescaled per row in registers: the row of each fragment element
// is learned once by loading a 16x16 matrix of row indices into an accumulator fragment (the element mapping
// of one fragment type is fixed, so this is layout-agnostic). Writes o = O / l (bf16) and lse = ln(2)(m+log2 l).
//
// Backward (deterministic, no atomics):
//   A. D[t, h] = dout[t, h] . o[t, h] (fp32, warp per row, fixed shuffle order) into the scratch.
//   B. dk, dv: one block per (key tile, kv head). For each q head of the group (ascending) and each query tile
//      from the key tile's first key to the end of the sequence (ascending): S^T = K Q^T, dP^T = V dO^T,
//      P^T = exp2(s2 - lse2) (causal mask), dS^T = P^T (dP^T - D); dV += P^T dO, dK += dS^T Q in registers.
//      Writes dk = scale dK, dv = dV.
//   C. dq: one block per (query tile, q head), over the key tiles up to the diagonal (ascending):
//      S = Q K^T, dP = dO V^T, dS = P (dP - D); dQ += dS K. Writes dq = scale dQ.
// P and dS are rounded to bf16 before their products (as FlashAttention does).
#include <mma.h>

#include <cstdint>
#include <string>

#include "ops/attention/cuda.h"

namespace ds::ops::cuda {
namespace {

namespace wmma = nvcuda::wmma;
using ds::cuda::bf16;

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

using FragA = wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major>;
using FragBc = wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::col_major>;
using FragBr = wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::row_major>;
using FragC = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;

constexpr size_t a128(size_t b) { return (b + 127) / 128 * 128; }

// ---------------------------------------------------------------------------------------------------------
// Shared-memory layouts (byte offsets; every array starts on a 128-byte boundary).

template <int HD, int BM, int BN>
struct FwdSmem {
  static constexpr int LDH = HD + 8, LDS = BN + 4, LDP = BN + 8;
  static constexpr size_t Q = 0;
  static constexpr size_t K = Q + a128(size_t(BM) * LDH * 2);
  static constexpr size_t V = K + a128(size_t(BN) * LDH * 2);
  static constexpr size_t S = V + a128(size_t(BN) * LDH * 2);
  static constexpr size_t P = S + a128(size_t(BM) * LDS * 4);
  static constexpr size_t Alpha = P + a128(size_t(BM) * LDP * 2);
  static constexpr size_t Stage = Alpha + a128(size_t(BM) * 4);
  static constexpr size_t bytes = Stage + a128(size_t(kWarps) * 256 * 4);
};

// Backward, dq pass: rows = queries (BM), columns = keys (BN).
template <int HD, int BM, int BN>
struct DqSmem {
  static constexpr int LDH = HD + 8, LDS = BN + 4, LDP = BN + 8;
  static constexpr size_t Q = 0;
  static constexpr size_t dO = Q + a128(size_t(BM) * LDH * 2);
  static constexpr size_t K = dO + a128(size_t(BM) * LDH * 2);
  static constexpr size_t V = K + a128(size_t(BN) * LDH * 2);
  static constexpr size_t S = V + a128(size_t(BN) * LDH * 2);
  static constexpr size_t dP = S + a128(size_t(BM) * LDS * 4);
  static constexpr size_t dS = dP + a128(size_t(BM) * LDS * 4);
  static constexpr size_t Lse = dS + a128(size_t(BM) * LDP * 2);
  static constexpr size_t D = Lse + a128(size_t(BM) * 4);
  static constexpr size_t Stage = D + a128(size_t(BM) * 4);
  static constexpr size_t bytes = Stage + a128(size_t(kWarps) * 256 * 4);
};

// Backward, dk/dv pass: rows = keys (BN), columns = queries (BM).
template <int HD, int BN, int BM>
struct DkvSmem {
  static constexpr int LDH = HD + 8, LDS = BM + 4, LDP = BM + 8;
  static constexpr size_t K = 0;
  static constexpr size_t V = K + a128(size_t(BN) * LDH * 2);
  static constexpr size_t Q = V + a128(size_t(BN) * LDH * 2);
  static constexpr size_t dO = Q + a128(size_t(BM) * LDH * 2);
  static constexpr size_t S = dO + a128(size_t(BM) * LDH * 2);
  static constexpr size_t dP = S + a128(size_t(BN) * LDS * 4);
  static constexpr size_t P = dP + a128(size_t(BN) * LDS * 4);
  static constexpr size_t dS = P + a128(size_t(BN) * LDP * 2);
  static constexpr size_t Lse = dS + a128(size_t(BN) * LDP * 2);
  static constexpr size_t D = Lse + a128(size_t(BM) * 4);
  static constexpr size_t Stage = D + a128(size_t(BM) * 4);
  static constexpr size_t bytes = Stage + a128(size_t(kWarps) * 256 * 4);
};

// Tile sizes per head dim. kMaxSmem: the 227 KiB opt-in limit of sm_90.
constexpr size_t kMaxSmem = 227 * 1024;
template <int HD>
struct Cfg {
  static constexpr int FWD_BM = 64, FWD_BN = 64;
  static constexpr int DQ_BM = 64, DQ_BN = 64;
  static constexpr int DKV_BN = HD >= 256 ? 32 : 64, DKV_BM = 64;
};

// ---------------------------------------------------------------------------------------------------------
// Device helpers.

// dst[r][0:HD] (row stride LD) = src row (s0 + row0 + r), head `head`, of a [*, H, HD] tensor, for
// row0 + r < row_end; zero otherwise. 16-byte copies.
template <int HD, int R, int LD>
__device__ __forceinline__ void load_rows(bf16* dst, const bf16* __restrict__ src, int64_t s0, int row0,
                                          int row_end, int H, int head) {
  constexpr int CH = HD / 8;
  for (int i = threadIdx.x; i < R * CH; i += kThreads) {
    const int r = i / CH, c = i % CH, row = row0 + r;
    uint4 v = make_uint4(0u, 0u, 0u, 0u);
    if (row < row_end) v = *reinterpret_cast<const uint4*>(src + ((s0 + row) * int64_t(H) + head) * HD + c * 8);
    *reinterpret_cast<uint4*>(dst + r * LD + c * 8) = v;
  }
}

// dst[r] = src[(s0 + row0 + r) * H + head] * mul for row0 + r < row_end; 0 otherwise.
template <int R>
__device__ __forceinline__ void load_stat(float* dst, const float* __restrict__ src, int64_t s0, int row0,
                                          int row_end, int H, int head, float mul) {
  for (int r = threadIdx.x; r < R; r += kThreads) {
    const int row = row0 + r;
    dst[r] = row < row_end ? src[(s0 + row) * int64_t(H) + head] * mul : 0.0f;
  }
}

// Accumulator fragment whose element e holds the row (0..15) of element e.
__device__ __forceinline__ void make_rowid(FragC& rowid, float* stage) {
  const int lane = threadIdx.x & 31;
  for (int e = lane; e < 256; e += 32) stage[e] = static_cast<float>(e / 16);
  __syncwarp();
  wmma::load_matrix_sync(rowid, stage, 16, wmma::mem_row_major);
  __syncwarp();
}

// Writes the 16x16 fragment `f` (times mul) to rows [row0, row0 + 16) (those < nrows), columns [col0, col0 + 16)
// of a [*, H, HD] bf16 tensor at token s0 + row, head `head`, through the warp's 16x16 fp32 stage.
template <int HD>
__device__ __forceinline__ void store_frag(const FragC& f, float mul, float* stage, bf16* __restrict__ dst,
                                           int64_t s0, int row0, int nrows, int col0, int H, int head) {
  const int lane = threadIdx.x & 31;
  wmma::store_matrix_sync(stage, f, 16, wmma::mem_row_major);
  __syncwarp();
  const int r = lane >> 1, half = lane & 1, row = row0 + r;
  if (row < nrows) {
    const float* sp = stage + r * 16 + half * 8;
    uint4 u;
    __nv_bfloat162 b0 = __floats2bfloat162_rn(sp[0] * mul, sp[1] * mul);
    __nv_bfloat162 b1 = __floats2bfloat162_rn(sp[2] * mul, sp[3] * mul);
    __nv_bfloat162 b2 = __floats2bfloat162_rn(sp[4] * mul, sp[5] * mul);
    __nv_bfloat162 b3 = __floats2bfloat162_rn(sp[6] * mul, sp[7] * mul);
    u.x = *reinterpret_cast<uint32_t*>(&b0);
    u.y = *reinterpret_cast<uint32_t*>(&b1);
    u.z = *reinterpret_cast<uint32_t*>(&b2);
    u.w = *reinterpret_cast<uint32_t*>(&b3);
    *reinterpret_cast<uint4*>(dst + ((s0 + row) * int64_t(H) + head) * HD + col0 + half * 8) = u;
  }
  __syncwarp();
}

// out[16x16 at (rt, ct)] = sum_kk A[rt, kk] B[kk, ct]: A row-major [.., lda] (bf16), B^T given row-major
// (i.e. B col-major) [.., ldb], KSTEPS steps of 16.
template <int KSTEPS>
__device__ __forceinline__ void mma_abt(FragC& acc, const bf16* A, int lda, const bf16* Bt, int ldb) {
#pragma unroll
  for (int kk = 0; kk < KSTEPS; ++kk) {
    FragA a;
    FragBc b;
    wmma::load_matrix_sync(a, A + kk * 16, lda);
    wmma::load_matrix_sync(b, Bt + kk * 16, ldb);
    wmma::mma_sync(acc, a, b, acc);
  }
}

// acc += sum_kk A[.., kk] B[kk, ..]: A row-major [.., lda], B row-major [.., ldb].
template <int KSTEPS>
__device__ __forceinline__ void mma_ab(FragC& acc, const bf16* A, int lda, const bf16* B, int ldb) {
#pragma unroll
  for (int kk = 0; kk < KSTEPS; ++kk) {
    FragA a;
    FragBr b;
    wmma::load_matrix_sync(a, A + kk * 16, lda);
    wmma::load_matrix_sync(b, B + kk * 16 * ldb, ldb);
    wmma::mma_sync(acc, a, b, acc);
  }
}

// ---------------------------------------------------------------------------------------------------------
// Forward.

template <int HD>
__global__ void __launch_bounds__(kThreads)
    attn_fwd_kernel(const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v,
                    const int32_t* __restrict__ cu, int tiles, int Hq, int Hkv, int group, float sl2,
                    bf16* __restrict__ o, float* __restrict__ lse) {
  constexpr int BM = Cfg<HD>::FWD_BM, BN = Cfg<HD>::FWD_BN;
  using L = FwdSmem<HD, BM, BN>;
  constexpr int LDH = L::LDH, LDS = L::LDS, LDP = L::LDP;
  constexpr int kSF = (BM / 16) * (BN / 16) / kWarps;  // score fragments per warp
  constexpr int kOF = (BM / 16) * (HD / 16) / kWarps;  // output fragments per warp
  constexpr int TPR = kThreads / BM;                   // softmax threads per row
  constexpr int CPT = BN / TPR;                        // softmax columns per thread
  static_assert(kSF * kWarps == (BM / 16) * (BN / 16) && kOF * kWarps == (BM / 16) * (HD / 16));
  static_assert(TPR * BM == kThreads && CPT * TPR == BN && (TPR & (TPR - 1)) == 0 && TPR <= 32);

  extern __shared__ __align__(128) unsigned char smem[];
  bf16* sQ = reinterpret_cast<bf16*>(smem + L::Q);
  bf16* sK = reinterpret_cast<bf16*>(smem + L::K);
  bf16* sV = reinterpret_cast<bf16*>(smem + L::V);
  float* sS = reinterpret_cast<float*>(smem + L::S);
  bf16* sP = reinterpret_cast<bf16*>(smem + L::P);
  float* sAlpha = reinterpret_cast<float*>(smem + L::Alpha);
  const int warp = threadIdx.x >> 5;
  float* stage = reinterpret_cast<float*>(smem + L::Stage) + warp * 256;

  const int seq = blockIdx.x / tiles, tile = tiles - 1 - static_cast<int>(blockIdx.x % tiles);  // long tiles first
  const int h = blockIdx.y, g = h / group;
  const int64_t s0 = cu[seq];
  const int len = cu[seq + 1] - cu[seq];
  const int q0 = tile * BM;
  if (q0 >= len) return;
  const int nq = min(BM, len - q0);
  const int kv_end = q0 + nq;  // keys [0, kv_end) are visible to some row of the tile

  load_rows<HD, BM, LDH>(sQ, q, s0, q0, len, Hq, h);
  FragC rowid;
  make_rowid(rowid, stage);
  FragC acc[kOF];
#pragma unroll
  for (int i = 0; i < kOF; ++i) wmma::fill_fragment(acc[i], 0.0f);

  const int srow = threadIdx.x / TPR, scol0 = (threadIdx.x % TPR) * CPT;
  const int qi = q0 + srow;  // this thread's query row (position in the sequence)
  float m_run = -INFINITY, l_run = 0.0f;

  for (int kb = 0; kb < kv_end; kb += BN) {
    __syncthreads();  // the previous tile's K, V, P are no longer read
    load_rows<HD, BN, LDH>(sK, k, s0, kb, kv_end, Hkv, g);
    load_rows<HD, BN, LDH>(sV, v, s0, kb, kv_end, Hkv, g);
    __syncthreads();
#pragma unroll
    for (int i = 0; i < kSF; ++i) {
      const int f = warp * kSF + i, rt = f / (BN / 16), ct = f % (BN / 16);
      FragC s;
      wmma::fill_fragment(s, 0.0f);
      mma_abt<HD / 16>(s, sQ + rt * 16 * LDH, LDH, sK + ct * 16 * LDH, LDH);
      wmma::store_matrix_sync(sS + rt * 16 * LDS + ct * 16, s, LDS, wmma::mem_row_major);
    }
    __syncthreads();
    {  // online softmax of row srow over columns [scol0, scol0 + CPT)
      float x[CPT];
      float mx = -INFINITY;
#pragma unroll
      for (int c = 0; c < CPT; ++c) {
        const int j = kb + scol0 + c;
        x[c] = (j <= qi && qi < len) ? sS[srow * LDS + scol0 + c] * sl2 : -INFINITY;
        mx = fmaxf(mx, x[c]);
      }
#pragma unroll
      for (int off = 1; off < TPR; off <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
      const float m_new = fmaxf(m_run, mx);
      const float alpha = m_new == -INFINITY ? 1.0f : exp2f(m_run - m_new);
      float sum = 0.0f;
#pragma unroll
      for (int c = 0; c < CPT; ++c) {
        const float p = x[c] == -INFINITY ? 0.0f : exp2f(x[c] - m_new);
        sP[srow * LDP + scol0 + c] = __float2bfloat16(p);
        sum += p;
      }
#pragma unroll
      for (int off = 1; off < TPR; off <<= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
      l_run = l_run * alpha + sum;
      m_run = m_new;
      if (threadIdx.x % TPR == 0) sAlpha[srow] = alpha;
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < kOF; ++i) {
      const int f = warp * kOF + i, rt = f / (HD / 16), ct = f % (HD / 16);
#pragma unroll
      for (int e = 0; e < acc[i].num_elements; ++e) acc[i].x[e] *= sAlpha[rt * 16 + static_cast<int>(rowid.x[e])];
      mma_ab<BN / 16>(acc[i], sP + rt * 16 * LDP, LDP, sV + ct * 16, LDH);
    }
  }

  __syncthreads();  // sAlpha of the last tile is no longer read
  if (threadIdx.x % TPR == 0) {
    sAlpha[srow] = l_run > 0.0f ? 1.0f / l_run : 0.0f;
    if (srow < nq) lse[(s0 + qi) * Hq + h] = (m_run + log2f(l_run)) * kLn2;
  }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < kOF; ++i) {
    const int f = warp * kOF + i, rt = f / (HD / 16), ct = f % (HD / 16);
#pragma unroll
    for (int e = 0; e < acc[i].num_elements; ++e) acc[i].x[e] *= sAlpha[rt * 16 + static_cast<int>(rowid.x[e])];
    store_frag<HD>(acc[i], 1.0f, stage, o, s0 + q0, rt * 16, nq, ct * 16, Hq, h);
  }
}

// ---------------------------------------------------------------------------------------------------------
// Backward A: D = rowsum(dout * o), fp32 [N, Hq].

template <int HD>
__global__ void __launch_bounds__(kThreads)
    attn_bwd_dot_kernel(const bf16* __restrict__ o, const bf16* __restrict__ dout, float* __restrict__ D,
                        int64_t rows) {
  const int lane = threadIdx.x & 31;
  const int64_t row = int64_t(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (row >= rows) return;
  const __nv_bfloat162* o2 = reinterpret_cast<const __nv_bfloat162*>(o + row * HD);
  const __nv_bfloat162* d2 = reinterpret_cast<const __nv_bfloat162*>(dout + row * HD);
  float acc = 0.0f;
#pragma unroll
  for (int i = lane; i < HD / 2; i += 32) {
    const float2 a = __bfloat1622float2(o2[i]), b = __bfloat1622float2(d2[i]);
    acc = fmaf(a.x, b.x, acc);
    acc = fmaf(a.y, b.y, acc);
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  if (lane == 0) D[row] = acc;
}

// ---------------------------------------------------------------------------------------------------------
// Backward B: dk, dv per (key tile, kv head).

template <int HD>
__global__ void __launch_bounds__(kThreads)
    attn_bwd_dkdv_kernel(const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v,
                         const bf16* __restrict__ dout, const float* __restrict__ lse, const float* __restrict__ Dg,
                         const int32_t* __restrict__ cu, int tiles, int Hq, int Hkv, int group, float sl2,
                         float scale, bf16* __restrict__ dk, bf16* __restrict__ dv) {
  constexpr int BN = Cfg<HD>::DKV_BN, BM = Cfg<HD>::DKV_BM;
  using L = DkvSmem<HD, BN, BM>;
  constexpr int LDH = L::LDH, LDS = L::LDS, LDP = L::LDP;
  constexpr int kSF = (BN / 16) * (BM / 16) / kWarps;  // S^T fragments per warp
  constexpr int kKF = (BN / 16) * (HD / 16) / kWarps;  // dK (and dV) fragments per warp
  static_assert(kSF * kWarps == (BN / 16) * (BM / 16) && kKF * kWarps == (BN / 16) * (HD / 16));

  extern __shared__ __align__(128) unsigned char smem[];
  bf16* sK = reinterpret_cast<bf16*>(smem + L::K);
  bf16* sV = reinterpret_cast<bf16*>(smem + L::V);
  bf16* sQ = reinterpret_cast<bf16*>(smem + L::Q);
  bf16* sdO = reinterpret_cast<bf16*>(smem + L::dO);
  float* sS = reinterpret_cast<float*>(smem + L::S);
  float* sdP = reinterpret_cast<float*>(smem + L::dP);
  bf16* sP = reinterpret_cast<bf16*>(smem + L::P);
  bf16* sdS = reinterpret_cast<bf16*>(smem + L::dS);
  float* sLse = reinterpret_cast<float*>(smem + L::Lse);
  float* sD = reinterpret_cast<float*>(smem + L::D);
  const int warp = threadIdx.x >> 5;
  float* stage = reinterpret_cast<float*>(smem + L::Stage) + warp * 256;

  const int seq = blockIdx.x / tiles, tile = static_cast<int>(blockIdx.x % tiles);  // early keys = most work
  const int g = blockIdx.y;
  const int64_t s0 = cu[seq];
  const int len = cu[seq + 1] - cu[seq];
  const int k0 = tile * BN;
  if (k0 >= len) return;
  const int nk = min(BN, len - k0);

  load_rows<HD, BN, LDH>(sK, k, s0, k0, len, Hkv, g);
  load_rows<HD, BN, LDH>(sV, v, s0, k0, len, Hkv, g);
  FragC accK[kKF], accV[kKF];
#pragma unroll
  for (int i = 0; i < kKF; ++i) {
    wmma::fill_fragment(accK[i], 0.0f);
    wmma::fill_fragment(accV[i], 0.0f);
  }

  for (int hh = 0; hh < group; ++hh) {
    const int h = g * group + hh;
    for (int qb = k0; qb < len; qb += BM) {
      __syncthreads();  // the previous query tile is no longer read
      load_rows<HD, BM, LDH>(sQ, q, s0, qb, len, Hq, h);
      load_rows<HD, BM, LDH>(sdO, dout, s0, qb, len, Hq, h);
      load_stat<BM>(sLse, lse, s0, qb, len, Hq, h, kLog2e);
      load_stat<BM>(sD, Dg, s0, qb, len, Hq, h, 1.0f);
      __syncthreads();
#pragma unroll
      for (int i = 0; i < kSF; ++i) {
        const int f = warp * kSF + i, rt = f / (BM / 16), ct = f % (BM / 16);  // rt: key tile, ct: query tile
        FragC s, dp;
        wmma::fill_fragment(s, 0.0f);
        wmma::fill_fragment(dp, 0.0f);
        mma_abt<HD / 16>(s, sK + rt * 16 * LDH, LDH, sQ + ct * 16 * LDH, LDH);
        mma_abt<HD / 16>(dp, sV + rt * 16 * LDH, LDH, sdO + ct * 16 * LDH, LDH);
        wmma::store_matrix_sync(sS + rt * 16 * LDS + ct * 16, s, LDS, wmma::mem_row_major);
        wmma::store_matrix_sync(sdP + rt * 16 * LDS + ct * 16, dp, LDS, wmma::mem_row_major);
      }
      __syncthreads();
      for (int e = threadIdx.x; e < BN * BM; e += kThreads) {
        const int r = e / BM, c = e % BM;  // r: key row, c: query column
        const int key = k0 + r, qry = qb + c;
        const bool valid = r < nk && qry < len && key <= qry;
        const float p = valid ? exp2f(fmaf(sS[r * LDS + c], sl2, -sLse[c])) : 0.0f;
        const float ds = p * (sdP[r * LDS + c] - sD[c]);
        sP[r * LDP + c] = __float2bfloat16(p);
        sdS[r * LDP + c] = __float2bfloat16(ds);
      }
      __syncthreads();
#pragma unroll
      for (int i = 0; i < kKF; ++i) {
        const int f = warp * kKF + i, rt = f / (HD / 16), ct = f % (HD / 16);
        mma_ab<BM / 16>(accV[i], sP + rt * 16 * LDP, LDP, sdO + ct * 16, LDH);
        mma_ab<BM / 16>(accK[i], sdS + rt * 16 * LDP, LDP, sQ + ct * 16, LDH);
      }
    }
  }
#pragma unroll
  for (int i = 0; i < kKF; ++i) {
    const int f = warp * kKF + i, rt = f / (HD / 16), ct = f % (HD / 16);
    store_frag<HD>(accK[i], scale, stage, dk, s0 + k0, rt * 16, nk, ct * 16, Hkv, g);
    store_frag<HD>(accV[i], 1.0f, stage, dv, s0 + k0, rt * 16, nk, ct * 16, Hkv, g);
  }
}

// ---------------------------------------------------------------------------------------------------------
// Backward C: dq per (query tile, q head).

template <int HD>
__global__ void __launch_bounds__(kThreads)
    attn_bwd_dq_kernel(const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v,
                       const bf16* __restrict__ dout, const float* __restrict__ lse, const float* __restrict__ Dg,
                       const int32_t* __restrict__ cu, int tiles, int Hq, int Hkv, int group, float sl2, float scale,
                       bf16* __restrict__ dq) {
  constexpr int BM = Cfg<HD>::DQ_BM, BN = Cfg<HD>::DQ_BN;
  using L = DqSmem<HD, BM, BN>;
  constexpr int LDH = L::LDH, LDS = L::LDS, LDP = L::LDP;
  constexpr int kSF = (BM / 16) * (BN / 16) / kWarps;
  constexpr int kQF = (BM / 16) * (HD / 16) / kWarps;
  static_assert(kSF * kWarps == (BM / 16) * (BN / 16) && kQF * kWarps == (BM / 16) * (HD / 16));

  extern __shared__ __align__(128) unsigned char smem[];
  bf16* sQ = reinterpret_cast<bf16*>(smem + L::Q);
  bf16* sdO = reinterpret_cast<bf16*>(smem + L::dO);
  bf16* sK = reinterpret_cast<bf16*>(smem + L::K);
  bf16* sV = reinterpret_cast<bf16*>(smem + L::V);
  float* sS = reinterpret_cast<float*>(smem + L::S);
  float* sdP = reinterpret_cast<float*>(smem + L::dP);
  bf16* sdS = reinterpret_cast<bf16*>(smem + L::dS);
  float* sLse = reinterpret_cast<float*>(smem + L::Lse);
  float* sD = reinterpret_cast<float*>(smem + L::D);
  const int warp = threadIdx.x >> 5;
  float* stage = reinterpret_cast<float*>(smem + L::Stage) + warp * 256;

  const int seq = blockIdx.x / tiles, tile = tiles - 1 - static_cast<int>(blockIdx.x % tiles);
  const int h = blockIdx.y, g = h / group;
  const int64_t s0 = cu[seq];
  const int len = cu[seq + 1] - cu[seq];
  const int q0 = tile * BM;
  if (q0 >= len) return;
  const int nq = min(BM, len - q0);
  const int kv_end = q0 + nq;

  load_rows<HD, BM, LDH>(sQ, q, s0, q0, len, Hq, h);
  load_rows<HD, BM, LDH>(sdO, dout, s0, q0, len, Hq, h);
  load_stat<BM>(sLse, lse, s0, q0, len, Hq, h, kLog2e);
  load_stat<BM>(sD, Dg, s0, q0, len, Hq, h, 1.0f);
  FragC acc[kQF];
#pragma unroll
  for (int i = 0; i < kQF; ++i) wmma::fill_fragment(acc[i], 0.0f);

  for (int kb = 0; kb < kv_end; kb += BN) {
    __syncthreads();
    load_rows<HD, BN, LDH>(sK, k, s0, kb, kv_end, Hkv, g);
    load_rows<HD, BN, LDH>(sV, v, s0, kb, kv_end, Hkv, g);
    __syncthreads();
#pragma unroll
    for (int i = 0; i < kSF; ++i) {
      const int f = warp * kSF + i, rt = f / (BN / 16), ct = f % (BN / 16);
      FragC s, dp;
      wmma::fill_fragment(s, 0.0f);
      wmma::fill_fragment(dp, 0.0f);
      mma_abt<HD / 16>(s, sQ + rt * 16 * LDH, LDH, sK + ct * 16 * LDH, LDH);
      mma_abt<HD / 16>(dp, sdO + rt * 16 * LDH, LDH, sV + ct * 16 * LDH, LDH);
      wmma::store_matrix_sync(sS + rt * 16 * LDS + ct * 16, s, LDS, wmma::mem_row_major);
      wmma::store_matrix_sync(sdP + rt * 16 * LDS + ct * 16, dp, LDS, wmma::mem_row_major);
    }
    __syncthreads();
    for (int e = threadIdx.x; e < BM * BN; e += kThreads) {
      const int r = e / BN, c = e % BN;
      const int qry = q0 + r, key = kb + c;
      const bool valid = qry < len && key <= qry;
      const float p = valid ? exp2f(fmaf(sS[r * LDS + c], sl2, -sLse[r])) : 0.0f;
      sdS[r * LDP + c] = __float2bfloat16(p * (sdP[r * LDS + c] - sD[r]));
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < kQF; ++i) {
      const int f = warp * kQF + i, rt = f / (HD / 16), ct = f % (HD / 16);
      mma_ab<BN / 16>(acc[i], sdS + rt * 16 * LDP, LDP, sK + ct * 16, LDH);
    }
  }
#pragma unroll
  for (int i = 0; i < kQF; ++i) {
    const int f = warp * kQF + i, rt = f / (HD / 16), ct = f % (HD / 16);
    store_frag<HD>(acc[i], scale, stage, dq, s0 + q0, rt * 16, nq, ct * 16, Hq, h);
  }
}

// ---------------------------------------------------------------------------------------------------------
// Host side.

void check_dims(const ds::ops::AttnDims& d, int64_t max_seqlen, const char* what) {
  const std::string w(what);
  DS_CUDA_REQUIRE(d.N >= 0 && d.num_seqs >= 0, w + ": N (" + std::to_string(d.N) + ") and num_seqs (" +
                                                   std::to_string(d.num_seqs) + ") must be >= 0");
  DS_CUDA_REQUIRE(d.Hq > 0 && d.Hkv > 0 && d.Hq % d.Hkv == 0,
                  w + ": Hq (" + std::to_string(d.Hq) + ") must be a positive multiple of Hkv (" +
                      std::to_string(d.Hkv) + ")");
  DS_CUDA_REQUIRE(d.Hq <= 65535, w + ": Hq (" + std::to_string(d.Hq) + ") must be <= 65535");
  DS_CUDA_REQUIRE(d.head_dim == 32 || d.head_dim == 64 || d.head_dim == 128 || d.head_dim == 256,
                  w + ": head_dim (" + std::to_string(d.head_dim) + ") must be 32, 64, 128 or 256");
  DS_CUDA_REQUIRE(d.N == 0 || d.num_seqs > 0, w + ": " + std::to_string(d.N) + " tokens but no sequences");
  DS_CUDA_REQUIRE(max_seqlen >= 0 && max_seqlen <= d.N && (d.N == 0 || max_seqlen > 0),
                  w + ": max_seqlen (" + std::to_string(max_seqlen) + ") must be in [1, N = " + std::to_string(d.N) +
                      "]");
  DS_CUDA_REQUIRE(d.N < (int64_t(1) << 31), w + ": N must fit in int32 (cu_seqlens)");
  DS_CUDA_REQUIRE(d.scale > 0, w + ": scale must be > 0");
}

void check_ptr(const void* p, const char* name, const char* what) {
  DS_CUDA_REQUIRE(p != nullptr, std::string(what) + ": " + name + " is null");
  DS_CUDA_REQUIRE(reinterpret_cast<uintptr_t>(p) % 16 == 0,
                  std::string(what) + ": " + name + " must be 16-byte aligned");
}

template <typename Kernel>
void set_smem(Kernel kernel, size_t bytes) {
  DS_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
}

dim3 tile_grid(int64_t num_seqs, int64_t max_seqlen, int tile, int64_t heads, int& tiles) {
  tiles = static_cast<int>(ds::cuda::ceil_div(max_seqlen, tile));
  const int64_t x = num_seqs * tiles;
  DS_CUDA_REQUIRE(x < (int64_t(1) << 31), "attention: too many tiles (num_seqs * max_seqlen / tile)");
  return dim3(static_cast<unsigned>(x), static_cast<unsigned>(heads));
}

template <int HD>
void launch_forward(const ds::ops::AttnDims& d, const bf16* q, const bf16* k, const bf16* v, const int32_t* cu,
                    int64_t max_seqlen, bf16* o, float* lse, cudaStream_t stream) {
  using L = FwdSmem<HD, Cfg<HD>::FWD_BM, Cfg<HD>::FWD_BN>;
  static_assert(L::bytes <= kMaxSmem);
  int tiles = 0;
  const dim3 grid = tile_grid(d.num_seqs, max_seqlen, Cfg<HD>::FWD_BM, d.Hq, tiles);
  set_smem(attn_fwd_kernel<HD>, L::bytes);
  attn_fwd_kernel<HD><<<grid, kThreads, L::bytes, stream>>>(q, k, v, cu, tiles, static_cast<int>(d.Hq),
                                                            static_cast<int>(d.Hkv), static_cast<int>(d.Hq / d.Hkv),
                                                            static_cast<float>(d.scale * 1.4426950408889634), o, lse);
  DS_CUDA_LAUNCH_CHECK();
}

template <int HD>
void launch_backward(const ds::ops::AttnDims& d, const bf16* q, const bf16* k, const bf16* v, const bf16* o,
                     const float* lse, const bf16* dout, const int32_t* cu, int64_t max_seqlen, bf16* dq, bf16* dk,
                     bf16* dv, float* D, cudaStream_t stream) {
  const int Hq = static_cast<int>(d.Hq), Hkv = static_cast<int>(d.Hkv), group = Hq / Hkv;
  const float sl2 = static_cast<float>(d.scale * 1.4426950408889634), scale = static_cast<float>(d.scale);
  {
    const int64_t rows = d.N * d.Hq;
    const int64_t blocks = ds::cuda::ceil_div(rows, kWarps);
    DS_CUDA_REQUIRE(blocks < (int64_t(1) << 31), "attention_backward: too many rows");
    attn_bwd_dot_kernel<HD><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(o, dout, D, rows);
    DS_CUDA_LAUNCH_CHECK();
  }
  {
    using L = DkvSmem<HD, Cfg<HD>::DKV_BN, Cfg<HD>::DKV_BM>;
    static_assert(L::bytes <= kMaxSmem);
    int tiles = 0;
    const dim3 grid = tile_grid(d.num_seqs, max_seqlen, Cfg<HD>::DKV_BN, d.Hkv, tiles);
    set_smem(attn_bwd_dkdv_kernel<HD>, L::bytes);
    attn_bwd_dkdv_kernel<HD><<<grid, kThreads, L::bytes, stream>>>(q, k, v, dout, lse, D, cu, tiles, Hq, Hkv, group,
                                                                   sl2, scale, dk, dv);
    DS_CUDA_LAUNCH_CHECK();
  }
  {
    using L = DqSmem<HD, Cfg<HD>::DQ_BM, Cfg<HD>::DQ_BN>;
    static_assert(L::bytes <= kMaxSmem);
    int tiles = 0;
    const dim3 grid = tile_grid(d.num_seqs, max_seqlen, Cfg<HD>::DQ_BM, d.Hq, tiles);
    set_smem(attn_bwd_dq_kernel<HD>, L::bytes);
    attn_bwd_dq_kernel<HD><<<grid, kThreads, L::bytes, stream>>>(q, k, v, dout, lse, D, cu, tiles, Hq, Hkv, group,
                                                                 sl2, scale, dq);
    DS_CUDA_LAUNCH_CHECK();
  }
}

}  // namespace

void attention_forward(const ds::ops::AttnDims& d, const bf16* q, const bf16* k, const bf16* v,
                       const int32_t* cu_seqlens, int64_t max_seqlen, bf16* o, float* lse, cudaStream_t stream) {
  check_dims(d, max_seqlen, "attention_forward");
  if (d.N == 0) return;
  const char* w = "attention_forward";
  check_ptr(q, "q", w);
  check_ptr(k, "k", w);
  check_ptr(v, "v", w);
  check_ptr(o, "o", w);
  DS_CUDA_REQUIRE(cu_seqlens != nullptr && lse != nullptr, "attention_forward: cu_seqlens and lse must be non-null");
  switch (d.head_dim) {
    case 32: launch_forward<32>(d, q, k, v, cu_seqlens, max_seqlen, o, lse, stream); break;
    case 64: launch_forward<64>(d, q, k, v, cu_seqlens, max_seqlen, o, lse, stream); break;
    case 128: launch_forward<128>(d, q, k, v, cu_seqlens, max_seqlen, o, lse, stream); break;
    default: launch_forward<256>(d, q, k, v, cu_seqlens, max_seqlen, o, lse, stream); break;
  }
}

size_t attention_scratch_bytes(const ds::ops::AttnDims& d) {
  const int64_t rows = std::max<int64_t>(d.N * d.Hq, 1);
  return static_cast<size_t>((rows * 4 + 255) / 256 * 256);
}

void attention_backward(const ds::ops::AttnDims& d, const bf16* q, const bf16* k, const bf16* v, const bf16* o,
                        const float* lse, const bf16* dout, const int32_t* cu_seqlens, int64_t max_seqlen, bf16* dq,
                        bf16* dk, bf16* dv, void* scratch, cudaStream_t stream) {
  check_dims(d, max_seqlen, "attention_backward");
  if (d.N == 0) return;
  const char* w = "attention_backward";
  check_ptr(q, "q", w);
  check_ptr(k, "k", w);
  check_ptr(v, "v", w);
  check_ptr(o, "o", w);
  check_ptr(dout, "dout", w);
  check_ptr(dq, "dq", w);
  check_ptr(dk, "dk", w);
  check_ptr(dv, "dv", w);
  check_ptr(scratch, "scratch", w);
  DS_CUDA_REQUIRE(cu_seqlens != nullptr && lse != nullptr, "attention_backward: cu_seqlens and lse must be non-null");
  float* D = static_cast<float*>(scratch);
  switch (d.head_dim) {
    case 32: launch_backward<32>(d, q, k, v, o, lse, dout, cu_seqlens, max_seqlen, dq, dk, dv, D, stream); break;
    case 64: launch_backward<64>(d, q, k, v, o, lse, dout, cu_seqlens, max_seqlen, dq, dk, dv, D, stream); break;
    case 128: launch_backward<128>(d, q, k, v, o, lse, dout, cu_seqlens, max_seqlen, dq, dk, dv, D, stream); break;
    default: launch_backward<256>(d, q, k, v, o, lse, dout, cu_seqlens, max_seqlen, dq, dk, dv, D, stream); break;
  }
}

}  // namespace ds::ops::cuda
