// The Qwen3.5 model on one CUDA GPU (the "cuda" engine of model/engine.h): bf16 activations and compute weights,
// fp32 gradients, and fp32 or bf16 master weights and fp32, bf16 or 8-bit AdamW moments (OptimizerState; numerics:
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
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "model/engine.h"
#include "model/model.h"
#include "ops/adamw/adamw.h"

namespace ds {
namespace cuda {
class StepProfiler;
}

// How many times, in this process, a GPU engine updated the embedding's early chunks (the in-backward update split,
// model/gpu_model.cpp split_embed): for tests, which check the split ran. 0 without CUDA.
int64_t embedding_update_splits();

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
  // Engine::last_logits: the forward alone (embedding, layers, final norm; no loss, no backward, the gradients
  // untouched) and one row of the lm_head GEMM (bf16 inputs, fp32 accumulate and output) for the batch's last
  // position, written into the fused loss's scratch (it holds at least one chunk row of V fp32 logits), then
  // copied to the host: fp32 [vocab_size]. Nothing is allocated. ds::Error as forward_backward for a batch
  // outside the plan or the model; an empty batch is an error.
  std::vector<float> last_logits(const PackedBatch& batch);
  // Zeroes the gradients (and restarts Gradients::Bf16's micro-batch count).
  void zero_grads();
  // Engine::begin_step: the step that keys Gradients::Bf16's stochastic rounding (model/engine.h).
  void begin_step(int64_t step);
  // Deterministic: each unit's sum (model.h param_units) added in unit order; Gradients::InBackward: the sums the
  // last backward took.
  double grad_sum_squares();
  // Gradients::InBackward (GpuPlan::gradients; model/engine.h): arms the next forward_backward's backward to take
  // each unit's sum of squares and, with `update`, to run the unit's AdamW update (`*update`, its grad_scale the
  // clip factor, decay per ParamSpec) on a side stream as soon as the unit's gradients are final, its slot then
  // reused (model/gpu_params.h). The next forward waits for each unit's update where it reads that unit. ds::Error
  // in the fp32 mode.
  void arm_in_backward(const ops::AdamWParams* update);
  Gradients gradients() const;
  // One AdamW update of every parameter (decay per ParamSpec::weight_decay), refreshing the bf16 copy. With
  // set_async_optimizer(true) (and no profiler) it returns at once: the update runs on a side stream unit by unit
  // (model/model.h param_units, in the forward's order), each unit's gradients zeroed after it, and the next
  // forward waits for each unit's update only where it reads that unit's weights, so the update overlaps the host
  // work between steps and the next step's first layers; every other reader of the weights, gradients or state
  // waits for all of it. The same bits either way (the same kernels on the same data, in another stream).
  void adamw_step(const ops::AdamWParams& p, double weight_decay);
  void set_async_optimizer(bool on);
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
  // Data parallelism's gradient sum overlapped with the backward: during the next forward_backward with a
  // backward (the step's last micro-batch), as soon as the gradients of a unit (model/model.h param_units: the head
  // first, then the layers L-1 .. 0, the embedding last) are complete on the step's stream, `reduce` is called with
  // them (x [n] fp32, device) and a side stream (a cudaStream_t) that waits for them: it enqueues the all-reduce
  // there, and the next layers' backward runs meanwhile. join_reduce() makes the step's stream wait for every
  // reduce so issued (true) or does nothing when none was (false). The units tile the gradient buffer, each handed
  // over once, after its last write.
  void reduce_grads_during_next_backward(std::function<void(float* x, int64_t n, void* stream)> reduce);
  bool join_reduce();
  // --shard optimizer (GpuPlan::shard_world > 0; model/gpu_params.h ParamShard): the flat device buffers that the
  // engine reduce-scatters and all-gathers over the ranks, and this rank's share of them. grads fp32 [padded];
  // compute bf16 [padded]; master fp32 (master_flat: [padded], flat like the others; else the bf16 layout's
  // compacted small parameters, rank r's part at master_ranges[r]); share = padded / world; [lo, hi) this rank's
  // flat range.
  struct ShardBuffers {
    float* grads = nullptr;
    void* compute = nullptr;
    float* master = nullptr;
    bool master_flat = true;
    int world = 0;  // the plan's shard_world (0: planned unsharded)
    int64_t padded = 0, share = 0, lo = 0, hi = 0;
    std::vector<std::pair<int64_t, int64_t>> master_ranges;
    void* stream = nullptr;
  };
  ShardBuffers shard_buffers();
  // The sum of squares of the gradients of this rank's share [lo, hi) (the whole buffer unsharded), in double.
  double share_grad_sum_squares();
  // A sharded optimizer state made whole on rank 0's host, for a checkpoint: every rank calls this with the same
  // `broadcast` (bytes at a device pointer from rank root to every rank, enqueued on the step's stream: the
  // communicator's); rank 0 gets (*out)[which] = state tensor `which` over all P flat elements (fp32), the others
  // nothing. Each rank's part travels through a 16 MiB device buffer allocated for the call (not in the step).
  void gather_optimizer_state(const std::function<void(void* p, int64_t bytes, int root)>& broadcast, int rank,
                              std::vector<std::vector<float>>* out);

  // The optimizer's state as checkpoint tensors (model/gpu_optimizer.h): `count` state tensors per parameter,
  // their names, and slab copies (fp32, offsets as ParamSpec's).
  int optimizer_state_count() const;
  std::string optimizer_state_name(int which, const ParamSpec& p) const;
  void read_optimizer_state(int which, int64_t first, int64_t count, float* dst) const;
  void write_optimizer_state(int which, int64_t first, int64_t count, const float* src);
  // The 8bit state as checkpoints store it (model/engine.h moment_scale_name; unsharded): whether parameter k's
  // moments are 8-bit codes, their codes (flat offsets as ParamSpec's, inside one parameter) and parameter k's
  // block scales [first_block, first_block + count); and the same two written (a resume: bitwise, no re-quantization).
  bool optimizer_codes_8bit(size_t k) const;
  void read_optimizer_codes(int which, int64_t first, int64_t count, uint8_t* dst) const;
  void read_optimizer_block_scales(int which, size_t k, int64_t first_block, int64_t count, float* dst) const;
  void write_optimizer_codes(int which, int64_t first, int64_t count, const uint8_t* src);
  void write_optimizer_block_scales(int which, size_t k, int64_t first_block, int64_t count, const float* src);

  // A LoRA run (the host model had an adapter, Qwen35Model::set_adapter; docs/lora.md, model/gpu_lora.h): the base
  // frozen in bf16, the adapters trained. adapter(): the host adapter the engine was built with (its config; the
  // dropout key the trainer sets on it is read by each forward_backward with a backward; its values are those of
  // the build, not kept current: read_lora), null for a full run. zero_grads, grad_sum_squares, adamw_step and
  // device_grads then act on the adapters only.
  LoraAdapter* adapter() const;
  // The adapters' device buffers as fp32 slabs [first, first + count) of the host adapter's flat layout: the
  // masters, the gradients, the AdamW moments; a write of Values refreshes their bf16 copy. ds::Error without an
  // adapter or outside the buffer.
  enum class LoraBuffer { Values, Grads, ExpAvg, ExpAvgSq };
  void read_lora(LoraBuffer which, int64_t first, int64_t count, float* dst) const;
  void write_lora(LoraBuffer which, int64_t first, int64_t count, const float* src);

  size_t planned_bytes() const;  // the single device allocation
  OptimizerState optimizer_state() const;  // the modes in use (GpuPlan's, Auto resolved)
  Recompute recompute() const;
  std::string recompute_label() const;  // model/gpu_plan.h recompute_label of the plan in use
  Precision precision() const;  // the plan's, or bf16 where the FP8 backend failed its probe
  size_t peak_bytes() const;     // device memory in use by this process at its high point (cudaMemGetInfo)

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace ds
