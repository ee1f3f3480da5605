// Tokenizer (Qwen3 byte-level BPE) against goldens produced by HF tokenizers, plus error cases and the
// `tokenize` command end to end.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cli/commands/commands.h"
#include "core/error.h"
#include "core/files.h"
#include "data/tokenizer.h"
#include "test_util.h"

namespace {

using ds::Tokenizer;
using nlohmann::json;
namespace fs = std::filesystem;

const Tokenizer& qwen3() {
  static const Tokenizer tok = Tokenizer::from_file(ds::test::data_path("qwen3_tokenizer/tokenizer.json"));
  return tok;
}

std::string tok_path() { return ds::test::data_path("qwen3_tokenizer/tokenizer.json"); }

// A fresh temp directory per test, removed at the end.
struct TempDir {
  fs::path dir;
  TempDir() {
    dir = fs::temp_directory_path() /
          ("ds_tok_" + std::to_string(::getpid()) + "_" +
           ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir);
    fs::create_directories(dir);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(dir, ec);
  }
  std::string file(const std::string& name, const std::string& content) const {
    std::string p = (dir / name).string();
    ds::write_file_atomic(p, content);
    return p;
  }
  std::string path(const std::string& name) const { return (dir / name).string(); }
};

// Expects fn() to throw ds::Error whose message contains every string in `needles`.
template <class F>
void expect_error(F&& fn, const std::vector<std::string>& needles) {
  try {
    fn();
    ADD_FAILURE() << "expected ds::Error";
  } catch (const ds::Error& e) {
    std::string msg = e.what();
    for (const auto& n : needles) EXPECT_NE(msg.find(n), std::string::npos) << "message: " << msg << "\nmissing: " << n;
  }
}

TEST(Tokenizer, Qwen3GoldenCases) {
  const Tokenizer& tok = qwen3();
  json cases = json::parse(ds::read_file(ds::test::fixture("tokenizer/qwen3_cases_golden.json")));
  ASSERT_TRUE(cases.is_array());
  ASSERT_GT(cases.size(), 50u);
  int passed = 0;
  for (const auto& c : cases) {
    std::string text = c["text"].get<std::string>();
    std::vector<int32_t> want = c["ids"].get<std::vector<int32_t>>();
    std::vector<int32_t> got = tok.encode(text);
    EXPECT_EQ(got, want) << "text: " << json(text).dump();
    std::string dec = tok.decode(want);
    EXPECT_EQ(dec, c["decoded"].get<std::string>()) << "text: " << json(text).dump();
    if (got == want && dec == c["decoded"].get<std::string>()) ++passed;
  }
  EXPECT_EQ(passed, static_cast<int>(cases.size()));
}

TEST(Tokenizer, Qwen3TinyShakespeareGolden) {
  const Tokenizer& tok = qwen3();
  json golden = json::parse(ds::read_file(ds::test::fixture("tokenizer/qwen3_tiny_shakespeare_golden.json")));
  ASSERT_TRUE(golden.is_array());
  ASSERT_EQ(golden.size(), 1u);
  std::string text = ds::read_file(ds::test::data_path("tiny_shakespeare.txt"));
  ASSERT_EQ(golden[0]["text"].get<std::string>(), text);
  std::vector<int32_t> want = golden[0]["ids"].get<std::vector<int32_t>>();
  ASSERT_EQ(want.size(), 301829u);

  auto t0 = std::chrono::steady_clock::now();
  std::vector<int32_t> got = tok.encode(text);
  double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("[tokenizer] encoded %zu bytes -> %zu ids in %.3f s (%.2f MB/s)\n", text.size(), got.size(), sec,
              text.size() / sec / 1e6);

  ASSERT_EQ(got.size(), want.size());
  size_t first_diff = got.size();
  for (size_t i = 0; i < got.size(); ++i)
    if (got[i] != want[i]) {
      first_diff = i;
      break;
    }
  EXPECT_EQ(first_diff, got.size()) << "first mismatching id at index " << first_diff;
  EXPECT_EQ(tok.decode(want), text);
  EXPECT_EQ(golden[0]["decoded"].get<std::string>(), text);
}

TEST(Tokenizer, VocabAndTokenLookup) {
  const Tokenizer& tok = qwen3();
  EXPECT_EQ(tok.vocab_size(), 151669);
  EXPECT_EQ(tok.token_to_id("<|endoftext|>"), 151643);
  EXPECT_EQ(tok.token_to_id("<|im_start|>"), 151644);
  EXPECT_EQ(tok.token_to_id("\xC4\xA0"), 220);  // "Ġ" = byte-level space
  EXPECT_EQ(tok.token_to_id("no-such-token-xyz"), -1);
  EXPECT_EQ(tok.id_to_token(151645), "<|im_end|>");
  EXPECT_EQ(tok.id_to_token(220), "\xC4\xA0");
  EXPECT_EQ(tok.id_to_token(-1), "");
  EXPECT_EQ(tok.id_to_token(10000000), "");
}

TEST(Tokenizer, DecodeLossyAndUnknownIds) {
  const Tokenizer& tok = qwen3();
  // "👍" is split across byte tokens; a prefix of it decodes to one U+FFFD as from_utf8_lossy does.
  std::vector<int32_t> ids = tok.encode("\xF0\x9F\x91\x8D");
  ASSERT_GE(ids.size(), 1u);
  EXPECT_EQ(tok.decode(ids), "\xF0\x9F\x91\x8D");
  int32_t f0 = tok.token_to_id("\xC3\xB0");  // byte 0xF0 -> 'ð'
  ASSERT_GE(f0, 0);
  EXPECT_EQ(tok.decode({f0}), "\xEF\xBF\xBD");
  EXPECT_EQ(tok.decode({f0, 32}), "\xEF\xBF\xBD" "A");
  // Ids without a token (e.g. the model's padded vocab rows) are skipped, as HF does.
  EXPECT_EQ(tok.decode({32, 151700, 32}), "AA");
}

TEST(Tokenizer, AddedTokensLongestMatchAndNfc) {
  const Tokenizer& tok = qwen3();
  std::vector<int32_t> a = tok.encode("<|im_start|><|im_end|>");
  EXPECT_EQ(a, (std::vector<int32_t>{151644, 151645}));
  // An unfinished special token is ordinary text.
  std::vector<int32_t> b = tok.encode("<|im_start");
  EXPECT_EQ(std::find(b.begin(), b.end(), 151644), b.end());
  // NFC: decomposed and precomposed e-acute encode identically.
  EXPECT_EQ(tok.encode("e\xCC\x81"), tok.encode("\xC3\xA9"));
}

TEST(Tokenizer, ThreadSafeEncode) {
  const Tokenizer& tok = qwen3();
  std::string text = ds::read_file(ds::test::data_path("tiny_shakespeare.txt")).substr(0, 200000);
  std::vector<int32_t> want = tok.encode(text);
  std::vector<int> ok(8, 0);
#pragma omp parallel for num_threads(4)
  for (int i = 0; i < 8; ++i) ok[i] = tok.encode(text) == want;
  for (int i = 0; i < 8; ++i) EXPECT_TRUE(ok[i]) << i;
}

TEST(Tokenizer, ErrorMissingFile) {
  expect_error([] { Tokenizer::from_file("/nonexistent/dir/tokenizer.json"); }, {"/nonexistent/dir/tokenizer.json"});
}

TEST(Tokenizer, ErrorCorruptJson) {
  TempDir td;
  std::string p = td.file("tokenizer.json", "{\"model\": {\"type\": \"BPE\", \"vocab\": {");
  expect_error([&] { Tokenizer::from_file(p); }, {p, "invalid JSON"});
}

TEST(Tokenizer, ErrorUnsupportedModelType) {
  TempDir td;
  json j = json::parse(ds::read_file(tok_path()));
  j["model"] = {{"type", "WordPiece"}, {"vocab", {{"a", 0}}}, {"unk_token", "[UNK]"}};
  std::string p = td.file("tokenizer.json", j.dump());
  expect_error([&] { Tokenizer::from_file(p); }, {p, "model.type", "WordPiece"});
}

TEST(Tokenizer, ErrorUnsupportedSettings) {
  TempDir td;
  json base = json::parse(ds::read_file(tok_path()));
  {
    json j = base;
    j["model"]["dropout"] = 0.1;
    std::string p = td.file("dropout.json", j.dump());
    expect_error([&] { Tokenizer::from_file(p); }, {p, "model.dropout"});
  }
  {
    json j = base;
    j["normalizer"] = {{"type", "Lowercase"}};
    std::string p = td.file("norm.json", j.dump());
    expect_error([&] { Tokenizer::from_file(p); }, {p, "normalizer.type", "Lowercase"});
  }
  {
    json j = base;
    j["pre_tokenizer"]["pretokenizers"][0]["behavior"] = "Removed";
    std::string p = td.file("behavior.json", j.dump());
    expect_error([&] { Tokenizer::from_file(p); }, {p, "pre_tokenizer.pretokenizers[0].behavior"});
  }
  {
    json j = base;
    j["decoder"] = {{"type", "WordPiece"}};
    std::string p = td.file("decoder.json", j.dump());
    expect_error([&] { Tokenizer::from_file(p); }, {p, "decoder.type"});
  }
  {
    json j = base;
    j["model"]["merges"][5] = json::array({"notatoken", "x"});
    std::string p = td.file("merges.json", j.dump());
    expect_error([&] { Tokenizer::from_file(p); }, {p, "model.merges[5]", "notatoken"});
  }
}

TEST(Tokenizer, MergesAsStringsEqualPairs) {
  // The same tokenizer with merges in the legacy "a b" string form encodes identically.
  TempDir td;
  json j = json::parse(ds::read_file(tok_path()));
  json merges = json::array();
  for (const auto& m : j["model"]["merges"]) merges.push_back(m[0].get<std::string>() + " " + m[1].get<std::string>());
  j["model"]["merges"] = merges;
  std::string p = td.file("tokenizer.json", j.dump());
  Tokenizer t2 = Tokenizer::from_file(p);
  std::string text = "Hello world, ROMEO: don't 12345 \xE4\xBD\xA0\xE5\xA5\xBD <|im_end|>";
  EXPECT_EQ(t2.encode(text), qwen3().encode(text));
}

TEST(Tokenizer, ErrorInvalidUtf8) {
  const Tokenizer& tok = qwen3();
  expect_error([&] { tok.encode(std::string("abc\xFF" "def")); }, {"invalid UTF-8", "byte offset 3"});
  expect_error([&] { tok.encode(std::string("ab\xC3")); }, {"byte offset 2"});                 // truncated
  expect_error([&] { tok.encode(std::string("\xC0\xAF")); }, {"byte offset 0"});               // overlong
  expect_error([&] { tok.encode(std::string("x\xED\xA0\x80")); }, {"byte offset 1"});          // surrogate
  expect_error([&] { tok.encode(std::string("12345678\x80")); }, {"byte offset 8"});           // stray continuation
}

TEST(Tokenizer, CommandEndToEnd) {
  TempDir td;
  std::vector<std::string> texts = {"Hello world", "<|im_start|>user\nhi<|im_end|>", "",
                                    "caf\xC3\xA9 \xF0\x9F\x91\x8D"};
  std::string in;
  for (const auto& t : texts) in += json{{"text", t}, {"meta", 1}}.dump() + "\n";
  std::string ip = td.file("in.jsonl", in);
  std::string op = td.path("out.jsonl");
  EXPECT_EQ(ds::cli::cmd_tokenize(tok_path(), ip, op), 0);
  std::string out = ds::read_file(op);
  std::vector<std::string> lines;
  size_t pos = 0;
  while (pos < out.size()) {
    size_t nl = out.find('\n', pos);
    ASSERT_NE(nl, std::string::npos);
    lines.push_back(out.substr(pos, nl - pos));
    pos = nl + 1;
  }
  ASSERT_EQ(lines.size(), texts.size());
  for (size_t i = 0; i < texts.size(); ++i) {
    json j = json::parse(lines[i]);
    EXPECT_EQ(j["ids"].get<std::vector<int32_t>>(), qwen3().encode(texts[i])) << i;
  }
  EXPECT_EQ(json::parse(lines[0])["ids"].get<std::vector<int32_t>>(), (std::vector<int32_t>{9707, 1879}));
}

TEST(Tokenizer, CommandErrors) {
  TempDir td;
  std::string op = td.path("out.jsonl");
  {
    std::string ip = td.file("missing.jsonl", "{\"text\": \"ok\"}\n{\"txt\": \"oops\"}\n");
    expect_error([&] { ds::cli::cmd_tokenize(tok_path(), ip, op); }, {ip + ":2", "\"text\""});
  }
  {
    std::string ip = td.file("nonstring.jsonl", "{\"text\": 5}\n");
    expect_error([&] { ds::cli::cmd_tokenize(tok_path(), ip, op); }, {ip + ":1", "\"text\""});
  }
  {
    std::string ip = td.file("empty.jsonl", "{\"text\": \"a\"}\n\n{\"text\": \"b\"}\n");
    expect_error([&] { ds::cli::cmd_tokenize(tok_path(), ip, op); }, {ip + ":2", "empty line"});
  }
  {
    std::string ip = td.file("bad.jsonl", "{\"text\": \"a\"\n");
    expect_error([&] { ds::cli::cmd_tokenize(tok_path(), ip, op); }, {ip + ":1", "invalid JSON"});
  }
  EXPECT_FALSE(ds::file_exists(op));  // nothing written on failure
  expect_error([&] { ds::cli::cmd_tokenize(tok_path(), td.path("nope.jsonl"), op); }, {"nope.jsonl"});
}

}  // namespace
