// The engine interface: what the trainer, `eval`, `forward`, `generate` (on the GPU; on the CPU it decodes with
// the model's carried state, model/generate.h) and `bench step` need from an engine that runs the Qwen3.5 model
// (docs/architecture.md). Two engines implement it:
//   - "cpu": the fp32 reference (model/model.h: Qwen35Model, ops' CPU references), AdamW state on the host;
//   - "cuda": the GPU engine (model/gpu_model.h), every buffer on the device, no host copy of the weights,
//     gradients or optimizer state; checkpoints stream from the device in bounded slabs.
// The trainer never branches on the engine: it asks for a step, a gradient norm, an optimizer update and the
// checkpoint tensors, all through this interface.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/error.h"
#include "model/config.h"
#include "model/model.h"
#include "model/safetensors.h"
#include "ops/adamw/adamw.h"

namespace ds {
namespace cuda {
class StepProfiler;  // core/cuda/profile.h
}
namespace dist {
class Communicator;  // dist/communicator.h
}

// How the GPU engine keeps its weights and optimizer state (`--optimizer-state`; docs/memory.md):
//   fp32: fp32 master weights + a bf16 compute copy, fp32 gradients, fp32 AdamW moments (18 bytes per parameter);
//   bf16: the GEMM weights (is_matrix) in bf16 only, updated with stochastic rounding, bf16 AdamW moments, fp32
//         gradients; the small fp32-read parameters (norms, conv taps, A_log, dt_bias) stay fp32 with fp32 moments
//         (10 bytes per parameter; ops/adamw/bf16_state.h);
//   8bit: the bf16 state's weights and update, with the GEMM weights' AdamW moments m and sqrt(v) in 8-bit
//         blockwise dynamic codes (one fp32 scale per 256 elements; ops/adamw/q8_state.h): about 8 bytes per
//         parameter; lossy beyond the bf16 state (docs/memory.md);
//   auto: the first of the memory_candidates() (model/gpu_plan.h) whose plan fits the device (resolved when the
//         engine is built).
enum class OptimizerState { Auto, Fp32, Bf16, EightBit };
// Whether the state keeps the GEMM weights (is_matrix) in bf16 only, with an fp32 master for the small parameters
// only (bf16 and 8bit; model/gpu_params.h).
inline bool bf16_weights(OptimizerState s) { return s == OptimizerState::Bf16 || s == OptimizerState::EightBit; }
// Elements a --shard optimizer share of the GPU engine is a multiple of (model/gpu_params.h ParamShard): 128 (256
// bytes of bf16), 256 in the 8bit state (whole quantization blocks, ops/adamw/q8_state.h).
inline int64_t share_align(OptimizerState s) { return s == OptimizerState::EightBit ? 256 : 128; }
// Which activations the backward rebuilds instead of keeping (`--recompute`; docs/memory.md):
//   none: every activation kept per layer;
//   selective: the cheap ones rebuilt (norm outputs, SwiGLU output, conv output, q/k l2norm, gated-norm output,
//              gated attention output; model/gpu_activations.h), one shared buffer each;
//   mlp: selective, and the MLP's gate|up output too (its GEMM again in the backward: about 2 N H 2I FLOPs per
//        layer for N x 2I activations, the cheapest time per byte after selective's; docs/memory.md);
//   full: only each layer's input kept; the backward runs the layer's forward again first;
//   auto: chosen with the optimizer state to fit the device (the order of memory_candidates(), model/gpu_plan.h).
// Every policy computes bitwise the same losses and gradients (the rebuilt values are the forward's own bits).
enum class Recompute { Auto, None, Selective, Mlp, Full };
// The policies whose backward rebuilds activations (selective, mlp, full), and so whose first GpuPlan::kept_layers
// layers may keep theirs instead.
inline bool rebuilds_activations(Recompute r) {
  return r == Recompute::Selective || r == Recompute::Mlp || r == Recompute::Full;
}
const char* optimizer_state_name(OptimizerState s);  // "auto" | "fp32" | "bf16" | "8bit"
const char* recompute_name(Recompute r);             // "auto" | "none" | "selective" | "mlp" | "full"
OptimizerState parse_optimizer_state(const std::string& s);  // ds::Error naming --optimizer-state
Recompute parse_recompute(const std::string& s);             // ds::Error naming --recompute
// "auto, none, selective, mlp or full": every value parse_recompute takes, for help texts and errors.
std::string recompute_choices();

// Where the gradients live (`--gradients`; docs/memory.md):
//   fp32: one fp32 gradient buffer of every parameter (4 bytes per parameter), the micro-batches accumulate into
//         it and the AdamW step runs after the backward;
//   in-backward: no whole-model gradient buffer. Each unit's gradients (model.h param_units: the embedding, each
//         layer, the head) go into a small fp32 slot and the unit's AdamW update runs as soon as they are final,
//         during the backward; the slot is then reused. Global-norm clipping keeps its meaning: the step first runs
//         a norm-only forward + backward (the gradients summed into squares, nothing updated), then the updating one
//         with the clip factor known; with --clip 0 and --nan-policy stop the norm pass is skipped. The result is
//         the fp32 mode's, bitwise (the same gradients, the same per-unit sums). One micro-batch per step
//         (--grad-accum 1) and one rank.
//   bf16: one bf16 gradient buffer of every parameter (2 bytes per parameter; lossy, opt-in). Each unit's
//         gradients of a micro-batch are made in an fp32 slot (as in-backward's) and, when final, added into the
//         buffer with stochastic rounding: g = SR(float(g) + slot), the random bits counter-based (ops/adamw/
//         bf16_state.h accumulate_grad: keyed by the step of begin_step(), the micro-batch's index since
//         zero_grads() and the flat parameter index), so the result is deterministic and the CPU engine emulates it
//         bitwise. The optimizer and the grad norm read the bf16 values. Any --grad-accum; one rank.
//   auto: chosen with the other memory modes to fit the device (memory_candidates, model/gpu_plan.h): fp32 where
//         it fits; in-backward, without a norm pass, right after fp32 at the same state and recompute (the same
//         speed), with one (GpuPlan::norm_pass: 1.85x the step) only after everything else. Never bf16 (lossy:
//         only when asked for).
enum class Gradients { Auto, Fp32, InBackward, Bf16 };
const char* gradients_name(Gradients g);          // "auto" | "fp32" | "in-backward" | "bf16"
Gradients parse_gradients(const std::string& s);  // ds::Error naming --gradients

// Precision (`--precision`): model/model.h.
const char* precision_name(Precision p);         // "bf16" | "fp8"
Precision parse_precision(const std::string& s);  // ds::Error naming --precision

// The memory flags into plan: `optimizer_state`, `recompute` and `gradients` as given ("auto" or a mode); with
// memory "fixed" an "auto" one becomes fp32 / selective / fp32, with memory "auto" it stays Auto (the engine resolves
// it to fit the device). ds::Error naming the flag for any other value.
struct GpuPlan;
// offload_activations (--offload-activations) needs --recompute full or auto (check_offload_recompute), and with
// --memory fixed it makes that full recompute (fixed's selective keeps no layer inputs to offload).
void apply_memory_flags(GpuPlan& plan, const std::string& memory, const std::string& optimizer_state,
                        const std::string& recompute, const std::string& gradients = "fp32",
                        bool offload_activations = false);

// The device buffers GpuPlan::offload_activations keeps the layer inputs in (layer i's in buffer i % kOffloadRing).
// At least 3: in the backward, layer i's input, the buffer its rerun writes (layer i + 1's input) and the buffer
// layer i - 1's input is fetched into must differ (model/gpu_model.cpp offload_before_backward).
inline constexpr int64_t kOffloadRing = 3;
// The ring's size for a model of `layers` decoder layers (all of them when there are fewer than kOffloadRing).
inline int64_t offload_ring(int64_t layers) { return layers < kOffloadRing ? layers : kOffloadRing; }
// ds::Error naming both flags unless --recompute (its text) is full or auto where --offload-activations is on.
void check_offload_recompute(bool offload_activations, const std::string& recompute);
// ds::Error naming --fp8-lm-head unless it comes with precision Fp8 and z_loss 0 (GpuPlan::fp8_lm_head).
void check_fp8_lm_head(bool fp8_lm_head, Precision precision, double z_loss = 0);

// Sizes a GPU engine plans its memory for (the CPU engine ignores them).
struct GpuPlan {
  int64_t max_tokens = 0;          // tokens per micro-batch (packed)
  int64_t max_seqs = 0;            // documents per micro-batch
  int64_t max_seqlen = 0;          // longest document (0: max_tokens); sizes cuDNN attention's length buckets
  int64_t rows = 0;                // the tokens are `rows` windows of max_seqlen (micro-batch); 0: any packing
  int64_t ce_chunk_tokens = 2048;  // fused-loss chunk
  OptimizerState optimizer_state = OptimizerState::Fp32;
  Recompute recompute = Recompute::Selective;
  // With recompute selective, mlp or full: the first kept_layers decoder layers keep the activations those policies
  // rebuild (as recompute none does; full: their forward does not run again), the rest rebuild them (docs/memory.md
  // "Recompute by layer"). 0: every layer rebuilds.
  // `auto` sets it to the most layers that fit between none and the full policy; bitwise the same results.
  int64_t kept_layers = 0;
  // With recompute full: the mlp_layers decoder layers after the kept ones rebuild only what recompute mlp rebuilds
  // (they keep mlp's activations and their forward does not run again; the gate|up GEMM does), the rest run their
  // forward again (docs/memory.md "Recompute by layer"). `auto` weighs them against kept layers by the forward time
  // each saves per byte; bitwise the same results.
  int64_t mlp_layers = 0;
  // With recompute mlp: the selective_layers decoder layers after the kept ones keep their gate|up output and rebuild
  // only what selective rebuilds; the rest rebuild gate|up too (docs/memory.md "Recompute by layer"). Keeping a
  // layer's N x 2I gate|up saves more time per byte than keeping all of its activations (a gate|up GEMM against a
  // few norm and elementwise passes), so `auto` takes these first, before any kept layer; bitwise the same results.
  int64_t selective_layers = 0;
  // --offload-activations (recompute full, or auto: then only full is considered): the decoder layers' inputs, all
  // that full recompute keeps of a layer, go to pinned host memory during the forward (N x hidden_size bf16 per
  // layer) and come back before each layer's backward, behind the compute on a copy stream; the device keeps a
  // ring of kOffloadRing of them (docs/memory.md "Offloaded layer inputs"). Bitwise the same results.
  bool offload_activations = false;
  // Bytes the process may use on the device, the CUDA context included (0: all the device has free); `auto` and
  // the fit check plan within it as `plan --device-memory` does (bench step --max-memory).
  size_t memory_limit = 0;
  Precision precision = Precision::Bf16;
  // --fp8-lm-head (with precision Fp8; lossy, opt-in; docs/fp8.md "The lm head's gradient GEMMs"): the fused loss's
  // dh and dW GEMMs in FP8 (ops/linear_cross_entropy/linear_cross_entropy.h LinearCeOptions::fp8_grads). The logits
  // and the loss stay exact. check_fp8_lm_head says which runs may have it.
  bool fp8_lm_head = false;
  Gradients gradients = Gradients::Fp32;
  // Whether a Gradients::InBackward step needs its norm-only pass (--clip > 0 or --nan-policy skip; in_backward_step):
  // what that mode costs, for `auto` (memory_candidates).
  bool norm_pass = true;
  // The layers' gradient slots of the slotted gradient modes (in-backward, bf16; model/gpu_params.h): 2, 3 or 4; 0:
  // resolve_memory_modes chooses (DELTASTACK_LAYER_SLOTS when set; else, in-backward, 3 where the modes it resolves
  // stay those of 2 slots at most two kept / gate|up / mlp layers fewer, else 2). gpu_layer_slots(plan): the count a
  // plan's store uses.
  int layer_slots = 0;
  // --shard optimizer on the GPU engine (ZeRO-1; docs/distributed.md): this rank of shard_world keeps and
  // updates only its even share of the flat parameters' AdamW state (model/gpu_params.h ParamShard);
  // shard_world 0: the whole state (no sharding).
  int shard_rank = 0, shard_world = 0;
  // A LoRA run (docs/lora.md; r 0: none): the adapters' config. The GPU engine then keeps the base frozen in the
  // bf16 layout (model/gpu_params.h: no base gradient, no base optimizer state) and the adapters beside it
  // (model/gpu_lora.h); optimizer_state and gradients are resolved to that (resolved(), model/gpu_plan.h), only
  // the recompute policy is chosen. make_engine sets it from the host model's adapter.
  LoraConfig lora;

  // Batches of `micro_batch` packed windows of seq_len tokens, each holding at most docs_per_window documents
  // (a document never spans windows): the trainer's, eval's and bench's batches.
  static GpuPlan windows(int64_t micro_batch, int64_t seq_len, int64_t docs_per_window) {
    GpuPlan p;
    p.max_tokens = micro_batch * seq_len;
    p.max_seqs = micro_batch * docs_per_window;
    p.max_seqlen = seq_len;
    p.rows = micro_batch;
    return p;
  }
  // The same for an engine that only runs forwards (eval): the memory modes left to the engine (Auto: the
  // leanest that fits the device), since a forward is bitwise the same in every mode (the GEMMs read the same
  // bf16 weights, the small parameters the same fp32 ones). With the fp32 state a 9B checkpoint would not fit an
  // H200 for eval although it trained there.
  static GpuPlan forward_windows(int64_t micro_batch, int64_t seq_len, int64_t docs_per_window) {
    GpuPlan p = windows(micro_batch, seq_len, docs_per_window);
    p.optimizer_state = OptimizerState::Auto;
    p.recompute = Recompute::Auto;
    p.gradients = Gradients::Auto;  // a forward never reads the gradients: the slots are as good as the buffer
    p.norm_pass = false;
    return p;
  }
};

// Reads fp32 values of the named tensor, numel elements, the first of them flat parameter element `flat_offset`
// (ParamSpec::offset; -1 for a tensor outside the flat parameters, e.g. a LoRA adapter's state); ds::Error naming
// the file and tensor when it is missing or has another element count. The trainer passes a checkpoint reader here
// on resume; it dequantizes a moment stored as 8-bit codes (moment_scale_name) by the flat offset's blocks.
using TensorSource = std::function<std::vector<float>(const std::string& name, int64_t numel, int64_t flat_offset)>;
// A moment the checkpoint stores as 8-bit codes (the layout below), as stored: fills `codes` (numel bytes) and
// `scales` (q8_state::num_blocks(flat_offset, numel) F32 block scales, each finite and >= 0) and returns true;
// false where the checkpoint holds the tensor in another dtype (TensorSource then reads it). ds::Error naming the
// file and tensor where a count is wrong or a scale is not finite and >= 0.
using CodeSource = std::function<bool(const std::string& name, int64_t numel, int64_t flat_offset, std::string& codes,
                                      std::vector<float>& scales)>;

// The 8bit state's moments in checkpoints (ops/adamw/q8_state.h): "exp_avg.<param>" / "exp_avg_sq.<param>" hold the
// U8 codes (of m, and of sqrt(v)) in the parameter's shape, and moment_scale_name of that name ("exp_avg_scale.
// <param>" / "exp_avg_sq_scale.<param>") the F32 scale of each 256-element block of the flat parameter range
// (ops::q8_state::num_blocks(offset, numel) of them; the first and last block may be cut by the parameter's ends).
// 1 byte per element instead of F32's 4, bitwise the device's state.
inline std::string moment_scale_name(const std::string& state_name) {
  const size_t dot = state_name.find('.');
  return state_name.substr(0, dot) + "_scale" + state_name.substr(dot);
}

class Engine {
 public:
  virtual ~Engine() = default;

  virtual std::string device() const = 0;  // "cpu" | "cuda": saved in checkpoints, a resume keeps it
  virtual const ModelConfig& config() const = 0;
  virtual const std::vector<ParamSpec>& params() const = 0;  // HF names, shapes, decay flags, flat offsets

  // Forward, loss (sum of per-token CE + z-loss over valid targets) and, when grad_scale != 0, the backward:
  // the gradient of grad_scale * loss_sum is ADDED to the engine's gradients (micro-batches accumulate).
  // capture (small inputs only): hidden states and full logits, as HF output_hidden_states / logits.
  // ds::Error for a batch the model or the engine's plan cannot take (naming the position or the limit).
  virtual LossResult forward_backward(const PackedBatch& batch, double grad_scale, double z_loss = 0.0,
                                      ForwardCapture* capture = nullptr) = 0;
  // The forward alone (no loss, no backward, the gradients untouched) and the fp32 logits [vocab_size] of the
  // batch's last position (its last document's last token): one row of the lm_head GEMM, not the N x V logits.
  // GPU: bf16 compute, within the 1e-2 logits band of the CPU engine's fp32 (docs/cuda_backend.md); the plan's
  // buffers only (nothing allocated per call). ds::Error as forward_backward for a batch the model or the plan
  // cannot take; an empty batch is an error. Generation's next-token logits (model/generate.h).
  virtual std::vector<float> last_logits(const PackedBatch& batch) = 0;
  virtual void zero_grads() = 0;
  // The trainer's step (1-based) whose micro-batches follow (call before zero_grads()): Gradients::Bf16 keys the
  // stochastic rounding of each micro-batch's accumulation by it and by the micro-batch's index, counted from 0 by
  // the backwards (forward_backward with grad_scale != 0) since zero_grads(). A no-op in the other modes.
  virtual void begin_step(int64_t /*step*/) {}
  // Sum of squares of every gradient element, in double, in a fixed order (bitwise reproducible): each unit's
  // sum (model.h param_units), added in unit order. Gradients::InBackward: the sums the last backward took of each
  // unit's final gradients.
  virtual double grad_sum_squares() = 0;
  // Gradients::InBackward only (the `gradients()` in use): what the next forward_backward's backward does with each
  // unit's final gradients. update null: their sums of squares are kept (grad_sum_squares) and nothing else (the
  // norm pass); else the AdamW update `*update` (p.grad_scale: the clip factor) of the unit, its sum kept too. A
  // forward_backward with grad_scale 0 (a batch without targets) still consumes the arming: it runs no backward, so
  // every unit's gradients are zero, their sums 0, and an armed update runs over them (as the fp32 mode's
  // optimizer_step after a zero_grads() does: the moments decay, the weight decay applies, the step counts).
  // ds::Error in the fp32 mode. in_backward_step() (below) is the step built on it.
  virtual void arm_in_backward(const ops::AdamWParams* /*update*/) {
    fail("internal: arm_in_backward() needs --gradients in-backward");
  }
  virtual Gradients gradients() const { return Gradients::Fp32; }
  // Data parallel over `comm`'s ranks (docs/distributed.md), set once after the engine is built and before a
  // resume loads the optimizer state. ShardMode::None: every rank keeps the whole AdamW state; Optimizer: rank r
  // keeps and updates only its even share of the flat parameter vector (dist::even_counts), the weights are
  // all-gathered after each update; Full (ZeRO-3, the CPU engine): rank r keeps only its even share of each layer
  // unit (model.h: param_units) of the weights, the reduced gradients and the moments; forward_backward all-gathers
  // a unit's weights before its forward and again before its backward into one of two buffers planned here (the
  // next unit's gather started while the current one computes), and reduce-scatters its gradients after its
  // backward. At world size 1 every mode is the plain engine. The GPU engine: its ranks need the NCCL communicator
  // (ds::Error for another one at world size above 1; at world size 1 under a launcher NCCL runs the same path,
  // Optimizer with one share), and ds::Error for Full at any world size.
  enum class ShardMode { None, Optimizer, Full };
  virtual void distribute(dist::Communicator& comm, ShardMode mode) = 0;
  // A rank with no batch where the other ranks run a forward (an evaluation's uneven share): takes part in the
  // collectives such a forward runs (ShardMode::Full: its per-unit gathers), computes nothing. No-op otherwise.
  virtual void forward_without_batch() {}
  // After a step's micro-batches (each rank ran its own with the global 1 / target-count scale): every rank's
  // gradients become their sum over the ranks (None: all of them, the same bits on every rank; Optimizer: the
  // rank's share, reduce-scattered; Full: nothing left to do, each unit's were reduce-scattered in its backward). grad_sum_squares() and optimizer_step() then act on the global gradient.
  virtual void reduce_grads() {}
  // Called before the step's last micro-batch: an engine that can overlap the reduce_grads() sum with that
  // micro-batch's backward starts each part of it as soon as that part's gradients are complete (the GPU engine
  // over NCCL with --shard none: per layer, on a side stream; DELTASTACK_DP_OVERLAP=0 turns it off); reduce_grads()
  // then only waits for it. The result is the same bits either way.
  virtual void reduce_grads_during_next_backward() {}
  // Around a checkpoint save (every rank calls both; rank 0 writes between them): a sharded optimizer state (and
  // with ShardMode::Full the weights) is gathered whole for optimizer_tensors() (weight_tensors()), then released.
  virtual void gather_for_save() {}
  virtual void release_after_save() {}
  // One AdamW update of every parameter (p.weight_decay applied to the parameters whose ParamSpec says so;
  // p.grad_scale multiplies the gradients first: the clip factor). GPU: also refreshes the bf16 compute copy.
  virtual void optimizer_step(const ops::AdamWParams& p) = 0;

  // Checkpoint tensors, streamed: each entry reads its fp32 values from the engine while the file is written
  // (no copy of the whole state in host memory). The engine must outlive the write.
  //   weight_tensors: the parameters with HF names (A_log and linear_attn.norm.weight stay F32 whatever dtype);
  //   optimizer_tensors: the optimizer's own state ("exp_avg.<name>", "exp_avg_sq.<name>" for AdamW; F32, or
  //   BF16 where the moments live in bf16: lossless either way; the 8-bit state's moments as U8 codes with their
  //   F32 block scales, moment_scale_name, or dequantized to F32 where the state is sharded: bitwise either way).
  virtual std::vector<SaveTensor> weight_tensors(DType dtype = DType::F32) = 0;
  // The weights as a checkpoint keeps them: lossless in the smallest dtype (F32; BF16 for a weight that lives in
  // bf16 only, bf16_weights(OptimizerState)).
  virtual std::vector<SaveTensor> checkpoint_weight_tensors() { return weight_tensors(DType::F32); }
  virtual std::vector<SaveTensor> optimizer_tensors() = 0;
  // Restores the optimizer state that optimizer_tensors() wrote (names as there), one tensor at a time. `codes`
  // (may be empty): an engine that keeps the 8bit state's codes takes a moment stored as codes as it is (bitwise
  // and without a host re-quantization: a 27B resume's 54 billion elements), else it reads fp32 values from `read`.
  virtual void load_optimizer(const TensorSource& read, const CodeSource& codes = nullptr) = 0;
  // The accumulated gradients with HF names (fp32), streamed like the weights (`deltastack forward --grads`); with
  // a LoRA adapter on the model (Qwen35Model::set_adapter), the adapters' under PEFT's keys.
  virtual std::vector<SaveTensor> grad_tensors() = 0;

  // The LoRA adapter being trained (docs/lora.md: the base frozen, only the adapters have gradients and AdamW
  // state; optimizer_tensors() then hold "exp_avg.<PEFT key>" / "exp_avg_sq.<PEFT key>", grad_tensors() the
  // adapters' gradients under PEFT's keys); null for a full run. Its values are the engine's current ones (the GPU
  // engine copies them back from the device here after an update).
  virtual LoraAdapter* adapter() { return nullptr; }
  // The adapter's dropout key for the next forward_backward (LoraAdapter::set_dropout_key; nullopt: no dropout).
  // No-op for a full run.
  virtual void set_lora_dropout_key(std::optional<uint64_t> key) {
    if (LoraAdapter* a = adapter()) a->set_dropout_key(key);
  }

  virtual size_t peak_bytes() const { return 0; }     // device memory high point (0 on the CPU)
  virtual size_t planned_bytes() const { return 0; }  // the GPU engine's one allocation (0 on the CPU)
  // The memory modes in use (resolved: never Auto). The CPU engine: fp32 state, nothing recomputed.
  virtual OptimizerState optimizer_state() const { return OptimizerState::Fp32; }
  virtual Recompute recompute() const { return Recompute::None; }
  // The policy with its layers as logs name it (model/gpu_plan.h recompute_label: "full, the first 48 of 64
  // rebuilding only mlp's activations"); the policy's name where no layer differs.
  virtual std::string recompute_label() const { return recompute_name(recompute()); }
  // The GEMM precision in use: the plan's, or bf16 where the FP8 backend failed its probe (one log line).
  virtual Precision precision() const { return Precision::Bf16; }
  // Timed scopes of the step's ops on the compute stream, collected by the caller after each step (`bench step
  // --profile`; core/cuda/profile.h); null turns them off. The CUDA engine only; the CPU engine ignores it.
  virtual void set_profiler(cuda::StepProfiler* /*prof*/) {}
};

// Builds the engine for `device` ("cpu" or "cuda"; "auto" = cuda when a device is present) from a host model whose
// weights are initialised or loaded. The CUDA engine uploads the weights and then releases the host model's
// buffers (host.release_buffers()); the CPU engine takes the model over. ds::Error when CUDA is asked for but
// unavailable, or the plan does not fit in device memory (the message gives the bytes). A model with a LoRA adapter
// (Qwen35Model::set_adapter) trains the adapter on either engine (the GPU's: model/gpu_lora.h; plan.lora is set
// from it there).
std::unique_ptr<Engine> make_engine(const std::string& device, Qwen35Model host, const GpuPlan& plan);

// One training step of an engine in Gradients::InBackward over one micro-batch (docs/memory.md): with clip > 0 or
// norm_first, a norm-only forward + backward first; when its loss and grad norm are finite, the updating forward +
// backward with p.grad_scale = the clip factor (clip / (norm + 1e-6) when the norm exceeds clip > 0, else 1, as the
// fp32 mode's step computes it); without the norm pass, the updating pass alone (p.grad_scale 1) and the norm its
// backward took. `updated` false: the norm pass found a non-finite loss or norm and nothing was updated.
// Global-norm clipping's factor on the gradients: clip / (norm + 1e-6) when clip > 0 and the norm exceeds it,
// else 1 (torch.nn.utils.clip_grad_norm_'s rule; the trainer's, bench step's and in_backward_step's one definition).
inline double clip_factor(double norm, double clip) { return clip > 0 && norm > clip ? clip / (norm + 1e-6) : 1.0; }

struct InBackwardStep {
  LossResult result;
  double grad_sum_squares = 0;
  bool updated = false;
};
InBackwardStep in_backward_step(Engine& e, const PackedBatch& b, double grad_scale, double z_loss,
                                ops::AdamWParams p, double clip, bool norm_first);

// "cuda" when device is "cuda", or "auto" and a CUDA device is present; else "cpu".
std::string resolve_device(const std::string& device);

// The GPU engine's on/off environment switches, "0" or "1" (unset: 1): DELTASTACK_EMBED_SPLIT (the in-backward
// 8-bit update of the embedding in two parts, model/gpu_model.cpp), DELTASTACK_ASYNC_OPTIMIZER (the optimizer
// step overlapped with the next step), DELTASTACK_DP_OVERLAP (the data-parallel all-reduce overlapped with the
// last backward) and DELTASTACK_STREAM_PRIORITY (the step's stream at the device's greatest priority and the side
// stream of the overlapped updates at the least; 0: both at the default, for A/B timing); and, unset 0,
// DELTASTACK_ATTENTION_SPLIT (cuDNN's attention backward as one call per key/value head, its dP workspace divided by
// num_key_value_heads, which the memory plan counts; measured on the H200: +0.3 % at 9B, +0.9 % at 2B per step,
// docs/memory.md), DELTASTACK_CUDNN_ZERO_WORKSPACE (ops/attention/cudnn.cpp), DELTASTACK_DIVISION_SIGMOID
// (core/cuda/cuda_utils.h) and DELTASTACK_Q8_BINARY_SEARCH (ops/adamw/cuda.h), read where they act. ds::Error
// naming the variable for any other value.
// check_engine_knobs() checks them all, whatever the device: the trainer (with ops::check_knobs, before --out is
// touched), eval and generate call it first. `unset`: the value when the variable is not set.
bool engine_knob(const char* name, bool unset = true);
// The in-backward gradient slots of the layers (model/gpu_params.h) asked for by DELTASTACK_LAYER_SLOTS: 2, 3 or 4
// (each slot more holds one layer's fp32 gradients and gives the side stream's update one layer's backward more), 0
// when unset (GpuPlan::layer_slots then chooses); ds::Error naming the variable for any other value
// (check_engine_knobs checks it first).
int layer_slots();
// The layer slots a resolved plan's store uses: plan.layer_slots, else DELTASTACK_LAYER_SLOTS, else 2.
int gpu_layer_slots(const GpuPlan& plan);
inline constexpr const char* kAttentionSplitKnob = "DELTASTACK_ATTENTION_SPLIT";  // the name, for its reader and tests
void check_engine_knobs();

}  // namespace ds
