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

std::vector<std::string> read_documents(const std::vector<std::string>& files, TxtSplit split) {
  DS_CHECK(!files.empty(), "--data: no data files given");
  std::vector<std::string> docs;
  for (const std::string& f : files) {
    std::string ext = std::filesystem::path(f).extension().string();
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
        DS_CHECK(j.is_object() && j.contains("text") && j["text"].is_string(),
                 "{}:{}: expected an object with a string \"text\" field", f, lineno);
        std::string t = j["text"].get<std::string>();
        if (!t.empty()) docs.push_back(std::move(t));
      }
    } else if (ext == ".txt" || ext == ".text" || ext == ".md") {
      split_txt(text, split, docs);
    } else {
      fail("{}: unsupported data file type \"{}\" (use .txt or .jsonl)", f, ext);
    }
    DS_CHECK(docs.size() > before, "{}: no text in this file", f);
  }
  return docs;
}

std::vector<std::vector<int32_t>> tokenize_documents(const Tokenizer& tok, const std::vector<std::string>& docs,
                                                     int32_t eos) {
  std::vector<std::vector<int32_t>> out(docs.size());
  std::vector<std::string> errors(docs.size());
#pragma omp parallel for schedule(dynamic, 64)
  for (size_t i = 0; i < docs.size(); ++i) {
    try {
      out[i] = tok.encode(docs[i]);
      if (eos >= 0) out[i].push_back(eos);
    } catch (const std::exception& e) {
      errors[i] = e.what();
    }
  }
  for (size_t i = 0; i < docs.size(); ++i)
    DS_CHECK(errors[i].empty(), "document {}: {}", i, errors[i]);
  return out;
}

std::string documents_fingerprint(const std::vector<std::vector<int32_t>>& docs) {
  uint64_t h = 0xcbf29ce484222325ull;
  auto mix = [&h](uint64_t v) {
    for (int b = 0; b < 8; ++b) {
      h ^= (v >> (8 * b)) & 0xff;
      h *= 0x100000001b3ull;
    }
  };
  mix(docs.size());
  for (const std::vector<int32_t>& d : docs) {
    mix(d.size());
    for (int32_t id : d) mix(static_cast<uint32_t>(id));
  }
  return fmt::format("{:016x}", h);
}

PackedDataset::PackedDataset(const std::vector<std::vector<int32_t>>& docs, int64_t seq_len) : seq_len_(seq_len) {
  DS_CHECK(seq_len >= 2, "--seq-len must be at least 2, got {}", seq_len);
  for (size_t d = 0; d < docs.size(); ++d)
    for (int32_t id : docs[d]) {
      stream_.push_back(id);
      doc_of_.push_back(static_cast<int32_t>(d));
    }
  DS_CHECK(stream_.size() >= 2, "data: fewer than 2 tokens in total");
  num_windows_ = static_cast<int64_t>(stream_.size()) / seq_len;
  if (num_windows_ == 0) num_windows_ = 1;  // one short window
  for (int64_t w = 0; w < num_windows_; ++w) {
    int64_t begin = w * seq_len, end = std::min<int64_t>(static_cast<int64_t>(stream_.size()), begin + seq_len), docs = 1;
    for (int64_t t = begin + 1; t < end; ++t) docs += doc_of_[t] != doc_of_[t - 1];
    max_docs_ = std::max(max_docs_, docs);
  }
}

PackedBatch PackedDataset::batch(const std::vector<int64_t>& windows) const {
  PackedBatch b;
  b.cu_seqlens.push_back(0);
  const int64_t total = static_cast<int64_t>(stream_.size());
  for (int64_t w : windows) {
    DS_CHECK(w >= 0 && w < num_windows_, "data: window {} out of range", w);
    int64_t begin = w * seq_len_, end = std::min(total, begin + seq_len_);
    for (int64_t t = begin; t < end; ++t) {
      if (t > begin && doc_of_[t] != doc_of_[t - 1]) b.cu_seqlens.push_back(static_cast<int32_t>(b.input_ids.size()));
      b.input_ids.push_back(stream_[t]);
      bool next_same = t + 1 < total && doc_of_[t + 1] == doc_of_[t];
      b.targets.push_back(next_same ? stream_[t + 1] : -100);
    }
    b.cu_seqlens.push_back(static_cast<int32_t>(b.input_ids.size()));
  }
  b.finalize("data batch");
  return b;
}

}  // namespace ds
