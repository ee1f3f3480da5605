// The GPU engine's FP8 linear layers (`--precision fp8`; docs/fp8.md): the decoder's matrix GEMMs (in_proj_qkv,
// in_proj_z, out_proj, q|gate, k, v, o_proj, gate|up, down) with per-tensor current scaling (ops/linear/fp8.h),
// forward, dgrad and wgrad. Everything else of the step stays as in bf16 (embedding, lm head + loss, norms, conv1d,
// in_proj_b|a, the gated delta rule, attention, A_log, dt_bias).
//
// The casts go into a few scratch buffers of the activation plan (GpuFp8Bufs), rewritten by every GEMM: x (a
// forward input, or a backward input cast transposed), w (a weight, or its transpose; a LoRA run's FP8-stored
// weight needs only the transpose, fp8_stored_base below), dy and dyt (an output gradient and its transpose). One
// stream: each buffer is read by its GEMM before the next cast rewrites it.
//
// Each cast needs its tensor's amax first. No amax pass is run twice for one tensor within a pass (a forward and
// its backward, recompute included), and none where the kernel that produced the tensor computed it:
// - the amax of every GEMM input (per layer and Fp8Input) and of every weight is kept in a small table for the
//   pass: the backward's transposed casts of the inputs and of the weights reuse the forward's (the same bf16
//   values: a recompute is bitwise the forward);
// - RMSNorm, the gated RMSNorm, the attention output gate and SwiGLU (forward), and in the backward SwiGLU's, the
//   RMSNorm's that adds the residual stream's gradient, the gated RMSNorm's and conv1d's (the output gradients of
//   gate|up, of down, out_proj and o_proj, of in_proj_z and of in_proj_qkv) write the amax of what they store
//   (fused_input_amax / fused_grad_amax; core/cuda/kernel_utils.cuh amax_commit). A max is exact and order-free,
//   so every cast is bit for bit what a separate amax pass gives.
// Formats: E4M3 for weights and activations; output gradients in E5M2 (default) or E4M3
// (DELTASTACK_FP8_GRAD=e5m2|e4m3). Forward GEMMs use the tensor cores' fast accumulation, the backward's promote
// to fp32 (DELTASTACK_FP8_FAST_ACCUM=forward|all|none; TransformerEngine's default split).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "core/fp8.h"
#include "model/config.h"
#include "model/params.h"

namespace ds {

// Whether a GPU plan keeps the inputs that only FP8 GEMMs read (out_proj's / o_proj's, gate|up's, down's) for the
// backward as their transposed FP8 casts, [K, pad16(tokens)] E4M3, instead of in bf16 (half the bytes, and the
// backward casts nothing for them; GpuLayerActs::t8): --precision fp8 with recompute none (the other policies rebuild
// these inputs instead of keeping them), no LoRA (whose terms read the inputs in bf16), and every such linear on the
// FP8 path (GpuFp8Linear::takes).
bool fp8_keeps_inputs(const ModelConfig& c, bool fp8, bool recompute_none, bool lora);
// Whether cuBLASLt's FP8 GEMM takes a linear K -> N: K and N multiples of 16 (the caller runs bf16 GEMMs otherwise).
inline bool fp8_gemm_takes(int64_t K, int64_t N) { return K % 16 == 0 && N % 16 == 0; }
// The bytes those kept casts take for micro-batches of max_tokens tokens (bf16 would take twice as many).
size_t fp8_kept_bytes(const ModelConfig& c, int64_t max_tokens);

// A LoRA run's frozen base under --precision fp8 (the default; DELTASTACK_FP8_FROZEN_BASE=0: not): every decoder
// GEMM weight that the FP8 path takes is stored as its E4M3 cast only, 1 byte per element instead of bf16's 2, cast
// once at upload with the amax of its bf16 values (model/gpu_params.h). The forward GEMMs read those codes as they
// are; the dgrad's transposed cast becomes a byte transpose of them. Both are bit for bit the casts the bf16-stored
// base gives (a cast is elementwise with one scale per tensor, and a frozen weight's amax never changes), so the run
// is bitwise the same, in less memory and with no weight cast per pass (docs/fp8.md).
inline constexpr const char* kFp8FrozenBaseKnob = "DELTASTACK_FP8_FROZEN_BASE";
bool fp8_stored_base(bool fp8, bool lora);

// One FP8-stored weight: layer `layer`'s GEMM weight `weight` (GpuFp8Linear's index: 0..2 the mixer input's linears
// in order, 3 the mixer's output projection, 4 gate|up, 5 down), rows x cols ([N, K]) elements from flat parameter
// offset `offset` on (gate|up: gate_proj's rows, then up_proj's: the two tensors, one cast with one amax, as the
// fused GEMM casts them).
struct Fp8WeightUnit {
  int64_t layer = 0;
  int weight = 0;
  int64_t offset = 0, rows = 0, cols = 0;
  int64_t numel() const { return rows * cols; }
};
// The weights an FP8-stored base holds as casts: those of every linear group (the linears reading one input) of
// which every shape takes the FP8 GEMM (fp8_gemm_takes), as the engine's linears_forward decides per group; in
// layer order, then weight order.
std::vector<Fp8WeightUnit> fp8_weight_units(const ModelConfig& c, const ParamLayout& layout);
// The units a plan stores in FP8: fp8_weight_units where fp8_stored_base(fp8, lora), none otherwise.
std::vector<Fp8WeightUnit> fp8_stored_units(const ModelConfig& c, const ParamLayout& layout, bool fp8, bool lora);

// The FP8 formats and accumulation of a run, from the environment (DELTASTACK_FP8_GRAD, DELTASTACK_FP8_FAST_ACCUM,
// DELTASTACK_FP8_AMAX); ds::Error naming the variable for a bad value.
struct Fp8Recipe {
  Fp8Format grad = Fp8Format::E5M2;
  bool fast_accum_forward = true, fast_accum_backward = false;
  // The amax table and the producers' fused amax (DELTASTACK_FP8_AMAX=fused, the default), or an amax pass before
  // every cast (=separate: the first FP8 build's way, kept for A/B timing and the bitwise test; the same results).
  bool fused_amax = true;
  static Fp8Recipe from_env();
  std::string describe() const;
};

}  // namespace ds

#ifdef DELTASTACK_CUDA
#include <cuda_runtime.h>

#include "core/cuda/cuda_utils.h"
#include "model/config.h"
#include "ops/linear/fp8.h"

namespace ds {

// Where an FP8 GEMM input sits in a decoder layer (the amax table's key, with the layer): the mixer's input (the
// normed hidden state: in_proj_qkv and in_proj_z, or q|gate, k and v), the mixer's output projection's input
// (out_proj's or o_proj's), the MLP's input (gate|up's) and down_proj's input.
enum class Fp8Input { MixerIn = 0, MixerOut = 1, MlpIn = 2, MlpOut = 3 };

// The FP8 scratch of the activation plan (null when the precision is bf16).
struct GpuFp8Bufs {
  uint8_t *x = nullptr, *w = nullptr, *dy = nullptr, *dyt = nullptr;
  float* f = nullptr;     // 8 slots kFp8Slot floats apart: amax x, amax w, amax dy, then scales x, w, dy, dyt
  float* amax = nullptr;  // the pass's amax table: amax_slots(layers) floats (GpuFp8Linear)
  // The FP8-only GEMM inputs kept in FP8 (fp8_keeps_inputs): the dequantization scales of their kept transposed casts,
  // one per layer and Fp8Input, kFp8Slot floats apart (cuBLASLt's scale pointers); null when not kept.
  float* saved_scale = nullptr;

  // Per layer: the 4 inputs (Fp8Input) and up to 6 weights (3 of the mixer's input, its output projection,
  // gate|up, down); then kGradSlots output-gradient slots.
  static constexpr int64_t kPerLayer = 10, kGradSlots = 4;
  static int64_t amax_slots(int64_t layers) { return layers * kPerLayer + kGradSlots; }
  // Bytes of each buffer for config c and micro-batches of max_tokens tokens (amax: floats).
  struct Sizes {
    size_t x = 0, w = 0, dy = 0, dyt = 0, amax = 0, saved_scale = 0;  // saved_scale: floats, when inputs are kept
  };
  static Sizes sizes(const ModelConfig& c, int64_t max_tokens);
};

// One linear layer family's FP8 GEMMs over the scratch buffers. M: tokens; a linear maps K inputs to N outputs
// (W: [N, K] bf16, the compute copy). Every call is enqueued on `stream`.
//
// The amax table: a pass (begin_pass: the weights may have changed since the last) computes each input's and
// each weight's amax once, at its first cast, or takes it from the producer kernel (fused_input_amax); later casts
// of the same tensor in the pass read it. `layer` and `role` name an input; `weight` (0..5) a layer's weight:
// 0..2 the mixer input's linears in order, 3 the mixer's output projection, 4 gate|up, 5 down.
// frozen_weights (a LoRA run: the base is uploaded once and never written again, model/gpu_model.cpp): each
// weight's amax, computed at its first cast, holds for every later pass too (the same bf16 values, so the same
// max; one amax read of the base less per pass, a micro-batch's forward and backward: begin_pass). With
// DELTASTACK_FP8_AMAX=separate every cast still runs its own amax pass, which makes that the bitwise reference
// (CudaLora.Fp8FrozenBaseAmaxIsTheSeparatePasses).
class GpuFp8Linear {
 public:
  using bf16 = ds::cuda::bf16;
  GpuFp8Linear(const GpuFp8Bufs& b, const Fp8Recipe& r, cudaStream_t s, int64_t layers, bool frozen_weights = false);

  static bool takes(int64_t K, int64_t N) { return fp8_gemm_takes(K, N); }

  // The FP8-stored frozen weights (fp8_stored_base): for each unit, its E4M3 codes [rows, cols] and their
  // dequantization scale (a device float). forward() then reads those codes for that weight, whatever W it is given
  // (the store's view of the weight: a key, not bf16 values), and backward() transposes them for the dgrad.
  struct StoredWeight {
    Fp8WeightUnit unit;
    const uint8_t* q = nullptr;
    const float* scale = nullptr;
  };
  void use_stored_weights(const std::vector<StoredWeight>& weights);

  // A new pass (a forward, its backward): every amax of the table is stale (a frozen weight's excepted).
  void begin_pass() { ++pass_; }
  // The device float, zeroed on the stream, where the kernel producing layer `layer`'s input `role` writes its
  // amax (the kernels' `amax` argument); the input's casts in this pass then run no amax pass.
  float* fused_input_amax(int64_t layer, Fp8Input role);
  // The same for an output gradient: slot k (0 .. kGradSlots - 1) zeroed; hand it to backward's dy_amax after the
  // producer ran.
  float* fused_grad_amax(int k);

  // x [M, K] cast (E4M3) into the x buffer: the forward input of one or more linears that read x.
  ops::cuda::Fp8Matrix input(const bf16* x, int64_t M, int64_t K, int64_t layer, Fp8Input role);
  // y [M, N] (= or +=) qx . q(W)^T, W [N, K] (layer `layer`'s weight `weight`) cast into the w buffer; residual
  // (bf16 [M, N], not with accumulate): y = qx . q(W)^T + residual in the GEMM's epilogue.
  void forward(const ops::cuda::Fp8Matrix& qx, const bf16* W, int64_t N, bf16* y, bool accumulate, int64_t layer,
               int weight, const bf16* residual = nullptr);

  // x [M, K] cast transposed (E4M3, [K, pad16(M)]) into the x buffer: the wgrad input of the linears that read x.
  ops::cuda::Fp8Matrix input_t(const bf16* x, int64_t M, int64_t K, int64_t layer, Fp8Input role);

  // input() and, in the same pass over x, its transposed cast into xt ([K, pad16(M)] bytes the caller keeps for
  // the backward, GpuFp8Bufs::saved_scale): the forward input of a kept input. kept_t then gives that cast back (its scale
  // kept beside it), for the backward in place of input_t.
  ops::cuda::Fp8Matrix input_keeping_t(const bf16* x, int64_t M, int64_t K, int64_t layer, Fp8Input role,
                                       uint8_t* xt);
  ops::cuda::Fp8Matrix kept_t(const uint8_t* xt, int64_t M, int64_t K, int64_t layer, Fp8Input role) const;
  // One linear's backward: dx [M, K] (= or +=) q(dy) . q(W^T)^T and dW [N, K] += q(dy^T) . qxt^T (fp32), with
  // dy [M, N] cast once for both layouts (the grad format). qxt from input_t of the layer's input. dW null (a frozen
  // weight): the dgrad only, and qxt gives only its shape (rows K, cols fp8_padded(M); data may be null).
  // dy_amax: dy's amax from its producer (fused_grad_amax), or null (an amax pass here).
  // overwrite_dw: dW = the wgrad (the GEMM's beta 0) instead of dW += it (GpuModel's wgrad_overwrite).
  void backward(const bf16* dy, int64_t M, const bf16* W, const ops::cuda::Fp8Matrix& qxt, int64_t N, bf16* dx,
                bool accumulate_dx, float* dW, int64_t layer, int weight, const float* dy_amax,
                bool overwrite_dw = false);

 private:
  // The table's slot of an input / a weight; its amax, computed from x [rows, cols] unless this pass has it (or,
  // all_passes: a frozen weight's, unless any pass has).
  float* amax_of(int64_t slot, const bf16* x, int64_t rows, int64_t cols, bool all_passes = false);
  int64_t input_slot(int64_t layer, Fp8Input role) const;
  int64_t weight_slot(int64_t layer, int weight) const;
  float* kept_scale(int64_t layer, Fp8Input role) const;

  // The stored weight of (layer, weight), or null; ds::Error when it is not [N, K].
  const StoredWeight* stored(int64_t layer, int weight, int64_t N, int64_t K) const;

  GpuFp8Bufs b_;
  Fp8Recipe r_;
  cudaStream_t s_;
  int64_t layers_;
  bool frozen_weights_;
  uint64_t pass_ = 1;
  std::vector<uint64_t> have_;  // per slot: the pass whose amax it holds (0: none)
  std::vector<StoredWeight> stored_;  // per weight slot (empty: none stored)
};

}  // namespace ds
#endif
