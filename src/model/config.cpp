#include "model/config.h"

#include <cmath>
#include <filesystem>

#include "core/error.h"
#include "core/files.h"

namespace ds {

namespace {

using json = nlohmann::json;

// Size limits (validate() enforces them; from_json checks num_hidden_layers before building layer_types). With
// these, every derived quantity (projection widths, num_parameters) fits in int64 with room to spare.
constexpr int64_t kMaxVocab = int64_t{1} << 24;        // 16,777,216 (real vocabularies: ~250k)
constexpr int64_t kMaxWidth = int64_t{1} << 20;        // hidden_size, intermediate_size, projection widths
constexpr int64_t kMaxLayers = int64_t{1} << 16;       // num_hidden_layers
constexpr int64_t kMaxHeads = int64_t{1} << 16;        // head counts, head dims, conv kernel
constexpr int64_t kMaxPositions = int64_t{1} << 31;    // max_position_embeddings

// A JSON value for an error message. nlohmann's dump() recurses once per nesting level, so dumping a deeply
// nested value (e.g. "hidden_size": [[[[...]]]]) would overflow the stack: arrays and objects are only named.
std::string brief(const json& v) {
  if (v.is_array()) return "an array";
  if (v.is_object()) return "an object";
  std::string s = v.dump(-1, ' ', /*ensure_ascii=*/true);
  if (s.size() > 80) s = s.substr(0, 77) + "...";
  return s;
}

int64_t get_int(const json& j, const char* key, int64_t def, const std::string& src, bool required = false) {
  if (!j.contains(key) || j[key].is_null()) {
    DS_CHECK(!required, "{}: missing required field \"{}\"", src, key);
    return def;
  }
  const json& v = j[key];
  DS_CHECK(v.is_number_integer() || v.is_number_unsigned(), "{}: field \"{}\" must be an integer, got {}", src, key,
           brief(v));
  // get<int64_t>() would wrap an unsigned value above INT64_MAX to a negative one.
  DS_CHECK(!v.is_number_unsigned() || v.get<uint64_t>() <= static_cast<uint64_t>(INT64_MAX),
           "{}: field \"{}\" is out of range, got {}", src, key, brief(v));
  return v.get<int64_t>();
}

double get_num(const json& j, const char* key, double def, const std::string& src) {
  if (!j.contains(key) || j[key].is_null()) return def;
  const json& v = j[key];
  DS_CHECK(v.is_number(), "{}: field \"{}\" must be a number, got {}", src, key, brief(v));
  return v.get<double>();
}

bool get_bool(const json& j, const char* key, bool def, const std::string& src) {
  if (!j.contains(key) || j[key].is_null()) return def;
  DS_CHECK(j[key].is_boolean(), "{}: field \"{}\" must be true or false, got {}", src, key, brief(j[key]));
  return j[key].get<bool>();
}

std::vector<std::string> interval_layers(int64_t n, int64_t interval) {
  std::vector<std::string> t;
  for (int64_t i = 0; i < n; ++i) t.push_back((i + 1) % interval == 0 ? "full_attention" : "linear_attention");
  return t;
}

}  // namespace

ModelConfig ModelConfig::from_json(const json& root, const std::string& source) {
  DS_CHECK(root.is_object(), "{}: config must be a JSON object", source);
  const json* jp = &root;
  std::string src = source;
  std::string mt = root.contains("model_type") && root["model_type"].is_string() ? root["model_type"].get<std::string>()
                                                                                  : "";
  ModelConfig c;
  c.source = source;
  bool top_tie_present = false, top_tie = false;
  if (root.contains("text_config")) {
    DS_CHECK(root["text_config"].is_object(), "{}: \"text_config\" must be an object", source);
    DS_CHECK(mt.empty() || mt == "qwen3_5" || mt == "qwen3_5_text", "{}: unsupported model_type \"{}\" (expected qwen3_5)",
             source, mt);
    jp = &root["text_config"];
    src = source + " (text_config)";
    // The composite model ties by its top-level flag (docs/model.md §5.4); its default is false.
    top_tie_present = true;
    top_tie = get_bool(root, "tie_word_embeddings", false, source);
    const json& tc = *jp;
    std::string tmt = tc.contains("model_type") && tc["model_type"].is_string() ? tc["model_type"].get<std::string>() : "";
    DS_CHECK(tmt.empty() || tmt == "qwen3_5_text", "{}: unsupported model_type \"{}\" (expected qwen3_5_text)", src, tmt);
  } else {
    DS_CHECK(mt.empty() || mt == "qwen3_5_text", "{}: unsupported model_type \"{}\" (expected qwen3_5_text, or qwen3_5 "
             "with text_config)", source, mt);
  }
  const json& j = *jp;
  c.vocab_size = get_int(j, "vocab_size", c.vocab_size, src);
  c.hidden_size = get_int(j, "hidden_size", c.hidden_size, src);
  c.intermediate_size = get_int(j, "intermediate_size", c.intermediate_size, src);
  c.num_hidden_layers = get_int(j, "num_hidden_layers", c.num_hidden_layers, src);
  c.num_attention_heads = get_int(j, "num_attention_heads", c.num_attention_heads, src);
  c.num_key_value_heads = get_int(j, "num_key_value_heads", c.num_key_value_heads, src);
  c.head_dim = get_int(j, "head_dim", c.head_dim, src);
  c.linear_conv_kernel_dim = get_int(j, "linear_conv_kernel_dim", c.linear_conv_kernel_dim, src);
  c.linear_key_head_dim = get_int(j, "linear_key_head_dim", c.linear_key_head_dim, src);
  c.linear_value_head_dim = get_int(j, "linear_value_head_dim", c.linear_value_head_dim, src);
  c.linear_num_key_heads = get_int(j, "linear_num_key_heads", c.linear_num_key_heads, src);
  c.linear_num_value_heads = get_int(j, "linear_num_value_heads", c.linear_num_value_heads, src);
  c.max_position_embeddings = get_int(j, "max_position_embeddings", c.max_position_embeddings, src);
  c.rms_norm_eps = get_num(j, "rms_norm_eps", c.rms_norm_eps, src);
  c.initializer_range = get_num(j, "initializer_range", c.initializer_range, src);
  c.tie_word_embeddings = top_tie_present ? top_tie : get_bool(j, "tie_word_embeddings", false, src);
  if (j.contains("hidden_act") && !j["hidden_act"].is_null()) {
    DS_CHECK(j["hidden_act"].is_string() && (j["hidden_act"] == "silu" || j["hidden_act"] == "swish"),
             "{}: unsupported hidden_act {} (only silu)", src, brief(j["hidden_act"]));
  }
  if (j.contains("attention_bias") && j["attention_bias"].is_boolean())
    DS_CHECK(!j["attention_bias"].get<bool>(), "{}: attention_bias=true is not supported", src);
  // RoPE: rope_parameters (v5), else legacy top-level fields.
  c.rope_theta = get_num(j, "rope_theta", c.rope_theta, src);
  c.partial_rotary_factor = get_num(j, "partial_rotary_factor", c.partial_rotary_factor, src);
  if (j.contains("rope_parameters") && !j["rope_parameters"].is_null()) {
    const json& rp = j["rope_parameters"];
    DS_CHECK(rp.is_object(), "{}: \"rope_parameters\" must be an object", src);
    std::string rt = rp.contains("rope_type") && rp["rope_type"].is_string() ? rp["rope_type"].get<std::string>()
                                                                             : "default";
    DS_CHECK(rt == "default", "{}: rope_parameters.rope_type \"{}\" is not supported (only \"default\")", src, rt);
    c.rope_theta = get_num(rp, "rope_theta", c.rope_theta, src + " rope_parameters");
    c.partial_rotary_factor = get_num(rp, "partial_rotary_factor", c.partial_rotary_factor, src + " rope_parameters");
  } else if (j.contains("rope_scaling") && j["rope_scaling"].is_object()) {
    const json& rs = j["rope_scaling"];
    std::string rt = rs.contains("rope_type") && rs["rope_type"].is_string() ? rs["rope_type"].get<std::string>()
                                                                             : "default";
    DS_CHECK(rt == "default", "{}: rope_scaling.rope_type \"{}\" is not supported", src, rt);
  }
  if (j.contains("eos_token_id") && j["eos_token_id"].is_number_integer())
    c.eos_token_id = get_int(j, "eos_token_id", -1, src);
  // Layer types: explicit list, else every full_attention_interval-th layer.
  if (j.contains("layer_types") && !j["layer_types"].is_null()) {
    const json& lt = j["layer_types"];
    DS_CHECK(lt.is_array(), "{}: \"layer_types\" must be a list", src);
    for (const auto& t : lt) {
      DS_CHECK(t.is_string() && (t == "linear_attention" || t == "full_attention"),
               "{}: layer_types entries must be \"linear_attention\" or \"full_attention\", got {}", src, brief(t));
      c.layer_types.push_back(t.get<std::string>());
    }
    DS_CHECK(static_cast<int64_t>(c.layer_types.size()) == c.num_hidden_layers,
             "{}: layer_types has {} entries but num_hidden_layers is {}", src, c.layer_types.size(),
             c.num_hidden_layers);
  } else {
    int64_t interval = get_int(j, "full_attention_interval", 4, src);
    DS_CHECK(interval >= 1, "{}: full_attention_interval must be >= 1, got {}", src, interval);
    DS_CHECK(c.num_hidden_layers >= 0 && c.num_hidden_layers <= kMaxLayers,
             "{}: num_hidden_layers must be a positive integer at most {}, got {}", src, kMaxLayers, c.num_hidden_layers);
    c.layer_types = interval_layers(c.num_hidden_layers, interval);
  }
  c.source = src;
  c.validate();
  return c;
}

void ModelConfig::validate() const {
  const std::string& s = source;
  auto positive = [&](int64_t v, const char* name, int64_t max) {
    DS_CHECK(v > 0 && v <= max, "{}: {} must be a positive integer at most {}, got {}", s, name, max, v);
  };
  positive(vocab_size, "vocab_size", kMaxVocab);
  positive(hidden_size, "hidden_size", kMaxWidth);
  positive(intermediate_size, "intermediate_size", kMaxWidth);
  positive(num_hidden_layers, "num_hidden_layers", kMaxLayers);
  positive(num_attention_heads, "num_attention_heads", kMaxHeads);
  positive(num_key_value_heads, "num_key_value_heads", kMaxHeads);
  positive(head_dim, "head_dim", kMaxHeads);
  positive(linear_conv_kernel_dim, "linear_conv_kernel_dim", kMaxHeads);
  positive(linear_key_head_dim, "linear_key_head_dim", kMaxHeads);
  positive(linear_value_head_dim, "linear_value_head_dim", kMaxHeads);
  positive(linear_num_key_heads, "linear_num_key_heads", kMaxHeads);
  positive(linear_num_value_heads, "linear_num_value_heads", kMaxHeads);
  positive(max_position_embeddings, "max_position_embeddings", kMaxPositions);
  // Projection widths (products of two fields, each <= 2^16 here, so no overflow).
  auto width = [&](int64_t v, const char* what) {
    DS_CHECK(v <= kMaxWidth, "{}: {} = {} is above {}", s, what, v, kMaxWidth);
  };
  width(num_attention_heads * head_dim, "num_attention_heads * head_dim");
  width(num_key_value_heads * head_dim, "num_key_value_heads * head_dim");
  width(key_dim(), "linear_num_key_heads * linear_key_head_dim");
  width(value_dim(), "linear_num_value_heads * linear_value_head_dim");
  DS_CHECK(num_attention_heads % num_key_value_heads == 0,
           "{}: num_attention_heads ({}) must be a multiple of num_key_value_heads ({})", s, num_attention_heads,
           num_key_value_heads);
  DS_CHECK(linear_num_value_heads % linear_num_key_heads == 0,
           "{}: linear_num_value_heads ({}) must be a multiple of linear_num_key_heads ({})", s,
           linear_num_value_heads, linear_num_key_heads);
  DS_CHECK(rms_norm_eps > 0 && rms_norm_eps < 1, "{}: rms_norm_eps must be in (0, 1), got {}", s, rms_norm_eps);
  DS_CHECK(rope_theta > 0 && std::isfinite(rope_theta), "{}: rope_theta must be positive and finite, got {}", s,
           rope_theta);
  DS_CHECK(partial_rotary_factor > 0 && partial_rotary_factor <= 1,
           "{}: partial_rotary_factor must be in (0, 1], got {}", s, partial_rotary_factor);
  DS_CHECK(rotary_dim() % 2 == 0 && rotary_dim() >= 2, "{}: head_dim * partial_rotary_factor = {} must be even and >= 2",
           s, rotary_dim());
  DS_CHECK(static_cast<int64_t>(layer_types.size()) == num_hidden_layers,
           "{}: {} layer types for {} layers", s, layer_types.size(), num_hidden_layers);
  DS_CHECK(initializer_range > 0 && std::isfinite(initializer_range),
           "{}: initializer_range must be positive and finite, got {}", s, initializer_range);
}

int64_t ModelConfig::num_parameters() const {
  int64_t H = hidden_size, I = intermediate_size;
  int64_t total = vocab_size * H + H;  // embed + final norm
  if (!tie_word_embeddings) total += vocab_size * H;
  for (int64_t i = 0; i < num_hidden_layers; ++i) {
    total += 2 * H + 3 * H * I;  // two norms, MLP
    if (is_full_attention(i)) {
      total += H * num_attention_heads * head_dim * 2 + 2 * H * num_key_value_heads * head_dim +
               num_attention_heads * head_dim * H + 2 * head_dim;
    } else {
      total += conv_dim() * H + value_dim() * H + 2 * linear_num_value_heads * H + conv_dim() * linear_conv_kernel_dim +
               2 * linear_num_value_heads + linear_value_head_dim + H * value_dim();
    }
  }
  return total;
}

void check_not_adapter_dir(const std::string& dir) {
  std::error_code ec;
  DS_CHECK(!std::filesystem::exists(std::filesystem::path(dir) / "adapter_config.json", ec), "{}: holds a LoRA adapter "
           "(adapter_config.json), not a model's weights: give the base model as --model and this directory as "
           "--adapter", dir);
}

ModelConfig ModelConfig::from_file(const std::string& path) {
  std::string file = path;
  if (std::filesystem::is_directory(path)) file = (std::filesystem::path(path) / "config.json").string();
  if (!file_exists(file) && std::filesystem::is_directory(path)) check_not_adapter_dir(path);
  DS_CHECK(file_exists(file), "{}: config file not found", file);
  DS_CHECK(!file.ends_with(".safetensors"), "{}: a safetensors weights file, not a model config; give the checkpoint "
           "directory that holds it beside its config.json (or a config.json)", file);
  json j;
  try {
    j = json::parse(read_file(file));
  } catch (const json::exception& e) {
    fail("{}: not a model config (a config.json): invalid JSON ({})", file, printable(e.what()));
  }
  return from_json(j, file);
}

std::vector<std::string> ModelConfig::preset_names() { return {"tiny", "0.8b", "2b", "4b", "9b", "27b"}; }

ModelConfig ModelConfig::preset(const std::string& name) {
  ModelConfig c;
  c.source = "preset " + name;
  c.vocab_size = 248320;
  c.head_dim = 256;
  c.linear_key_head_dim = c.linear_value_head_dim = 128;
  c.linear_num_key_heads = 16;
  c.max_position_embeddings = 262144;
  c.rope_theta = 1e7;
  c.partial_rotary_factor = 0.25;
  c.eos_token_id = 248044;
  auto sz = [&](int64_t H, int64_t L, int64_t I, int64_t hq, int64_t hkv, int64_t hv, bool tie) {
    c.hidden_size = H;
    c.num_hidden_layers = L;
    c.intermediate_size = I;
    c.num_attention_heads = hq;
    c.num_key_value_heads = hkv;
    c.linear_num_value_heads = hv;
    c.tie_word_embeddings = tie;
  };
  if (name == "0.8b") sz(1024, 24, 3584, 8, 2, 16, true);
  else if (name == "2b") sz(2048, 24, 6144, 8, 2, 16, true);
  else if (name == "4b") sz(2560, 32, 9216, 16, 4, 32, true);
  else if (name == "9b") sz(4096, 32, 12288, 16, 4, 32, false);
  else if (name == "27b") sz(5120, 64, 17408, 24, 4, 48, false);
  else if (name == "tiny") {
    // The embedded default: the Qwen3.5 architecture (3 GDN layers + 1 gated attention layer, tied embeddings) at a
    // width that trains on a 2-core CPU in minutes. Its vocabulary is the one Qwen3 models use with the bundled
    // Qwen3 tokenizer (151,669 ids, padded to 151,936), not Qwen3.5's 248,320: at hidden 64 the head is nearly all
    // of the compute, and 96k rows no token can reach would only cost time.
    sz(64, 4, 192, 4, 2, 4, true);
    c.vocab_size = 151936;
    c.head_dim = 32;
    c.linear_num_key_heads = 2;
    c.linear_key_head_dim = c.linear_value_head_dim = 16;
    c.max_position_embeddings = 4096;
    c.rope_theta = 10000.0;
    c.eos_token_id = 151643;  // <|endoftext|> of the bundled Qwen3 tokenizer
  } else {
    std::string names;
    for (auto& n : preset_names()) names += (names.empty() ? "" : ", ") + n;
    fail("unknown model preset \"{}\" (known: {})", name, names);
  }
  c.layer_types = interval_layers(c.num_hidden_layers, 4);
  c.validate();
  return c;
}

ModelConfig ModelConfig::resolve(const std::string& spec) {
  for (auto& n : preset_names())
    if (spec == n) return preset(spec);
  if (std::filesystem::exists(spec)) return from_file(spec);
  std::string names;
  for (auto& n : preset_names()) names += (names.empty() ? "" : ", ") + n;
  fail("--model {}: not a preset ({}) and no such file or directory", spec, names);
}

json ModelConfig::to_json() const {
  json j;
  j["architectures"] = json::array({"Qwen3_5ForCausalLM"});
  j["model_type"] = "qwen3_5_text";
  j["vocab_size"] = vocab_size;
  j["hidden_size"] = hidden_size;
  j["intermediate_size"] = intermediate_size;
  j["num_hidden_layers"] = num_hidden_layers;
  j["num_attention_heads"] = num_attention_heads;
  j["num_key_value_heads"] = num_key_value_heads;
  j["head_dim"] = head_dim;
  j["hidden_act"] = "silu";
  j["max_position_embeddings"] = max_position_embeddings;
  j["initializer_range"] = initializer_range;
  j["rms_norm_eps"] = rms_norm_eps;
  j["tie_word_embeddings"] = tie_word_embeddings;
  j["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", rope_theta},
                          {"partial_rotary_factor", partial_rotary_factor}};
  j["attention_bias"] = false;
  j["attention_dropout"] = 0.0;
  j["linear_conv_kernel_dim"] = linear_conv_kernel_dim;
  j["linear_key_head_dim"] = linear_key_head_dim;
  j["linear_value_head_dim"] = linear_value_head_dim;
  j["linear_num_key_heads"] = linear_num_key_heads;
  j["linear_num_value_heads"] = linear_num_value_heads;
  j["layer_types"] = layer_types;
  if (eos_token_id >= 0) j["eos_token_id"] = eos_token_id;
  j["dtype"] = "float32";
  return j;
}

}  // namespace ds
