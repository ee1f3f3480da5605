// Device helpers of the CUDA tests whose tensors are too large to fill or check on the host
// (tests/test_cuda_gdn_large.cpp): a counter-hash fill of l2-normalised bf16 rows (GDN q, k), and reductions that
// return a few numbers instead of the tensors: relative L2 error of two device tensors (in double), the number of
// non-finite elements, byte-wise equality. Kernels in tests/cuda_large_util.cu (CUDA builds only).
#pragma once
#ifdef DELTASTACK_CUDA

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "core/cuda/cuda_utils.h"

namespace ds::test::cuda {

// rows x dim bf16 values (dim a multiple of 32, at most 1024): uniform in [-1, 1) from a counter hash of
// (seed, index), each row then l2-normalised in fp32 (eps 1e-6) and rounded to bf16. Independent of launch shape.
void fill_unit_rows(::ds::cuda::bf16* x, int64_t rows, int64_t dim, uint64_t seed, cudaStream_t stream);

// ||got - ref|| / max(||ref||, 1e-300) over n elements, sums in double (core/numerics.h's rel_l2 on the device):
// 0 when equal, +infinity when either side holds a NaN or an infinity. Waits for the stream.
double rel_l2(const ::ds::cuda::bf16* got, const ::ds::cuda::bf16* ref, int64_t n, cudaStream_t stream);
double rel_l2(const float* got, const float* ref, int64_t n, cudaStream_t stream);

// Elements that are NaN or infinite (a poisoned element a kernel never wrote counts). Waits for the stream.
int64_t count_nonfinite(const ::ds::cuda::bf16* x, int64_t n, cudaStream_t stream);
int64_t count_nonfinite(const float* x, int64_t n, cudaStream_t stream);

// x[i] *= s for n fp32 elements, enqueued on `stream` (does not wait).
void scale(float* x, int64_t n, float s, cudaStream_t stream);

// Whether two device buffers hold the same bytes (bytes a multiple of 4, both 4-byte aligned). Waits for the stream.
bool same_bytes(const void* a, const void* b, size_t bytes, cudaStream_t stream);

}  // namespace ds::test::cuda

#endif  // DELTASTACK_CUDA
