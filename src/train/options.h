// The train options, each defined once in train_options() (options.cpp): its flag, member, default, help text,
// range, whether a --resume may change it and how trainer_state.json keeps it. The CLI flags (options_cli.h), the
// checkpoint's "options" object, validation and the resume rules are all derived from that table.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include <nlohmann/json.hpp>

namespace ds {

// Every member but `given` is a train option; the defaults are the table's.
struct TrainOptions {
  TrainOptions();

  std::string model;
  std::vector<std::string> data;
  std::string tokenizer;
  std::string txt_split;
  int64_t seq_len, micro_batch, grad_accum, steps, warmup;
  std::string schedule;
  double lr, min_lr_ratio, weight_decay, beta1, beta2, adam_eps, clip, z_loss, val_fraction;
  std::vector<std::string> val_data;
  int64_t eval_interval, eval_batches, save_interval, keep_last, max_shard_mb;
  uint64_t seed;
  std::string out;
  int threads;
  std::string nan_policy;
  std::string resume;
  std::string device;
  std::string optimizer_state, recompute, memory;
  double max_memory;      // GiB of GPU memory the run may use, the CUDA context included (0: all that is free)
  std::string precision;  // bf16 | fp8 (the decoder's matrix GEMMs; docs/fp8.md)
  bool fp8_lm_head;       // --fp8-lm-head: the lm head's gradient GEMMs in FP8 too (GpuPlan::fp8_lm_head)
  std::string gradients;  // fp32 | in-backward (model/engine.h Gradients)
  std::string shard;  // none | optimizer (several ranks; docs/distributed.md)
  // LoRA (docs/lora.md): --lora-rank R > 0 trains a new adapter (0: every parameter), --adapter DIR continues one.
  int64_t lora_rank;
  double lora_alpha, lora_dropout;
  std::string lora_targets;  // all-linear, or a comma list of module names (model/lora.h parse_lora_targets)
  bool use_rslora;
  std::string adapter;
  bool move_aside;
  bool no_save;  // no checkpoint at all (Checkpoints::due; the trainer's signal and data-changed saves)
  bool offload_activations;  // --offload-activations (GpuPlan::offload_activations)
  std::string data_changed;
  std::vector<std::string> given;  // long names of the flags on the command line (without "--")

  bool was_given(std::string_view flag) const;
};

// How a --resume and trainer_state.json treat an option (bits; 0: saved, always present, fixed on resume).
enum TrainOptionTraits : unsigned {
  kResumable = 1,  // a --resume may change it (any other flag given with --resume is an error)
  kNotSaved = 2,   // not in trainer_state.json
  kNewerKey = 4,   // absent in checkpoints of earlier versions: those read the default (or set_older's value)
  kGlobal = 8,     // a flag of every subcommand, registered on the top-level app (--threads)
};

template <class T>
using TrainMember = T TrainOptions::*;

struct TrainOption {
  std::string flag;  // the long flag without "--"; its trainer_state.json key is the same with '_' ("seq_len")
  std::variant<TrainMember<std::string>, TrainMember<std::vector<std::string>>, TrainMember<int64_t>,
               TrainMember<uint64_t>, TrainMember<double>, TrainMember<int>, TrainMember<bool>>
      member;
  std::string help;  // a bool option is a flag without a value (--move-aside)
  bool shows_default;  // `--help` shows the default (not for an empty one)
  unsigned traits;     // TrainOptionTraits
  std::function<void(TrainOptions&)> set_default;
  // kNewerKey options whose earlier versions ran with another value than today's default: what a checkpoint
  // without the key reads instead (empty: the default).
  std::function<void(TrainOptions&)> set_older;
  std::function<void(const TrainOptions&)> check;  // ds::Error naming the flag; empty: any value

  std::string key() const;
  bool has(TrainOptionTraits t) const { return (traits & t) != 0; }
};

// The table, in `deltastack train --help` order.
const std::vector<TrainOption>& train_options();
const TrainOption& train_option(std::string_view flag);  // ds::Error for a flag not in the table

// ds::Error naming the flag of the first option out of range (or of two that contradict each other).
void validate(const TrainOptions& o);

// --lora-targets' comma list as names (parse_lora_targets, model/lora.h, checks them); ds::Error for an empty name.
std::vector<std::string> split_lora_targets(const std::string& list);

// The flags a --resume may change, as "--steps, --out, ..." (for messages and --help).
std::string resumable_flags();

// trainer_state.json's "options": every saved option under its key.
nlohmann::json options_to_json(const TrainOptions& o);

// The options of a run resumed from a checkpoint that saved `saved` (in the file `src`): those, but the flags given
// on this command line that a resume may change; any other given flag is a ds::Error (a flag is never silently
// ignored). --out defaults to the checkpoint's own run directory.
TrainOptions resumed_options(const TrainOptions& cli, const nlohmann::json& saved, const std::string& src);

}  // namespace ds
