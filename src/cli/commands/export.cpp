// `deltastack export`: a training checkpoint (fp32 master weights) as a Hugging Face release-style model
// directory: config.json, bf16 (or fp32) weights under HF names with A_log and the gated-norm weight kept fp32
// (as Qwen3.5's released checkpoints), sharded past --max-shard-mb, plus the checkpoint's tokenizer.json.
#include <filesystem>

#include "cli/commands/commands.h"
#include "core/error.h"
#include "core/files.h"
#include "core/log.h"
#include "model/config.h"
#include "model/model.h"
#include "model/safetensors.h"

namespace ds::cli {

int cmd_export(const std::string& checkpoint, const std::string& out, const std::string& dtype, int64_t max_shard_mb) {
  namespace fs = std::filesystem;
  DS_CHECK(dtype == "bf16" || dtype == "f32", "--dtype must be bf16 or f32, got \"{}\"", dtype);
  DS_CHECK(max_shard_mb >= 1 && max_shard_mb <= 1000000, "--max-shard-mb must be in [1, 1000000], got {}", max_shard_mb);
  std::error_code ec;
  DS_CHECK(!fs::exists(out, ec) || (fs::is_directory(out, ec) && fs::is_empty(out, ec)),
           "{}: output exists and is not an empty directory (nothing is overwritten)", out);
  DS_CHECK(fs::is_directory(checkpoint, ec), "{}: not a checkpoint directory", checkpoint);
  ModelConfig c = ModelConfig::from_file(checkpoint);
  Qwen35Model m(c);
  m.load(checkpoint);  // every parameter present, shapes match, values finite
  m.save(out, dtype == "bf16" ? DType::BF16 : DType::F32, max_shard_mb * 1000000);
  const std::string tok = (fs::path(checkpoint) / "tokenizer.json").string();
  if (file_exists(tok)) write_file_atomic((fs::path(out) / "tokenizer.json").string(), read_file(tok));
  log_info("exported {} ({} parameters, {}) to {}", checkpoint, m.num_parameters(), dtype, out);
  return 0;
}

}  // namespace ds::cli
