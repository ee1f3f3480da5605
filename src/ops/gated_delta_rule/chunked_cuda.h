// Chunked (C = 64) gated delta rule on Hopper with bf16 tensor-core MMAs (mma.sync m16n8k16), forward and
// backward, exact (no approximation) and deterministic (no atomics). Math of gated_delta_rule.h, layouts of
// cuda.h; the kernel design and the bytes it keeps are described at the top of chunked.cu.
//
// Use:
//   GdnChunkedPlan plan = gdn_chunked_plan(max_tokens, max_seqs, Hk, Hv, dk, dv);   // once
//   buffers: index (plan.index_bytes(), one per micro-batch, shared by all layers), saved (plan.saved_bytes(),
//            per layer, kept from forward to backward), workspace (plan.workspace_bytes(), shared scratch)
//   gdn_chunked_prepare(plan, cu_seqlens, num_seqs, N, index, stream)   // device-side chunk table, no host sync
//   gdn_chunked_forward(...); ... gdn_chunked_backward(...)
//
// Limits: dk = dv = 128; Hv a multiple of Hk; N <= max_tokens < 2^31, num_seqs <= max_seqs < 2^28; q, k, v, do
// 16-byte aligned and v_stride a multiple of 8 elements; o, dq, dk, dv 4-byte aligned and dv_stride even;
// g <= 0 (log decay). Other arguments: ds::Error from the launcher.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "core/cuda/cuda_utils.h"
#include "ops/gated_delta_rule/gated_delta_rule.h"

namespace ds::ops::cuda {

struct GdnChunkedPlan {
  int64_t max_tokens = 0, max_seqs = 0, Hk = 0, Hv = 0, dk = 0, dv = 0;
  int64_t max_chunks = 0;  // ceil(max_tokens / 64) + max_seqs: an upper bound on the chunks of any batch
  // int32 chunk table written by gdn_chunked_prepare.
  size_t index_bytes() const;
  // Kept from forward to backward: the bf16 state at the start of every chunk [max_chunks, Hv, dk, dv] (32 KiB per
  // chunk and value head), T = (I + A)^{-1} bf16 [max_chunks, Hv, 64, 64] (8 KiB) and the in-chunk cumulative gates
  // fp32 [max_tokens, Hv].
  size_t saved_bytes() const;
  // Scratch used by forward and by backward (need not survive between them).
  size_t workspace_bytes() const;
};

GdnChunkedPlan gdn_chunked_plan(int64_t max_tokens, int64_t max_seqs, int64_t Hk, int64_t Hv, int64_t dk, int64_t dv);

// cu_seqlens: int32 device [num_seqs + 1], 0 .. N, non-decreasing (empty sequences allowed).
void gdn_chunked_prepare(const GdnChunkedPlan& plan, const int32_t* cu_seqlens, int64_t num_seqs, int64_t N,
                         void* index, cudaStream_t stream);

// d: N, num_seqs, Hk, Hv, dk, dv, scale (chunk_size is ignored: always 64).
// q, k: bf16 [N, Hk, dk]; v: bf16 rows of v_stride elements (head h at v + t*v_stride + h*dv); g, beta: fp32 [N, Hv];
// initial_state: fp32 [num_seqs, Hv, dk, dv] or null (zero); o: bf16 [N, Hv, dv]; final_state: fp32 or null.
void gdn_chunked_forward(const GdnChunkedPlan& plan, const ds::ops::GdnDims& d, const void* index,
                         const ds::cuda::bf16* q, const ds::cuda::bf16* k, const ds::cuda::bf16* v, int64_t v_stride,
                         const float* g, const float* beta, const float* initial_state, ds::cuda::bf16* o,
                         float* final_state, void* saved, void* workspace, cudaStream_t stream);

// Inputs as forward plus saved (from the forward on the same inputs), dout bf16 [N, Hv, dv], dfinal_state fp32 or
// null (zero). Outputs (all overwritten): dq, dk bf16 [N, Hk, dk] (summed over the Hv/Hk value heads of a k-head
// in increasing head order); dv bf16 rows of dv_stride; dg, dbeta fp32 [N, Hv]; dinitial_state fp32
// [num_seqs, Hv, dk, dv] or null (not wanted).
void gdn_chunked_backward(const GdnChunkedPlan& plan, const ds::ops::GdnDims& d, const void* index,
                          const ds::cuda::bf16* q, const ds::cuda::bf16* k, const ds::cuda::bf16* v, int64_t v_stride,
                          const float* g, const float* beta, const void* saved, const ds::cuda::bf16* dout,
                          const float* dfinal_state, ds::cuda::bf16* dq, ds::cuda::bf16* dk, ds::cuda::bf16* dv,
                          int64_t dv_stride, float* dg, float* dbeta, float* dinitial_state, void* workspace,
                          cudaStream_t stream);

// Per-phase launchers for timing (same arguments as above); each phase needs the earlier ones of its direction.
enum class GdnPhase { kPrep, kFwdH, kFwdO, kBwdPrep, kBwdDvLocal, kBwdDh, kBwdChunk };
void gdn_chunked_run_phase(GdnPhase phase, const GdnChunkedPlan& plan, const ds::ops::GdnDims& d, const void* index,
                           const ds::cuda::bf16* q, const ds::cuda::bf16* k, const ds::cuda::bf16* v,
                           int64_t v_stride, const float* g, const float* beta, const float* initial_state,
                           ds::cuda::bf16* o, float* final_state, void* saved, const ds::cuda::bf16* dout,
                           const float* dfinal_state, ds::cuda::bf16* dq, ds::cuda::bf16* dk, ds::cuda::bf16* dv,
                           int64_t dv_stride, float* dg, float* dbeta, float* dinitial_state, void* workspace,
                           cudaStream_t stream);

// Testing knob: scan kernels' value-column tile (16: the forward scan's, the backward's 32; 32 or 64; 0 = automatic).
void gdn_chunked_set_scan_bv(int bv);
// Testing knob: the scans' cp.async ring at BV 32 (2 or 3 stages; 0 = automatic: 2).
void gdn_chunked_set_scan_stages(int stages);

}  // namespace ds::ops::cuda
