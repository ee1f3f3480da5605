// Linear layers on the GPU through cuBLASLt: bf16 inputs, fp32 accumulation (CUBLAS_COMPUTE_32F), bf16
// activations out, fp32 weight gradients accumulated in place. One handle and one workspace per process.
#pragma once
#include <cuda_runtime.h>

#include "core/cuda/cuda_utils.h"

namespace ds::ops::cuda {

// y[M, N] = x[M, K] @ W[N, K]^T (bf16 out; accumulate: y += ..., reading y as bf16). residual (bf16 [M, N], not
// with accumulate): y = x W^T + residual in the GEMM's epilogue (fp32 sum, one rounding; the decoder's residual
// stream, docs/gpu.md).
void linear_forward(const ds::cuda::bf16* x, const ds::cuda::bf16* W, ds::cuda::bf16* y, int64_t M, int64_t K,
                    int64_t N, bool accumulate, cudaStream_t stream, const ds::cuda::bf16* residual = nullptr);
// dx[M, K] = dy[M, N] @ W[N, K] (bf16 out; accumulate: dx += ...).
void linear_backward_data(const ds::cuda::bf16* dy, const ds::cuda::bf16* W, ds::cuda::bf16* dx, int64_t M,
                          int64_t K, int64_t N, bool accumulate, cudaStream_t stream);
// dW[N, K] += dy[M, N]^T @ x[M, K] (fp32 accumulate into fp32 dW).
// dW += dy^T x (beta 1), or dW = dy^T x (beta 0).
void linear_backward_weight(const ds::cuda::bf16* dy, const ds::cuda::bf16* x, float* dW, int64_t M, int64_t K,
                            int64_t N, cudaStream_t stream, float beta = 1.0f);
// General row-major GEMM used by the fused loss: C[M,N] (fp32 or bf16 per c_is_f32) = alpha * op(A) op(B) + beta*C,
// A: [M,K] (or [K,M] if ta), B: [K,N] (or [N,K] if tb), bf16. C_in (K > 0): the beta term reads C_in (C's type and
// leading dimension) instead of C: C = alpha op(A) op(B) + beta C_in.
void gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const ds::cuda::bf16* A, int64_t lda,
          const ds::cuda::bf16* B, int64_t ldb, float beta, void* C, bool c_is_f32, int64_t ldc, cudaStream_t stream,
          const void* C_in = nullptr);

}  // namespace ds::ops::cuda
