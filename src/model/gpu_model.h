// The Qwen3.5 model on one CUDA GPU (the "cuda" engine of model/engine.h): bf16 activations and compute weights,
// fp32 gradients, and fp32 or bf16 master weights and AdamW moments (OptimizerState; numerics:
// docs/cuda_backend.md, memory modes: docs/memory.md). Its parts:
//   - the parameter store (model/gpu_params.h): master / compute / gradient buffers and typed per-layer views;
//   - the optimizer (model/gpu_optimizer.h): its state layout, update and checkpoint tensors;
//   - the activation plan (model/gpu_activations.h): the memory layout of one step;
//   - the op plans (ops/gated_delta_rule/plan.h, ops/attention/plan.h): kernels chosen by the op registry, their
//     saved state and workspace;
//   - the decoder (gpu_model.cpp): layer forward/backward over those.
// Every device buffer comes from one allocation planned up front from GpuPlan (model/gpu_memory.h): nothing is
// allocated in the step loop. Parameter layout and names are the host Qwen35Model's, so checkpoints move both ways.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "model/engine.h"
#include "model/model.h"
#include "ops/adamw/adamw.h"

namespace ds {
namespace cuda {
class StepProfiler;
}

class GpuModel {
 public:
  // Allocates the whole plan and uploads the host model's weights one parameter at a time (host.fill_param: a
  // deferred model, Qwen35Model::Deferred, never holds them all on the host). Throws ds::Error if CUDA is unavailable or
  // the plan does not fit in device memory (the message gives the bytes needed).
  GpuModel(const Qwen35Model& host, const GpuPlan& plan);
  ~GpuModel();
  GpuModel(const GpuModel&) = delete;
  GpuModel& operator=(const GpuModel&) = delete;

  // As Qwen35Model::forward_backward: gradients of grad_scale * loss_sum are ADDED to the device gradients.
  LossResult forward_backward(const PackedBatch& batch, double grad_scale, double z_loss = 0.0,
                              ForwardCapture* capture = nullptr);
  void zero_grads();
  double grad_sum_squares();  // deterministic
  // One AdamW update of every parameter (decay per ParamSpec::weight_decay), refreshing the bf16 copy.
  void adamw_step(const ops::AdamWParams& p, double weight_decay);
  // Timed scopes around every op of the step, zero_grads, grad_sum_squares and adamw_step, by family and role
  // (core/cuda/profile.h; `bench step --profile`); null (the default) turns them off. Results are unchanged.
  void set_profiler(cuda::StepProfiler* prof);

  // Device -> host copy of elements [first, first + count) of the fp32 weights or gradients (offsets as
  // ParamSpec's), for checkpoints (streamed in slabs) and tests. ds::Error when the range is outside the buffer.
  enum class Buffer { Weights, Grads };
  void read(Buffer which, int64_t first, int64_t count, float* dst) const;
  void download_grads(std::vector<float>& out) const;  // the whole gradient buffer (tests)
  // The fp32 gradient buffer on the device ([P] elements, offsets as ParamSpec's) and the stream every op of the
  // step runs on (a cudaStream_t): what data parallelism reduces over the ranks (dist/communicator.h).
  struct DeviceGrads {
    float* data;
    int64_t count;
    void* stream;
  };
  DeviceGrads device_grads();

  // The optimizer's state as checkpoint tensors (model/gpu_optimizer.h): `count` state tensors per parameter,
  // their names, and slab copies (fp32, offsets as ParamSpec's).
  int optimizer_state_count() const;
  std::string optimizer_state_name(int which, const ParamSpec& p) const;
  void read_optimizer_state(int which, int64_t first, int64_t count, float* dst) const;
  void write_optimizer_state(int which, int64_t first, int64_t count, const float* src);

  size_t planned_bytes() const;  // the single device allocation
  OptimizerState optimizer_state() const;  // the modes in use (GpuPlan's, Auto resolved)
  Recompute recompute() const;
  size_t peak_bytes() const;     // device memory in use by this process at its high point (cudaMemGetInfo)

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace ds
