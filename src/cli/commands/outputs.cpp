#include "cli/commands/outputs.h"

#include <filesystem>

#include "core/error.h"
#include "data/token_dataset.h"
#include "train/run_dir.h"

namespace fs = std::filesystem;

namespace ds::cli {

namespace {

fs::path real(const std::string& p) {
  std::error_code ec;
  const fs::path r = fs::weakly_canonical(p, ec);
  return ec ? fs::absolute(p).lexically_normal() : r;
}

// Whether `p` is `dir` or lies below it (both real paths).
bool inside(const fs::path& p, const fs::path& dir) {
  const fs::path rel = p.lexically_relative(dir);
  return !rel.empty() && *rel.begin() != "..";
}

bool same_file(const fs::path& a, const fs::path& b) {
  std::error_code ec;
  return a == b || fs::equivalent(a, b, ec);  // hard links too
}

}  // namespace

void check_outputs(const std::vector<OutputFile>& outputs, const std::vector<std::string>& inputs, bool overwrite) {
  std::error_code ec;
  for (size_t i = 0; i < outputs.size(); ++i) {
    const OutputFile& o = outputs[i];
    if (o.path.empty()) continue;
    const fs::path p = real(o.path);
    for (size_t k = 0; k < i; ++k)
      DS_CHECK(outputs[k].path.empty() || !same_file(p, real(outputs[k].path)), "{} {}: is also {}; give two files",
               o.flag, o.path, outputs[k].flag);
    const bool exists = fs::exists(p, ec);
    DS_CHECK(!exists || !fs::is_directory(p, ec), "{} {}: is a directory; name a file", o.flag, o.path);
    for (const std::string& in : inputs) {
      if (in.empty()) continue;
      const fs::path q = real(in);
      if (fs::is_directory(q, ec))  // a new file beside the inputs is fine, replacing one of them is not
        DS_CHECK(!exists || !inside(p, q), "{} {}: would replace a file of the input directory {}; write it elsewhere",
                 o.flag, o.path, in);
      else
        DS_CHECK(!same_file(p, q), "{} {}: is the input file {}; write it elsewhere", o.flag, o.path, in);
    }
    if (!exists) continue;
    const fs::path parent = p.parent_path();
    DS_CHECK(!fs::exists(parent / "trainer_state.json", ec) && !fs::exists(parent / "config.json", ec),
             "{} {}: would replace a file of the checkpoint / model directory {}; write it elsewhere", o.flag, o.path,
             parent.string());
    DS_CHECK(o.replaces_dataset || !is_dataset_dir(parent.string()), "{} {}: would replace a file of the pre-tokenized dataset {}; write it "
             "elsewhere", o.flag, o.path, parent.string());
    // A training run's directory (its lock file): its metrics are never replaced, --overwrite or not.
    const std::string name = p.filename().string();
    DS_CHECK(!fs::exists(parent / RunDirectory::kLockName, ec) ||
                 (name != RunDirectory::kMetricsName && name != RunDirectory::kAbandonedMetricsName &&
                  name != RunDirectory::kLockName),
             "{} {}: would replace the training run's {} in {}; write it elsewhere", o.flag, o.path, name,
             parent.string());
    DS_CHECK(overwrite, "{} {}: exists; pass --overwrite to replace it", o.flag, o.path);
  }
}

}  // namespace ds::cli
