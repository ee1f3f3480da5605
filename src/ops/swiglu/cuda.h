// CUDA SwiGLU h = silu(gate) * up; math of swiglu.h. swiglu_forward / swiglu_backward take the engine's fused
// [N, 2*I] gate|up GEMM output (row t: gate at [t*2I, t*2I+I), up at [t*2I+I, t*2I+2I)); the *_rows forms take
// gate and up as two row-strided arrays.
#pragma once
#include <cuda_runtime.h>

#include "core/cuda/cuda_utils.h"

namespace ds::ops::cuda {

// amax (every form): null, or a device float zeroed before the call that receives max |output| over the bf16
// values written (h; dgate and dup together): --precision fp8's amax of an FP8 GEMM operand fused into its producer
// (core/cuda/kernel_utils.cuh amax_commit; bit for bit ops/linear/fp8.h fp8_amax).
// gu: bf16 [N, 2I]; h: bf16 [N, I].
void swiglu_forward(const ds::cuda::bf16* gu, ds::cuda::bf16* h, int64_t N, int64_t I, cudaStream_t stream,
                    float* amax = nullptr);
// dgu: bf16 [N, 2I] (overwritten); it may be gu itself (in place: each thread reads a position's gate and up before
// writing that position's gradients; the engine makes gate|up's gradient over its gate|up output).
void swiglu_backward(const ds::cuda::bf16* gu, const ds::cuda::bf16* dh, ds::cuda::bf16* dgu, int64_t N, int64_t I,
                     cudaStream_t stream, float* amax = nullptr);

// The same math on gate and up given as two row-strided bf16 arrays: row t of gate / up at gate + t * ld_in,
// up + t * ld_in (ld_in >= I), of dgate / dup at + t * ld_out (ld_out >= I); h, dh dense [N, I]. Outputs (h; dgate,
// dup) must not overlap the inputs, except that dgate / dup may be gate / up themselves (the same strides: in place,
// as swiglu_backward). (deltastack.torch passes gate and up as two tensors: ld = I.)
void swiglu_forward_rows(const ds::cuda::bf16* gate, const ds::cuda::bf16* up, int64_t ld_in, ds::cuda::bf16* h,
                         int64_t N, int64_t I, cudaStream_t stream, float* amax = nullptr);
void swiglu_backward_rows(const ds::cuda::bf16* gate, const ds::cuda::bf16* up, int64_t ld_in,
                          const ds::cuda::bf16* dh, ds::cuda::bf16* dgate, ds::cuda::bf16* dup, int64_t ld_out,
                          int64_t N, int64_t I, cudaStream_t stream, float* amax = nullptr);

}  // namespace ds::ops::cuda
