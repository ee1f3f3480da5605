// CUDA causal depthwise conv1d + SiLU over packed sequences (see cuda.h; math of conv1d.h / cpu.cpp):
//   p[t, c] = sum_{j<K} w[c, j] * x[t-(K-1)+j, c]  (taps with source < seq_start[t] are zero; j ascending)
//   y = silu(p);  dp = dy * s (1 + p (1 - s)),  s = sigmoid(p)
//   dx[s, c] = sum_j dp[s+(K-1)-j, c] w[c, j]   over t = s+(K-1)-j < N with seq_start[t] <= s (same document)
//   dw[c, j] += sum_t dp[t, c] x[t-(K-1)+j, c]
// K is a template parameter (1..4; Qwen3.5 uses 4). Each thread owns V adjacent channels.
// Forward: grid x over channels (128 threads x V), grid y over tiles of TT = 32 tokens; a thread loads its taps
// once per tile (vector loads: scalar ones, one 128-byte line per lane, made the L1 the bottleneck), then walks
// the tile in groups of 8 tokens, carrying the K-1 rows before each group in registers (packed bf16): each x row is
// read once, plus K-1 halo rows per tile. V = 8 (16-byte) when C % 8 == 0 and x/y are 16-byte aligned, else V = 1.
// Backward: grid x over channels, grid y over fixed token slots (a function of N only). A thread walks its
// slot in tiles of TT "lead" tokens u, keeping the last K-1 tokens' x and dp in registers: dp[u] is
// recomputed from x, dx[u-(K-1)] is completed from dp[u-(K-1)..u], and dw accumulates in fp32 registers
// (tokens in ascending order). The K-1 tokens after the slot are recomputed (halo), so slots are independent.
// The partial dw of each slot goes to scratch [slot, C*K]; a second kernel sums slots in a fixed order and
// ADDS into dw. V = 4 (8-byte accesses, to keep the dp window in registers) when C % 4 == 0 and pointers are
// 8-byte aligned, else V = 1. A step's rows are loaded while the step before computes. Deterministic, no atomics.
#include <climits>
#include <cstdint>

#include "core/cuda/kernel_utils.cuh"
#include "ops/conv1d/cuda.h"

namespace ds::ops::cuda {
namespace {

using namespace ds::cuda;

constexpr int kThreads = 128;
constexpr int kFwdTile = 32;  // tokens per forward tile (the taps are loaded once per tile)
constexpr int kFwdGroup = 8;  // rows loaded together inside a tile
constexpr int kBwdTile = 4;  // lead tokens per backward step
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

// p <- p * sigmoid(p): FS, by sigmoid_fast_v (core/cuda/kernel_utils.cuh: the division's fast path for the V values,
// one rarely taken branch); else by V calls of sigmoid_fast. Bitwise the same (CudaOps.Conv1dSigmoidFormsAreBitwiseEqual).
template <int V, bool FS>
__device__ __forceinline__ void silu_in_place(float (&p)[V]) {
  if constexpr (FS) {
    float s[V];
    sigmoid_fast_v<V>(p, s);
#pragma unroll
    for (int v = 0; v < V; ++v) p[v] = p[v] * s[v];
  } else {
#pragma unroll
    for (int v = 0; v < V; ++v) p[v] = p[v] * sigmoid_fast(p[v]);
  }
}

// A thread owns V channels of a tile of TT tokens: the taps once (vector loads), then TT / G groups of G tokens,
// each loading its G rows while the K-1 rows before them are carried in registers (a tile reads TT + K-1 rows).
// Per output the same arithmetic as ever: p += w[j] x[t-(K-1)+j] for j ascending over the document's taps, then
// p * sigmoid(p).
template <int V, int K, bool FS>
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
        if (t < N) {
          float p[V];
#pragma unroll
          for (int v = 0; v < V; ++v) p[v] = 0.f;
#pragma unroll
          for (int j = 0; j < K; ++j) {
            if (t - W + j >= st[i]) {
#pragma unroll
              for (int v = 0; v < V; ++v) p[v] += wr[j][v] * raw_get<V>(xw[i + j], v);
            }
          }
          silu_in_place<V, FS>(p);
          store_bf<V>(y + t * C + c0, p);
        }
      }
#pragma unroll
      for (int i = 0; i < W; ++i) xw[i] = xw[G + i];
    }
  }
}

template <int V, int K, bool FS>
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
  float wr[K][V], dwa[K][V];
  load_taps<V, K>(w, (reinterpret_cast<uintptr_t>(w) & 15u) == 0, c0, wr);
#pragma unroll
  for (int v = 0; v < V; ++v)
#pragma unroll
    for (int j = 0; j < K; ++j) dwa[j][v] = 0.f;
  // Window over tokens u0-W .. u0+TT-1: entries [0, W) are carried from the previous step. Document starts are
  // int32 (N < 2^31); INT_MAX marks tokens at or past uend (in no document).
  typename Raw<V>::T xw[W + TT];
  float dpw[W + TT][V];
  int32_t stw[W + TT];
#pragma unroll
  for (int i = 0; i < W; ++i) {
    const int64_t t = s0 - W + i;
    xw[i] = t >= 0 ? raw_load<V>(x + t * C + c0) : raw_zero<V>();
    stw[i] = t >= 0 ? __ldg(seq_start + t) : 0;
#pragma unroll
    for (int v = 0; v < V; ++v) dpw[i][v] = 0.f;  // dp before s0 only feeds dx rows of other slots
  }
  // The next step's rows are loaded before this step computes (one step of software pipelining).
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
    // dp for the lead tokens; dw for those inside the slot.
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
      if constexpr (FS) {
        float sgv[V];
        sigmoid_fast_v<V>(p, sgv);
#pragma unroll
        for (int v = 0; v < V; ++v) {
          const float sg = sgv[v];
          dpw[W + i][v] = raw_get<V>(dyt[i], v) * sg * (1.0f + p[v] * (1.0f - sg));
        }
      } else {
#pragma unroll
        for (int v = 0; v < V; ++v) {
          const float sg = sigmoid_fast(p[v]);
          dpw[W + i][v] = raw_get<V>(dyt[i], v) * sg * (1.0f + p[v] * (1.0f - sg));
        }
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
    // dx for s = u - W, whose taps t = s + W - j = u - j are all in the window now.
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
    // Carry the last W tokens.
#pragma unroll
    for (int i = 0; i < W; ++i) {
      xw[i] = xw[TT + i];
      stw[i] = stw[TT + i];
#pragma unroll
      for (int v = 0; v < V; ++v) dpw[i][v] = dpw[TT + i][v];
    }
  }
  amax_commit(m, amax);
  float* prow = partial + static_cast<int64_t>(blockIdx.y) * C * K + c0 * K;
#pragma unroll
  for (int v = 0; v < V; ++v)
#pragma unroll
    for (int j = 0; j < K; ++j) prow[v * K + j] = dwa[j][v];
}

template <int V, bool FS>
void launch_fwd_as(const bf16* x, const float* w, const int32_t* ss, bf16* y, int64_t N, int64_t C, int64_t K,
                cudaStream_t stream) {
  const int64_t tiles = (N + kFwdTile - 1) / kFwdTile;
  const dim3 grid = grid_cols_rows(C, V, kThreads, tiles);
  switch (K) {
    case 1:
      conv_fwd_kernel<V, 1, FS><<<grid, kThreads, 0, stream>>>(x, w, ss, y, N, C);
      break;
    case 2:
      conv_fwd_kernel<V, 2, FS><<<grid, kThreads, 0, stream>>>(x, w, ss, y, N, C);
      break;
    case 3:
      conv_fwd_kernel<V, 3, FS><<<grid, kThreads, 0, stream>>>(x, w, ss, y, N, C);
      break;
    default:
      conv_fwd_kernel<V, 4, FS><<<grid, kThreads, 0, stream>>>(x, w, ss, y, N, C);
      break;
  }
}

template <int V, bool FS>
void launch_bwd_as(const bf16* x, const float* w, const bf16* dy, const int32_t* ss, bf16* dx, float* partial, int64_t N,
                int64_t C, int64_t K, const Slots& s, float* amax, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>((C / V + kThreads - 1) / kThreads), static_cast<unsigned>(s.count));
  switch (K) {
    case 1:
      conv_bwd_kernel<V, 1, FS><<<grid, kThreads, 0, stream>>>(x, w, dy, ss, dx, partial, N, C, s.per, amax);
      break;
    case 2:
      conv_bwd_kernel<V, 2, FS><<<grid, kThreads, 0, stream>>>(x, w, dy, ss, dx, partial, N, C, s.per, amax);
      break;
    case 3:
      conv_bwd_kernel<V, 3, FS><<<grid, kThreads, 0, stream>>>(x, w, dy, ss, dx, partial, N, C, s.per, amax);
      break;
    default:
      conv_bwd_kernel<V, 4, FS><<<grid, kThreads, 0, stream>>>(x, w, dy, ss, dx, partial, N, C, s.per, amax);
      break;
  }
}

// The kernels in the sigmoids' form of ds::cuda::division_sigmoid() (bitwise the same outputs either way).
template <int V>
void launch_fwd(const bf16* x, const float* w, const int32_t* ss, bf16* y, int64_t N, int64_t C, int64_t K,
                cudaStream_t stream) {
  if (ds::cuda::division_sigmoid()) launch_fwd_as<V, false>(x, w, ss, y, N, C, K, stream);
  else launch_fwd_as<V, true>(x, w, ss, y, N, C, K, stream);
}
template <int V>
void launch_bwd(const bf16* x, const float* w, const bf16* dy, const int32_t* ss, bf16* dx, float* partial, int64_t N,
                int64_t C, int64_t K, const Slots& s, float* amax, cudaStream_t stream) {
  if (ds::cuda::division_sigmoid()) launch_bwd_as<V, false>(x, w, dy, ss, dx, partial, N, C, K, s, amax, stream);
  else launch_bwd_as<V, true>(x, w, dy, ss, dx, partial, N, C, K, s, amax, stream);
}

void check_shape(const char* fn, int64_t N, int64_t C, int64_t K) {
  DS_CUDA_REQUIRE(N >= 0 && C > 0 && K >= 1 && K <= 4,
                  std::string(fn) + ": need N >= 0, C > 0 and 1 <= K <= 4 (kernels are built for K up to 4), got N=" +
                      std::to_string(N) + " C=" + std::to_string(C) + " K=" + std::to_string(K));
}

}  // namespace

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
    launch_bwd<4>(x, w, dy, seq_start, dx, partial, N, C, K, s, amax, stream);
  else
    launch_bwd<1>(x, w, dy, seq_start, dx, partial, N, C, K, s, amax, stream);
  DS_CUDA_LAUNCH_CHECK();
  launch_sum_partials(partial, s.count, C * K, C * K, dw, stream);
  DS_CUDA_LAUNCH_CHECK();
}

}  // namespace ds::ops::cuda
