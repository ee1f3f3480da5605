// CUDA causal depthwise conv1d + SiLU over packed sequences (see cuda.h; math of conv1d.h / cpu.cpp):
//   p[t, c] = sum_{j<K} w[c, j] * x[t-(K-1)+j, c]  (taps with source < seq_start[t] are zero; j ascending)
//   y = silu(p);  dp = dy * s (1 + p (1 - s)),  s = sigmoid(p)
//   dx[s, c] = sum_j dp[s+(K-1)-j, c] w[c, j]   over t = s+(K-1)-j < N with seq_start[t] <= s (same document)
//   dw[c, j] += sum_t dp[t, c] x[t-(K-1)+j, c]
// K is a template parameter (1..4; Qwen3.5 uses 4). Each thread owns V adjacent channels. Every form below runs
// the same arithmetic per output, in the same order, so all give bitwise the same y, dx, dw and amax
// (conv1d_set_forms picks the form; tests/test_cuda_ops.cpp checks each against the CPU reference and the others).
// Forward, rows form (default, V = 8: C % 8 == 0 and x/y 16-byte aligned): a thread owns R = 8 consecutive tokens
// and loads its R + K-1 rows before any arithmetic; grid x over token groups, y over channel blocks.
// Forward, tile form (V = 1 elsewhere; or chosen): grid x over channels (128 threads x V), grid y over tiles of
// TT = 32 tokens; a thread loads its taps once per tile, then walks the tile in groups of 8 tokens, carrying the
// K-1 rows before each group in registers (packed bf16).
// Backward: grid x over channels, grid y over fixed token slots (a function of N only). A thread walks its
// slot in steps of TT = 4 "lead" tokens u, keeping the last K-1 tokens' x and dp in registers: dp[u] is
// recomputed from x, dx[u-(K-1)] is completed from dp[u-(K-1)..u], and dw accumulates in fp32 registers
// (tokens in ascending order). The K-1 tokens after the slot are recomputed (halo), so slots are independent.
// The partial dw of each slot goes to scratch [slot, C*K]; a second kernel sums slots in a fixed order and
// ADDS into dw. V = 4 (8-byte accesses, to keep the dp window in registers) when C % 4 == 0 and pointers are
// 8-byte aligned, else V = 1. Staged form (default where C % 8 == 0 and x/dy are 16-byte aligned): the block's
// threads copy the slot's rows of x and dy for its 512 channels into shared memory, 16 tokens at a time by
// cp.async, the next stage in flight while the steps run over the current one. Per-thread form (elsewhere): each
// thread loads its own rows, one step ahead. Deterministic, no atomics.
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <initializer_list>
#include <string>

#include "core/cuda/kernel_utils.cuh"
#include "ops/conv1d/cuda.h"

namespace ds::ops::cuda {
namespace {

using namespace ds::cuda;

constexpr int kThreads = 128;
constexpr int kFwdTile = 32;  // tokens per forward tile (the taps are loaded once per tile)
constexpr int kFwdGroup = 8;  // rows loaded together inside a tile
constexpr int kBwdTile = 4;  // lead tokens per backward step
constexpr int kFwdRows = 8;    // the forward's default form: rows per thread (conv_fwd_rows_kernel)
constexpr int kBwdStage = 16;  // the backward's default form: staged rows (conv_bwd_staged_kernel)
constexpr int64_t kMaxSlots = 128;
constexpr int64_t kMinTokensPerSlot = 16;

Slots slots_for(int64_t n) { return make_slots(n, kMaxSlots, kMinTokensPerSlot); }

// Packed storage of V bf16 values: V = 8 -> uint4, 4 -> uint2, 1 -> unsigned short.
template <int V>
struct Raw;
template <>
struct Raw<8> {
  using T = uint4;
};
template <>
struct Raw<4> {
  using T = uint2;
};
template <>
struct Raw<1> {
  using T = unsigned short;
};

template <int V>
__device__ __forceinline__ typename Raw<V>::T raw_zero() {
  if constexpr (V == 8)
    return make_uint4(0, 0, 0, 0);
  else if constexpr (V == 4)
    return make_uint2(0, 0);
  else
    return 0;
}
template <int V>
__device__ __forceinline__ typename Raw<V>::T raw_load(const bf16* p) {
  return *reinterpret_cast<const typename Raw<V>::T*>(p);
}
template <int V>
__device__ __forceinline__ float raw_get(const typename Raw<V>::T& r, int k) {  // k: compile-time after unroll
  if constexpr (V == 1) {
    return __uint_as_float(static_cast<uint32_t>(r) << 16);
  } else {
    uint32_t w;
    if constexpr (V == 8)
      w = k < 2 ? r.x : k < 4 ? r.y : k < 6 ? r.z : r.w;
    else
      w = k < 2 ? r.x : r.y;
    return (k & 1) ? __uint_as_float(w & 0xffff0000u) : __uint_as_float(w << 16);
  }
}

// The K taps of V adjacent channels (w: [C, K] fp32) into wr[j][v]: 16-byte loads when w is 16-byte aligned and
// V * K % 4 == 0 (c0 is a multiple of V), else one float at a time.
template <int V, int K>
__device__ __forceinline__ void load_taps(const float* __restrict__ w, bool w16, int64_t c0, float (&wr)[K][V]) {
  if ((V * K) % 4 == 0 && w16) {
    const float4* w4 = reinterpret_cast<const float4*>(w + c0 * K);
#pragma unroll
    for (int q = 0; q < V * K / 4; ++q) {
      const float4 f = __ldg(w4 + q);
      const float e[4] = {f.x, f.y, f.z, f.w};
#pragma unroll
      for (int u = 0; u < 4; ++u) wr[(4 * q + u) % K][(4 * q + u) / K] = e[u];
    }
  } else {
#pragma unroll
    for (int v = 0; v < V; ++v)
#pragma unroll
      for (int j = 0; j < K; ++j) wr[j][v] = __ldg(w + (c0 + v) * K + j);
  }
}

// One forward output: y[t, c0 .. c0+V) = silu(p), p = sum_j w[j] x[t-(K-1)+j] for j ascending over the taps
// inside t's document (st: its first token), x[t-(K-1)+j] from the window entry xw[i + j]. Both forward forms run
// exactly this.
template <int V, int K, int NW>
__device__ __forceinline__ void fwd_out(int64_t t, int32_t st, const float (&wr)[K][V],
                                        const typename Raw<V>::T (&xw)[NW], int i, bf16* __restrict__ yrow) {
  constexpr int W = K - 1;
  float p[V];
#pragma unroll
  for (int v = 0; v < V; ++v) p[v] = 0.f;
#pragma unroll
  for (int j = 0; j < K; ++j) {
    if (t - W + j >= st) {
#pragma unroll
      for (int v = 0; v < V; ++v) p[v] += wr[j][v] * raw_get<V>(xw[i + j], v);
    }
  }
#pragma unroll
  for (int v = 0; v < V; ++v) p[v] = p[v] * sigmoid_fast(p[v]);
  store_bf<V>(yrow, p);
}

// A thread owns V channels of a tile of TT tokens: the taps once (vector loads), then TT / G groups of G tokens,
// each loading its G rows while the K-1 rows before them are carried in registers (a tile reads TT + K-1 rows).
// Per output the same arithmetic as ever: p += w[j] x[t-(K-1)+j] for j ascending over the document's taps, then
// p * sigmoid(p).
template <int V, int K>
__global__ void __launch_bounds__(kThreads)
    conv_fwd_kernel(const bf16* __restrict__ x, const float* __restrict__ w, const int32_t* __restrict__ seq_start,
                    bf16* __restrict__ y, int64_t N, int64_t C) {
  constexpr int TT = kFwdTile, G = kFwdGroup, W = K - 1;
  const int64_t c0 = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) * V;
  if (c0 >= C) return;
  float wr[K][V];
  load_taps<V, K>(w, (reinterpret_cast<uintptr_t>(w) & 15u) == 0, c0, wr);
  const int64_t ntiles = (N + TT - 1) / TT;
  for (int64_t tile = blockIdx.y; tile < ntiles; tile += gridDim.y) {
    const int64_t t0 = tile * TT;
    typename Raw<V>::T xw[W + G];  // tokens u0-W .. u0+G-1
#pragma unroll
    for (int i = 0; i < W; ++i) {
      const int64_t t = t0 - W + i;
      xw[i] = (t >= 0 && t < N) ? raw_load<V>(x + t * C + c0) : raw_zero<V>();
    }
#pragma unroll 1
    for (int64_t u0 = t0; u0 < t0 + TT && u0 < N; u0 += G) {
      int32_t st[G];
#pragma unroll
      for (int i = 0; i < G; ++i) {
        const int64_t t = u0 + i;
        xw[W + i] = t < N ? raw_load<V>(x + t * C + c0) : raw_zero<V>();
        st[i] = t < N ? __ldg(seq_start + t) : 0;
      }
#pragma unroll
      for (int i = 0; i < G; ++i) {
        const int64_t t = u0 + i;
        if (t < N) fwd_out<V, K>(t, st[i], wr, xw, i, y + t * C + c0);
      }
#pragma unroll
      for (int i = 0; i < W; ++i) xw[i] = xw[G + i];
    }
  }
}

// Forward, the rows form (the default): a thread owns R consecutive tokens of V = 8 channels and loads all R + K-1
// rows it reads before any arithmetic, so each thread has (R + K-1) 16-byte loads in flight and no thread waits
// on a load between two of its outputs; the K-1 halo rows a neighbouring group also reads come from L1 / L2. Grid x
// over token groups, y over channel blocks: the blocks an SM runs one after another share their taps (L1). Per
// output the arithmetic of conv_fwd_kernel: p += w[j] x[t-(K-1)+j] for j ascending over the document's taps, then
// p * sigmoid(p): bitwise the same y.
template <int V, int K, int R>
__global__ void __launch_bounds__(kThreads)
    conv_fwd_rows_kernel(const bf16* __restrict__ x, const float* __restrict__ w, const int32_t* __restrict__ seq_start,
                         bf16* __restrict__ y, int64_t N, int64_t C) {
  constexpr int W = K - 1;
  const int64_t c0 = (static_cast<int64_t>(blockIdx.y) * kThreads + threadIdx.x) * V;
  if (c0 >= C) return;
  const int64_t t0 = static_cast<int64_t>(blockIdx.x) * R;
  typename Raw<V>::T xw[W + R];
#pragma unroll
  for (int i = 0; i < W + R; ++i) {
    const int64_t t = t0 - W + i;
    xw[i] = (t >= 0 && t < N) ? raw_load<V>(x + t * C + c0) : raw_zero<V>();
  }
  int32_t st[R];
#pragma unroll
  for (int i = 0; i < R; ++i) st[i] = t0 + i < N ? __ldg(seq_start + t0 + i) : 0;
  float wr[K][V];
  load_taps<V, K>(w, (reinterpret_cast<uintptr_t>(w) & 15u) == 0, c0, wr);
#pragma unroll
  for (int i = 0; i < R; ++i) {
    const int64_t t = t0 + i;
    if (t < N) fwd_out<V, K>(t, st[i], wr, xw, i, y + t * C + c0);
  }
}

// One backward step of a thread (V channels c0..): the TT lead tokens u0.. whose rows are in xw[W..], dyt, stw[W..]
// (entries [0, W) carried from the step before): dp for each lead token, dw (fp32 registers, tokens ascending) for
// those inside the slot [s0, s1), dx of s = u - (K-1) for s in the slot (its taps t = s + K-1 - j = u - j are all
// in the window now), then the last K-1 tokens carried. Both backward kernels run exactly this, so their dx, dw
// and amax are bitwise the same.
template <int V, int K, int TT>
__device__ __forceinline__ void bwd_step(int64_t u0, int64_t s0, int64_t s1, int64_t C, int64_t c0,
                                         const float (&wr)[K][V], float (&dwa)[K][V],
                                         typename Raw<V>::T (&xw)[K - 1 + TT], const typename Raw<V>::T (&dyt)[TT],
                                         float (&dpw)[K - 1 + TT][V], int32_t (&stw)[K - 1 + TT],
                                         bf16* __restrict__ dx, bool amax, unsigned& m) {
  constexpr int W = K - 1;
#pragma unroll
  for (int i = 0; i < TT; ++i) {
    const int64_t u = u0 + i;
    const int32_t st = stw[W + i];
    float p[V];
#pragma unroll
    for (int v = 0; v < V; ++v) p[v] = 0.f;
#pragma unroll
    for (int j = 0; j < K; ++j)
      if (u - W + j >= st) {
#pragma unroll
        for (int v = 0; v < V; ++v) p[v] += wr[j][v] * raw_get<V>(xw[i + j], v);
      }
#pragma unroll
    for (int v = 0; v < V; ++v) {
      const float sg = sigmoid_fast(p[v]);
      dpw[W + i][v] = raw_get<V>(dyt[i], v) * sg * (1.0f + p[v] * (1.0f - sg));
    }
    if (u < s1) {
#pragma unroll
      for (int j = 0; j < K; ++j)
        if (u - W + j >= st) {
#pragma unroll
          for (int v = 0; v < V; ++v) dwa[j][v] += dpw[W + i][v] * raw_get<V>(xw[i + j], v);
        }
    }
  }
#pragma unroll
  for (int i = 0; i < TT; ++i) {
    const int64_t s = u0 + i - W;
    if (s >= s0 && s < s1) {
      float o[V];
#pragma unroll
      for (int v = 0; v < V; ++v) o[v] = 0.f;
#pragma unroll
      for (int j = 0; j < K; ++j)
        if (stw[W + i - j] <= s) {  // t = s + W - j is inside s's document (and < N)
#pragma unroll
          for (int v = 0; v < V; ++v) o[v] += dpw[W + i - j][v] * wr[j][v];
        }
      store_bf<V>(dx + s * C + c0, o);
      if (amax) m = max(m, amax_bits_of<V>(o));
    }
  }
#pragma unroll
  for (int i = 0; i < W; ++i) {
    xw[i] = xw[TT + i];
    stw[i] = stw[TT + i];
#pragma unroll
    for (int v = 0; v < V; ++v) dpw[i][v] = dpw[TT + i][v];
  }
}

// A thread's state before its slot's first step: the K-1 tokens before s0 (their x and document starts; dp 0:
// dp before s0 only feeds dx rows of other slots), the taps, dw zero.
template <int V, int K, int TT>
__device__ __forceinline__ void bwd_begin(const bf16* __restrict__ x, const float* __restrict__ w,
                                          const int32_t* __restrict__ seq_start, int64_t s0, int64_t C, int64_t c0,
                                          float (&wr)[K][V], float (&dwa)[K][V], typename Raw<V>::T (&xw)[K - 1 + TT],
                                          float (&dpw)[K - 1 + TT][V], int32_t (&stw)[K - 1 + TT]) {
  constexpr int W = K - 1;
  load_taps<V, K>(w, (reinterpret_cast<uintptr_t>(w) & 15u) == 0, c0, wr);
#pragma unroll
  for (int v = 0; v < V; ++v)
#pragma unroll
    for (int j = 0; j < K; ++j) dwa[j][v] = 0.f;
#pragma unroll
  for (int i = 0; i < W; ++i) {
    const int64_t t = s0 - W + i;
    xw[i] = t >= 0 ? raw_load<V>(x + t * C + c0) : raw_zero<V>();
    stw[i] = t >= 0 ? __ldg(seq_start + t) : 0;
#pragma unroll
    for (int v = 0; v < V; ++v) dpw[i][v] = 0.f;
  }
}

template <int V, int K>
__device__ __forceinline__ void bwd_end(const float (&dwa)[K][V], float* __restrict__ partial, int64_t C, int64_t c0) {
  float* prow = partial + static_cast<int64_t>(blockIdx.y) * C * K + c0 * K;
#pragma unroll
  for (int v = 0; v < V; ++v)
#pragma unroll
    for (int j = 0; j < K; ++j) prow[v * K + j] = dwa[j][v];
}

// The backward of any shape (V = 4 or 1): each thread loads its own rows, one step ahead.
template <int V, int K>
__global__ void __launch_bounds__(kThreads)
    conv_bwd_kernel(const bf16* __restrict__ x, const float* __restrict__ w, const bf16* __restrict__ dy,
                    const int32_t* __restrict__ seq_start, bf16* __restrict__ dx, float* __restrict__ partial,
                    int64_t N, int64_t C, int64_t per, float* __restrict__ amax) {
  constexpr int TT = kBwdTile;
  constexpr int W = K - 1;  // carried tokens
  const int64_t c0 = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) * V;
  if (c0 >= C) return;
  const int64_t s0 = static_cast<int64_t>(blockIdx.y) * per;
  const int64_t s1 = s0 + per < N ? s0 + per : N;
  const int64_t uend = s1 + W < N ? s1 + W : N;  // lead tokens needed: [s0, s1 + K - 1) within N
  // Window over tokens u0-W .. u0+TT-1: entries [0, W) are carried from the previous step. Document starts are
  // int32 (N < 2^31); INT_MAX marks tokens at or past uend (in no document).
  float wr[K][V], dwa[K][V];
  typename Raw<V>::T xw[W + TT];
  float dpw[W + TT][V];
  int32_t stw[W + TT];
  bwd_begin<V, K, TT>(x, w, seq_start, s0, C, c0, wr, dwa, xw, dpw, stw);
  unsigned m = 0;  // max |dx| bits (in_proj_qkv's output gradient: its FP8 amax, fused)
  typename Raw<V>::T nx[TT], ndy[TT];
  int32_t nst[TT];
  auto fetch = [&](int64_t u0) {
#pragma unroll
    for (int i = 0; i < TT; ++i) {
      const int64_t u = u0 + i;
      const bool in = u < uend;
      nx[i] = in ? raw_load<V>(x + u * C + c0) : raw_zero<V>();
      ndy[i] = in ? raw_load<V>(dy + u * C + c0) : raw_zero<V>();
      nst[i] = in ? __ldg(seq_start + u) : INT_MAX;
    }
  };
  fetch(s0);
#pragma unroll 1
  for (int64_t u0 = s0; u0 < s1 + W; u0 += TT) {
    typename Raw<V>::T dyt[TT];
#pragma unroll
    for (int i = 0; i < TT; ++i) {
      xw[W + i] = nx[i];
      dyt[i] = ndy[i];
      stw[W + i] = nst[i];
    }
    if (u0 + TT < s1 + W) fetch(u0 + TT);
    bwd_step<V, K, TT>(u0, s0, s1, C, c0, wr, dwa, xw, dyt, dpw, stw, dx, amax != nullptr, m);
  }
  amax_commit(m, amax);
  bwd_end<V, K>(dwa, partial, C, c0);
}

// The backward where C % 8 == 0 and x, dy are 16-byte aligned (the default there): the block stages its slot's rows
// of its 512 channels in shared memory, ST tokens of x and dy at a time, by 16-byte cp.async from all its threads,
// the next stage in flight while the threads run bwd_step over the current one (two buffers, 8 ST KiB). The
// thread -> channels and slot mapping, the steps and their arithmetic are conv_bwd_kernel<4, K>'s: bitwise the same
// dx, dw and amax. Rows at or past min(s1 + K-1, N) are zero-filled and marked INT_MAX, as there.
template <int K, int ST>
__global__ void __launch_bounds__(kThreads)
    conv_bwd_staged_kernel(const bf16* __restrict__ x, const float* __restrict__ w, const bf16* __restrict__ dy,
                           const int32_t* __restrict__ seq_start, bf16* __restrict__ dx, float* __restrict__ partial,
                           int64_t N, int64_t C, int64_t per, float* __restrict__ amax) {
  constexpr int V = 4, TT = kBwdTile, W = K - 1, CH = kThreads * V, CPR = CH / 8;  // CPR: 16-byte chunks per row
  static_assert(ST % TT == 0, "a stage holds whole steps");
  extern __shared__ __align__(16) unsigned char conv_smem[];
  bf16* const buf = reinterpret_cast<bf16*>(conv_smem);  // [2 buffers][x, dy][ST][CH]
  const int64_t cb = static_cast<int64_t>(blockIdx.x) * CH;
  const int64_t c0 = cb + threadIdx.x * V;
  const bool active = c0 < C;
  const int64_t s0 = static_cast<int64_t>(blockIdx.y) * per;
  const int64_t s1 = s0 + per < N ? s0 + per : N;
  const int64_t uend = s1 + W < N ? s1 + W : N;
  const int64_t lead_end = s1 + W;  // the steps run over lead tokens [s0, s1 + K - 1)
  const int nstages = static_cast<int>((lead_end - s0 + ST - 1) / ST);
  auto issue = [&](int k) {  // stage k's rows into buffer k % 2 (an empty group past the last stage)
    if (k < nstages) {
      bf16* b = buf + (k & 1) * 2 * ST * CH;
      for (int q = threadIdx.x; q < 2 * ST * CPR; q += kThreads) {
        const int tensor = q / (ST * CPR), r = (q / CPR) % ST, ch = q % CPR;
        const int64_t u = s0 + static_cast<int64_t>(k) * ST + r, c = cb + ch * 8;
        const bool valid = u < uend && c < C;
        const bf16* src = tensor ? dy : x;
        cp16(b + (tensor * ST + r) * CH + ch * 8, valid ? src + u * C + c : src, valid);
      }
    }
    cp_commit();
  };
  issue(0);
  float wr[K][V], dwa[K][V];
  typename Raw<V>::T xw[W + TT];
  float dpw[W + TT][V];
  int32_t stw[W + TT];
  if (active) bwd_begin<V, K, TT>(x, w, seq_start, s0, C, c0, wr, dwa, xw, dpw, stw);
  unsigned m = 0;
  for (int k = 0; k < nstages; ++k) {
    issue(k + 1);
    cp_wait<1>();
    __syncthreads();
    const bf16* bx = buf + (k & 1) * 2 * ST * CH;
    const bf16* bd = bx + ST * CH;
#pragma unroll 1
    for (int g = 0; g < ST / TT; ++g) {
      const int64_t u0 = s0 + static_cast<int64_t>(k) * ST + g * TT;
      if (u0 >= lead_end || !active) break;
      typename Raw<V>::T dyt[TT];
#pragma unroll
      for (int i = 0; i < TT; ++i) {
        const int64_t u = u0 + i;
        xw[W + i] = *reinterpret_cast<const uint2*>(bx + (g * TT + i) * CH + threadIdx.x * V);
        dyt[i] = *reinterpret_cast<const uint2*>(bd + (g * TT + i) * CH + threadIdx.x * V);
        stw[W + i] = u < uend ? __ldg(seq_start + u) : INT_MAX;
      }
      bwd_step<V, K, TT>(u0, s0, s1, C, c0, wr, dwa, xw, dyt, dpw, stw, dx, amax != nullptr, m);
    }
    __syncthreads();  // buffer k % 2 is refilled by issue(k + 2)
  }
  amax_commit(m, amax);
  if (active) bwd_end<V, K>(dwa, partial, C, c0);
}

// Calls f.template operator()<K>() for the kernel width K (1..4; check_shape has checked it).
template <typename F>
void with_k(int64_t K, F&& f) {
  switch (K) {
    case 1: f.template operator()<1>(); break;
    case 2: f.template operator()<2>(); break;
    case 3: f.template operator()<3>(); break;
    default: f.template operator()<4>(); break;
  }
}

// The forms in use (conv1d_set_forms; at the first call DELTASTACK_CONV_FWD_ROWS / DELTASTACK_CONV_BWD_STAGE, for
// A/Bs in a whole step): the forward's rows per thread (4, 8 or 16; 0: the tile form), the backward's staged rows
// (8 or 16; 0: the per-thread form). The outputs are bitwise the same in every form.
int env_form(const char* name, int dflt, std::initializer_list<int> allowed) {
  const char* v = std::getenv(name);
  if (!v || !*v) return dflt;
  for (int a : allowed)
    if (std::to_string(a) == v) return a;
  DS_CUDA_REQUIRE(false, std::string(name) + "=" + v + ": not one of the conv1d kernels' forms (ops/conv1d/cuda.h)");
  return dflt;
}
struct Forms {
  int fwd_rows = -1, bwd_stage = -1;  // -1: not read yet
};
Forms g_forms;
const Forms& forms() {
  if (g_forms.fwd_rows < 0) {
    g_forms.fwd_rows = env_form("DELTASTACK_CONV_FWD_ROWS", kFwdRows, {0, 4, 8, 16});
    g_forms.bwd_stage = env_form("DELTASTACK_CONV_BWD_STAGE", kBwdStage, {0, 8, 16});
  }
  return g_forms;
}

template <int V>
void launch_fwd(const bf16* x, const float* w, const int32_t* ss, bf16* y, int64_t N, int64_t C, int64_t K,
                cudaStream_t stream) {
  if constexpr (V == 8) {  // the rows form has 16-byte rows only
    const int R = forms().fwd_rows;
    if (R > 0) {
      const dim3 grid(static_cast<unsigned>((N + R - 1) / R),
                      static_cast<unsigned>((C / V + kThreads - 1) / kThreads));
      with_k(K, [&]<int KK>() {
        if (R == 4) conv_fwd_rows_kernel<V, KK, 4><<<grid, kThreads, 0, stream>>>(x, w, ss, y, N, C);
        else if (R == 16) conv_fwd_rows_kernel<V, KK, 16><<<grid, kThreads, 0, stream>>>(x, w, ss, y, N, C);
        else conv_fwd_rows_kernel<V, KK, 8><<<grid, kThreads, 0, stream>>>(x, w, ss, y, N, C);
      });
      return;
    }
  }
  const int64_t tiles = (N + kFwdTile - 1) / kFwdTile;
  const dim3 grid = grid_cols_rows(C, V, kThreads, tiles);
  with_k(K, [&]<int KK>() { conv_fwd_kernel<V, KK><<<grid, kThreads, 0, stream>>>(x, w, ss, y, N, C); });
}

template <int K, int ST>
void launch_bwd_staged(const bf16* x, const float* w, const bf16* dy, const int32_t* ss, bf16* dx, float* partial,
                       int64_t N, int64_t C, const Slots& s, float* amax, cudaStream_t stream) {
  constexpr int smem = 2 * 2 * ST * kThreads * 4 * static_cast<int>(sizeof(bf16));
  static const bool attr = [] {  // above 48 KiB of dynamic shared memory needs the opt-in
    DS_CUDA_CHECK(cudaFuncSetAttribute(conv_bwd_staged_kernel<K, ST>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    return true;
  }();
  (void)attr;
  const dim3 grid(static_cast<unsigned>((C / 4 + kThreads - 1) / kThreads), static_cast<unsigned>(s.count));
  conv_bwd_staged_kernel<K, ST><<<grid, kThreads, smem, stream>>>(x, w, dy, ss, dx, partial, N, C, s.per, amax);
}

template <int V>
void launch_bwd(const bf16* x, const float* w, const bf16* dy, const int32_t* ss, bf16* dx, float* partial, int64_t N,
                int64_t C, int64_t K, const Slots& s, float* amax, bool staged, cudaStream_t stream) {
  if constexpr (V == 4) {
    if (staged && forms().bwd_stage > 0) {
      with_k(K, [&]<int KK>() {
        if (forms().bwd_stage == 8) launch_bwd_staged<KK, 8>(x, w, dy, ss, dx, partial, N, C, s, amax, stream);
        else launch_bwd_staged<KK, 16>(x, w, dy, ss, dx, partial, N, C, s, amax, stream);
      });
      return;
    }
  }
  (void)staged;
  const dim3 grid(static_cast<unsigned>((C / V + kThreads - 1) / kThreads), static_cast<unsigned>(s.count));
  with_k(K, [&]<int KK>() {
    conv_bwd_kernel<V, KK><<<grid, kThreads, 0, stream>>>(x, w, dy, ss, dx, partial, N, C, s.per, amax);
  });
}

void check_shape(const char* fn, int64_t N, int64_t C, int64_t K) {
  DS_CUDA_REQUIRE(N >= 0 && C > 0 && K >= 1 && K <= 4,
                  std::string(fn) + ": need N >= 0, C > 0 and 1 <= K <= 4 (kernels are built for K up to 4), got N=" +
                      std::to_string(N) + " C=" + std::to_string(C) + " K=" + std::to_string(K));
}

}  // namespace

void conv1d_set_forms(int fwd_rows, int bwd_stage) {
  DS_CUDA_REQUIRE(fwd_rows == 0 || fwd_rows == 4 || fwd_rows == 8 || fwd_rows == 16,
                  "conv1d_set_forms: the forward's rows per thread must be 0, 4, 8 or 16");
  DS_CUDA_REQUIRE(bwd_stage == 0 || bwd_stage == 8 || bwd_stage == 16,
                  "conv1d_set_forms: the backward's staged rows must be 0, 8 or 16");
  g_forms.fwd_rows = fwd_rows;
  g_forms.bwd_stage = bwd_stage;
}

std::pair<int, int> conv1d_forms() { return {forms().fwd_rows, forms().bwd_stage}; }

void conv1d_silu_forward(const ds::cuda::bf16* x, const float* w, const int32_t* seq_start, ds::cuda::bf16* y,
                         int64_t N, int64_t C, int64_t K, cudaStream_t stream) {
  check_shape("conv1d_silu_forward", N, C, K);
  if (N == 0) return;
  DS_CUDA_REQUIRE(x && w && seq_start && y, "conv1d_silu_forward: null pointer argument");
  if (C % 8 == 0 && aligned(x, 16) && aligned(y, 16))
    launch_fwd<8>(x, w, seq_start, y, N, C, K, stream);
  else
    launch_fwd<1>(x, w, seq_start, y, N, C, K, stream);
  DS_CUDA_LAUNCH_CHECK();
}

size_t conv1d_scratch_bytes(int64_t N, int64_t C, int64_t K) {
  if (N <= 0 || C <= 0 || K <= 0) return 0;
  return static_cast<size_t>(slots_for(N).count) * static_cast<size_t>(C * K) * sizeof(float);
}

void conv1d_silu_backward(const ds::cuda::bf16* x, const float* w, const ds::cuda::bf16* dy, const int32_t* seq_start,
                          ds::cuda::bf16* dx, float* dw, int64_t N, int64_t C, int64_t K, void* scratch,
                          cudaStream_t stream, float* amax) {
  check_shape("conv1d_silu_backward", N, C, K);
  if (N == 0) return;
  DS_CUDA_REQUIRE(x && w && dy && seq_start && dx && dw, "conv1d_silu_backward: null pointer argument");
  DS_CUDA_REQUIRE(scratch != nullptr, "conv1d_silu_backward: scratch is null (need conv1d_scratch_bytes)");
  const Slots s = slots_for(N);
  float* partial = static_cast<float*>(scratch);
  if (C % 4 == 0 && aligned(x, 8) && aligned(dy, 8) && aligned(dx, 8))
    launch_bwd<4>(x, w, dy, seq_start, dx, partial, N, C, K, s, amax,
                  /*staged=*/C % 8 == 0 && aligned(x, 16) && aligned(dy, 16), stream);
  else
    launch_bwd<1>(x, w, dy, seq_start, dx, partial, N, C, K, s, amax, false, stream);
  DS_CUDA_LAUNCH_CHECK();
  launch_sum_partials(partial, s.count, C * K, C * K, dw, stream);
  DS_CUDA_LAUNCH_CHECK();
}

}  // namespace ds::ops::cuda
