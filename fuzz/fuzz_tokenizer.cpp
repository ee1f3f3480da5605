// libFuzzer targets for the tokenizer (see fuzz/README.md for the build commands). One source, two targets:
//
//   fuzz_tokenizer_json   (default): each input is a tokenizer.json text for Tokenizer::from_json_string.
//       Rejection must be a ds::Error; never a crash, sanitizer report, other exception, hang or absurd
//       allocation. An accepted tokenizer is exercised: encoding fixed probe strings and the input itself (when
//       valid UTF-8) must give ids that all have a token (< vocab_size), encoding twice (word cache) must give
//       the same ids, and decode of those ids and of arbitrary ids must be valid UTF-8. A ds::Error from encode
//       is tolerated here only for PCRE2 resource limits of a fuzzed regex.
//
//   fuzz_tokenizer_encode (-DFUZZ_TOKENIZER_ENCODE): the real Qwen3 tokenizer (data/qwen3_tokenizer/tokenizer.json,
//       or $DS_TOKENIZER) is loaded once; each input is text. Invalid UTF-8 must be a ds::Error; valid UTF-8 must
//       encode to in-range ids, deterministically; when the text equals its NFC form, decode(encode(x)) == x.
//       The input bytes are also decoded as raw int32 ids (out-of-range and negative included): the result must
//       be valid UTF-8.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>
#include <string_view>
#include <vector>

#include <utf8proc.h>

#include "core/error.h"
#include "data/tokenizer.h"

namespace {

[[noreturn]] void bug(const char* what, std::string_view detail = {}) {
  std::fprintf(stderr, "fuzz_tokenizer invariant violated: %s %.*s\n", what, static_cast<int>(detail.size()),
               detail.data());
  std::abort();
}

// Independent UTF-8 check (Unicode Table 3-7, well-formed byte sequences).
bool valid_utf8(std::string_view s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  size_t n = s.size(), i = 0;
  while (i < n) {
    unsigned c = p[i];
    size_t len;
    unsigned lo = 0x80, hi = 0xBF;
    if (c <= 0x7F) {
      ++i;
      continue;
    } else if (c >= 0xC2 && c <= 0xDF) {
      len = 2;
    } else if (c == 0xE0) {
      len = 3, lo = 0xA0;
    } else if ((c >= 0xE1 && c <= 0xEC) || c == 0xEE || c == 0xEF) {
      len = 3;
    } else if (c == 0xED) {
      len = 3, hi = 0x9F;
    } else if (c == 0xF0) {
      len = 4, lo = 0x90;
    } else if (c >= 0xF1 && c <= 0xF3) {
      len = 4;
    } else if (c == 0xF4) {
      len = 4, hi = 0x8F;
    } else {
      return false;
    }
    if (i + len > n) return false;
    if (p[i + 1] < lo || p[i + 1] > hi) return false;
    for (size_t k = 2; k < len; ++k)
      if (p[i + k] < 0x80 || p[i + k] > 0xBF) return false;
    i += len;
  }
  return true;
}

std::string nfc(std::string_view s) {
  utf8proc_uint8_t* dst = nullptr;
  utf8proc_ssize_t n = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(s.data()),
                                    static_cast<utf8proc_ssize_t>(s.size()), &dst,
                                    static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_COMPOSE));
  if (n < 0) bug("utf8proc_map failed on valid UTF-8");
  std::string out(reinterpret_cast<char*>(dst), static_cast<size_t>(n));
  std::free(dst);
  return out;
}

void check_ids(const ds::Tokenizer& tok, const std::vector<int32_t>& ids) {
  for (int32_t id : ids) {
    if (id < 0 || id >= tok.vocab_size()) bug("id out of range");
    if (tok.id_to_token(id).empty()) bug("id without a token");
  }
}

// Raw little-endian int32 ids from the input bytes (any value, also negative / out of range).
std::vector<int32_t> raw_ids(const uint8_t* data, size_t size) {
  std::vector<int32_t> ids(size / 4);
  if (!ids.empty()) std::memcpy(ids.data(), data, ids.size() * 4);
  return ids;
}

#ifdef FUZZ_TOKENIZER_ENCODE

const ds::Tokenizer& qwen3() {
  static const ds::Tokenizer tok = [] {
    const char* env = std::getenv("DS_TOKENIZER");
    std::string path = env ? env : "data/qwen3_tokenizer/tokenizer.json";
    try {
      return ds::Tokenizer::from_file(path);
    } catch (const ds::Error& e) {
      std::fprintf(stderr, "fuzz_tokenizer_encode: cannot load %s (run from the repository root or set "
                           "DS_TOKENIZER): %s\n", path.c_str(), e.what());
      std::exit(1);
    }
  }();
  return tok;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  qwen3();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const ds::Tokenizer& tok = qwen3();
  const std::string text(reinterpret_cast<const char*>(data), size);
  const bool valid = valid_utf8(text);
  std::vector<int32_t> ids;
  try {
    ids = tok.encode(text);
  } catch (const ds::Error& e) {
    if (valid) bug("encode rejected valid UTF-8:", e.what());
    if (std::strstr(e.what(), "invalid UTF-8") == nullptr) bug("unexpected encode error:", e.what());
  } catch (const std::exception& e) {
    bug("non-ds::Error exception from encode:", e.what());
  }
  if (valid) {
    if (!text.empty() && ids.empty()) bug("non-empty text encoded to no ids");
    check_ids(tok, ids);
    if (tok.encode(text) != ids) bug("encode is not deterministic (word cache)");
    const std::string back = tok.decode(ids);
    if (!valid_utf8(back)) bug("decode output is not valid UTF-8");
    if (nfc(text) == text && back != text) bug("decode(encode(x)) != x for NFC text");
  } else if (!ids.empty()) {
    bug("encode accepted invalid UTF-8");
  }
  const std::string d = tok.decode(raw_ids(data, size));
  if (!valid_utf8(d)) bug("decode of raw ids is not valid UTF-8");
  return 0;
}

#else  // tokenizer.json parsing

const char* const kProbes[] = {
    "Hello, world! It's 2026.",
    "  leading and trailing  \n\n\ttabs\r\n",
    "caf\xC3\xA9 cafe\xCC\x81 \xE4\xBD\xA0\xE5\xA5\xBD \xF0\x9F\x98\x80 \xE2\x80\xAF\xC2\xA0x",
    "<|endoftext|><|im_start|>user\nhi<|im_end|>",
    "",
};

void exercise(const ds::Tokenizer& tok, std::string_view text) {
  std::vector<int32_t> ids;
  try {
    ids = tok.encode(text);
  } catch (const ds::Error& e) {
    // A fuzzed Split regex may hit PCRE2's match/depth/heap limits; that must surface as this ds::Error.
    if (std::strstr(e.what(), "pre-tokenizer regex failed") == nullptr) bug("unexpected encode error:", e.what());
    return;
  }
  if (!text.empty() && ids.empty()) bug("non-empty text encoded to no ids");
  check_ids(tok, ids);
  if (tok.encode(text) != ids) bug("encode is not deterministic (word cache)");
  if (!valid_utf8(tok.decode(ids))) bug("decode output is not valid UTF-8");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string text(reinterpret_cast<const char*>(data), size);
  try {
    const ds::Tokenizer tok = ds::Tokenizer::from_json_string(text, "fuzz-input");
    if (tok.vocab_size() < 256) bug("accepted a vocabulary without the 256 byte tokens");
    for (const char* p : kProbes) exercise(tok, p);
    if (valid_utf8(text)) {
      size_t cut = std::min<size_t>(text.size(), 512);  // a prefix that ends on a character boundary
      while (cut < text.size() && (static_cast<unsigned char>(text[cut]) & 0xC0) == 0x80) --cut;
      exercise(tok, std::string_view(text).substr(0, cut));
    }
    if (!valid_utf8(tok.decode(raw_ids(data, size)))) bug("decode of raw ids is not valid UTF-8");
  } catch (const ds::Error&) {
    // Rejected tokenizer: expected.
  } catch (const std::exception& e) {
    bug("non-ds::Error exception escaped:", e.what());
  }
  return 0;
}

#endif
