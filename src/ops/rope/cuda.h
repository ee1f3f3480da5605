// CUDA partial RoPE (half-split pairs inside the first rotary_dim dims of each head); math of rope.h.
// cos/sin tables are fp32 [N, rotary_dim/2], built on the host with ds::ops::rope_tables and copied.
#pragma once
#include <cuda_runtime.h>

#include "core/cuda/cuda_utils.h"

namespace ds::ops::cuda {

// In place on x: bf16 [N, H, head_dim]; inverse = the transposed rotation (backward).
void rope_apply(ds::cuda::bf16* x, int64_t N, int64_t H, int64_t head_dim, int64_t rotary_dim, const float* cos_t,
                const float* sin_t, bool inverse, cudaStream_t stream);

}  // namespace ds::ops::cuda
