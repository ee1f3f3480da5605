// CUDA causal depthwise conv1d + SiLU over packed sequences; math of conv1d.h. seq_start[t] is the index of the
// first token of t's document (taps before it read zero).
#pragma once
#include <cuda_runtime.h>

#include "core/cuda/cuda_utils.h"

namespace ds::ops::cuda {

// x, y: bf16 [N, C]; w: fp32 [C, K]; seq_start: int32 [N].
void conv1d_silu_forward(const ds::cuda::bf16* x, const float* w, const int32_t* seq_start, ds::cuda::bf16* y,
                         int64_t N, int64_t C, int64_t K, cudaStream_t stream);
// dx: bf16 [N, C] (overwritten); dw: fp32 [C, K] (accumulated, deterministic). amax: null, or a zeroed device float
// that receives max |dx| (in_proj_qkv's output gradient: its FP8 cast's amax fused; core/cuda/kernel_utils.cuh).
size_t conv1d_scratch_bytes(int64_t N, int64_t C, int64_t K);
void conv1d_silu_backward(const ds::cuda::bf16* x, const float* w, const ds::cuda::bf16* dy, const int32_t* seq_start,
                          ds::cuda::bf16* dx, float* dw, int64_t N, int64_t C, int64_t K, void* scratch,
                          cudaStream_t stream, float* amax = nullptr);

}  // namespace ds::ops::cuda
