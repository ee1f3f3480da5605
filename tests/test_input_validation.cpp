// Hostile and hand-edited inputs from issue 25 (items 1, 8, 13, 14, 15): each was a crash or a silently wrong result
// before its fix; each must now be a ds::Error naming the file, field, tensor or flag and the bad value.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "cli/commands/commands.h"
#include "core/cu_seqlens.h"
#include "core/cuda/device.h"
#include "core/error.h"
#include "core/files.h"
#include "data/token_dataset.h"
#include "model/engine.h"
#include "model/forward_inputs.h"
#include "model/model.h"
#include "model/safetensors.h"
#include "train/checkpoint.h"
#include "train_test_util.h"

namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using ds::test::error_of;
using ds::test::fixture;

// The message contains every needle (and the call threw a ds::Error at all).
void expect_error(const std::function<void()>& f, const std::vector<std::string>& needles) {
  const std::string e = error_of(f);
  for (const std::string& n : needles) EXPECT_NE(e.find(n), std::string::npos) << "missing \"" << n << "\" in: " << e;
}

// ------------------------------------------------------------------------------------------------- cu_seqlens (1)

TEST(InputValidation, CuSeqlensCheckNamesTheFirstBadEntry) {
  auto check = [](std::vector<int64_t> cu, int64_t T) {
    return error_of([&] { ds::check_cu_seqlens(cu.data(), cu.size(), T, "in.st"); });
  };
  EXPECT_EQ(check({0, 3, 3, 8}, 8), "(no error)");  // an empty sequence is allowed
  EXPECT_EQ(check({0, 100000, 8}, 8), "in.st: cu_seqlens[1] = 100000 is outside [0, 8] (the token count)");
  EXPECT_EQ(check({0, -5, 8}, 8), "in.st: cu_seqlens[1] = -5 is outside [0, 8] (the token count)");
  EXPECT_EQ(check({0, 6, 2, 8}, 8), "in.st: cu_seqlens[2] = 2 is below cu_seqlens[1] = 6 (the entries must not decrease)");
  EXPECT_EQ(check({1, 8}, 8), "in.st: cu_seqlens[0] = 1, must be 0");
  EXPECT_EQ(check({0, 4}, 8), "in.st: cu_seqlens[1] = 4, the last entry, must be the token count 8");
  EXPECT_EQ(check({0}, 8), "in.st: cu_seqlens needs at least two entries (0 and the token count 8), got 1");
  const int32_t c32[] = {0, 9, 8};
  EXPECT_EQ(error_of([&] { ds::check_cu_seqlens(c32, 3, 8, "b"); }), "b: cu_seqlens[1] = 9 is outside [0, 8] (the token count)");
}

// Before: finalize wrote positions up to cu[s + 1] before checking the next entry (heap corruption, abort).
TEST(InputValidation, PackedBatchRefusesAnInteriorEntryPastTheTokens) {
  ds::PackedBatch b;
  b.input_ids.assign(8, 1);
  b.targets.assign(8, -100);
  b.cu_seqlens = {0, 100000, 8};
  EXPECT_EQ(error_of([&] { b.finalize("data batch"); }),
            "data batch: cu_seqlens[1] = 100000 is outside [0, 8] (the token count)");
  // check() (both engines call it) refuses a batch whose cu_seqlens changed after finalize().
  b.cu_seqlens = {0, 8};
  b.finalize("b");
  b.cu_seqlens = {0, 9, 8};
  ds::ModelConfig c = ds::ModelConfig::from_file(fixture("hf_qwen35_tiny_a"));
  EXPECT_EQ(error_of([&] { b.check(ds::batch_limits(c)); }), "batch: cu_seqlens[1] = 9 is outside [0, 8] (the token count)");
}

struct InputTensor {
  std::string name;
  std::vector<int64_t> shape, values;
};
// `forward --inputs` from tensors (I64), parsed in memory.
ds::ForwardInputs read_inputs(const std::vector<InputTensor>& ts, int64_t vocab = 256) {
  std::vector<ds::SaveTensor> st;
  for (const InputTensor& t : ts) st.push_back(ds::make_tensor_i64(t.name, t.shape, t.values.data()));
  return ds::read_forward_inputs(ds::SafetensorsReader::from_bytes(ds::serialize_safetensors(st), "in.st"), vocab);
}
const std::vector<int64_t> kIds8 = {5, 6, 7, 8, 9, 10, 11, 12};

// Before: with labels, [0, 100000, 8] read labels out of bounds and reported heap garbage as a "label"; [0, -5, 8]
// blamed a label. Now the cu_seqlens entry is named before any entry is used.
TEST(InputValidation, ForwardInputsCheckCuSeqlensBeforeTheLabels) {
  for (const auto& [cu, want] : std::vector<std::pair<std::vector<int64_t>, std::string>>{
           {{0, 100000, 8}, "in.st: cu_seqlens[1] = 100000 is outside [0, 8]"},
           {{0, -5, 8}, "in.st: cu_seqlens[1] = -5 is outside [0, 8]"},
           {{0, 5, 3, 8}, "in.st: cu_seqlens[2] = 3 is below cu_seqlens[1] = 5"}}) {
    const std::string e = error_of([&] {
      read_inputs({{"input_ids", {1, 8}, kIds8}, {"labels", {1, 8}, kIds8}, {"cu_seqlens", {int64_t(cu.size())}, cu}});
    });
    EXPECT_EQ(e.rfind(want, 0), 0u) << e;
  }
  // A good one: two sequences, labels shifted inside each.
  const ds::ForwardInputs fi =
      read_inputs({{"input_ids", {1, 8}, kIds8}, {"labels", {1, 8}, kIds8}, {"cu_seqlens", {3}, {0, 3, 8}}});
  EXPECT_EQ(fi.batch.cu_seqlens, (std::vector<int32_t>{0, 3, 8}));
  EXPECT_EQ(fi.batch.targets, (std::vector<int32_t>{6, 7, -100, 9, 10, 11, 12, -100}));
  EXPECT_EQ(fi.batch.positions, (std::vector<int32_t>{0, 1, 2, 0, 1, 2, 3, 4}));
  EXPECT_TRUE(fi.has_labels);
}

// position_ids and attention_mask were ignored silently; any other tensor still is nowhere.
TEST(InputValidation, ForwardInputsReadPositionIdsAndRefuseWhatTheyCannotUse) {
  // Packed position_ids (transformers' convention): each 0 starts a sequence, as cu_seqlens [0, 3, 8] would.
  const ds::ForwardInputs p =
      read_inputs({{"input_ids", {1, 8}, kIds8}, {"position_ids", {1, 8}, {0, 1, 2, 0, 1, 2, 3, 4}}});
  EXPECT_EQ(p.batch.cu_seqlens, (std::vector<int32_t>{0, 3, 8}));
  // Two rows: each row is a sequence; position_ids must restart with each.
  const ds::ForwardInputs rows = read_inputs({{"input_ids", {2, 4}, kIds8},
                                              {"position_ids", {2, 4}, {0, 1, 2, 3, 0, 1, 2, 3}},
                                              {"attention_mask", {2, 4}, {1, 1, 1, 1, 1, 1, 1, 1}}});
  EXPECT_EQ(rows.batch.cu_seqlens, (std::vector<int32_t>{0, 4, 8}));
  expect_error([&] { read_inputs({{"input_ids", {2, 4}, kIds8}, {"position_ids", {2, 4}, {0, 1, 2, 3, 4, 5, 6, 7}}}); },
               {"in.st: position_ids[4] = 4, but token 4 is position 0 of its sequence"});
  expect_error([&] {
    read_inputs({{"input_ids", {1, 8}, kIds8}, {"cu_seqlens", {2}, {0, 8}}, {"position_ids", {1, 8}, {0, 1, 2, 0, 1, 2, 3, 4}}});
  }, {"in.st: position_ids[3] = 0, but token 3 is position 3"});
  expect_error([&] { read_inputs({{"input_ids", {1, 8}, kIds8}, {"attention_mask", {1, 8}, {1, 1, 1, 1, 1, 1, 0, 0}}}); },
               {"in.st: attention_mask[6] = 0: padding is not supported"});
  expect_error([&] { read_inputs({{"input_ids", {1, 8}, kIds8}, {"token_type_ids", {1, 8}, kIds8}}); },
               {"in.st: unknown tensor \"token_type_ids\""});
  expect_error([&] { read_inputs({{"input_ids", {1, 8}, kIds8}, {"labels", {1, 8}, {0, 0, 0, 0, 0, 0, 0, 256}}}); },
               {"in.st: labels[7] = 256 is outside the vocabulary [0, 256)"});
  expect_error([&] { read_inputs({{"input_ids", {1, 8}, {0, 0, -1, 0, 0, 0, 0, 0}}}); },
               {"in.st: input_ids[2] = -1 is outside the vocabulary"});
}

// End to end through the command: an error naming the inputs file and cu_seqlens, no output written.
TEST(InputValidation, ForwardCommandRefusesBadCuSeqlens) {
  const std::string dir = ds::test::fresh_tmpdir("forward_cu");
  const std::vector<int64_t> cu = {0, 100000, 8};
  const std::string in = dir + "/in.safetensors";
  ds::write_safetensors(in, {ds::make_tensor_i64("input_ids", {1, 8}, kIds8.data()),
                             ds::make_tensor_i64("labels", {1, 8}, kIds8.data()),
                             ds::make_tensor_i64("cu_seqlens", {3}, cu.data())});
  EXPECT_EQ(error_of([&] { ds::cli::cmd_forward(fixture("hf_qwen35_tiny_a"), in, dir + "/out.safetensors", ""); }),
            in + ": cu_seqlens[1] = 100000 is outside [0, 8] (the token count)");
  EXPECT_FALSE(fs::exists(dir + "/out.safetensors"));
  fs::remove_all(dir);
}

// -------------------------------------------------------------------------------------- weight dtypes (8)

// A copy of the fixture checkpoint whose `tensor` is relabelled `dtype` (same byte size, the payload unchanged).
std::string relabelled_checkpoint(const std::string& dir, const std::string& tensor, const std::string& dtype) {
  fs::create_directories(dir);
  fs::copy_file(fixture("hf_qwen35_tiny_a/config.json"), dir + "/config.json", fs::copy_options::overwrite_existing);
  const std::string bytes = ds::read_file(fixture("hf_qwen35_tiny_a/model.safetensors"));
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  const std::string payload = bytes.substr(8 + n);
  json h = json::parse(bytes.substr(8, n));
  h[tensor]["dtype"] = dtype;
  std::string header = h.dump();
  header.resize((header.size() + 7) / 8 * 8, ' ');
  n = header.size();
  std::string out(8, '\0');
  std::memcpy(out.data(), &n, 8);
  out += header + payload;
  ds::write_file_atomic(dir + "/model.safetensors", out);
  return dir;
}

// Before: the I32-labelled weights were converted as integers (eval loss 791030451; inspect said "load check: ok").
TEST(InputValidation, WeightsStoredAsIntegersAreRefused) {
  const std::string base = ds::test::fresh_tmpdir("weights_i32");
  const std::string dir = relabelled_checkpoint(base + "/ck", "model.layers.0.mlp.up_proj.weight", "I32");
  const ds::ModelConfig c = ds::ModelConfig::from_file(dir);
  ds::Qwen35Model m(c);
  expect_error([&] { m.load(dir); }, {dir, "model.layers.0.mlp.up_proj.weight", "dtype I32", "float dtype"});
  expect_error([&] { ds::cli::cmd_inspect(dir); }, {"model.layers.0.mlp.up_proj.weight", "dtype I32"});
  // The reader itself refuses to read integers as floats (resume's optimizer state goes through it).
  ds::SafetensorsReader r(dir + "/model.safetensors");
  expect_error([&] { r.read_f32("model.layers.0.mlp.up_proj.weight"); },
               {dir + "/model.safetensors", "model.layers.0.mlp.up_proj.weight", "I32", "expected a float dtype"});
  fs::remove_all(base);
}

// ------------------------------------------------------------------------------------ dataset index.json (13)

// A dataset of 3 documents (the second masked) in shards of 4 tokens: 3 shards, labels present.
std::string small_dataset(const std::string& dir) {
  fs::create_directories(dir);
  ds::DatasetWriter w(dir, 4);
  w.add({{1, 2, 3, 4}, {}});
  w.add({{5, 6, 7, 8}, {0, 0, 1, 1}});
  w.add({{9, 10, 11}, {}});
  w.finish(json::object());
  return ds::read_file(dir + "/index.json");
}

TEST(InputValidation, DatasetIndexNamesEachFileOnce) {
  const std::string dir = ds::test::fresh_tmpdir("index_twice") + "/ds";
  const json index = json::parse(small_dataset(dir));
  ASSERT_EQ(index["shards"].size(), 3u);
  EXPECT_EQ(ds::MappedTokenStore(dir).num_tokens(), 11);
  // Shard 1 listed as shard 0's file (the same size): before, training read shard 0's tokens twice.
  json j = index;
  j["shards"][1]["tokens"] = j["shards"][0]["tokens"];
  ds::write_file_atomic(dir + "/index.json", j.dump());
  EXPECT_EQ(error_of([&] { ds::MappedTokenStore s(dir); }),
            dir + "/index.json: field \"shards[1].tokens\" names \"tokens-00000.bin\", which field \"shards[0].tokens\" "
            "names too: each file of the dataset is listed once");
  // A token shard as another shard's labels.
  j = index;
  j["shards"][1]["labels"] = j["shards"][1]["tokens"];
  ds::write_file_atomic(dir + "/index.json", j.dump());
  expect_error([&] { ds::MappedTokenStore s(dir); }, {"field \"shards[1].labels\" names \"tokens-00001.bin\""});
  j = index;
  j["masked_documents"] = j["documents"];
  ds::write_file_atomic(dir + "/index.json", j.dump());
  expect_error([&] { ds::MappedTokenStore s(dir); }, {"field \"masked_documents\" names \"documents.bin\""});
  fs::remove_all(fs::path(dir).parent_path());
}

// Before: "masked": false with the label files still there trained on the prompt tokens the labels exclude.
TEST(InputValidation, DatasetIndexMaskedFalseBesideLabelsIsRefused) {
  const std::string dir = ds::test::fresh_tmpdir("index_masked") + "/ds";
  const json index = json::parse(small_dataset(dir));
  ASSERT_TRUE(index["masked"].get<bool>());
  json j = index;
  j["masked"] = false;
  ds::write_file_atomic(dir + "/index.json", j.dump());
  expect_error([&] { ds::MappedTokenStore s(dir); },
               {dir + "/index.json", "field \"masked\" is false, but field \"shards[0].labels\""});
  // The fields removed too: the label files on disk still tell.
  j.erase("masked_documents");
  for (json& s : j["shards"]) s.erase("labels");
  ds::write_file_atomic(dir + "/index.json", j.dump());
  expect_error([&] { ds::MappedTokenStore s(dir); }, {"field \"masked\" is false, but " + dir + "/masked.bin exists"});
  fs::remove(dir + "/masked.bin");
  expect_error([&] { ds::MappedTokenStore s(dir); }, {"field \"masked\" is false, but " + dir + "/labels-00000.bin exists"});
  // With the label files gone, the dataset is an unmasked one.
  for (int i = 0; i < 3; ++i) fs::remove(dir + "/labels-0000" + std::to_string(i) + ".bin");
  EXPECT_FALSE(ds::MappedTokenStore(dir).has_labels());
  fs::remove_all(fs::path(dir).parent_path());
}

// ------------------------------------------------------------------------------------------- plan (14, 15)

// A config whose plan passes 2^64 bytes: 65536 layers of hidden 2^20 at 2^30 tokens (2^67 bytes of layer inputs).
TEST(InputValidation, PlanBeyond2To64BytesIsAnError) {
  if (!ds::cuda_compiled()) GTEST_SKIP() << "plan needs a CUDA build";
  const std::string dir = ds::test::fresh_tmpdir("plan_wrap");
  json j = json::parse(ds::read_file(fixture("hf_qwen35_tiny_a/config.json")));
  j.erase("layer_types");
  j["num_hidden_layers"] = 65536;
  j["full_attention_interval"] = 4;
  j["hidden_size"] = 1 << 20;
  j["intermediate_size"] = 1 << 20;
  j["max_position_embeddings"] = int64_t{1} << 30;
  ds::write_file_atomic(dir + "/config.json", j.dump());
  for (const char* attention : {"simple", "cudnn"}) {
    std::string out;
    EXPECT_EQ(ds::test::run("plan --model " + dir + "/config.json --seq-len 1073741824 --micro-batch 1 --memory fixed "
                            "--attention " + std::string(attention), &out),
              1) << out;
    EXPECT_NE(out.find("more than 2^64 bytes"), std::string::npos) << out;
    EXPECT_EQ(out.find("fits"), std::string::npos) << out;
  }
  fs::remove_all(dir);
}

TEST(InputValidation, PlanRefusesMoreDocumentsThanTokensPerWindow) {
  if (!ds::cuda_compiled()) GTEST_SKIP() << "plan needs a CUDA build";
  std::string out;
  EXPECT_EQ(ds::test::run("plan --model 0.8b --seq-len 64 --docs-per-window 65", &out), 1) << out;
  EXPECT_NE(out.find("plan: --docs-per-window 65 is more than --seq-len 64"), std::string::npos) << out;
  EXPECT_EQ(ds::test::run("plan --model 0.8b --seq-len 64 --docs-per-window 64", &out), 0) << out;
}

// --------------------------------------------------------------------------------- checkpoints (15)

TEST(InputValidation, OptimizerStateOfAnotherRunIsRefused) {
  const std::string dir = ds::test::fresh_tmpdir("optimizer_extra");
  ds::Qwen35Model m(ds::ModelConfig::from_file(fixture("hf_qwen35_tiny_a")));
  m.load(fixture("hf_qwen35_tiny_a"));
  std::unique_ptr<ds::Engine> e = ds::make_engine("cpu", std::move(m), ds::GpuPlan{});
  std::vector<ds::SaveTensor> state = e->optimizer_tensors();
  ds::write_safetensors(dir + "/optimizer.safetensors", state);
  ds::load_optimizer_state(*e, dir);  // this model's own state loads
  // A larger model's state: one more layer's moments. Before: ignored, the run resumed on it.
  const float zero[4] = {0, 0, 0, 0};
  state.push_back(ds::make_tensor_f32("exp_avg.model.layers.4.input_layernorm.weight", {4}, zero));
  ds::write_safetensors(dir + "/optimizer.safetensors", state);
  EXPECT_EQ(error_of([&] { ds::load_optimizer_state(*e, dir); }),
            dir + "/optimizer.safetensors: optimizer state exp_avg.model.layers.4.input_layernorm.weight has no "
                  "parameter in this model: the file belongs to another run or model");
  fs::remove_all(dir);
}

// Before: the index silently won over model.safetensors (transformers loads the single file first).
TEST(InputValidation, CheckpointWithBothLayoutsIsAmbiguous) {
  const std::string dir = ds::test::fresh_tmpdir("both_layouts");
  for (const auto& f : fs::directory_iterator(fixture("hf_qwen35_tiny_a_release_layout")))
    fs::copy_file(f.path(), dir + "/" + f.path().filename().string());
  EXPECT_EQ(ds::CheckpointReader(dir).names().size(), ds::CheckpointReader(fixture("hf_qwen35_tiny_a_release_layout")).names().size());
  fs::copy_file(fixture("hf_qwen35_tiny_a/model.safetensors"), dir + "/model.safetensors");
  EXPECT_EQ(error_of([&] { ds::CheckpointReader r(dir); }),
            dir + ": holds both model.safetensors and model.safetensors.index.json, so which one is the checkpoint is "
                  "ambiguous; move the stale one out of the directory");
  // Either file named directly is no guess.
  EXPECT_NO_THROW(ds::CheckpointReader(dir + "/model.safetensors"));
  EXPECT_NO_THROW(ds::CheckpointReader(dir + "/model.safetensors.index.json"));
  fs::remove_all(dir);
}

}  // namespace
