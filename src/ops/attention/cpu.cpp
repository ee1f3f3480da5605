// CPU reference for causal GQA softmax attention over packed sequences and the sigmoid output gate.
// Math (per q head h with kv head g = h / (Hq/Hkv), per token t of segment [s0, s1)):
//   s_tj = scale * q_t . k_j  (s0 <= j <= t),  lse_t = log sum_j exp(s_tj),  P_tj = exp(s_tj - lse_t)
//   o_t  = sum_j P_tj v_j
// Backward (standard softmax-attention gradients, recomputing P from lse):
//   D_t = dout_t . o_t,  dP_tj = dout_t . v_j,  dS_tj = P_tj (dP_tj - D_t)
//   dq_t = scale sum_j dS_tj k_j,  dk_j = scale sum_{h in group} sum_{t >= j} dS_tj q_t,
//   dv_j = sum_{h in group} sum_{t >= j} P_tj dout_t
// Threading: every output row is produced by exactly one loop iteration whose inner sums run in a fixed
// order, so results are bitwise independent of the thread count. dq is one pass over (t, h) rows; dk/dv is
// a second pass over (j, g) rows that recomputes P (2x the score work, no cross-thread reductions).
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "core/error.h"
#include "ops/attention/attention.h"

namespace ds::ops {
namespace {

template <typename T>
inline T dot(const T* a, const T* b, int64_t n) {
  T s = 0;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

template <typename T>
inline void axpy(T* y, T a, const T* x, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

// Validates the dimensions and cu_seqlens; fills the segment [start, end) of every token.
void segments(const AttnDims& d, const int32_t* cu, std::vector<int64_t>& start, std::vector<int64_t>& end,
              int64_t& max_len) {
  DS_CHECK(d.N >= 0 && d.num_seqs >= 0, "attention: N ({}) and num_seqs ({}) must be >= 0", d.N, d.num_seqs);
  DS_CHECK(d.Hq > 0 && d.Hkv > 0 && d.head_dim > 0, "attention: Hq ({}), Hkv ({}), head_dim ({}) must be > 0",
           d.Hq, d.Hkv, d.head_dim);
  DS_CHECK(d.Hq % d.Hkv == 0, "attention: Hq ({}) must be a multiple of Hkv ({})", d.Hq, d.Hkv);
  DS_CHECK(d.N == 0 || d.num_seqs > 0, "attention: {} tokens but no sequences", d.N);
  start.assign(static_cast<size_t>(d.N), 0);
  end.assign(static_cast<size_t>(d.N), 0);
  max_len = 0;
  if (d.num_seqs == 0) return;
  DS_CHECK(cu[0] == 0, "attention: cu_seqlens[0] is {}, expected 0", cu[0]);
  for (int64_t s = 0; s < d.num_seqs; ++s) {
    const int64_t a = cu[s], b = cu[s + 1];
    DS_CHECK(b >= a, "attention: cu_seqlens decreases at index {} ({} -> {})", s + 1, a, b);
    DS_CHECK(b <= d.N, "attention: cu_seqlens[{}] = {} exceeds N = {}", s + 1, b, d.N);
    for (int64_t t = a; t < b; ++t) {
      start[t] = a;
      end[t] = b;
    }
    if (b - a > max_len) max_len = b - a;
  }
  DS_CHECK(cu[d.num_seqs] == d.N, "attention: cu_seqlens[{}] = {} but N = {}", d.num_seqs, cu[d.num_seqs], d.N);
}

// Multiply-adds of one score pass (sum over segments of len (len + 1) / 2 pairs, times Hq * head_dim): small
// problems run on one thread (the partition never changes results, only the overhead).
bool worth_threads(const AttnDims& d, const int32_t* cu) {
  double pairs = 0;
  for (int64_t s = 0; s < d.num_seqs; ++s) {
    const double len = cu[s + 1] - cu[s];
    pairs += len * (len + 1) / 2;
  }
  return pairs * static_cast<double>(d.Hq * d.head_dim) > 65536.0;
}

}  // namespace

template <typename T>
void attention_forward(const AttnDims& d, const T* q, const T* k, const T* v, const int32_t* cu_seqlens, T* o,
                       T* lse) {
  std::vector<int64_t> start, end;
  int64_t max_len = 0;
  segments(d, cu_seqlens, start, end, max_len);
  const int64_t N = d.N, Hq = d.Hq, Hkv = d.Hkv, hd = d.head_dim, group = Hq / Hkv;
  const T scale = static_cast<T>(d.scale);
  const bool par = worth_threads(d, cu_seqlens);

#pragma omp parallel if (par)
  {
    std::vector<T> sc(static_cast<size_t>(max_len));
    std::vector<T> acc(static_cast<size_t>(hd));
    // Row (t, h); consecutive iterations share t, so the key/value rows stay in cache across heads.
#pragma omp for schedule(dynamic, 8)
    for (int64_t idx = 0; idx < N * Hq; ++idx) {
      const int64_t t = idx / Hq, h = idx % Hq, g = h / group, s0 = start[t], len = t - s0 + 1;
      const T* qt = q + idx * hd;
      T m = -std::numeric_limits<T>::infinity();
      for (int64_t j = 0; j < len; ++j) {
        const T s = scale * dot(qt, k + ((s0 + j) * Hkv + g) * hd, hd);
        sc[j] = s;
        m = s > m ? s : m;
      }
      double sum = 0;
      for (int64_t j = 0; j < len; ++j) {
        const T e = std::exp(sc[j] - m);
        sc[j] = e;
        sum += e;
      }
      const T inv = static_cast<T>(1.0 / sum);
      std::fill(acc.begin(), acc.end(), T(0));
      for (int64_t j = 0; j < len; ++j) axpy(acc.data(), sc[j] * inv, v + ((s0 + j) * Hkv + g) * hd, hd);
      std::copy(acc.begin(), acc.end(), o + idx * hd);
      lse[idx] = static_cast<T>(static_cast<double>(m) + std::log(sum));
    }
  }
}

template <typename T>
void attention_backward(const AttnDims& d, const T* q, const T* k, const T* v, const T* o, const T* lse,
                        const T* dout, const int32_t* cu_seqlens, T* dq, T* dk, T* dv) {
  std::vector<int64_t> start, end;
  int64_t max_len = 0;
  segments(d, cu_seqlens, start, end, max_len);
  const int64_t N = d.N, Hq = d.Hq, Hkv = d.Hkv, hd = d.head_dim, group = Hq / Hkv;
  const T scale = static_cast<T>(d.scale);
  const bool par = worth_threads(d, cu_seqlens);

  // D[t, h] = dout_t . o_t (the softmax-backward row term).
  std::vector<T> D(static_cast<size_t>(N * Hq));
#pragma omp parallel for schedule(static) if (par)
  for (int64_t idx = 0; idx < N * Hq; ++idx) D[idx] = dot(dout + idx * hd, o + idx * hd, hd);

  // Pass 1: dq, one (t, h) row per iteration, keys j = s0 .. t (ascending).
#pragma omp parallel if (par)
  {
    std::vector<T> acc(static_cast<size_t>(hd));
#pragma omp for schedule(dynamic, 8)
    for (int64_t idx = 0; idx < N * Hq; ++idx) {
      const int64_t t = idx / Hq, h = idx % Hq, g = h / group;
      const T* qt = q + idx * hd;
      const T* dot_ = dout + idx * hd;
      const T l = lse[idx], Dt = D[idx];
      std::fill(acc.begin(), acc.end(), T(0));
      for (int64_t j = start[t]; j <= t; ++j) {
        const T* kj = k + (j * Hkv + g) * hd;
        const T p = std::exp(scale * dot(qt, kj, hd) - l);
        const T ds = p * (dot(dot_, v + (j * Hkv + g) * hd, hd) - Dt);
        axpy(acc.data(), ds, kj, hd);
      }
      T* dqt = dq + idx * hd;
      for (int64_t i = 0; i < hd; ++i) dqt[i] = scale * acc[i];
    }
  }

  // Pass 2: dk, dv, one (j, g) key row per iteration; sums over the group's q heads (ascending), then over
  // queries t = j .. end-1 (ascending).
#pragma omp parallel if (par)
  {
    std::vector<T> ak(static_cast<size_t>(hd)), av(static_cast<size_t>(hd));
#pragma omp for schedule(dynamic, 8)
    for (int64_t idx = 0; idx < N * Hkv; ++idx) {
      const int64_t j = idx / Hkv, g = idx % Hkv, s1 = end[j];
      const T* kj = k + idx * hd;
      const T* vj = v + idx * hd;
      std::fill(ak.begin(), ak.end(), T(0));
      std::fill(av.begin(), av.end(), T(0));
      for (int64_t h = g * group; h < (g + 1) * group; ++h) {
        for (int64_t t = j; t < s1; ++t) {
          const int64_t r = t * Hq + h;
          const T* qt = q + r * hd;
          const T* dot_ = dout + r * hd;
          const T p = std::exp(scale * dot(qt, kj, hd) - lse[r]);
          axpy(av.data(), p, dot_, hd);
          axpy(ak.data(), p * (dot(dot_, vj, hd) - D[r]), qt, hd);
        }
      }
      T* dkj = dk + idx * hd;
      T* dvj = dv + idx * hd;
      for (int64_t i = 0; i < hd; ++i) {
        dkj[i] = scale * ak[i];
        dvj[i] = av[i];
      }
    }
  }
}

template <typename T>
void output_gate_forward(const T* o, const T* gate, T* y, int64_t n) {
#pragma omp parallel for schedule(static) if (n > 32768)
  for (int64_t i = 0; i < n; ++i) y[i] = o[i] * (T(1) / (T(1) + std::exp(-gate[i])));
}

template <typename T>
void output_gate_backward(const T* o, const T* gate, const T* dy, T* dout, T* dgate, int64_t n) {
#pragma omp parallel for schedule(static) if (n > 32768)
  for (int64_t i = 0; i < n; ++i) {
    const T s = T(1) / (T(1) + std::exp(-gate[i]));
    dout[i] = dy[i] * s;
    dgate[i] = dy[i] * o[i] * s * (T(1) - s);
  }
}

#define DS_INSTANTIATE(T)                                                                                       \
  template void attention_forward<T>(const AttnDims&, const T*, const T*, const T*, const int32_t*, T*, T*);    \
  template void attention_backward<T>(const AttnDims&, const T*, const T*, const T*, const T*, const T*,        \
                                      const T*, const int32_t*, T*, T*, T*);                                    \
  template void output_gate_forward<T>(const T*, const T*, T*, int64_t);                                        \
  template void output_gate_backward<T>(const T*, const T*, const T*, T*, T*, int64_t);
DS_INSTANTIATE(float)
DS_INSTANTIATE(double)
#undef DS_INSTANTIATE

}  // namespace ds::ops
