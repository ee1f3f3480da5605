// Where a command may write (forward, tokenize): never over one of its inputs, another of its outputs, or a file of
// a checkpoint or model directory; over an existing file only with --overwrite.
#pragma once
#include <string>
#include <vector>

namespace ds::cli {

struct OutputFile {
  std::string flag;  // "--output"
  std::string path;  // empty: not asked for (skipped)
  bool replaces_dataset = false;  // tokenize --format dataset replacing a whole dataset: its files may be replaced
};

// ds::Error naming the flag and the path when an output (symlinks and hard links resolved) equals another output,
// is a directory, is an input file, would replace a file inside an input directory or a directory that holds a
// checkpoint or model (config.json or trainer_state.json; with `overwrite` too) or a pre-tokenized dataset (unless
// replaces_dataset), or exists without `overwrite`.
// A new file beside the inputs is fine.
void check_outputs(const std::vector<OutputFile>& outputs, const std::vector<std::string>& inputs, bool overwrite);

}  // namespace ds::cli
