// Byte-level BPE tokenizer loaded from a Hugging Face tokenizer.json (the Qwen2/Qwen3 family: NFC normalizer,
// Split-regex pre-tokenizer (Isolated) + ByteLevel(use_regex=false), BPE model with merges, ByteLevel decoder,
// added tokens matched before normalisation). Matches HF tokenizers' encode(text, add_special_tokens=False)
// and decode(ids, skip_special_tokens=False).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace ds {

// The bytes [begin, end) of the text a token came from.
struct TokenOffset {
  size_t begin = 0, end = 0;
};

class Tokenizer {
 public:
  // Throws ds::Error naming the file for a missing/corrupt file or an unsupported model/normalizer/pre-tokenizer.
  static Tokenizer from_file(const std::string& path);
  // Same, from the tokenizer.json text itself; `name` stands for the file in error messages.
  static Tokenizer from_json_string(std::string json_text, const std::string& name);
  ~Tokenizer();
  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;

  // UTF-8 text -> ids. Invalid UTF-8 is handled as documented in tokenizer.cpp (ds::Error naming the byte offset).
  std::vector<int32_t> encode(std::string_view text) const;
  // encode(text), and for each id the bytes of `text` it came from (HF's offset mapping, in bytes; offsets.size()
  // == ids.size()). Added tokens: the bytes they matched. Model tokens: exact, except inside a line that the NFC
  // normalizer changed, where an offset not at the line's start or end lies somewhere strictly inside that line.
  // A token that is part of a UTF-8 character covers only its own bytes of it.
  std::vector<int32_t> encode_with_offsets(std::string_view text, std::vector<TokenOffset>& offsets) const;
  // ids -> UTF-8 text (byte-level decode; incomplete byte sequences become U+FFFD as HF does).
  std::string decode(const std::vector<int32_t>& ids) const;

  int64_t vocab_size() const;                       // max id + 1 (model vocab and added tokens)
  const std::string& source() const;                // the file it was read from (the name given), for messages
  int32_t token_to_id(std::string_view token) const;  // -1 if unknown
  std::string id_to_token(int32_t id) const;          // "" if unknown
  // The id of a special token something depends on (token_to_id), or ds::Error naming the tokenizer's file, the
  // token and `needed_for` (what needs it) when the tokenizer lacks it. With matched_in_text the token must be one of
  // "added_tokens" (matched whole before normalisation, so that encode gives its one id wherever the text holds it,
  // as the chat template's markers need); a plain vocabulary entry of that spelling does not count.
  int32_t required_id(std::string_view token, std::string_view needed_for, bool matched_in_text = false) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  Tokenizer();
};

}  // namespace ds
