// libFuzzer target for a pre-tokenized dataset's index.json (see fuzz/README.md for the build command).
// At start a small masked dataset is written with ds::DatasetWriter into a directory of its own under $TMPDIR
// (three documents, the second with a loss mask, shards of 4 tokens: tokens-0000{0,1,2}.bin, labels-0000{0,1,2}.bin,
// documents.bin, masked.bin). Each input replaces that directory's index.json, then ds::MappedTokenStore opens
// it. Rejection must be a ds::Error, never a crash, sanitizer report or other exception. An accepted index must
// describe the files as written: every file named once, 11 tokens in shards of its shard_tokens, document offsets
// 0 .. num_tokens, labels exactly when "masked" is true; and every window of it must pack into a valid batch
// (PackedDataset::batch runs PackedBatch::finalize) with targets that are input ids of the same document.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <set>
#include <string>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "data/dataset.h"
#include "data/token_dataset.h"

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

[[noreturn]] void bug(const char* what) {
  std::fprintf(stderr, "fuzz_dataset_index invariant violated: %s\n", what);
  std::abort();
}

std::string g_dir;  // the dataset directory

void check_accepted(const ds::MappedTokenStore& s) {
  const json& ix = s.index();
  // The files as written: 11 tokens, 3 documents.
  if (s.num_tokens() != 11 || s.num_documents() != 3) bug("accepted counts that differ from the files");
  std::set<std::string> files;
  size_t named = 0;
  for (const json& sh : ix["shards"])
    for (const char* k : {"tokens", "labels"})
      if (sh.contains(k)) files.insert(sh[k].get<std::string>()), ++named;
  files.insert(ix["documents"].get<std::string>()), ++named;
  if (ix["masked"].get<bool>()) files.insert(ix["masked_documents"].get<std::string>()), ++named;
  if (files.size() != named) bug("a file named twice was accepted");
  if (ix["masked"].get<bool>() != s.has_labels()) bug("labels without \"masked\" (or the reverse)");
  if (!s.has_labels() && fs::exists(g_dir + "/labels-00000.bin")) bug("\"masked\": false beside label files");
  const auto starts = s.doc_starts();
  if (starts.front() != 0 || starts.back() != s.num_tokens()) bug("document offsets");
  for (size_t d = 0; d + 1 < starts.size(); ++d)
    if (starts[d + 1] < starts[d]) bug("document offsets decrease");
  s.check_ids(1 << 20);
  std::shared_ptr<const ds::MappedTokenStore> keep(&s, [](const ds::MappedTokenStore*) {});
  for (int64_t seq : {2, 3, 4, 11}) {
    const ds::PackedDataset data(keep, 0, s.num_documents(), seq);
    for (int64_t w = 0; w < data.num_windows(); ++w) {
      const ds::PackedBatch b = data.batch({w});
      for (size_t t = 0; t < b.targets.size(); ++t)
        if (b.targets[t] != -100 && (b.targets[t] < 1 || b.targets[t] > 11)) bug("a target that is no token");
    }
  }
  (void)ds::documents_fingerprint(s, 0, s.num_documents());
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  const char* tmp = std::getenv("TMPDIR");
  g_dir = std::string(tmp ? tmp : "/tmp") + "/fuzz_dataset_index." + std::to_string(::getpid());
  fs::remove_all(g_dir);
  fs::create_directories(g_dir);
  ds::DatasetWriter w(g_dir, 4);
  w.add({{1, 2, 3, 4}, {}});
  w.add({{5, 6, 7, 8}, {0, 0, 1, 1}});
  w.add({{9, 10, 11}, {}});
  w.finish(json{{"tokenizer", "t.json"}, {"tokenizer_fingerprint", "0123456789abcdef"}, {"eos_id", 11}});
  std::atexit([] { fs::remove_all(g_dir); });
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // A plain write (no fsync: thousands of inputs a second).
  FILE* f = std::fopen((g_dir + "/index.json").c_str(), "wb");
  if (!f || std::fwrite(data, 1, size, f) != size || std::fclose(f) != 0) bug("cannot write index.json");
  std::unique_ptr<ds::MappedTokenStore> s;
  try {
    s = std::make_unique<ds::MappedTokenStore>(g_dir);
  } catch (const ds::Error&) {
    return 0;  // rejected: expected
  }
  check_accepted(*s);
  return 0;
}
