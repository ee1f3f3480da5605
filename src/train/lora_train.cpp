#include "train/lora_train.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <memory>

#include <fmt/format.h>

#include "core/error.h"
#include "core/files.h"
#include "core/log.h"
#include "core/rng.h"
#include "model/safetensors.h"
#include "train/checkpoint.h"

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace ds {

namespace {

// Whether --model names a directory of HF weights (else a preset or config.json: the weights are initialised).
bool has_weights(const std::string& model) {
  return fs::is_directory(model) &&
         (file_exists(model + "/model.safetensors") || file_exists(model + "/model.safetensors.index.json"));
}

// A LoRA checkpoint holds no base: the base its run recorded (`model`: a preset, a config.json, or a checkpoint
// directory) must still be there, unless it is a preset or a config.json (the base is then initialised from the
// saved seed on the checkpoint's own config.json: nothing at the path is read). ds::Error naming `where` (the
// checkpoint) and the path otherwise.
void check_base_exists(const std::string& model, const std::string& where) {
  std::error_code ec;
  const auto presets = ModelConfig::preset_names();
  if (fs::exists(model, ec) || fs::path(model).extension() == ".json" ||
      std::count(presets.begin(), presets.end(), model))
    return;
  fail("{}: its base model {} (options.model) does not exist: a LoRA checkpoint holds the adapter only; put the base "
       "the adapter was trained on back at that path", where, model);
}

// The fingerprint `got` of the base rebuilt from the checkpoint's record against the one it trained on (`lora`: the
// checkpoint's "lora" record). ds::Error naming `where` (the checkpoint), the base's path and both fingerprints.
void check_base_fingerprint(const json& lora, const std::string& got, const std::string& model,
                            const std::string& where) {
  DS_CHECK(lora["base_fingerprint"] == json(got), "{}: the base model's weights ({}) have the fingerprint {}, but the "
           "adapter was trained on weights with the fingerprint {} (lora.base_fingerprint): the base changed since; "
           "use the base the adapter was trained on", where, model, got, lora["base_fingerprint"].dump());
}

}  // namespace

bool lora_run(const TrainOptions& o) { return o.lora_rank > 0 || !o.adapter.empty(); }

LoraConfig lora_config_of(const TrainOptions& o) {
  LoraConfig c;
  c.r = o.lora_rank;
  c.lora_alpha = o.lora_alpha;
  c.lora_dropout = o.lora_dropout;
  c.use_rslora = o.use_rslora;
  c.target_modules = parse_lora_targets(split_lora_targets(o.lora_targets), "--lora-targets");
  return c;
}

WeightsFingerprint::WeightsFingerprint(int64_t total) : h_(splitmix64(static_cast<uint64_t>(total))) {}

void WeightsFingerprint::add(const float* w, int64_t n) {
  int64_t i = 0;
  if (odd_ && n > 0) {  // the pair the last call left open
    uint64_t pair = 0;
    std::memcpy(&pair, &held_, sizeof held_);
    std::memcpy(reinterpret_cast<char*>(&pair) + sizeof held_, w, sizeof(float));
    h_ = splitmix64(h_ ^ pair);
    odd_ = false;
    i = 1;
  }
  for (; i + 1 < n; i += 2) {
    uint64_t pair = 0;
    std::memcpy(&pair, w + i, sizeof pair);
    h_ = splitmix64(h_ ^ pair);
  }
  if (i < n) {
    std::memcpy(&held_, w + i, sizeof held_);
    odd_ = true;
  }
}

std::string WeightsFingerprint::hex() const {
  uint64_t h = h_;
  if (odd_) h = splitmix64(h ^ static_cast<uint64_t>(held_));
  return fmt::format("{:016x}", h);
}

std::string weights_fingerprint(const std::vector<float>& w) {
  WeightsFingerprint f(static_cast<int64_t>(w.size()));
  f.add(w.data(), static_cast<int64_t>(w.size()));
  return f.hex();
}

std::string model_fingerprint(const Qwen35Model& model) {
  WeightsFingerprint f(model.num_parameters());
  int64_t largest = 0;
  for (const ParamSpec& p : model.params()) largest = std::max(largest, p.numel);
  std::vector<float> stage(static_cast<size_t>(largest));
  for (size_t k = 0; k < model.params().size(); ++k) {
    model.fill_param(k, stage.data());
    f.add(stage.data(), model.params()[k].numel);
  }
  return f.hex();
}

LoraConfig run_lora_config(const TrainOptions& o) {
  if (!o.resume.empty()) return read_lora_config(o.resume);
  if (!o.adapter.empty()) return read_lora_config(o.adapter);
  return lora_config_of(o);
}

bool multimodal_layout(const std::string& model) {
  if (!has_weights(model)) return false;
  const CheckpointReader ck(model);
  for (const std::string& n : ck.names())
    if (n.rfind("model.language_model.", 0) == 0) return true;
  return false;
}

json attach_lora(const TrainOptions& opt, Qwen35Model& model, const SavedCheckpoint* resumed) {
  if (resumed) check_base_exists(opt.model, "--resume " + opt.resume);
  // Parameter by parameter (a GPU run's base is never whole on the host: Qwen35Model::fill_param).
  const std::string fingerprint = model_fingerprint(model);
  std::shared_ptr<LoraAdapter> adapter;
  if (resumed) {
    DS_CHECK(resumed->lora.is_object() && resumed->lora.contains("base_fingerprint"), "{}: field \"lora\" (the "
             "frozen base's fingerprint) is missing, but the options name a LoRA run (options.lora_rank {}, "
             "options.adapter \"{}\")", resumed->path, opt.lora_rank, opt.adapter);
    check_base_fingerprint(resumed->lora, fingerprint, opt.model, "--resume " + opt.resume);
    adapter = std::make_shared<LoraAdapter>(LoraAdapter::load(opt.resume, model.config()));
  } else if (!opt.adapter.empty()) {
    adapter = load_adapter(opt.adapter, model, opt.model);
  } else {
    adapter = std::make_shared<LoraAdapter>(model.config(), lora_config_of(opt), multimodal_layout(opt.model));
    adapter->init_peft(opt.seed);
  }
  model.set_adapter(adapter);
  const LoraConfig& c = adapter->config();
  log_info("LoRA: rank {}, alpha {}{}, dropout {}, {} adapted matrices, {} trainable parameters ({:.3f}% of the "
           "frozen base's {}); base fingerprint {}", c.r, c.lora_alpha, c.use_rslora ? " (rsLoRA)" : "",
           c.lora_dropout, adapter->specs().size(), adapter->values().size(),
           100.0 * static_cast<double>(adapter->values().size()) / static_cast<double>(model.num_parameters()),
           model.num_parameters(), fingerprint);
  return {{"base_model", opt.model}, {"base_fingerprint", fingerprint}};
}

void save_lora_checkpoint_weights(const std::string& dir, const ModelConfig& config, const LoraAdapter& adapter,
                                  const json& base) {
  adapter.save(dir, base.value("base_model", std::string()));
  write_file_atomic((fs::path(dir) / "config.json").string(), config.to_json().dump(2) + "\n");
}

void set_lora_dropout(Engine& engine, uint64_t seed, int64_t micro_index) {
  engine.set_lora_dropout_key(LoraAdapter::dropout_key(seed, micro_index));
}

bool is_lora_checkpoint(const std::string& dir) {
  return file_exists((fs::path(dir) / "adapter_config.json").string()) &&
         file_exists((fs::path(dir) / "trainer_state.json").string());
}

Qwen35Model lora_base_model(const std::string& dir) {
  const SavedCheckpoint ck = read_checkpoint_state(dir);
  const json& o = ck.options;
  DS_CHECK(o.contains("model") && o["model"].is_string() && o.contains("seed") && o["seed"].is_number_unsigned(),
           "{}: fields \"options.model\" and \"options.seed\" (the LoRA run's base) are missing or malformed",
           ck.path);
  DS_CHECK(ck.lora.is_object() && ck.lora.contains("base_fingerprint"), "{}: field \"lora\" (the frozen base's "
           "fingerprint) is missing: not a LoRA checkpoint", ck.path);
  const std::string model_path = o["model"].get<std::string>();
  check_base_exists(model_path, dir);
  Qwen35Model model(ModelConfig::from_file(dir));
  if (has_weights(model_path)) model.load(model_path);
  else model.init_weights(o["seed"].get<uint64_t>());
  check_base_fingerprint(ck.lora, model_fingerprint(model), model_path, dir);
  return model;
}

std::shared_ptr<LoraAdapter> load_adapter(const std::string& dir, Qwen35Model& model, const std::string& model_path) {
  auto adapter = std::make_shared<LoraAdapter>(LoraAdapter::load(dir, model.config()));
  if (!is_lora_checkpoint(dir)) return adapter;
  const json lora = read_checkpoint_state(dir).lora;
  if (!lora.is_object() || !lora.contains("base_fingerprint")) return adapter;
  const std::string got = model_fingerprint(model);  // parameter by parameter: a deferred base stays deferred
  DS_CHECK(lora["base_fingerprint"] == json(got), "--adapter {}: this LoRA checkpoint was trained on the base {} "
           "(fingerprint {}, its trainer_state.json: lora.base_fingerprint), but the weights of --model {} have the "
           "fingerprint {}: an adapter fits only the base it was trained on", dir, lora.value("base_model", json()).dump(),
           lora["base_fingerprint"].dump(), model_path, got);
  return adapter;
}

void merge_lora(Qwen35Model& model, const LoraAdapter& a) {
  const int64_t r = a.config().r;
  const float s = static_cast<float>(a.config().scaling());
  for (const LoraTensorSpec& sp : a.specs()) {
    const std::string name = fmt::format("model.layers.{}.{}.weight", sp.layer, lora_module_path(sp.module));
    const ParamSpec& p = model.spec(name);
    DS_CHECK(p.shape == std::vector<int64_t>({sp.out, sp.in}), "LoRA: the adapter of {} does not fit {}",
             a.key(sp, false), name);
    float* W = model.weight(name);
    const float* A = a.values().data() + sp.a_offset;  // [r, in]
    const float* B = a.values().data() + sp.b_offset;  // [out, r]
#pragma omp parallel for schedule(static)
    for (int64_t o = 0; o < sp.out; ++o)
      for (int64_t i = 0; i < sp.in; ++i) {
        float acc = 0;
        for (int64_t k = 0; k < r; ++k) acc += B[o * r + k] * A[k * sp.in + i];
        W[o * sp.in + i] += s * acc;
      }
  }
}

}  // namespace ds
