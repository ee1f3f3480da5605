// The GPU engine's parameter store: the weights, their bf16 compute copy and the fp32 gradients, with typed
// per-layer views (model/params.h). Two layouts (OptimizerState, model/engine.h):
//   fp32: fp32 master [P] + bf16 compute copy [P] + fp32 gradients [P], flat in ParamSpec order;
//   bf16 (the bf16 and 8bit states): bf16 weights [P] (the GEMM weights' only copy) + fp32 gradients [P] + an
//         fp32 master of the small parameters only (!is_matrix: norms, conv taps, A_log, dt_bias), compacted in
//         ParamSpec order.
// The decoder reads GEMM weights from `compute` and the small parameters from `master` in both layouts (in the
// bf16 layout the master views of GEMM weights are nullptr).
//
// layer_params(i) is where a sharded store (ZeRO-3) will gather layer i's compute weights before the layer runs,
// and after_layer_backward(i) where it will reduce-scatter layer i's gradients; on one GPU the first returns views
// of the resident buffers and the second does nothing. The decoder only reaches weights through them.
#pragma once
#ifdef DELTASTACK_CUDA
#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <vector>

#include "core/cuda/cuda_utils.h"
#include "model/engine.h"
#include "model/gpu_fp8.h"
#include "model/gpu_memory.h"
#include "model/params.h"

namespace ds {

// This rank's share of the flat parameters under --shard optimizer (ZeRO-1; docs/distributed.md). The flat
// buffers (fp32 gradients, bf16 weights, the fp32 layout's master) are padded to P_pad, a multiple of
// world · share_align(state) elements, so every rank's share is S = P_pad / world elements, 256-byte aligned (and in
// the 8bit state a whole number of its 256-element quantization blocks, ops/adamw/q8_state.h), and NCCL's
// equal-count reduce-scatter and all-gather work in place on them. Rank r owns the flat range [lo, hi) = [r·S, min((r+1)·S, P))
// (a share may cut through a tensor). world 0 (not sharded) and world 1 own everything, P_pad = P for world 0.
struct ParamShard {
  int rank = 0, world = 0;
};

// Gradients::InBackward (model/engine.h): no flat gradient buffer. Each unit (model.h param_units) adds its
// gradients into a slot while its backward runs, and the slot is free again once the unit's update has read it:
//   slot 0: the embedding, and the untied head (its backward ends before the embedding's begins);
//   slot 1: the head when tied (it is final while the embedding, which holds lm_head, is still accumulating);
//   slots 2 .. 2 + n - 1: the layers in turn (layer i in 2 + i % n, n = the constructor's layer_slots: one accumulating, the others
//   being updated; the backward of layer i waits for the update of layer i + n, so n - 1 layers' backwards of slack
//   for the side stream's update; docs/gpu.md, ninth session).
// A unit's elements lie contiguous in its slot, starting at the unit's flat offset modulo 64 (so every gradient
// pointer has the flat buffer's alignment mod 256 bytes, and the GEMMs and sums see the same alignments as in the
// fp32 mode).
// Gradients::Bf16: the same slots, where each unit's gradients of one micro-batch are made, and one bf16 buffer
// [P_pad] of every parameter, flat, into which a final unit's slot is added with stochastic rounding
// (accumulate_unit); the optimizer and the sums of squares read that buffer.
// The layers' slots: the constructor's layer_slots (GpuPlan::layer_slots, model/engine.h gpu_layer_slots).
inline constexpr int kMaxGradSlots = 6;  // 2 + the most layer slots

class GpuParamStore {
 public:
  using bf16 = ds::cuda::bf16;
  // state: Fp32, Bf16 or EightBit (resolved; the last two have the same layout). params: the ParamSpec table (outlives
  // the store); units: param_units of the model (they tile [0, P)); gradients: the flat fp32 buffer, or the slots
  // above (and the bf16 buffer in Bf16; ds::Error with a shard).
  // frozen (a LoRA run's base, model/gpu_lora.h): the bf16 layout (state Bf16) with no gradient of the GEMM weights
  // (their gradient views are nullptr: the decoder skips their weight-gradient GEMMs, the loss and the embedding
  // their weight gradients) and, for the small parameters' gradients that the ops compute beside dx, one scratch of
  // the largest unit's small parameters that every unit's views share (written, never read). ds::Error with another
  // state, a shard or Gradients::InBackward.
  // fp8_units (a frozen base under --precision fp8, model/gpu_fp8.h fp8_stored_base): these GEMM weights are kept
  // as their E4M3 casts only (1 byte per element, cast at upload with the amax of their bf16 values; one unit may
  // span two tensors, gate_proj and up_proj), the bf16 copy holds the other parameters (compacted, each at its flat
  // offset's alignment mod 128 elements), and the compute views of the FP8-stored weights point at their codes: keys
  // for GpuFp8Linear's stored casts (fp8_codes), never bf16 values. Each unit must cover whole parameters; ds::Error
  // without frozen.
  GpuParamStore(const ParamLayout& layout, const std::vector<ParamSpec>& params, OptimizerState state,
                ParamShard shard = {}, std::vector<ParamUnit> units = {}, Gradients gradients = Gradients::Fp32,
                bool frozen = false, std::vector<Fp8WeightUnit> fp8_units = {}, int layer_slots = 2);

  // The buffers above and the grad-norm reduction scratch.
  void reserve(Arena& a);

  struct Layer {
    LayerParams<const bf16*> compute;  // GEMM operands
    LayerParams<const float*> master;  // norm weights, conv taps, A_log, dt_bias (read in fp32)
    LayerParams<float*> grad;          // made by the backward (model/gpu_model.cpp wgrad_overwrite: written or added)
  };
  struct Model {
    ModelParams<const bf16*> compute;
    ModelParams<const float*> master;
    ModelParams<float*> grad;
  };
  Layer layer_params(int64_t i) const;
  void after_layer_backward(int64_t /*i*/, cudaStream_t /*stream*/) {}
  Model model_params() const;

  OptimizerState state() const { return state_; }
  bool frozen() const { return frozen_; }
  int64_t size() const { return P_; }
  int64_t fp32_size() const { return P32_; }  // elements of the fp32 master (P in the fp32 layout)
  const std::vector<ParamSpec>& params() const { return params_; }
  // Parameter k's fp32 master (nullptr: its weights live in bf16 only), bf16 copy and gradients.
  float* master(size_t k) const { return fp32_offset_[k] < 0 ? nullptr : w_ + fp32_offset_[k]; }
  int64_t fp32_offset(size_t k) const { return fp32_offset_[k]; }  // -1: bf16 only
  // (An FP8-stored weight's compute(k) is its codes' address; see the constructor.)
  bf16* compute(size_t k) const;
  // The FP8-stored weights (empty: none): unit u's codes [rows, cols] E4M3 and its dequantization scale (a device
  // float, set by upload), and whether p points into the codes.
  const std::vector<Fp8WeightUnit>& fp8_units() const { return f8units_; }
  const uint8_t* fp8_codes(size_t u) const { return w8_ + w8_at_[u]; }
  const float* fp8_scale(size_t u) const { return w8_f_ + (2 * u + 1) * ops::cuda::kFp8Slot; }
  // Every unit with its codes and scale, as GpuFp8Linear::use_stored_weights takes them.
  std::vector<GpuFp8Linear::StoredWeight> fp8_stored_weights() const;
  bool holds_fp8(const void* p) const {
    const auto* b = static_cast<const uint8_t*>(p);
    return w8_ && b >= w8_ && b < w8_ + W8_;
  }
  size_t fp8_bytes() const { return static_cast<size_t>(W8_); }
  float* grads() const { return g_; }  // the flat buffer [P_pad] (Gradients::Fp32); the slots in InBackward, Bf16
  float* grad(size_t k) const { return g_ + grad_at(params_[k].offset); }  // parameter k's gradients
  Gradients gradients() const { return gradients_; }
  const std::vector<ParamUnit>& units() const { return units_; }
  // Unit u's gradients [units()[u].size()], contiguous, and the slot they live in (InBackward and Bf16; the flat
  // buffer's range and slot 0 in Fp32).
  float* unit_grads(size_t u) const { return g_ + grad_at(units_[u].lo); }
  int slot_of(size_t u) const { return unit_slot_[u]; }
  // Whether the backward makes each unit's gradients in a slot (InBackward, Bf16), readied before its first kernel
  // (model/gpu_model.cpp begin_unit).
  bool slotted() const { return gradients_ != Gradients::Fp32; }
  // Gradients::Bf16: the bf16 gradient buffer [P_pad] (flat; null in the other modes), parameter k's part of it,
  // and unit u's slot added into its range with stochastic rounding (ops/adamw/cuda.h accumulate_grad_bf16; key:
  // bf16_state::grad_key(step, micro-batch)), enqueued on `stream`.
  bf16* grads_bf16() const { return gb_; }
  const bf16* grad_bf16(size_t k) const { return gb_ + params_[k].offset; }
  void accumulate_unit(size_t u, uint64_t key, cudaStream_t stream);
  // Zeroes unit u's accumulated gradients (the flat buffer's range, or the bf16 buffer's), enqueued on `stream`.
  void zero_unit_grads(size_t u, cudaStream_t stream);
  // The sum of squares of unit u's gradients (Bf16: of its bf16 values) into its entry of the per-unit sums,
  // enqueued on `stream`; grad_sum_squares(stream, false) then adds the entries in unit order. Each parameter's
  // partials (ops/adamw/cuda.h sum_squares_partials, at param_partials(k)), then all of the unit's in parameter
  // order (sum_partials): a fixed order. Sharded: only each parameter's part in the share, the rest of its partials
  // zero. `fused` (may be empty): the parameters whose partials an update on the
  // same stream already wrote (GpuOptimizer::fuses_sum), not taken again.
  void unit_sum_squares(size_t u, cudaStream_t stream, const std::function<bool(size_t k)>& fused = nullptr);
  double* param_partials(size_t k) const { return partials_ + partial_at_[k]; }
  // Unit u's parameters, the ParamSpec index range [first, last) of those whose first element lies in the unit: the
  // range an in-backward update of the unit covers (GpuOptimizer::step_params), and unit_sum_squares sums.
  std::pair<size_t, size_t> unit_params(size_t u) const { return unit_params_[u]; }
  bf16* compute_base() const { return wb_; }  // the bf16 weights [P_pad], flat (compacted with FP8-stored weights)
  float* master_base() const { return w_; }   // the fp32 master [fp32_size()] (fp32 layout: flat, [P_pad])

  // The share (ParamShard): whether sharded, P_pad, S, this rank's flat range [share_lo, share_hi), and the range
  // of the compacted fp32 master (bf16 layout; the fp32 layout's is the flat one) that rank r's flat range holds.
  bool sharded() const { return shard_.world > 0; }
  const ParamShard& shard() const { return shard_; }
  int64_t padded_size() const { return Ppad_; }
  int64_t share_size() const { return S_; }
  int64_t share_lo() const { return lo_; }
  int64_t share_hi() const { return hi_; }
  std::pair<int64_t, int64_t> share_range(int rank) const;  // rank r's flat range [lo, hi)
  std::pair<int64_t, int64_t> fp32_range_of(int rank) const;
  // Sum of squares of the gradients of [share_lo, share_hi) (the whole buffer unsharded), synchronised: each unit's
  // sum as unit_sum_squares takes it over each parameter's part in the share (so one rank's is grad_sum_squares's
  // bits; at several ranks, a parameter cut by a share boundary is partitioned from the cut: fixed for a world
  // size, not equal across world sizes). The caller adds the ranks' values (model/engine.cpp).
  double share_grad_sum_squares(cudaStream_t stream);
  // The parameter holding flat element `first` and its count; ds::Error unless [first, first + count) lies
  // inside one parameter.
  size_t param_at(int64_t first, int64_t count) const;

  // The weights, one parameter at a time: values(k, dst) writes parameter k's fp32 values (numel) into dst, a host
  // buffer of the largest parameter's size (bf16-only weights: rounded to nearest; FP8-stored ones: rounded to bf16,
  // then cast with their unit's amax, as GpuFp8Linear casts a bf16 weight). Zeroes the gradients.
  void upload(const std::function<void(size_t k, float* dst)>& values, cudaStream_t stream);
  // fp32 values of flat elements [first, first + count) (one parameter) to the host; ds::Error for an FP8-stored
  // weight (its bf16 values are not kept).
  void read_weights(int64_t first, int64_t count, float* dst, cudaStream_t stream) const;
  void zero_grads(cudaStream_t stream);
  // Sum of squares of the gradients in double, fixed reduction order (bitwise reproducible): each unit's sum
  // (unit_sum_squares), added in unit order on the host; synchronises. fresh false: the per-unit sums already
  // taken (InBackward: by the backward) are added, not taken again.
  double grad_sum_squares(cudaStream_t stream, bool fresh = true);

 private:
  const ParamLayout& layout_;
  const std::vector<ParamSpec>& params_;
  static constexpr int64_t kUploadStage = int64_t{1} << 23;  // bf16 elements of the FP8 upload's device stage
  std::vector<Fp8WeightUnit> f8units_;
  std::vector<int> f8unit_of_;        // per parameter: its FP8 unit, or -1
  std::vector<int64_t> w8_at_;        // per unit: its codes' byte offset in w8_
  int64_t W8_ = 0;                    // bytes of w8_
  std::vector<int64_t> bf16_offset_;  // per parameter: its offset in wb_ (-1: FP8-stored)
  int64_t Pb_ = 0;                    // elements of wb_
  ParamLayout compute_layout_;        // layout_ with the offsets of wb_ (FP8-stored: their codes, in bf16 units)
  uint8_t* w8_ = nullptr;
  float* w8_f_ = nullptr;             // per unit: amax, scale (ops/linear/fp8.h kFp8Slot floats apart)
  bf16* stage_ = nullptr;             // the FP8 upload's device stage [kUploadStage]
  void upload_fp8_unit(size_t u, const std::vector<uint16_t>& bits, cudaStream_t stream);
  OptimizerState state_;
  ParamShard shard_;
  int64_t P_ = 0, P32_ = 0, Ppad_ = 0, S_ = 0, lo_ = 0, hi_ = 0;
  std::vector<int64_t> fp32_offset_;  // per parameter: offset into w_, or -1
  ParamLayout master_layout_;         // layout_ with the offsets of w_
  ParamLayout grad_layout_;           // layout_ with the offsets of g_ (InBackward: into the slots)
  std::vector<ParamUnit> units_;
  Gradients gradients_;
  bool frozen_ = false;
  std::vector<int> unit_slot_;        // per unit: its slot (InBackward)
  std::vector<int64_t> unit_at_;      // per unit: where its first element lies in g_
  int64_t G_ = 0;                     // elements of g_
  int64_t slot_at_[kMaxGradSlots] = {}, slot_len_[kMaxGradSlots] = {};  // the slots' ranges in g_ (slotted modes)
  int64_t grad_at(int64_t flat) const;  // where flat element `flat` lies in g_
  float *w_ = nullptr, *g_ = nullptr;
  bf16* wb_ = nullptr;
  bf16* gb_ = nullptr;  // Gradients::Bf16's buffer
  double* sumsq_ = nullptr;  // per unit
  // The gradients' sum-of-squares partials: parameter k's at partial_at_[k] (params_.size() + 1 entries, in parameter
  // order, so a unit's are contiguous), and each unit's parameters [unit_params_[u].first, .second).
  double* partials_ = nullptr;
  std::vector<int64_t> partial_at_;
  std::vector<std::pair<size_t, size_t>> unit_params_;
};

// Device <-> host copies of bf16 values as fp32 (exact widening / round to nearest even), through a bounded host
// staging buffer. Synchronise the stream.
void download_bf16_as_f32(const ds::cuda::bf16* src, int64_t count, float* dst, cudaStream_t stream);
void upload_f32_as_bf16(const float* src, int64_t count, ds::cuda::bf16* dst, cudaStream_t stream);

}  // namespace ds
#endif
