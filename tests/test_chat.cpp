// Chat / SFT samples (data/chat.h): the bundled Qwen3 chat template against transformers' apply_chat_template
// (fixtures/chat/qwen3_chat_golden.json: text, ids and loss mask exactly, through `deltastack tokenize` too),
// prompt / completion pairs, the errors, tokenizer offsets, packing with masks, and a micro-batch without labels.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "cli/commands/commands.h"
#include "core/error.h"
#include "core/files.h"
#include "data/chat.h"
#include "data/dataset.h"
#include "data/tokenizer.h"
#include "model/model.h"
#include "test_util.h"
#include "train_test_util.h"

namespace {

using nlohmann::json;
namespace fs = std::filesystem;

const ds::Tokenizer& qwen3() {
  static const ds::Tokenizer tok = ds::Tokenizer::from_file(ds::test::data_path("qwen3_tokenizer/tokenizer.json"));
  return tok;
}

const json& golden() {
  static const json g = json::parse(ds::read_file(ds::test::fixture("chat/qwen3_chat_golden.json")));
  return g;
}

// The .jsonl line of a golden case: its messages and the template kwargs beside them.
json line_of(const json& c) {
  json j = c["kwargs"];
  if (j.is_null()) j = json::object();
  j["messages"] = c["messages"];
  return j;
}

std::string tmpdir(const std::string& tag) {
  fs::path p = fs::temp_directory_path() / ("ds_chat_" + tag + "_" + std::to_string(::getpid()));
  fs::remove_all(p);
  fs::create_directories(p);
  return p.string();
}

using ds::test::error_of;

TEST(Chat, GoldenRenderingIdsAndMasksExact) {
  const json& cases = golden()["cases"];
  ASSERT_EQ(cases.size(), 12u);
  int64_t labelled = 0;
  for (const json& c : cases) {
    SCOPED_TRACE(c["name"].get<std::string>());
    const ds::LabelledText s = ds::parse_sample(line_of(c));
    EXPECT_TRUE(s.masked);
    EXPECT_EQ(s.text, c["text"].get<std::string>());
    const ds::TokenizedSample t = ds::tokenize_sample(qwen3(), s);
    EXPECT_EQ(t.ids, c["ids"].get<std::vector<int32_t>>());
    std::vector<int> mask(t.loss_mask.begin(), t.loss_mask.end());
    EXPECT_EQ(mask, c["loss_mask"].get<std::vector<int>>());
    for (int m : mask) labelled += m;
  }
  EXPECT_EQ(labelled, 165);  // the golden's own count: a mask of zeros would not pass
}

// `deltastack tokenize` on the golden conversations writes the golden ids and masks, line for line.
TEST(Chat, TokenizeCommandMatchesGolden) {
  const std::string dir = tmpdir("cli");
  std::string in;
  for (const json& c : golden()["cases"]) in += line_of(c).dump() + "\n";
  in += "{\"text\": \"hello\"}\n";  // a text line keeps its {"ids"} form
  ds::write_file_atomic(dir + "/in.jsonl", in);
  ASSERT_EQ(ds::cli::cmd_tokenize(ds::test::data_path("qwen3_tokenizer/tokenizer.json"), dir + "/in.jsonl",
                                  dir + "/out.jsonl"),
            0);
  std::istringstream out(ds::read_file(dir + "/out.jsonl"));
  std::string line;
  for (const json& c : golden()["cases"]) {
    ASSERT_TRUE(std::getline(out, line));
    const json j = json::parse(line);
    EXPECT_EQ(j, (json{{"ids", c["ids"]}, {"loss_mask", c["loss_mask"]}})) << c["name"];
  }
  ASSERT_TRUE(std::getline(out, line));
  EXPECT_EQ(line, "{\"ids\":[14990]}");
  EXPECT_FALSE(std::getline(out, line));
  fs::remove_all(dir);
}

// Template branches the golden does not reach: a system turn after the first, an explicit empty reasoning on a
// history turn, "<think>" text in a history turn before the last query, a user turn that looks like a tool response.
TEST(Chat, TemplateBranches) {
  using M = ds::ChatMessage;
  ds::LabelledText s = ds::render_qwen3_chat(
      {M{"user", "a", {}}, M{"system", "s2", {}}, M{"assistant", "<think>\nr\n</think>\n\nb", {}}, M{"user", "c", {}},
       M{"assistant", "d", std::string("why")}, M{"assistant", "e", std::string("")}},
      {});
  EXPECT_EQ(s.text,
            "<|im_start|>user\na<|im_end|>\n<|im_start|>system\ns2<|im_end|>\n<|im_start|>assistant\nb<|im_end|>\n"
            "<|im_start|>user\nc<|im_end|>\n<|im_start|>assistant\n<think>\nwhy\n</think>\n\nd<|im_end|>\n"
            "<|im_start|>assistant\n<think>\n\n</think>\n\ne<|im_end|>\n");
  ASSERT_EQ(s.labels.size(), 3u);
  EXPECT_EQ(s.text.substr(s.labels[0].begin, s.labels[0].end - s.labels[0].begin), "b<|im_end|>");
  // A user message wrapped in <tool_response> is not a query: the last query is the first user turn, so the last
  // assistant turn gets its (empty) think block and the one before it, without reasoning, none.
  s = ds::render_qwen3_chat({M{"user", "q", {}}, M{"assistant", "x", {}},
                             M{"user", "<tool_response>r</tool_response>", {}}, M{"assistant", "y", {}}},
                            {});
  EXPECT_EQ(s.text,
            "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\nx<|im_end|>\n<|im_start|>user\n"
            "<tool_response>r</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\ny<|im_end|>\n");
  // enable_thinking true with a generation prompt: the bare header.
  s = ds::parse_sample(json::parse(
      R"({"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": true, "enable_thinking": true})"));
  EXPECT_EQ(s.text, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n");
  EXPECT_TRUE(s.labels.empty());
}

TEST(Chat, PromptCompletion) {
  // Standard form: the text is prompt + completion, labels on the completion's tokens.
  ds::LabelledText s = ds::parse_sample(json::parse(R"({"prompt": "Question: 2+2?\nAnswer:", "completion": " 4."})"));
  ASSERT_TRUE(s.masked);
  EXPECT_EQ(s.text, "Question: 2+2?\nAnswer: 4.");
  ds::TokenizedSample t = ds::tokenize_sample(qwen3(), s);
  const std::vector<int32_t> p = qwen3().encode("Question: 2+2?\nAnswer:"), c = qwen3().encode(" 4.");
  std::vector<int32_t> ids = p;
  ids.insert(ids.end(), c.begin(), c.end());
  ASSERT_EQ(t.ids, ids);
  std::vector<uint8_t> mask(p.size(), 0);
  mask.resize(ids.size(), 1);
  EXPECT_EQ(t.loss_mask, mask);
  // A boundary inside what would be one token: prompt and completion are tokenized apart, so the completion keeps
  // its labels ("Hello" is one token; "Hel" + "lo" are not merged across the boundary).
  const ds::TokenizedSample split =
      ds::tokenize_sample(qwen3(), ds::parse_sample(json::parse(R"({"prompt": "Hel", "completion": "lo"})")));
  ASSERT_EQ(qwen3().encode("Hello").size(), 1u);
  std::vector<int32_t> hel = qwen3().encode("Hel"), lo = qwen3().encode("lo");
  hel.insert(hel.end(), lo.begin(), lo.end());
  EXPECT_EQ(split.ids, hel);
  EXPECT_EQ(std::count(split.loss_mask.begin(), split.loss_mask.end(), 1), static_cast<long>(lo.size()));
  EXPECT_EQ(split.loss_mask.back(), 1);
  // Conversational form: one conversation; only the completion's assistant turns are labelled (not a few-shot
  // answer inside the prompt).
  s = ds::parse_sample(json::parse(
      R"({"prompt": [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"},
                     {"role": "user", "content": "2+2?"}],
          "completion": [{"role": "assistant", "content": "4"}]})"));
  const ds::LabelledText whole = ds::parse_sample(json::parse(
      R"({"messages": [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"},
                       {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]})"));
  EXPECT_EQ(s.text, whole.text);
  ASSERT_EQ(whole.labels.size(), 2u);
  ASSERT_EQ(s.labels.size(), 1u);
  EXPECT_EQ(s.labels[0].begin, whole.labels[1].begin);
  EXPECT_EQ(s.labels[0].end, whole.labels[1].end);
}

// Every unsupported or malformed sample is a ds::Error naming the file, the line and the field.
TEST(Chat, ErrorsNameFileLineAndField) {
  const std::string dir = tmpdir("errors"), tok = ds::test::data_path("qwen3_tokenizer/tokenizer.json");
  const std::string ok = R"({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {R"({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]})", "field \"tools\""},
      {R"({"messages": [{"role": "tool", "content": "x"}]})", "field \"messages[0].role\": \"tool\""},
      {R"({"messages": [{"role": "user", "content": "x"}, {"role": "bot", "content": "y"}]})",
       "field \"messages[1].role\": unknown role \"bot\""},
      {R"({"messages": [{"role": "assistant", "content": "", "tool_calls": [{"name": "f"}]}]})",
       "field \"messages[0].tool_calls\""},
      {R"({"messages": [{"role": "user"}]})", "field \"messages[0].content\" is missing"},
      {R"({"messages": [{"role": "user", "content": [{"type": "text"}]}]})", "field \"messages[0].content\" must be a string"},
      {R"({"messages": [{"role": "user", "content": "x", "reasoning_content": "r"}]})", "messages[0].reasoning_content"},
      {R"({"messages": []})", "no messages"},
      {R"({"messages": {"role": "user"}})", "field \"messages\" must be an array"},
      {R"({"messages": [{"role": "user", "content": "x"}], "enable_thinking": "no"})", "field \"enable_thinking\""},
      {R"({"messages": [{"role": "user", "content": "x"}], "text": "y"})", "not several"},
      {R"({"prompt": "x"})", "field \"completion\" is missing"},
      {R"({"prompt": "x", "completion": [{"role": "assistant", "content": "y"}]})", "both be strings"},
      {R"({"other": 1})", "expected \"text\", \"messages\""},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    SCOPED_TRACE(cases[i].first);
    const std::string in = dir + "/in" + std::to_string(i) + ".jsonl";
    ds::write_file_atomic(in, ok + "\n" + cases[i].first + "\n");
    const std::string e = error_of([&] { ds::cli::cmd_tokenize(tok, in, dir + "/out.jsonl"); });
    EXPECT_NE(e.find(in + ":2: "), std::string::npos) << e;
    EXPECT_NE(e.find(cases[i].second), std::string::npos) << e;
    // Training reads the same lines with the same errors.
    const std::string e2 = error_of([&] { ds::read_documents({in}, ds::TxtSplit::Paragraph); });
    EXPECT_NE(e2.find(in + ":2: "), std::string::npos) << e2;
    EXPECT_NE(e2.find(cases[i].second), std::string::npos) << e2;
  }
  EXPECT_FALSE(fs::exists(dir + "/out.jsonl"));
  fs::remove_all(dir);
}

// encode_with_offsets gives encode's ids and byte ranges that tile the text, also where NFC changes it.
TEST(Chat, TokenizerOffsets) {
  for (const std::string& text : {std::string("Hello, world!\n\n  x"), std::string("梯度🙂 ok"),
                                 std::string("<|im_start|>user\nhi<|im_end|>\n"),
                                 std::string("cafe\xCC\x81\nnext line\ne\xCC\x81")}) {  // decomposed é: NFC changes it
    SCOPED_TRACE(text);
    std::vector<ds::TokenOffset> off;
    const std::vector<int32_t> ids = qwen3().encode_with_offsets(text, off);
    EXPECT_EQ(ids, qwen3().encode(text));
    ASSERT_EQ(off.size(), ids.size());
    size_t pos = 0;
    for (const ds::TokenOffset& o : off) {
      EXPECT_GE(o.begin, pos);
      EXPECT_GT(o.end, o.begin);
      EXPECT_LE(o.end, text.size());
      pos = o.begin;
    }
    EXPECT_EQ(off.back().end, text.size());
  }
  // The decomposed line: the token starting "next" begins exactly at its line, after NFC shortened the first line.
  const std::string text = "cafe\xCC\x81\nnext";
  std::vector<ds::TokenOffset> off;
  const std::vector<int32_t> ids = qwen3().encode_with_offsets(text, off);
  const size_t k = ids.size() - 1;
  EXPECT_EQ(qwen3().decode({ids[k]}), "next");
  EXPECT_EQ(off[k].begin, 7u);
  EXPECT_EQ(off[k].end, 11u);
}

// Packing keeps the masks: a target is -100 where the token it predicts is not labelled; text documents are
// unmasked, and their fingerprint is the ids-only one (a resume of an earlier text run still matches).
TEST(Chat, PackingKeepsMasks) {
  std::vector<ds::TokenizedSample> docs = {{{1, 2, 3, 4}, {0, 0, 1, 1}}, {{5, 6}, {}}, {{7, 8, 9}, {1, 0, 0}}};
  ds::PackedDataset set(docs, 9);
  const ds::PackedBatch b = set.batch({0});
  EXPECT_EQ(b.input_ids, (std::vector<int32_t>{1, 2, 3, 4, 5, 6, 7, 8, 9}));
  EXPECT_EQ(b.targets, (std::vector<int32_t>{-100, 3, 4, -100, 6, -100, -100, -100, -100}));
  EXPECT_EQ(b.cu_seqlens, (std::vector<int32_t>{0, 4, 6, 9}));
  EXPECT_EQ(ds::documents_fingerprint(std::vector<ds::TokenizedSample>{{{5, 6}, {}}}),
            ds::documents_fingerprint(std::vector<std::vector<int32_t>>{{5, 6}}));
  EXPECT_NE(ds::documents_fingerprint(std::vector<ds::TokenizedSample>{{{5, 6}, {1, 1}}}),
            ds::documents_fingerprint(std::vector<std::vector<int32_t>>{{5, 6}}));
  // tokenize_documents: the eos of a chat follows its trailing "\n" (unlabelled), a completion's is labelled.
  const std::vector<ds::TokenizedSample> t = ds::tokenize_documents(
      qwen3(),
      {ds::parse_sample(json::parse(R"({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]})")),
       ds::parse_sample(json::parse(R"({"prompt": "a", "completion": " b"})"))},
      151643);
  EXPECT_EQ(t[0].ids.back(), 151643);
  EXPECT_EQ(t[0].loss_mask.back(), 0);
  EXPECT_EQ(t[0].loss_mask[t[0].loss_mask.size() - 3], 1);  // <|im_end|>
  EXPECT_EQ(t[1].ids.back(), 151643);
  EXPECT_EQ(t[1].loss_mask, (std::vector<uint8_t>{0, 1, 1}));
}

// A micro-batch whose targets are all ignored adds exactly 0 to the loss and the gradients (no NaN), so a step
// mixing it with a labelled one equals the labelled one alone.
TEST(Chat, MicroBatchWithoutLabelsAddsZero) {
  ds::ModelConfig c = ds::ModelConfig::preset("tiny");
  c.vocab_size = 512;
  ds::Qwen35Model m(c);
  m.init_weights(3);
  ds::PackedBatch none;
  none.input_ids = {5, 6, 7, 8, 9, 10};
  none.targets.assign(6, -100);
  none.cu_seqlens = {0, 4, 6};
  none.finalize();
  ds::PackedBatch some = none;
  some.targets = {6, 7, -100, -100, 10, -100};
  m.zero_grads();
  const ds::LossResult r0 = m.forward_backward(none, 1.0);
  EXPECT_EQ(r0.loss_sum, 0.0);
  EXPECT_EQ(r0.num_valid, 0);
  for (float g : m.grads()) ASSERT_EQ(g, 0.0f);
  const ds::LossResult r1 = m.forward_backward(some, 1.0 / 3);
  EXPECT_EQ(r1.num_valid, 3);
  EXPECT_TRUE(std::isfinite(r1.loss_sum) && r1.loss_sum > 0);
  const std::vector<float> both = m.grads();
  m.zero_grads();
  m.forward_backward(some, 1.0 / 3);
  EXPECT_EQ(m.grads(), both);
  double norm = 0;
  for (float g : both) norm += static_cast<double>(g) * g;
  EXPECT_GT(norm, 0.0);
}

// `train` on chat data: windows that hold only user text (no label) and labelled ones mix in micro-batches; every
// step's loss is finite, and a step whose windows hold no label reports 0.
TEST(Chat, TrainsOnChatData) {
  const std::string dir = ds::test::fresh_tmpdir("chat_train");
  const std::string args = ds::test::small_setup_on(dir, dir + "/chat.jsonl");
  std::string lines;
  for (int i = 0; i < 24; ++i) {
    json m = json::array({{{"role", "user"}, {"content", std::string(i % 3 == 0 ? 400 : 20, 'a' + i % 26)}},
                          {{"role", "assistant"}, {"content", "answer " + std::to_string(i)}}});
    lines += json{{"messages", m}}.dump() + "\n";
  }
  ds::write_file_atomic(dir + "/chat.jsonl", lines);
  std::string log;
  ASSERT_EQ(ds::test::run("train " + args + " --threads 1 --steps 6 --grad-accum 2 --out " + dir + "/run", &log), 0)
      << log;
  int evals = 0;
  const std::vector<json> ms = ds::test::metrics(dir + "/run/metrics.jsonl");
  for (const json& j : ms) {
    if (j.contains("eval_loss")) {
      ASSERT_TRUE(j["eval_loss"].is_number()) << j;
      EXPECT_TRUE(std::isfinite(j["eval_loss"].get<double>())) << j;
      ++evals;
    }
  }
  const std::vector<double> losses = ds::test::train_losses(dir + "/run/metrics.jsonl");
  ASSERT_EQ(losses.size(), 6u);
  for (double l : losses) EXPECT_TRUE(std::isfinite(l) && l >= 0) << l;
  EXPECT_GT(*std::max_element(losses.begin(), losses.end()), 1.0);
  EXPECT_GE(evals, 1);
  fs::remove_all(dir);
}

// Chat data that labels nothing (user turns only, empty completions) is an error before training, not steps that
// report loss 0 while the weights still move and an eval_loss of NaN.
TEST(Chat, TrainingDataWithoutALabelIsAnError) {
  const std::string dir = ds::test::fresh_tmpdir("chat_nolabel");
  const std::string args = ds::test::small_setup_on(dir, dir + "/chat.jsonl");
  std::string lines;
  for (int i = 0; i < 24; ++i) {
    lines += json{{"messages", json::array({{{"role", "user"}, {"content", "question " + std::to_string(i)}}})}}.dump() +
             "\n";
    lines += json{{"prompt", "prompt " + std::to_string(i)}, {"completion", ""}}.dump() + "\n";
  }
  ds::write_file_atomic(dir + "/chat.jsonl", lines);
  std::string log;
  EXPECT_EQ(ds::test::run("train " + args + " --threads 1 --steps 2 --out " + dir + "/run", &log), 1) << log;
  EXPECT_NE(log.find("has a labelled token"), std::string::npos) << log;
  EXPECT_FALSE(fs::exists(dir + "/run/checkpoint-2"));
  fs::remove_all(dir);
}

// Issue 25 item 9: the bundled tokenizer.json without some of its added tokens, written to `path`.
std::string tokenizer_without(const std::string& path, const std::vector<std::string>& drop) {
  json j = json::parse(ds::read_file(ds::test::data_path("qwen3_tokenizer/tokenizer.json")));
  json kept = json::array();
  for (const json& t : j["added_tokens"])
    if (std::find(drop.begin(), drop.end(), t["content"].get<std::string>()) == drop.end()) kept.push_back(t);
  j["added_tokens"] = kept;
  ds::write_file_atomic(path, j.dump());
  return path;
}

// A tokenizer without <|im_start|> / <|im_end|> would encode the chat template's markers as plain text and cut the
// labels through merged tokens; without <|endoftext|> the documents would be packed with no separator. Both are
// errors naming the tokenizer file, the token and what needs it, before anything is trained or written; plain text
// needs no chat markers.
TEST(Chat, TokenizerWithoutTheSpecialTokensIsRefused) {
  const std::string dir = ds::test::fresh_tmpdir("chat_notokens");
  const ds::Tokenizer nochat = ds::Tokenizer::from_file(tokenizer_without(dir + "/nochat.json", {"<|im_end|>"}));
  const ds::LabelledText chat = ds::parse_sample(json::parse(
      R"({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})"));
  std::string err = ds::test::error_of([&] { ds::tokenize_sample(nochat, chat); });
  EXPECT_NE(err.find(dir + "/nochat.json: the tokenizer has no <|im_end|> token in \"added_tokens\", which the chat "
                     "template (conversation samples, generate --chat) needs"), std::string::npos) << err;
  EXPECT_EQ(ds::tokenize_sample(nochat, ds::parse_sample(json::parse(R"({"text": "hi"})"))).ids, qwen3().encode("hi"));
  std::vector<int32_t> ab = qwen3().encode("Hi"), b = qwen3().encode(" you");
  ab.insert(ab.end(), b.begin(), b.end());
  EXPECT_EQ(ds::tokenize_sample(nochat, ds::parse_sample(json::parse(R"({"prompt": "Hi", "completion": " you"})"))).ids,
            ab) << "a prompt / completion pair of strings needs no chat markers";
  EXPECT_EQ(ds::document_separator(nochat), 151643);

  // Through the commands: train, tokenize (jsonl and dataset), eval, generate --chat.
  tokenizer_without(dir + "/noeos.json", {"<|endoftext|>"});
  const ds::Tokenizer noeos = ds::Tokenizer::from_file(dir + "/noeos.json");
  err = ds::test::error_of([&] { ds::document_separator(noeos); });
  EXPECT_NE(err.find(dir + "/noeos.json: the tokenizer has no <|endoftext|> token, which packing documents (the "
                     "separator after each one) needs"), std::string::npos) << err;
  const std::string args = ds::test::small_setup(dir);
  ds::write_file_atomic(dir + "/chat.jsonl", json{{"messages", json::array({{{"role", "user"}, {"content", "hi"}},
                        {{"role", "assistant"}, {"content", "yo"}}})}}.dump() + "\n");
  std::string log;
  EXPECT_EQ(ds::test::run("train " + args + " --threads 1 --steps 1 --tokenizer " + dir + "/noeos.json --out " + dir +
                          "/run", &log), 1) << log;
  EXPECT_NE(log.find("noeos.json: the tokenizer has no <|endoftext|> token"), std::string::npos) << log;
  EXPECT_FALSE(fs::exists(dir + "/run/checkpoint-1"));
  EXPECT_EQ(ds::test::run("tokenize --format dataset --tokenizer " + dir + "/noeos.json --input " + dir +
                          "/corpus.txt --output " + dir + "/set", &log), 1) << log;
  EXPECT_NE(log.find("noeos.json: the tokenizer has no <|endoftext|> token"), std::string::npos) << log;
  EXPECT_FALSE(fs::exists(dir + "/set"));
  EXPECT_EQ(ds::test::run("tokenize --tokenizer " + dir + "/nochat.json --input " + dir + "/chat.jsonl --output " +
                          dir + "/chat.ids.jsonl", &log), 1) << log;
  EXPECT_NE(log.find("nochat.json: the tokenizer has no <|im_end|> token"), std::string::npos) << log;
  EXPECT_FALSE(fs::exists(dir + "/chat.ids.jsonl"));
  ASSERT_EQ(ds::test::run("train " + args + " --threads 1 --steps 0 --out " + dir + "/a", &log), 0) << log;
  EXPECT_EQ(ds::test::run("eval --threads 1 --device cpu --seq-len 32 --model " + dir + "/a/checkpoint-0 --tokenizer " +
                          dir + "/noeos.json --data " + dir + "/corpus.txt", &log), 1) << log;
  EXPECT_NE(log.find("noeos.json: the tokenizer has no <|endoftext|> token"), std::string::npos) << log;
  EXPECT_EQ(ds::test::run("generate --threads 1 --device cpu --chat --max-new-tokens 2 --prompt hi --model " + dir +
                          "/a/checkpoint-0 --tokenizer " + dir + "/nochat.json", &log), 1) << log;
  EXPECT_NE(log.find("nochat.json: the tokenizer has no <|im_end|> token"), std::string::npos) << log;
  fs::remove_all(dir);
}

}  // namespace
