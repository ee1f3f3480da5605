#include "data/dataset.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <utf8proc.h>

#include <algorithm>
#include <filesystem>

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

bool blank(const std::string& s) { return s.find_first_not_of(" \t\r\n") == std::string::npos; }

// Byte offset of the first invalid UTF-8 sequence (overlong, surrogate, > U+10FFFF, truncated, stray continuation
// byte), or npos. Checked per file so the error names the file, not a document index after splitting.
size_t first_invalid_utf8(const std::string& s) {
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

void split_txt(const std::string& text, TxtSplit split, std::vector<std::string>& out) {
  if (split == TxtSplit::File) {
    if (!blank(text)) out.push_back(text);
    return;
  }
  std::string cur;
  size_t pos = 0;
  while (pos < text.size()) {
    size_t nl = text.find('\n', pos);
    std::string line = text.substr(pos, nl == std::string::npos ? std::string::npos : nl - pos + 1);
    pos = nl == std::string::npos ? text.size() : nl + 1;
    if (split == TxtSplit::Line) {
      if (!blank(line)) out.push_back(line);
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

}  // namespace

std::vector<LabelledText> read_documents(const std::vector<std::string>& files, TxtSplit split) {
  DS_CHECK(!files.empty(), "--data: no data files given");
  std::vector<LabelledText> docs;
  for (const std::string& f : files) {
    std::string ext = std::filesystem::path(f).extension().string();
    std::error_code ec;
    DS_CHECK(!std::filesystem::is_directory(f, ec), "{}: is a directory; a pre-tokenized dataset directory (`deltastack "
             "tokenize --format dataset`) is read by `train --data DIR` alone, other commands take .txt / .jsonl files",
             f);
    std::string text = read_file(f);
    if (size_t bad = first_invalid_utf8(text); bad != std::string::npos)
      fail("{}:{}: invalid UTF-8 at byte offset {} (data files must be UTF-8 text)", f,
           1 + std::count(text.begin(), text.begin() + static_cast<std::ptrdiff_t>(bad), '\n'), bad);
    size_t before = docs.size();
    if (ext == ".jsonl") {
      size_t pos = 0;
      int64_t lineno = 0;
      while (pos < text.size()) {
        size_t nl = text.find('\n', pos);
        std::string line = text.substr(pos, nl == std::string::npos ? std::string::npos : nl - pos);
        pos = nl == std::string::npos ? text.size() : nl + 1;
        ++lineno;
        // As `deltastack tokenize`: a trailing newline ends the last line, any other empty line is an error.
        DS_CHECK(!blank(line), "{}:{}: empty line (expected a JSON object with a string field \"text\")", f, lineno);
        nlohmann::json j;
        try {
          j = nlohmann::json::parse(line);
        } catch (const nlohmann::json::exception& e) {
          fail("{}:{}: invalid JSON ({})", f, lineno, e.what());
        }
        LabelledText sample;
        try {
          sample = parse_sample(j);
        } catch (const Error& e) {
          fail("{}:{}: {}", f, lineno, e.what());
        }
        if (!sample.text.empty()) docs.push_back(std::move(sample));
      }
    } else if (ext == ".txt" || ext == ".text" || ext == ".md") {
      std::vector<std::string> parts;
      split_txt(text, split, parts);
      for (std::string& p : parts) docs.push_back(LabelledText{std::move(p), false, {}});
    } else {
      fail("{}: unsupported data file type \"{}\" (use .txt or .jsonl)", f, ext);
    }
    DS_CHECK(docs.size() > before, "{}: no text in this file", f);
  }
  return docs;
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
    doc_masked_.reserve(docs.size());
  }
  doc_starts_.clear();
  doc_starts_.reserve(docs.size() + 1);
  for (size_t d = 0; d < docs.size(); ++d) {
    const TokenizedSample& s = docs[d];
    DS_CHECK(s.loss_mask.empty() || s.loss_mask.size() == s.ids.size(), "document {}: {} ids but {} loss_mask values",
             d, s.ids.size(), s.loss_mask.size());
    doc_starts_.push_back(static_cast<int64_t>(ids_.size()));
    ids_.insert(ids_.end(), s.ids.begin(), s.ids.end());
    if (!masked) continue;
    doc_masked_.push_back(!s.loss_mask.empty());
    if (s.loss_mask.empty()) labels_.insert(labels_.end(), s.ids.size(), 1);
    else labels_.insert(labels_.end(), s.loss_mask.begin(), s.loss_mask.end());
  }
  num_tokens_ = static_cast<int64_t>(ids_.size());
  doc_starts_.push_back(num_tokens_);
  shard_ = std::max<int64_t>(1, num_tokens_);
  token_shards_ = {ids_.data()};
  if (masked) label_shards_ = {labels_.data()};
}

std::string documents_fingerprint(const TokenStore& store, int64_t doc_begin, int64_t doc_end) {
  Fnv1a f;
  f.mix(static_cast<uint64_t>(doc_end - doc_begin));
  const std::vector<int64_t>& st = store.doc_starts();
  for (int64_t d = doc_begin; d < doc_end; ++d) {
    const int64_t b = st[d], e = st[d + 1];
    f.mix(static_cast<uint64_t>(e - b));
    for (int64_t t = b; t < e; ++t) f.mix(static_cast<uint32_t>(store.token(t)));
    if (!store.masked(d)) continue;
    f.mix(0x6d61736bull);
    for (int64_t t = b; t < e; ++t) f.mix(store.label(t));
  }
  return fmt::format("{:016x}", f.h);
}

bool any_labelled_target(const TokenStore& store, int64_t doc_begin, int64_t doc_end) {
  const std::vector<int64_t>& st = store.doc_starts();
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
  const std::vector<int64_t>& st = store_->doc_starts();
  base_ = st[doc_begin];
  end_ = st[doc_end];
  starts_.reserve(static_cast<size_t>(doc_end - doc_begin) + 1);
  for (int64_t d = doc_begin; d < doc_end; ++d) starts_.push_back(st[d] - base_);
  starts_.push_back(end_ - base_);
  const int64_t total = end_ - base_;
  DS_CHECK(total >= 2, "data: fewer than 2 tokens in total");
  num_windows_ = total / seq_len_;
  if (num_windows_ == 0) num_windows_ = 1;  // one short window
  for (int64_t w = 0; w < num_windows_; ++w) {
    const int64_t begin = w * seq_len_, end = std::min(total, begin + seq_len_);
    int64_t docs = 1;
    // Distinct document starts strictly inside the window (empty documents repeat a start).
    for (auto it = std::upper_bound(starts_.begin(), starts_.end(), begin); it != starts_.end() && *it < end;
         it = std::upper_bound(it, starts_.end(), *it))
      ++docs;
    max_docs_ = std::max(max_docs_, docs);
  }
}

PackedBatch PackedDataset::batch(const std::vector<int64_t>& windows) const {
  PackedBatch b;
  b.cu_seqlens.push_back(0);
  const int64_t total = end_ - base_;
  const TokenStore& s = *store_;
  const bool labels = s.has_labels();
  for (int64_t w : windows) {
    DS_CHECK(w >= 0 && w < num_windows_, "data: window {} out of range", w);
    const int64_t begin = w * seq_len_, end = std::min(total, begin + seq_len_);
    // The first document start after position t (the last entry is `total`, so one always exists for t < total).
    auto it = std::upper_bound(starts_.begin(), starts_.end(), begin);
    for (int64_t t = begin; t < end; ++t) {
      if (t == *it) {
        b.cu_seqlens.push_back(static_cast<int32_t>(b.input_ids.size()));
        it = std::upper_bound(it, starts_.end(), t);
      }
      b.input_ids.push_back(s.token(base_ + t));
      const bool next_same = t + 1 < *it;
      const bool labelled = !labels || (next_same && s.label(base_ + t + 1));
      b.targets.push_back(next_same && labelled ? s.token(base_ + t + 1) : -100);
    }
    b.cu_seqlens.push_back(static_cast<int32_t>(b.input_ids.size()));
  }
  b.finalize("data batch");
  return b;
}

}  // namespace ds
