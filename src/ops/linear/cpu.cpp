// Linear layers through OpenBLAS, thread-count invariant: OpenBLAS always runs single-threaded
// (ds::set_num_threads pins it to 1) and the parallelism is ours, over a FIXED partition of the output into
// 64-row/column slices chosen from the shapes alone. Each output element is then computed by the same
// single-threaded GEMM call whatever the thread count, so results are bitwise identical for 1 or 2 threads
// (OpenBLAS's own threading is not: see docs/determinism.md).
#include <cblas.h>

#include <algorithm>

#include "ops/linear/linear.h"

namespace ds::ops {

namespace {

// Row-major C[M,N] = op(A) op(B) + beta * C through single-threaded OpenBLAS.
void gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B, int64_t ldb,
          float beta, float* C, int64_t ldc) {
  cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, M, N, K, 1.0f, A, lda,
              B, ldb, beta, C, ldc);
}
void gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, const double* A, int64_t lda, const double* B,
          int64_t ldb, double beta, double* C, int64_t ldc) {
  cblas_dgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, M, N, K, 1.0, A, lda, B,
              ldb, beta, C, ldc);
}

constexpr int64_t kSlice = 64;
constexpr int64_t kSerialWork = 1 << 18;  // M*N*K below this: one call, no threads

// C[M,N] (row-major, ldc) = op(A) op(B) + beta C, split along M or N (the larger) into kSlice slices.
// A is addressed as [M,K] (or [K,M] if ta), B as [K,N] (or [N,K] if tb).
template <typename T>
void gemm_fixed_partition(bool ta, bool tb, int64_t M, int64_t N, int64_t K, const T* A, int64_t lda, const T* B,
                          int64_t ldb, T beta, T* C, int64_t ldc) {
  if (M == 0 || N == 0) return;
  const bool split_m = M >= N;
  const int64_t len = split_m ? M : N, slices = (len + kSlice - 1) / kSlice;
  const bool par = M * N * K >= kSerialWork && slices > 1;
#pragma omp parallel for schedule(dynamic, 1) if (par)
  for (int64_t s = 0; s < slices; ++s) {
    const int64_t b = s * kSlice, n = std::min(kSlice, len - b);
    if (split_m) {
      const T* As = ta ? A + b : A + b * lda;  // rows b.. of op(A)
      gemm(ta, tb, n, N, K, As, lda, B, ldb, beta, C + b * ldc, ldc);
    } else {
      const T* Bs = tb ? B + b * ldb : B + b;  // columns b.. of op(B)
      gemm(ta, tb, M, n, K, A, lda, Bs, ldb, beta, C + b, ldc);
    }
  }
}

}  // namespace

template <typename T>
void linear_forward(const T* x, const T* W, T* y, int64_t M, int64_t K, int64_t N, bool accumulate) {
  gemm_fixed_partition(false, true, M, N, K, x, K, W, K, accumulate ? T(1) : T(0), y, N);
}

template <typename T>
void linear_backward(const T* x, const T* W, const T* dy, T* dx, T* dW, int64_t M, int64_t K, int64_t N,
                     bool accumulate_dx) {
  if (M == 0) return;
  if (dx) gemm_fixed_partition(false, false, M, K, N, dy, N, W, K, accumulate_dx ? T(1) : T(0), dx, K);
  if (dW) gemm_fixed_partition(true, false, N, K, M, dy, N, x, K, T(1), dW, K);
}

template void linear_forward<float>(const float*, const float*, float*, int64_t, int64_t, int64_t, bool);
template void linear_forward<double>(const double*, const double*, double*, int64_t, int64_t, int64_t, bool);
template void linear_backward<float>(const float*, const float*, const float*, float*, float*, int64_t, int64_t,
                                     int64_t, bool);
template void linear_backward<double>(const double*, const double*, const double*, double*, double*, int64_t, int64_t,
                                      int64_t, bool);

}  // namespace ds::ops
