// The causal depthwise conv1d + SiLU on CUDA (ops/conv1d/cuda.h) as an op plan: its backward's scratch is sized once
// for the largest micro-batch. x, y, dy, dx: bf16 [N, C]; w: fp32 [C, K]; dw: fp32 [C, K] accumulated; seq_start:
// int32 [N], the first token of each token's document (taps before it read zero).
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "core/cuda/cuda_utils.h"
#include "ops/conv1d/cuda.h"

namespace ds::ops::cuda {

class Conv1dPlan {
 public:
  Conv1dPlan(int64_t max_tokens, int64_t channels, int64_t kernel) : max_tokens_(max_tokens), C_(channels), K_(kernel) {}
  size_t workspace_bytes() const { return conv1d_scratch_bytes(max_tokens_, C_, K_); }
  void forward(const ds::cuda::bf16* x, const float* w, const int32_t* seq_start, ds::cuda::bf16* y, int64_t N,
               cudaStream_t stream) const {
    DS_CUDA_REQUIRE(N >= 0 && N <= max_tokens_, "conv1d plan: more tokens than the plan holds");
    conv1d_silu_forward(x, w, seq_start, y, N, C_, K_, stream);
  }
  void backward(const ds::cuda::bf16* x, const float* w, const ds::cuda::bf16* dy, const int32_t* seq_start,
                ds::cuda::bf16* dx, float* dw, int64_t N, void* workspace, cudaStream_t stream,
                float* amax = nullptr) const {
    DS_CUDA_REQUIRE(N >= 0 && N <= max_tokens_, "conv1d plan: more tokens than the plan holds");
    conv1d_silu_backward(x, w, dy, seq_start, dx, dw, N, C_, K_, workspace, stream, amax);
  }

 private:
  int64_t max_tokens_, C_, K_;
};

}  // namespace ds::ops::cuda
