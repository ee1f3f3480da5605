// CUDA gated RMSNorm y = x * rsqrt(mean(x^2)+eps) * w * silu(z) (FLA FusedRMSNormGated: all fp32 inside, one
// rounding); math of gated_rmsnorm.h. Conventions: docs/cuda_backend.md.
#pragma once
#include <cuda_runtime.h>

#include "core/cuda/cuda_utils.h"

namespace ds::ops::cuda {

// x, z, y: bf16 [rows, d]; w: fp32 [d]; rstd: fp32 [rows] (out). amax: null, or a zeroed device float that
// receives max |y| (the FP8 cast's amax fused; core/cuda/kernel_utils.cuh amax_commit).
void gated_rmsnorm_forward(const ds::cuda::bf16* x, const ds::cuda::bf16* z, const float* w, ds::cuda::bf16* y,
                           float* rstd, int64_t rows, int64_t d, float eps, cudaStream_t stream,
                           float* amax = nullptr);
// dx, dz: bf16 [rows, d] (overwritten); dw: fp32 [d] (accumulated, deterministic). amax: null, or a zeroed device
// float that receives max |dz| (in_proj_z's output gradient: its FP8 cast's amax fused).
size_t gated_rmsnorm_scratch_bytes(int64_t rows, int64_t d);
void gated_rmsnorm_backward(const ds::cuda::bf16* x, const ds::cuda::bf16* z, const float* w, const float* rstd,
                            const ds::cuda::bf16* dy, ds::cuda::bf16* dx, ds::cuda::bf16* dz, float* dw, int64_t rows,
                            int64_t d, void* scratch, cudaStream_t stream, float* amax = nullptr);

}  // namespace ds::ops::cuda
