// Regression cases found by the libFuzzer targets in fuzz/ (fuzz_config, fuzz_tokenizer_json,
// fuzz_tokenizer_encode; see fuzz/README.md "Campaigns"). Each case failed (crash, sanitizer report, non-ds::Error
// exception, absurd allocation or silent mis-parse) before its fix. They need no sanitizer to run.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/error.h"
#include "data/tokenizer.h"
#include "model/config.h"
#include "test_util.h"

namespace {

using nlohmann::json;

// Expects fn() to throw ds::Error whose message contains every string in `needles`.
template <class F>
void expect_error(F&& fn, const std::vector<std::string>& needles) {
  try {
    fn();
    ADD_FAILURE() << "expected ds::Error";
  } catch (const ds::Error& e) {
    const std::string msg = e.what();
    for (const auto& n : needles) EXPECT_NE(msg.find(n), std::string::npos) << "missing \"" << n << "\" in: " << msg;
  }
}

ds::ModelConfig config(const std::string& text) { return ds::ModelConfig::from_json(json::parse(text), "regress"); }

// `depth` nested empty arrays: deep enough that a recursive nlohmann dump()/copy overflows an 8 MiB stack.
std::string deep_array(size_t depth) { return std::string(depth, '[') + std::string(depth, ']'); }
constexpr size_t kDeep = 500000;

// ---------------------------------------------------------------------------------------------------------------
// ModelConfig::from_json

// fuzz_config: vocab_size = hidden_size = 2^31 passed the old "below 2^31" check and num_parameters() overflowed
// int64 (UBSan: signed integer overflow in config.cpp). Sizes now have per-field limits.
TEST(FuzzRegressions, ConfigHugeSizesAreRejected) {
  expect_error([] { config(R"({"vocab_size": 2147483648, "hidden_size": 2147483648})"); }, {"regress", "vocab_size"});
  expect_error([] { config(R"({"hidden_size": 2147483648})"); }, {"hidden_size", "at most 1048576"});
  expect_error([] { config(R"({"intermediate_size": 1048577})"); }, {"intermediate_size"});
  expect_error([] { config(R"({"vocab_size": 16777217})"); }, {"vocab_size", "at most 16777216"});
  expect_error([] { config(R"({"head_dim": 65537})"); }, {"head_dim", "at most 65536"});
  expect_error([] { config(R"({"linear_conv_kernel_dim": 65537})"); }, {"linear_conv_kernel_dim"});
  expect_error([] { config(R"({"max_position_embeddings": 2147483649})"); }, {"max_position_embeddings"});
}

// fuzz_config: linear_num_key_heads = linear_key_head_dim = linear_num_value_heads = 2^31 made key_dim() 2^62
// and conv_dim() = 2 * key_dim() + value_dim() overflow (UBSan in config.h). Products of fields are limited too.
TEST(FuzzRegressions, ConfigProjectionWidthOverflowIsRejected) {
  expect_error(
      [] {
        config(R"({"linear_num_key_heads": 2147483648, "linear_key_head_dim": 2147483648,
                   "linear_num_value_heads": 2147483648})");
      },
      {"linear_key_head_dim", "at most 65536"});
  expect_error([] { config(R"({"linear_num_key_heads": 65536, "linear_num_value_heads": 65536})"); },
               {"linear_num_key_heads * linear_key_head_dim", "1048576"});
  expect_error([] { config(R"({"num_attention_heads": 8192, "num_key_value_heads": 4})"); },
               {"num_attention_heads * head_dim"});
}

// The largest accepted sizes: every derived quantity must be computable without overflow.
TEST(FuzzRegressions, ConfigLimitsKeepDerivedQuantitiesInRange) {
  const ds::ModelConfig c = config(R"({"vocab_size": 16777216, "hidden_size": 1048576, "intermediate_size": 1048576,
      "num_hidden_layers": 65536, "num_attention_heads": 4096, "num_key_value_heads": 4096, "head_dim": 256,
      "linear_num_key_heads": 8192, "linear_key_head_dim": 128, "linear_num_value_heads": 8192,
      "linear_value_head_dim": 128, "linear_conv_kernel_dim": 65536, "full_attention_interval": 2})");
  EXPECT_EQ(c.num_hidden_layers, 65536);
  EXPECT_EQ(c.conv_dim(), 3 * (int64_t{1} << 20));
  // The same count in long double (exact below 2^64): half the layers full attention, half linear attention.
  const long double H = 1048576.0L, w = 1048576.0L, cd = 3 * w, Hv = 8192.0L, K = 65536.0L;
  const long double mlp = 2 * H + 3 * H * w;
  const long double full = H * w * 2 + 2 * H * w + w * H + 2 * 256;
  const long double linear = cd * H + w * H + 2 * Hv * H + cd * K + 2 * Hv + 128 + H * w;
  const long double expect = 2 * 16777216.0L * H + H + 32768 * (mlp + full) + 32768 * (mlp + linear);
  EXPECT_LT(expect, 9.2e18L);
  EXPECT_EQ(static_cast<long double>(c.num_parameters()), expect);
  // One layer more is refused before layer_types is built.
  expect_error([] { config(R"({"num_hidden_layers": 65537})"); }, {"num_hidden_layers", "at most 65536"});
  expect_error([] { config(R"({"num_hidden_layers": 100000, "full_attention_interval": 3})"); },
               {"num_hidden_layers"});
}

// fuzz_config: an unsigned JSON integer above INT64_MAX was read through get<int64_t>() and wrapped to a negative
// number, so 18446744073709551615 was reported as "-1" (and eos_token_id silently became "none").
TEST(FuzzRegressions, ConfigUnsignedAboveInt64IsOutOfRange) {
  expect_error([] { config(R"({"hidden_size": 18446744073709551615})"); },
               {"hidden_size", "out of range", "18446744073709551615"});
  expect_error([] { config(R"({"eos_token_id": 18446744073709551615})"); }, {"eos_token_id", "out of range"});
  expect_error([] { config(R"({"full_attention_interval": 9223372036854775808})"); },
               {"full_attention_interval", "out of range"});
  EXPECT_EQ(config(R"({"eos_token_id": 9223372036854775807})").eos_token_id, INT64_MAX);
}

// A deeply nested value in a field reported by an error used to be dump()ed into the message: nlohmann's dump()
// recurses per level and overflowed the stack (SIGSEGV). Error messages now only name arrays and objects.
TEST(FuzzRegressions, ConfigDeeplyNestedValueDoesNotOverflowTheStack) {
  const std::string deep = deep_array(kDeep);
  expect_error([&] { config(R"({"hidden_size": )" + deep + "}"); }, {"hidden_size", "must be an integer, got an array"});
  expect_error([&] { config(R"({"rope_theta": )" + deep + "}"); }, {"rope_theta", "an array"});
  expect_error([&] { config(R"({"tie_word_embeddings": )" + deep + "}"); }, {"tie_word_embeddings", "an array"});
  expect_error([&] { config(R"({"hidden_act": )" + deep + "}"); }, {"hidden_act", "an array"});
  expect_error([&] { config(R"({"layer_types": [)" + deep + "]}"); }, {"layer_types", "an array"});
  // Long scalars are shortened in messages.
  expect_error([] { config(R"({"hidden_act": ")" + std::string(100000, 'x') + "\"}"); }, {"hidden_act", "xxx..."});
}

// Non-finite floats cannot come from json::parse, but from_json also takes programmatic JSON: inf rope_theta /
// initializer_range passed "> 0" and to_json() then wrote them as null.
TEST(FuzzRegressions, ConfigNonFiniteFloatsAreRejected) {
  expect_error([] { ds::ModelConfig::from_json(json{{"rope_theta", INFINITY}}, "regress"); }, {"rope_theta", "finite"});
  expect_error([] { ds::ModelConfig::from_json(json{{"initializer_range", INFINITY}}, "regress"); },
               {"initializer_range", "finite"});
  expect_error([] { ds::ModelConfig::from_json(json{{"rms_norm_eps", NAN}}, "regress"); }, {"rms_norm_eps"});
  expect_error([] { ds::ModelConfig::from_json(json{{"partial_rotary_factor", NAN}}, "regress"); },
               {"partial_rotary_factor"});
}

// ---------------------------------------------------------------------------------------------------------------
// Tokenizer::from_json_string

// A minimal valid byte-level BPE tokenizer.json: the 256 GPT-2 byte-level tokens (id = byte), "he" = 256 with the
// merge "h e", NFC, Split(Qwen-style regex, Isolated) + ByteLevel(use_regex=false), ByteLevel decoder.
json tiny_tokenizer() {
  json vocab = json::object();
  int next = 256;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
    const uint32_t cp = printable ? static_cast<uint32_t>(b) : static_cast<uint32_t>(next++);
    std::string s;
    if (cp < 0x80) {
      s.push_back(static_cast<char>(cp));
    } else {
      s.push_back(static_cast<char>(0xC0 | (cp >> 6)));
      s.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    }
    vocab[s] = b;
  }
  vocab["he"] = 256;
  const json bl = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", false}, {"use_regex", false}};
  json split = {{"type", "Split"},
                {"pattern", {{"Regex", R"([^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s+(?!\S)|\s+)"}}},
                {"behavior", "Isolated"},
                {"invert", false}};
  return {{"version", "1.0"},
          {"truncation", nullptr},
          {"normalizer", {{"type", "NFC"}}},
          {"pre_tokenizer", {{"type", "Sequence"}, {"pretokenizers", json::array({split, bl})}}},
          {"decoder", bl},
          {"added_tokens", json::array()},
          {"model",
           {{"type", "BPE"}, {"dropout", nullptr}, {"vocab", vocab}, {"merges", json::array({json::array({"h", "e"})})}}}};
}

ds::Tokenizer load(const json& j) { return ds::Tokenizer::from_json_string(j.dump(), "regress.json"); }

TEST(FuzzRegressions, TokenizerTinySeedLoads) {
  const ds::Tokenizer t = load(tiny_tokenizer());
  EXPECT_EQ(t.vocab_size(), 257);
  EXPECT_EQ(t.encode("hehe h"), (std::vector<int32_t>{256, 256, ' ', 'h'}));
  EXPECT_EQ(t.decode(t.encode("hehe h")), "hehe h");
}

// fuzz_tokenizer_json: one vocab (or added token) id near INT32_MAX made the loader size its per-id tables to
// 2^31 entries (~140 GB): std::bad_alloc escaped instead of a ds::Error, or the process was OOM-killed.
TEST(FuzzRegressions, TokenizerHugeIdIsRejected) {
  json j = tiny_tokenizer();
  j["model"]["vocab"]["zzz"] = 2147483646;
  expect_error([&] { load(j); }, {"regress.json", "model.vocab", "out of range", "2147483646"});
  j = tiny_tokenizer();
  j["model"]["vocab"]["zzz"] = 4194304;
  expect_error([&] { load(j); }, {"model.vocab", "4194303"});
  j = tiny_tokenizer();
  j["model"]["vocab"]["zzz"] = 18446744073709551615ull;
  expect_error([&] { load(j); }, {"model.vocab", "18446744073709551615"});
  j = tiny_tokenizer();
  j["added_tokens"] = json::array({{{"id", 2147483000}, {"content", "<x>"}}});
  expect_error([&] { load(j); }, {"added_tokens[0].id", "2147483000"});
}

// A deeply nested value in a reported field was dump()ed into the message and overflowed the stack (SIGSEGV).
TEST(FuzzRegressions, TokenizerDeeplyNestedValueDoesNotOverflowTheStack) {
  std::string text = tiny_tokenizer().dump();
  const std::string deep = deep_array(kDeep);
  auto with = [&](const std::string& from, const std::string& to) {
    std::string t = text;
    const size_t at = t.find(from);
    EXPECT_NE(at, std::string::npos) << from;
    return t.replace(at, from.size(), to);
  };
  expect_error([&] { ds::Tokenizer::from_json_string(with(R"("type":"BPE")", R"("type":)" + deep), "r.json"); },
               {"model.type", "an array"});
  expect_error([&] { ds::Tokenizer::from_json_string(with(R"("dropout":null)", R"("dropout":)" + deep), "r.json"); },
               {"model.dropout", "an array"});
  expect_error([&] { ds::Tokenizer::from_json_string(with(R"([["h","e"]])", "[" + deep + "]"), "r.json"); },
               {"model.merges[0]", "an array"});
  expect_error(
      [&] { ds::Tokenizer::from_json_string(with(R"("behavior":"Isolated")", R"("behavior":)" + deep), "r.json"); },
      {"pre_tokenizer.pretokenizers[0].behavior", "an array"});
}

// Seed-corpus construction for fuzz_tokenizer_json: every Split with a {"String": ...} pattern was rejected,
// because PCRE2_LITERAL cannot be combined with PCRE2_UCP ("invalid option bits with PCRE2_LITERAL").
TEST(FuzzRegressions, TokenizerStringSplitPatternLoadsAndSplits) {
  json j = tiny_tokenizer();
  j["pre_tokenizer"]["pretokenizers"].insert(
      j["pre_tokenizer"]["pretokenizers"].begin(),
      json{{"type", "Split"}, {"pattern", {{"String", "e."}}}, {"behavior", "Isolated"}, {"invert", false}});
  const ds::Tokenizer t = load(j);
  // "he.he": the literal "e." (not the regex "any char after e") is isolated first, so the first "he" cannot merge.
  EXPECT_EQ(t.encode("he.hex"), (std::vector<int32_t>{'h', 'e', '.', 256, 'x'}));
  EXPECT_EQ(t.encode("heXhe"), (std::vector<int32_t>{256, 'X', 256}));
  EXPECT_EQ(t.decode(t.encode("he.hex")), "he.hex");
}

// Issue 25 (a breaker's find, not a fuzzer's): two tokens on one id were accepted; encoding gave both that id and
// decoding only one of them.
TEST(FuzzRegressions, TokenizerDuplicateIdsAreRejected) {
  json j = tiny_tokenizer();
  j["model"]["vocab"]["zz"] = 256;  // "he" has 256
  const std::string e = ds::test::error_of([&] { load(j); });
  EXPECT_NE(e.find("regress.json: field \"model.vocab\": tokens "), std::string::npos) << e;
  EXPECT_NE(e.find(" both have id 256 (each id names one token)"), std::string::npos) << e;
  EXPECT_TRUE(e.find("\"he\"") != std::string::npos && e.find("\"zz\"") != std::string::npos) << e;
  // Added tokens: one id for two contents is refused; the same content listed twice is what HF tolerates.
  j = tiny_tokenizer();
  j["added_tokens"] = json::array({{{"id", 257}, {"content", "<a>"}}, {{"id", 257}, {"content", "<b>"}}});
  expect_error([&] { load(j); }, {"field \"added_tokens[1].id\": id 257 is also the id of added_tokens[0] (\"<a>\"), "
                                  "a different token \"<b>\""});
  j["added_tokens"][1]["content"] = "<a>";
  EXPECT_EQ(load(j).vocab_size(), 258);
}

}  // namespace

namespace {

// Issue 25 item 18: printable() (core/error.h) keeps text and valid UTF-8, and shows every other byte as \xNN: what a
// JSON parser's "last read" quotes of a binary file reaches the terminal escaped.
TEST(FuzzRegressions, PrintableEscapesBytesThatAreNotText) {
  EXPECT_EQ(ds::printable("plain text, line\nand tab\t"), "plain text, line\nand tab\t");
  EXPECT_EQ(ds::printable("caf\xC3\xA9 \xF0\x9F\x91\x8D"), "caf\xC3\xA9 \xF0\x9F\x91\x8D");
  EXPECT_EQ(ds::printable(std::string("a\0b", 3)), "a\\x00b");
  EXPECT_EQ(ds::printable("\x01\x7f\xfe\xff"), "\\x01\\x7f\\xfe\\xff");
  EXPECT_EQ(ds::printable("\xC3"), "\\xc3") << "a truncated sequence";
  EXPECT_EQ(ds::printable("\xC0\xAF"), "\\xc0\\xaf") << "an overlong form";
  EXPECT_EQ(ds::printable("\xED\xA0\x80"), "\\xed\\xa0\\x80") << "a surrogate";
  EXPECT_EQ(ds::printable("\xF4\x90\x80\x80"), "\\xf4\\x90\\x80\\x80") << "past U+10FFFF";
  const std::string bad = "{\"hidden_size\": \"\xfe\xff\"}";
  std::string what;
  try {
    const nlohmann::json parsed = nlohmann::json::parse(bad);  // throws: the byte is not UTF-8
    ADD_FAILURE() << "parsed: " << parsed.dump();
  } catch (const nlohmann::json::exception& e) {
    what = e.what();
  }
  ASSERT_NE(what.find('\xfe'), std::string::npos) << "the parser quotes the raw byte: " << what;
  EXPECT_EQ(ds::printable(what).find('\xfe'), std::string::npos);
  EXPECT_NE(ds::printable(what).find("\\xfe"), std::string::npos);
}

}  // namespace
