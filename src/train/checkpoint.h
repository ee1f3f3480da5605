// The trainer's checkpoints (docs/checkpoints.md): OUT/checkpoint-STEP/ holds the weights (HF layout), the optimizer
// state, tokenizer.json and trainer_state.json. A save writes a temp dir, fsyncs it and renames it into place, so a
// kill never leaves a partial checkpoint-STEP; --keep-last prunes the run's older ones; resume reads them back.
#pragma once
#include <cstdint>
#include <functional>
#include <string>

#include <nlohmann/json.hpp>

#include "model/engine.h"
#include "train/options.h"

namespace ds {

// Where a run stands: trainer_state.json, less the options.
struct TrainerState {
  int64_t step = 0;             // the checkpoint's step (skipped steps included)
  int64_t optimizer_steps = 0;  // AdamW updates taken (its bias correction step)
  int64_t tokens_seen = 0;
  double elapsed_s = 0;
  int64_t world_size = 1;       // ranks of the run that saved it (each ran grad_accum micro-batches per step)
};

// A fresh run's id: 64 random bits in hex (only used to tell runs apart in one --out).
std::string new_run_id();

// The id of the branch that a resume of run `run_id` from step `step` into another run directory `out` (its
// canonical path) starts: 16 hex digits of an FNV-1a hash of the three, so the same resume into the same directory
// (a retry after a kill) continues the same branch, and any other resume there is another run's.
std::string branch_run_id(const std::string& run_id, int64_t step, const std::string& out);

// A checkpoint's trainer_state.json: its state and saved options. ds::Error naming the file when it is missing,
// not JSON, or without a non-negative "step" and "options".
struct SavedCheckpoint {
  TrainerState state;
  // The run, kept across resumes; empty in checkpoints written before run ids existed (those count as this run's).
  std::string run_id;
  // Where the run's branch starts (trainer_state.json "resumed_from": {"run_id", "step", "path"} of the checkpoint
  // it was resumed from into another directory); null for a run that started fresh.
  nlohmann::json resumed_from;
  nlohmann::json options;
  nlohmann::json data;  // the data's fingerprint (Checkpoints' `data`); null in checkpoints of earlier versions
  nlohmann::json lora;  // a LoRA run's base (Checkpoints::set_lora: "base_model", "base_fingerprint"); else null
  std::string path;     // of trainer_state.json
};
SavedCheckpoint read_checkpoint_state(const std::string& dir);

// What a checkpoint holds besides its tensors (safetensors headers, JSON files, the tokenizer): 64 MiB at most.
constexpr int64_t kCheckpointSlackBytes = int64_t{64} << 20;
// Bytes the tensors take as stored: each one's elements times its dtype's size (no headers).
int64_t stored_bytes(const std::vector<SaveTensor>& ts);
// The bytes a checkpoint of a model of `config` takes at most, parameter by parameter as the engines store them:
// fp32 state: F32 weights and two F32 moments (12 bytes per parameter); bf16: the matrices' BF16 weights and moments
// (6); 8bit: the matrices' BF16 weights and U8 codes plus an F32 scale per 256 (about 4.03), or F32 moments where
// `shard` is not "none" (the sharded 8bit state stores them dequantized: 10); the other parameters 12 in every
// state; plus kCheckpointSlackBytes. Equal to stored_bytes of the engine's checkpoint_weight_tensors() and
// optimizer_tensors() plus that slack (tests: CheckpointCodes, CudaEngine.EightBitCheckpointStoresCodes...). What the trainer checks the free space against before it
// trains (27B in the 8bit state: 101.1 GiB).
int64_t checkpoint_bytes_estimate(const ModelConfig& config, const std::string& optimizer_state,
                                  const std::string& shard = "none");

// Restores the engine's optimizer state from checkpoint `dir` (optimizer.safetensors or its sharded index).
void load_optimizer_state(Engine& engine, const std::string& dir);

// The checkpoints in --out of a run that starts at start_step (its resumed step, or 0).
class Checkpoints {
 public:
  // For a run directory claimed by the run (RunDirectory::claim): a file named like a checkpoint this run will save
  // is a ds::Error now. Every checkpoint gets a copy of `tokenizer_json` (the tokenizer the run reads) and, in
  // trainer_state.json, `data` (what identifies the training and validation documents) and, when not null,
  // `resumed_from` (where the run's branch starts).
  Checkpoints(const TrainOptions& opt, int64_t start_step, std::string run_id, std::string tokenizer_json,
              nlohmann::json data, nlohmann::json resumed_from = nullptr);

  // A LoRA run (train/lora_train.h): each checkpoint holds the adapter (PEFT's adapter_config.json and
  // adapter_model.safetensors, the base's config.json) instead of the weights, its AdamW moments, and `base` (what
  // identifies the frozen base: "base_model", "base_fingerprint") as trainer_state.json's "lora"; adapter_floats:
  // the adapter's size (the checkpoint's size estimate).
  void set_lora(nlohmann::json base, int64_t adapter_floats) {
    lora_ = std::move(base);
    lora_floats_ = adapter_floats;
  }
  // Whether the run saves a checkpoint after `step`: every --save-interval steps and at the last one; never with
  // --no-save.
  bool due(int64_t step) const;
  // Saves checkpoint-<state.step> (replacing one of the same step atomically), calls `saved` with its path once it
  // is durable, then prunes for --keep-last (so what `saved` records, e.g. the checkpoint a second signal names, is
  // never one that the pruning is removing). Returns the checkpoint's path.
  std::string save(Engine& engine, const TrainerState& state,
                   const std::function<void(const std::string&)>& saved = {});
  // Before training (last_checkpoint "") and after each save: a ds::Error when the next checkpoint this run saves
  // after `step` (checkpoint_bytes_estimate) does not fit in the free space of --out, so that a run never trains
  // for hours to fail at its save. After a save the error names `last_checkpoint` and the resume command. Nothing
  // with --no-save.
  void check_room_for_next_save(const ModelConfig& config, int64_t step, const std::string& last_checkpoint) const;

 private:
  void prune(int64_t step);
  // ds::Error "<what> needs X GiB but only Y GiB is free ...<then>" when `need` bytes exceed --out's free space.
  void check_room(int64_t need, const std::string& what, const std::string& then) const;

  TrainOptions opt_;

 public:
  // The run directory moved (renamed while the run trained): later saves go to `out`.
  void move_to(const std::string& out) { opt_.out = out; }

 private:
  int64_t start_step_;
  std::string run_id_;
  std::string session_id_;  // this process: --keep-last prunes its saves, and the run's up to the resumed step
  std::string tokenizer_json_;
  nlohmann::json data_;
  nlohmann::json resumed_from_;
  nlohmann::json lora_;
  int64_t lora_floats_ = 0;
};

}  // namespace ds
