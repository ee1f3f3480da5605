// FP8 linear layers on the GPU (`--precision fp8`; docs/fp8.md): per-tensor current scaling, E4M3 for weights and
// activations, E4M3 or E5M2 for output gradients, GEMMs through cuBLASLt's FP8 kernels with fp32 accumulation.
//
// The casts are core/fp8.h's, bit for bit (the CPU emulation the tests and the probe compare against): a tensor x is
// cast as fp8_encode(x * inv) with inv = fp8_inv_scale(amax(x)), and the GEMM multiplies the codes and scales the
// fp32 sum by the two operands' 1 / inv (cuBLASLt's A/B scale pointers, device floats written by the cast kernels).
//
// Hopper's FP8 tensor cores take only the "TN" form (both operands contiguous along the reduction), so a linear
// layer y = x W^T (x [M, K], W [N, K]) needs:
//   forward  y[M, N]  = q(x)[M, K]     . q(W)[N, K]^T
//   dgrad    dx[M, K] = q(dy)[M, N]    . q(W^T)[K, N]^T     (W cast transposed)
//   wgrad    dW[N, K] += q(dy^T)[N, M] . q(x^T)[K, M]^T     (dy and x cast transposed; M padded to 16 with zeros)
// The amax of a tensor is the same whichever layout it is cast into, so x's forward and backward casts agree.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "core/cuda/cuda_utils.h"
#include "core/fp8.h"

namespace ds::ops::cuda {

// An FP8 GEMM operand: rows x cols codes, row-major with leading dimension ld (elements = bytes), the format, and
// the device float its codes are multiplied by (the dequantization scale, 1 / inv).
struct Fp8Matrix {
  const uint8_t* data = nullptr;
  int64_t rows = 0, cols = 0, ld = 0;
  Fp8Format format = Fp8Format::E4M3;
  const float* scale = nullptr;
};

// *amax = max |x| over the rows x cols bf16 matrix x (leading dimension ld >= cols); NaN when any element is NaN.
// One pass; blocks combine with atomicMax on the non-negative fp32 bits, which is order-free (max is exact), so the
// result is deterministic. amax: one device float.
void fp8_amax(const ds::cuda::bf16* x, int64_t rows, int64_t cols, int64_t ld, float* amax, cudaStream_t stream);

// q[r * ldq + c] = fp8_encode(x[r, c] * inv), inv = fp8_inv_scale(*amax, format); *scale = 1 / inv. ldq >= cols.
void fp8_quantize(const ds::cuda::bf16* x, int64_t rows, int64_t cols, int64_t ld, const float* amax,
                  Fp8Format format, uint8_t* q, int64_t ldq, float* scale, cudaStream_t stream);

// The transpose: qt[c * ldqt + r] = fp8_encode(x[r, c] * inv) for r < rows; qt[c * ldqt + r] = 0 for
// rows <= r < ldqt (the zero padding the wgrad GEMM's reduction runs over). ldqt >= rows. *scale = 1 / inv.
void fp8_quantize_transpose(const ds::cuda::bf16* x, int64_t rows, int64_t cols, int64_t ld, const float* amax,
                            Fp8Format format, uint8_t* qt, int64_t ldqt, float* scale, cudaStream_t stream);

// Distance in floats between two amax / scale values in one buffer: each on its own 256-byte boundary, the alignment
// cuBLASLt's scale pointers get from an allocation of their own.
inline constexpr int64_t kFp8Slot = 64;

// Both casts of x in one pass (one read of x): q (row-major, ldq; skipped when null) and qt (transposed, ldqt, its
// zero padding), as fp8_quantize and fp8_quantize_transpose write them; *scale_t (and *scale when not null) = 1 / inv.
void fp8_quantize_both(const ds::cuda::bf16* x, int64_t rows, int64_t cols, int64_t ld, const float* amax,
                       Fp8Format format, uint8_t* q, int64_t ldq, uint8_t* qt, int64_t ldqt, float* scale_t,
                       float* scale, cudaStream_t stream);

// qt[c * ldqt + r] = q[r * ldq + c] for r < rows, 0 for rows <= r < ldqt: a cast already made, transposed (its
// codes as they are; the same scale). cols, ldq and ldqt multiples of 4 and q, qt 4-byte aligned (ds::cuda error
// otherwise).
void fp8_transpose(const uint8_t* q, int64_t rows, int64_t cols, int64_t ldq, uint8_t* qt, int64_t ldqt,
                   cudaStream_t stream);

// Leading dimension of a transposed cast over `rows` rows: rows rounded up to 16 (cuBLASLt's FP8 alignment).
inline int64_t fp8_padded(int64_t rows) { return (rows + 15) / 16 * 16; }

// Whether gemm_fp8 takes C[M, N] = A[M, K] B[N, K]^T: K, lda and ldb multiples of 16, A and B 16-byte aligned, the
// formats not both E5M2 (Hopper's FP8 GEMM takes E4M3 x E4M3, E4M3 x E5M2 and E5M2 x E4M3).
bool gemm_fp8_supported(const Fp8Matrix& A, const Fp8Matrix& B);

// How cuBLASLt scales the operands: one fp32 per tensor (the product path), or DeepSeek-V3-style blocks (B, the
// weight: one fp32 per 128 x 128 block, CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F; A, the activation: one per
// 1 x 128 run along K, VEC128_32F), which `bench ops` times beside it.
enum class Fp8ScaleMode { Tensor, Block };

// C[M, N] = A.scale * B.scale * (A[M, K] . B[N, K]^T) + beta * C, M = A.rows, N = B.rows, K = A.cols = B.cols.
// C: bf16 or fp32 (c_is_f32), row-major, leading dimension ldc >= N. fp32 accumulation; fast_accum lets the
// tensor cores keep their partial sums in their own (narrower) accumulator instead of promoting them to fp32 every
// few K steps (CUBLASLT_MATMUL_DESC_FAST_ACCUM). The algorithm is chosen once per problem and kept (deterministic).
// ds::cuda error when !gemm_fp8_supported or cuBLASLt has no algorithm for the problem.
// C_in: the beta term reads C_in (C's type and ldc) instead of C (the residual stream added in the epilogue).
void gemm_fp8(const Fp8Matrix& A, const Fp8Matrix& B, void* C, bool c_is_f32, int64_t ldc, float beta,
              bool fast_accum, cudaStream_t stream, Fp8ScaleMode mode = Fp8ScaleMode::Tensor,
              const void* C_in = nullptr);

}  // namespace ds::ops::cuda
