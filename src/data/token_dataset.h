// Pre-tokenized dataset directories (`deltastack tokenize --format dataset`, `train --data DIR`): the token stream
// of many .txt / .jsonl files, as training's in-memory path tokenizes them (read_documents, tokenize_documents with
// the <|endoftext|> separator, chat / completion loss masks), stored so that training maps it read-only instead of
// holding it in memory.
//
// Layout of DIR:
//   index.json      {"format": "deltastack-dataset", "version": 1, "tokenizer_fingerprint", "tokenizer",
//                    "eos_id", "num_tokens", "num_documents", "shard_tokens", "masked", "documents",
//                    "masked_documents" (when masked), "shards": [{"tokens", "labels" (when masked), "num_tokens"}],
//                    "sources"}
//   tokens-NNNNN.bin   raw little-endian int32 ids, shard_tokens per shard (the last one fewer)
//   labels-NNNNN.bin   uint8 per token (1 = labelled), only when some document has a loss mask
//   documents.bin      little-endian int64: each document's first stream position, then num_tokens
//   masked.bin         uint8 per document: 1 where it had a loss mask (for documents_fingerprint), when masked
#pragma once
#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "data/dataset.h"

namespace ds {

inline constexpr const char* kDatasetFormat = "deltastack-dataset";
inline constexpr int kDatasetVersion = 1;

// 16 hex digits: the FNV-1a hash of a tokenizer.json's bytes (a dataset remembers the tokenizer it was made with).
std::string tokenizer_fingerprint(const std::string& tokenizer_json);

// Whether `path` is a directory holding an index.json.
bool is_dataset_dir(const std::string& path);

// Writes shards into an existing (empty, temporary) directory, document by document, through buffers of a few MB
// (documents.bin and masked.bin too, so memory does not grow with the corpus); label shards only from the first
// masked document on (then the earlier tokens' labels, all 1, are written first). finish() writes index.json, every
// file fsync'ed. ds::Error naming the file on a failed write.
class DatasetWriter {
 public:
  DatasetWriter(std::string dir, int64_t shard_tokens);
  ~DatasetWriter();
  DatasetWriter(const DatasetWriter&) = delete;
  DatasetWriter& operator=(const DatasetWriter&) = delete;
  void add(const TokenizedSample& doc);
  // `meta`: the caller's index.json fields (tokenizer, tokenizer_fingerprint, eos_id, sources); the rest is added.
  void finish(nlohmann::json meta);
  int64_t num_tokens() const { return num_tokens_; }
  int64_t num_documents() const { return num_docs_; }

  // An output file written through a buffer.
  struct Out {
    int fd = -1;
    std::string path;
    std::vector<char> buf;
    void open(std::string p);
    void write(const void* data, size_t n);
    void flush();
    void sync_close();  // flush, fsync, close
    ~Out();
  };

 private:
  std::string dir_;
  int64_t shard_tokens_, num_tokens_ = 0, in_shard_ = 0, num_docs_ = 0;
  bool any_masked_ = false;
  Out tok_, lab_, docs_, masked_;
  std::vector<int64_t> shard_sizes_;
  void open_shard();
  void close_shard();
};

// A dataset directory mapped read-only. Checks index.json (format, version, every field's type, the sizes of
// documents.bin / masked.bin / each shard against it, the document offsets) and fails with a ds::Error naming the
// file and the field.
class MappedTokenStore : public TokenStore {
 public:
  explicit MappedTokenStore(const std::string& dir);
  ~MappedTokenStore() override;
  MappedTokenStore(const MappedTokenStore&) = delete;
  MappedTokenStore& operator=(const MappedTokenStore&) = delete;
  const nlohmann::json& index() const { return index_; }
  // ds::Error naming the shard and position of the first id outside [0, vocab_size).
  void check_ids(int64_t vocab_size) const;
  void release_pages() const override;
  void windows_read(int64_t windows) const override;
  // A read of a page past the new end of a mapped file that was truncated in place raises SIGBUS. The store's
  // handler (installed with the first store, for the process) looks the address up in the live stores' mappings:
  // inside read_guarded it jumps back there (siglongjmp) and DataChangedError names the file; in any other read (the
  // scans at start: fingerprints, check_ids) it writes "error: FILE changed ..." to stderr and exits 1 (nothing is
  // trained yet then). A bus error outside every mapping keeps its default action.
  void read_guarded(const std::function<void()>& reads) const override;

  struct Map {
    void* p = nullptr;
    size_t n = 0;
    std::string file;
  };

 private:
  std::string dir_;
  nlohmann::json index_;
  std::vector<Map> maps_;
  // The SIGBUS handler's view of maps_, from before the first mapping (the constructor's checks read them) until
  // the destructor unmaps them, or the constructor fails.
  struct Registration {
    explicit Registration(const std::vector<Map>* maps);
    ~Registration() { reset(); }
    Registration(const Registration&) = delete;
    Registration& operator=(const Registration&) = delete;
    void reset();
    const std::vector<Map>* maps_;
  } registration_{&maps_};
  mutable std::atomic<int64_t> windows_read_{0};
  std::vector<std::string> token_files_;
  const void* map(const std::string& file, size_t expect_bytes, const std::string& field);
};

}  // namespace ds
