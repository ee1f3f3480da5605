// CUDA SwiGLU h = silu(gate) * up; math of swiglu.h. gate and up are the two halves of one fused
// [N, 2*I] GEMM output (row t: gate at [t*2I, t*2I+I), up at [t*2I+I, t*2I+2I)).
#pragma once
#include <cuda_runtime.h>

#include "core/cuda/cuda_utils.h"

namespace ds::ops::cuda {

// gu: bf16 [N, 2I]; h: bf16 [N, I].
void swiglu_forward(const ds::cuda::bf16* gu, ds::cuda::bf16* h, int64_t N, int64_t I, cudaStream_t stream);
// dgu: bf16 [N, 2I] (overwritten).
void swiglu_backward(const ds::cuda::bf16* gu, const ds::cuda::bf16* dh, ds::cuda::bf16* dgu, int64_t N, int64_t I,
                     cudaStream_t stream);

}  // namespace ds::ops::cuda
