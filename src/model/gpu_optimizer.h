// The GPU engine's optimizer: its state layout and dtype, its update over the parameter store, and its own
// checkpoint tensors. Today one mode, AdamW with fp32 moments flat in ParamSpec order (exp_avg, exp_avg_sq);
// another state layout (bf16 or block-quantized moments) is another GpuOptimizer.
#pragma once
#ifdef DELTASTACK_CUDA
#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <vector>

#include "model/gpu_memory.h"
#include "model/gpu_params.h"
#include "ops/adamw/adamw.h"

namespace ds {

class GpuOptimizer {
 public:
  virtual ~GpuOptimizer() = default;
  virtual void reserve(Arena& a) = 0;
  virtual void zero_state(cudaStream_t stream) = 0;
  // One update of every parameter: p.weight_decay where the ParamSpec decays, p.grad_scale (the clip factor)
  // multiplies the gradients first; refreshes the store's bf16 compute copy.
  virtual void step(GpuParamStore& store, const ops::AdamWParams& p, cudaStream_t stream) = 0;
  // The state as checkpoint tensors: names (one per state tensor and parameter) and fp32 slab access.
  virtual int num_state_tensors() const = 0;                     // per parameter
  virtual std::string state_name(int which, const ParamSpec& p) const = 0;
  virtual void read_state(int which, int64_t first, int64_t count, float* dst, cudaStream_t stream) const = 0;
  virtual void write_state(int which, int64_t first, int64_t count, const float* src, cudaStream_t stream) = 0;
};

// AdamW (decoupled weight decay, bias-corrected; ops/adamw/adamw.h) with fp32 moments.
class GpuAdamW final : public GpuOptimizer {
 public:
  GpuAdamW(const std::vector<ParamSpec>& params, int64_t num_params) : params_(params), P_(num_params) {}
  void reserve(Arena& a) override;
  void zero_state(cudaStream_t stream) override;
  void step(GpuParamStore& store, const ops::AdamWParams& p, cudaStream_t stream) override;
  int num_state_tensors() const override { return 2; }
  std::string state_name(int which, const ParamSpec& p) const override {
    return (which == 0 ? "exp_avg." : "exp_avg_sq.") + p.name;
  }
  void read_state(int which, int64_t first, int64_t count, float* dst, cudaStream_t stream) const override;
  void write_state(int which, int64_t first, int64_t count, const float* src, cudaStream_t stream) override;

 private:
  float* buf(int which) const { return which == 0 ? m_ : v_; }
  const std::vector<ParamSpec>& params_;
  int64_t P_;
  float *m_ = nullptr, *v_ = nullptr;
};

}  // namespace ds
#endif
