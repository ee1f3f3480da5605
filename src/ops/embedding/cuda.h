// CUDA embedding lookup and deterministic scatter-add backward; math of embedding.h.
#pragma once
#include <cuda_runtime.h>

#include "core/cuda/cuda_utils.h"

namespace ds::ops::cuda {

// ids: int32 [N] (device); table: bf16 [V, H]; out: bf16 [N, H]. Ids are validated on the host beforehand.
void embedding_forward(const int32_t* ids, const ds::cuda::bf16* table, ds::cuda::bf16* out, int64_t N, int64_t H,
                       cudaStream_t stream);
// Deterministic backward over a host-built grouping of positions by id: uniq_ids [U], starts [U+1] (offsets into
// positions), positions [N] (token indices sorted by id, then by position). dtable: fp32 [V, H] accumulated.
void embedding_backward(const int32_t* uniq_ids, const int32_t* starts, const int32_t* positions, int64_t U,
                        const ds::cuda::bf16* dout, float* dtable, int64_t H, cudaStream_t stream);

}  // namespace ds::ops::cuda
