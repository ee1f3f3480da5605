// Causal GQA attention on CUDA as an op plan: the engine reserves batch_bytes() and workspace_bytes(), calls
// prepare() once per micro-batch and forward/backward per attention layer, and never sees which kernel runs.
// Engines: cuDNN's fused SDPA (ops/attention/cudnn.h; length buckets, deterministic backward) when the op registry
// selects it for "cuda" (DELTASTACK_ATTENTION) and its graphs build, else the simple kernel (ops/attention/cuda.h).
// A batch with more short documents than cuDNN's buckets hold runs on the simple kernel (one warning per plan).
// Layouts: q, o, dq: bf16 [N, Hq, hd]; k, v, dk, dv: bf16 [N, Hkv, hd]; lse: fp32 [N, Hq] (natural log).
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "core/cuda/cuda_utils.h"
#include "ops/attention/attention.h"
#include "ops/attention/cudnn.h"

namespace ds::ops::cuda {

// The plan's limits are cuDNN's bounds (ops/attention/cudnn.h): tokens, documents, the longest document (it sizes
// cuDNN's length buckets), heads, head_dim, the softmax scale and the window count `rows` (0: any packing).
using AttnLimits = ops::cudnn::AttnBounds;

class AttentionPlan {
 public:
  // Builds the cuDNN graphs when the registry selects cuDNN (a failure to build logs one warning and keeps the
  // simple kernel). ds::Error for invalid limits.
  explicit AttentionPlan(const AttnLimits& limits);
  ~AttentionPlan();
  AttentionPlan(const AttentionPlan&) = delete;
  AttentionPlan& operator=(const AttentionPlan&) = delete;

  std::string name() const;        // "cudnn (fused SDPA)" | "cuda-simple"
  size_t batch_bytes() const;      // device metadata of one micro-batch (cuDNN's lengths and offsets)
  size_t workspace_bytes() const;  // scratch of one forward or backward call
  // Gives up cuDNN (its deterministic backward keeps an S^2 workspace) for the simple kernel, e.g. when the memory
  // plan does not fit; false when already on the simple kernel.
  bool drop_to_simple();

  // cu_host / cu_dev: the batch's cu_seqlens on the host and on the device (int32 [num_seqs + 1]), both alive until
  // the next prepare; batch: batch_bytes() of device memory. ds::Error when a document is longer than max_seqlen.
  void prepare(const int32_t* cu_host, const int32_t* cu_dev, int64_t N, int64_t num_seqs, void* batch,
               cudaStream_t stream);
  void forward(const ds::cuda::bf16* q, const ds::cuda::bf16* k, const ds::cuda::bf16* v, ds::cuda::bf16* o,
               float* lse, void* workspace, cudaStream_t stream);
  void backward(const ds::cuda::bf16* q, const ds::cuda::bf16* k, const ds::cuda::bf16* v, const ds::cuda::bf16* o,
                const float* lse, const ds::cuda::bf16* dout, ds::cuda::bf16* dq, ds::cuda::bf16* dk,
                ds::cuda::bf16* dv, void* workspace, cudaStream_t stream);

 private:
  AttnDims dims(int64_t N, int64_t S) const;
  AttnLimits l_;
  std::unique_ptr<ops::cudnn::Attention> cudnn_;
  bool cudnn_batch_ = false, warned_ = false;
  int64_t N_ = 0, num_seqs_ = 0, max_seqlen_ = 0;
  const int32_t* cu_ = nullptr;
};

}  // namespace ds::ops::cuda
