// Gated delta rule on the GPU: a simple, exact, deterministic first version (math of gated_delta_rule.h; the fast
// chunked tensor-core kernel is a later step). Per (sequence s, value head h), q/k head hk = h / (Hv/Hk):
//   S̄_t = e^{g_t} S_{t-1};  w_t = v_t − S̄_tᵀ k_t;  u_t = β_t w_t;  S_t = S̄_t + k_t u_tᵀ;  o_t = scale · S_tᵀ q_t
//
// Thread mapping (both directions). The fp32 state S [dk, dv] lives in registers, one state column per P
// threads: thread (column b, slice p) holds R = dk/P rows of column b (R = 32, or dk when dk < 32; P ≤ 4), row
// a(r) = 4·((r/4)·P + p) + r%4 of register r, so that the P lanes of a column read 4 consecutive k/q values
// each with one vector load. The lanes of a column are adjacent, so a column contraction (Sᵀk, dSᵀk) is R
// per-thread FMAs plus log2(P) shuffles. Columns are independent in the recurrence; only outputs that sum over
// columns (dq, dk, dg, dβ) need cross-thread reductions.
//
// Forward (gdn_fwd_kernel): one block per (sequence, value head, tile of ≤ 32 columns), P·32 threads; tokens are
// staged 32 at a time in shared memory (fp32). Per token: one pass over the old state gives Sᵀk and Sᵀq, then
// o = scale·(e^g Sᵀq + u (k·q)) (k·q precomputed per staged token) and S ← e^g S + k uᵀ. At the start of every
// chunk of C = chunk_size tokens of a sequence the state is stored in states[chunk_offsets[s] + c][h].
//
// Backward (gdn_bwd_kernel): one block per (sequence, value head, group of TV = min(dv, 32) state columns), P·TV
// threads, G = dv/TV groups, chunks in reverse with dS (the gradient w.r.t. the state after the chunk, zero after
// the last chunk; its columns are the block's) carried in registers. Every per-column quantity (w, u, du, dv, the
// S and dS columns) only needs the block's own columns; every column sum (dq, dk, dβ, dg, e_i and the pair dot
// products dO_m·u_j, du_m·u_j of phase 3) is a sum over the groups of the same expression restricted to the
// group's columns, and everything downstream of them is linear, so each block runs the algorithm below on its
// columns and writes its dq, dk, dg, dβ as fp32 partials [G, ...] in scratch (the k·k and q̃·k pair products of
// phase 3 are recomputed per group). Per chunk of L
// tokens starting from S0 (read from states), with in-chunk cumulative gates c_i = Σ_{m≤i} g_m, G_i = e^{c_i},
// Γ_ij = e^{c_i − c_j} (j ≤ i only, so no exponent is positive):
//   phase 1, tokens forward: replay the recurrence from S0 (bitwise the forward kernel's arithmetic), keep w_i in
//            shared memory, dq_i = scale·S_i dO_i (a row contraction: per-warp reduce-scatter with shuffles, then
//            a fixed-order sum over warps), and e_i = k_iᵀ dS u_i (dS still holds the chunk-end gradient);
//   phase 2, tokens in reverse (docs/model.md §4): dS += q̃_i dO_iᵀ; du_i = dSᵀ k_i; dv_i = β_i du_i;
//            dβ_i = du_i·w_i; dk_i ← dS u_i − β_i G_i S0 du_i (row contraction); dS̄ = dS − β_i k_i du_iᵀ;
//            dg_i ← G_i ⟨dS̄, S0⟩; dS ← e^{g_i} dS̄.  S0 is kept in shared memory (each thread its own slice).
//   phase 3, chunk-level terms of S̄_i = G_i S0 + Σ_{j<i} Γ_ij k_j u_jᵀ that phase 2 left out (no per-token states
//            are ever stored):  dk_i −= β_i Σ_{j<i} Γ_ij (du_i·u_j) k_j, and
//            dg_i += Σ_{m≥i} Σ_{j<i} M_mj + Σ_{j<i} Γ_{L−1,j} e_j,
//            M_mj = Γ_mj ((q̃_m·k_j)(dO_m·u_j) − β_m (k_m·k_j)(du_m·u_j))   (⟨dS̄_i, Σ_{j<i} Γ_ij k_j u_jᵀ⟩ expanded
//            with dS̄_i = Σ_{m≥i} Γ_mi (q̃_m dO_mᵀ − β_m k_m du_mᵀ) + Γ_{L−1,i} dS_end; the m-sum is a column sum of
//            the row-wise exclusive prefix sums of M, with Γ_{L−1,j} e_j as an extra row m = L).
//            Every term carries its own decay factor, so strong decay (g ≤ −50) gives tiny dg without cancellation.
// dk is accumulated in an fp32 scratch [G, N, Hv, dk] (phase 2 writes, phase 3 adds). With G > 1 or GVA (Hv > Hk)
// dq and dk are written per (column group, value head) into fp32 scratch and summed (value head of the GVA group
// outer, column group inner) by gdn_reduce_kernel, which also sums the [G, N, Hv] dg and dβ partials when G > 1;
// with G == 1 and Hv == Hk they are converted to bf16 in place. No atomics anywhere: results are bitwise
// reproducible.
//
// Cost estimate (dk = dv = 128, C = 64; H200: 132 SMs, ~1.9 GHz). Forward: 3·dk·dv FMAs per token and head over
// 128 threads per 32-column tile (per thread and token ≈ 100 FMAs, 4 shuffles, 24 vector shared loads); 32k
// tokens × 32 heads × 4 tiles = 128 blocks ≈ one per SM, each latency-bound at ≈ 150–250 cycles per token
// → ≈ 3–5 ms. Backward: per token and head ≈ 9·dk·dv FMAs in phases 1–2 plus the row contractions (≈ 60 shuffles
// per thread and token) and 2 block barriers, ≈ 1200 cycles per token and phase for a 512-thread block, plus
// phase 3 (≈ C²/2·(2dk+2dv) + C²/2·dk FMAs per chunk, ≈ 300 cycles per token) → ≈ 2700 cycles per token. One
// block per (sequence, head) kept a single 32k-token sequence on 32 SMs (measured 110 ms); with the columns split
// into G = 4 groups of 32 (128-thread blocks, ≈ 98 KB shared memory, two fit per SM) the same problem runs 128
// blocks, each with a quarter of the per-token work in phases 1–2 (phase 3's k·k, q̃·k products, ≈ C²/2·2dk per
// chunk, are repeated in every group), plus one reduction pass over the fp32 partials (≈ 2·G·N·Hv·dk·4 bytes
// read). The chunked tensor-core kernel replaces all of this.
//
// Limits: dk, dv ∈ {16, 32, 64, 128}; chunk_size ≤ 64 (the backward's shared memory is sized for 64 tokens:
// ≈ 98 KB per block at dk = 128).
#include "ops/gated_delta_rule/cuda.h"

#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#include "core/cuda/kernel_utils.cuh"

namespace ds::ops::cuda {
namespace {

using ds::cuda::aligned16;
using ds::cuda::bf16;
using ds::cuda::store_f8;

constexpr int kMaxChunk = 64;  // backward shared memory is sized for chunks of up to 64 tokens
constexpr int kFwdTile = 32;   // tokens staged per forward tile

// State rows per thread (R) and threads per state column (P).
template <int DK>
struct Rows {
  static constexpr int R = DK >= 32 ? 32 : DK;
  static constexpr int P = DK / R;
  static_assert(R % 8 == 0 && (P == 1 || P == 2 || P == 4), "unsupported dk");
};

constexpr int ilog2(int x) { return x <= 1 ? 0 : 1 + ilog2(x / 2); }
constexpr int cmin(int a, int b) { return a < b ? a : b; }
constexpr int cmax(int a, int b) { return a > b ? a : b; }
constexpr int align16(int bytes) { return (bytes + 15) / 16 * 16; }

// Row of register r of the thread in column slice p (four consecutive rows per vector load).
template <int P>
__device__ __forceinline__ int row_of(int r, int p) {
  return 4 * ((r >> 2) * P + p) + (r & 3);
}

__device__ __forceinline__ float bf_lo(uint32_t x) { return __uint_as_float(x << 16); }
__device__ __forceinline__ float bf_hi(uint32_t x) { return __uint_as_float(x & 0xffff0000u); }
__device__ __forceinline__ float bf2f(bf16 x) { return __bfloat162float(x); }

// Re-reads the thread's 4·N k values (bf16 pairs) of a shared row through volatile loads, so that the compiler
// cannot keep the earlier copy live across the shuffles in between (register pressure: 512 threads × 128 regs).
template <int N, int P>
__device__ __forceinline__ void reload_k(uint2 (&kp)[N], const bf16* row, int p) {
  const volatile unsigned* kv = reinterpret_cast<const volatile unsigned*>(row);
#pragma unroll
  for (int r4 = 0; r4 < N; ++r4) kp[r4] = make_uint2(kv[2 * (r4 * P + p)], kv[2 * (r4 * P + p) + 1]);
}

// Kept local rather than ds::cuda::unpack8 (core/cuda/kernel_utils.cuh): same values, but the shared form changes
// the backward kernel's instruction schedule, and this one is what was validated on the GPU.
__device__ __forceinline__ void unpack8(const uint4& u, float* f) {
  f[0] = bf_lo(u.x), f[1] = bf_hi(u.x), f[2] = bf_lo(u.y), f[3] = bf_hi(u.y);
  f[4] = bf_lo(u.z), f[5] = bf_hi(u.z), f[6] = bf_lo(u.w), f[7] = bf_hi(u.w);
}

// Cooperative copy of rows × cols bf16 (cols % 8 == 0) from global rows of src_stride elements into shared
// memory rows of dst_stride elements, as bf16 (T = bf16) or converted to fp32 (T = float). vec: 16-byte global
// loads allowed (src and src_stride aligned).
template <typename T>
__device__ __forceinline__ void stage_rows(T* dst, int dst_stride, const bf16* src, int64_t src_stride, int rows,
                                           int cols, bool vec, int tid, int nt) {
  if (vec) {
    const int g8 = cols / 8;
    for (int idx = tid; idx < rows * g8; idx += nt) {
      const int r = idx / g8, c8 = (idx - r * g8) * 8;
      const uint4 u = *reinterpret_cast<const uint4*>(src + r * src_stride + c8);
      if constexpr (sizeof(T) == 2) {
        *reinterpret_cast<uint4*>(dst + r * dst_stride + c8) = u;
      } else {
        float f[8];
        unpack8(u, f);
        store_f8(dst + r * dst_stride + c8, 0, f);
      }
    }
  } else {
    for (int idx = tid; idx < rows * cols; idx += nt) {
      const int r = idx / cols, c = idx - r * cols;
      const bf16 x = src[r * src_stride + c];
      if constexpr (sizeof(T) == 2)
        dst[r * dst_stride + c] = x;
      else
        dst[r * dst_stride + c] = bf2f(x);
    }
  }
}

// Number of values a lane holds after the reduce-scatter steps 1.. of a warp with 2^steps columns, starting
// from n values after step 0.
constexpr int rs_final(int n, int steps) { return (steps == 0 || n == 1) ? n : rs_final(n / 2, steps - 1); }

// Reduce-scatter steps S..LOGC-1 across the columns of a warp (lanes c·P + p, partner lane = lane ^ (P << S)):
// v holds N partial sums for the thread's register indices off .. off+N-1; each step keeps the half selected by
// bit S of the lane's column c and adds the partner's copy. When N reaches 1 before the last step, the remaining
// steps are plain butterflies and only the lane whose remaining column bits are 0 owns the result.
template <int N, int S, int LOGC, int P, int M>
__device__ __forceinline__ void rs_steps(float (&v)[M], int c, int& off, bool& owner, unsigned mask) {
  if constexpr (S < LOGC) {
    if constexpr (N > 1) {
      constexpr int H = N / 2;
      const bool bit = (c >> S) & 1;
#pragma unroll
      for (int k = 0; k < H; ++k) {
        const float send = bit ? v[k] : v[k + H];
        const float keep = bit ? v[k + H] : v[k];
        v[k] = keep + __shfl_xor_sync(mask, send, P << S);
      }
      if (bit) off += H;
      rs_steps<H, S + 1, LOGC, P>(v, c, off, owner, mask);
    } else {
      v[0] += __shfl_xor_sync(mask, v[0], P << S);
      if ((c >> S) & 1) owner = false;
      rs_steps<1, S + 1, LOGC, P>(v, c, off, owner, mask);
    }
  }
}

// ------------------------------------------------------------------------------------------------------------
// Forward
// ------------------------------------------------------------------------------------------------------------

struct FwdArgs {
  const bf16* q;
  const bf16* k;
  const bf16* v;
  int64_t v_stride;
  const float* g;
  const float* beta;
  const int32_t* cu;
  const int32_t* chunk_off;
  bf16* o;
  float* states;
  int Hk, Hv, C;
  float scale;
  bool vec_qk, vec_v;
};

template <int DK, int DV>
struct FwdCfg {
  static constexpr int R = Rows<DK>::R, P = Rows<DK>::P;
  static constexpr int TV = cmin(DV, 32);  // state columns per block
  static constexpr int NTILE = DV / TV;
  static constexpr int NT = P * TV;
  static constexpr int WT = cmin(NT, 32);
  static constexpr unsigned MASK = WT == 32 ? 0xffffffffu : ((1u << WT) - 1u);
};

template <int DK, int DV>
__global__ void __launch_bounds__(FwdCfg<DK, DV>::NT) gdn_fwd_kernel(const FwdArgs a) {
  using Cf = FwdCfg<DK, DV>;
  constexpr int R = Cf::R, P = Cf::P, TV = Cf::TV, NT = Cf::NT;
  __shared__ __align__(16) float Ks[kFwdTile][DK];
  __shared__ __align__(16) float Qs[kFwdTile][DK];
  __shared__ __align__(16) float Vs[kFwdTile][TV];
  __shared__ float gs[kFwdTile], es[kFwdTile], bs[kFwdTile], kqs[kFwdTile];

  const int64_t blk = blockIdx.x;
  const int64_t task = blk / Cf::NTILE;
  const int tile = static_cast<int>(blk - task * Cf::NTILE);
  const int64_t s = task / a.Hv;
  const int h = static_cast<int>(task - s * a.Hv);
  const int hk = h / (a.Hv / a.Hk);
  const int64_t bos = a.cu[s];
  const int len = a.cu[s + 1] - a.cu[s];
  if (len <= 0) return;
  const int tid = threadIdx.x, p = tid % P, cl = tid / P, b = tile * TV + cl;
  const int64_t cbase = a.chunk_off[s];

  float S[R];
#pragma unroll
  for (int r = 0; r < R; ++r) S[r] = 0.f;

  for (int t0 = 0; t0 < len; t0 += kFwdTile) {
    const int n = cmin(kFwdTile, len - t0);
    const int64_t ts = bos + t0;
    __syncthreads();  // the previous tile is consumed
    stage_rows<float>(&Ks[0][0], DK, a.k + (ts * a.Hk + hk) * DK, int64_t(a.Hk) * DK, n, DK, a.vec_qk, tid, NT);
    stage_rows<float>(&Qs[0][0], DK, a.q + (ts * a.Hk + hk) * DK, int64_t(a.Hk) * DK, n, DK, a.vec_qk, tid, NT);
    stage_rows<float>(&Vs[0][0], TV, a.v + ts * a.v_stride + int64_t(h) * DV + tile * TV, a.v_stride, n, TV, a.vec_v,
                      tid, NT);
    for (int i = tid; i < n; i += NT) {
      const float gv = a.g[(ts + i) * a.Hv + h];
      gs[i] = gv;
      es[i] = expf(gv);
      bs[i] = a.beta[(ts + i) * a.Hv + h];
    }
    __syncthreads();
    // k·q per staged token (start offset rotated by token so that the threads hit distinct banks).
    for (int i = tid; i < n; i += NT) {
      float acc = 0.f;
      for (int j = 0; j < DK; ++j) {
        const int x = (j + i) & (DK - 1);
        acc = fmaf(Ks[i][x], Qs[i][x], acc);
      }
      kqs[i] = acc;
    }
    __syncthreads();

    for (int i = 0; i < n; ++i) {
      const int tl = t0 + i;
      if (tl % a.C == 0) {  // chunk start: save the state for the backward
        float* st = a.states + ((cbase + tl / a.C) * a.Hv + h) * int64_t(DK * DV) + b;
#pragma unroll
        for (int r = 0; r < R; ++r) st[int64_t(row_of<P>(r, p)) * DV] = S[r];
      }
      const float* kr = &Ks[i][0];
      const float* qr = &Qs[i][0];
      float ak[4] = {0.f, 0.f, 0.f, 0.f}, aq[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int r4 = 0; r4 < R / 4; ++r4) {
        const float4 kk = *reinterpret_cast<const float4*>(kr + 4 * (r4 * P + p));
        const float4 qq = *reinterpret_cast<const float4*>(qr + 4 * (r4 * P + p));
        ak[0] = fmaf(S[4 * r4 + 0], kk.x, ak[0]);
        ak[1] = fmaf(S[4 * r4 + 1], kk.y, ak[1]);
        ak[2] = fmaf(S[4 * r4 + 2], kk.z, ak[2]);
        ak[3] = fmaf(S[4 * r4 + 3], kk.w, ak[3]);
        aq[0] = fmaf(S[4 * r4 + 0], qq.x, aq[0]);
        aq[1] = fmaf(S[4 * r4 + 1], qq.y, aq[1]);
        aq[2] = fmaf(S[4 * r4 + 2], qq.z, aq[2]);
        aq[3] = fmaf(S[4 * r4 + 3], qq.w, aq[3]);
      }
      float sk = (ak[0] + ak[1]) + (ak[2] + ak[3]);
      float sq = (aq[0] + aq[1]) + (aq[2] + aq[3]);
#pragma unroll
      for (int o = 1; o < P; o <<= 1) {
        sk += __shfl_xor_sync(Cf::MASK, sk, o);
        sq += __shfl_xor_sync(Cf::MASK, sq, o);
      }
      const float eg = es[i];
      const float w = fmaf(-eg, sk, Vs[i][cl]);  // v − S̄ᵀk
      const float u = bs[i] * w;
      const float ov = a.scale * fmaf(eg, sq, u * kqs[i]);  // scale · (e^g Sᵀq + u (k·q)) = scale · S_tᵀ q
#pragma unroll
      for (int r4 = 0; r4 < R / 4; ++r4) {
        const float4 kk = *reinterpret_cast<const float4*>(kr + 4 * (r4 * P + p));
        S[4 * r4 + 0] = fmaf(kk.x, u, eg * S[4 * r4 + 0]);
        S[4 * r4 + 1] = fmaf(kk.y, u, eg * S[4 * r4 + 1]);
        S[4 * r4 + 2] = fmaf(kk.z, u, eg * S[4 * r4 + 2]);
        S[4 * r4 + 3] = fmaf(kk.w, u, eg * S[4 * r4 + 3]);
      }
      if (p == 0) a.o[((bos + tl) * a.Hv + h) * DV + b] = __float2bfloat16_rn(ov);
    }
  }
}

// ------------------------------------------------------------------------------------------------------------
// Backward
// ------------------------------------------------------------------------------------------------------------

struct BwdArgs {
  const bf16* q;
  const bf16* k;
  const bf16* v;
  int64_t v_stride;
  const float* g;
  const float* beta;
  const int32_t* cu;
  const int32_t* chunk_off;
  const float* states;
  const bf16* dout;
  bf16* dq;
  bf16* dk;
  bf16* dv;
  int64_t dv_stride;
  float* dg;
  float* dbeta;
  float* dq_part;    // [G, N, Hv, dk] fp32 partials unless direct_qk (then null)
  float* dk_part;    // [G, N, Hv, dk] fp32 (always)
  float* dg_part;    // [G, N, Hv] fp32 partials unless direct_gb (then null)
  float* db_part;    // [G, N, Hv] fp32 partials unless direct_gb (then null)
  int64_t pstride;   // N·Hv·dk: stride of the column groups in dq_part / dk_part
  int64_t gstride;   // N·Hv: stride of the column groups in dg_part / db_part
  bool direct_qk;    // G == 1 and Hv == Hk: dq, dk written as bf16 by the kernel
  bool direct_gb;    // G == 1: dg, dβ written by the kernel
  int Hk, Hv, C;
  float scale;
  bool vec_qk, vec_v, vec_do;
};

template <int DK, int DV>
struct BwdCfg {
  static constexpr int R = Rows<DK>::R, P = Rows<DK>::P;
  static constexpr int TV = cmin(DV, 32);  // state columns per block
  static constexpr int G = DV / TV;        // column groups per (sequence, head)
  static constexpr int NT = P * TV;
  static constexpr int WT = cmin(NT, 32);  // threads per (possibly partial) warp
  static constexpr int NW = NT / WT;
  static constexpr int CPW = WT / P;  // state columns per warp
  static constexpr int LOGC = ilog2(CPW);
  static constexpr int NFIN = rs_final(R / 2, LOGC - 1);
  static constexpr unsigned MASK = WT == 32 ? 0xffffffffu : ((1u << WT) - 1u);
  static constexpr int C = kMaxChunk;
  static constexpr int LP = C + 1;                             // row stride of the phase-3 pair matrices
  static constexpr int KS = DK + 8, OS = TV + 8, WS = TV + 4;  // shared row strides (elements)
  // Shared memory layout (bytes). The stash (S0, one float4 column per thread and register quad) is dead in
  // phase 3 and reused for the pair matrices M [(C+1) × LP] and Z [C × LP].
  static constexpr int STASH = align16(cmax(DK * TV * 4, ((C + 1) * LP + C * LP) * 4));
  static constexpr int OFF_K = STASH;
  static constexpr int OFF_Q = OFF_K + align16(C * KS * 2);
  static constexpr int OFF_O = OFF_Q + align16(C * KS * 2);
  static constexpr int OFF_W = OFF_O + align16(C * OS * 2);
  static constexpr int OFF_U = OFF_W + align16(C * WS * 4);
  static constexpr int OFF_RED = OFF_U + align16(C * WS * 4);
  static constexpr int OFF_SC = OFF_RED + align16(2 * NW * DK * 4);
  static constexpr int N_SC = 5 * C + 3 * C * NW;  // g, β, e^g, c, G; then sA, sB, sE [C][NW]
  static constexpr int BYTES = OFF_SC + align16(N_SC * 4);
  static_assert(R % 8 == 0 && LOGC >= 1, "unsupported shape");
  static_assert(BYTES <= 227 * 1024, "backward shared memory exceeds the 227 KB per block of sm_90");
};

template <int DK, int DV>
__global__ void __launch_bounds__(BwdCfg<DK, DV>::NT, 1) gdn_bwd_kernel(const BwdArgs a) {
  using Cf = BwdCfg<DK, DV>;
  constexpr int R = Cf::R, P = Cf::P, NT = Cf::NT, WT = Cf::WT, NW = Cf::NW, LP = Cf::LP;
  constexpr int KS = Cf::KS, OS = Cf::OS, WS = Cf::WS;
  constexpr unsigned MASK = Cf::MASK;
  extern __shared__ __align__(16) unsigned char gdn_smem[];
  float4* stash = reinterpret_cast<float4*>(gdn_smem);
  float* Mm = reinterpret_cast<float*>(gdn_smem);  // phase 3 only
  float* Zm = Mm + (Cf::C + 1) * LP;
  bf16* Ks = reinterpret_cast<bf16*>(gdn_smem + Cf::OFF_K);
  bf16* Qs = reinterpret_cast<bf16*>(gdn_smem + Cf::OFF_Q);
  bf16* Os = reinterpret_cast<bf16*>(gdn_smem + Cf::OFF_O);
  float* Ws = reinterpret_cast<float*>(gdn_smem + Cf::OFF_W);
  float* Us = reinterpret_cast<float*>(gdn_smem + Cf::OFF_U);  // du
  float* red = reinterpret_cast<float*>(gdn_smem + Cf::OFF_RED);
  float* gS = reinterpret_cast<float*>(gdn_smem + Cf::OFF_SC);
  float* bS = gS + Cf::C;
  float* eS = bS + Cf::C;
  float* cS = eS + Cf::C;
  float* GS = cS + Cf::C;
  float* sA = GS + Cf::C;       // [C][NW] per-warp partials of G_i ⟨dS̄_i, S0⟩
  float* sB = sA + Cf::C * NW;  // dβ
  float* sE = sB + Cf::C * NW;  // e_i = k_iᵀ dS_end u_i

  const int64_t blk = blockIdx.x;
  const int64_t task = blk / Cf::G;
  const int tile = static_cast<int>(blk - task * Cf::G);
  const int64_t s = task / a.Hv;
  const int h = static_cast<int>(task - s * a.Hv);
  const int ratio = a.Hv / a.Hk;
  const int hk = h / ratio;
  const int64_t bos = a.cu[s];
  const int len = a.cu[s + 1] - a.cu[s];
  if (len <= 0) return;
  constexpr int TV = Cf::TV;
  // cl: the thread's column within the block's tile (shared-memory index); b: its state column.
  const int tid = threadIdx.x, lane = tid % WT, warp = tid / WT, p = tid % P, c = lane / P, cl = tid / P;
  const int b = tile * TV + cl;
  float* const dq_part = a.direct_qk ? nullptr : a.dq_part + tile * a.pstride;
  float* const dk_part = a.dk_part + tile * a.pstride;
  float* const dg_out = a.direct_gb ? a.dg : a.dg_part + tile * a.gstride;
  float* const db_out = a.direct_gb ? a.dbeta : a.db_part + tile * a.gstride;
  const int C = a.C;
  const int nch = (len + C - 1) / C;
  const int64_t cbase = a.chunk_off[s];
  const float scale = a.scale;

  float dS[R];
#pragma unroll
  for (int r = 0; r < R; ++r) dS[r] = 0.f;
  int buf = 0;

  for (int ch = nch - 1; ch >= 0; --ch) {
    const int L = cmin(C, len - ch * C);
    const int64_t t0 = bos + int64_t(ch) * C;
    __syncthreads();  // the previous chunk's phase 3 is done with shared memory

    // ---- Phase 0: stage the chunk, S0 into registers and the stash.
    stage_rows<bf16>(Ks, KS, a.k + (t0 * a.Hk + hk) * DK, int64_t(a.Hk) * DK, L, DK, a.vec_qk, tid, NT);
    stage_rows<bf16>(Qs, KS, a.q + (t0 * a.Hk + hk) * DK, int64_t(a.Hk) * DK, L, DK, a.vec_qk, tid, NT);
    stage_rows<bf16>(Os, OS, a.dout + (t0 * a.Hv + h) * DV + tile * TV, int64_t(a.Hv) * DV, L, TV, a.vec_do, tid,
                     NT);
    stage_rows<float>(Ws, WS, a.v + t0 * a.v_stride + int64_t(h) * DV + tile * TV, a.v_stride, L, TV, a.vec_v, tid,
                      NT);
    for (int i = tid; i < L; i += NT) {
      const float gv = a.g[(t0 + i) * a.Hv + h];
      gS[i] = gv;
      eS[i] = expf(gv);
      bS[i] = a.beta[(t0 + i) * a.Hv + h];
    }
    float S[R];
    {
      const float* st = a.states + ((cbase + ch) * a.Hv + h) * int64_t(DK * DV) + b;
#pragma unroll
      for (int r4 = 0; r4 < R / 4; ++r4) {
        const int a0 = row_of<P>(4 * r4, p);
        const float4 x = make_float4(st[int64_t(a0) * DV], st[int64_t(a0 + 1) * DV], st[int64_t(a0 + 2) * DV],
                                     st[int64_t(a0 + 3) * DV]);
        stash[r4 * NT + tid] = x;
        S[4 * r4 + 0] = x.x, S[4 * r4 + 1] = x.y, S[4 * r4 + 2] = x.z, S[4 * r4 + 3] = x.w;
      }
    }
    __syncthreads();
    if (tid == 0) {  // in-chunk cumulative gates (read from phase 2 on; phase 1 has barriers in between)
      float acc = 0.f;
      for (int i = 0; i < L; ++i) {
        acc += gS[i];
        cS[i] = acc;
        GS[i] = expf(acc);
      }
    }

    // ---- Phase 1: replay forward; dq_i = scale · S_i dO_i; e_i = k_iᵀ dS_end u_i; w_i kept in Ws.
    for (int i = 0; i < L; ++i) {
      uint2 kp[R / 4];
      const uint2* krow = reinterpret_cast<const uint2*>(Ks + i * KS);
#pragma unroll
      for (int r4 = 0; r4 < R / 4; ++r4) kp[r4] = krow[r4 * P + p];
      const float vb = Ws[i * WS + cl];
      const float dob = bf2f(Os[i * OS + cl]);
      float ak[4] = {0.f, 0.f, 0.f, 0.f}, ay[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int r4 = 0; r4 < R / 4; ++r4) {
        const float k0 = bf_lo(kp[r4].x), k1 = bf_hi(kp[r4].x), k2 = bf_lo(kp[r4].y), k3 = bf_hi(kp[r4].y);
        ak[0] = fmaf(S[4 * r4 + 0], k0, ak[0]);
        ak[1] = fmaf(S[4 * r4 + 1], k1, ak[1]);
        ak[2] = fmaf(S[4 * r4 + 2], k2, ak[2]);
        ak[3] = fmaf(S[4 * r4 + 3], k3, ak[3]);
        ay[0] = fmaf(dS[4 * r4 + 0], k0, ay[0]);
        ay[1] = fmaf(dS[4 * r4 + 1], k1, ay[1]);
        ay[2] = fmaf(dS[4 * r4 + 2], k2, ay[2]);
        ay[3] = fmaf(dS[4 * r4 + 3], k3, ay[3]);
      }
      float sk = (ak[0] + ak[1]) + (ak[2] + ak[3]);
      float y = (ay[0] + ay[1]) + (ay[2] + ay[3]);
#pragma unroll
      for (int o = 1; o < P; o <<= 1) {
        sk += __shfl_xor_sync(MASK, sk, o);
        y += __shfl_xor_sync(MASK, y, o);
      }
      const float eg = eS[i];
      const float w = fmaf(-eg, sk, vb);  // same arithmetic as the forward kernel
      const float u = bS[i] * w;
      reload_k<R / 4, P>(kp, Ks + i * KS, p);
#pragma unroll
      for (int r4 = 0; r4 < R / 4; ++r4) {
        S[4 * r4 + 0] = fmaf(bf_lo(kp[r4].x), u, eg * S[4 * r4 + 0]);
        S[4 * r4 + 1] = fmaf(bf_hi(kp[r4].x), u, eg * S[4 * r4 + 1]);
        S[4 * r4 + 2] = fmaf(bf_lo(kp[r4].y), u, eg * S[4 * r4 + 2]);
        S[4 * r4 + 3] = fmaf(bf_hi(kp[r4].y), u, eg * S[4 * r4 + 3]);
      }
      // Row contraction S_i dO_i: reduce-scatter over the warp's columns (step 0 inline), then across warps.
      float v[R / 2];
      const bool b0 = c & 1;
#pragma unroll
      for (int kx = 0; kx < R / 2; ++kx) {
        const float lo = S[kx] * dob, hi = S[kx + R / 2] * dob;
        v[kx] = (b0 ? hi : lo) + __shfl_xor_sync(MASK, b0 ? lo : hi, P);
      }
      int off = b0 ? R / 2 : 0;
      bool owner = true;
      rs_steps<R / 2, 1, Cf::LOGC, P>(v, c, off, owner, MASK);
      float ep = p == 0 ? u * y : 0.f;
#pragma unroll
      for (int o = 1; o < WT; o <<= 1) ep += __shfl_xor_sync(MASK, ep, o);
      __syncwarp(MASK);  // every lane of the column has read v_i before w_i replaces it
      if (p == 0) Ws[i * WS + cl] = w;
      if (lane == 0) sE[i * NW + warp] = ep;
      float* rb = red + (buf * NW + warp) * DK;
      if (owner) {
#pragma unroll
        for (int kx = 0; kx < Cf::NFIN; ++kx) rb[row_of<P>(off + kx, p)] = v[kx];
      }
      __syncthreads();
      const int64_t t = t0 + i;
      for (int x = tid; x < DK; x += NT) {
        const float* rr = red + buf * NW * DK + x;
        float acc = rr[0];
#pragma unroll
        for (int wi = 1; wi < NW; ++wi) acc += rr[wi * DK];
        const float val = scale * acc;
        if (a.direct_qk)
          a.dq[(t * a.Hk + hk) * DK + x] = __float2bfloat16_rn(val);
        else
          dq_part[(t * a.Hv + h) * DK + x] = val;
      }
      buf ^= 1;
    }

    // ---- Phase 2: reverse-time recurrence.
    for (int i = L - 1; i >= 0; --i) {
      uint2 kp[R / 4], qp[R / 4];
      const uint2* krow = reinterpret_cast<const uint2*>(Ks + i * KS);
      const uint2* qrow = reinterpret_cast<const uint2*>(Qs + i * KS);
#pragma unroll
      for (int r4 = 0; r4 < R / 4; ++r4) {
        kp[r4] = krow[r4 * P + p];
        qp[r4] = qrow[r4 * P + p];
      }
      const float bt = bS[i], eg = eS[i], Gi = GS[i];
      const float wb = Ws[i * WS + cl];
      const float u = bt * wb;
      const float sdob = scale * bf2f(Os[i * OS + cl]);
      float ad[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int r4 = 0; r4 < R / 4; ++r4) {
        const float k0 = bf_lo(kp[r4].x), k1 = bf_hi(kp[r4].x), k2 = bf_lo(kp[r4].y), k3 = bf_hi(kp[r4].y);
        dS[4 * r4 + 0] = fmaf(bf_lo(qp[r4].x), sdob, dS[4 * r4 + 0]);  // dS += q̃ dOᵀ
        dS[4 * r4 + 1] = fmaf(bf_hi(qp[r4].x), sdob, dS[4 * r4 + 1]);
        dS[4 * r4 + 2] = fmaf(bf_lo(qp[r4].y), sdob, dS[4 * r4 + 2]);
        dS[4 * r4 + 3] = fmaf(bf_hi(qp[r4].y), sdob, dS[4 * r4 + 3]);
        ad[0] = fmaf(dS[4 * r4 + 0], k0, ad[0]);
        ad[1] = fmaf(dS[4 * r4 + 1], k1, ad[1]);
        ad[2] = fmaf(dS[4 * r4 + 2], k2, ad[2]);
        ad[3] = fmaf(dS[4 * r4 + 3], k3, ad[3]);
      }
      float du = (ad[0] + ad[1]) + (ad[2] + ad[3]);
#pragma unroll
      for (int o = 1; o < P; o <<= 1) du += __shfl_xor_sync(MASK, du, o);
      const int64_t t = t0 + i;
      if (p == 0) {
        Us[i * WS + cl] = du;
        a.dv[t * a.dv_stride + int64_t(h) * DV + b] = __float2bfloat16_rn(bt * du);
      }
      reload_k<R / 4, P>(kp, Ks + i * KS, p);
      float pb = p == 0 ? du * wb : 0.f;  // dβ = du·w
      const float coef = bt * Gi * du, bk = bt * du;
      // dk ← dS u − β G S0 du (row contraction, step 0 fused), dS̄ = dS − β k duᵀ, ⟨dS̄, S0⟩, dS ← e^g dS̄.
      float v[R / 2];
      const bool b0 = c & 1;
      float pg[2] = {0.f, 0.f};
#pragma unroll
      for (int r4 = 0; r4 < R / 8; ++r4) {
        const float4 s0l = stash[r4 * NT + tid];
        const float4 s0h = stash[(r4 + R / 8) * NT + tid];
        const float sl[4] = {s0l.x, s0l.y, s0l.z, s0l.w};
        const float sh[4] = {s0h.x, s0h.y, s0h.z, s0h.w};
        const uint2 kl = kp[r4], kh = kp[r4 + R / 8];
        const float kvl[4] = {bf_lo(kl.x), bf_hi(kl.x), bf_lo(kl.y), bf_hi(kl.y)};
        const float kvh[4] = {bf_lo(kh.x), bf_hi(kh.x), bf_lo(kh.y), bf_hi(kh.y)};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int il = 4 * r4 + j, ih = il + R / 2;
          const float pl = fmaf(dS[il], u, -coef * sl[j]);
          const float ph = fmaf(dS[ih], u, -coef * sh[j]);
          v[il] = (b0 ? ph : pl) + __shfl_xor_sync(MASK, b0 ? pl : ph, P);
          const float dl = fmaf(-bk, kvl[j], dS[il]);
          const float dh = fmaf(-bk, kvh[j], dS[ih]);
          pg[0] = fmaf(dl, sl[j], pg[0]);
          pg[1] = fmaf(dh, sh[j], pg[1]);
          dS[il] = eg * dl;
          dS[ih] = eg * dh;
        }
      }
      int off = b0 ? R / 2 : 0;
      bool owner = true;
      rs_steps<R / 2, 1, Cf::LOGC, P>(v, c, off, owner, MASK);
      float pa = Gi * (pg[0] + pg[1]);
#pragma unroll
      for (int o = 1; o < WT; o <<= 1) {
        pa += __shfl_xor_sync(MASK, pa, o);
        pb += __shfl_xor_sync(MASK, pb, o);
      }
      if (lane == 0) {
        sA[i * NW + warp] = pa;
        sB[i * NW + warp] = pb;
      }
      float* rb = red + (buf * NW + warp) * DK;
      if (owner) {
#pragma unroll
        for (int kx = 0; kx < Cf::NFIN; ++kx) rb[row_of<P>(off + kx, p)] = v[kx];
      }
      __syncthreads();
      for (int x = tid; x < DK; x += NT) {
        const float* rr = red + buf * NW * DK + x;
        float acc = rr[0];
#pragma unroll
        for (int wi = 1; wi < NW; ++wi) acc += rr[wi * DK];
        dk_part[(t * a.Hv + h) * DK + x] = acc;
      }
      buf ^= 1;
    }

    // ---- Phase 3: chunk-level pair terms.
    __syncthreads();  // Us, sA/sB/sE and this block's dk_part rows complete; the stash is free
    for (int idx = tid; idx < L * (L - 1) / 2; idx += NT) {  // pairs j < m, row-major over the lower triangle
      int m = static_cast<int>(0.5f * (1.f + sqrtf(1.f + 8.f * static_cast<float>(idx))));
      while (m * (m - 1) / 2 > idx) --m;
      while (m * (m + 1) / 2 <= idx) ++m;
      const int j = idx - m * (m - 1) / 2;
      float qk = 0.f, kk = 0.f, dow = 0.f, duw = 0.f;
      const uint4* qm = reinterpret_cast<const uint4*>(Qs + m * KS);
      const uint4* km = reinterpret_cast<const uint4*>(Ks + m * KS);
      const uint4* kj = reinterpret_cast<const uint4*>(Ks + j * KS);
#pragma unroll 2
      for (int d8 = 0; d8 < DK / 8; ++d8) {
        float fq[8], fm[8], fj[8];
        unpack8(qm[d8], fq);
        unpack8(km[d8], fm);
        unpack8(kj[d8], fj);
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          qk = fmaf(fq[e], fj[e], qk);
          kk = fmaf(fm[e], fj[e], kk);
        }
      }
      const uint4* om = reinterpret_cast<const uint4*>(Os + m * OS);
      const float4* um = reinterpret_cast<const float4*>(Us + m * WS);
      const float4* wj = reinterpret_cast<const float4*>(Ws + j * WS);
#pragma unroll 2
      for (int d8 = 0; d8 < TV / 8; ++d8) {
        float fo[8];
        unpack8(om[d8], fo);
        const float4 u0 = um[2 * d8], u1 = um[2 * d8 + 1], w0 = wj[2 * d8], w1 = wj[2 * d8 + 1];
        const float fu[8] = {u0.x, u0.y, u0.z, u0.w, u1.x, u1.y, u1.z, u1.w};
        const float fw[8] = {w0.x, w0.y, w0.z, w0.w, w1.x, w1.y, w1.z, w1.w};
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          dow = fmaf(fo[e], fw[e], dow);
          duw = fmaf(fu[e], fw[e], duw);
        }
      }
      const float gam = expf(cS[m] - cS[j]);
      const float bj = bS[j], bm = bS[m];
      const float dou = bj * dow, duu = bj * duw;  // dO_m·u_j, du_m·u_j
      Mm[m * LP + j] = gam * (scale * qk * dou - bm * kk * duu);
      Zm[m * LP + j] = bm * gam * duu;
    }
    for (int j = tid; j < L; j += NT) {  // extra row L: Γ_{L−1,j} e_j
      float e = sE[j * NW];
      for (int wi = 1; wi < NW; ++wi) e += sE[j * NW + wi];
      Mm[L * LP + j] = j < L - 1 ? expf(cS[L - 1] - cS[j]) * e : 0.f;
    }
    __syncthreads();
    // Rows m ≤ L: exclusive prefix over j in place, P_m(i) = Σ_{j<i} M_mj for i ≤ min(m, L−1).
    for (int m = tid; m <= L; m += NT) {
      const int lim = m < L ? m : L - 1;
      float run = 0.f;
      for (int j = 0; j <= lim; ++j) {
        const float x = j < lim ? Mm[m * LP + j] : 0.f;
        Mm[m * LP + j] = run;
        run += x;
      }
    }
    __syncthreads();
    for (int i = tid; i < L; i += NT) {
      float bsum = 0.f;
      for (int m = i; m <= L; ++m) bsum += Mm[m * LP + i];
      float as = sA[i * NW], bb = sB[i * NW];
      for (int wi = 1; wi < NW; ++wi) {
        as += sA[i * NW + wi];
        bb += sB[i * NW + wi];
      }
      dg_out[(t0 + i) * a.Hv + h] = as + bsum;
      db_out[(t0 + i) * a.Hv + h] = bb;
    }
    // dk_i −= Σ_{j<i} Z_ij k_j, then bf16 when there is no GVA group to sum.
    for (int idx = tid; idx < L * DK; idx += NT) {
      const int i = idx / DK, x = idx - i * DK;
      float acc = 0.f;
      for (int j = 0; j < i; ++j) acc = fmaf(Zm[i * LP + j], bf2f(Ks[j * KS + x]), acc);
      const int64_t t = t0 + i;
      const int64_t o = (t * a.Hv + h) * DK + x;
      const float val = dk_part[o] - acc;
      if (a.direct_qk)
        a.dk[(t * a.Hk + hk) * DK + x] = __float2bfloat16_rn(val);
      else
        dk_part[o] = val;
    }
  }
}

// Deterministic second pass over the backward's fp32 partials (fixed order: value head of the GVA group outer,
// column group inner, i.e. the CPU reference's head order):
//   dq[t, j, :] = Σ_{m<r} Σ_{g<G} dq_part[g, t, j·r + m, :]  (same for dk), as bf16, for idx < 2·nqk (when nqk > 0);
//   dg[t, h] = Σ_{g<G} dg_part[g, t, h]  (same for dβ), for the next 2·ngb indices (when ngb > 0).
struct RedArgs {
  const float* dq_part;
  const float* dk_part;
  const float* dg_part;
  const float* db_part;
  bf16* dq;
  bf16* dk;
  float* dg;
  float* dbeta;
  int64_t nqk;      // N·Hk·dk, or 0 when dq, dk were written directly
  int64_t ngb;      // N·Hv, or 0 when dg, dβ were written directly
  int64_t pstride;  // N·Hv·dk
  int r, G, width;  // width: dk
};

__global__ void gdn_reduce_kernel(const RedArgs a) {
  const int64_t total = 2 * a.nqk + 2 * a.ngb;
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < total;
       idx += int64_t(gridDim.x) * blockDim.x) {
    if (idx < 2 * a.nqk) {
      const bool is_k = idx >= a.nqk;
      const int64_t e = is_k ? idx - a.nqk : idx;
      const int64_t row = e / a.width, x = e - row * a.width;  // row = t·Hk + j
      const float* pp = (is_k ? a.dk_part : a.dq_part) + row * a.r * a.width + x;
      float acc = pp[0];
      for (int m = 0; m < a.r; ++m)
        for (int g = m == 0 ? 1 : 0; g < a.G; ++g) acc += pp[g * a.pstride + int64_t(m) * a.width];
      (is_k ? a.dk : a.dq)[e] = __float2bfloat16_rn(acc);
    } else {
      const int64_t e0 = idx - 2 * a.nqk;
      const bool is_b = e0 >= a.ngb;
      const int64_t e = is_b ? e0 - a.ngb : e0;
      const float* pp = (is_b ? a.db_part : a.dg_part) + e;
      float acc = pp[0];
      for (int g = 1; g < a.G; ++g) acc += pp[g * a.ngb];
      (is_b ? a.dbeta : a.dg)[e] = acc;
    }
  }
}

// ------------------------------------------------------------------------------------------------------------
// Launchers
// ------------------------------------------------------------------------------------------------------------

bool dim_ok(int64_t x) { return x == 16 || x == 32 || x == 64 || x == 128; }

void check_dims(const GdnDims& d, const char* who) {
  const std::string w(who);
  DS_CUDA_REQUIRE(d.N >= 0 && d.num_seqs >= 0, w + ": N and num_seqs must be >= 0");
  DS_CUDA_REQUIRE(d.Hk > 0 && d.Hv > 0 && d.Hv % d.Hk == 0, w + ": Hv must be a positive multiple of Hk");
  DS_CUDA_REQUIRE(dim_ok(d.dk) && dim_ok(d.dv), w + ": dk and dv must be 16, 32, 64 or 128 (got " +
                                                    std::to_string(d.dk) + ", " + std::to_string(d.dv) + ")");
  DS_CUDA_REQUIRE(d.chunk_size >= 1 && d.chunk_size <= kMaxChunk,
                  w + ": chunk_size must be in [1, 64] (got " + std::to_string(d.chunk_size) + ")");
  DS_CUDA_REQUIRE(std::isfinite(d.scale), w + ": scale must be finite");
  DS_CUDA_REQUIRE(d.N <= INT32_MAX, w + ": N too large");
}

template <int DK, int DV>
void launch_fwd(const GdnDims& d, const FwdArgs& a, cudaStream_t stream) {
  using Cf = FwdCfg<DK, DV>;
  const int64_t blocks = d.num_seqs * d.Hv * Cf::NTILE;
  DS_CUDA_REQUIRE(blocks <= INT32_MAX, "gated_delta_rule_forward: too many (sequence, head) blocks");
  gdn_fwd_kernel<DK, DV><<<static_cast<unsigned>(blocks), Cf::NT, 0, stream>>>(a);
  DS_CUDA_LAUNCH_CHECK();
}

template <int DK, int DV>
void launch_bwd(const GdnDims& d, const BwdArgs& a, cudaStream_t stream) {
  using Cf = BwdCfg<DK, DV>;
  const int64_t blocks = d.num_seqs * d.Hv * Cf::G;
  DS_CUDA_REQUIRE(blocks <= INT32_MAX, "gated_delta_rule_backward: too many (sequence, head) blocks");
  DS_CUDA_CHECK(cudaFuncSetAttribute(gdn_bwd_kernel<DK, DV>, cudaFuncAttributeMaxDynamicSharedMemorySize, Cf::BYTES));
  gdn_bwd_kernel<DK, DV><<<static_cast<unsigned>(blocks), Cf::NT, Cf::BYTES, stream>>>(a);
  DS_CUDA_LAUNCH_CHECK();
}

// Calls F::template run<DK, DV>() for the runtime (dk, dv).
template <typename F, int DK>
void dispatch_dv(int64_t dv, F& f) {
  switch (dv) {
    case 16:
      return f.template run<DK, 16>();
    case 32:
      return f.template run<DK, 32>();
    case 64:
      return f.template run<DK, 64>();
    default:
      return f.template run<DK, 128>();
  }
}
template <typename F>
void dispatch(int64_t dk, int64_t dv, F& f) {
  switch (dk) {
    case 16:
      return dispatch_dv<F, 16>(dv, f);
    case 32:
      return dispatch_dv<F, 32>(dv, f);
    case 64:
      return dispatch_dv<F, 64>(dv, f);
    default:
      return dispatch_dv<F, 128>(dv, f);
  }
}

struct FwdLaunch {
  const GdnDims& d;
  const FwdArgs& a;
  cudaStream_t stream;
  template <int DK, int DV>
  void run() {
    launch_fwd<DK, DV>(d, a, stream);
  }
};
struct BwdLaunch {
  const GdnDims& d;
  const BwdArgs& a;
  cudaStream_t stream;
  template <int DK, int DV>
  void run() {
    launch_bwd<DK, DV>(d, a, stream);
  }
};

size_t round256(size_t x) { return (x + 255) / 256 * 256; }
// Column groups of the backward (BwdCfg::G): dv / 32 for dv ≥ 32, else 1.
int64_t col_groups(const GdnDims& d) { return d.dv > 32 ? d.dv / 32 : 1; }
// Scratch layout (each part 256-aligned): dk partials [G, N, Hv, dk]; dq partials [G, N, Hv, dk] when G > 1 or
// Hv > Hk; dg and dβ partials [G, N, Hv] when G > 1.
struct ScratchLayout {
  size_t dk = 0, dq = 0, dg = 0, db = 0, total = 0;
};
ScratchLayout scratch_layout(const GdnDims& d) {
  ScratchLayout l;
  const int64_t G = col_groups(d);
  const size_t part = static_cast<size_t>(G * d.N * d.Hv * d.dk) * sizeof(float);
  const size_t gb = static_cast<size_t>(G * d.N * d.Hv) * sizeof(float);
  size_t off = round256(part);
  if (G > 1 || d.Hv > d.Hk) l.dq = off, off += round256(part);
  if (G > 1) l.dg = off, off += round256(gb), l.db = off, off += round256(gb);
  l.total = off;
  return l;
}

}  // namespace

void gated_delta_rule_forward(const ds::ops::GdnDims& d, const bf16* q, const bf16* k, const bf16* v, int64_t v_stride,
                              const float* g, const float* beta, const int32_t* cu_seqlens,
                              const int32_t* chunk_offsets, int64_t total_chunks, bf16* o, float* states,
                              cudaStream_t stream) {
  check_dims(d, "gated_delta_rule_forward");
  DS_CUDA_REQUIRE(v_stride >= d.Hv * d.dv, "gated_delta_rule_forward: v_stride smaller than Hv * dv");
  DS_CUDA_REQUIRE(total_chunks >= 0, "gated_delta_rule_forward: total_chunks must be >= 0");
  if (d.N == 0 || d.num_seqs == 0) return;
  DS_CUDA_REQUIRE(q && k && v && g && beta && cu_seqlens && chunk_offsets && o && states,
                  "gated_delta_rule_forward: null pointer");
  FwdArgs a{};
  a.q = q, a.k = k, a.v = v, a.v_stride = v_stride, a.g = g, a.beta = beta;
  a.cu = cu_seqlens, a.chunk_off = chunk_offsets, a.o = o, a.states = states;
  a.Hk = static_cast<int>(d.Hk), a.Hv = static_cast<int>(d.Hv), a.C = static_cast<int>(d.chunk_size);
  a.scale = static_cast<float>(d.scale);
  a.vec_qk = aligned16(q) && aligned16(k);
  a.vec_v = aligned16(v) && v_stride % 8 == 0;
  FwdLaunch f{d, a, stream};
  dispatch(d.dk, d.dv, f);
}

size_t gated_delta_rule_scratch_bytes(const ds::ops::GdnDims& d, int64_t total_chunks) {
  (void)total_chunks;
  if (d.N <= 0 || d.Hk <= 0) return 0;
  return scratch_layout(d).total;
}

void gated_delta_rule_backward(const ds::ops::GdnDims& d, const bf16* q, const bf16* k, const bf16* v, int64_t v_stride,
                               const float* g, const float* beta, const int32_t* cu_seqlens,
                               const int32_t* chunk_offsets, int64_t total_chunks, const float* states,
                               const bf16* dout, bf16* dq, bf16* dk, bf16* dv, int64_t dv_stride, float* dg,
                               float* dbeta, void* scratch, cudaStream_t stream) {
  check_dims(d, "gated_delta_rule_backward");
  DS_CUDA_REQUIRE(v_stride >= d.Hv * d.dv, "gated_delta_rule_backward: v_stride smaller than Hv * dv");
  DS_CUDA_REQUIRE(dv_stride >= d.Hv * d.dv, "gated_delta_rule_backward: dv_stride smaller than Hv * dv");
  DS_CUDA_REQUIRE(total_chunks >= 0, "gated_delta_rule_backward: total_chunks must be >= 0");
  if (d.N == 0 || d.num_seqs == 0) return;
  DS_CUDA_REQUIRE(q && k && v && g && beta && cu_seqlens && chunk_offsets && states && dout && dq && dk && dv && dg &&
                      dbeta && scratch,
                  "gated_delta_rule_backward: null pointer");
  const int64_t G = col_groups(d);
  const ScratchLayout sl = scratch_layout(d);
  char* const sc = static_cast<char*>(scratch);
  BwdArgs a{};
  a.q = q, a.k = k, a.v = v, a.v_stride = v_stride, a.g = g, a.beta = beta;
  a.cu = cu_seqlens, a.chunk_off = chunk_offsets, a.states = states, a.dout = dout;
  a.dq = dq, a.dk = dk, a.dv = dv, a.dv_stride = dv_stride, a.dg = dg, a.dbeta = dbeta;
  a.direct_qk = G == 1 && d.Hv == d.Hk;
  a.direct_gb = G == 1;
  a.dk_part = reinterpret_cast<float*>(sc + sl.dk);
  a.dq_part = a.direct_qk ? nullptr : reinterpret_cast<float*>(sc + sl.dq);
  a.dg_part = a.direct_gb ? nullptr : reinterpret_cast<float*>(sc + sl.dg);
  a.db_part = a.direct_gb ? nullptr : reinterpret_cast<float*>(sc + sl.db);
  a.pstride = d.N * d.Hv * d.dk;
  a.gstride = d.N * d.Hv;
  a.Hk = static_cast<int>(d.Hk), a.Hv = static_cast<int>(d.Hv), a.C = static_cast<int>(d.chunk_size);
  a.scale = static_cast<float>(d.scale);
  a.vec_qk = aligned16(q) && aligned16(k);
  a.vec_v = aligned16(v) && v_stride % 8 == 0;
  a.vec_do = aligned16(dout);
  BwdLaunch f{d, a, stream};
  dispatch(d.dk, d.dv, f);
  if (!a.direct_qk || !a.direct_gb) {
    RedArgs ra{};
    ra.dq_part = a.dq_part, ra.dk_part = a.dk_part, ra.dg_part = a.dg_part, ra.db_part = a.db_part;
    ra.dq = dq, ra.dk = dk, ra.dg = dg, ra.dbeta = dbeta;
    ra.nqk = a.direct_qk ? 0 : d.N * d.Hk * d.dk;
    ra.ngb = a.direct_gb ? 0 : d.N * d.Hv;
    ra.pstride = a.pstride;
    ra.r = static_cast<int>(d.Hv / d.Hk), ra.G = static_cast<int>(G), ra.width = static_cast<int>(d.dk);
    const int64_t total = 2 * ra.nqk + 2 * ra.ngb;
    const int threads = 256;
    const int64_t blocks = std::min<int64_t>((total + threads - 1) / threads, 65536);
    gdn_reduce_kernel<<<static_cast<unsigned>(blocks), threads, 0, stream>>>(ra);
    DS_CUDA_LAUNCH_CHECK();
  }
}

}  // namespace ds::ops::cuda
