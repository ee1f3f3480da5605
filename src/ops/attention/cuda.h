// Causal GQA softmax attention over packed sequences on the GPU (math of attention.h), a simple
// flash-attention-style kernel: bf16 in/out, fp32 softmax statistics; backward in two deterministic passes
// (dk/dv per key block over its queries, dq per query block over its keys), no atomics.
#pragma once
#include <cuda_runtime.h>

#include "core/cuda/cuda_utils.h"
#include "ops/attention/attention.h"

namespace ds::ops::cuda {

// q, o: bf16 [N, Hq, hd]; k, v: bf16 [N, Hkv, hd]; cu_seqlens: int32 device [num_seqs + 1]; lse: fp32 [N, Hq].
// head_dim up to 256. max_seqlen = longest sequence (host-known).
void attention_forward(const ds::ops::AttnDims& d, const ds::cuda::bf16* q, const ds::cuda::bf16* k,
                       const ds::cuda::bf16* v, const int32_t* cu_seqlens, int64_t max_seqlen, ds::cuda::bf16* o,
                       float* lse, cudaStream_t stream);
size_t attention_scratch_bytes(const ds::ops::AttnDims& d);
// dq: [N, Hq, hd]; dk, dv: [N, Hkv, hd] (bf16, overwritten).
void attention_backward(const ds::ops::AttnDims& d, const ds::cuda::bf16* q, const ds::cuda::bf16* k,
                        const ds::cuda::bf16* v, const ds::cuda::bf16* o, const float* lse, const ds::cuda::bf16* dout,
                        const int32_t* cu_seqlens, int64_t max_seqlen, ds::cuda::bf16* dq, ds::cuda::bf16* dk,
                        ds::cuda::bf16* dv, void* scratch, cudaStream_t stream);

}  // namespace ds::ops::cuda
