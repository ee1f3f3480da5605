// CUDA RMSNorm (zero-centered or plain), forward and backward; math of rmsnorm.h. Conventions:
// docs/cuda_backend.md. Used for the decoder norms, the final norm and the attention q/k norms (rows =
// tokens x heads, dim = head_dim).
#pragma once
#include <cuda_runtime.h>

#include "core/cuda/cuda_utils.h"

namespace ds::ops::cuda {

// x, y: bf16 [rows, dim]; w: fp32 [dim]; rstd: fp32 [rows] (out).
// amax (--precision fp8, ops/linear/fp8.h): when not null, a device float zeroed before the call that receives
// max |y| over the bf16 outputs (fp8_amax's value, fused: the FP8 cast of y needs no amax pass of its own).
void rmsnorm_forward(const ds::cuda::bf16* x, const float* w, ds::cuda::bf16* y, float* rstd, int64_t rows,
                     int64_t dim, float eps, bool zero_centered, cudaStream_t stream, float* amax = nullptr);

// dx: bf16 [rows, dim] (overwritten; may alias dy); dw: fp32 [dim] (accumulated, deterministic).
// scratch: rmsnorm_scratch_bytes(rows, dim) bytes of device memory.
size_t rmsnorm_scratch_bytes(int64_t rows, int64_t dim);
// dres (null: none): a bf16 [rows, dim] gradient added to dx in the same pass (the residual stream's gradient:
// dx = rmsnorm's dx + dres, one rounding; may alias dx). amax: null, or a zeroed device float that receives max |dx|
// (--precision fp8, as rmsnorm_forward's).
void rmsnorm_backward(const ds::cuda::bf16* x, const float* w, const float* rstd, const ds::cuda::bf16* dy,
                      ds::cuda::bf16* dx, float* dw, int64_t rows, int64_t dim, bool zero_centered, void* scratch,
                      cudaStream_t stream, const ds::cuda::bf16* dres = nullptr, float* amax = nullptr);

}  // namespace ds::ops::cuda
