#include "model/lora.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <set>

#include "core/error.h"
#include "core/files.h"
#include "core/rng.h"

namespace ds {

namespace {

using json = nlohmann::json;

struct ModuleInfo {
  LoraModule module;
  const char* path;  // inside a decoder layer
  const char* name;  // PEFT's short name
};
constexpr std::array<ModuleInfo, kNumLoraModules> kModules{{
    {LoraModule::in_proj_qkv, "linear_attn.in_proj_qkv", "in_proj_qkv"},
    {LoraModule::in_proj_z, "linear_attn.in_proj_z", "in_proj_z"},
    {LoraModule::out_proj, "linear_attn.out_proj", "out_proj"},
    {LoraModule::q_proj, "self_attn.q_proj", "q_proj"},
    {LoraModule::k_proj, "self_attn.k_proj", "k_proj"},
    {LoraModule::v_proj, "self_attn.v_proj", "v_proj"},
    {LoraModule::o_proj, "self_attn.o_proj", "o_proj"},
    {LoraModule::gate_proj, "mlp.gate_proj", "gate_proj"},
    {LoraModule::up_proj, "mlp.up_proj", "up_proj"},
    {LoraModule::down_proj, "mlp.down_proj", "down_proj"},
}};

const std::string kTextPrefix = "base_model.model.model.layers.";
const std::string kMultimodalPrefix = "base_model.model.model.language_model.layers.";

// Whether module m exists in layer i, and its base weight's [out, in] there.
bool module_shape(const ModelConfig& c, int64_t i, LoraModule m, int64_t& out, int64_t& in) {
  const int64_t H = c.hidden_size, I = c.intermediate_size;
  const int64_t Hq = c.num_attention_heads, Hkv = c.num_key_value_heads, hd = c.head_dim;
  const bool attn = c.is_full_attention(i);
  switch (m) {
    case LoraModule::in_proj_qkv: out = c.conv_dim(), in = H; return !attn;
    case LoraModule::in_proj_z: out = c.value_dim(), in = H; return !attn;
    case LoraModule::out_proj: out = H, in = c.value_dim(); return !attn;
    case LoraModule::q_proj: out = Hq * hd * 2, in = H; return attn;
    case LoraModule::k_proj: out = Hkv * hd, in = H; return attn;
    case LoraModule::v_proj: out = Hkv * hd, in = H; return attn;
    case LoraModule::o_proj: out = H, in = Hq * hd; return attn;
    case LoraModule::gate_proj: out = I, in = H; return true;
    case LoraModule::up_proj: out = I, in = H; return true;
    case LoraModule::down_proj: out = H, in = I; return true;
  }
  return false;
}

// A value that leaves a PEFT feature off: null, false, "", [] or {}.
bool neutral(const json& v) {
  return v.is_null() || (v.is_boolean() && !v.get<bool>()) || (v.is_string() && v.get<std::string>().empty()) ||
         ((v.is_array() || v.is_object()) && v.empty());
}

std::string brief(const json& v) {
  if (v.is_array()) return "a list";
  if (v.is_object()) return "an object";
  return v.dump();
}

}  // namespace

const char* lora_module_path(LoraModule m) { return kModules[static_cast<size_t>(m)].path; }
const char* lora_module_name(LoraModule m) { return kModules[static_cast<size_t>(m)].name; }

double LoraConfig::scaling() const {
  return use_rslora ? lora_alpha / std::sqrt(static_cast<double>(r)) : lora_alpha / static_cast<double>(r);
}

std::vector<LoraModule> parse_lora_targets(const std::vector<std::string>& names, const std::string& what) {
  DS_CHECK(!names.empty(), "{}: no target modules", what);
  std::set<LoraModule> chosen;
  for (const std::string& n : names) {
    if (n == "all-linear") {
      for (const ModuleInfo& mi : kModules) chosen.insert(mi.module);
      continue;
    }
    bool found = false;
    for (const ModuleInfo& mi : kModules)
      if (n == mi.name || n == mi.path) chosen.insert(mi.module), found = true;
    if (!found) {
      std::string known;
      for (const ModuleInfo& mi : kModules) known += std::string(known.empty() ? "" : ", ") + mi.name;
      fail("{}: target module \"{}\" is not one deltastack adapts (all-linear, or some of: {})", what, n, known);
    }
  }
  return {chosen.begin(), chosen.end()};
}

LoraConfig read_lora_config(const std::string& dir) {
  const std::string path = (std::filesystem::path(dir) / "adapter_config.json").string();
  DS_CHECK(std::filesystem::is_regular_file(path), "{}: no such file (an adapter directory holds "
           "adapter_config.json and adapter_model.safetensors)", path);
  json j;
  try {
    j = json::parse(read_file(path));
  } catch (const json::exception& e) {
    fail("{}: not valid JSON ({})", path, e.what());
  }
  return parse_lora_config(j, path);
}

LoraConfig parse_lora_config(const json& j, const std::string& path) {
  DS_CHECK(j.is_object(), "{}: expected a JSON object", path);
  LoraConfig cfg;
  // The fields read, each checked; the fields PEFT writes that do not change the math (bookkeeping, or only how
  // the adapter was initialised); every other field must be off.
  static const std::set<std::string> ignored = {
      "base_model_name_or_path", "revision", "task_type", "inference_mode", "init_lora_weights", "peft_version",
      "auto_mapping", "megatron_core", "qalora_group_size", "loftq_config", "eva_config", "corda_config",
      "lora_ga_config"};
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& k = it.key();
    const json& v = it.value();
    if (ignored.count(k)) continue;
    if (k == "peft_type") {
      DS_CHECK(v.is_string() && v.get<std::string>() == "LORA", "{}: peft_type is {}; only LORA adapters are "
               "supported", path, brief(v));
    } else if (k == "r") {
      // nlohmann keeps a non-negative integer as unsigned: read it as such (no wrap of values above INT64_MAX).
      DS_CHECK(v.is_number_unsigned() && v.get<uint64_t>() > 0 && v.get<uint64_t>() <= (uint64_t{1} << 20),
               "{}: r must be a positive integer (at most 2^20), got {}", path, brief(v));
      cfg.r = static_cast<int64_t>(v.get<uint64_t>());
    } else if (k == "lora_alpha") {
      DS_CHECK(v.is_number() && std::isfinite(v.get<double>()), "{}: lora_alpha must be a finite number, got {}",
               path, brief(v));
      cfg.lora_alpha = v.get<double>();
    } else if (k == "lora_dropout") {
      DS_CHECK(v.is_number() && v.get<double>() >= 0 && v.get<double>() < 1, "{}: lora_dropout must be in [0, 1), "
               "got {}", path, brief(v));
      cfg.lora_dropout = v.get<double>();
    } else if (k == "use_rslora") {
      DS_CHECK(v.is_boolean(), "{}: use_rslora must be true or false, got {}", path, brief(v));
      cfg.use_rslora = v.get<bool>();
    } else if (k == "bias") {
      DS_CHECK(v.is_string() && v.get<std::string>() == "none", "{}: bias is {}; only \"none\" is supported (the "
               "base model's linear layers have no bias)", path, brief(v));
    } else if (k == "target_modules") {
      if (v.is_string()) {
        DS_CHECK(v.get<std::string>() == "all-linear", "{}: target_modules is the regular expression {}; "
                 "deltastack supports a list of module names or \"all-linear\"", path, v.dump());
        cfg.target_modules = parse_lora_targets({"all-linear"}, path + ": target_modules");
      } else {
        DS_CHECK(v.is_array(), "{}: target_modules must be a list of module names, got {}", path, brief(v));
        std::vector<std::string> names;
        for (const json& e : v) {
          DS_CHECK(e.is_string(), "{}: target_modules must hold strings, got {}", path, brief(e));
          names.push_back(e.get<std::string>());
        }
        cfg.target_modules = parse_lora_targets(names, path + ": target_modules");
      }
    } else {
      // use_dora, fan_in_fan_out, modules_to_save, layers_to_transform, layers_pattern, rank_pattern,
      // alpha_pattern, exclude_modules, lora_bias, target_parameters, ... and fields of later PEFT versions.
      DS_CHECK(neutral(v), "{}: field \"{}\" is {}; deltastack does not support it (only plain LoRA: see "
               "docs/lora.md)", path, k, brief(v));
    }
  }
  DS_CHECK(cfg.r > 0, "{}: field \"r\" is missing", path);
  DS_CHECK(j.contains("lora_alpha"), "{}: field \"lora_alpha\" is missing", path);
  DS_CHECK(!cfg.target_modules.empty(), "{}: field \"target_modules\" is missing", path);
  return cfg;
}

std::vector<LoraTensorSpec> lora_tensor_specs(const ModelConfig& model, const LoraConfig& config) {
  DS_CHECK(config.r > 0, "LoRA: r must be positive, got {}", config.r);
  DS_CHECK(!config.target_modules.empty(), "LoRA: no target modules");
  std::vector<LoraTensorSpec> specs;
  int64_t off = 0;
  for (int64_t i = 0; i < model.num_hidden_layers; ++i)
    for (LoraModule m : config.target_modules) {
      LoraTensorSpec s;
      s.layer = i;
      s.module = m;
      if (!module_shape(model, i, m, s.out, s.in)) continue;
      s.a_offset = off;
      off += config.r * s.in;
      s.b_offset = off;
      off += s.out * config.r;
      specs.push_back(s);
    }
  DS_CHECK(!specs.empty(), "LoRA: none of the target modules exists in this model");
  return specs;
}

int64_t lora_num_values(const std::vector<LoraTensorSpec>& specs, int64_t r) {
  return specs.empty() ? 0 : specs.back().b_offset + specs.back().out * r;
}

LoraAdapter::LoraAdapter(const ModelConfig& model, LoraConfig config, bool multimodal_keys)
    : config_(std::move(config)), multimodal_keys_(multimodal_keys), specs_(lora_tensor_specs(model, config_)) {
  by_layer_.resize(static_cast<size_t>(model.num_hidden_layers));
  for (size_t k = 0; k < specs_.size(); ++k) by_layer_[static_cast<size_t>(specs_[k].layer)].push_back(k);
  values_.assign(static_cast<size_t>(lora_num_values(specs_, config_.r)), 0.0f);
}

std::string LoraAdapter::key(const LoraTensorSpec& s, bool b) const {
  return (multimodal_keys_ ? kMultimodalPrefix : kTextPrefix) + std::to_string(s.layer) + "." +
         lora_module_path(s.module) + (b ? ".lora_B.weight" : ".lora_A.weight");
}

LoraAdapter LoraAdapter::load(const std::string& dir, const ModelConfig& model) {
  LoraConfig cfg = read_lora_config(dir);
  const std::string path = (std::filesystem::path(dir) / "adapter_model.safetensors").string();
  DS_CHECK(std::filesystem::is_regular_file(path), "{}: no such file (deltastack reads adapters in safetensors "
           "format only)", path);
  SafetensorsReader f(path);
  DS_CHECK(!f.tensors().empty(), "{}: holds no tensors", path);
  const std::string& first = f.tensors().front().name;
  const bool multimodal = first.rfind(kMultimodalPrefix, 0) == 0;
  LoraAdapter a(model, std::move(cfg), multimodal);
  std::set<std::string> expected;
  for (const LoraTensorSpec& s : a.specs_)
    for (bool b : {false, true}) {
      const std::string k = a.key(s, b);
      expected.insert(k);
      const TensorInfo* t = f.find(k);
      DS_CHECK(t, "{}: missing tensor \"{}\" (adapter_config.json targets {})", path, k, lora_module_name(s.module));
      const std::vector<int64_t> shape = b ? std::vector<int64_t>{s.out, a.config_.r}
                                           : std::vector<int64_t>{a.config_.r, s.in};
      DS_CHECK(t->shape == shape, "{}: tensor \"{}\" has shape [{}] but r = {} and the model need [{}]", path, k,
               fmt::join(t->shape, ", "), a.config_.r, fmt::join(shape, ", "));
      DS_CHECK(is_float_dtype(t->dtype), "{}: tensor \"{}\" has dtype {}; adapter tensors must be F32, BF16, F16 "
               "or F64", path, k, dtype_name(t->dtype));
      const std::vector<float> v = f.read_f32(k);
      for (size_t e = 0; e < v.size(); ++e)
        DS_CHECK(std::isfinite(v[e]), "{}: tensor \"{}\" holds a non-finite value at index {}", path, k, e);
      std::copy(v.begin(), v.end(), a.values_.begin() + (b ? s.b_offset : s.a_offset));
    }
  for (const TensorInfo& t : f.tensors())
    DS_CHECK(expected.count(t.name), "{}: tensor \"{}\" is not an adapter of this model's target modules (a "
             "layer or module the config does not have, another prefix, or a kind deltastack does not support)",
             path, t.name);
  return a;
}

std::vector<SaveTensor> LoraAdapter::tensors(const std::vector<float>& buffer) const {
  DS_CHECK(buffer.size() == values_.size(), "LoRA: a buffer of {} floats, the adapters have {}", buffer.size(),
           values_.size());
  std::vector<SaveTensor> out;
  for (const LoraTensorSpec& s : specs_) {
    out.push_back(make_tensor_f32_view(key(s, false), {config_.r, s.in}, buffer.data() + s.a_offset));
    out.push_back(make_tensor_f32_view(key(s, true), {s.out, config_.r}, buffer.data() + s.b_offset));
  }
  return out;
}

json lora_config_to_json(const LoraConfig& cfg, const std::string& base_model_name_or_path) {
  json targets = json::array();
  for (LoraModule m : cfg.target_modules) targets.push_back(lora_module_name(m));
  return {
      {"peft_type", "LORA"},
      {"task_type", "CAUSAL_LM"},
      {"base_model_name_or_path", base_model_name_or_path.empty() ? json(nullptr) : json(base_model_name_or_path)},
      {"r", cfg.r},
      {"lora_alpha", cfg.lora_alpha},
      {"lora_dropout", cfg.lora_dropout},
      {"use_rslora", cfg.use_rslora},
      {"target_modules", targets},
      {"bias", "none"},
      {"use_dora", false},
      {"fan_in_fan_out", false},
      {"modules_to_save", nullptr},
      {"layers_to_transform", nullptr},
      {"layers_pattern", nullptr},
      {"rank_pattern", json::object()},
      {"alpha_pattern", json::object()},
      {"init_lora_weights", true},
      {"inference_mode", true},
  };
}

void LoraAdapter::init_peft(uint64_t seed) {
  std::fill(values_.begin(), values_.end(), 0.0f);
  for (size_t k = 0; k < specs_.size(); ++k) {
    const LoraTensorSpec& s = specs_[k];
    Rng rng(seed, 0x10a0000000ull + k);  // a stream range of its own (the model's init_param uses 1 + index)
    const double bound = 1.0 / std::sqrt(static_cast<double>(s.in));
    float* a = values_.data() + s.a_offset;
    for (int64_t e = 0; e < config_.r * s.in; ++e) a[e] = static_cast<float>((2.0 * rng.uniform() - 1.0) * bound);
  }
}

uint64_t LoraAdapter::dropout_key(uint64_t seed, int64_t micro_index) {
  return splitmix64(splitmix64(seed ^ 0xd80bd80bd80bull) + static_cast<uint64_t>(micro_index));
}

void LoraAdapter::dropout_mask(size_t k, int64_t rows, float* mask) const {
  DS_CHECK(dropout_key_.has_value(), "LoRA: a dropout mask without a dropout key");
  DS_CHECK(k < specs_.size(), "LoRA: no adapter {}", k);
  const double p = config_.lora_dropout;
  const float keep = static_cast<float>(1.0 / (1.0 - p));
  const uint64_t key = dropout_stream(k);
  for (int64_t e = 0; e < rows * specs_[k].in; ++e)
    mask[e] = dropout_drops(key, static_cast<uint64_t>(e), p) ? 0.0f : keep;
}

uint64_t LoraAdapter::dropout_stream(size_t k) const {
  DS_CHECK(dropout_key_.has_value(), "LoRA: a dropout mask without a dropout key");
  return rng_stream_key(*dropout_key_, k + 1);
}

void LoraAdapter::save(const std::string& dir, const std::string& base_model_name_or_path) const {
  namespace fs = std::filesystem;
  fs::create_directories(dir);
  const json j = lora_config_to_json(config_, base_model_name_or_path);
  write_file_atomic((fs::path(dir) / "adapter_config.json").string(), j.dump(2) + "\n");
  write_safetensors((fs::path(dir) / "adapter_model.safetensors").string(), tensors(values_), {{"format", "pt"}});
}

}  // namespace ds
