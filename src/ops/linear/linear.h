// Linear layer without bias (PyTorch layout, W: [out, in]) through BLAS (OpenBLAS sgemm/dgemm).
#pragma once
#include <cstdint>

namespace ds::ops {

// y[M, N] = x[M, K] @ W[N, K]^T  (+ y if accumulate).
template <typename T>
void linear_forward(const T* x, const T* W, T* y, int64_t M, int64_t K, int64_t N, bool accumulate = false);

// dx[M, K] = dy[M, N] @ W[N, K]  (+ dx if accumulate_dx); skipped when dx is null.
// dW[N, K] += dy^T @ x            (always accumulates); skipped when dW is null.
template <typename T>
void linear_backward(const T* x, const T* W, const T* dy, T* dx, T* dW, int64_t M, int64_t K, int64_t N,
                     bool accumulate_dx = false);

}  // namespace ds::ops
