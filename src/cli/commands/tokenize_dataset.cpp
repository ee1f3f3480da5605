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
#include <set>
#include <string>
#include <vector>

#include "cli/commands/commands.h"
#include "cli/commands/outputs.h"
#include "core/error.h"
#include "core/files.h"
#include "core/fs_safety.h"
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

// A ds::Error unless `dir` is provably a dataset this command wrote: an index.json with "format":
// "deltastack-dataset", and nothing but the files that index names beside it (its shards' "tokens" / "labels",
// documents.bin, masked.bin when "masked", TempDir's marker): no other file, directory or link, not even one named
// like a shard. What --overwrite may replace; anything else is kept.
void check_is_our_dataset(const std::string& dir, const std::string& out) {
  const std::string index = (fs::path(dir) / "index.json").string();
  std::string format;
  std::set<std::string> listed = {"index.json", "documents.bin", TempDir::kTempMarker};
  try {
    const nlohmann::json j = nlohmann::json::parse(read_file(index));
    if (j.is_object() && j.contains("format") && j["format"].is_string()) format = j["format"].get<std::string>();
    if (j.is_object() && j.value("masked", false) == true) listed.insert("masked.bin");
    if (j.is_object() && j.contains("shards") && j["shards"].is_array())
      for (const nlohmann::json& sh : j["shards"])
        for (const char* k : {"tokens", "labels"})
          if (sh.is_object() && sh.contains(k) && sh[k].is_string()) listed.insert(sh[k].get<std::string>());
  } catch (const std::exception&) {
  }
  DS_CHECK(format == kDatasetFormat, "--output {}: an existing directory that is not a dataset (no "
           "index.json with \"format\": \"{}\"); refusing to replace it, --overwrite or not", out, kDatasetFormat);
  const std::string other = foreign_entry(dir, [&](const std::string& n) { return listed.count(n) > 0; });
  DS_CHECK(other.empty(), "--output {}: the dataset directory also holds {}, which its index.json does not list "
           "(tokenize did not write it); refusing to replace it (and {}), --overwrite or not. Move it away or give "
           "another --output", out, other, other);
}

// Checks the output directory before any work; returns what is there now (what the final rename may replace).
FileIdentity check_dataset_output(const std::string& out, const std::vector<std::string>& inputs,
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
  const FileIdentity there = file_identity(o.string());
  if (!there.exists) return there;
  DS_CHECK(fs::is_directory(fs::symlink_status(o, ec)), "--output {}: exists and is not a directory (a dataset is a "
           "directory; give --format jsonl for a .jsonl of ids)", out);
  if (fs::is_empty(o, ec)) return there;
  check_is_our_dataset(o.string(), out);
  // The rest as for any output (checkpoint / model directories, --overwrite), on the file that names a dataset.
  check_outputs({{"--output", (o / "index.json").string(), /*replaces_dataset=*/true}}, all, /*overwrite=*/true);
  DS_CHECK(overwrite, "--output {}: a dataset directory exists; pass --overwrite to replace it", out);
  return there;
}

}  // namespace

int cmd_tokenize_dataset(const std::string& tokenizer_path, const std::vector<std::string>& inputs,
                         const std::string& output_dir, const std::string& txt_split, int64_t shard_tokens,
                         bool overwrite, int64_t block_bytes) {
  DS_CHECK(!inputs.empty(), "--input: no input files given");
  DS_CHECK(shard_tokens >= 1, "--shard-tokens must be at least 1, got {}", shard_tokens);
  const TxtSplit split = parse_txt_split(txt_split);
  const FileIdentity existing = check_dataset_output(output_dir, inputs, tokenizer_path, overwrite);
  const std::string tokenizer_json = read_file(tokenizer_path);
  const Tokenizer tok = Tokenizer::from_json_string(tokenizer_json, tokenizer_path);
  const int32_t eos = document_separator(tok);

  const fs::path out = real_path(output_dir);
  // "<DIR>.tmp.<pid>" beside DIR: those of killed runs go first; ours is removed on failure and on SIGINT / SIGTERM.
  TempDir::remove_stale(out.string(), ".tmp.", /*hidden=*/false);
  TempDir tmp_dir(out.string(), ".tmp.", /*hidden=*/false, "--output " + output_dir);
  const std::string& tmp = tmp_dir.path();
  std::error_code ec;
  {
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
        tmp_dir.check_signal();
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
    // Replaces only what was checked above (nothing, an empty directory, or our dataset): a directory made there
    // meanwhile, or another tokenize's output, stays and this run fails.
    tmp_dir.commit(existing, [&](const std::string& old) {
      if (!fs::is_empty(old, ec)) check_is_our_dataset(old, output_dir);
    });
    log_info("tokenize: {} documents, {} tokens -> {}", w.num_documents(), w.num_tokens(), out.string());
  }
  return 0;
}

}  // namespace ds::cli
