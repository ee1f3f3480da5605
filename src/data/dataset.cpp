#include "data/dataset.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <utf8proc.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <limits>
#include <string_view>

#include "core/error.h"
#include "core/files.h"

namespace ds {

TxtSplit parse_txt_split(const std::string& s) {
  if (s == "paragraph") return TxtSplit::Paragraph;
  if (s == "line") return TxtSplit::Line;
  if (s == "file") return TxtSplit::File;
  fail("--txt-split: unknown value \"{}\" (paragraph, line or file)", s);
}

namespace {

bool blank(std::string_view s) { return s.find_first_not_of(" \t\r\n") == std::string_view::npos; }

// Byte offset of the first invalid UTF-8 sequence (overlong, surrogate, > U+10FFFF, truncated, stray continuation
// byte), or npos. Checked per file (per piece of one: pieces end after a newline, so a sequence never straddles
// two) so the error names the file, not a document index after splitting.
size_t first_invalid_utf8(std::string_view s) {
  const auto* p = reinterpret_cast<const utf8proc_uint8_t*>(s.data());
  const size_t n = s.size();
  for (size_t i = 0; i < n;) {
    if (p[i] < 0x80) {
      ++i;
      continue;
    }
    utf8proc_int32_t cp;
    utf8proc_ssize_t len = utf8proc_iterate(p + i, static_cast<utf8proc_ssize_t>(n - i), &cp);
    if (len <= 0) return i;
    i += static_cast<size_t>(len);
  }
  return std::string::npos;
}

// Paragraph: a document is a run of non-blank lines (each kept with its "\n"), ended by a blank line (only spaces,
// tabs, "\r") or the end of the text. Line: every non-blank line. File: the whole text unless it is blank.
void split_txt(std::string_view text, TxtSplit split, std::vector<std::string>& out) {
  if (split == TxtSplit::File) {
    if (!blank(text)) out.emplace_back(text);
    return;
  }
  std::string cur;
  size_t pos = 0;
  while (pos < text.size()) {
    size_t nl = text.find('\n', pos);
    std::string_view line = text.substr(pos, nl == std::string::npos ? std::string::npos : nl - pos + 1);
    pos = nl == std::string::npos ? text.size() : nl + 1;
    if (split == TxtSplit::Line) {
      if (!blank(line)) out.emplace_back(line);
      continue;
    }
    if (blank(line)) {
      if (!cur.empty()) out.push_back(std::move(cur));
      cur.clear();
    } else {
      cur += line;
    }
  }
  if (!cur.empty() && !blank(cur)) out.push_back(cur);
}

bool line_space(char c) { return c == ' ' || c == '\t' || c == '\r'; }

}  // namespace

DocumentReader::DocumentReader(std::string file, TxtSplit split, size_t block_bytes)
    : file_(std::move(file)), split_(split), block_(std::max<size_t>(1, block_bytes)) {
  std::error_code ec;
  DS_CHECK(!std::filesystem::is_directory(file_, ec) || std::filesystem::exists(file_ + "/index.json", ec),
           "{}: a directory, not a data file; give the .txt / .jsonl files in it (or tokenize them into a dataset "
           "directory with `deltastack tokenize --format dataset` for `train --data DIR`)", file_);
  DS_CHECK(!std::filesystem::is_directory(file_, ec), "{}: is a directory; a pre-tokenized dataset directory "
           "(`deltastack tokenize --format dataset`) is read by `train --data DIR` alone, other commands take .txt / "
           ".jsonl files", file_);
  f_ = std::fopen(file_.c_str(), "rb");
  if (!f_) fail("{}: cannot open ({})", file_, std::strerror(errno));
  const std::string ext = std::filesystem::path(file_).extension().string();
  jsonl_ = ext == ".jsonl";
  if (!jsonl_ && ext != ".txt" && ext != ".text" && ext != ".md") {
    std::fclose(f_);
    f_ = nullptr;
    fail("{}: unsupported data file type \"{}\" (use .txt or .jsonl)", file_, ext);
  }
  const auto size = std::filesystem::file_size(file_, ec);
  file_bytes_ = ec ? 0 : static_cast<int64_t>(size);
}

DocumentReader::~DocumentReader() {
  if (f_) std::fclose(f_);
}

// The end of the last whole document in buf_ (0: none yet; the whole buffer at the end of the file).
size_t DocumentReader::find_cut() const {
  if (eof_) return buf_.size();
  if (!jsonl_ && split_ == TxtSplit::File) return 0;
  const bool any_line = jsonl_ || split_ == TxtSplit::Line;
  size_t e = buf_.size();  // search for a "\n" before e
  while (e > 0) {
    const size_t nl = buf_.rfind('\n', e - 1);
    if (nl == std::string::npos || nl < no_cut_below_) return 0;
    if (any_line) return nl + 1;
    size_t i = nl;  // the line ending at nl is blank when only spaces, tabs and "\r" precede nl on it
    while (i > 0 && line_space(buf_[i - 1])) --i;
    if (i == 0 || buf_[i - 1] == '\n') return nl + 1;
    e = i;
  }
  return 0;
}

bool DocumentReader::next(std::vector<LabelledText>& out) {
  out.clear();
  while (true) {
    size_t cut = find_cut();
    if (cut == 0 && !eof_) {  // read on: up to block_ bytes held, more while no whole document is
      no_cut_below_ = buf_.size();
      const size_t want = buf_.size() < block_ ? block_ - buf_.size() : block_;
      const int64_t left = file_bytes_ - done_ - static_cast<int64_t>(buf_.size());
      const size_t n = std::min(want, std::max<size_t>(left > 0 ? static_cast<size_t>(left) : 0, 1 << 16));
      const size_t old = buf_.size();
      buf_.resize(old + n);
      const size_t got = std::fread(buf_.data() + old, 1, n, f_);
      buf_.resize(old + got);
      if (got < n) {
        DS_CHECK(!std::ferror(f_), "{}: read error at byte offset {} ({})", file_, done_ + static_cast<int64_t>(old + got),
                 std::strerror(errno));
        eof_ = true;
      }
      continue;
    }
    if (cut == 0) {  // end of file, nothing left
      DS_CHECK(docs_ > 0, "{}: no text in this file", file_);
      return false;
    }
    parse(std::string_view(buf_).substr(0, cut), out);
    buf_.erase(0, cut);
    no_cut_below_ = 0;
    if (!out.empty()) return true;
  }
}

void DocumentReader::parse(std::string_view text, std::vector<LabelledText>& out) {
  if (size_t bad = first_invalid_utf8(text); bad != std::string::npos)
    fail("{}:{}: invalid UTF-8 at byte offset {} (data files must be UTF-8 text)", file_,
         lines_done_ + 1 + std::count(text.begin(), text.begin() + static_cast<std::ptrdiff_t>(bad), '\n'),
         done_ + static_cast<int64_t>(bad));
  if (jsonl_) {
    size_t pos = 0;
    int64_t lineno = lines_done_;
    while (pos < text.size()) {
      size_t nl = text.find('\n', pos);
      std::string_view line = text.substr(pos, nl == std::string::npos ? std::string::npos : nl - pos);
      pos = nl == std::string::npos ? text.size() : nl + 1;
      ++lineno;
      // As `deltastack tokenize`: a trailing newline ends the last line, any other empty line is an error.
      DS_CHECK(!blank(line), "{}:{}: empty line (expected a JSON object with a string field \"text\")", file_, lineno);
      nlohmann::json j;
      try {
        j = nlohmann::json::parse(line);
      } catch (const nlohmann::json::exception& e) {
        fail("{}:{}: invalid JSON ({})", file_, lineno, printable(e.what()));
      }
      LabelledText sample;
      try {
        sample = parse_sample(j);
      } catch (const Error& e) {
        fail("{}:{}: {}", file_, lineno, e.what());
      }
      if (!sample.text.empty()) out.push_back(std::move(sample));
    }
  } else {
    std::vector<std::string> parts;
    split_txt(text, split_, parts);
    for (std::string& p : parts) out.push_back(LabelledText{std::move(p), false, {}});
  }
  docs_ += static_cast<int64_t>(out.size());
  lines_done_ += std::count(text.begin(), text.end(), '\n');
  done_ += static_cast<int64_t>(text.size());
}

std::vector<LabelledText> read_documents(const std::vector<std::string>& files, TxtSplit split) {
  DS_CHECK(!files.empty(), "--data: no data files given");
  std::vector<LabelledText> docs, part;
  for (const std::string& f : files) {
    DocumentReader r(f, split, std::numeric_limits<size_t>::max());  // the whole file in one read
    while (r.next(part)) docs.insert(docs.end(), std::make_move_iterator(part.begin()), std::make_move_iterator(part.end()));
  }
  return docs;
}

int32_t document_separator(const Tokenizer& tok) {
  return tok.required_id("<|endoftext|>", "packing documents (the separator after each one)");
}

std::vector<TokenizedSample> tokenize_documents(const Tokenizer& tok, const std::vector<LabelledText>& docs,
                                                int32_t eos) {
  std::vector<TokenizedSample> out(docs.size());
  std::vector<std::string> errors(docs.size());
#pragma omp parallel for schedule(dynamic, 64)
  for (size_t i = 0; i < docs.size(); ++i) {
    try {
      out[i] = tokenize_sample(tok, docs[i]);
      if (eos >= 0) {
        if (!out[i].loss_mask.empty()) out[i].loss_mask.push_back(out[i].loss_mask.back());
        out[i].ids.push_back(eos);
      }
    } catch (const std::exception& e) {
      errors[i] = e.what();
    }
  }
  for (size_t i = 0; i < docs.size(); ++i)
    DS_CHECK(errors[i].empty(), "document {}: {}", i, errors[i]);
  return out;
}

namespace {

struct Fnv1a {
  uint64_t h = 0xcbf29ce484222325ull;
  void mix(uint64_t v) {
    for (int b = 0; b < 8; ++b) {
      h ^= (v >> (8 * b)) & 0xff;
      h *= 0x100000001b3ull;
    }
  }
};

}  // namespace

std::string documents_fingerprint(const std::vector<std::vector<int32_t>>& docs) {
  Fnv1a f;
  f.mix(docs.size());
  for (const std::vector<int32_t>& d : docs) {
    f.mix(d.size());
    for (int32_t id : d) f.mix(static_cast<uint32_t>(id));
  }
  return fmt::format("{:016x}", f.h);
}

std::string documents_fingerprint(const std::vector<TokenizedSample>& docs) {
  Fnv1a f;
  f.mix(docs.size());
  for (const TokenizedSample& d : docs) {
    f.mix(d.ids.size());
    for (int32_t id : d.ids) f.mix(static_cast<uint32_t>(id));
    if (d.loss_mask.empty()) continue;
    f.mix(0x6d61736bull);  // "mask": a masked document never hashes like an unmasked one
    for (uint8_t m : d.loss_mask) f.mix(m);
  }
  return fmt::format("{:016x}", f.h);
}

MemoryTokenStore::MemoryTokenStore(const std::vector<TokenizedSample>& docs) {
  bool masked = false;
  size_t total = 0;
  for (const TokenizedSample& d : docs) {
    masked = masked || !d.loss_mask.empty();
    total += d.ids.size();
  }
  ids_.reserve(total);
  if (masked) {
    labels_.reserve(total);
    masked_.reserve(docs.size());
  }
  starts_.reserve(docs.size() + 1);
  for (size_t d = 0; d < docs.size(); ++d) {
    const TokenizedSample& s = docs[d];
    DS_CHECK(s.loss_mask.empty() || s.loss_mask.size() == s.ids.size(), "document {}: {} ids but {} loss_mask values",
             d, s.ids.size(), s.loss_mask.size());
    starts_.push_back(static_cast<int64_t>(ids_.size()));
    ids_.insert(ids_.end(), s.ids.begin(), s.ids.end());
    if (!masked) continue;
    masked_.push_back(!s.loss_mask.empty());
    if (s.loss_mask.empty()) labels_.insert(labels_.end(), s.ids.size(), 1);
    else labels_.insert(labels_.end(), s.loss_mask.begin(), s.loss_mask.end());
  }
  num_tokens_ = static_cast<int64_t>(ids_.size());
  starts_.push_back(num_tokens_);
  num_docs_ = static_cast<int64_t>(docs.size());
  doc_starts_ = starts_.data();
  shard_ = std::max<int64_t>(1, num_tokens_);
  token_shards_ = {ids_.data()};
  if (masked) {
    label_shards_ = {labels_.data()};
    doc_masked_ = masked_.data();
  }
}

std::string documents_fingerprint(const TokenStore& store, int64_t doc_begin, int64_t doc_end) {
  Fnv1a f;
  f.mix(static_cast<uint64_t>(doc_end - doc_begin));
  const std::span<const int64_t> st = store.doc_starts();
  int64_t scanned = 0;
  for (int64_t d = doc_begin; d < doc_end; ++d) {
    const int64_t b = st[d], e = st[d + 1];
    if ((scanned += e - b) >= (int64_t{16} << 20)) {  // a mapped store: keep the resident pages bounded
      store.release_pages();
      scanned = 0;
    }
    f.mix(static_cast<uint64_t>(e - b));
    for (int64_t t = b; t < e; ++t) f.mix(static_cast<uint32_t>(store.token(t)));
    if (!store.masked(d)) continue;
    f.mix(0x6d61736bull);
    for (int64_t t = b; t < e; ++t) f.mix(store.label(t));
  }
  store.release_pages();
  return fmt::format("{:016x}", f.h);
}

bool any_labelled_target(const TokenStore& store, int64_t doc_begin, int64_t doc_end) {
  const std::span<const int64_t> st = store.doc_starts();
  for (int64_t d = doc_begin; d < doc_end; ++d) {
    if (!store.has_labels()) {
      if (st[d + 1] - st[d] >= 2) return true;
      continue;
    }
    for (int64_t t = st[d] + 1; t < st[d + 1]; ++t)
      if (store.label(t)) return true;
  }
  return false;
}

void require_labelled_target(const TokenStore& store, int64_t doc_begin, int64_t doc_end, const std::string& what,
                             const std::string& use) {
  DS_CHECK(any_labelled_target(store, doc_begin, doc_end), "data: none of the {} {} has a labelled token (chat "
           "samples label only the assistant turns, prompt / completion pairs only the completion): there is nothing "
           "to {}", doc_end - doc_begin, what, use);
}

void check_vocab(const Tokenizer& tok, int64_t model_vocab_size, const std::string& model_source) {
  DS_CHECK(tok.vocab_size() <= model_vocab_size, "{} has {} token ids, but the model's vocab_size is {} ({}): the "
           "tokenizer and the model do not belong together (give the model's own tokenizer.json)", tok.source(),
           tok.vocab_size(), model_vocab_size, model_source);
}

namespace {

std::vector<TokenizedSample> unmasked(const std::vector<std::vector<int32_t>>& docs) {
  std::vector<TokenizedSample> out(docs.size());
  for (size_t i = 0; i < docs.size(); ++i) out[i].ids = docs[i];
  return out;
}

std::shared_ptr<const TokenStore> in_memory(const std::vector<TokenizedSample>& docs, int64_t seq_len) {
  DS_CHECK(seq_len >= 2, "--seq-len must be at least 2, got {}", seq_len);
  return std::make_shared<MemoryTokenStore>(docs);
}

}  // namespace

PackedDataset::PackedDataset(const std::vector<std::vector<int32_t>>& docs, int64_t seq_len)
    : PackedDataset(unmasked(docs), seq_len) {}

PackedDataset::PackedDataset(const std::vector<TokenizedSample>& docs, int64_t seq_len)
    : PackedDataset(in_memory(docs, seq_len), 0, static_cast<int64_t>(docs.size()), seq_len) {}

PackedDataset::PackedDataset(std::shared_ptr<const TokenStore> store, int64_t doc_begin, int64_t doc_end,
                             int64_t seq_len)
    : seq_len_(seq_len), store_(std::move(store)) {
  DS_CHECK(seq_len >= 2, "--seq-len must be at least 2, got {}", seq_len);
  DS_CHECK(0 <= doc_begin && doc_begin <= doc_end && doc_end <= store_->num_documents(),
           "data: documents [{}, {}) out of range ({} documents)", doc_begin, doc_end, store_->num_documents());
  index_windows(doc_begin, doc_end);
}

void PackedDataset::index_windows(int64_t doc_begin, int64_t doc_end) {
  const std::span<const int64_t> st = store_->doc_starts();
  base_ = st[doc_begin];
  end_ = st[doc_end];
  starts_ = st.subspan(static_cast<size_t>(doc_begin), static_cast<size_t>(doc_end - doc_begin) + 1);
  const int64_t total = end_ - base_;
  DS_CHECK(total >= 2, "data: fewer than 2 tokens in total");
  num_windows_ = total / seq_len_;
  if (num_windows_ == 0) num_windows_ = 1;  // one short window
  auto it = starts_.begin();
  for (int64_t w = 0; w < num_windows_; ++w) {
    const int64_t begin = base_ + w * seq_len_, end = std::min(end_, begin + seq_len_);
    int64_t docs = 1;
    // Distinct document starts strictly inside the window (empty documents repeat a start); windows ascend, so the
    // search goes on from the previous window's.
    for (it = std::upper_bound(it, starts_.end(), begin); it != starts_.end() && *it < end;
         it = std::upper_bound(it, starts_.end(), *it))
      ++docs;
    max_docs_ = std::max(max_docs_, docs);
    if (w % (int64_t{1} << 20) == 0) store_->release_pages();
  }
  store_->release_pages();
}

PackedBatch PackedDataset::batch(const std::vector<int64_t>& windows) const {
  int64_t n = 0;
  for (int64_t w : windows) {
    DS_CHECK(w >= 0 && w < num_windows_, "data: window {} out of range", w);
    n += std::min(end_, base_ + (w + 1) * seq_len_) - (base_ + w * seq_len_);
  }
  // Sized first and filled in place: the reads of the store run inside read_guarded, which allocates nothing.
  PackedBatch b;
  b.input_ids.resize(static_cast<size_t>(n));
  b.targets.resize(static_cast<size_t>(n));
  b.cu_seqlens.resize(static_cast<size_t>(n) + windows.size() + 1);  // a start per token at most, an end per window
  const TokenStore& s = *store_;
  const bool labels = s.has_labels();
  size_t segs = 0;
  s.read_guarded([&] {
    int32_t* ids = b.input_ids.data();
    int32_t* targets = b.targets.data();
    int32_t* cu = b.cu_seqlens.data();
    int32_t at = 0;
    size_t k = 0;
    cu[k++] = 0;
    for (int64_t w : windows) {
      const int64_t begin = base_ + w * seq_len_, end = std::min(end_, begin + seq_len_);
      // The first document start after position t (the last entry is end_, so one always exists for t < end_).
      auto it = std::upper_bound(starts_.begin(), starts_.end(), begin);
      for (int64_t t = begin; t < end; ++t, ++at) {
        if (t == *it) {
          cu[k++] = at;
          it = std::upper_bound(it, starts_.end(), t);
        }
        ids[at] = s.token(t);
        const bool next_same = t + 1 < *it;
        const bool labelled = !labels || (next_same && s.label(t + 1));
        targets[at] = next_same && labelled ? s.token(t + 1) : -100;
      }
      cu[k++] = at;
    }
    segs = k;
  });
  b.cu_seqlens.resize(segs);
  s.windows_read(static_cast<int64_t>(windows.size()));
  b.finalize("data batch");
  return b;
}

}  // namespace ds
