// CPU reference for the fused linear + cross-entropy (gradient-in-forward design of docs/model.md §2.8,
// Liger / QuACK style, chunked over tokens so the [N, V] logits never exist).
//
// Per chunk of up to chunk_tokens rows (only rows with a valid label, or all rows when logits_out is wanted):
//   1. S = h_c @ W^T                       (BLAS gemm, [C, V] scratch)
//   2. per row n (OpenMP over rows): m = max S_n, e = exp(S_n - m) in place, sum (double across blocks),
//        lse = m + log(sum),  loss_n = lse - S_{n,y} + z lse^2
//        dlogits_n = grad_scale * (softmax_n * (1 + 2 z lse) - onehot(y))      (0 rows for ignored labels)
//      the label entry is recomputed in double from S_{n,y} and lse (no cancellation when p_y -> 1)
//   3. dh_c = dlogits @ W                  (BLAS gemm, K = V)
//   4. dW  += dlogits^T @ h_c              (BLAS gemm, beta = 1, chunks in ascending order)
// Loss sums are added in token order on one thread. Parallel work is split into units that do not depend on
// the thread count (rows for step 2; 64 fixed vocabulary slices for the gemms, each a single-threaded BLAS
// call; the dh partials of the slices are summed in slice order), so results are bitwise independent of it.
#include <cblas.h>
#if defined(__linux__)
#include <sys/mman.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <new>
#include <type_traits>
#include <vector>

#include "core/error.h"
#include "core/fp8.h"
#include "ops/linear_cross_entropy/linear_cross_entropy.h"

#if defined(__GNUC__) && defined(__x86_64__) && !defined(__clang__)
// Runtime dispatch to the widest vector unit for the row passes (the same machine always picks the same clone).
#define DS_ROW_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define DS_ROW_CLONES
#endif

namespace ds::ops {
namespace {

// Number of vocabulary slices the gemms are split into (fixed, so results never depend on the thread count).
constexpr int64_t kVocabGroups = 64;

// exp(x) for float with only arithmetic, so loops around it vectorise: x = n ln2 + r, |r| <= ln2/2,
// exp(r) by the Cephes expf polynomial (about 1 ulp), times 2^n built in the exponent bits. Inputs below
// -87 (exp < 1.7e-38) return 0; NaN propagates. Valid for x <= 88.
[[gnu::always_inline]] inline float exp_f32(float x) {
  const float lo = -87.0f;
  const float xc = x < lo ? lo : x;  // NaN stays NaN (the comparison is false)
  const float magic = 12582912.0f;   // 1.5 * 2^23: adding it rounds to an integer
  const float n = (xc * 1.44269504088896341f + magic) - magic;
  float r = xc - n * 0.693359375f;  // ln2 split in a short high part and the rest
  r = r - n * -2.12194440e-4f;
  const float r2 = r * r;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r2 + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n == n ? n : 0.0f) + 127) << 23;  // (NaN: r already carries it)
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  const float e = p * scale;
  return x < lo ? 0.0f : e;
}

DS_ROW_CLONES float row_max_f32(const float* s, int64_t V) {
  float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
  for (int64_t i = 0; i < V; ++i) m = s[i] > m ? s[i] : m;
  return m;
}

// s[i] <- exp(s[i] - m); returns the sum (float within blocks of 2048, double across blocks).
DS_ROW_CLONES double row_exp_sum_f32(float* s, int64_t V, float m) {
  double total = 0;
  for (int64_t b = 0; b < V; b += 2048) {
    const int64_t e = std::min(V, b + 2048);
    float part = 0;
#pragma omp simd reduction(+ : part)
    for (int64_t i = b; i < e; ++i) {
      const float v = exp_f32(s[i] - m);
      s[i] = v;
      part += v;
    }
    total += part;
  }
  return total;
}

DS_ROW_CLONES void row_scale_f32(float* s, int64_t V, float c) {
#pragma omp simd
  for (int64_t i = 0; i < V; ++i) s[i] *= c;
}

double row_max(const double* s, int64_t V) {
  double m = -std::numeric_limits<double>::infinity();
  for (int64_t i = 0; i < V; ++i) m = s[i] > m ? s[i] : m;
  return m;
}
double row_exp_sum(double* s, int64_t V, double m) {
  double total = 0;
  for (int64_t i = 0; i < V; ++i) {
    s[i] = std::exp(s[i] - m);
    total += s[i];
  }
  return total;
}
void row_scale(double* s, int64_t V, double c) {
  for (int64_t i = 0; i < V; ++i) s[i] *= c;
}
float row_max(const float* s, int64_t V) { return row_max_f32(s, V); }
double row_exp_sum(float* s, int64_t V, float m) { return row_exp_sum_f32(s, V, m); }
void row_scale(float* s, int64_t V, float c) { row_scale_f32(s, V, c); }

// Row-major C[M, N] = alpha op(A) op(B) + beta C.
void gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
          const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, M, N, K, alpha, A,
              lda, B, ldb, beta, C, ldc);
}
void gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, double alpha, const double* A, int64_t lda,
          const double* B, int64_t ldb, double beta, double* C, int64_t ldc) {
  cblas_dgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, M, N, K, alpha, A,
              lda, B, ldb, beta, C, ldc);
}

// Uninitialised scratch on 2 MiB boundaries, backed by transparent huge pages where the kernel allows it
// (first touch of a 1 GiB logits chunk costs ~260k page faults with 4 KiB pages, ~30% of the op at N = 1024).
struct Scratch {
  void* ptr = nullptr;
  explicit Scratch(size_t bytes) {
    constexpr size_t kHuge = size_t(2) << 20;
    if (bytes >= kHuge) {
      const size_t rounded = (bytes + kHuge - 1) / kHuge * kHuge;
      ptr = std::aligned_alloc(kHuge, rounded);
#ifdef MADV_HUGEPAGE
      if (ptr) ::madvise(ptr, rounded, MADV_HUGEPAGE);
#endif
    } else {
      ptr = std::malloc(bytes > 0 ? bytes : 1);
    }
    if (!ptr) throw std::bad_alloc();
  }
  ~Scratch() { std::free(ptr); }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
};


}  // namespace

template <typename T>
LinearCeResult linear_cross_entropy(const T* h, const T* W, const int32_t* labels, int64_t N, int64_t H, int64_t V,
                                    const LinearCeOptions& opt, T* dh, T* dW, T* logits_out) {
  DS_CHECK(N >= 0 && H > 0 && V > 0, "linear_cross_entropy: N ({}) must be >= 0, H ({}) and V ({}) > 0", N, H, V);
  DS_CHECK(opt.chunk_tokens > 0, "linear_cross_entropy: chunk_tokens ({}) must be > 0", opt.chunk_tokens);
  LinearCeResult res;
  for (int64_t n = 0; n < N; ++n) {
    const int64_t y = labels[n];
    if (y == opt.ignore_index) continue;
    if (y < 0 || y >= V)
      fail("linear_cross_entropy: label {} at token {} is outside [0, {}) and is not ignore_index ({})", y, n, V,
           opt.ignore_index);
    ++res.num_valid;
  }
  if (dh) std::fill(dh, dh + N * H, T(0));

  // Rows that need logits: the valid ones, or all of them when the caller keeps the logits.
  std::vector<int64_t> rows;
  rows.reserve(static_cast<size_t>(logits_out ? N : res.num_valid));
  for (int64_t n = 0; n < N; ++n)
    if (logits_out || labels[n] != opt.ignore_index) rows.push_back(n);
  const int64_t R = static_cast<int64_t>(rows.size());
  if (dW && opt.dW_overwrite) std::fill(dW, dW + V * H, T(0));  // then added into, as without the flag
  if (R == 0) return res;

  const bool want_grad = dh != nullptr || dW != nullptr;
  // --fp8-lm-head (linear_cross_entropy.h): the backward GEMMs read W and h as their E4M3 casts (per-tensor, amax
  // over all of W and all N rows of h) and each chunk's dlogits as their E5M2 cast at the bound |grad_scale|.
  const bool fp8 = opt.fp8_grads && want_grad;
  std::vector<float> Wq, hq;
  if (fp8) {
    if constexpr (!std::is_same_v<T, float>) {
      fail("linear_cross_entropy: fp8_grads emulates the GPU's FP8 casts in float only");
    } else {
      DS_CHECK(opt.z_loss == 0, "linear_cross_entropy: the FP8 lm head (--fp8-lm-head) needs z_loss 0, got {} "
               "(the z-loss factor breaks the dlogits' bound)", opt.z_loss);
      Wq.assign(W, W + V * H);
      fp8_fake_quantize(Wq.data(), V * H, Fp8Format::E4M3, fp8_amax(W, V * H));
      hq.assign(h, h + N * H);
      fp8_fake_quantize(hq.data(), N * H, Fp8Format::E4M3, fp8_amax(h, N * H));
    }
  }
  const T* Wb = W;  // the backward GEMMs' W and rows of h
  const T* hb = h;
  if constexpr (std::is_same_v<T, float>) {
    if (fp8) Wb = Wq.data(), hb = hq.data();
  }
  const int64_t C = std::min(opt.chunk_tokens, R);
  const double z = opt.z_loss, gs = opt.grad_scale;
  // Fixed V-groups: the unit of parallel work for the gemms (a constant, not the thread count).
  const int64_t G = std::min<int64_t>(kVocabGroups, V);
  auto group_begin = [&](int64_t g) { return V * g / G; };

  // The [C, V] scratch is left uninitialised (every entry is written by the logits gemm before it is read).
  Scratch S_buf(static_cast<size_t>(C * V) * sizeof(T));
  T* const S = static_cast<T*>(S_buf.ptr);
  std::vector<T> hc(static_cast<size_t>(C * H)), dh_part;
  if (dh) dh_part.resize(static_cast<size_t>(G * C * H));
  std::vector<double> row_loss(static_cast<size_t>(C)), row_z(static_cast<size_t>(C));

  for (int64_t r0 = 0; r0 < R; r0 += C) {
    const int64_t cn = std::min(C, R - r0);
    const bool par = cn * V * H > 65536;  // small chunks run on one thread (the partition never changes results)
    for (int64_t r = 0; r < cn; ++r) std::memcpy(hc.data() + r * H, h + rows[r0 + r] * H, sizeof(T) * H);

    // 1. logits, per V-group: S[:, v0:v1] = hc @ W[v0:v1]^T
#pragma omp parallel for schedule(dynamic, 1) if (par)
    for (int64_t g = 0; g < G; ++g) {
      const int64_t v0 = group_begin(g), v1 = group_begin(g + 1);
      gemm(false, true, cn, v1 - v0, H, T(1), hc.data(), H, W + v0 * H, H, T(0), S + v0, V);
    }
    if (logits_out)
      for (int64_t r = 0; r < cn; ++r) std::memcpy(logits_out + rows[r0 + r] * V, S + r * V, sizeof(T) * V);

    // 2. per row: log-sum-exp, loss, dlogits in place.
#pragma omp parallel for schedule(static) if (par)
    for (int64_t r = 0; r < cn; ++r) {
      T* s = S + r * V;
      const int64_t y = labels[rows[r0 + r]];
      row_loss[r] = row_z[r] = 0;
      if (y == opt.ignore_index) {
        if (want_grad) std::fill(s, s + V, T(0));
        continue;
      }
      const double ly = s[y];
      const T m = row_max(s, V);
      const double sum = row_exp_sum(s, V, m);
      const double lse = static_cast<double>(m) + std::log(sum);
      row_z[r] = z * lse * lse;
      row_loss[r] = lse - ly + row_z[r];
      if (want_grad) {
        const double c = 1.0 + 2.0 * z * lse;
        row_scale(s, V, static_cast<T>(gs * c / sum));
        s[y] = static_cast<T>(gs * (std::exp(ly - lse) * c - 1.0));
      }
    }
    for (int64_t r = 0; r < cn; ++r) {
      res.loss_sum += row_loss[r];
      res.z_loss_sum += row_z[r];
    }
    if (!want_grad) continue;
    if constexpr (std::is_same_v<T, float>) {
      if (fp8) fp8_fake_quantize(S, cn * V, Fp8Format::E5M2, static_cast<float>(std::fabs(gs)));
    }
    if (fp8 && dW)  // the logits are made: hc now holds the chunk's rows of the cast of h, for dW
      for (int64_t r = 0; r < cn; ++r) std::memcpy(hc.data() + r * H, hb + rows[r0 + r] * H, sizeof(T) * H);

    // 3. per V-group: dh partial = dS[:, v0:v1] @ W[v0:v1];  dW[v0:v1] += dS[:, v0:v1]^T @ hc
#pragma omp parallel for schedule(dynamic, 1) if (par)
    for (int64_t g = 0; g < G; ++g) {
      const int64_t v0 = group_begin(g), v1 = group_begin(g + 1);
      if (dh)
        gemm(false, false, cn, H, v1 - v0, T(1), S + v0, V, Wb + v0 * H, H, T(0), dh_part.data() + g * C * H, H);
      if (dW) gemm(true, false, v1 - v0, H, cn, T(1), S + v0, V, hc.data(), H, T(1), dW + v0 * H, H);
    }
    // 4. dh = sum of the group partials in group order.
    if (dh) {
#pragma omp parallel for schedule(static) if (par)
      for (int64_t r = 0; r < cn; ++r) {
        T* out = dh + rows[r0 + r] * H;
        for (int64_t g = 0; g < G; ++g) {
          const T* p = dh_part.data() + (g * C + r) * H;
          for (int64_t i = 0; i < H; ++i) out[i] += p[i];
        }
      }
    }
  }
  return res;
}

template LinearCeResult linear_cross_entropy<float>(const float*, const float*, const int32_t*, int64_t, int64_t,
                                                    int64_t, const LinearCeOptions&, float*, float*, float*);
template LinearCeResult linear_cross_entropy<double>(const double*, const double*, const int32_t*, int64_t,
                                                     int64_t, int64_t, const LinearCeOptions&, double*, double*,
                                                     double*);

}  // namespace ds::ops
