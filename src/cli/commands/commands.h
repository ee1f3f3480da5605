// Subcommand entry points. Each returns the process exit code; ds::Error escapes to main(), which prints it
// and exits 1.
#pragma once
#include <string>

namespace ds::cli {

// `deltastack tokenize`: one {"text": ...} JSON object per input line -> one {"ids": [...]} per output line.
int cmd_tokenize(const std::string& tokenizer_path, const std::string& input_jsonl, const std::string& output_jsonl);

}  // namespace ds::cli
