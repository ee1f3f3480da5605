// The CUDA engine's memory plan, computed on the host: the engine lays its one allocation out with
// lay_out_gpu_memory, and `deltastack plan` runs the same function in a sizing pass without a device
// (plan_gpu_memory), so the planner and the engine agree by construction.
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "model/config.h"
#include "model/engine.h"
#include "model/gpu_memory.h"
#ifdef DELTASTACK_CUDA
#include "ops/attention/plan.h"
#include "ops/conv1d/plan.h"
#include "ops/gated_delta_rule/plan.h"
#include "ops/linear_cross_entropy/plan.h"
#endif

namespace ds {

class GpuParamStore;
class GpuOptimizer;
class GpuLora;
struct GpuActivations;

// What the op plans reserve (from the plans themselves in the engine, from their size functions in the planner).
struct GpuOpSizes {
  size_t gdn_saved = 0, gdn_batch = 0, gdn_workspace = 0;  // per GDN layer / per micro-batch / shared
  size_t attn_batch = 0, attn_workspace = 0;              // per micro-batch / shared
  size_t conv_workspace = 0;                              // shared
  size_t ce_workspace = 0;                                // the fused loss's own scratch
};

#ifdef DELTASTACK_CUDA
// The op plans' limits for config c and batches of `plan` (one definition for the engine and the planner).
// max_seqlen 0 -> max_tokens; a LoRA plan (plan.lora.r > 0): optimizer_state Bf16 (the frozen base's layout) and
// gradients Fp32 (the adapters' flat buffer), ds::Error for --gradients in-backward or --shard optimizer with LoRA.
GpuPlan resolved(GpuPlan plan);
ops::cuda::GdnLimits gdn_limits(const ModelConfig& c, const GpuPlan& plan);
ops::cuda::AttnLimits attn_limits(const ModelConfig& c, const GpuPlan& plan);
ops::cuda::Conv1dPlan conv_plan(const ModelConfig& c, const GpuPlan& plan);
ops::cuda::LinearCrossEntropyPlan ce_plan(const ModelConfig& c, const GpuPlan& plan);

// The engine's whole layout in one pass over `a` (a sizing pass when a.base is null): parameter store, optimizer,
// activations and every scratch buffer, in a fixed order, each counted under its MemoryUse. A LoRA plan: no base
// optimizer (null) and the adapters (model/gpu_lora.h); otherwise lora is null.
void lay_out_gpu_memory(Arena& a, const ModelConfig& c, const GpuPlan& plan, GpuParamStore& store,
                        GpuOptimizer* optimizer, GpuLora* lora, GpuActivations& acts, const GpuOpSizes& ops);
#endif

// Device memory the CUDA runtime, cuBLASLt and cuDNN hold beside the engine's allocation (measured on the H200,
// CUDA 13.0, cuDNN 9.19: process peak minus the allocation, 0.52-0.57 GiB at 0.8B and 2B).
constexpr size_t kCudaContextBytes = size_t{590} << 20;
// The engine's margin: an allocation fits when allocation + kAllocationSlack < the free bytes.
constexpr size_t kAllocationSlack = size_t{512} << 20;

// The free device bytes the engine plans against: `free`, or with a limit (GpuPlan::memory_limit > 0, as `plan
// --device-memory`: the allocation plus the context within it) at most what the limit leaves after the context,
// plus the slack the fit check keeps spare.
inline size_t plannable_free_bytes(size_t free, size_t memory_limit) {
  if (memory_limit == 0) return free;
  const size_t room = memory_limit > kCudaContextBytes ? memory_limit - kCudaContextBytes : 0;
  return room + kAllocationSlack < free ? room + kAllocationSlack : free;
}

struct GpuMemoryPlan {
  std::array<size_t, static_cast<size_t>(MemoryUse::kCount)> by_use{};
  size_t allocation = 0;  // the engine's one cudaMalloc
  size_t total = 0;       // allocation + kCudaContextBytes
  std::string gated_delta_rule, attention;  // the kernels the plan assumes
};

// The plan of `deltastack train --device cuda` for config c and batches of `plan`, without a device: the chunked
// gated delta rule where it takes the shapes (head dim 128), else the simple one; cuDNN attention (its workspace
// estimated from its length buckets: 1.125 x the largest bucket's B·Hq·S²·2-byte dP, as cuDNN 9.19 measured on the
// H200) unless attention = "simple". ds::Error in a build without CUDA support.
// plan's optimizer_state, recompute and gradients must be resolved (not Auto): ds::Error otherwise.
GpuMemoryPlan plan_gpu_memory(const ModelConfig& c, const GpuPlan& plan, const std::string& attention = "cudnn");

// The memory modes `auto` chooses among, in the order tried, cheapest first (docs/memory.md): the (optimizer state,
// recompute) pairs fp32 with none, then selective, then mlp recompute (all bitwise the results of any policy), bf16
// with none, selective, mlp, 8bit with none, selective, mlp, then full recompute with fp32, bf16, 8bit (full costs
// one more forward per step, +25-33 %); each with the fp32 gradient buffer, and without a norm pass (norm_pass false)
// the in-backward gradients right after it (the same speed, bitwise the same step); with a norm pass (+85 %, measured
// at 9B) the in-backward gradients after all of those, in the same pair order. Never the bf16 gradients (lossy,
// opt-in): with g = Bf16 given, the pairs in the same order with them. A mode that is not Auto keeps its value.
struct MemoryModes {
  OptimizerState state;
  Recompute recompute;
  Gradients gradients;
  bool operator==(const MemoryModes&) const = default;
};
std::vector<MemoryModes> memory_candidates(OptimizerState s, Recompute r, Gradients g = Gradients::Fp32,
                                           bool norm_pass = true);
// plan with its Auto modes replaced by the first candidate whose plan `fits` (the last, leanest one when none
// does: the caller reports what it needs). Modes already given are kept. With --recompute auto, a selective, mlp or
// full candidate first takes the most kept_layers (1 .. layers - 1) that fit: those layers run at none's speed; and
// when no candidate fits, full recompute with offload_activations (the layer inputs in pinned host memory) is tried
// last, with its own kept layers (returned even when it does not fit either: the leanest plan). GpuPlan::layer_slots
// 0 is resolved too: DELTASTACK_LAYER_SLOTS when set; else, when the modes come out in-backward, 3 if the plan with
// three slots resolves to the same modes (state, gradients, recompute policy, offload), with at most two kept, gate|up
// or mlp layers fewer, and fits; else 2.
// The recompute policy as logs and `plan` name it: "selective", or "selective, the first 21 of 32 layers keeping
// their activations" (GpuPlan::kept_layers).
std::string recompute_label(const GpuPlan& plan, int64_t layers);
// The pinned host bytes of GpuPlan::offload_activations: the layer inputs that leave the device, all but the last
// kOffloadRing of the L (offloaded_layers), max_tokens x hidden_size bf16 each (0 without it).
int64_t offloaded_layers(const ModelConfig& c, const GpuPlan& plan);
size_t offload_host_bytes(const ModelConfig& c, const GpuPlan& plan);
GpuPlan resolve_memory_modes(const ModelConfig& c, GpuPlan plan, const std::function<bool(const GpuMemoryPlan&)>& fits,
                             const std::string& attention = "cudnn");

}  // namespace ds
