// Fused linear + cross-entropy on the GPU (math of linear_cross_entropy.h): walks the tokens in chunks, each
// chunk's logits [chunk, V] computed by cuBLASLt in fp32, turned in place into grad_scale * dlogits (bf16), then
// dh = dlogits @ W and dW += dlogits^T @ h (the first chunk's dW = with LinearCeOptions::dW_overwrite). The [N, V]
// logits never exist. Deterministic.
#pragma once
#include <cuda_runtime.h>

#include <string>

#include "core/cuda/cuda_utils.h"
#include "ops/linear_cross_entropy/linear_cross_entropy.h"

namespace ds::ops::cuda {

// Scratch bytes for N tokens (fp8_grads: LinearCeOptions::fp8_grads' casts too; with_dW false: for calls without
// dW only, a frozen head's, which need no casts of h and the dlogits transposed).
size_t linear_cross_entropy_scratch_bytes(int64_t N, int64_t H, int64_t V, int64_t chunk_tokens,
                                          bool fp8_grads = false, bool with_dW = true);
// Why the FP8 lm head cannot run at these sizes ("" when it can): its GEMMs need V, H and the chunk multiples of 16.
std::string linear_cross_entropy_fp8_unsupported(int64_t H, int64_t V, int64_t chunk_tokens);
// h: bf16 [N, H]; W: bf16 [V, H]; targets: int32 [N] (device, -100 = ignore; validated on the host).
// loss_out: fp64 device [2] = {sum of per-token losses, sum of z-loss parts}. dh: bf16 [N, H] (null: forward
// only); dW: fp32 [V, H] accumulated, or overwritten with opt.dW_overwrite (null: skip). opt.grad_scale multiplies the gradients. opt.fp8_grads: dh and dW
// by FP8 GEMMs (cuda.cu; ds::cuda error where linear_cross_entropy_fp8_unsupported or z_loss != 0); the scratch
// must then be linear_cross_entropy_scratch_bytes(..., true).
void linear_cross_entropy(const ds::cuda::bf16* h, const ds::cuda::bf16* W, const int32_t* targets, int64_t N,
                          int64_t H, int64_t V, const ds::ops::LinearCeOptions& opt, double* loss_out,
                          ds::cuda::bf16* dh, float* dW, void* scratch, cudaStream_t stream);

}  // namespace ds::ops::cuda
