// `deltastack export`: a training checkpoint (fp32 master weights) as a Hugging Face release-style model
// directory: config.json, bf16 (or fp32) weights under HF names with A_log and the gated-norm weight kept fp32
// (as Qwen3.5's released checkpoints), sharded past --max-shard-mb, plus the checkpoint's tokenizer.json. A LoRA
// run's checkpoint (train/lora_train.h) exports as a PEFT adapter directory, or with --merge as the full model with
// the adapter merged into its weights.
#include <algorithm>
#include <filesystem>
#include <memory>
#include <vector>

#include "cli/commands/commands.h"
#include "core/error.h"
#include "core/files.h"
#include "core/fs_safety.h"
#include "core/log.h"
#include "model/config.h"
#include "model/model.h"
#include "model/safetensors.h"
#include "train/checkpoint.h"
#include "train/lora_train.h"

namespace ds::cli {

namespace {

namespace fs = std::filesystem;

// The checkpoint's tokenizer.json into the export `dir` (a warning when it has none).
void copy_tokenizer(const std::string& checkpoint, const std::string& dir) {
  const std::string tok = (fs::path(checkpoint) / "tokenizer.json").string();
  if (file_exists(tok))
    write_file_atomic((fs::path(dir) / "tokenizer.json").string(), read_file(tok));
  else
    log_warn("{} has no tokenizer.json: the export has none either (pass --tokenizer to eval/generate)", checkpoint);
}

// The finished export renamed into place, replacing only what was checked at the start (nothing, or that empty
// directory).
void commit_export(TempDir& tmp, const FileIdentity& existing, const std::string& out) {
  tmp.commit(existing, [&](const std::string& old) {
    std::error_code ec;
    DS_CHECK(fs::is_empty(old, ec), "{}: files were written there while this export ran; not replacing them", out);
  });
}

// A LoRA checkpoint into `dir`: its adapter as PEFT's files (adapter_config.json with base_model_name_or_path the
// run's base, adapter_model.safetensors fp32, the key layout the run trained with), or with `merge` the base with
// W += scaling * lora_B lora_A as a model directory of dtype `as`.
void export_lora(const std::string& checkpoint, const std::string& dir, bool merge, DType as, int64_t shard_bytes) {
  const ModelConfig c = ModelConfig::from_file(checkpoint);
  const LoraAdapter adapter = LoraAdapter::load(checkpoint, c);
  if (!merge) {
    const nlohmann::json lora = read_checkpoint_state(checkpoint).lora;
    adapter.save(dir, lora.is_object() ? lora.value("base_model", std::string()) : std::string());
    return;
  }
  Qwen35Model model = lora_base_model(checkpoint);
  merge_lora(model, adapter);
  save_model_dir(dir, c, model.to_tensors(model.weights(), as), as, shard_bytes);
}

}  // namespace

int cmd_export(const std::string& checkpoint, const std::string& out, const std::string& dtype, int64_t max_shard_mb,
               bool merge) {
  namespace fs = std::filesystem;
  DS_CHECK(dtype == "bf16" || dtype == "f32", "--dtype must be bf16 or f32, got \"{}\"", dtype);
  DS_CHECK(max_shard_mb >= 1 && max_shard_mb <= 1000000, "--max-shard-mb must be in [1, 1000000], got {}", max_shard_mb);
  std::error_code ec;
  const std::string last = fs::path(out).lexically_normal().filename().string();
  DS_CHECK(!last.empty() && last != "." && last != "..", "{}: name the output directory itself", out);
  DS_CHECK(!fs::is_symlink(fs::path(out).lexically_normal(), ec), "{}: is a symbolic link; give the real path", out);
  DS_CHECK(!fs::exists(out, ec) || (fs::is_directory(out, ec) && fs::is_empty(out, ec)),
           "{}: output exists and is not an empty directory (nothing is overwritten)", out);
  DS_CHECK(fs::is_directory(checkpoint, ec), "{}: not a checkpoint directory", checkpoint);
  // Real paths (symlinks resolved) for the containment check and for every write below.
  const fs::path ck = fs::canonical(checkpoint), dst = fs::weakly_canonical(out);
  const FileIdentity existing = file_identity(dst.string());  // all that the final rename may replace
  const auto rel = dst.lexically_relative(ck);
  DS_CHECK(rel.empty() || *rel.begin() == "..", "{}: the output may not be inside the checkpoint {}", out, checkpoint);
  const bool lora = is_lora_checkpoint(checkpoint);
  DS_CHECK(lora || !merge, "--merge: {} is not a LoRA checkpoint (no adapter_config.json): its weights are the "
           "whole model already; export it without --merge", checkpoint);
  const DType as = dtype == "bf16" ? DType::BF16 : DType::F32;
  if (lora) {  // the adapter or the merged model, built in a temp dir beside the destination as below
    TempDir::remove_stale(dst.string(), ".export.tmp.", /*hidden=*/true);
    TempDir tmp(dst.string(), ".export.tmp.", /*hidden=*/true, out);
    export_lora(checkpoint, tmp.path(), merge, as, max_shard_mb * 1000000);
    copy_tokenizer(checkpoint, tmp.path());
    commit_export(tmp, existing, out);
    log_info("exported the LoRA checkpoint {} to {} ({})", checkpoint, out,
             merge ? fmt::format("the base with the adapter merged, {}", dtype) : std::string("a PEFT adapter"));
    return 0;
  }
  ModelConfig c = ModelConfig::from_file(checkpoint);
  // Streamed: names and shapes are checked now, each tensor's values are read (and checked finite) when its turn
  // comes in the write, so host memory holds one tensor at a time (the largest, the embedding, for any model size).
  const std::vector<ParamSpec> params = qwen35_params(c);
  const CheckpointWeights weights(checkpoint, c, params);
  weights.check_tied_head(params.front());  // the embedding comes first in the table
  struct Current {
    const ParamSpec* p = nullptr;
    std::vector<float> values;
  };
  auto current = std::make_shared<Current>();
  // Built in ".<name>.export.tmp.<pid>" beside the destination (those of killed exports go first; ours is removed
  // on failure and on SIGINT / SIGTERM) and renamed into place at the end, replacing only what was checked above
  // (nothing, or that empty directory): a concurrent export into the same destination never removes this one's
  // files, and the one that finishes second fails instead of replacing the first one's output.
  TempDir::remove_stale(dst.string(), ".export.tmp.", /*hidden=*/true);
  TempDir tmp(dst.string(), ".export.tmp.", /*hidden=*/true, out);
  std::vector<SaveTensor> tensors;
  for (const ParamSpec& p : params)
    tensors.push_back(make_tensor_f32_reader(p.name, p.shape, [&weights, current, &p, &tmp](int64_t first,
                                                                                             int64_t count, float* dst) {
      if (current->p != &p) {  // the next tensor: a signal stops the export here
        tmp.check_signal();
        current->values = weights.read(p);
        current->p = &p;
      }
      std::copy(current->values.begin() + first, current->values.begin() + first + count, dst);
    }, stored_dtype(p, as)));
  int64_t num_parameters = 0;
  for (const ParamSpec& p : params) num_parameters += p.numel;
  save_model_dir(tmp.path(), c, tensors, as, max_shard_mb * 1000000);
  copy_tokenizer(checkpoint, tmp.path());
  commit_export(tmp, existing, out);
  log_info("exported {} ({} parameters, {}) to {}", checkpoint, num_parameters, dtype, out);
  return 0;
}

}  // namespace ds::cli
