// The training loop: packed data, grad accumulation, AdamW with warmup + cosine/linear/constant schedule,
// global grad-norm clipping, a NaN/Inf guard, held-out evaluation, metrics.jsonl, crash-safe checkpoints
// (checkpoint.h) and bitwise resume. The options are those of options.h.
#pragma once
#include <string>

#include "train/options.h"

namespace ds {

// Runs training. Returns the exit code: 0, or 128 + the signal when SIGINT / SIGTERM stopped it (after saving a
// checkpoint of the last step; interrupt.h). Throws ds::Error on bad input or a NaN under nan_policy=stop.
int train(TrainOptions opt);

// Default paths of the bundled data (next to the source tree the binary was built from).
std::string bundled_data_path();
std::string bundled_tokenizer_path();

}  // namespace ds
