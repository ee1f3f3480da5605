// Small CUDA elementwise ops the GPU model needs: residual adds, the attention output gate (HF
// Qwen3_5Attention o * sigmoid(gate); math of attention.h output_gate_*), bf16 <-> fp32 copies.
#pragma once
#include <cuda_runtime.h>

#include "core/cuda/cuda_utils.h"

namespace ds::ops::cuda {

// amax (add, output_gate_forward): null, or a device float zeroed before the call that receives max |y| over the
// bf16 outputs (--precision fp8: the amax of an FP8 GEMM operand fused into its producer; core/cuda/kernel_utils.cuh
// amax_commit, bit for bit ops/linear/fp8.h fp8_amax).
// y = a + b (bf16, fp32 add, one rounding). y may alias a or b.
void add(const ds::cuda::bf16* a, const ds::cuda::bf16* b, ds::cuda::bf16* y, int64_t n, cudaStream_t stream,
         float* amax = nullptr);
// y = o * sigmoid(gate), all bf16 [n].
void output_gate_forward(const ds::cuda::bf16* o, const ds::cuda::bf16* gate, ds::cuda::bf16* y, int64_t n,
                         cudaStream_t stream, float* amax = nullptr);
// dout = dy * sigmoid(gate); dgate = dy * o * sigmoid(gate) * (1 - sigmoid(gate)). Overwritten.
void output_gate_backward(const ds::cuda::bf16* o, const ds::cuda::bf16* gate, const ds::cuda::bf16* dy,
                          ds::cuda::bf16* dout, ds::cuda::bf16* dgate, int64_t n, cudaStream_t stream);
// Strided 2-D copy of bf16 rows: dst[r*dst_stride + c] = src[r*src_stride + c] for c < cols.
void copy_rows(const ds::cuda::bf16* src, int64_t src_stride, ds::cuda::bf16* dst, int64_t dst_stride, int64_t rows,
               int64_t cols, cudaStream_t stream);
void bf16_to_f32(const ds::cuda::bf16* x, float* y, int64_t n, cudaStream_t stream);

}  // namespace ds::ops::cuda
