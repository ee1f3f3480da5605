// Training data: readers for .txt and .jsonl files, and packing of tokenized documents into fixed windows
// with cu_seqlens, so that no recurrent state, conv tap or attention crosses a document and no target
// predicts across one.
#pragma once
#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "data/batch.h"
#include "core/error.h"
#include "data/chat.h"
#include "data/tokenizer.h"

namespace ds {

// How a .txt file is cut into documents: at blank lines (paragraphs; the default, which for tiny Shakespeare
// gives one speech per document), per line, or the whole file as one document.
enum class TxtSplit { Paragraph, Line, File };
TxtSplit parse_txt_split(const std::string& s);  // "paragraph" | "line" | "file", else ds::Error

// Reads documents from .txt (split as above) and .jsonl files, in file order. A .jsonl line is one sample as
// parse_sample (data/chat.h) takes it: {"text"}, a chat {"messages"} rendered with the bundled Qwen3 template
// (labels on the assistant turns), or {"prompt", "completion"} (labels on the completion); an empty line is an
// error, as in `deltastack tokenize`. Text documents are unmasked (every token labelled). Errors name the file
// (and line): missing file, a file with no text, invalid UTF-8 (with the byte offset), invalid JSON, a sample
// parse_sample rejects (naming the field), an unknown extension.
std::vector<LabelledText> read_documents(const std::vector<std::string>& files, TxtSplit split);

// The documents of one .txt / .jsonl file, read_documents' rule, in pieces of about `block_bytes` bytes so that a
// file larger than memory streams: a piece ends after a blank line (TxtSplit::Paragraph), after a newline (Line, and
// every .jsonl), or at the end of the file (File: the file is one document), and is read on until such a point, so
// a piece holds whole documents and the concatenation of the pieces' documents is exactly read_documents({file}).
// Memory: about 2 * block_bytes plus the largest document. Errors as read_documents, naming the file and the line
// (counted over the whole file) and the byte offset; "no text in this file" is raised at the end.
class DocumentReader {
 public:
  static constexpr size_t kDefaultBlockBytes = size_t{32} << 20;
  DocumentReader(std::string file, TxtSplit split, size_t block_bytes = kDefaultBlockBytes);
  ~DocumentReader();
  DocumentReader(const DocumentReader&) = delete;
  DocumentReader& operator=(const DocumentReader&) = delete;
  // Replaces `out` with the documents of the next piece (never empty); false (and `out` empty) at the end of the file.
  bool next(std::vector<LabelledText>& out);
  int64_t file_bytes() const { return file_bytes_; }
  int64_t bytes_done() const { return done_; }  // bytes of the file in the pieces returned so far

 private:
  std::string file_;
  TxtSplit split_;
  bool jsonl_ = false;
  size_t block_;
  std::FILE* f_ = nullptr;
  bool eof_ = false;
  std::string buf_;         // bytes read and not yet returned; starts at a line start
  size_t no_cut_below_ = 0;  // buf_ has no cut point ending before here (a long document read on)
  int64_t file_bytes_ = 0, done_ = 0, lines_done_ = 0, docs_ = 0;
  size_t find_cut() const;
  void parse(std::string_view piece, std::vector<LabelledText>& out);
};

// Tokenizes every document (tokenize_sample; errors name the document index; read_documents has already
// rejected invalid UTF-8 naming the file) and appends `eos` (when >= 0) to each, so the model learns where
// documents end; in a masked document the eos is labelled when the token before it is (a completion's end, not the
// "\n" after a chat's last <|im_end|>).
std::vector<TokenizedSample> tokenize_documents(const Tokenizer& tok, const std::vector<LabelledText>& docs,
                                                int32_t eos);

// The id of <|endoftext|>, the separator tokenize_documents appends to every document for training, eval and
// `tokenize --format dataset`; ds::Error naming the tokenizer's file when it has none (the documents would be
// packed into one another with nothing between them).
int32_t document_separator(const Tokenizer& tok);

// A 64-bit FNV-1a hash of tokenized documents (their count, each one's length and ids, and the loss mask of each
// masked one), as 16 hex digits: what a checkpoint saves to tell whether a resume trains on the same data.
// Documents without masks hash as the ids-only overload.
std::string documents_fingerprint(const std::vector<std::vector<int32_t>>& docs);
std::string documents_fingerprint(const std::vector<TokenizedSample>& docs);

// A data file that changed under a running reader (a memory-mapped shard truncated or replaced in place): what
// TokenStore::read_guarded throws, naming the file. The trainer saves the weights of the last complete step on it.
struct DataChangedError : Error {
  using Error::Error;
};

// A token stream with document boundaries and optional labels: either held in memory (built from tokenized
// documents) or the read-only memory-mapped shards of a pre-tokenized dataset directory (data/token_dataset.h).
// Tokens are stored in shards of shard_tokens() ids each (one shard in memory); doc_starts() holds each document's
// first stream position and, last, the stream's length (num_documents() + 1 values).
class TokenStore {
 public:
  virtual ~TokenStore() = default;
  int64_t num_tokens() const { return num_tokens_; }
  int64_t num_documents() const { return num_docs_; }
  std::span<const int64_t> doc_starts() const { return {doc_starts_, static_cast<size_t>(num_docs_ + 1)}; }
  bool has_labels() const { return !label_shards_.empty(); }
  int32_t token(int64_t t) const { return token_shards_[t / shard_][t % shard_]; }
  uint8_t label(int64_t t) const { return label_shards_[t / shard_][t % shard_]; }
  // Whether document d carried a loss mask (it hashes with it: documents_fingerprint).
  bool masked(int64_t d) const { return doc_masked_ && doc_masked_[d]; }
  // Drops the pages a scan of the whole store made resident from this process (a mapped store: they stay in the
  // page cache, but no longer count as its memory); a no-op in memory.
  virtual void release_pages() const {}
  // Says that `windows` more windows were read (PackedDataset::batch): a mapped store releases its pages every 16
  // (about 2 MB each: the binary search of the document offsets and the ids, with the kernel's fault-around), so
  // that a long run's resident pages stay bounded instead of growing towards the dataset's size. Thread-safe.
  virtual void windows_read(int64_t windows) const { (void)windows; }
  // Runs `reads` (reads of this store into memory the caller allocated: it must neither allocate nor hold objects
  // with destructors, since a mapped store leaves it at the faulting read). A mapped store whose file was truncated
  // or replaced in place under it (a bus error on a page past the file's new end) throws DataChangedError naming the
  // file instead of the process dying of SIGBUS; in memory it just calls `reads`.
  virtual void read_guarded(const std::function<void()>& reads) const { reads(); }

 protected:
  int64_t num_tokens_ = 0, shard_ = 1, num_docs_ = 0;
  const int64_t* doc_starts_ = nullptr;  // num_docs_ + 1 values
  std::vector<const int32_t*> token_shards_;
  std::vector<const uint8_t*> label_shards_;  // empty: every position labelled
  const uint8_t* doc_masked_ = nullptr;       // null: no document masked
};

// The documents concatenated in memory (labels kept only when some document is masked; an unmasked document in a
// masked corpus is labelled everywhere).
class MemoryTokenStore : public TokenStore {
 public:
  explicit MemoryTokenStore(const std::vector<TokenizedSample>& docs);

 private:
  std::vector<int32_t> ids_;
  std::vector<uint8_t> labels_, masked_;
  std::vector<int64_t> starts_;
};

// documents_fingerprint of documents [doc_begin, doc_end) of a store: equal to the vector overload's on the same
// documents.
std::string documents_fingerprint(const TokenStore& store, int64_t doc_begin, int64_t doc_end);
// Whether any of documents [doc_begin, doc_end) has a token after its first that is labelled (something to train on).
bool any_labelled_target(const TokenStore& store, int64_t doc_begin, int64_t doc_end);
// ds::Error unless any_labelled_target: "data: none of the N `what` has a labelled token (chat samples label only
// the assistant turns, ...): there is nothing to `use`" (a loss over no target is 0 / 0).
void require_labelled_target(const TokenStore& store, int64_t doc_begin, int64_t doc_end, const std::string& what,
                             const std::string& use);

// ds::Error naming the tokenizer's file and the model's config (model_source) when the tokenizer has ids the model's
// vocabulary lacks (tok.vocab_size() > model_vocab_size): they were not made for each other.
void check_vocab(const Tokenizer& tok, int64_t model_vocab_size, const std::string& model_source);

// The token stream of all documents cut into windows of seq_len tokens. Window w covers stream positions
// [w*seq_len, (w+1)*seq_len) (the last partial window is dropped unless it is the only one); its cu_seqlens
// mark document starts; the target of position t is the next token of the same document (even when it lies in
// the next window), or -100 at a document's last token and where that next token is not labelled (loss_mask 0).
// Over a store: documents [doc_begin, doc_end) of it form the stream (a train / validation split), read in place.
class PackedDataset {
 public:
  PackedDataset(const std::vector<std::vector<int32_t>>& docs, int64_t seq_len);
  PackedDataset(const std::vector<TokenizedSample>& docs, int64_t seq_len);
  PackedDataset(std::shared_ptr<const TokenStore> store, int64_t doc_begin, int64_t doc_end, int64_t seq_len);
  int64_t num_windows() const { return num_windows_; }
  int64_t num_tokens() const { return end_ - base_; }
  int64_t seq_len() const { return seq_len_; }
  // The most documents (cu_seqlens segments) any one window holds: sizes the GPU's per-batch buffers.
  int64_t max_docs_per_window() const { return max_docs_; }
  // Concatenates the given windows (each its own set of documents) into one packed batch.
  PackedBatch batch(const std::vector<int64_t>& windows) const;

 private:
  int64_t seq_len_, num_windows_ = 0, max_docs_ = 1;
  std::shared_ptr<const TokenStore> store_;
  int64_t base_ = 0, end_ = 0;  // stream positions [base_, end_) of the store
  std::span<const int64_t> starts_;  // the store's starts of documents [doc_begin, doc_end], then end_ (absolute)
  void index_windows(int64_t doc_begin, int64_t doc_end);
};

}  // namespace ds
