// CUDA GDN gates: beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias) (threshold 20); math of gdn_gate.h.
// a and b come from one fused projection output ab: bf16 [N, 2*Hv] (b first, then a, per token).
#pragma once
#include <cuda_runtime.h>

#include "core/cuda/cuda_utils.h"

namespace ds::ops::cuda {

// g, beta: fp32 [N, Hv]; A_log, dt_bias: fp32 [Hv].
void gdn_gate_forward(const ds::cuda::bf16* ab, const float* A_log, const float* dt_bias, float* g, float* beta,
                      int64_t N, int64_t Hv, cudaStream_t stream);
// dab: bf16 [N, 2Hv] (overwritten); dA_log, ddt_bias: fp32 [Hv] (accumulated, deterministic).
size_t gdn_gate_scratch_bytes(int64_t N, int64_t Hv);
void gdn_gate_backward(const ds::cuda::bf16* ab, const float* A_log, const float* dt_bias, const float* dg,
                       const float* dbeta, ds::cuda::bf16* dab, float* dA_log, float* ddt_bias, int64_t N, int64_t Hv,
                       void* scratch, cudaStream_t stream);

}  // namespace ds::ops::cuda
