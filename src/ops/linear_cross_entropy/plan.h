// The fused linear + cross-entropy on CUDA (ops/linear_cross_entropy/cuda.h) as an op plan: its scratch is sized
// once for the largest micro-batch, and the chunk size is the plan's. h: bf16 [N, H]; W: bf16 [V, H]; targets:
// int32 [N] (-100 = ignore); loss: fp64 device [2]; dh: bf16 [N, H] or null; dW: fp32 [V, H] accumulated (or
// overwritten: LinearCeOptions::dW_overwrite) or null.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "core/cuda/cuda_utils.h"
#include "ops/linear_cross_entropy/cuda.h"
#include "ops/linear_cross_entropy/linear_cross_entropy.h"

namespace ds::ops::cuda {

class LinearCrossEntropyPlan {
 public:
  // fp8_grads: the lm head's gradient GEMMs in FP8 (LinearCeOptions::fp8_grads; `--fp8-lm-head`). head_grads
  // false: a frozen head (LoRA), run without dW only, whose scratch holds no casts for a weight gradient.
  LinearCrossEntropyPlan(int64_t max_tokens, int64_t hidden, int64_t vocab, int64_t chunk_tokens,
                         bool fp8_grads = false, bool head_grads = true)
      : max_tokens_(max_tokens), H_(hidden), V_(vocab), chunk_(chunk_tokens), fp8_(fp8_grads), head_grads_(head_grads) {}
  size_t workspace_bytes() const {
    return linear_cross_entropy_scratch_bytes(max_tokens_, H_, V_, chunk_, fp8_, head_grads_);
  }
  bool fp8_grads() const { return fp8_; }
  // The loss (and, with dh / dW, its gradients) of N <= max_tokens tokens; opt.chunk_tokens and opt.fp8_grads are
  // set to the plan's.
  void run(const ds::cuda::bf16* h, const ds::cuda::bf16* W, const int32_t* targets, int64_t N, LinearCeOptions opt,
           double* loss, ds::cuda::bf16* dh, float* dW, void* workspace, cudaStream_t stream) const {
    DS_CUDA_REQUIRE(N >= 0 && N <= max_tokens_, "linear_cross_entropy plan: more tokens than the plan holds");
    DS_CUDA_REQUIRE(!dW || head_grads_, "linear_cross_entropy plan: a dW for a plan made for a frozen head");
    opt.chunk_tokens = chunk_;
    opt.fp8_grads = fp8_;
    linear_cross_entropy(h, W, targets, N, H_, V_, opt, loss, dh, dW, workspace, stream);
  }

 private:
  int64_t max_tokens_, H_, V_, chunk_;
  bool fp8_, head_grads_;
};

}  // namespace ds::ops::cuda
