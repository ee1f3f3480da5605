// The Qwen3.5 dense text model (HF Qwen3_5ForCausalLM; docs/model.md §2) on the CPU reference backend:
// fp32 parameters in one flat buffer (HF names and shapes), explicit forward and backward per layer
// (llm.c style), packed sequences with cu_seqlens (no state, conv tap or attention crosses a document).
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "data/batch.h"
#include "model/config.h"
#include "model/lora.h"
#include "model/params.h"
#include "model/safetensors.h"

namespace ds {

// The decoder's matrix GEMMs (`--precision`; docs/fp8.md): bf16 (the exact mode; fp32 on the CPU engine), or FP8
// (E4M3 / E5M2 with per-tensor current scaling: model/gpu_fp8.h on the GPU, core/fp8.h's casts emulated exactly on
// the CPU). Lossy, opt-in.
enum class Precision { Bf16, Fp8 };

// The limits a batch is checked against for this model (PackedBatch::check, data/batch.h).
inline BatchLimits batch_limits(const ModelConfig& c) {
  return {.vocab_size = c.vocab_size, .max_position_embeddings = c.max_position_embeddings};
}

// What a forward pass can hand back to tools (`deltastack forward`): HF output_hidden_states and logits.
struct ForwardCapture {
  bool hidden_states = false;  // num_layers + 1 tensors [N, H]; the last is after the final norm (HF)
  bool logits = false;         // [N, V]
  std::vector<std::vector<float>> hidden;
  std::vector<float> logits_values;
};

struct LossResult {
  double loss_sum = 0;   // sum of per-token CE (+ z-loss) over valid targets
  double z_loss_sum = 0;
  int64_t num_valid = 0;
};

// The dtype a parameter is stored in when a checkpoint is written as `dtype`: A_log and the gated-norm weight
// stay F32 (as in released Qwen3.5 checkpoints), everything else follows `dtype`.
DType stored_dtype(const ParamSpec& p, DType dtype);

// Writes dir/config.json (cfg, with "dtype": "bfloat16" when dtype is BF16) and `tensors` (the weights, HF names),
// each file atomically: dir/model.safetensors when they fit in max_shard_bytes, else model-0000k-of-0000n shards
// plus model.safetensors.index.json (HF save_pretrained's layout). Streams the tensors (views or readers).
void save_model_dir(const std::string& dir, const ModelConfig& cfg, const std::vector<SaveTensor>& tensors,
                    DType dtype, int64_t max_shard_bytes);

// A checkpoint's weights (HF safetensors: one file, shards with an index, or a directory; "model." or
// "model.language_model." prefix; model.visual.* and mtp.* ignored) checked against a parameter table when opened:
// every parameter present with its shape, no text-model tensor the config has no place for (ds::Error naming the
// file and tensor otherwise). Values are read one tensor at a time, so a caller can stream a model of any size.
class CheckpointWeights {
 public:
  CheckpointWeights(const std::string& path, const ModelConfig& cfg, const std::vector<ParamSpec>& params);
  // The parameter's values (fp32, converted from the stored dtype); ds::Error at the first non-finite value.
  std::vector<float> read(const ParamSpec& p) const;
  // With tied embeddings, an lm_head.weight present in the checkpoint must equal the embedding (ds::Error). The
  // embedding's values: `loaded` when the caller has them, else read here (only when there is a head to compare).
  void check_tied_head(const ParamSpec& embed, const float* loaded = nullptr) const;

 private:
  std::string name_of(const ParamSpec& p) const;
  std::string path_, prefix_;
  CheckpointReader ck_;
  bool tied_;
};

// The parameter table of a Qwen3.5 config, in the flat-buffer order both engines use (HF names and shapes; decay
// on matrices only). No memory for the values.
std::vector<ParamSpec> qwen35_params(const ModelConfig& c);

// The flat parameter buffer cut into the contiguous "units" forward_backward reads one after another: unit 0 is the
// embedding, unit 1 + i decoder layer i (every tensor of model.layers.i.*), unit num_hidden_layers + 1 the head:
// the final norm, and lm_head when it is not tied (tied, the lm_head is the embedding: unit 0 again). [lo, hi) in
// elements of the flat buffer; the units cover it in order. ds::Error when the table is not in qwen35_params' order.
struct ParamUnit {
  int64_t lo = 0, hi = 0;
  int64_t size() const { return hi - lo; }
};
std::vector<ParamUnit> param_units(const ModelConfig& c, const std::vector<ParamSpec>& params);

// Where forward_backward reads a unit's weights and adds its gradients when weights() does not hold them (the CPU
// engine's ShardMode::Full, model/engine.cpp: a unit is all-gathered before it runs and its gradients are
// reduce-scattered after its backward). The model calls, per forward_backward:
//   acquire(u) ... release(u) around every use of unit u's weights, in the order of unit_order(): the embedding,
//   the layers 0 .. L-1, the head (held through the loss and the final norm's backward), the embedding again when
//   tied (lm_head), and with a backward the layers L-1 .. 0 once more; at most two units are held at once (the
//   head and the tied embedding);
//   grads(u) ... grads_done(u) around each unit's gradient contributions: the head (tied: the embedding's lm_head
//   part first, then the head), the layers L-1 .. 0, the embedding; one unit at a time.
class UnitSource {
 public:
  virtual ~UnitSource() = default;
  // Unit u's fp32 weights, units[u].size() floats in flat order, valid until release(u).
  virtual float* acquire(int64_t u) = 0;
  virtual void release(int64_t u) = 0;
  // A buffer of units[u].size() fp32 zeros the model adds unit u's gradient (of grad_scale * loss_sum) into;
  // grads_done(u): the contribution is complete (the engine takes it).
  virtual float* grads(int64_t u) = 0;
  virtual void grads_done(int64_t u) = 0;
};

class Qwen35Model {
 public:
  explicit Qwen35Model(ModelConfig config);
  // A model whose weights are not held on the host yet: defer_init or defer_load names where they come from, and
  // an engine takes them one parameter at a time (fill_param): the GPU engine uploads each as it comes, so a GPU
  // run never holds a full host copy (9B: 36 GB of fp32); the CPU engine materializes them.
  struct Deferred {};
  Qwen35Model(ModelConfig config, Deferred);

  const ModelConfig& config() const { return cfg_; }
  const std::vector<ParamSpec>& params() const { return params_; }
  const ParamSpec& spec(const std::string& name) const;  // throws if unknown
  const ParamLayout& layout() const { return *layout_; }  // typed views of the parameters
  int64_t num_parameters() const { return params_.back().offset + params_.back().numel; }
  std::vector<float>& weights() { return weights_; }
  const std::vector<float>& weights() const { return weights_; }
  std::vector<float>& grads() { return grads_; }  // empty until zero_grads() or a backward
  float* weight(const std::string& name) { return weights_.data() + spec(name).offset; }
  float* grad(const std::string& name) { return grads_.data() + spec(name).offset; }

  // HF _init_weights (docs/model.md §5.5): normal(0, initializer_range) for linear/conv/embedding, zeros
  // for zero-centered norms, ones for the gated norm and dt_bias, A_log = log(U(0.01, 16)). Deterministic in seed.
  void init_weights(uint64_t seed);
  // The same values, produced later per parameter (deferred model; the host buffer stays empty).
  void defer_init(uint64_t seed);
  // load()'s values, read per parameter later from the checkpoint at `path` (opened and checked here: a missing or
  // misshapen tensor is a ds::Error now, a non-finite value when it is read).
  void defer_load(const std::string& path);
  bool deferred() const { return static_cast<bool>(deferred_); }
  // Parameter k's fp32 values into dst[0, params()[k].numel): from the deferred source, or from weights().
  void fill_param(size_t k, float* dst) const;
  // A deferred model's weights into weights() (the CPU engine); nothing for a model that holds them.
  void materialize();
  // Loads HF safetensors (single file, sharded with index, or a directory). Accepts "model." and
  // "model.language_model." prefixes, ignores model.visual.* and mtp.*, ties lm_head when the config says so
  // (an lm_head.weight present in a tied checkpoint must equal the embedding or it is an error). Every
  // parameter must be present with the right shape (ds::Error naming the file and tensor otherwise).
  void load(const std::string& path);
  // Writes dir/config.json and the weights (HF names, "model." prefix; lm_head only when untied), each file
  // atomically: dir/model.safetensors when they fit in max_shard_bytes (HF save_pretrained's 5 GB default),
  // else model-0000k-of-0000n.safetensors shards plus model.safetensors.index.json. Memory beyond the model is
  // a few MiB (streamed). dtype F32 or BF16 (A_log and the gated-norm weight always F32, as released checkpoints).
  void save(const std::string& dir, DType dtype = DType::F32, int64_t max_shard_bytes = 5000000000) const;
  // The parameters as safetensors entries: name -> values from `buffer` (weights, grads), as views: `buffer` must
  // outlive the write. A_log and the gated-norm weight stay F32 whatever `dtype`.
  std::vector<SaveTensor> to_tensors(const std::vector<float>& buffer, DType dtype = DType::F32) const;

  // The units (param_units) and the order in which forward_backward acquires their weights: with a backward
  // (backward = true) or forward only. Indices into units().
  const std::vector<ParamUnit>& units() const { return units_; }
  std::vector<int64_t> unit_order(bool backward) const;
  // From here on forward_backward reads the weights from `s` and hands it the gradients (weights() and grads()
  // are then not used and may be released); null: weights() and grads() again. The source must outlive its use.
  // last_logits and decode read weights() only (ds::Error with a source set).
  void set_unit_source(UnitSource* s) { source_ = s; }
  // The matrix GEMMs of forward_backward: Precision::Fp8 reads their operands through the FP8 casts the GPU's
  // `--precision fp8` GEMMs use (core/fp8.h, emulated exactly; docs/fp8.md), Bf16 (the default) is the plain fp32
  // reference (the name says what the GPU runs).
  void set_precision(Precision p) { precision_ = p; }
  Precision precision() const { return precision_; }
  // `--fp8-lm-head` (GpuPlan::fp8_lm_head): the loss's dh and dW GEMMs read W, h and the dlogits through the FP8
  // casts the GPU's FP8 lm head uses (LinearCeOptions::fp8_grads; the logits and the loss stay exact).
  void set_fp8_lm_head(bool on) { fp8_lm_head_ = on; }
  bool fp8_lm_head() const { return fp8_lm_head_; }
  // LoRA (model/lora.h, docs/lora.md): with an adapter set, each adapted linear layer adds scaling * (x lora_A^T)
  // lora_B^T to its output in forward_backward, last_logits and decode (in both precisions: the LoRA term itself is
  // fp32); a backward adds d(grad_scale * loss_sum) / d lora_A, lora_B into adapter->grads() (zeroed first when
  // empty) and computes no base gradient: no weight-gradient GEMM for the frozen matrices, grads() neither
  // allocated nor changed. Dropout on lora_A's input only in a backward while the adapter has a dropout key
  // (LoraAdapter::set_dropout_key: the trainer's), else PEFT's eval mode. ds::Error when the adapter was built for
  // another config; null removes it.
  // Not with a unit source (forward_backward: ds::Error).
  void set_adapter(std::shared_ptr<LoraAdapter> a);
  LoraAdapter* adapter() const { return adapter_.get(); }
  const std::shared_ptr<LoraAdapter>& shared_adapter() const { return adapter_; }  // the engine that keeps it

  void zero_grads();
  // Frees the host weight and gradient buffers (the GPU engine calls it after uploading the weights: a GPU run
  // keeps no host copy). Afterwards only config() and params() may be used.
  void release_buffers();
  // Forward, loss (sum over valid targets, z-loss optional) and, if grad_scale != 0, backward: the gradient of
  // grad_scale * loss_sum is ADDED to grads() (so micro-batches accumulate). Rejects token ids >= vocab_size
  // and batches longer than max_position_embeddings per document (ds::Error).
  LossResult forward_backward(const PackedBatch& batch, double grad_scale, double z_loss = 0.0,
                              ForwardCapture* capture = nullptr);
  // The forward alone and the fp32 logits [vocab_size] of the batch's last position (one row of the lm_head
  // GEMM; generation's next-token logits, the CPU engine's Engine::last_logits). ds::Error for an empty batch,
  // released weights, or a batch the model cannot take (PackedBatch::check).
  std::vector<float> last_logits(const PackedBatch& batch);

  // What generation keeps between tokens (one sequence): per Gated DeltaNet layer the conv input's last K-1 rows
  // and the recurrent state S [Hv, dk, dv]; per attention layer the keys (after norm and RoPE) and values of
  // every position so far. A new token then costs one token's work in the GDN layers and one row of scores in
  // the attention layers, instead of the whole prefix again.
  struct DecodeState {
    int64_t length = 0;  // tokens consumed
    std::vector<std::vector<float>> conv_tail, state, keys, values;  // per layer (empty where it does not apply)
  };
  // Appends `ids` (the prompt, then one token at a time) to `st` and returns the logits [V] after the last of
  // them: what last_logits of the whole sequence so far returns, up to fp32 rounding (the attention sums run in
  // another order). ds::Error past max_position_embeddings or for an id >= vocab_size.
  std::vector<float> decode(DecodeState& st, const std::vector<int32_t>& ids);

 private:
  struct Impl;
  ModelConfig cfg_;
  std::vector<ParamSpec> params_;
  std::map<std::string, size_t> by_name_;
  std::shared_ptr<const ParamLayout> layout_;  // shared: a moved or copied model keeps the same offsets
  std::vector<float> weights_, grads_;
  std::vector<ParamUnit> units_;
  UnitSource* source_ = nullptr;
  Precision precision_ = Precision::Bf16;
  bool fp8_lm_head_ = false;
  std::shared_ptr<LoraAdapter> adapter_;
  std::function<void(size_t k, float* dst)> deferred_;  // set by defer_init / defer_load until materialize()
  static void init_param(const ModelConfig& cfg, const std::vector<ParamSpec>& params, size_t k, uint64_t seed,
                         float* dst);
};

}  // namespace ds
