#include <cblas.h>

#include "ops/linear/linear.h"

namespace ds::ops {

namespace {
// Row-major C[M,N] = alpha * op(A) op(B) + beta * C through OpenBLAS.
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
}  // namespace

template <typename T>
void linear_forward(const T* x, const T* W, T* y, int64_t M, int64_t K, int64_t N, bool accumulate) {
  if (M == 0 || N == 0) return;
  gemm(false, true, M, N, K, x, K, W, K, accumulate ? T(1) : T(0), y, N);
}

template <typename T>
void linear_backward(const T* x, const T* W, const T* dy, T* dx, T* dW, int64_t M, int64_t K, int64_t N,
                     bool accumulate_dx) {
  if (M == 0) return;
  if (dx) gemm(false, false, M, K, N, dy, N, W, K, accumulate_dx ? T(1) : T(0), dx, K);
  if (dW) gemm(true, false, N, K, M, dy, N, x, K, T(1), dW, K);
}

template void linear_forward<float>(const float*, const float*, float*, int64_t, int64_t, int64_t, bool);
template void linear_forward<double>(const double*, const double*, double*, int64_t, int64_t, int64_t, bool);
template void linear_backward<float>(const float*, const float*, const float*, float*, float*, int64_t, int64_t,
                                     int64_t, bool);
template void linear_backward<double>(const double*, const double*, const double*, double*, double*, int64_t, int64_t,
                                      int64_t, bool);

}  // namespace ds::ops
