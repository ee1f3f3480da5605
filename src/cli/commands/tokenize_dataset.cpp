// `deltastack tokenize --format dataset`: many .txt / .jsonl files -> a pre-tokenized dataset directory
// (data/token_dataset.h) that `train --data DIR` maps instead of tokenizing into memory.
//
// Documents are those training reads (read_documents with --txt-split, tokenize_documents with the <|endoftext|>
// separator and the chat / completion loss masks), read by DocumentReader in pieces of about `block_bytes` (32 MiB;
// whole documents each) and tokenized piece by piece on all cores, so memory holds one piece's documents, not a file
// (a file larger than memory streams) nor the corpus; the output does not depend on the piece size. Progress (% of
// the input bytes, MB/s) goes to stderr every 5 s and after each file. The directory is written as "<DIR>.tmp.<pid>" (every file fsync'ed), then renamed to DIR and the
// parent fsync'ed: a failed or killed run leaves no DIR (or the previous one). An existing DIR is replaced only with
// --overwrite and only when it is a dataset directory (an index.json) or empty; never one holding an input.
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <string>
#include <vector>

#include "cli/commands/commands.h"
#include "cli/commands/outputs.h"
#include "core/error.h"
#include "core/files.h"
#include "core/log.h"
#include "data/dataset.h"
#include "data/token_dataset.h"
#include "data/tokenizer.h"

namespace fs = std::filesystem;

namespace ds::cli {

namespace {

// The absolute, normalised path, without a trailing separator ("corpus/" names the directory corpus: its temp and
// set-aside siblings must sit beside it, not inside it).
fs::path real_path(const std::string& p) {
  std::error_code ec;
  fs::path r = fs::weakly_canonical(fs::absolute(p), ec);
  if (ec) r = fs::absolute(p).lexically_normal();
  while (r.has_relative_path() && !r.has_filename()) r = r.parent_path();
  return r;
}

void check_dataset_output(const std::string& out, const std::vector<std::string>& inputs,
                          const std::string& tokenizer, bool overwrite) {
  std::error_code ec;
  DS_CHECK(!out.empty(), "--output: an empty directory name");
  const fs::path o = real_path(out);
  std::vector<std::string> all = inputs;
  all.push_back(tokenizer);
  for (const std::string& in : all) {
    const fs::path rel = real_path(in).lexically_relative(o);
    DS_CHECK(rel.empty() || *rel.begin() == "..", "--output {}: holds the input {}; write the dataset elsewhere", out,
             in);
  }
  if (!fs::exists(o, ec)) return;
  DS_CHECK(fs::is_directory(o, ec), "--output {}: exists and is not a directory (a dataset is a directory; give "
           "--format jsonl for a .jsonl of ids)", out);
  const bool empty = fs::is_empty(o, ec);
  DS_CHECK(empty || is_dataset_dir(o.string()), "--output {}: an existing directory that is not a dataset (no "
           "index.json); refusing to replace it, --overwrite or not", out);
  // The rest as for any output (checkpoint / model directories, --overwrite), on the file that names a dataset.
  if (empty) return;
  check_outputs({{"--output", (o / "index.json").string(), /*replaces_dataset=*/true}}, all, /*overwrite=*/true);
  DS_CHECK(overwrite, "--output {}: a dataset directory exists; pass --overwrite to replace it", out);
}

}  // namespace

int cmd_tokenize_dataset(const std::string& tokenizer_path, const std::vector<std::string>& inputs,
                         const std::string& output_dir, const std::string& txt_split, int64_t shard_tokens,
                         bool overwrite, int64_t block_bytes) {
  DS_CHECK(!inputs.empty(), "--input: no input files given");
  DS_CHECK(shard_tokens >= 1, "--shard-tokens must be at least 1, got {}", shard_tokens);
  const TxtSplit split = parse_txt_split(txt_split);
  check_dataset_output(output_dir, inputs, tokenizer_path, overwrite);
  const std::string tokenizer_json = read_file(tokenizer_path);
  const Tokenizer tok = Tokenizer::from_json_string(tokenizer_json, tokenizer_path);
  const int32_t eos = document_separator(tok);

  const fs::path out = real_path(output_dir);
  const std::string tmp = out.string() + ".tmp." + std::to_string(::getpid());
  std::error_code ec;
  fs::remove_all(tmp, ec);
  DS_CHECK(fs::create_directories(tmp, ec) && !ec, "{}: cannot create ({})", tmp, ec.message());
  try {
    DatasetWriter w(tmp, shard_tokens);
    const auto t0 = std::chrono::steady_clock::now();
    auto last = t0;
    int64_t total_bytes = 0, bytes = 0;
    for (const std::string& f : inputs) total_bytes += static_cast<int64_t>(fs::file_size(f, ec));
    std::vector<LabelledText> part;
    for (size_t i = 0; i < inputs.size(); ++i) {
      DocumentReader r(inputs[i], split, block_bytes > 0 ? static_cast<size_t>(block_bytes)
                                                         : DocumentReader::kDefaultBlockBytes);
      int64_t file_docs = 0;
      while (r.next(part)) {
        const std::vector<TokenizedSample> docs = tokenize_documents(tok, part, eos);
        for (const TokenizedSample& d : docs) w.add(d);
        file_docs += static_cast<int64_t>(docs.size());
        const auto now = std::chrono::steady_clock::now();
        if (now - last < std::chrono::seconds(5)) continue;
        last = now;
        const double s = std::chrono::duration<double>(now - t0).count(), done = double(bytes + r.bytes_done());
        log_info("tokenize: [{}/{}] {}: {:.1f} % of {:.1f} MB; {:.1f} of {:.1f} MB in all ({:.1f} %), {} tokens, "
                 "{:.1f} s, {:.2f} MB/s", i + 1, inputs.size(), inputs[i],
                 r.file_bytes() > 0 ? 100.0 * double(r.bytes_done()) / double(r.file_bytes()) : 100.0,
                 double(r.file_bytes()) / 1e6, done / 1e6, double(total_bytes) / 1e6,
                 total_bytes > 0 ? 100.0 * done / double(total_bytes) : 100.0, w.num_tokens(), s, done / 1e6 / s);
      }
      bytes += r.bytes_done();
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      log_info("tokenize: [{}/{}] {}: {} documents; {} documents, {} tokens, {:.1f} MB in {:.1f} s ({:.2f} MB/s)",
               i + 1, inputs.size(), inputs[i], file_docs, w.num_documents(), w.num_tokens(), double(bytes) / 1e6, s,
               s > 0 ? double(bytes) / 1e6 / s : 0.0);
    }
    std::vector<std::string> sources;
    for (const std::string& f : inputs) sources.push_back(fs::absolute(f).lexically_normal().string());
    w.finish({{"tokenizer", fs::absolute(tokenizer_path).lexically_normal().string()},
              {"tokenizer_fingerprint", tokenizer_fingerprint(tokenizer_json)},
              {"eos_id", eos},
              {"txt_split", txt_split},
              {"sources", sources}});
    if (fs::exists(out, ec)) {  // checked above: an empty directory, or a dataset with --overwrite
      const std::string old = out.string() + ".old." + std::to_string(::getpid());
      fs::rename(out, old);
      fs::rename(tmp, out);
      fs::remove_all(old, ec);
    } else {
      fs::rename(tmp, out);
    }
    fsync_dir(out.parent_path().string());
    log_info("tokenize: {} documents, {} tokens -> {}", w.num_documents(), w.num_tokens(), out.string());
  } catch (...) {
    fs::remove_all(tmp, ec);
    throw;
  }
  return 0;
}

}  // namespace ds::cli
