// LoRA adapters in PEFT's format (docs/lora.md): the adapter of each targeted linear layer of the decoder is a pair
// lora_A [r, in], lora_B [out, r] (fp32) and the layer computes
//   y = x W^T + scaling * (x lora_A^T) lora_B^T,   scaling = lora_alpha / r  (lora_alpha / sqrt(r) with use_rslora),
// the base weight W frozen (Hu et al. 2021, "LoRA"; PEFT's peft/tuners/lora/layer.py: Linear.forward). The files
// are PEFT's: DIR/adapter_config.json and DIR/adapter_model.safetensors with keys
//   base_model.model.model.layers.N.<module>.lora_A.weight / lora_B.weight
// (base_model.model.model.language_model.layers.N... for the released multimodal checkpoint layout).
#pragma once
#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "model/config.h"
#include "model/safetensors.h"

namespace ds {

// The linear layers of a Qwen3.5 decoder layer an adapter may target (HF module names under model.layers.N).
// Not in_proj_b / in_proj_a, not the embedding or lm_head.
enum class LoraModule {
  in_proj_qkv, in_proj_z, out_proj,    // linear_attn (Gated DeltaNet layers)
  q_proj, k_proj, v_proj, o_proj,      // self_attn (attention layers); q_proj's output is per head query | gate
  gate_proj, up_proj, down_proj,       // mlp (every layer)
};
inline constexpr int kNumLoraModules = 10;
// "linear_attn.in_proj_qkv", "self_attn.q_proj", "mlp.gate_proj", ...: the module's path inside a layer.
const char* lora_module_path(LoraModule m);
// The short name PEFT's target_modules uses: "in_proj_qkv", "q_proj", ...
const char* lora_module_name(LoraModule m);

// The fields of PEFT's LoraConfig that deltastack implements (adapter_config.json).
struct LoraConfig {
  int64_t r = 0;                     // rank, > 0
  double lora_alpha = 0;             // > 0 in practice (any finite value is accepted, as PEFT does)
  double lora_dropout = 0;           // [0, 1): applied to the input of lora_A in training only
  bool use_rslora = false;           // scaling alpha / sqrt(r) (Kalajdzievski 2023) instead of alpha / r
  std::vector<LoraModule> target_modules;  // no duplicates, in LoraModule order
  double scaling() const;
};

// target_modules as given by the user or a config: "all-linear" (every LoraModule) or names (short, e.g. "q_proj",
// or with the parent, "self_attn.q_proj"). ds::Error naming `what` (a flag or file and field) for an unknown name,
// a module deltastack does not adapt (in_proj_b, lm_head, ...) or an empty list.
std::vector<LoraModule> parse_lora_targets(const std::vector<std::string>& names, const std::string& what);

// Reads DIR/adapter_config.json. Every field that would change the math and that deltastack does not implement is
// a ds::Error naming the file and the field: peft_type other than LORA, bias other than "none", use_dora,
// fan_in_fan_out, modules_to_save, layers_to_transform, layers_pattern, rank_pattern, alpha_pattern,
// exclude_modules, target_modules as a regular expression, and any field deltastack does not know that is set (not
// null, false, "", [] or {}), except PEFT's bookkeeping and initialisation-only fields (docs/lora.md lists them).
LoraConfig read_lora_config(const std::string& dir);
// The same checks on a parsed adapter_config.json (errors name `path`).
LoraConfig parse_lora_config(const nlohmann::json& j, const std::string& path);
// The adapter_config.json PEFT's LoraConfig reads for `cfg` (peft_type LORA, task_type CAUSAL_LM, target_modules by
// short name, every unsupported feature off); parse_lora_config gives cfg back. base_model_name_or_path may be
// empty (null in the file).
nlohmann::json lora_config_to_json(const LoraConfig& cfg, const std::string& base_model_name_or_path = "");

// One adapted linear layer: where its lora_A and lora_B sit in the adapter's flat buffers.
struct LoraTensorSpec {
  int64_t layer = 0;
  LoraModule module = LoraModule::q_proj;
  int64_t in = 0, out = 0;           // the base weight's [out, in]
  int64_t a_offset = 0, b_offset = 0;  // lora_A [r, in] and lora_B [out, r] in values() / grads() (floats)
};

// The adapted linear layers of `model` under `config` (layer-major, LoraModule order within a layer; a module
// exists only in the layers of its kind), their lora_A / lora_B packed in that order into one flat buffer of
// lora_num_values(specs, r) floats. ds::Error for r <= 0, no targets, or targets none of the layers has.
std::vector<LoraTensorSpec> lora_tensor_specs(const ModelConfig& model, const LoraConfig& config);
int64_t lora_num_values(const std::vector<LoraTensorSpec>& specs, int64_t r);

// The adapters of one model: fp32 values and gradients in two flat buffers, one LoraTensorSpec per adapted linear
// layer (layer-major, LoraModule order within a layer; a module exists only in the layers of its kind).
class LoraAdapter {
 public:
  // Zero-valued adapters for every target module of every layer of `model` (the caller fills values()).
  LoraAdapter(const ModelConfig& model, LoraConfig config, bool multimodal_keys = false);
  // Reads DIR (read_lora_config, then DIR/adapter_model.safetensors): every expected key present with its shape
  // ([r, in] / [out, r]) and finite values, and no other key (ds::Error naming the file and key). The key prefix
  // (text or multimodal layout) is taken from the file; all keys must share it.
  static LoraAdapter load(const std::string& dir, const ModelConfig& model);
  // Writes DIR/adapter_config.json and DIR/adapter_model.safetensors (fp32, PEFT's keys), each atomically, so that
  // PEFT's PeftModel.from_pretrained loads them. base_model_name_or_path goes into the config (may be empty).
  void save(const std::string& dir, const std::string& base_model_name_or_path = "") const;

  const LoraConfig& config() const { return config_; }
  const std::vector<LoraTensorSpec>& specs() const { return specs_; }
  // The specs of layer i (indices into specs()).
  const std::vector<size_t>& layer_specs(int64_t i) const { return by_layer_[static_cast<size_t>(i)]; }
  int64_t num_layers() const { return static_cast<int64_t>(by_layer_.size()); }
  std::vector<float>& values() { return values_; }
  const std::vector<float>& values() const { return values_; }
  std::vector<float>& grads() { return grads_; }  // empty until zero_grads()
  void zero_grads() { grads_.assign(values_.size(), 0.0f); }
  bool multimodal_keys() const { return multimodal_keys_; }

  // PEFT's initialisation (LoraConfig init_lora_weights=True; peft/tuners/lora/layer.py reset_lora_parameters):
  // lora_A kaiming-uniform with a = sqrt(5), i.e. U(-1/sqrt(in), 1/sqrt(in)) (nn.init.kaiming_uniform_: gain
  // sqrt(2 / (1 + a^2)) = sqrt(1/3), bound gain * sqrt(3 / in)); lora_B zero. Deterministic in `seed`: spec k's
  // lora_A draws from its own counter stream (core/rng.h), so a value depends only on (seed, k, index).
  void init_peft(uint64_t seed);

  // Dropout on lora_A's input in training (PEFT's lora_dropout; nn.Dropout: kept values scaled by 1 / (1 - p)).
  // `key` names one micro-batch (the trainer derives it from the seed and the micro-batch's global index,
  // dropout_key()); the model applies dropout in a forward_backward with a backward while a key is set and
  // lora_dropout > 0; nullopt (the default) turns it off (eval, forward, generate).
  void set_dropout_key(std::optional<uint64_t> key) { dropout_key_ = key; }
  std::optional<uint64_t> dropout_key() const { return dropout_key_; }
  // Spec k's keep mask for `rows` rows of its input ([rows, in]): 0 (dropped, probability lora_dropout) or
  // 1 / (1 - lora_dropout), from the key set (ds::Error without one). The same values each call: the backward
  // regenerates the forward's mask.
  void dropout_mask(size_t k, int64_t rows, float* mask) const;
  // The random stream of spec k's mask under the key set (core/rng.h): element e ([rows, in] row-major) is dropped
  // when dropout_drops(dropout_stream(k), e, lora_dropout). The GPU engine draws the same masks from it.
  uint64_t dropout_stream(size_t k) const;
  // The dropout key of micro-batch `micro_index` (0-based, over the run's whole history: step, rank, micro-batch)
  // of a run seeded with `seed`.
  static uint64_t dropout_key(uint64_t seed, int64_t micro_index);
  // PEFT's key of spec k's lora_A (b = false) or lora_B (b = true).
  std::string key(const LoraTensorSpec& s, bool b) const;
  // The tensors of `buffer` (values() or grads()) under PEFT's keys, as fp32 views (buffer must outlive the write).
  std::vector<SaveTensor> tensors(const std::vector<float>& buffer) const;

 private:
  LoraConfig config_;
  bool multimodal_keys_ = false;
  std::vector<LoraTensorSpec> specs_;
  std::vector<std::vector<size_t>> by_layer_;
  std::vector<float> values_, grads_;
  std::optional<uint64_t> dropout_key_;
};

}  // namespace ds
