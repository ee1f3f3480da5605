// Gated delta rule on the GPU (math of gated_delta_rule.h), a simple exact version: one block per (sequence,
// value head) walks the tokens with the fp32 state [dk, dv] on chip, saving the state at every chunk start
// for the backward, which replays each chunk from its saved state and runs the reverse-time recurrence
// (docs/model.md §4). Deterministic (GVA dq/dk summed over value heads in fixed order).
#pragma once
#include <cuda_runtime.h>

#include "core/cuda/cuda_utils.h"
#include "ops/gated_delta_rule/gated_delta_rule.h"

namespace ds::ops::cuda {

// Chunks per sequence s: ceil(len_s / chunk_size); chunk_offsets: int32 device [num_seqs + 1] prefix sums of
// those counts (host-built), total_chunks = chunk_offsets[num_seqs].
// q, k: bf16 [N, Hk, dk] (l2-normalised); v: bf16 rows of v_stride elements, value head h at v + t*v_stride +
// h*dv; g, beta: fp32 [N, Hv]; o: bf16 [N, Hv, dv]; states: fp32 [total_chunks, Hv, dk, dv] (out: state at
// the start of each chunk). dk, dv up to 128.
void gated_delta_rule_forward(const ds::ops::GdnDims& d, const ds::cuda::bf16* q, const ds::cuda::bf16* k,
                              const ds::cuda::bf16* v, int64_t v_stride, const float* g, const float* beta,
                              const int32_t* cu_seqlens, const int32_t* chunk_offsets, int64_t total_chunks,
                              ds::cuda::bf16* o, float* states, cudaStream_t stream);
size_t gated_delta_rule_scratch_bytes(const ds::ops::GdnDims& d, int64_t total_chunks);
// dq, dk: bf16 [N, Hk, dk]; dv: bf16 written with dv_stride like v; dg, dbeta: fp32 [N, Hv]. All overwritten.
void gated_delta_rule_backward(const ds::ops::GdnDims& d, const ds::cuda::bf16* q, const ds::cuda::bf16* k,
                               const ds::cuda::bf16* v, int64_t v_stride, const float* g, const float* beta,
                               const int32_t* cu_seqlens, const int32_t* chunk_offsets, int64_t total_chunks,
                               const float* states, const ds::cuda::bf16* dout, ds::cuda::bf16* dq,
                               ds::cuda::bf16* dk, ds::cuda::bf16* dv, int64_t dv_stride, float* dg, float* dbeta,
                               void* scratch, cudaStream_t stream);

}  // namespace ds::ops::cuda
