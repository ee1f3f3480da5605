// Qwen3.5 dense text-model configuration (HF Qwen3_5TextConfig; docs/model.md §1). Reads the plain text form
// (model_type "qwen3_5_text") and the released composite form (model_type "qwen3_5" with "text_config"), with
// either `layer_types` or `full_attention_interval`, and `rope_parameters` (or legacy top-level rope_theta /
// partial_rotary_factor). Writes the plain text form, which transformers loads as Qwen3_5ForCausalLM.
#pragma once
#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace ds {

struct ModelConfig {
  int64_t vocab_size = 248320;
  int64_t hidden_size = 4096;
  int64_t intermediate_size = 12288;
  int64_t num_hidden_layers = 32;
  int64_t num_attention_heads = 16;
  int64_t num_key_value_heads = 4;
  int64_t head_dim = 256;
  int64_t linear_conv_kernel_dim = 4;
  int64_t linear_key_head_dim = 128;
  int64_t linear_value_head_dim = 128;
  int64_t linear_num_key_heads = 16;
  int64_t linear_num_value_heads = 32;
  int64_t max_position_embeddings = 32768;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  double partial_rotary_factor = 0.25;
  double initializer_range = 0.02;
  bool tie_word_embeddings = false;
  std::vector<std::string> layer_types;  // "linear_attention" | "full_attention", one per layer
  int64_t eos_token_id = -1;             // -1: none
  std::string source = "<preset>";       // where it came from, for error messages

  // Derived quantities (docs/model.md §1.1).
  int64_t key_dim() const { return linear_num_key_heads * linear_key_head_dim; }
  int64_t value_dim() const { return linear_num_value_heads * linear_value_head_dim; }
  int64_t conv_dim() const { return 2 * key_dim() + value_dim(); }
  int64_t rotary_dim() const { return static_cast<int64_t>(head_dim * partial_rotary_factor); }
  bool is_full_attention(int64_t layer) const { return layer_types.at(static_cast<size_t>(layer)) == "full_attention"; }
  int64_t num_parameters() const;  // text parameters (lm_head counted only when untied)

  // Parses a HF config.json object. `source` names the file in errors. Throws ds::Error for missing,
  // mistyped or contradictory fields (e.g. layer_types length != num_hidden_layers, H_v % H_k != 0).
  static ModelConfig from_json(const nlohmann::json& j, const std::string& source);
  // Reads config.json from a file path or from a directory containing it.
  static ModelConfig from_file(const std::string& path);
  // Published sizes "0.8b", "2b", "4b", "9b", "27b" (docs/model.md §1.2) and "tiny" (the embedded default).
  static ModelConfig preset(const std::string& name);
  static std::vector<std::string> preset_names();
  // A preset name, a config.json path, or a checkpoint directory.
  static ModelConfig resolve(const std::string& spec);

  // Checks internal consistency; throws ds::Error naming `source` and the field.
  void validate() const;
  // HF text config (model_type "qwen3_5_text", architectures ["Qwen3_5ForCausalLM"]).
  nlohmann::json to_json() const;
};

// ds::Error when the model directory `dir` holds a LoRA adapter (adapter_config.json: PEFT's files or a LoRA run's
// checkpoint, no base weights; docs/lora.md), saying to give it as --adapter and its base as --model. Called where a
// model directory lacks its config.json or weights.
void check_not_adapter_dir(const std::string& dir);

}  // namespace ds
