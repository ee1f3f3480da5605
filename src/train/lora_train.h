// LoRA training on the CPU engine (docs/lora.md, issue 26): the pieces the trainer, its checkpoints and `export`
// hook in. The base model is frozen (no gradient, no optimizer state); the adapter (model/lora.h) is trained with
// fp32 masters and AdamW by the engine (model/engine.h: Engine::adapter()). A LoRA checkpoint holds the adapter in
// PEFT's files, its AdamW moments, the base's config.json, and in trainer_state.json "lora": {"base_model": the
// base's --model, "base_fingerprint": weights_fingerprint of its weights}, checked at resume and at export --merge.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "model/engine.h"
#include "model/lora.h"
#include "model/model.h"
#include "train/options.h"

namespace ds {

struct SavedCheckpoint;  // train/checkpoint.h

// Whether the run trains a LoRA adapter: --lora-rank > 0 or --adapter (a resume: its saved options).
bool lora_run(const TrainOptions& o);

// The adapter config of --lora-rank, --lora-alpha, --lora-dropout, --lora-targets, --use-rslora.
LoraConfig lora_config_of(const TrainOptions& o);

// The adapter config of a LoRA run: a --resume checkpoint's adapter_config.json, else --adapter's, else
// lora_config_of (what the GPU plan sizes before the adapter is read: model/engine.h GpuPlan::lora).
LoraConfig run_lora_config(const TrainOptions& o);

// 16 hex digits identifying fp32 weights: a 64-bit hash of their bits in order (SplitMix64 finalizer over each
// pair of floats, chained; core/rng.h). Equal weights give equal strings; any changed bit changes it (up to
// collisions, probability ~2^-64).
std::string weights_fingerprint(const std::vector<float>& weights);
// The same hash fed in pieces (any split of the same values in order gives the same string): `total` values in
// all, add() them in order, then hex().
class WeightsFingerprint {
 public:
  explicit WeightsFingerprint(int64_t total);
  void add(const float* w, int64_t n);
  std::string hex() const;

 private:
  uint64_t h_;
  bool odd_ = false;  // a value waits for its pair's second half
  uint32_t held_ = 0;
};
// weights_fingerprint of a model's weights, read parameter by parameter (Qwen35Model::fill_param: a deferred model
// stays deferred, so a GPU run never holds its base whole on the host).
std::string model_fingerprint(const Qwen35Model& model);

// Whether the checkpoint at `model` (a directory of HF safetensors) stores the text model under
// "model.language_model." (the released multimodal layout): the adapter's keys then take PEFT's multimodal prefix.
// False for a preset or config.json.
bool multimodal_layout(const std::string& model);

// Puts the run's adapter on `model` (the base's fingerprint is taken of its weights, model_fingerprint) and
// returns the "lora" record of its checkpoints. The adapter: on --resume the checkpoint's own (adapter_config.json,
// adapter_model.safetensors), after checking that the base's fingerprint is the one it was trained on (ds::Error
// naming the checkpoint, both fingerprints and the base's path otherwise); with --adapter DIR that adapter; else a
// new one of lora_config_of(opt), PEFT-initialised from --seed (LoraAdapter::init_peft). The model stays deferred
// (the fingerprint is taken parameter by parameter), for either engine.
nlohmann::json attach_lora(const TrainOptions& opt, Qwen35Model& model, const SavedCheckpoint* resumed);

// A LoRA checkpoint's weights into `dir`: the adapter's PEFT files (base_model_name_or_path: base["base_model"])
// and the base's config.json.
void save_lora_checkpoint_weights(const std::string& dir, const ModelConfig& config, const LoraAdapter& adapter,
                                  const nlohmann::json& base);

// Before micro-batch `micro_index` (0-based over the run: ((step - 1) * ranks + rank) * grad_accum + a, the
// window order's index, so N ranks draw the masks one rank would): the adapter's dropout key from --seed
// (LoraAdapter::dropout_key). No-op for a full run.
void set_lora_dropout(Engine& engine, uint64_t seed, int64_t micro_index);

// Whether `dir` holds a LoRA checkpoint of `deltastack train` (adapter files and trainer_state.json).
bool is_lora_checkpoint(const std::string& dir);

// The frozen base of LoRA checkpoint `dir`, as its run built it (the config in dir; the weights of the saved
// options' --model directory, or initialised from the saved --seed for a preset or config.json), its fingerprint
// checked against trainer_state.json's (ds::Error naming both and the base's path).
Qwen35Model lora_base_model(const std::string& dir);

// The adapter in `dir` (LoraAdapter::load) for `model`. When `dir` is a LoRA checkpoint of `deltastack train`
// (trainer_state.json records its base's fingerprint), `model`'s weights (materialized here) must be that base:
// ds::Error naming dir, the recorded base, `model_path` (the --model given) and both fingerprints otherwise (same
// shapes, other weights: the adapter would apply silently to a base it was not trained on). A PEFT adapter directory
// records no fingerprint: only its shapes are checked. train --adapter, eval, generate and forward --adapter.
std::shared_ptr<LoraAdapter> load_adapter(const std::string& dir, Qwen35Model& model, const std::string& model_path);

// W += scaling * lora_B lora_A for every adapted matrix of `model` (the merged model computes what the base with
// the adapter computes, without dropout). ds::Error when the adapter does not fit the model.
void merge_lora(Qwen35Model& model, const LoraAdapter& adapter);

}  // namespace ds
