// Byte-level BPE tokenizer (Hugging Face tokenizer.json, Qwen2/Qwen3 layout). See tokenizer.h.
//
// Semantics follow HF `tokenizers` (Rust), encode(text, add_special_tokens=False):
//   1. Added tokens with normalized=false are matched in the raw text (leftmost-longest, non-overlapping, as
//      HF's Aho-Corasick LeftmostLongest), honouring single_word / lstrip / rstrip.
//   2. Every remaining piece is normalized (NFC via libutf8proc, or nothing), then added tokens with
//      normalized=true (their content NFC-normalized too) are matched in it the same way.
//   3. Every remaining piece is pre-tokenized: each Split(Regex, Isolated) step in order (PCRE2, UTF+UCP, JIT),
//      then ByteLevel (with use_regex=true the GPT-2 pattern is one more Isolated split). Regex matches and the
//      gaps between them become pieces; empty pieces are dropped. Each pattern runs on its piece alone, so a
//      look-ahead never sees past the piece (as in HF).
//   4. Each piece's bytes are BPE-merged: repeatedly merge the adjacent pair with the lowest merge rank,
//      leftmost first on ties (HF's BPE::merge_word order). The byte-level char mapping is applied to the vocab
//      at load time instead of to the text, so BPE runs on raw bytes.
//
// Regex translation: HF compiles patterns with Oniguruma, whose Unicode `\s` is the White_Space property.
// PCRE2 with UCP also matches U+180E, so `\s` / `\S` outside a class and `\s` inside a class are rewritten to an
// explicit White_Space class. (`\S` inside a class is left to PCRE2.) `\p{..}` classes use PCRE2's Unicode
// tables, (?i) uses Unicode case folding in both engines.
//
// Invalid UTF-8 input (overlongs, surrogates, > U+10FFFF, truncated sequences, stray continuation bytes) is
// rejected: encode() throws ds::Error "invalid UTF-8 at byte offset N". HF cannot receive such input at all
// (Rust &str), so there is nothing to match there.
//
// decode(): like HF decode(ids, skip_special_tokens=False) with a ByteLevel decoder: each id maps to its token
// string (added tokens first, then the model vocab; ids with no token are skipped, as HF does). Added tokens
// (e.g. "<|im_end|>") contribute their content verbatim, as current HF does; a model token whose chars are all
// in the byte-level alphabet becomes those bytes, otherwise its own UTF-8 bytes (HF ByteLevel's fallback). The
// concatenated bytes are converted to UTF-8 replacing each maximal invalid subsequence with U+FFFD (Rust's
// String::from_utf8_lossy; running it over the whole output equals HF's per-chunk runs, since added-token
// content is valid UTF-8 and so ends any invalid subsequence before it).
//
// Threading: encode/decode are const and safe to call concurrently. Each thread keeps a PCRE2 match state and
// a word -> ids cache (at most 2^17 words of <= 128 bytes) for the tokenizer it used last; switching tokenizers
// on a thread clears that thread's cache.
//
// Load-time restrictions (each a ds::Error naming the file and the field): model.type must be BPE with
// dropout null/0 and empty continuing_subword_prefix / end_of_word_suffix; normalizer null, NFC or a Sequence of
// NFC; pre_tokenizer ByteLevel(add_prefix_space=false) or Sequence[Split(Isolated, invert=false)..., ByteLevel];
// decoder ByteLevel; truncation null; the vocab must contain all 256 single-byte tokens. post_processor and
// padding do not affect encode(add_special_tokens=False) and are ignored. ignore_merges is supported;
// byte_fallback / unk_token never trigger because every byte has a token.
#include "data/tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <utf8proc.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <nlohmann/json.hpp>
#include <queue>
#include <string>
#include <unordered_map>
#include <utility>

#include "core/error.h"
#include "core/files.h"

namespace ds {

namespace {

using json = nlohmann::json;

// ---------------------------------------------------------------------------------------------------------------
// UTF-8 helpers

// Length of the valid UTF-8 sequence starting at s[i] (1..4), or 0 if the bytes at i do not start one.
// When invalid, *bad_len receives the length of the maximal valid prefix (at least 1) to replace with U+FFFD.
inline int utf8_seq_len(const unsigned char* s, size_t n, size_t i, int* bad_len) {
  unsigned char c = s[i];
  if (c < 0x80) return 1;
  int need;
  unsigned char lo = 0x80, hi = 0xBF;
  if (c >= 0xC2 && c <= 0xDF) {
    need = 1;
  } else if (c >= 0xE0 && c <= 0xEF) {
    need = 2;
    if (c == 0xE0) lo = 0xA0;
    if (c == 0xED) hi = 0x9F;
  } else if (c >= 0xF0 && c <= 0xF4) {
    need = 3;
    if (c == 0xF0) lo = 0x90;
    if (c == 0xF4) hi = 0x8F;
  } else {
    if (bad_len) *bad_len = 1;
    return 0;
  }
  for (int k = 1; k <= need; ++k) {
    if (i + k >= n) {
      if (bad_len) *bad_len = k;
      return 0;
    }
    unsigned char b = s[i + k];
    unsigned char l = (k == 1) ? lo : 0x80, h = (k == 1) ? hi : 0xBF;
    if (b < l || b > h) {
      if (bad_len) *bad_len = k;
      return 0;
    }
  }
  return need + 1;
}

// Byte offset of the first invalid UTF-8 byte, or npos if s is valid.
size_t utf8_first_invalid(std::string_view s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  size_t n = s.size(), i = 0;
  while (i < n) {
    // ASCII fast path, 8 bytes at a time.
    while (i + 8 <= n) {
      uint64_t w;
      std::memcpy(&w, p + i, 8);
      if (w & 0x8080808080808080ull) break;
      i += 8;
    }
    if (i >= n) break;
    if (p[i] < 0x80) {
      ++i;
      continue;
    }
    int len = utf8_seq_len(p, n, i, nullptr);
    if (len == 0) return i;
    i += len;
  }
  return std::string_view::npos;
}

// Decodes the (valid) code point at s[i] and its length.
inline uint32_t utf8_decode(const unsigned char* s, size_t i, int* len) {
  unsigned char c = s[i];
  if (c < 0x80) {
    *len = 1;
    return c;
  }
  if (c < 0xE0) {
    *len = 2;
    return ((c & 0x1Fu) << 6) | (s[i + 1] & 0x3Fu);
  }
  if (c < 0xF0) {
    *len = 3;
    return ((c & 0x0Fu) << 12) | ((s[i + 1] & 0x3Fu) << 6) | (s[i + 2] & 0x3Fu);
  }
  *len = 4;
  return ((c & 0x07u) << 18) | ((s[i + 1] & 0x3Fu) << 12) | ((s[i + 2] & 0x3Fu) << 6) | (s[i + 3] & 0x3Fu);
}

inline void utf8_append(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

// Rust String::from_utf8_lossy: each maximal invalid subsequence becomes one U+FFFD.
std::string utf8_lossy(std::string_view s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  size_t n = s.size(), i = 0;
  std::string out;
  out.reserve(n);
  while (i < n) {
    int bad = 0;
    int len = utf8_seq_len(p, n, i, &bad);
    if (len > 0) {
      out.append(s.data() + i, len);
      i += len;
    } else {
      out.append("\xEF\xBF\xBD");
      i += bad;
    }
  }
  return out;
}

// Unicode White_Space (what Oniguruma's and Rust regex's Unicode `\s` match).
inline bool is_white_space(uint32_t c) {
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}
// Rust regex Unicode `\w` (Alphabetic, marks, Nd, Pc, Join_Control), approximated with general categories.
inline bool is_word_char(uint32_t c) {
  if (c < 0x80) return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
  if (c == 0x200C || c == 0x200D) return true;
  switch (utf8proc_category(static_cast<utf8proc_int32_t>(c))) {
    case UTF8PROC_CATEGORY_LU: case UTF8PROC_CATEGORY_LL: case UTF8PROC_CATEGORY_LT: case UTF8PROC_CATEGORY_LM:
    case UTF8PROC_CATEGORY_LO: case UTF8PROC_CATEGORY_MN: case UTF8PROC_CATEGORY_MC: case UTF8PROC_CATEGORY_ME:
    case UTF8PROC_CATEGORY_ND: case UTF8PROC_CATEGORY_NL: case UTF8PROC_CATEGORY_PC:
      return true;
    default:
      return false;
  }
}
// Code point ending at byte `end` (valid UTF-8 assumed, end > 0).
inline uint32_t last_cp(std::string_view s, size_t end, size_t* start) {
  size_t i = end - 1;
  while (i > 0 && (static_cast<unsigned char>(s[i]) & 0xC0) == 0x80) --i;
  int len;
  *start = i;
  return utf8_decode(reinterpret_cast<const unsigned char*>(s.data()), i, &len);
}

// NFC via utf8proc. Text whose bytes are all < 0xCC (code points < U+0300) is already NFC: nothing there
// decomposes, and composition needs a combining mark or conjoining jamo, which all lie at or above U+0300.
std::string nfc(std::string_view s) {
  bool fast = true;
  for (unsigned char c : s) {
    if (c >= 0xCC) {
      fast = false;
      break;
    }
  }
  if (fast) return std::string(s);
  utf8proc_uint8_t* dst = nullptr;
  utf8proc_ssize_t n = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(s.data()),
                                    static_cast<utf8proc_ssize_t>(s.size()), &dst,
                                    static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_COMPOSE));
  if (n < 0) fail("tokenizer: NFC normalization failed ({})", utf8proc_errmsg(n));
  std::string out(reinterpret_cast<char*>(dst), static_cast<size_t>(n));
  std::free(dst);
  return out;
}

// ---------------------------------------------------------------------------------------------------------------
// GPT-2 byte-level alphabet: printable bytes map to themselves, the other 68 to U+0100.. in byte order.

struct ByteLevelMap {
  uint32_t byte_to_cp[256];
  int cp_to_byte[324];  // -1 where the code point is not in the alphabet
  ByteLevelMap() {
    std::fill(std::begin(cp_to_byte), std::end(cp_to_byte), -1);
    uint32_t next = 256;
    for (int b = 0; b < 256; ++b) {
      bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
      byte_to_cp[b] = printable ? static_cast<uint32_t>(b) : next++;
      cp_to_byte[byte_to_cp[b]] = b;
    }
  }
  // Token string -> raw bytes; false if a char is outside the alphabet (or the string is not valid UTF-8).
  bool unmap(std::string_view tok, std::string* out) const {
    out->clear();
    const auto* p = reinterpret_cast<const unsigned char*>(tok.data());
    size_t i = 0, n = tok.size();
    while (i < n) {
      int len = utf8_seq_len(p, n, i, nullptr);
      if (len == 0) return false;
      uint32_t cp = utf8_decode(p, i, &len);
      if (cp >= 324 || cp_to_byte[cp] < 0) return false;
      out->push_back(static_cast<char>(cp_to_byte[cp]));
      i += len;
    }
    return true;
  }
};
const ByteLevelMap& byte_level() {
  static const ByteLevelMap m;
  return m;
}

// ---------------------------------------------------------------------------------------------------------------
// Open-addressing map (id_a, id_b) -> (rank, merged id).

class PairMap {
 public:
  struct Val {
    int32_t rank;
    int32_t id;
  };
  void reserve(size_t n) {
    size_t cap = 16;
    while (cap < n * 2) cap <<= 1;
    keys_.assign(cap, kEmpty);
    vals_.assign(cap, Val{0, 0});
    mask_ = cap - 1;
  }
  void put(int32_t a, int32_t b, Val v) {
    uint64_t k = key(a, b);
    size_t i = slot(k);
    while (keys_[i] != kEmpty && keys_[i] != k) i = (i + 1) & mask_;
    keys_[i] = k;
    vals_[i] = v;
  }
  const Val* get(int32_t a, int32_t b) const {
    uint64_t k = key(a, b);
    size_t i = slot(k);
    while (true) {
      uint64_t kk = keys_[i];
      if (kk == k) return &vals_[i];
      if (kk == kEmpty) return nullptr;
      i = (i + 1) & mask_;
    }
  }

 private:
  static constexpr uint64_t kEmpty = ~0ull;
  static uint64_t key(int32_t a, int32_t b) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
  }
  size_t slot(uint64_t k) const { return static_cast<size_t>((k * 0x9E3779B97F4A7C15ull) >> 20) & mask_; }
  std::vector<uint64_t> keys_;
  std::vector<Val> vals_;
  size_t mask_ = 0;
};

// ---------------------------------------------------------------------------------------------------------------
// PCRE2 wrapper

constexpr const char* kWhiteSpaceClass =
    "\\x{09}-\\x{0D}\\x{20}\\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}\\x{202F}\\x{205F}\\x{3000}";

// Oniguruma pattern -> PCRE2 pattern: only `\s` / `\S` need rewriting (see the file comment).
std::string onig_to_pcre2(const std::string& p) {
  std::string out;
  out.reserve(p.size() + 64);
  bool in_class = false;
  for (size_t i = 0; i < p.size(); ++i) {
    char c = p[i];
    if (c == '\\' && i + 1 < p.size()) {
      char d = p[i + 1];
      ++i;
      if (d == 's') {
        if (!in_class) out.push_back('[');
        out.append(kWhiteSpaceClass);
        if (!in_class) out.push_back(']');
      } else if (d == 'S' && !in_class) {
        out.append("[^");
        out.append(kWhiteSpaceClass);
        out.push_back(']');
      } else {
        out.push_back('\\');
        out.push_back(d);
      }
      continue;
    }
    if (!in_class && c == '[') {
      in_class = true;
      out.push_back(c);
      if (i + 1 < p.size() && p[i + 1] == '^') out.push_back(p[++i]);
      if (i + 1 < p.size() && p[i + 1] == ']') out.push_back(p[++i]);  // literal ']' first in a class
      continue;
    }
    if (in_class && c == '[' && i + 1 < p.size() && p[i + 1] == ':') {  // POSIX [:name:]
      size_t e = p.find(":]", i + 2);
      if (e != std::string::npos) {
        out.append(p, i, e + 2 - i);
        i = e + 1;
        continue;
      }
    }
    if (in_class && c == ']') in_class = false;
    out.push_back(c);
  }
  return out;
}

// Per-thread PCRE2 match state (match data + JIT stack), shared by all patterns.
struct MatchState {
  pcre2_match_data* md = nullptr;
  pcre2_match_context* mc = nullptr;
  pcre2_jit_stack* js = nullptr;
  MatchState() {
    md = pcre2_match_data_create(16, nullptr);
    mc = pcre2_match_context_create(nullptr);
    js = pcre2_jit_stack_create(64 * 1024, 8 * 1024 * 1024, nullptr);
    if (!md || !mc) throw Error("tokenizer: out of memory creating PCRE2 match data");
    if (js) pcre2_jit_stack_assign(mc, nullptr, js);
  }
  ~MatchState() {
    if (js) pcre2_jit_stack_free(js);
    if (mc) pcre2_match_context_free(mc);
    if (md) pcre2_match_data_free(md);
  }
  MatchState(const MatchState&) = delete;
  MatchState& operator=(const MatchState&) = delete;
};
MatchState& match_state() {
  thread_local MatchState st;
  return st;
}

class Regex {
 public:
  // literal: the pattern is a plain string (Split pattern {"String": ...}).
  Regex(const std::string& pattern, bool literal, const std::string& where) {
    std::string pat = literal ? pattern : onig_to_pcre2(pattern);
    // PCRE2_LITERAL rejects PCRE2_UCP ("invalid option bits"); UCP only affects \w, \d, \s and classes anyway.
    uint32_t opts = PCRE2_UTF | (literal ? PCRE2_LITERAL : PCRE2_UCP);
    int err = 0;
    PCRE2_SIZE off = 0;
    code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pat.data()), pat.size(), opts, &err, &off, nullptr);
    if (!code_) {
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(err, msg, sizeof(msg));
      fail("{}: cannot compile regex {:?} at offset {}: {}", where, pattern, off, reinterpret_cast<char*>(msg));
    }
    pcre2_jit_compile(code_, PCRE2_JIT_COMPLETE);  // falls back to the interpreter if JIT is unavailable
  }
  ~Regex() {
    if (code_) pcre2_code_free(code_);
  }
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // Calls f(begin, end) for every piece of an Isolated split of s: each match and each non-empty gap, in order.
  template <class F>
  void split_isolated(std::string_view s, F&& f) const {
    MatchState& st = match_state();
    const auto* subj = reinterpret_cast<PCRE2_SPTR>(s.data());
    size_t n = s.size(), pos = 0, prev = 0;
    while (pos <= n) {
      int rc = pcre2_match(code_, subj, n, pos, PCRE2_NO_UTF_CHECK, st.md, st.mc);
      if (rc == PCRE2_ERROR_NOMATCH) break;
      if (rc < 0) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(rc, msg, sizeof(msg));
        fail("tokenizer: pre-tokenizer regex failed: {}", reinterpret_cast<char*>(msg));
      }
      PCRE2_SIZE* ov = pcre2_get_ovector_pointer(st.md);
      size_t b = ov[0], e = ov[1];
      if (e == b) {  // empty match: contributes no piece; step one code point
        if (b >= n) break;
        int len = 1;
        utf8_decode(subj, b, &len);
        pos = b + len;
        continue;
      }
      if (b > prev) f(prev, b);
      f(b, e);
      prev = pos = e;
    }
    if (prev < n) f(prev, n);
  }

 private:
  pcre2_code* code_ = nullptr;
};

constexpr const char* kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// ---------------------------------------------------------------------------------------------------------------
// Word cache: one per thread, for the tokenizer that used it last (tokenizers get unique serial numbers).

struct StrHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const noexcept { return std::hash<std::string_view>{}(s); }
};
struct WordCache {
  uint64_t owner = 0;
  std::unordered_map<std::string, std::vector<int32_t>, StrHash, std::equal_to<>> map;
};
constexpr size_t kCacheMaxEntries = 1u << 17;
constexpr size_t kCacheMaxWordBytes = 128;
std::atomic<uint64_t> g_tokenizer_serial{1};

struct AddedToken {
  int32_t id;
  std::string content;  // as in the file
  std::string match;    // what is matched: content, NFC-normalized for normalized tokens under an NFC normalizer
  bool single_word, lstrip, rstrip, normalized, special;
};

// Leftmost-longest, non-overlapping matcher over a set of added tokens (HF AddedVocabulary::find_matches).
class AddedMatcher {
 public:
  void build(const std::vector<AddedToken>* all, const std::vector<int>& members) {
    all_ = all;
    for (auto& v : by_byte_) v.clear();
    for (int m : members) {
      const std::string& c = (*all)[m].match;
      if (c.empty()) continue;
      by_byte_[static_cast<unsigned char>(c[0])].push_back(m);
    }
    for (auto& v : by_byte_)
      std::stable_sort(v.begin(), v.end(),
                       [&](int a, int b) { return (*all)[a].match.size() > (*all)[b].match.size(); });
    empty_ = true;
    for (auto& v : by_byte_) empty_ = empty_ && v.empty();
  }
  bool empty() const { return empty_; }

  // Calls on_text(begin, end) for unmatched pieces and on_token(id, begin, end) for matches (the bytes the match
  // consumed, with any whitespace lstrip / rstrip took), in order.
  template <class FT, class FI>
  void split(std::string_view s, FT&& on_text, FI&& on_token) const {
    if (empty_) {
      if (!s.empty()) on_text(0, s.size());
      return;
    }
    size_t n = s.size(), start_offset = 0, i = 0;
    while (i < n) {
      const auto& cands = by_byte_[static_cast<unsigned char>(s[i])];
      const AddedToken* hit = nullptr;
      for (int m : cands) {
        const std::string& c = (*all_)[m].match;
        if (c.size() <= n - i && std::memcmp(s.data() + i, c.data(), c.size()) == 0) {
          hit = &(*all_)[m];
          break;
        }
      }
      if (!hit) {
        ++i;
        continue;
      }
      size_t start = i, stop = i + hit->match.size();
      i = stop;  // the automaton resumes after the raw match
      // A match inside the whitespace an rstrip token swallowed is dropped (HF would emit overlapping pieces).
      if (start < start_offset) continue;
      if (hit->single_word) {
        size_t tmp;
        bool start_space = start == 0 || !is_word_char(last_cp(s, start, &tmp));
        bool stop_space = true;
        if (stop < n) {
          int len;
          stop_space = !is_word_char(utf8_decode(reinterpret_cast<const unsigned char*>(s.data()), stop, &len));
        }
        if (!start_space || !stop_space) continue;
      }
      if (hit->lstrip) {
        size_t ns = start;
        while (ns > 0) {
          size_t b;
          uint32_t cp = last_cp(s, ns, &b);
          if (!is_white_space(cp)) break;
          ns = b;
        }
        start = std::max(ns, start_offset);
      }
      if (hit->rstrip) {
        while (stop < n) {
          int len;
          uint32_t cp = utf8_decode(reinterpret_cast<const unsigned char*>(s.data()), stop, &len);
          if (!is_white_space(cp)) break;
          stop += len;
        }
      }
      if (start_offset < start) on_text(start_offset, start);
      on_token(hit->id, start, stop);
      start_offset = stop;
    }
    if (start_offset < n) on_text(start_offset, n);
  }

 private:
  const std::vector<AddedToken>* all_ = nullptr;
  std::vector<int> by_byte_[256];
  bool empty_ = true;
};

// Ids index dense per-id tables (decode bytes, token strings), so they are capped: a tiny file with one huge id
// must not allocate gigabytes. Real vocabularies are ~250k; 2^22 leaves plenty of room.
constexpr int64_t kMaxTokenId = (int64_t{1} << 22) - 1;

// A JSON value for an error message. nlohmann's dump() recurses once per nesting level, so dumping a deeply
// nested value would overflow the stack: arrays and objects are only named.
std::string brief(const json& v) {
  if (v.is_array()) return "an array";
  if (v.is_object()) return "an object";
  std::string s = v.dump(-1, ' ', /*ensure_ascii=*/true);
  if (s.size() > 80) s = s.substr(0, 77) + "...";
  return s;
}

// JSON field helpers (errors name the file and the field).
const json& require(const json& j, const char* key, const std::string& where, const std::string& path) {
  auto it = j.find(key);
  if (it == j.end()) fail("{}: missing field \"{}{}\"", path, where, key);
  return *it;
}
bool get_bool(const json& j, const char* key, bool dflt, const std::string& where, const std::string& path) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return dflt;
  if (!it->is_boolean()) fail("{}: field \"{}{}\" must be a boolean", path, where, key);
  return it->get<bool>();
}
std::string get_type(const json& j, const std::string& where, const std::string& path) {
  if (!j.is_object()) fail("{}: field \"{}\" must be an object", path, where);
  auto it = j.find("type");
  if (it == j.end() || !it->is_string()) fail("{}: field \"{}.type\" is missing or not a string", path, where);
  return it->get<std::string>();
}

}  // namespace

// ---------------------------------------------------------------------------------------------------------------

struct Tokenizer::Impl {
  uint64_t serial = 0;
  std::string source;  // the file (or the name standing for it) in error messages
  bool nfc = false;
  bool ignore_merges = false;
  std::vector<std::unique_ptr<Regex>> splits;  // applied in order, then BPE

  std::unordered_map<std::string, int32_t, StrHash, std::equal_to<>> vocab;      // token string -> id
  std::unordered_map<std::string, int32_t, StrHash, std::equal_to<>> raw_vocab;  // raw bytes -> id (ignore_merges)
  std::vector<std::string> id_to_tok;  // model vocab, by id ("" where absent)
  std::vector<uint8_t> id_present;
  int32_t byte_id[256];
  PairMap merges;

  std::vector<AddedToken> added;
  std::unordered_map<std::string, int32_t, StrHash, std::equal_to<>> added_by_content;  // original content
  std::unordered_map<int32_t, int> added_by_id;                                        // id -> index in added
  AddedMatcher raw_matcher, norm_matcher;

  std::vector<std::string> dec_bytes;  // per id: bytes the ByteLevel decoder emits
  std::vector<uint8_t> dec_present;
  int64_t vocab_size = 0;

  void bpe_merge(const unsigned char* w, size_t n, std::vector<int32_t>& out) const;
  void encode_word(std::string_view w, std::vector<int32_t>& out) const;
  void pretokenize(size_t level, std::string_view s, std::vector<int32_t>& out) const;
  void encode_normalized_piece(std::string_view s, std::vector<int32_t>& out) const;
  // The same, with each token's byte range [begin, end) in s.
  void encode_normalized_piece_offsets(std::string_view s, std::vector<int32_t>& out,
                                       std::vector<TokenOffset>& offsets) const;
};

// BPE on raw bytes w[0..n): merge the lowest-rank adjacent pair, leftmost on ties, until no pair merges.
void Tokenizer::Impl::bpe_merge(const unsigned char* w, size_t n, std::vector<int32_t>& out) const {
  constexpr int32_t kNone = INT32_MAX;
  if (n <= 64) {
    // Small words: arrays with a cached rank per adjacent pair; each step is a min scan.
    int32_t ids[64], ranks[64], news[64];
    size_t m = n;
    for (size_t i = 0; i < n; ++i) ids[i] = byte_id[w[i]];
    auto look = [&](size_t i) {
      const PairMap::Val* v = merges.get(ids[i], ids[i + 1]);
      ranks[i] = v ? v->rank : kNone;
      news[i] = v ? v->id : -1;
    };
    for (size_t i = 0; i + 1 < m; ++i) look(i);
    while (m > 1) {
      size_t best = 0;
      int32_t br = kNone;
      for (size_t i = 0; i + 1 < m; ++i)
        if (ranks[i] < br) {
          br = ranks[i];
          best = i;
        }
      if (br == kNone) break;
      ids[best] = news[best];
      for (size_t i = best + 1; i + 1 < m; ++i) {
        ids[i] = ids[i + 1];
        ranks[i] = ranks[i + 1];
        news[i] = news[i + 1];
      }
      --m;
      if (best > 0) look(best - 1);
      if (best + 1 < m) look(best);
    }
    out.insert(out.end(), ids, ids + m);
    return;
  }
  // Long words: doubly linked symbols + min-heap of (rank, position), as HF's BPE::merge_word.
  struct Sym {
    int32_t id, prev, next;
    bool alive;
  };
  std::vector<Sym> sym(n);
  for (size_t i = 0; i < n; ++i)
    sym[i] = Sym{byte_id[w[i]], static_cast<int32_t>(i) - 1, i + 1 < n ? static_cast<int32_t>(i + 1) : -1, true};
  struct Entry {
    int32_t rank, pos, new_id;
    bool operator>(const Entry& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  std::priority_queue<Entry, std::vector<Entry>, std::greater<Entry>> q;
  auto push = [&](int32_t pos) {
    if (pos < 0 || sym[pos].next < 0) return;
    const PairMap::Val* v = merges.get(sym[pos].id, sym[sym[pos].next].id);
    if (v) q.push(Entry{v->rank, pos, v->id});
  };
  for (size_t i = 0; i + 1 < n; ++i) push(static_cast<int32_t>(i));
  while (!q.empty()) {
    Entry e = q.top();
    q.pop();
    Sym& a = sym[e.pos];
    if (!a.alive || a.next < 0) continue;
    const PairMap::Val* v = merges.get(a.id, sym[a.next].id);
    if (!v || v->id != e.new_id || v->rank != e.rank) continue;  // stale entry
    Sym& b = sym[a.next];
    a.id = e.new_id;
    b.alive = false;
    a.next = b.next;
    if (a.next >= 0) sym[a.next].prev = e.pos;
    push(a.prev);
    push(e.pos);
  }
  for (int32_t i = 0; i >= 0; i = sym[i].next) out.push_back(sym[i].id);
}

void Tokenizer::Impl::encode_word(std::string_view w, std::vector<int32_t>& out) const {
  const auto* p = reinterpret_cast<const unsigned char*>(w.data());
  if (w.size() == 1) {
    out.push_back(byte_id[p[0]]);
    return;
  }
  thread_local WordCache cache;
  if (cache.owner != serial) {
    cache.map.clear();
    cache.owner = serial;
  }
  bool cacheable = w.size() <= kCacheMaxWordBytes;
  if (cacheable) {
    auto it = cache.map.find(w);
    if (it != cache.map.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  size_t before = out.size();
  bool done = false;
  if (ignore_merges) {
    auto it = raw_vocab.find(w);
    if (it != raw_vocab.end()) {
      out.push_back(it->second);
      done = true;
    }
  }
  if (!done) bpe_merge(p, w.size(), out);
  if (cacheable && cache.map.size() < kCacheMaxEntries)
    cache.map.emplace(std::string(w), std::vector<int32_t>(out.begin() + before, out.end()));
}

void Tokenizer::Impl::pretokenize(size_t level, std::string_view s, std::vector<int32_t>& out) const {
  if (level == splits.size()) {
    encode_word(s, out);
    return;
  }
  splits[level]->split_isolated(s, [&](size_t b, size_t e) { pretokenize(level + 1, s.substr(b, e - b), out); });
}

void Tokenizer::Impl::encode_normalized_piece(std::string_view s, std::vector<int32_t>& out) const {
  norm_matcher.split(
      s, [&](size_t b, size_t e) { pretokenize(0, s.substr(b, e - b), out); },
      [&](int32_t id, size_t, size_t) { out.push_back(id); });
}

void Tokenizer::Impl::encode_normalized_piece_offsets(std::string_view s, std::vector<int32_t>& out,
                                                      std::vector<TokenOffset>& offsets) const {
  // A word's tokens are the word's bytes in order (byte-level BPE), so each token's length is its decoded byte
  // length; when they do not add up (a vocabulary token outside the byte-level alphabet), every token of the word
  // gets the whole word.
  auto words = [&](auto&& self, size_t level, std::string_view w, size_t base) -> void {
    if (level == splits.size()) {
      const size_t first = out.size();
      encode_word(w, out);
      size_t sum = 0;
      for (size_t k = first; k < out.size(); ++k) sum += dec_bytes[static_cast<size_t>(out[k])].size();
      size_t pos = base;
      for (size_t k = first; k < out.size(); ++k) {
        if (sum == w.size()) {
          const size_t len = dec_bytes[static_cast<size_t>(out[k])].size();
          offsets.push_back({pos, pos + len});
          pos += len;
        } else {
          offsets.push_back({base, base + w.size()});
        }
      }
      return;
    }
    splits[level]->split_isolated(w, [&](size_t b, size_t e) { self(self, level + 1, w.substr(b, e - b), base + b); });
  };
  norm_matcher.split(
      s, [&](size_t b, size_t e) { words(words, 0, s.substr(b, e - b), b); },
      [&](int32_t id, size_t b, size_t e) {
        out.push_back(id);
        offsets.push_back({b, e});
      });
}

// ---------------------------------------------------------------------------------------------------------------

Tokenizer::Tokenizer() : impl_(std::make_unique<Impl>()) {}
Tokenizer::~Tokenizer() = default;
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;

Tokenizer Tokenizer::from_file(const std::string& path) { return from_json_string(read_file(path), path); }

Tokenizer Tokenizer::from_json_string(std::string text, const std::string& path) {
  json root;
  try {
    root = json::parse(text);
  } catch (const json::exception& e) {
    fail("{}: invalid JSON ({})", path, printable(e.what()));
  }
  if (!root.is_object()) fail("{}: expected a JSON object at the top level", path);
  text.clear();
  text.shrink_to_fit();

  Tokenizer tok;
  Impl& im = *tok.impl_;
  im.serial = g_tokenizer_serial.fetch_add(1);
  im.source = path;
  const ByteLevelMap& bl = byte_level();

  if (auto it = root.find("truncation"); it != root.end() && !it->is_null())
    fail("{}: field \"truncation\" is not supported (must be null)", path);

  // --- normalizer
  if (auto it = root.find("normalizer"); it != root.end() && !it->is_null()) {
    std::string t = get_type(*it, "normalizer", path);
    if (t == "NFC") {
      im.nfc = true;
    } else if (t == "Sequence") {
      const json& list = require(*it, "normalizers", "normalizer.", path);
      if (!list.is_array()) fail("{}: field \"normalizer.normalizers\" must be an array", path);
      for (size_t i = 0; i < list.size(); ++i) {
        std::string where = fmt::format("normalizer.normalizers[{}]", i);
        std::string ti = get_type(list[i], where, path);
        if (ti != "NFC") fail("{}: field \"{}.type\": unsupported normalizer \"{}\" (only NFC)", path, where, ti);
        im.nfc = true;
      }
    } else {
      fail("{}: field \"normalizer.type\": unsupported normalizer \"{}\" (supported: NFC, Sequence of NFC)", path, t);
    }
  }

  // --- pre_tokenizer
  {
    auto it = root.find("pre_tokenizer");
    if (it == root.end() || it->is_null())
      fail("{}: field \"pre_tokenizer\" is missing; a ByteLevel pre-tokenizer is required", path);
    std::vector<std::pair<const json*, std::string>> steps;
    std::string t = get_type(*it, "pre_tokenizer", path);
    if (t == "Sequence") {
      const json& list = require(*it, "pretokenizers", "pre_tokenizer.", path);
      if (!list.is_array()) fail("{}: field \"pre_tokenizer.pretokenizers\" must be an array", path);
      for (size_t i = 0; i < list.size(); ++i)
        steps.emplace_back(&list[i], fmt::format("pre_tokenizer.pretokenizers[{}]", i));
    } else {
      steps.emplace_back(&*it, "pre_tokenizer");
    }
    bool saw_byte_level = false;
    for (size_t i = 0; i < steps.size(); ++i) {
      const json& st = *steps[i].first;
      const std::string& where = steps[i].second;
      std::string ts = get_type(st, where, path);
      if (saw_byte_level) fail("{}: field \"{}\": ByteLevel must be the last pre-tokenizer", path, where);
      if (ts == "Split") {
        const json& pat = require(st, "pattern", where + ".", path);
        bool literal;
        std::string pattern;
        if (pat.is_object() && pat.contains("Regex") && pat["Regex"].is_string()) {
          literal = false;
          pattern = pat["Regex"].get<std::string>();
        } else if (pat.is_object() && pat.contains("String") && pat["String"].is_string()) {
          literal = true;
          pattern = pat["String"].get<std::string>();
        } else {
          fail("{}: field \"{}.pattern\" must be {{\"Regex\": str}} or {{\"String\": str}}", path, where);
        }
        const json& beh = require(st, "behavior", where + ".", path);
        if (!beh.is_string() || beh.get<std::string>() != "Isolated")
          fail("{}: field \"{}.behavior\": unsupported value {} (only \"Isolated\")", path, where, brief(beh));
        if (get_bool(st, "invert", false, where + ".", path))
          fail("{}: field \"{}.invert\": true is not supported", path, where);
        im.splits.push_back(std::make_unique<Regex>(pattern, literal, fmt::format("{}: field \"{}.pattern\"", path, where)));
      } else if (ts == "ByteLevel") {
        if (get_bool(st, "add_prefix_space", true, where + ".", path))
          fail("{}: field \"{}.add_prefix_space\": true is not supported", path, where);
        if (get_bool(st, "use_regex", true, where + ".", path))
          im.splits.push_back(
              std::make_unique<Regex>(kGpt2Pattern, false, fmt::format("{}: field \"{}\"", path, where)));
        saw_byte_level = true;
      } else {
        fail("{}: field \"{}.type\": unsupported pre-tokenizer \"{}\" (supported: Split, ByteLevel, Sequence)",
             path, where, ts);
      }
    }
    if (!saw_byte_level) fail("{}: field \"pre_tokenizer\": a ByteLevel pre-tokenizer is required", path);
  }

  // --- decoder
  {
    auto it = root.find("decoder");
    if (it == root.end() || it->is_null()) fail("{}: field \"decoder\" is missing; a ByteLevel decoder is required", path);
    std::string t = get_type(*it, "decoder", path);
    if (t != "ByteLevel") fail("{}: field \"decoder.type\": unsupported decoder \"{}\" (only ByteLevel)", path, t);
  }

  // --- model
  const json& model = require(root, "model", "", path);
  if (!model.is_object()) fail("{}: field \"model\" must be an object", path);
  if (auto it = model.find("type"); it != model.end()) {
    if (!it->is_string() || it->get<std::string>() != "BPE")
      fail("{}: field \"model.type\": unsupported model {} (only BPE)", path, brief(*it));
  }
  if (auto it = model.find("dropout"); it != model.end() && !it->is_null()) {
    if (!it->is_number() || it->get<double>() != 0.0)
      fail("{}: field \"model.dropout\": BPE dropout {} is not supported (must be null)", path, brief(*it));
  }
  for (const char* k : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    auto it = model.find(k);
    if (it != model.end() && !it->is_null() && !(it->is_string() && it->get<std::string>().empty()))
      fail("{}: field \"model.{}\": non-empty value {} is not supported", path, k, brief(*it));
  }
  im.ignore_merges = get_bool(model, "ignore_merges", false, "model.", path);

  const json& vocab = require(model, "vocab", "model.", path);
  if (!vocab.is_object()) fail("{}: field \"model.vocab\" must be an object of token -> id", path);
  int64_t max_id = -1;
  im.vocab.reserve(vocab.size() * 2);
  for (auto it = vocab.begin(); it != vocab.end(); ++it) {
    if (!it.value().is_number_integer()) fail("{}: field \"model.vocab\": id of {:?} is not an integer", path, it.key());
    int64_t id = it.value().get<int64_t>();
    if (it.value().is_number_unsigned() && it.value().get<uint64_t>() > static_cast<uint64_t>(kMaxTokenId)) id = -1;
    if (id < 0 || id > kMaxTokenId)
      fail("{}: field \"model.vocab\": id {} of {:?} out of range [0, {}]", path, brief(it.value()), it.key(),
           kMaxTokenId);
    im.vocab[it.key()] = static_cast<int32_t>(id);
    max_id = std::max(max_id, id);
  }
  im.id_to_tok.assign(static_cast<size_t>(max_id + 1), std::string());
  im.id_present.assign(static_cast<size_t>(max_id + 1), 0);
  for (const auto& [tokstr, id] : im.vocab) {
    // Two tokens on one id: encoding would give that id for both, decoding only one of them.
    if (im.id_present[id])
      fail("{}: field \"model.vocab\": tokens {:?} and {:?} both have id {} (each id names one token)", path,
           im.id_to_tok[id], tokstr, id);
    im.id_to_tok[id] = tokstr;
    im.id_present[id] = 1;
  }
  std::fill(std::begin(im.byte_id), std::end(im.byte_id), -1);
  {
    std::string raw;
    for (const auto& [tokstr, id] : im.vocab) {
      if (!bl.unmap(tokstr, &raw)) continue;
      if (raw.size() == 1) im.byte_id[static_cast<unsigned char>(raw[0])] = id;
      if (im.ignore_merges) im.raw_vocab[raw] = id;
    }
  }
  for (int b = 0; b < 256; ++b) {
    if (im.byte_id[b] < 0) {
      std::string s;
      utf8_append(s, bl.byte_to_cp[b]);
      fail("{}: field \"model.vocab\": missing the byte-level token {:?} for byte 0x{:02X}", path, s, b);
    }
  }

  const json& merges = require(model, "merges", "model.", path);
  if (!merges.is_array()) fail("{}: field \"model.merges\" must be an array", path);
  im.merges.reserve(merges.size());
  for (size_t i = 0; i < merges.size(); ++i) {
    const json& m = merges[i];
    std::string a, b;
    if (m.is_string()) {
      const std::string& s = m.get_ref<const std::string&>();
      size_t sp = s.find(' ');
      if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos)
        fail("{}: field \"model.merges[{}]\": {:?} is not \"a b\"", path, i, s);
      a = s.substr(0, sp);
      b = s.substr(sp + 1);
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
      a = m[0].get<std::string>();
      b = m[1].get<std::string>();
    } else {
      fail("{}: field \"model.merges[{}]\": expected \"a b\" or [a, b], got {}", path, i, brief(m));
    }
    auto ia = im.vocab.find(a), ib = im.vocab.find(b), ic = im.vocab.find(a + b);
    if (ia == im.vocab.end()) fail("{}: field \"model.merges[{}]\": token {:?} is not in model.vocab", path, i, a);
    if (ib == im.vocab.end()) fail("{}: field \"model.merges[{}]\": token {:?} is not in model.vocab", path, i, b);
    if (ic == im.vocab.end())
      fail("{}: field \"model.merges[{}]\": merged token {:?} is not in model.vocab", path, i, a + b);
    im.merges.put(ia->second, ib->second, PairMap::Val{static_cast<int32_t>(i), ic->second});
  }

  // --- added tokens
  if (auto it = root.find("added_tokens"); it != root.end() && !it->is_null()) {
    if (!it->is_array()) fail("{}: field \"added_tokens\" must be an array", path);
    for (size_t i = 0; i < it->size(); ++i) {
      const json& a = (*it)[i];
      std::string where = fmt::format("added_tokens[{}].", i);
      if (!a.is_object()) fail("{}: field \"added_tokens[{}]\" must be an object", path, i);
      const json& jid = require(a, "id", where, path);
      const json& jc = require(a, "content", where, path);
      if (!jid.is_number_integer() ||
          (jid.is_number_unsigned() && jid.get<uint64_t>() > static_cast<uint64_t>(kMaxTokenId)) ||
          jid.get<int64_t>() < 0 || jid.get<int64_t>() > kMaxTokenId)
        fail("{}: field \"{}id\" must be an integer in [0, {}], got {}", path, where, kMaxTokenId, brief(jid));
      if (!jc.is_string() || jc.get<std::string>().empty())
        fail("{}: field \"{}content\" must be a non-empty string", path, where);
      AddedToken t;
      t.id = static_cast<int32_t>(jid.get<int64_t>());
      t.content = jc.get<std::string>();
      if (utf8_first_invalid(t.content) != std::string_view::npos)
        fail("{}: field \"{}content\" is not valid UTF-8", path, where);
      t.single_word = get_bool(a, "single_word", false, where, path);
      t.lstrip = get_bool(a, "lstrip", false, where, path);
      t.rstrip = get_bool(a, "rstrip", false, where, path);
      t.normalized = get_bool(a, "normalized", true, where, path);
      t.special = get_bool(a, "special", false, where, path);
      if (auto same = im.added_by_id.find(t.id); same != im.added_by_id.end() && im.added[same->second].content != t.content)
        fail("{}: field \"{}id\": id {} is also the id of added_tokens[{}] ({:?}), a different token {:?}", path,
             where, t.id, same->second, im.added[same->second].content, t.content);
      im.added_by_content[t.content] = t.id;
      im.added_by_id[t.id] = static_cast<int>(im.added.size());
      max_id = std::max<int64_t>(max_id, t.id);
      im.added.push_back(std::move(t));
    }
  }
  // HF adds each content once; a later duplicate replaces an earlier one.
  std::vector<int> raw_members, norm_members;
  for (size_t i = 0; i < im.added.size(); ++i) {
    AddedToken& t = im.added[i];
    if (im.added_by_content[t.content] != t.id) continue;
    t.match = (t.normalized && im.nfc) ? nfc(t.content) : t.content;
    if (t.normalized) {
      norm_members.push_back(static_cast<int>(i));
    } else {
      raw_members.push_back(static_cast<int>(i));
    }
  }
  im.raw_matcher.build(&im.added, raw_members);
  im.norm_matcher.build(&im.added, norm_members);

  // --- decode table
  im.vocab_size = max_id + 1;
  im.dec_bytes.assign(static_cast<size_t>(im.vocab_size), std::string());
  im.dec_present.assign(static_cast<size_t>(im.vocab_size), 0);
  auto set_dec = [&](int32_t id, const std::string& tokstr) {
    std::string raw;
    im.dec_bytes[id] = bl.unmap(tokstr, &raw) ? raw : tokstr;
    im.dec_present[id] = 1;
  };
  for (int32_t id = 0; id < static_cast<int32_t>(im.id_to_tok.size()); ++id)
    if (im.id_present[id]) set_dec(id, im.id_to_tok[id]);
  for (const AddedToken& t : im.added) {  // added tokens decode to their content verbatim
    im.dec_bytes[t.id] = t.content;
    im.dec_present[t.id] = 1;
  }
  return tok;
}

std::vector<int32_t> Tokenizer::encode(std::string_view text) const {
  size_t bad = utf8_first_invalid(text);
  if (bad != std::string_view::npos)
    fail("tokenizer: invalid UTF-8 at byte offset {} (byte 0x{:02X})", bad, static_cast<unsigned char>(text[bad]));
  const Impl& im = *impl_;
  std::vector<int32_t> out;
  out.reserve(text.size() / 3 + 4);
  im.raw_matcher.split(
      text,
      [&](size_t b, size_t e) {
        std::string_view piece = text.substr(b, e - b);
        if (im.nfc) {
          std::string norm = nfc(piece);
          im.encode_normalized_piece(norm, out);
        } else {
          im.encode_normalized_piece(piece, out);
        }
      },
      [&](int32_t id, size_t, size_t) { out.push_back(id); });
  return out;
}

std::vector<int32_t> Tokenizer::encode_with_offsets(std::string_view text, std::vector<TokenOffset>& offsets) const {
  size_t bad = utf8_first_invalid(text);
  if (bad != std::string_view::npos)
    fail("tokenizer: invalid UTF-8 at byte offset {} (byte 0x{:02X})", bad, static_cast<unsigned char>(text[bad]));
  const Impl& im = *impl_;
  std::vector<int32_t> out;
  offsets.clear();
  std::vector<TokenOffset> local;
  im.raw_matcher.split(
      text,
      [&](size_t b, size_t e) {
        const std::string_view piece = text.substr(b, e - b);
        local.clear();
        if (!im.nfc) {
          im.encode_normalized_piece_offsets(piece, out, local);
          for (const TokenOffset& o : local) offsets.push_back({b + o.begin, b + o.end});
          return;
        }
        const std::string norm = nfc(piece);
        im.encode_normalized_piece_offsets(norm, out, local);
        if (norm == piece) {
          for (const TokenOffset& o : local) offsets.push_back({b + o.begin, b + o.end});
          return;
        }
        // NFC changed the piece. No code point composes with or reorders across a '\n' (a starter without
        // compositions), so the piece normalizes line by line: offsets at line starts and ends map exactly, and
        // one inside a line maps to a position strictly inside the same line of the text.
        std::vector<size_t> orig_start{0}, norm_start{0};
        std::string joined;
        for (size_t p = 0; p < piece.size();) {
          size_t nl = piece.find('\n', p);
          size_t end = nl == std::string_view::npos ? piece.size() : nl + 1;
          joined += nfc(piece.substr(p, end - p));
          p = end;
          orig_start.push_back(p);
          norm_start.push_back(joined.size());
        }
        if (joined != norm) {  // not expected; the piece as a whole is then the best that can be said
          for (size_t k = 0; k < local.size(); ++k) offsets.push_back({b, e});
          return;
        }
        auto map = [&](size_t x) {
          const size_t k = static_cast<size_t>(std::upper_bound(norm_start.begin(), norm_start.end(), x) -
                                               norm_start.begin()) - 1;
          if (x == norm_start[k]) return b + orig_start[k];
          const size_t len = orig_start[k + 1] - orig_start[k];
          return b + orig_start[k] + std::clamp<size_t>(x - norm_start[k], 1, len > 1 ? len - 1 : 1);
        };
        for (const TokenOffset& o : local) offsets.push_back({map(o.begin), map(o.end)});
      },
      [&](int32_t id, size_t b, size_t e) {
        out.push_back(id);
        offsets.push_back({b, e});
      });
  return out;
}

std::string Tokenizer::decode(const std::vector<int32_t>& ids) const {
  const Impl& im = *impl_;
  std::string bytes;
  for (int32_t id : ids) {
    if (id < 0 || id >= im.vocab_size || !im.dec_present[id]) continue;  // HF skips ids without a token
    bytes += im.dec_bytes[id];
  }
  return utf8_lossy(bytes);
}

int64_t Tokenizer::vocab_size() const { return impl_->vocab_size; }
const std::string& Tokenizer::source() const { return impl_->source; }

int32_t Tokenizer::token_to_id(std::string_view token) const {
  if (auto it = impl_->added_by_content.find(token); it != impl_->added_by_content.end()) return it->second;
  if (auto it = impl_->vocab.find(token); it != impl_->vocab.end()) return it->second;
  return -1;
}

int32_t Tokenizer::required_id(std::string_view token, std::string_view needed_for, bool matched_in_text) const {
  if (auto it = impl_->added_by_content.find(token); it != impl_->added_by_content.end()) return it->second;
  const int32_t id = matched_in_text ? -1 : token_to_id(token);
  DS_CHECK(id >= 0, "{}: the tokenizer has no {} token{}, which {} needs (use a tokenizer.json that has it, e.g. the "
           "bundled Qwen3 one)", impl_->source, token, matched_in_text ? " in \"added_tokens\"" : "", needed_for);
  return id;
}

std::string Tokenizer::id_to_token(int32_t id) const {
  const Impl& im = *impl_;
  if (auto it = im.added_by_id.find(id); it != im.added_by_id.end()) return im.added[it->second].content;
  if (id >= 0 && id < static_cast<int32_t>(im.id_to_tok.size()) && im.id_present[id]) return im.id_to_tok[id];
  return "";
}

}  // namespace ds
