// CUDA l2norm y = x / sqrt(sum(x^2) + eps) (FLA l2norm_fwd: fp32 math, output stored bf16); math of l2norm.h.
// Reads rows with a stride so q and k can be taken straight out of the conv output [N, conv_dim].
#pragma once
#include <cuda_runtime.h>

#include "core/cuda/cuda_utils.h"

namespace ds::ops::cuda {

// Row r of head h at x + t*x_stride + h*dim for r = t*heads + h. y: bf16 [rows, dim] contiguous; rnorm: fp32 [rows].
void l2norm_forward(const ds::cuda::bf16* x, int64_t x_stride, ds::cuda::bf16* y, float* rnorm, int64_t tokens,
                    int64_t heads, int64_t dim, float eps, cudaStream_t stream);
// dx written with the same strided layout as x (dx + t*dx_stride + h*dim), bf16; dy contiguous bf16 [rows, dim].
void l2norm_backward(const ds::cuda::bf16* y, const float* rnorm, const ds::cuda::bf16* dy, ds::cuda::bf16* dx,
                     int64_t dx_stride, int64_t tokens, int64_t heads, int64_t dim, cudaStream_t stream);

}  // namespace ds::ops::cuda
