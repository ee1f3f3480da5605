// CPU reference of the gated delta rule (see gated_delta_rule.h for the contract and layouts).
//
// Notation per (sequence, value head h), q/k head j = h / (Hv/Hk); q̃ = scale·q; S ∈ R^{dk×dv}, row-major.
//   S̄_t = exp(g_t) S_{t-1},  u_t = β_t (v_t − S̄_tᵀ k_t),  S_t = S̄_t + k_t u_tᵀ,  o_t = S_tᵀ q̃_t.
//
// Chunked form (docs/model.md §3.2). In a chunk of L tokens starting from state S0,
// with in-chunk cumulative log-gates c_i = Σ_{m≤i} g_m, G_i = exp(c_i), Γ_ij = exp(c_i − c_j) (only j ≤ i is
// ever formed, so every exponent is ≤ 0 up to rounding and strong decay cannot overflow):
//   A_ij  = β_i Γ_ij (k_i·k_j)                    j < i       (strictly lower)
//   w_i   = v_i − G_i S0ᵀ k_i,   r_i = β_i w_i
//   u     = (I + A)⁻¹ r                            forward substitution, row by row (the UT transform)
//   o_i   = G_i S0ᵀ q̃_i + Σ_{j≤i} Γ_ij (q̃_i·k_j) u_j
//   S1    = G_{L−1} S0 + Σ_j Γ_{L−1,j} k_j u_jᵀ
// u equals HF's v_new = U − W S (U = L⁻¹ v_β, W = L⁻¹ (k_β ⊙ e^c)) by linearity of L⁻¹; we solve for it once
// instead of forming U and W. u_i is exactly the recurrent u_t of the same token.
//
// Chunked backward (a true chunk-wise adjoint, same role as FLA's chunk_gated_delta_rule_bwd): a forward pass
// stores only the chunk-boundary states S0 (nchunks·dk·dv per task), then chunks are visited in reverse with
// dS = ∂L/∂S1; each chunk recomputes its u, A, Γ from S0 and applies the adjoint of the formulas above:
//   du_j  = Σ_{i≥j} Γ_ij (q̃_i·k_j) dO_i + Γ_{L−1,j} dSᵀ k_j        (explicit uses of u)
//   dr    = (I + A)⁻ᵀ du                                             (backward substitution; = recurrent du_t)
//   dA_ij = −dr_i·u_j  (j < i)
//   dq̃_i  = G_i S0 dO_i + Σ_{j≤i} Γ_ij (dO_i·u_j) k_j
//   dk_j  = Σ_{i≥j} Γ_ij (dO_i·u_j) q̃_i + Γ_{L−1,j} dS u_j + Σ_{i>j} D_ij k_i + Σ_{i<j} D_ji k_i
//           − β_j G_j S0 dr_j,            with D_ij = dA_ij β_i Γ_ij
//   dv_i  = β_i dr_i,   dβ_i = dr_i·w_i + Σ_{j<i} dA_ij Γ_ij (k_i·k_j)
//   dS0   = G_{L−1} dS + Σ_i G_i q̃_i dO_iᵀ − Σ_i β_i G_i k_i dr_iᵀ
//   dc_i  collects every exp(c_i − c_j) and exp(c_i) factor (row minus column sums), then
//   dg_m  = Σ_{i≥m} dc_i (reverse cumulative sum inside the chunk).
//
// Numerics of the gates (docs/parity.md has the measurements). With strong decay (g ≈ −13 per token) c reaches
// ≈ −800 in a chunk, so an fp32 c_i − c_j would carry an absolute error ≈ |c|·2⁻²⁴ ≈ 5e-5 into every Γ_ij; and
// dg is tiny next to the row and column sums that make up dc (each pair term enters dc_i with + and dc_j with −,
// and the reverse cumulative sum cancels them again), so fp32 dc and fp32 cumulative sums lose digits exactly
// there. Hence c and dc are kept in double (O(L) values per chunk): Γ_ij = exp(c_i − c_j) has its exponent
// exact to the inputs, and dg_m = Σ_{i≥m} dc_i is the sum of its own pair terms up to double rounding, as
// accurate as the recurrent form's direct dg_t = ⟨∂L/∂S̄_t, S̄_t⟩. Diagonal (i = j) factors are exp(0) = 1 and
// are never differentiated (their + and − contributions are equal), so they add no rounding either.
// Cost O(L·dk·dv + L²(dk+dv)) per chunk; memory nchunks·dk·dv + O(C·(C+dk+dv) + dk·dv) per task (plus, with
// GVA, an [N, Hv, dk] scratch each for dq and dk).
//
// Parallelism: OpenMP over (sequence, value head) tasks, each computed sequentially. With GVA (Hv > Hk) dq and
// dk are written per value head into scratch and summed over the group in head order afterwards, so every
// result is bitwise independent of the thread count.
#include "ops/gated_delta_rule/gated_delta_rule.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "core/error.h"

namespace ds::ops {
namespace {

void check_args(const GdnDims& d, const void* q, const void* k, const void* v, const void* g, const void* beta,
                const int32_t* cu) {
  DS_CHECK(d.N >= 0 && d.num_seqs >= 0, "gated_delta_rule: N ({}) and num_seqs ({}) must be >= 0", d.N,
           d.num_seqs);
  DS_CHECK(d.Hk > 0 && d.Hv > 0 && d.dk > 0 && d.dv > 0,
           "gated_delta_rule: Hk ({}), Hv ({}), dk ({}), dv ({}) must be > 0", d.Hk, d.Hv, d.dk, d.dv);
  DS_CHECK(d.Hv % d.Hk == 0, "gated_delta_rule: Hv ({}) must be a multiple of Hk ({})", d.Hv, d.Hk);
  DS_CHECK(d.chunk_size > 0, "gated_delta_rule: chunk_size ({}) must be > 0", d.chunk_size);
  DS_CHECK(std::isfinite(d.scale), "gated_delta_rule: scale must be finite");
  DS_CHECK(cu != nullptr, "gated_delta_rule: cu_seqlens is null");
  DS_CHECK(cu[0] == 0, "gated_delta_rule: cu_seqlens[0] = {}, expected 0", cu[0]);
  for (int64_t s = 0; s < d.num_seqs; ++s)
    DS_CHECK(cu[s + 1] >= cu[s], "gated_delta_rule: cu_seqlens not monotone at {} ({} < {})", s + 1, cu[s + 1],
             cu[s]);
  DS_CHECK(cu[d.num_seqs] == d.N, "gated_delta_rule: cu_seqlens ends at {}, expected N = {}", cu[d.num_seqs],
           d.N);
  DS_CHECK(d.N == 0 || (q && k && v && g && beta), "gated_delta_rule: null q/k/v/g/beta");
}

// Small problems run on one thread: a parallel region costs more than it saves there (and much more when the
// cores are oversubscribed). Which thread runs a task never changes its result.
bool worth_threads(const GdnDims& d) {
  return d.num_seqs * d.Hv > 1 && d.N * d.Hv * d.dk * d.dv >= (int64_t(1) << 16);
}

// Dot product with four fixed partial sums (a fixed summation order, so still deterministic).
template <typename T>
inline T dot(const T* __restrict a, const T* __restrict b, int64_t n) {
  T s0 = 0, s1 = 0, s2 = 0, s3 = 0;
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    s0 += a[i] * b[i];
    s1 += a[i + 1] * b[i + 1];
    s2 += a[i + 2] * b[i + 2];
    s3 += a[i + 3] * b[i + 3];
  }
  for (; i < n; ++i) s0 += a[i] * b[i];
  return (s0 + s1) + (s2 + s3);
}

// y += a·x
template <typename T>
inline void axpy(T a, const T* __restrict x, T* __restrict y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

// Small row-major GEMMs for the L·dk·dv products. Inner loops are axpys over contiguous rows (they vectorise
// without reassociation); each output element is summed over the reduction index in ascending order whatever
// the row blocking, so results are deterministic. Rows are processed four at a time so that each row of B is
// read once per four output rows.
//
// C[i, :] (=|+=) Σ_k (rs ? rs[i] : 1)·A[i, k] · B[k, :]      A: [M, K], B: [K, N], C: [M, N]
template <typename T>
void gemm_nn(int64_t M, int64_t N, int64_t K, const T* A, int64_t lda, const T* B, int64_t ldb, T* C, int64_t ldc,
             const T* rs, bool accumulate) {
  if (!accumulate)
    for (int64_t i = 0; i < M; ++i) std::fill(C + i * ldc, C + i * ldc + N, T(0));
  int64_t i = 0;
  for (; i + 4 <= M; i += 4) {
    T* __restrict c0 = C + i * ldc;
    T* __restrict c1 = c0 + ldc;
    T* __restrict c2 = c1 + ldc;
    T* __restrict c3 = c2 + ldc;
    const T s0 = rs ? rs[i] : T(1), s1 = rs ? rs[i + 1] : T(1), s2 = rs ? rs[i + 2] : T(1),
            s3 = rs ? rs[i + 3] : T(1);
    for (int64_t k = 0; k < K; ++k) {
      const T* __restrict b = B + k * ldb;
      const T a0 = s0 * A[i * lda + k], a1 = s1 * A[(i + 1) * lda + k], a2 = s2 * A[(i + 2) * lda + k],
              a3 = s3 * A[(i + 3) * lda + k];
      for (int64_t n = 0; n < N; ++n) {
        const T bn = b[n];
        c0[n] += a0 * bn;
        c1[n] += a1 * bn;
        c2[n] += a2 * bn;
        c3[n] += a3 * bn;
      }
    }
  }
  for (; i < M; ++i) {
    const T si = rs ? rs[i] : T(1);
    for (int64_t k = 0; k < K; ++k) axpy(si * A[i * lda + k], B + k * ldb, C + i * ldc, N);
  }
}

// C[m, :] += Σ_l (cf ? cf[l] : 1)·A[l, m] · B[l, :]      A: [L, M], B: [L, N], C: [M, N]   (C += Aᵀ diag(cf) B)
template <typename T>
void gemm_tn_acc(int64_t M, int64_t N, int64_t L, const T* A, int64_t lda, const T* B, int64_t ldb, T* C,
                 int64_t ldc, const T* cf) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) {
    T* __restrict c0 = C + m * ldc;
    T* __restrict c1 = c0 + ldc;
    T* __restrict c2 = c1 + ldc;
    T* __restrict c3 = c2 + ldc;
    for (int64_t l = 0; l < L; ++l) {
      const T* __restrict b = B + l * ldb;
      const T f = cf ? cf[l] : T(1);
      const T* a = A + l * lda + m;
      const T a0 = f * a[0], a1 = f * a[1], a2 = f * a[2], a3 = f * a[3];
      for (int64_t n = 0; n < N; ++n) {
        const T bn = b[n];
        c0[n] += a0 * bn;
        c1[n] += a1 * bn;
        c2[n] += a2 * bn;
        c3[n] += a3 * bn;
      }
    }
  }
  for (; m < M; ++m)
    for (int64_t l = 0; l < L; ++l) axpy((cf ? cf[l] : T(1)) * A[l * lda + m], B + l * ldb, C + m * ldc, N);
}

// out = Sᵀ  (S: [rows, cols] → out: [cols, rows])
template <typename T>
void transpose(const T* S, T* out, int64_t rows, int64_t cols) {
  for (int64_t a = 0; a < rows; ++a)
    for (int64_t b = 0; b < cols; ++b) out[b * rows + a] = S[a * cols + b];
}

// Scratch of one task (one thread); sized once, reused across chunks and tasks.
template <typename T>
struct Work {
  int64_t C, dk, dv;
  std::vector<T> q, k, v, dO;                    // [C, dk] / [C, dv] chunk copies (q pre-scaled)
  std::vector<T> g, beta, G, dbeta;              // [C]
  std::vector<double> c, dc;                     // [C] c_i and ∂L/∂c_i, in double (see the top of this file)
  std::vector<T> E, KK, A, QK, Z;                // [C, C] (row i, column j)
  std::vector<T> ks, qs, w, u, du, dr, dSk;      // [C, dv]
  std::vector<T> dq, dk_, dSu;                   // [C, dk]
  std::vector<T> S, dS, ST, dST;                 // [dk, dv] states, [dv, dk] their transposes
  std::vector<T> cf1, cf2;                       // [C] per-row coefficients
  std::vector<T> states;                         // chunk-boundary states (backward) or all states (oracle)
  explicit Work(const GdnDims& d) : C(d.chunk_size), dk(d.dk), dv(d.dv) {
    const int64_t cc = C * C;
    for (auto* p : {&q, &k, &dq, &dk_, &dSu}) p->assign(C * dk, T(0));
    for (auto* p : {&v, &dO, &ks, &qs, &w, &u, &du, &dr, &dSk}) p->assign(C * dv, T(0));
    for (auto* p : {&g, &beta, &G, &dbeta}) p->assign(C, T(0));
    c.assign(C, 0.0);
    dc.assign(C, 0.0);
    for (auto* p : {&E, &KK, &A, &QK, &Z}) p->assign(cc, T(0));
    for (auto* p : {&S, &dS, &ST, &dST}) p->assign(dk * dv, T(0));
    for (auto* p : {&cf1, &cf2}) p->assign(C, T(0));
  }
};

// Pointers and strides of one (sequence, value head) task.
struct Task {
  int64_t bos, len, h, hk;
};

template <typename T>
void load_chunk(const GdnDims& d, Work<T>& W, const Task& tk, int64_t t0, int64_t L, const T* q, const T* k,
                const T* v, const T* g, const T* beta, const T* dout) {
  const T sc = static_cast<T>(d.scale);
  for (int64_t i = 0; i < L; ++i) {
    const int64_t t = t0 + i;
    const T* qr = q + (t * d.Hk + tk.hk) * d.dk;
    const T* kr = k + (t * d.Hk + tk.hk) * d.dk;
    for (int64_t a = 0; a < d.dk; ++a) W.q[i * d.dk + a] = qr[a] * sc;
    std::memcpy(&W.k[i * d.dk], kr, sizeof(T) * d.dk);
    std::memcpy(&W.v[i * d.dv], v + (t * d.Hv + tk.h) * d.dv, sizeof(T) * d.dv);
    if (dout) std::memcpy(&W.dO[i * d.dv], dout + (t * d.Hv + tk.h) * d.dv, sizeof(T) * d.dv);
    W.g[i] = g[t * d.Hv + tk.h];
    W.beta[i] = beta[t * d.Hv + tk.h];
  }
}

// Gates, Γ, A, w and u of a loaded chunk of L tokens with start state S0 (s_zero: S0 is known to be 0).
template <typename T>
void chunk_core(Work<T>& W, int64_t L, const T* S0, bool s_zero) {
  const int64_t C = W.C, dk = W.dk, dv = W.dv;
  double acc = 0;
  for (int64_t i = 0; i < L; ++i) {
    acc += static_cast<double>(W.g[i]);
    W.c[i] = acc;
    W.G[i] = std::exp(static_cast<T>(acc));
  }
  for (int64_t i = 0; i < L; ++i)  // j ≤ i only: exponent ≤ 0; the difference is taken in double
    for (int64_t j = 0; j <= i; ++j) W.E[i * C + j] = std::exp(static_cast<T>(W.c[i] - W.c[j]));
  if (s_zero) {
    std::fill(W.ks.begin(), W.ks.begin() + L * dv, T(0));
    std::copy(W.v.begin(), W.v.begin() + L * dv, W.w.begin());
  } else {
    gemm_nn(L, dv, dk, W.k.data(), dk, S0, dv, W.ks.data(), dv, static_cast<const T*>(nullptr), false);
    for (int64_t i = 0; i < L; ++i)
      for (int64_t b = 0; b < dv; ++b) W.w[i * dv + b] = W.v[i * dv + b] - W.G[i] * W.ks[i * dv + b];
  }
  for (int64_t i = 0; i < L; ++i) {
    const T* ki = &W.k[i * dk];
    T* ui = &W.u[i * dv];
    for (int64_t b = 0; b < dv; ++b) ui[b] = W.beta[i] * W.w[i * dv + b];
    for (int64_t j = 0; j < i; ++j) {
      const T kk = dot(ki, &W.k[j * dk], dk);
      W.KK[i * C + j] = kk;
      const T a = W.beta[i] * W.E[i * C + j] * kk;
      W.A[i * C + j] = a;
      axpy(-a, &W.u[j * dv], ui, dv);
    }
  }
}

// S ← G_{L−1} S + Σ_j Γ_{L−1,j} k_j u_jᵀ (in place).
template <typename T>
void chunk_state_update(Work<T>& W, int64_t L, T* S) {
  const int64_t C = W.C, dk = W.dk, dv = W.dv;
  const T gl = W.G[L - 1];
  for (int64_t x = 0; x < dk * dv; ++x) S[x] *= gl;
  gemm_tn_acc(dk, dv, L, W.k.data(), dk, W.u.data(), dv, S, dv, &W.E[(L - 1) * C]);
}

// The chunk length actually used: chunk_size, or the longest sequence if that is shorter (the same partition
// into chunks, but the [C, C] scratch stays small when a caller passes a huge chunk_size).
GdnDims with_effective_chunk(const GdnDims& d, const int32_t* cu) {
  int64_t longest = 1;
  for (int64_t s = 0; s < d.num_seqs; ++s) longest = std::max<int64_t>(longest, cu[s + 1] - cu[s]);
  GdnDims e = d;
  e.chunk_size = std::min(d.chunk_size, longest);
  return e;
}

template <typename T>
std::vector<Task> make_tasks(const GdnDims& d, const int32_t* cu) {
  std::vector<Task> tasks;
  tasks.reserve(d.num_seqs * d.Hv);
  const int64_t r = d.Hv / d.Hk;
  for (int64_t s = 0; s < d.num_seqs; ++s)
    for (int64_t h = 0; h < d.Hv; ++h) tasks.push_back({cu[s], cu[s + 1] - cu[s], h, h / r});
  return tasks;
}

// Sums per-value-head partials [N, Hv, dk] over each GVA group in head order into [N, Hk, dk].
template <typename T>
void sum_groups(const GdnDims& d, const T* part, T* out) {
  const int64_t r = d.Hv / d.Hk;
#pragma omp parallel for schedule(static) if (d.N * d.Hv * d.dk >= (int64_t(1) << 16))
  for (int64_t t = 0; t < d.N; ++t)
    for (int64_t j = 0; j < d.Hk; ++j) {
      T* o = out + (t * d.Hk + j) * d.dk;
      const T* p = part + (t * d.Hv + j * r) * d.dk;
      std::copy(p, p + d.dk, o);
      for (int64_t m = 1; m < r; ++m)
        for (int64_t a = 0; a < d.dk; ++a) o[a] += p[m * d.dk + a];
    }
}

}  // namespace

// Chunked forward: o [N, Hv, dv], final_state [num_seqs, Hv, dk, dv] (math at the top of this file).
template <typename T>
void chunk_gated_delta_rule_forward(const GdnDims& dims, const T* q, const T* k, const T* v, const T* g,
                                    const T* beta, const int32_t* cu_seqlens, const T* initial_state, T* o,
                                    T* final_state) {
  check_args(dims, q, k, v, g, beta, cu_seqlens);
  const GdnDims d = with_effective_chunk(dims, cu_seqlens);
  DS_CHECK(d.N == 0 || o, "gated_delta_rule: null output o");
  const auto tasks = make_tasks<T>(d, cu_seqlens);
  const int64_t ntask = static_cast<int64_t>(tasks.size()), C = d.chunk_size, dk = d.dk, dv = d.dv;
#pragma omp parallel if (worth_threads(d))
  {
    Work<T> W(d);
#pragma omp for schedule(dynamic, 1)
    for (int64_t ti = 0; ti < ntask; ++ti) {
      const Task& tk = tasks[ti];
      T* S = W.S.data();
      bool s_zero = initial_state == nullptr;
      if (s_zero)
        std::fill(W.S.begin(), W.S.end(), T(0));
      else
        std::memcpy(S, initial_state + ti * dk * dv, sizeof(T) * dk * dv);
      for (int64_t t0 = tk.bos; t0 < tk.bos + tk.len; t0 += C) {
        const int64_t L = std::min(C, tk.bos + tk.len - t0);
        load_chunk(d, W, tk, t0, L, q, k, v, g, beta, static_cast<const T*>(nullptr));
        chunk_core(W, L, S, s_zero);
        if (!s_zero)
          gemm_nn(L, dv, dk, W.q.data(), dk, S, dv, W.qs.data(), dv, static_cast<const T*>(nullptr), false);
        for (int64_t i = 0; i < L; ++i) {
          T* oi = o + ((t0 + i) * d.Hv + tk.h) * dv;
          const T* qi = &W.q[i * dk];
          if (s_zero)
            std::fill(oi, oi + dv, T(0));
          else
            for (int64_t b = 0; b < dv; ++b) oi[b] = W.G[i] * W.qs[i * dv + b];
          for (int64_t j = 0; j <= i; ++j) axpy(W.E[i * C + j] * dot(qi, &W.k[j * dk], dk), &W.u[j * dv], oi, dv);
        }
        chunk_state_update(W, L, S);
        s_zero = false;
      }
      if (final_state) std::memcpy(final_state + ti * dk * dv, S, sizeof(T) * dk * dv);
    }
  }
}

// Chunked backward: checkpointed chunk-boundary states + per-chunk adjoint (see the top of this file).
template <typename T>
void chunk_gated_delta_rule_backward(const GdnDims& dims, const T* q, const T* k, const T* v, const T* g,
                                     const T* beta, const int32_t* cu_seqlens, const T* initial_state,
                                     const T* dout, const T* dfinal_state, T* dq, T* dk, T* dv, T* dg, T* dbeta,
                                     T* dinitial_state) {
  check_args(dims, q, k, v, g, beta, cu_seqlens);
  const GdnDims d = with_effective_chunk(dims, cu_seqlens);
  DS_CHECK(d.N == 0 || dout, "gated_delta_rule: null dout");
  const auto tasks = make_tasks<T>(d, cu_seqlens);
  const int64_t ntask = static_cast<int64_t>(tasks.size()), C = d.chunk_size, Dk = d.dk, Dv = d.dv;
  const int64_t r = d.Hv / d.Hk;
  // With GVA, dq/dk go per value head into scratch first (then a fixed-order group sum).
  std::vector<T> dq_part, dk_part;
  T* dq_dst = dq;
  T* dk_dst = dk;
  int64_t qk_heads = d.Hk;
  if (r > 1) {
    if (dq) dq_part.assign(d.N * d.Hv * Dk, T(0)), dq_dst = dq_part.data();
    if (dk) dk_part.assign(d.N * d.Hv * Dk, T(0)), dk_dst = dk_part.data();
    qk_heads = d.Hv;
  }
#pragma omp parallel if (worth_threads(d))
  {
    Work<T> W(d);
#pragma omp for schedule(dynamic, 1)
    for (int64_t ti = 0; ti < ntask; ++ti) {
      const Task& tk = tasks[ti];
      const int64_t qk_head = r > 1 ? tk.h : tk.hk;
      const int64_t nch = (tk.len + C - 1) / C;
      const int64_t ss = Dk * Dv;
      if (static_cast<int64_t>(W.states.size()) < nch * ss) W.states.resize(nch * ss);
      // Pass 1: chunk-boundary states.
      T* S = W.S.data();
      if (initial_state)
        std::memcpy(S, initial_state + ti * ss, sizeof(T) * ss);
      else
        std::fill(W.S.begin(), W.S.end(), T(0));
      for (int64_t n = 0; n < nch; ++n) {
        const int64_t t0 = tk.bos + n * C, L = std::min(C, tk.bos + tk.len - t0);
        std::memcpy(&W.states[n * ss], S, sizeof(T) * ss);
        if (n + 1 == nch) break;  // the final state is not needed
        load_chunk(d, W, tk, t0, L, q, k, v, g, beta, static_cast<const T*>(nullptr));
        chunk_core(W, L, S, n == 0 && !initial_state);
        chunk_state_update(W, L, S);
      }
      // Pass 2: chunks in reverse, dS = ∂L/∂(state at the chunk's end).
      T* dS = W.dS.data();
      if (dfinal_state)
        std::memcpy(dS, dfinal_state + ti * ss, sizeof(T) * ss);
      else
        std::fill(W.dS.begin(), W.dS.end(), T(0));
      for (int64_t n = nch - 1; n >= 0; --n) {
        const int64_t t0 = tk.bos + n * C, L = std::min(C, tk.bos + tk.len - t0);
        const T* S0 = &W.states[n * ss];
        const bool s_zero = n == 0 && !initial_state;
        load_chunk(d, W, tk, t0, L, q, k, v, g, beta, dout);
        chunk_core(W, L, S0, s_zero);
        const T* Q = W.q.data();
        const T* K = W.k.data();
        const T* E = W.E.data();
        const T* el = &W.E[(L - 1) * C];  // Γ_{L−1, j}
        const T gl = W.G[L - 1];
        // Products with the chunk's end-state gradient: dSk_j = dSᵀ k_j, dSu_j = dS u_j.
        const T* none = nullptr;
        gemm_nn(L, Dv, Dk, K, Dk, dS, Dv, W.dSk.data(), Dv, none, false);
        transpose(dS, W.dST.data(), Dk, Dv);
        gemm_nn(L, Dk, Dv, W.u.data(), Dv, W.dST.data(), Dk, W.dSu.data(), Dk, none, false);
        if (!s_zero) gemm_nn(L, Dv, Dk, Q, Dk, S0, Dv, W.qs.data(), Dv, none, false);
        // Intra-chunk output terms: QK, Z = Γ ⊙ (dO uᵀ), du (explicit), dq, dk, dc.
        for (int64_t j = 0; j < L; ++j)
          for (int64_t b = 0; b < Dv; ++b) W.du[j * Dv + b] = el[j] * W.dSk[j * Dv + b];
        std::fill(W.dq.begin(), W.dq.begin() + L * Dk, T(0));
        for (int64_t j = 0; j < L; ++j)
          for (int64_t a = 0; a < Dk; ++a) W.dk_[j * Dk + a] = el[j] * W.dSu[j * Dk + a];
        for (int64_t i = 0; i < L; ++i) {
          W.dc[i] = s_zero ? 0.0 : double(W.G[i] * dot(&W.qs[i * Dv], &W.dO[i * Dv], Dv));
          W.dbeta[i] = 0;
        }
        for (int64_t i = 0; i < L; ++i) {
          const T* qi = Q + i * Dk;
          const T* doi = &W.dO[i * Dv];
          for (int64_t j = 0; j <= i; ++j) {
            const T qk = dot(qi, K + j * Dk, Dk);
            const T z = E[i * C + j] * dot(doi, &W.u[j * Dv], Dv);
            axpy(E[i * C + j] * qk, doi, &W.du[j * Dv], Dv);
            axpy(z, K + j * Dk, &W.dq[i * Dk], Dk);
            axpy(z, qi, &W.dk_[j * Dk], Dk);
            if (j < i) {
              const T y = z * qk;
              W.dc[i] += y;
              W.dc[j] -= y;
            }
          }
        }
        // Gradient of the chunk's end state through exp(c_{L−1} − c_j) and exp(c_{L−1}).
        for (int64_t j = 0; j + 1 < L; ++j) {
          const T tj = el[j] * dot(K + j * Dk, &W.dSu[j * Dk], Dk);
          W.dc[L - 1] += tj;
          W.dc[j] -= tj;
        }
        if (!s_zero) W.dc[L - 1] += gl * dot(S0, dS, ss);
        // Adjoint of u = (I + A)⁻¹ r: backward substitution dr_j = du_j − Σ_{i>j} A_ij dr_i.
        for (int64_t j = L - 1; j >= 0; --j) {
          T* drj = &W.dr[j * Dv];
          std::copy(&W.du[j * Dv], &W.du[j * Dv] + Dv, drj);
          for (int64_t i = j + 1; i < L; ++i) axpy(-W.A[i * C + j], &W.dr[i * Dv], drj, Dv);
        }
        // Through A_ij = β_i Γ_ij (k_i·k_j): dA_ij = −dr_i·u_j.
        for (int64_t i = 1; i < L; ++i) {
          const T* dri = &W.dr[i * Dv];
          for (int64_t j = 0; j < i; ++j) {
            const T dA = -dot(dri, &W.u[j * Dv], Dv);
            const T ekk = E[i * C + j] * W.KK[i * C + j];
            W.dbeta[i] += dA * ekk;
            const T Dij = dA * W.beta[i] * E[i * C + j];
            axpy(Dij, K + j * Dk, &W.dk_[i * Dk], Dk);
            axpy(Dij, K + i * Dk, &W.dk_[j * Dk], Dk);
            const T x = Dij * W.KK[i * C + j];
            W.dc[i] += x;
            W.dc[j] -= x;
          }
        }
        // Through r_i = β_i (v_i − G_i S0ᵀ k_i).
        for (int64_t i = 0; i < L; ++i) {
          const T* dri = &W.dr[i * Dv];
          W.dbeta[i] += dot(dri, &W.w[i * Dv], Dv);
          if (!s_zero) W.dc[i] -= W.beta[i] * W.G[i] * dot(&W.ks[i * Dv], dri, Dv);
        }
        for (int64_t i = 0; i < L; ++i) W.cf1[i] = -W.beta[i] * W.G[i];
        if (!s_zero) {  // dq̃_i += G_i S0 dO_i,  dk_i −= β_i G_i S0 dr_i
          transpose(S0, W.ST.data(), Dk, Dv);
          gemm_nn(L, Dk, Dv, W.dO.data(), Dv, W.ST.data(), Dk, W.dq.data(), Dk, W.G.data(), true);
          gemm_nn(L, Dk, Dv, W.dr.data(), Dv, W.ST.data(), Dk, W.dk_.data(), Dk, W.cf1.data(), true);
        }
        // dS ← ∂L/∂S0 = G_{L−1} dS + Σ_i G_i q̃_i dO_iᵀ − Σ_i β_i G_i k_i dr_iᵀ (in place).
        for (int64_t x = 0; x < ss; ++x) dS[x] *= gl;
        gemm_tn_acc(Dk, Dv, L, Q, Dk, W.dO.data(), Dv, dS, Dv, W.G.data());
        gemm_tn_acc(Dk, Dv, L, K, Dk, W.dr.data(), Dv, dS, Dv, W.cf1.data());
        // Write this chunk's gradients; dg is the reverse cumulative sum of dc.
        const T sc = static_cast<T>(d.scale);
        double acc = 0;
        for (int64_t i = L - 1; i >= 0; --i) {
          const int64_t t = t0 + i;
          acc += W.dc[i];
          if (dg) dg[t * d.Hv + tk.h] = static_cast<T>(acc);
          if (dbeta) dbeta[t * d.Hv + tk.h] = W.dbeta[i];
          if (dv) {
            T* o = dv + (t * d.Hv + tk.h) * Dv;
            for (int64_t b = 0; b < Dv; ++b) o[b] = W.beta[i] * W.dr[i * Dv + b];
          }
          if (dq_dst) {
            T* o = dq_dst + (t * qk_heads + qk_head) * Dk;
            for (int64_t a = 0; a < Dk; ++a) o[a] = sc * W.dq[i * Dk + a];
          }
          if (dk_dst) std::memcpy(dk_dst + (t * qk_heads + qk_head) * Dk, &W.dk_[i * Dk], sizeof(T) * Dk);
        }
      }
      if (dinitial_state) std::memcpy(dinitial_state + ti * ss, dS, sizeof(T) * ss);
    }
  }
  if (r > 1) {
    if (dq) sum_groups(d, dq_part.data(), dq);
    if (dk) sum_groups(d, dk_part.data(), dk);
  }
}

// Token-by-token oracle in HF torch_recurrent_gated_delta_rule order: decay, read, write, then read the output.
template <typename T>
void recurrent_gated_delta_rule_forward(const GdnDims& d, const T* q, const T* k, const T* v, const T* g,
                                        const T* beta, const int32_t* cu_seqlens, const T* initial_state, T* o,
                                        T* final_state) {
  check_args(d, q, k, v, g, beta, cu_seqlens);
  DS_CHECK(d.N == 0 || o, "gated_delta_rule: null output o");
  const auto tasks = make_tasks<T>(d, cu_seqlens);
  const int64_t ntask = static_cast<int64_t>(tasks.size()), Dk = d.dk, Dv = d.dv, ss = Dk * Dv;
  const T sc = static_cast<T>(d.scale);
#pragma omp parallel if (worth_threads(d))
  {
    std::vector<T> S(ss), qt(Dk), kv(Dv), delta(Dv);
#pragma omp for schedule(dynamic, 1)
    for (int64_t ti = 0; ti < ntask; ++ti) {
      const Task& tk = tasks[ti];
      if (initial_state)
        std::memcpy(S.data(), initial_state + ti * ss, sizeof(T) * ss);
      else
        std::fill(S.begin(), S.end(), T(0));
      for (int64_t t = tk.bos; t < tk.bos + tk.len; ++t) {
        const T* qr = q + (t * d.Hk + tk.hk) * Dk;
        const T* kr = k + (t * d.Hk + tk.hk) * Dk;
        const T* vr = v + (t * d.Hv + tk.h) * Dv;
        const T eg = std::exp(g[t * d.Hv + tk.h]), bt = beta[t * d.Hv + tk.h];
        for (int64_t a = 0; a < Dk; ++a) qt[a] = qr[a] * sc;
        for (auto& x : S) x *= eg;                                               // S̄ = e^g S
        std::fill(kv.begin(), kv.end(), T(0));
        for (int64_t a = 0; a < Dk; ++a) axpy(kr[a], &S[a * Dv], kv.data(), Dv);  // S̄ᵀ k
        for (int64_t b = 0; b < Dv; ++b) delta[b] = (vr[b] - kv[b]) * bt;
        for (int64_t a = 0; a < Dk; ++a) axpy(kr[a], delta.data(), &S[a * Dv], Dv);
        T* orow = o + (t * d.Hv + tk.h) * Dv;
        std::fill(orow, orow + Dv, T(0));
        for (int64_t a = 0; a < Dk; ++a) axpy(qt[a], &S[a * Dv], orow, Dv);  // Sᵀ q̃
      }
      if (final_state) std::memcpy(final_state + ti * ss, S.data(), sizeof(T) * ss);
    }
  }
}

// Reverse-time backward of the recurrence (docs/model.md §4). Stores every state of a task: (len+1)·dk·dv
// values per thread, fine for an oracle, not meant for long sequences.
template <typename T>
void recurrent_gated_delta_rule_backward(const GdnDims& d, const T* q, const T* k, const T* v, const T* g,
                                         const T* beta, const int32_t* cu_seqlens, const T* initial_state,
                                         const T* dout, const T* dfinal_state, T* dq, T* dk, T* dv, T* dg,
                                         T* dbeta, T* dinitial_state) {
  check_args(d, q, k, v, g, beta, cu_seqlens);
  DS_CHECK(d.N == 0 || dout, "gated_delta_rule: null dout");
  const auto tasks = make_tasks<T>(d, cu_seqlens);
  const int64_t ntask = static_cast<int64_t>(tasks.size()), Dk = d.dk, Dv = d.dv, ss = Dk * Dv;
  const int64_t r = d.Hv / d.Hk;
  const T sc = static_cast<T>(d.scale);
  std::vector<T> dq_part, dk_part;
  T* dq_dst = dq;
  T* dk_dst = dk;
  int64_t qk_heads = d.Hk;
  if (r > 1) {
    if (dq) dq_part.assign(d.N * d.Hv * Dk, T(0)), dq_dst = dq_part.data();
    if (dk) dk_part.assign(d.N * d.Hv * Dk, T(0)), dk_dst = dk_part.data();
    qk_heads = d.Hv;
  }
#pragma omp parallel if (worth_threads(d))
  {
    std::vector<T> states, Sb(ss), dS(ss), qt(Dk), w(Dv), u(Dv), du(Dv), dqt(Dk), dkt(Dk);
#pragma omp for schedule(dynamic, 1)
    for (int64_t ti = 0; ti < ntask; ++ti) {
      const Task& tk = tasks[ti];
      const int64_t qk_head = r > 1 ? tk.h : tk.hk;
      // Forward, storing S_0 .. S_len.
      states.resize((tk.len + 1) * ss);
      if (initial_state)
        std::memcpy(states.data(), initial_state + ti * ss, sizeof(T) * ss);
      else
        std::fill(states.begin(), states.begin() + ss, T(0));
      for (int64_t i = 0; i < tk.len; ++i) {
        const int64_t t = tk.bos + i;
        const T* kr = k + (t * d.Hk + tk.hk) * Dk;
        const T* vr = v + (t * d.Hv + tk.h) * Dv;
        const T eg = std::exp(g[t * d.Hv + tk.h]), bt = beta[t * d.Hv + tk.h];
        const T* Sp = &states[i * ss];
        T* Sn = &states[(i + 1) * ss];
        for (int64_t x = 0; x < ss; ++x) Sn[x] = Sp[x] * eg;
        std::fill(u.begin(), u.end(), T(0));
        for (int64_t a = 0; a < Dk; ++a) axpy(kr[a], Sn + a * Dv, u.data(), Dv);
        for (int64_t b = 0; b < Dv; ++b) u[b] = (vr[b] - u[b]) * bt;
        for (int64_t a = 0; a < Dk; ++a) axpy(kr[a], u.data(), Sn + a * Dv, Dv);
      }
      // Reverse time (docs/model.md §4).
      if (dfinal_state)
        std::memcpy(dS.data(), dfinal_state + ti * ss, sizeof(T) * ss);
      else
        std::fill(dS.begin(), dS.end(), T(0));
      for (int64_t i = tk.len - 1; i >= 0; --i) {
        const int64_t t = tk.bos + i;
        const T* qr = q + (t * d.Hk + tk.hk) * Dk;
        const T* kr = k + (t * d.Hk + tk.hk) * Dk;
        const T* vr = v + (t * d.Hv + tk.h) * Dv;
        const T* dOr = dout + (t * d.Hv + tk.h) * Dv;
        const T eg = std::exp(g[t * d.Hv + tk.h]), bt = beta[t * d.Hv + tk.h];
        const T* Sp = &states[i * ss];
        const T* St = &states[(i + 1) * ss];
        for (int64_t x = 0; x < ss; ++x) Sb[x] = Sp[x] * eg;  // S̄_t
        std::fill(w.begin(), w.end(), T(0));
        for (int64_t a = 0; a < Dk; ++a) axpy(kr[a], &Sb[a * Dv], w.data(), Dv);
        for (int64_t b = 0; b < Dv; ++b) {
          w[b] = vr[b] - w[b];  // v − S̄ᵀk
          u[b] = bt * w[b];
        }
        for (int64_t a = 0; a < Dk; ++a) qt[a] = qr[a] * sc;
        for (int64_t a = 0; a < Dk; ++a) axpy(qt[a], dOr, &dS[a * Dv], Dv);       // dS += q̃ dOᵀ
        for (int64_t a = 0; a < Dk; ++a) dqt[a] = dot(St + a * Dv, dOr, Dv);       // dq̃ = S_t dO
        std::fill(du.begin(), du.end(), T(0));
        for (int64_t a = 0; a < Dk; ++a) axpy(kr[a], &dS[a * Dv], du.data(), Dv);  // du = dSᵀ k
        for (int64_t a = 0; a < Dk; ++a)
          dkt[a] = dot(&dS[a * Dv], u.data(), Dv) - bt * dot(&Sb[a * Dv], du.data(), Dv);
        if (dv)
          for (int64_t b = 0; b < Dv; ++b) dv[(t * d.Hv + tk.h) * Dv + b] = bt * du[b];
        if (dbeta) dbeta[t * d.Hv + tk.h] = dot(du.data(), w.data(), Dv);
        for (int64_t a = 0; a < Dk; ++a) axpy(-bt * kr[a], du.data(), &dS[a * Dv], Dv);  // dS̄
        if (dg) dg[t * d.Hv + tk.h] = dot(dS.data(), Sb.data(), ss);
        for (auto& x : dS) x *= eg;
        if (dq_dst)
          for (int64_t a = 0; a < Dk; ++a) dq_dst[(t * qk_heads + qk_head) * Dk + a] = sc * dqt[a];
        if (dk_dst) std::memcpy(dk_dst + (t * qk_heads + qk_head) * Dk, dkt.data(), sizeof(T) * Dk);
      }
      if (dinitial_state) std::memcpy(dinitial_state + ti * ss, dS.data(), sizeof(T) * ss);
    }
  }
  if (r > 1) {
    if (dq) sum_groups(d, dq_part.data(), dq);
    if (dk) sum_groups(d, dk_part.data(), dk);
  }
}

#define DS_INSTANTIATE_GDN(T)                                                                                     \
  template void chunk_gated_delta_rule_forward<T>(const GdnDims&, const T*, const T*, const T*, const T*,        \
                                                  const T*, const int32_t*, const T*, T*, T*);                   \
  template void chunk_gated_delta_rule_backward<T>(const GdnDims&, const T*, const T*, const T*, const T*,       \
                                                   const T*, const int32_t*, const T*, const T*, const T*, T*,   \
                                                   T*, T*, T*, T*, T*);                                          \
  template void recurrent_gated_delta_rule_forward<T>(const GdnDims&, const T*, const T*, const T*, const T*,    \
                                                      const T*, const int32_t*, const T*, T*, T*);               \
  template void recurrent_gated_delta_rule_backward<T>(const GdnDims&, const T*, const T*, const T*, const T*,   \
                                                       const T*, const int32_t*, const T*, const T*, const T*,   \
                                                       T*, T*, T*, T*, T*, T*);
DS_INSTANTIATE_GDN(float)
DS_INSTANTIATE_GDN(double)
#undef DS_INSTANTIATE_GDN

}  // namespace ds::ops
