// The training loop: packed data, grad accumulation, AdamW with warmup + cosine/linear/constant schedule,
// global grad-norm clipping, a NaN/Inf guard, held-out evaluation, metrics.jsonl, crash-safe checkpoints and
// bitwise resume.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace ds {

struct TrainOptions {
  std::string model = "tiny";          // preset name, config.json, or HF checkpoint dir (weights loaded)
  std::vector<std::string> data;       // .txt / .jsonl files (empty: the bundled tiny Shakespeare)
  std::string tokenizer;               // tokenizer.json (empty: the bundled Qwen3 tokenizer)
  std::string txt_split = "paragraph";
  int64_t seq_len = 128;
  int64_t micro_batch = 8;
  int64_t grad_accum = 1;
  int64_t steps = 200;
  int64_t warmup = 20;
  std::string schedule = "cosine";     // cosine | linear | constant (after warmup)
  double lr = 3e-3;
  double min_lr_ratio = 0.1;           // final lr = lr * min_lr_ratio (cosine / linear)
  double weight_decay = 0.1;
  double beta1 = 0.9, beta2 = 0.95, adam_eps = 1e-8;
  double clip = 1.0;                   // max global grad norm (0 = off)
  double z_loss = 0.0;
  double val_fraction = 0.05;          // fraction of documents (from the end) held out
  std::vector<std::string> val_data;   // separate evaluation files (then nothing is held out of `data`)
  int64_t eval_interval = 50;          // steps between evaluations (0 = only at start and end)
  int64_t eval_batches = 4;            // micro-batches per evaluation
  int64_t save_interval = 0;           // steps between checkpoints (0 = only at the end)
  int64_t keep_last = 0;               // checkpoints kept in --out, newest first (0 = all)
  int64_t max_shard_mb = 5000;         // checkpoint files (weights, optimizer state) split past this size (MB)
  uint64_t seed = 1234;
  std::string out = "runs/default";
  int threads = 0;                     // 0 = all cores
  std::string nan_policy = "stop";     // stop | skip
  std::string resume;                  // checkpoint dir to resume from
  std::string device = "auto";          // auto (cuda when a GPU is present) | cpu | cuda
  std::vector<std::string> given;      // long names of the flags on the command line (without "--")
};

// Runs training. Returns the exit code (0). Throws ds::Error on bad input or a NaN under nan_policy=stop.
int train(TrainOptions opt);

// Default paths of the bundled data (next to the source tree the binary was built from).
std::string bundled_data_path();
std::string bundled_tokenizer_path();

}  // namespace ds
