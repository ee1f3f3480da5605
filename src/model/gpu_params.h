// The GPU engine's parameter store: the fp32 master weights, their bf16 compute copy and the fp32 gradients, flat
// in ParamSpec order (offsets as the host model's), with typed per-layer views (model/params.h).
//
// layer_params(i) is where a sharded store (ZeRO-3) will gather layer i's compute weights before the layer runs,
// and after_layer_backward(i) where it will reduce-scatter layer i's gradients; on one GPU the first returns views
// of the resident buffers and the second does nothing. The decoder only reaches weights through them.
#pragma once
#ifdef DELTASTACK_CUDA
#include <cuda_runtime.h>

#include <cstdint>

#include "core/cuda/cuda_utils.h"
#include "model/gpu_memory.h"
#include "model/params.h"

namespace ds {

class GpuParamStore {
 public:
  using bf16 = ds::cuda::bf16;
  GpuParamStore(const ParamLayout& layout, int64_t num_params) : layout_(layout), P_(num_params) {}

  // master fp32 [P], grads fp32 [P], compute bf16 [P], and the grad-norm reduction scratch.
  void reserve(Arena& a);

  struct Layer {
    LayerParams<const bf16*> compute;  // GEMM operands
    LayerParams<const float*> master;  // norm weights, conv taps, A_log, dt_bias (read in fp32)
    LayerParams<float*> grad;          // accumulated (+=) by the backward
  };
  struct Model {
    ModelParams<const bf16*> compute;
    ModelParams<const float*> master;
    ModelParams<float*> grad;
  };
  Layer layer_params(int64_t i) const;
  void after_layer_backward(int64_t /*i*/, cudaStream_t /*stream*/) {}
  Model model_params() const;

  int64_t size() const { return P_; }
  float* master() const { return w_; }
  float* grads() const { return g_; }
  bf16* compute() const { return wb_; }

  void upload(const float* host, cudaStream_t stream);  // master <- host [P], then the bf16 copy
  void zero_grads(cudaStream_t stream);
  // Sum of squares of the gradients in double, fixed reduction order (bitwise reproducible); synchronises.
  double grad_sum_squares(cudaStream_t stream);

 private:
  const ParamLayout& layout_;
  int64_t P_;
  float *w_ = nullptr, *g_ = nullptr;
  bf16* wb_ = nullptr;
  double* sumsq_ = nullptr;
  void* sumsq_scratch_ = nullptr;
};

}  // namespace ds
#endif
