// CPU reference for the causal depthwise conv1d + SiLU over packed sequences (Dao causal_conv1d_fn with
// seq_idx, activation "silu", no bias; docs/model.md §2.6, §3.6; backward §4):
//   p[t, c] = sum_{j=0..K-1} w[c, j] * x[t-(K-1)+j, c]   (taps before the segment start are zero; j ascending)
//   y = silu(p) = p / (1 + exp(-p))
//   dp = dy * sig(p) * (1 + p (1 - sig(p)))
//   dx[s, c] = sum_j dp[s+(K-1)-j, c] * w[c, j]          (only t = s+(K-1)-j inside s's segment)
//   dw[c, j] += sum_t dp[t, c] * x[t-(K-1)+j, c]          (t ascending, double accumulator)
// Every output element is produced by one loop iteration with a fixed inner order: results do not depend on
// the thread count.
#include <algorithm>
#include <cmath>
#include <vector>

#include "core/error.h"
#include "ops/conv1d/conv1d.h"

namespace ds::ops {
namespace {

// Validates cu_seqlens and returns the segment [start, end) of every token.
void conv_segments(const int32_t* cu, int64_t num_seqs, int64_t N, int64_t C, int64_t K,
                   std::vector<int64_t>& start, std::vector<int64_t>& end) {
  DS_CHECK(N >= 0 && C > 0 && K > 0, "conv1d: N ({}), C ({}), K ({}) must be >= 0, > 0, > 0", N, C, K);
  DS_CHECK(num_seqs >= 0 && (N == 0 || num_seqs > 0), "conv1d: {} tokens but num_seqs = {}", N, num_seqs);
  start.assign(static_cast<size_t>(N), 0);
  end.assign(static_cast<size_t>(N), 0);
  if (num_seqs == 0) return;
  DS_CHECK(cu[0] == 0, "conv1d: cu_seqlens[0] is {}, expected 0", cu[0]);
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t a = cu[s], b = cu[s + 1];
    DS_CHECK(b >= a && b <= N, "conv1d: cu_seqlens[{}] = {} out of order or beyond N = {}", s + 1, b, N);
    for (int64_t t = a; t < b; ++t) {
      start[t] = a;
      end[t] = b;
    }
  }
  DS_CHECK(cu[num_seqs] == N, "conv1d: cu_seqlens[{}] = {} but N = {}", num_seqs, cu[num_seqs], N);
}

// p row t into out[0..C) (pre-activation), taps j ascending; wT is w transposed to [K, C].
template <typename T>
inline void conv_row(const T* x, const T* wT, int64_t t, int64_t s0, int64_t C, int64_t K, T* out) {
  std::fill(out, out + C, T(0));
  for (int64_t j = 0; j < K; ++j) {
    const int64_t src = t - (K - 1) + j;
    if (src < s0) continue;  // a zero tap: skipping it equals adding 0
    const T* xs = x + src * C;
    const T* wj = wT + j * C;
#pragma omp simd
    for (int64_t c = 0; c < C; ++c) out[c] += wj[c] * xs[c];
  }
}

template <typename T>
std::vector<T> transpose_w(const T* w, int64_t C, int64_t K) {
  std::vector<T> wT(static_cast<size_t>(C * K));
  for (int64_t c = 0; c < C; ++c)
    for (int64_t j = 0; j < K; ++j) wT[j * C + c] = w[c * K + j];
  return wT;
}

}  // namespace

template <typename T>
void conv1d_silu_forward(const T* x, const T* w, const int32_t* cu_seqlens, int64_t num_seqs, int64_t N,
                         int64_t C, int64_t K, T* y) {
  std::vector<int64_t> start, end;
  conv_segments(cu_seqlens, num_seqs, N, C, K, start, end);
  const std::vector<T> wT = transpose_w(w, C, K);
#pragma omp parallel for schedule(static) if (N * C * K > 32768)
  for (int64_t t = 0; t < N; ++t) {
    T* yt = y + t * C;
    conv_row(x, wT.data(), t, start[t], C, K, yt);
    for (int64_t c = 0; c < C; ++c) yt[c] = yt[c] / (T(1) + std::exp(-yt[c]));
  }
}

template <typename T>
void conv1d_silu_backward(const T* x, const T* w, const T* dy, const int32_t* cu_seqlens, int64_t num_seqs,
                          int64_t N, int64_t C, int64_t K, T* dx, T* dw) {
  std::vector<int64_t> start, end;
  conv_segments(cu_seqlens, num_seqs, N, C, K, start, end);
  const std::vector<T> wT = transpose_w(w, C, K);

  // dp = dy * silu'(p), recomputing p.
  std::vector<T> dp(static_cast<size_t>(N * C));
#pragma omp parallel for schedule(static) if (N * C * K > 32768)
  for (int64_t t = 0; t < N; ++t) {
    T* r = dp.data() + t * C;
    conv_row(x, wT.data(), t, start[t], C, K, r);
    const T* dyt = dy + t * C;
    for (int64_t c = 0; c < C; ++c) {
      const T p = r[c];
      const T sg = T(1) / (T(1) + std::exp(-p));
      r[c] = dyt[c] * sg * (T(1) + p * (T(1) - sg));
    }
  }

  // dx[s] = sum_j dp[s + K-1-j] * w[:, j], j ascending, only outputs in s's segment.
#pragma omp parallel for schedule(static) if (N * C * K > 32768)
  for (int64_t s = 0; s < N; ++s) {
    T* out = dx + s * C;
    std::fill(out, out + C, T(0));
    for (int64_t j = 0; j < K; ++j) {
      const int64_t t = s + (K - 1) - j;
      if (t >= end[s]) continue;
      const T* g = dp.data() + t * C;
      const T* wj = wT.data() + j * C;
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) out[c] += g[c] * wj[c];
    }
  }

  // dw[c, j] += sum_t dp[t, c] x[t-(K-1)+j, c], per channel block, t ascending.
  constexpr int64_t kBlock = 64;
  const int64_t nblocks = (C + kBlock - 1) / kBlock;
#pragma omp parallel if (N * C * K > 32768)
  {
    std::vector<double> acc(static_cast<size_t>(K * kBlock));
#pragma omp for schedule(static)
    for (int64_t b = 0; b < nblocks; ++b) {
      const int64_t c0 = b * kBlock, cn = std::min(kBlock, C - c0);
      std::fill(acc.begin(), acc.end(), 0.0);
      for (int64_t t = 0; t < N; ++t) {
        const T* g = dp.data() + t * C + c0;
        for (int64_t j = 0; j < K; ++j) {
          const int64_t src = t - (K - 1) + j;
          if (src < start[t]) continue;
          const T* xs = x + src * C + c0;
          double* a = acc.data() + j * kBlock;
#pragma omp simd
          for (int64_t c = 0; c < cn; ++c) a[c] += static_cast<double>(g[c]) * static_cast<double>(xs[c]);
        }
      }
      for (int64_t c = 0; c < cn; ++c)
        for (int64_t j = 0; j < K; ++j) dw[(c0 + c) * K + j] += static_cast<T>(acc[j * kBlock + c]);
    }
  }
}

#define DS_INSTANTIATE(T)                                                                                    \
  template void conv1d_silu_forward<T>(const T*, const T*, const int32_t*, int64_t, int64_t, int64_t, int64_t, \
                                       T*);                                                                  \
  template void conv1d_silu_backward<T>(const T*, const T*, const T*, const int32_t*, int64_t, int64_t,       \
                                        int64_t, int64_t, T*, T*);
DS_INSTANTIATE(float)
DS_INSTANTIATE(double)
#undef DS_INSTANTIATE

}  // namespace ds::ops
