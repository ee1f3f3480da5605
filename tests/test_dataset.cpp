// Pre-tokenized dataset directories (data/token_dataset.h): `deltastack tokenize --format dataset` writes what
// training's in-memory path reads (batches, fingerprints), errors name the bad file and field, and training on the
// directory is bitwise training on the source file, resume included.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "cli/commands/commands.h"
#include "core/error.h"
#include "core/files.h"
#include "data/dataset.h"
#include "data/token_dataset.h"
#include "data/tokenizer.h"
#include "test_util.h"
#include "train_test_util.h"

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

std::string tok_path() { return ds::test::data_path("qwen3_tokenizer/tokenizer.json"); }
const ds::Tokenizer& tok() {
  static const ds::Tokenizer t = ds::Tokenizer::from_file(tok_path());
  return t;
}

using ds::test::error_of;

// Two files: paragraphs of text, and .jsonl with a chat, a prompt / completion pair and a text.
std::vector<std::string> write_corpus(const std::string& dir) {
  ds::write_file_atomic(dir + "/a.txt", "First paragraph, a few words.\nIts second line.\n\nSecond one.\n\nThird, "
                                        "the last paragraph of the file.\n");
  ds::write_file_atomic(
      dir + "/b.jsonl",
      "{\"messages\": [{\"role\": \"user\", \"content\": \"Hi there\"}, {\"role\": \"assistant\", \"content\": "
      "\"Hello! How can I help?\"}]}\n{\"prompt\": \"2+2=\", \"completion\": \"4\"}\n{\"text\": \"plain text line\"}\n");
  return {dir + "/a.txt", dir + "/b.jsonl"};
}

void expect_same_batches(const ds::PackedDataset& a, const ds::PackedDataset& b) {
  ASSERT_EQ(a.num_windows(), b.num_windows());
  ASSERT_EQ(a.num_tokens(), b.num_tokens());
  EXPECT_EQ(a.max_docs_per_window(), b.max_docs_per_window());
  for (int64_t w = 0; w < a.num_windows(); ++w) {
    std::vector<int64_t> ws = {w, (w + 3) % a.num_windows()};
    const ds::PackedBatch x = a.batch(ws), y = b.batch(ws);
    EXPECT_EQ(x.input_ids, y.input_ids) << w;
    EXPECT_EQ(x.targets, y.targets) << w;
    EXPECT_EQ(x.cu_seqlens, y.cu_seqlens) << w;
    EXPECT_EQ(x.positions, y.positions) << w;
  }
}

}  // namespace

TEST(Dataset, RoundTripBatchesEqualTheInMemoryPath) {
  const std::string dir = ds::test::fresh_tmpdir("dataset_roundtrip");
  const std::vector<std::string> files = write_corpus(dir);
  ASSERT_EQ(ds::cli::cmd_tokenize_dataset(tok_path(), files, dir + "/ds", "paragraph", 7), 0);
  EXPECT_FALSE(fs::exists(dir + "/ds.tmp." + std::to_string(::getpid())));

  const int32_t eos = tok().token_to_id("<|endoftext|>");
  ASSERT_GE(eos, 0);
  const std::vector<ds::TokenizedSample> docs =
      ds::tokenize_documents(tok(), ds::read_documents(files, ds::TxtSplit::Paragraph), eos);
  ASSERT_EQ(docs.size(), 6u);
  int64_t total = 0;
  for (const auto& d : docs) total += static_cast<int64_t>(d.ids.size());

  auto store = std::make_shared<ds::MappedTokenStore>(dir + "/ds");
  const json& ix = store->index();
  EXPECT_EQ(ix["format"], "deltastack-dataset");
  EXPECT_EQ(ix["version"], 1);
  EXPECT_EQ(ix["num_documents"], 6);
  EXPECT_EQ(ix["num_tokens"], total);
  EXPECT_EQ(ix["eos_id"], eos);
  EXPECT_EQ(ix["masked"], true);
  EXPECT_EQ(ix["tokenizer_fingerprint"], ds::tokenizer_fingerprint(ds::read_file(tok_path())));
  ASSERT_EQ(ix["shards"].size(), static_cast<size_t>((total + 6) / 7));
  EXPECT_EQ(ix["shards"][0]["tokens"], "tokens-00000.bin");
  EXPECT_EQ(ix["shards"][0]["labels"], "labels-00000.bin");
  EXPECT_EQ(store->num_tokens(), total);
  EXPECT_EQ(store->num_documents(), 6);
  // The shard bytes are the ids, little-endian int32; documents.bin the offsets; masked.bin the chat / completion.
  const std::string t0 = ds::read_file(dir + "/ds/tokens-00000.bin");
  ASSERT_EQ(t0.size(), 28u);
  std::vector<int32_t> first(7);
  std::memcpy(first.data(), t0.data(), 28);
  EXPECT_EQ(first, std::vector<int32_t>(docs[0].ids.begin(), docs[0].ids.begin() + 7));
  EXPECT_EQ(store->doc_starts()[1], static_cast<int64_t>(docs[0].ids.size()));
  EXPECT_EQ(store->token(store->doc_starts()[1] - 1), eos);
  EXPECT_EQ(ds::read_file(dir + "/ds/masked.bin"), std::string("\0\0\0\1\1\0", 6));

  // The whole stream, a split (the last 2 documents held out) and their fingerprints: as in memory.
  for (int64_t seq : {5, 16, 64}) {
    expect_same_batches(ds::PackedDataset(docs, seq), ds::PackedDataset(store, 0, 6, seq));
    expect_same_batches(ds::PackedDataset(std::vector<ds::TokenizedSample>(docs.begin(), docs.end() - 2), seq),
                        ds::PackedDataset(store, 0, 4, seq));
    expect_same_batches(ds::PackedDataset(std::vector<ds::TokenizedSample>(docs.end() - 2, docs.end()), seq),
                        ds::PackedDataset(store, 4, 6, seq));
  }
  EXPECT_EQ(ds::documents_fingerprint(*store, 0, 6), ds::documents_fingerprint(docs));
  EXPECT_EQ(ds::documents_fingerprint(*store, 4, 6),
            ds::documents_fingerprint(std::vector<ds::TokenizedSample>(docs.end() - 2, docs.end())));
  // Labels survive: the chat's user turn is unlabelled, so some targets are -100 inside a document.
  const ds::PackedBatch all = ds::PackedDataset(store, 0, 6, total).batch({0});
  int64_t ignored = 0;
  for (int32_t t : all.targets) ignored += t == -100;
  EXPECT_GT(ignored, 6);

  // Text only: no label shards, "masked": false.
  ASSERT_EQ(ds::cli::cmd_tokenize_dataset(tok_path(), {files[0]}, dir + "/text", "line", 1 << 20), 0);
  const ds::MappedTokenStore text(dir + "/text");
  EXPECT_EQ(text.index()["masked"], false);
  EXPECT_FALSE(text.has_labels());
  EXPECT_EQ(text.num_documents(), 4);  // --txt-split line: four non-blank lines
  EXPECT_FALSE(fs::exists(dir + "/text/labels-00000.bin"));
  EXPECT_FALSE(fs::exists(dir + "/text/masked.bin"));
  fs::remove_all(dir);
}

// A .txt with CRLF lines, blank lines of spaces / tabs / "\r", runs of blank lines, multi-byte UTF-8 and no final
// newline, and a .jsonl with a long line: every block size from 1 byte (a piece boundary at every byte: inside a
// document, right after a blank line, between "\r" and "\n", inside a UTF-8 sequence, inside a .jsonl line) gives
// read_documents' documents, and the dataset files are byte-identical to those of the default block size.
std::vector<std::string> write_piece_corpus(const std::string& dir) {
  ds::write_file_atomic(dir + "/p.txt",
                        "First paragraph, a few words.\r\nIts second line.\r\n\r\nSecond one \xe2\x80\x94 with "
                        "\xe2\x80\x9cquotes\xe2\x80\x9d.\n \t\n\n\nThird paragraph\nspans three\nlines.\n\r\n"
                        "\xe6\x97\xa5\xe6\x9c\xac\xe8\xaa\x9e line\n\n\nLast, no newline at the end");
  ds::write_file_atomic(dir + "/q.jsonl",
                        "{\"text\": \"short\"}\n{\"prompt\": \"2+2=\", \"completion\": \"4\"}\n{\"text\": \"a longer "
                        "line, long enough to straddle several small blocks of the reader \xc3\xa9\xc3\xa8\"}\r\n"
                        "{\"messages\": [{\"role\": \"user\", \"content\": \"Hi\"}, {\"role\": \"assistant\", "
                        "\"content\": \"Hello!\"}]}\n");
  return {dir + "/p.txt", dir + "/q.jsonl"};
}

std::vector<ds::LabelledText> read_in_pieces(const std::string& file, ds::TxtSplit split, size_t block,
                                             int64_t* pieces) {
  ds::DocumentReader r(file, split, block);
  std::vector<ds::LabelledText> all, part;
  *pieces = 0;
  while (r.next(part)) {
    EXPECT_FALSE(part.empty());
    ++*pieces;
    all.insert(all.end(), part.begin(), part.end());
  }
  EXPECT_EQ(r.bytes_done(), r.file_bytes());
  return all;
}

TEST(Dataset, PiecesOfAnyBlockSizeReadTheWholeFilesDocuments) {
  const std::string dir = ds::test::fresh_tmpdir("dataset_pieces");
  const std::vector<std::string> files = write_piece_corpus(dir);
  const std::vector<ds::LabelledText> para = ds::read_documents({files[0]}, ds::TxtSplit::Paragraph);
  ASSERT_EQ(para.size(), 5u);
  EXPECT_EQ(para[0].text, "First paragraph, a few words.\r\nIts second line.\r\n");
  EXPECT_EQ(para[2].text, "Third paragraph\nspans three\nlines.\n");
  EXPECT_EQ(para[4].text, "Last, no newline at the end");
  for (ds::TxtSplit split : {ds::TxtSplit::Paragraph, ds::TxtSplit::Line, ds::TxtSplit::File}) {
    for (const std::string& f : files) {
      const std::vector<ds::LabelledText> whole = ds::read_documents({f}, split);
      for (size_t block = 1; block <= 48; ++block) {
        int64_t pieces = 0;
        const std::vector<ds::LabelledText> got = read_in_pieces(f, split, block, &pieces);
        ASSERT_EQ(got.size(), whole.size()) << f << " block " << block;
        for (size_t i = 0; i < got.size(); ++i) {
          EXPECT_EQ(got[i].text, whole[i].text) << f << " block " << block << " document " << i;
          EXPECT_EQ(got[i].masked, whole[i].masked);
          ASSERT_EQ(got[i].labels.size(), whole[i].labels.size());
          for (size_t k = 0; k < got[i].labels.size(); ++k) {
            EXPECT_EQ(got[i].labels[k].begin, whole[i].labels[k].begin);
            EXPECT_EQ(got[i].labels[k].end, whole[i].labels[k].end);
          }
          EXPECT_EQ(got[i].split_at_labels, whole[i].split_at_labels);
        }
        // Small blocks cut the file into several pieces (one per document at 1 byte), except a .txt read whole.
        const bool one_doc = split == ds::TxtSplit::File && f.ends_with(".txt");
        if (block <= 8) {
          EXPECT_EQ(pieces, one_doc ? 1 : static_cast<int64_t>(whole.size())) << f << " " << block;
        }
      }
    }
  }
  for (int64_t block : {1, 5, 29, 1000}) {
    const std::string out = dir + "/ds" + std::to_string(block);
    ASSERT_EQ(ds::cli::cmd_tokenize_dataset(tok_path(), files, out, "paragraph", 11, false, block), 0);
    if (block != 1) continue;
    ASSERT_EQ(ds::cli::cmd_tokenize_dataset(tok_path(), files, dir + "/ds0", "paragraph", 11), 0);
  }
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir + "/ds0")) names.push_back(e.path().filename().string());
  EXPECT_GE(names.size(), 6u);  // index.json, documents.bin, masked.bin, tokens / labels shards
  for (int64_t block : {1, 5, 29, 1000})
    for (const std::string& n : names)
      EXPECT_EQ(ds::read_file(dir + "/ds" + std::to_string(block) + "/" + n), ds::read_file(dir + "/ds0/" + n))
          << n << " block " << block;
  const ds::MappedTokenStore store(dir + "/ds0");
  EXPECT_EQ(store.num_documents(), 9);  // 5 paragraphs, 4 samples
  // The text's label shards are written once the first masked sample comes: all ones, shard by shard.
  ASSERT_TRUE(store.masked(6) && !store.masked(4));
  EXPECT_EQ(ds::read_file(dir + "/ds0/labels-00000.bin"), std::string(11, '\1'));
  store.release_pages();
  EXPECT_EQ(store.token(store.doc_starts()[5] - 1), tok().token_to_id("<|endoftext|>"));
  EXPECT_EQ(ds::documents_fingerprint(store, 0, 9),
            ds::documents_fingerprint(ds::tokenize_documents(tok(), ds::read_documents(files, ds::TxtSplit::Paragraph),
                                                             tok().token_to_id("<|endoftext|>"))));
}

TEST(Dataset, ErrorsInALaterPieceNameTheWholeFilesLineAndOffset) {
  const std::string dir = ds::test::fresh_tmpdir("dataset_piece_errors");
  ds::write_file_atomic(dir + "/bad.txt", "one\n\ntwo\n\nthree \xff here\n");
  ds::write_file_atomic(dir + "/bad.jsonl", "{\"text\": \"a\"}\n{\"text\": \"b\"}\n{\"text\": \n");
  ds::write_file_atomic(dir + "/blank.txt", " \n\r\n\t\n");
  for (size_t block : {size_t{2}, size_t{7}, std::numeric_limits<size_t>::max()}) {
    auto err = [&](const std::string& f) {
      return error_of([&] {
        std::vector<ds::LabelledText> part;
        ds::DocumentReader r(dir + "/" + f, ds::TxtSplit::Paragraph, block);
        while (r.next(part)) {}
      });
    };
    EXPECT_NE(err("bad.txt").find("bad.txt:5: invalid UTF-8 at byte offset 16"), std::string::npos) << block;
    EXPECT_NE(err("bad.jsonl").find("bad.jsonl:3: invalid JSON"), std::string::npos) << err("bad.jsonl");
    EXPECT_NE(err("blank.txt").find("blank.txt: no text in this file"), std::string::npos) << err("blank.txt");
  }
}

TEST(Dataset, CorruptOrMissingFilesAndOutputsAreNamed) {
  const std::string dir = ds::test::fresh_tmpdir("dataset_errors");
  const std::vector<std::string> files = write_corpus(dir);
  ASSERT_EQ(ds::cli::cmd_tokenize_dataset(tok_path(), files, dir + "/ds", "paragraph", 7), 0);
  const std::string index = ds::read_file(dir + "/ds/index.json");
  // A trailing slash names the same directory (README's `--output corpus/`): made fresh, then replaced.
  ASSERT_EQ(ds::cli::cmd_tokenize_dataset(tok_path(), files, dir + "/slash/", "paragraph", 7), 0);
  EXPECT_EQ(ds::read_file(dir + "/slash/index.json"), index);
  ASSERT_EQ(ds::cli::cmd_tokenize_dataset(tok_path(), files, dir + "/slash//", "paragraph", 7, true), 0);
  EXPECT_EQ(ds::read_file(dir + "/slash/index.json"), index);
  for (const auto& e : fs::directory_iterator(dir))
    EXPECT_EQ(e.path().filename().string().find(".tmp."), std::string::npos) << e.path();

  // An existing dataset is replaced only with --overwrite; a directory that is no dataset never; nor one that
  // holds an input.
  EXPECT_NE(error_of([&] { ds::cli::cmd_tokenize_dataset(tok_path(), files, dir + "/ds", "paragraph", 7); })
                .find("exists; pass --overwrite"), std::string::npos);
  EXPECT_EQ(ds::cli::cmd_tokenize_dataset(tok_path(), {files[1]}, dir + "/ds", "paragraph", 7, true), 0);
  EXPECT_EQ(ds::MappedTokenStore(dir + "/ds").num_documents(), 3);
  EXPECT_NE(error_of([&] { ds::cli::cmd_tokenize_dataset(tok_path(), files, dir, "paragraph", 7, true); })
                .find("holds the input"), std::string::npos);
  fs::create_directories(dir + "/other");
  ds::write_file_atomic(dir + "/other/keep.txt", "x");
  EXPECT_NE(error_of([&] { ds::cli::cmd_tokenize_dataset(tok_path(), files, dir + "/other", "paragraph", 7, true); })
                .find("not a dataset"), std::string::npos);
  EXPECT_TRUE(fs::exists(dir + "/other/keep.txt"));
  // A bad input file: the error names it, and no dataset (nor temporary directory) is left.
  ds::write_file_atomic(dir + "/bad.jsonl", "{\"text\": 3}\n");
  EXPECT_NE(error_of([&] { ds::cli::cmd_tokenize_dataset(tok_path(), {dir + "/bad.jsonl"}, dir + "/new"); })
                .find("bad.jsonl:1"), std::string::npos);
  EXPECT_FALSE(fs::exists(dir + "/new"));
  EXPECT_FALSE(fs::exists(dir + "/new.tmp." + std::to_string(::getpid())));

  ASSERT_EQ(ds::cli::cmd_tokenize_dataset(tok_path(), files, dir + "/ds", "paragraph", 7, true), 0);
  const std::string work = dir + "/work";
  auto fresh = [&] {
    fs::remove_all(work);
    fs::copy(dir + "/ds", work);
  };
  auto expect = [&](const std::string& what, const std::vector<std::string>& needles) {
    const std::string e = error_of([&] { ds::MappedTokenStore s(work); });
    for (const std::string& n : needles) EXPECT_NE(e.find(n), std::string::npos) << what << ": " << e;
  };
  fresh();
  fs::remove(work + "/index.json");
  expect("missing index", {"index.json"});
  fresh();
  ds::write_file_atomic(work + "/index.json", "{\"format\": ");
  expect("truncated index", {"index.json", "invalid JSON"});
  for (const auto& [key, value] : std::vector<std::pair<std::string, json>>{
           {"version", 2}, {"format", "other"}, {"num_tokens", "many"}, {"shards", json::array()}}) {
    fresh();
    json j = json::parse(index);
    j[key] = value;
    ds::write_file_atomic(work + "/index.json", j.dump());
    expect(key, {"index.json", "\"" + key + "\""});
  }
  fresh();
  json j = json::parse(index);
  j.erase("num_documents");
  ds::write_file_atomic(work + "/index.json", j.dump());
  expect("missing field", {"index.json", "missing field \"num_documents\""});
  fresh();
  fs::resize_file(work + "/tokens-00001.bin", 12);
  expect("truncated shard", {"tokens-00001.bin", "12 bytes", "shards[1].tokens"});
  fresh();
  fs::remove(work + "/labels-00000.bin");
  expect("missing labels", {"labels-00000.bin", "cannot open"});
  fresh();
  fs::remove(work + "/documents.bin");
  expect("missing documents", {"documents.bin"});
  fresh();
  {
    std::string d = ds::read_file(work + "/documents.bin");
    const int64_t big = 1000000;
    std::memcpy(d.data() + 8, &big, 8);
    ds::write_file_atomic(work + "/documents.bin", d);
  }
  expect("offsets", {"documents.bin", "must not decrease"});
  // Ids outside the model's vocabulary: named by shard and position.
  fresh();
  EXPECT_NE(error_of([&] { ds::MappedTokenStore(work).check_ids(1000); }).find("tokens-00000.bin: token 0"),
            std::string::npos);
  fs::remove_all(dir);
}

// Issue 25 item 11: a shard truncated in place under the mapping. A read of a page past its new end is a bus error:
// inside read_guarded (every batch) a DataChangedError naming the shard; in any other read (the scans at start) the
// process writes an error naming the shard and exits 1, never dies of SIGBUS. Item 18: a shard replaced by a
// directory is named as such, not as "4096 bytes".
TEST(Dataset, AShardChangedUnderTheMappingIsNamed) {
  const std::string dir = ds::test::fresh_tmpdir("dataset_sigbus");
  std::string text;
  for (int i = 0; i < 800; ++i) text += "Paragraph " + std::to_string(i) + " of a corpus long enough for pages.\n\n";
  ds::write_file_atomic(dir + "/a.txt", text);
  ASSERT_EQ(ds::cli::cmd_tokenize_dataset(tok_path(), {dir + "/a.txt"}, dir + "/ds", "paragraph", 4096), 0);
  auto store = std::make_shared<ds::MappedTokenStore>(dir + "/ds");
  ASSERT_GT(store->num_tokens(), 8192);
  const ds::PackedDataset set(store, 0, store->num_documents(), 64);
  const ds::PackedBatch before = set.batch({0, 1});
  fs::resize_file(dir + "/ds/tokens-00000.bin", 0);  // in place: the mapping stays, its pages are gone
  try {
    set.batch({0, 1});
    ADD_FAILURE() << "no error";
  } catch (const ds::DataChangedError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find(dir + "/ds/tokens-00000.bin: the file changed while the run read it (truncated or replaced in "
                        "place: a bus error at byte 0 of its 16384 mapped bytes)"), std::string::npos) << what;
  }
  EXPECT_EQ(set.batch({store->num_tokens() / 64 - 1}).size(), 64) << "the other shard reads as before";
  int32_t first = -1;
  EXPECT_THROW(store->read_guarded([&] { first = store->token(5); }), ds::DataChangedError);
  EXPECT_EQ(first, -1);
  EXPECT_EQ(before.input_ids.size(), 128u);
  // Outside read_guarded (a scan at start): a message naming the shard and exit 1, in a child process.
  const std::string log = dir + "/child.log";
  const pid_t pid = ::fork();
  if (pid == 0) {
    FILE* f = std::fopen(log.c_str(), "w");
    if (f) ::dup2(::fileno(f), 2);
    ds::documents_fingerprint(*store, 0, store->num_documents());
    ::_exit(0);
  }
  int st = 0;
  ::waitpid(pid, &st, 0);
  ASSERT_TRUE(WIFEXITED(st)) << "killed by signal " << (WIFSIGNALED(st) ? WTERMSIG(st) : 0);
  EXPECT_EQ(WEXITSTATUS(st), 1);
  const std::string said = ds::read_file(log);
  EXPECT_NE(said.find("error: " + dir + "/ds/tokens-00000.bin: the file changed while deltastack read it"),
            std::string::npos) << said;
  // A shard replaced by a directory.
  store.reset();
  fs::remove(dir + "/ds/tokens-00000.bin");
  fs::create_directories(dir + "/ds/tokens-00000.bin");
  const std::string e = error_of([&] { ds::MappedTokenStore s(dir + "/ds"); });
  EXPECT_NE(e.find(dir + "/ds/tokens-00000.bin: not a regular file (a directory), named by " + dir +
                   "/ds/index.json field \"shards[0].tokens\""), std::string::npos) << e;
  fs::remove_all(dir);
}

// `deltastack tokenize` then `train --data DIR`: the same losses and eval losses, bit for bit, as training on the
// source file, and a resume from a checkpoint of the text run continues on the dataset (same fingerprint) bitwise.
TEST(Dataset, TrainingOnADatasetIsTrainingOnItsSource) {
  const std::string dir = ds::test::fresh_tmpdir("dataset_train");
  const std::string args = ds::test::small_setup(dir);
  std::string out;
  ASSERT_EQ(ds::test::run("tokenize --tokenizer " + tok_path() + " --input " + dir + "/corpus.txt --output " + dir +
                          "/ds --shard-tokens 1000", &out), 0) << out;
  EXPECT_NE(out.find("MB/s"), std::string::npos) << out;
  ASSERT_TRUE(fs::exists(dir + "/ds/tokens-00001.bin"));
  std::string ds_args = args;
  ds_args.replace(ds_args.find(dir + "/corpus.txt"), (dir + "/corpus.txt").size(), dir + "/ds");
  ASSERT_EQ(ds::test::run("train " + args + " --steps 6 --warmup 2 --threads 1 --save-interval 3 --out " + dir + "/a"), 0);
  ASSERT_EQ(ds::test::run("train " + ds_args + " --steps 3 --warmup 2 --threads 1 --out " + dir + "/b", &out), 0) << out;
  EXPECT_NE(out.find("mapped"), std::string::npos) << out;
  const auto la = ds::test::train_losses(dir + "/a/metrics.jsonl"), lb = ds::test::train_losses(dir + "/b/metrics.jsonl");
  ASSERT_EQ(la.size(), 6u);
  ASSERT_EQ(lb.size(), 3u);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(la[i], lb[i]) << "step " << i + 1;
  const auto ma = ds::test::metrics(dir + "/a/metrics.jsonl"), mb = ds::test::metrics(dir + "/b/metrics.jsonl");
  ASSERT_TRUE(ma[0].contains("eval_loss") && mb[0].contains("eval_loss"));
  EXPECT_EQ(ma[0]["eval_loss"].get<double>(), mb[0]["eval_loss"].get<double>());
  // Resume the text run's checkpoint on the dataset: no data-change warning, steps 4..6 as the text run's.
  ASSERT_EQ(ds::test::run("train --resume " + dir + "/a/checkpoint-3 --data " + dir + "/ds --steps 6 --threads 1 "
                          "--data-changed error --out " + dir + "/c", &out), 0) << out;
  const auto lc = ds::test::train_losses(dir + "/c/metrics.jsonl");
  ASSERT_EQ(lc.size(), 3u);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(la[3 + i], lc[i]) << "step " << 4 + i;
  // --val-data as a dataset: the same evaluation as --val-data with its source file.
  std::string va = args, vb = args;
  va.replace(va.find("--val-fraction 0.1"), 18, "--val-data " + dir + "/corpus.txt");
  vb.replace(vb.find("--val-fraction 0.1"), 18, "--val-data " + dir + "/ds");
  ASSERT_EQ(ds::test::run("train " + va + " --steps 1 --threads 1 --out " + dir + "/va", &out), 0) << out;
  ASSERT_EQ(ds::test::run("train " + vb + " --steps 1 --threads 1 --out " + dir + "/vb", &out), 0) << out;
  const auto mva = ds::test::metrics(dir + "/va/metrics.jsonl"), mvb = ds::test::metrics(dir + "/vb/metrics.jsonl");
  ASSERT_TRUE(mva[0].contains("eval_loss") && mvb[0].contains("eval_loss"));
  EXPECT_EQ(mva[0]["eval_loss"].get<double>(), mvb[0]["eval_loss"].get<double>());
  EXPECT_EQ(ds::test::train_losses(dir + "/va/metrics.jsonl"), ds::test::train_losses(dir + "/vb/metrics.jsonl"));
  // A dataset made with another tokenizer is refused, naming the field.
  json ix = json::parse(ds::read_file(dir + "/ds/index.json"));
  ix["tokenizer_fingerprint"] = "0000000000000000";
  ds::write_file_atomic(dir + "/ds/index.json", ix.dump());
  EXPECT_NE(ds::test::run("train " + ds_args + " --steps 1 --out " + dir + "/d", &out), 0);
  EXPECT_NE(out.find("tokenizer_fingerprint"), std::string::npos) << out;
  fs::remove_all(dir);
}
