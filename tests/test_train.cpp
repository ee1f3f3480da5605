// Config parsing, data packing, and the trainer end to end through the CLI: metrics, checkpoints, bitwise
// resume, determinism, the NaN guard and bad-input errors.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <utility>
#include <vector>

#include "core/cuda/device.h"
#include "core/error.h"
#include "core/files.h"
#include "data/dataset.h"
#include "model/config.h"
#include "model/model.h"
#include "model/safetensors.h"
#include "test_util.h"
#include "train/options.h"
#include "train_test_util.h"

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

using ds::test::metrics;
using ds::test::run;
using ds::test::small_setup;
using ds::test::train_losses;

std::string tmpdir(const std::string& name) { return ds::test::fresh_tmpdir("train_" + name); }

}  // namespace

TEST(Config, PresetsHaveThePublishedParameterCounts) {
  EXPECT_NEAR(ds::ModelConfig::preset("0.8b").num_parameters() / 1e9, 0.75, 0.01);
  EXPECT_NEAR(ds::ModelConfig::preset("2b").num_parameters() / 1e9, 1.88, 0.01);
  EXPECT_NEAR(ds::ModelConfig::preset("9b").num_parameters() / 1e9, 8.95, 0.01);
  EXPECT_NEAR(ds::ModelConfig::preset("27b").num_parameters() / 1e9, 26.9, 0.1);
  auto c = ds::ModelConfig::preset("9b");
  EXPECT_EQ(c.conv_dim(), 8192);
  EXPECT_TRUE(c.is_full_attention(3));
  EXPECT_FALSE(c.is_full_attention(4));
  EXPECT_THROW(ds::ModelConfig::preset("7b"), ds::Error);
}

TEST(Config, CompositeIntervalAndErrors) {
  json text = {{"model_type", "qwen3_5_text"}, {"hidden_size", 64}, {"num_hidden_layers", 8},
               {"full_attention_interval", 2}, {"rope_parameters", {{"rope_theta", 1e6}, {"partial_rotary_factor", 0.5}}}};
  json comp = {{"model_type", "qwen3_5"}, {"tie_word_embeddings", true}, {"text_config", text}};
  auto c = ds::ModelConfig::from_json(comp, "x/config.json");
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_EQ(c.layer_types[1], "full_attention");
  EXPECT_EQ(c.layer_types[2], "linear_attention");
  EXPECT_DOUBLE_EQ(c.rope_theta, 1e6);
  EXPECT_EQ(c.rotary_dim(), 128);
  auto expect_error = [](json j, const std::string& needle) {
    try {
      ds::ModelConfig::from_json(j, "bad/config.json");
      ADD_FAILURE() << "no error for " << needle;
    } catch (const ds::Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("bad/config.json"), std::string::npos) << e.what();
    }
  };
  json j = text;
  j["layer_types"] = {"linear_attention"};
  expect_error(j, "layer_types");
  j = text;
  j["linear_num_value_heads"] = 5;
  expect_error(j, "linear_num_value_heads");
  j = text;
  j["hidden_size"] = "big";
  expect_error(j, "hidden_size");
  j = text;
  j["model_type"] = "llama";
  expect_error(j, "model_type");
  EXPECT_THROW(ds::ModelConfig::from_file("/nonexistent/config.json"), ds::Error);
}

TEST(Data, PackingKeepsDocumentsApart) {
  std::vector<std::vector<int32_t>> docs = {{1, 2, 3}, {4, 5}, {6, 7, 8, 9, 10}};
  ds::PackedDataset set(docs, 4);
  ASSERT_EQ(set.num_windows(), 2);  // 10 tokens -> 2 full windows of 4
  ds::PackedBatch b = set.batch({0, 1});
  EXPECT_EQ(b.input_ids, (std::vector<int32_t>{1, 2, 3, 4, 5, 6, 7, 8}));
  EXPECT_EQ(b.cu_seqlens, (std::vector<int32_t>{0, 3, 4, 5, 8}));
  // targets: next token of the same document, -100 at document ends; window 1 ends mid-document and its last
  // target is the next token (9) of that document.
  EXPECT_EQ(b.targets, (std::vector<int32_t>{2, 3, -100, 5, -100, 7, 8, 9}));
  EXPECT_EQ(b.positions, (std::vector<int32_t>{0, 1, 2, 0, 0, 0, 1, 2}));
}

TEST(Data, ReadersAndErrors) {
  std::string dir = tmpdir("readers");
  ds::write_file_atomic(dir + "/a.txt", "para one\nline two\n\n\npara two\n");
  ds::write_file_atomic(dir + "/b.jsonl", "{\"text\": \"hello\"}\n{\"text\": \"world\"}\n");
  auto docs = ds::read_documents({dir + "/a.txt", dir + "/b.jsonl"}, ds::TxtSplit::Paragraph);
  std::vector<std::string> texts;
  for (const ds::LabelledText& d : docs) {
    texts.push_back(d.text);
    EXPECT_FALSE(d.masked);
  }
  EXPECT_EQ(texts, (std::vector<std::string>{"para one\nline two\n", "para two\n", "hello", "world"}));
  ds::write_file_atomic(dir + "/empty.txt", "");
  ds::write_file_atomic(dir + "/bad.jsonl", "{\"text\": 1}\n");
  ds::write_file_atomic(dir + "/x.csv", "a,b\n");
  ds::write_file_atomic(dir + "/blank.jsonl", "{\"text\": \"hello\"}\n\n{\"text\": \"world\"}\n");  // as tokenize
  for (std::string f : {"empty.txt", "bad.jsonl", "x.csv", "missing.txt", "blank.jsonl"}) {
    try {
      ds::read_documents({dir + "/" + f}, ds::TxtSplit::Paragraph);
      ADD_FAILURE() << f;
    } catch (const ds::Error& e) {
      EXPECT_NE(std::string(e.what()).find(f), std::string::npos) << e.what();
      if (f == "blank.jsonl") {
        EXPECT_NE(std::string(e.what()).find("blank.jsonl:2: empty line"), std::string::npos);
      }
    }
  }
  fs::remove_all(dir);
}

// The option table (train/options.h) keeps trainer_state.json's format: the same keys and defaults; a checkpoint
// of an earlier version (without the later keys) reads their defaults; a resume takes only the resumable flags.
TEST(Train, OptionTableKeepsTheCheckpointFormat) {
  auto expect_error = [](const std::function<void()>& f, const std::string& needle) {
    try {
      f();
      ADD_FAILURE() << "no error for " << needle;
    } catch (const ds::Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  const ds::TrainOptions d;
  const json j = ds::options_to_json(d);
  std::vector<std::string> keys;
  for (const auto& [k, v] : j.items()) keys.push_back(k);
  EXPECT_EQ(keys, (std::vector<std::string>{"adam_eps", "adapter", "beta1", "beta2", "clip", "data", "device",
                                            "eval_batches", "eval_interval", "fp8_lm_head", "grad_accum", "gradients", "keep_last", "lora_alpha",
                                            "lora_dropout", "lora_rank", "lora_targets", "lr", "max_shard_mb",
                                            "micro_batch", "min_lr_ratio", "model", "nan_policy", "optimizer_state",
                                            "precision", "save_interval", "schedule", "seed", "seq_len", "steps", "tokenizer",
                                            "txt_split", "use_rslora", "val_data", "val_fraction", "warmup",
                                            "weight_decay", "z_loss"}));
  EXPECT_EQ(j["lora_rank"], 0);  // a full run; LoRA (docs/lora.md) with PEFT's defaults when asked
  EXPECT_EQ(j["lora_alpha"], 8.0);
  EXPECT_EQ(j["lora_targets"], "all-linear");
  EXPECT_EQ(j["model"], "tiny");
  EXPECT_EQ(j["seq_len"], 128);
  EXPECT_EQ(j["lr"], 3e-3);
  EXPECT_EQ(j["seed"], 1234u);
  EXPECT_EQ(j["val_data"], json::array());
  EXPECT_EQ(j["precision"], "bf16");
  EXPECT_EQ(j["fp8_lm_head"], false);
  EXPECT_EQ(j["gradients"], "auto");
  EXPECT_EQ(d.out, "runs/default");
  EXPECT_EQ(d.threads, 0);
  EXPECT_NO_THROW(ds::validate(d));

  json old = j;
  for (const char* k : {"keep_last", "max_shard_mb", "device", "val_data", "optimizer_state", "precision", "lora_rank",
                        "lora_alpha", "lora_dropout", "lora_targets", "use_rslora", "adapter",
                        "gradients", "fp8_lm_head"})
    old.erase(k);
  old["lr"] = 0.5;
  ds::TrainOptions cli;
  cli.resume = "ck";
  cli.out = "elsewhere";
  cli.steps = 7;
  cli.keep_last = 3;  // not given: the checkpoint's (here the default)
  cli.lr = 0.25;
  cli.given = {"resume", "out", "steps"};
  const ds::TrainOptions r = ds::resumed_options(cli, old, "st.json");
  EXPECT_EQ(r.lr, 0.5);
  EXPECT_EQ(r.steps, 7);
  EXPECT_EQ(r.keep_last, 0);
  EXPECT_EQ(r.max_shard_mb, 5000);
  EXPECT_EQ(r.device, "auto");
  EXPECT_EQ(r.optimizer_state, "fp32");  // earlier versions kept fp32 state: not `auto`, which may pick bf16
  EXPECT_EQ(r.precision, "bf16");        // earlier versions ran bf16 GEMMs only
  EXPECT_EQ(r.gradients, "fp32");        // and kept a gradient buffer
  EXPECT_FALSE(r.fp8_lm_head);           // and the bf16 lm head
  EXPECT_EQ(r.lora_rank, 0);             // earlier versions trained every parameter
  EXPECT_TRUE(r.adapter.empty());
  EXPECT_EQ(r.out, "elsewhere");
  EXPECT_EQ(r.resume, "ck");
  {  // a resume switching to --precision bf16 drops the checkpoint's FP8 lm head; to fp8 (or not given) keeps it
    json f8 = j;
    f8["precision"] = "fp8";
    f8["fp8_lm_head"] = true;
    ds::TrainOptions c2;
    c2.resume = "ck";
    c2.out = "elsewhere";
    c2.precision = "bf16";
    c2.given = {"resume", "out", "precision"};
    const ds::TrainOptions to_bf16 = ds::resumed_options(c2, f8, "st.json");
    EXPECT_EQ(to_bf16.precision, "bf16");
    EXPECT_FALSE(to_bf16.fp8_lm_head);
    EXPECT_NO_THROW(ds::validate(to_bf16));
    c2.given = {"resume", "out"};
    EXPECT_TRUE(ds::resumed_options(c2, f8, "st.json").fp8_lm_head);
  }
  cli.given.push_back("lr");
  expect_error([&] { ds::resumed_options(cli, old, "st.json"); }, "--lr cannot change on --resume");
  cli.given.pop_back();
  old["micro_batch"] = 2.5;  // an edited file: not silently truncated to 2
  expect_error([&] { ds::resumed_options(cli, old, "st.json"); },
               "st.json: field \"options.micro_batch\" must be an integer, got 2.5");
  old["micro_batch"] = true;
  expect_error([&] { ds::resumed_options(cli, old, "st.json"); },
               "st.json: field \"options.micro_batch\" must be an integer, got true");
  old["micro_batch"] = 2;
  EXPECT_EQ(ds::resumed_options(cli, old, "st.json").micro_batch, 2);
  old.erase("seq_len");
  expect_error([&] { ds::resumed_options(cli, old, "st.json"); }, "st.json: field \"options.seq_len\" is missing");

  ds::TrainOptions bad;
  bad.beta2 = 1.0;
  expect_error([&] { ds::validate(bad); }, "--beta2 must be in [0, 1), got 1");
  bad = ds::TrainOptions();
  bad.schedule = "step";
  expect_error([&] { ds::validate(bad); }, "--schedule must be cosine, linear or constant, got \"step\"");
  bad = ds::TrainOptions();
  bad.max_shard_mb = 0;
  expect_error([&] { ds::validate(bad); }, "--max-shard-mb must be in [1, 1000000], got 0");
}

TEST(Train, MetricsCheckpointsAndBitwiseResume) {
  std::string dir = tmpdir("resume");
  std::string args = small_setup(dir);
  ASSERT_EQ(run("train " + args + " --steps 6 --warmup 2 --threads 1 --save-interval 3 --out " + dir + "/a"), 0);
  auto m = metrics(dir + "/a/metrics.jsonl");
  ASSERT_GE(m.size(), 7u);
  EXPECT_TRUE(m[0].contains("eval_loss"));
  for (const char* k : {"step", "loss", "grad_norm", "lr", "tokens", "tokens_per_s", "elapsed_s"})
    EXPECT_TRUE(m[1].contains(k)) << k;
  for (const char* f : {"config.json", "model.safetensors", "optimizer.safetensors", "trainer_state.json", "tokenizer.json"})
    EXPECT_TRUE(fs::exists(dir + "/a/checkpoint-3/" + f)) << f;
  // Resume from step 3 into another dir: steps 4..6 must be bitwise the same, and so must the final weights.
  fs::create_directories(dir + "/b");
  ASSERT_EQ(run("train --resume " + dir + "/a/checkpoint-3 --steps 6 --threads 1 --out " + dir + "/b"), 0);
  auto la = train_losses(dir + "/a/metrics.jsonl"), lb = train_losses(dir + "/b/metrics.jsonl");
  ASSERT_EQ(la.size(), 6u);
  ASSERT_EQ(lb.size(), 3u);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(la[3 + i], lb[i]) << "step " << 4 + i;
  EXPECT_EQ(ds::read_file(dir + "/a/checkpoint-6/model.safetensors"), ds::read_file(dir + "/b/checkpoint-6/model.safetensors"));
  // Same seed, another run, two threads: identical losses.
  ASSERT_EQ(run("train " + args + " --steps 3 --warmup 2 --out " + dir + "/c --threads 2"), 0);
  auto lc = train_losses(dir + "/c/metrics.jsonl");
  ASSERT_EQ(lc.size(), 3u);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(la[i], lc[i]) << "step " << i + 1;
  fs::remove_all(dir);
}

// --precision fp8 on the CPU engine (the emulated casts, docs/fp8.md): a run of its own (finite, not the bf16 run's
// losses), bitwise repeatable and resumed bitwise, its checkpoint keeping the precision; a resume may switch to bf16.
TEST(Train, Fp8PrecisionTrainsResumesAndMaySwitch) {
  std::string dir = tmpdir("fp8");
  std::string args = small_setup(dir) + " --steps 4 --warmup 1 --threads 1";
  ASSERT_EQ(run("train " + args + " --out " + dir + "/bf16"), 0);
  ASSERT_EQ(run("train " + args + " --precision fp8 --save-interval 2 --out " + dir + "/a"), 0);
  ASSERT_EQ(run("train " + args + " --precision fp8 --out " + dir + "/b"), 0);
  auto l16 = train_losses(dir + "/bf16/metrics.jsonl"), la = train_losses(dir + "/a/metrics.jsonl"),
       lb = train_losses(dir + "/b/metrics.jsonl");
  ASSERT_EQ(la.size(), 4u);
  EXPECT_EQ(la, lb);
  for (size_t i = 0; i < la.size(); ++i) {
    EXPECT_TRUE(std::isfinite(la[i]));
    EXPECT_NE(la[i], l16[i]) << "step " << i + 1;
    EXPECT_LT(std::abs(la[i] - l16[i]) / l16[i], 0.02) << "step " << i + 1;
  }
  const json st = json::parse(ds::read_file(dir + "/a/checkpoint-2/trainer_state.json"));
  EXPECT_EQ(st["options"]["precision"], "fp8");
  ASSERT_EQ(run("train --resume " + dir + "/a/checkpoint-2 --steps 4 --threads 1 --out " + dir + "/c"), 0);
  auto lc = train_losses(dir + "/c/metrics.jsonl");
  ASSERT_EQ(lc.size(), 2u);
  EXPECT_EQ(lc[0], la[2]);
  EXPECT_EQ(lc[1], la[3]);
  ASSERT_EQ(run("train --resume " + dir + "/a/checkpoint-2 --steps 4 --threads 1 --precision bf16 --out " + dir + "/d"), 0);
  auto ld = train_losses(dir + "/d/metrics.jsonl");
  ASSERT_EQ(ld.size(), 2u);
  EXPECT_NE(ld[0], la[2]);
  EXPECT_NE(run("train " + args + " --precision fp16 --out " + dir + "/e"), 0);
  fs::remove_all(dir);
}

// `train ARGS` into fresh dir/a (the fp32 gradient buffer) and dir/b (--gradients in-backward).
static void train_fp32_and_in_backward(const std::string& args, const std::string& dir) {
  fs::remove_all(dir + "/a");
  fs::remove_all(dir + "/b");
  ASSERT_EQ(run("train " + args + " --out " + dir + "/a"), 0);
  ASSERT_EQ(run("train " + args + " --gradients in-backward --out " + dir + "/b"), 0);
}

// --gradients in-backward on the CPU engine (the same semantics over its host buffers; model/engine.h Gradients):
// the trainer's in-backward step (the norm pass, the clip factor from it, the updating pass) is bitwise the fp32
// mode's step with clipping active, without the norm pass (--clip 0), and with --nan-policy skip (the norm pass
// again); a checkpoint resumes bitwise in either mode; --grad-accum 2 is refused.
TEST(Train, GradientsInBackwardIsTheFp32Step) {
  std::string dir = tmpdir("inbwd");
  const std::string args = small_setup(dir) + " --steps 4 --warmup 1 --threads 1 --save-interval 2";
  auto norms = [](const std::string& path) {
    std::vector<double> n;
    for (auto& j : metrics(path))
      if (j.contains("grad_norm")) n.push_back(j["grad_norm"].get<double>());
    return n;
  };
  for (const char* extra : {" --clip 0.05", " --clip 0", " --clip 0.05 --nan-policy skip"}) {
    SCOPED_TRACE(extra);
    train_fp32_and_in_backward(args + extra, dir);
    const auto la = train_losses(dir + "/a/metrics.jsonl"), lb = train_losses(dir + "/b/metrics.jsonl");
    const auto na = norms(dir + "/a/metrics.jsonl"), nb = norms(dir + "/b/metrics.jsonl");
    ASSERT_EQ(la.size(), 4u);
    EXPECT_EQ(la, lb);
    EXPECT_EQ(na, nb);
    if (std::string(extra).find("0.05") != std::string::npos) {
      EXPECT_GT(na[1], 0.05);  // clipping was active
    }
    EXPECT_EQ(ds::read_file(dir + "/a/checkpoint-4/model.safetensors"),
              ds::read_file(dir + "/b/checkpoint-4/model.safetensors"));
    EXPECT_EQ(ds::read_file(dir + "/a/checkpoint-4/optimizer.safetensors"),
              ds::read_file(dir + "/b/checkpoint-4/optimizer.safetensors"));
  }
  const json st = json::parse(ds::read_file(dir + "/b/checkpoint-2/trainer_state.json"));
  EXPECT_EQ(st["options"]["gradients"], "in-backward");
  // The last loop's runs (--clip 0.05 --nan-policy skip): resumed in the other mode, the same steps.
  ASSERT_EQ(run("train --resume " + dir + "/b/checkpoint-2 --steps 4 --threads 1 --gradients fp32 --out " + dir + "/c"), 0);
  ASSERT_EQ(run("train --resume " + dir + "/a/checkpoint-2 --steps 4 --threads 1 --gradients in-backward --out " + dir +
                "/d"), 0);
  const auto la = train_losses(dir + "/a/metrics.jsonl"), lc = train_losses(dir + "/c/metrics.jsonl"),
             ld = train_losses(dir + "/d/metrics.jsonl");
  ASSERT_EQ(lc.size(), 2u);
  EXPECT_EQ(lc[0], la[2]);
  EXPECT_EQ(lc[1], la[3]);
  EXPECT_EQ(ld, lc);
  std::string log;
  EXPECT_NE(run("train " + args + " --gradients in-backward --grad-accum 2 --out " + dir + "/e", &log), 0);
  EXPECT_NE(log.find("--grad-accum must be 1"), std::string::npos) << log;
  // A resume cannot change --grad-accum (nor --micro-batch): the error says so instead of advising them.
  ASSERT_EQ(run("train " + args + " --steps 1 --grad-accum 2 --out " + dir + "/g"), 0);
  EXPECT_NE(run("train --resume " + dir + "/g/checkpoint-1 --steps 2 --gradients in-backward", &log), 0);
  EXPECT_NE(log.find("a resume keeps it); use --gradients fp32"), std::string::npos) << log;
  EXPECT_EQ(log.find("raise --micro-batch"), std::string::npos) << log;
  EXPECT_NE(run("train " + args + " --gradients fused --out " + dir + "/f"), 0);
  fs::remove_all(dir);
}

// --gradients in-backward on steps whose batch has no targets (prompt/completion lines whose long prompts fill
// whole windows: a window of prompt tokens only has no label): the fp32 mode takes an AdamW step over zero
// gradients there (grad norm 0; the moments decay, the weight decay applies), and so must the update in the backward
// (it once skipped it, counted it and logged the previous step's grad norm). Losses, grad norms, weights and moments
// bitwise the fp32 mode's, with and without the norm pass.
TEST(Train, GradientsInBackwardStepWithoutTargets) {
  const std::string dir = tmpdir("inbwd_nolabels");
  std::istringstream words_in(ds::read_file(ds::test::data_path("tiny_shakespeare.txt")).substr(0, 20000));
  std::vector<std::string> words;
  for (std::string w; words_in >> w;) words.push_back(w);
  std::string jsonl;
  size_t at = 0;
  auto take = [&](size_t n) {
    std::string s;
    for (size_t i = 0; i < n; ++i) s += (i ? " " : "") + words[at++ % words.size()];
    return s;
  };
  for (int i = 0; i < 40; ++i) jsonl += json{{"prompt", take(i % 3 == 0 ? 6 : 90)}, {"completion", take(3)}}.dump() + "\n";
  ds::write_file_atomic(dir + "/sft.jsonl", jsonl);
  const std::string args = ds::test::small_setup_on(dir, dir + "/sft.jsonl") +
                           " --micro-batch 1 --steps 10 --warmup 1 --threads 1 --save-interval 10";
  auto steps = [](const std::string& path) {
    std::vector<std::pair<double, double>> v;  // loss, grad norm
    for (auto& j : metrics(path))
      if (j.contains("grad_norm")) v.emplace_back(j["loss"].get<double>(), j["grad_norm"].get<double>());
    return v;
  };
  for (const char* extra : {" --clip 0", " --clip 1"}) {
    SCOPED_TRACE(extra);
    train_fp32_and_in_backward(args + extra, dir);
    const auto sa = steps(dir + "/a/metrics.jsonl"), sb = steps(dir + "/b/metrics.jsonl");
    ASSERT_EQ(sa.size(), 10u);
    const auto no_targets = std::count_if(sa.begin(), sa.end(), [](auto& s) { return s.first == 0.0; });
    ASSERT_GE(no_targets, 2) << "the data should give steps without targets";
    ASSERT_LT(no_targets, 9) << "and steps with targets";
    for (const auto& s : sa) {
      if (s.first == 0.0) {
        EXPECT_EQ(s.second, 0.0);
      }
    }
    EXPECT_EQ(sa, sb);
    for (const char* f : {"/checkpoint-10/model.safetensors", "/checkpoint-10/optimizer.safetensors"})
      EXPECT_TRUE(ds::read_file(dir + "/a" + f) == ds::read_file(dir + "/b" + f)) << f;
  }
  fs::remove_all(dir);
}

// --max-shard-mb 1: the weights and the AdamW moments go to shards plus index files, and a resume from them
// continues bitwise like a resume from single files.
TEST(Train, ShardedCheckpointsResumeBitwise) {
  std::string dir = tmpdir("shards");
  std::string args = small_setup(dir);
  ASSERT_EQ(run("train " + args + " --steps 4 --warmup 1 --threads 1 --save-interval 2 --out " + dir + "/a"), 0);
  ASSERT_EQ(run("train " + args + " --steps 4 --warmup 1 --threads 1 --save-interval 2 --max-shard-mb 1 --out " + dir +
                "/b"), 0);
  const std::string ck = dir + "/b/checkpoint-2";
  for (const char* f : {"model.safetensors.index.json", "model-00001-of-00002.safetensors",
                        "optimizer.safetensors.index.json", "optimizer-00001-of-00003.safetensors"})
    EXPECT_TRUE(fs::exists(ck + "/" + f)) << f;
  EXPECT_FALSE(fs::exists(ck + "/optimizer.safetensors"));
  ASSERT_EQ(run("train --resume " + ck + " --steps 4 --threads 1 --out " + dir + "/c"), 0);
  auto la = train_losses(dir + "/a/metrics.jsonl"), lc = train_losses(dir + "/c/metrics.jsonl");
  ASSERT_EQ(la.size(), 4u);
  ASSERT_EQ(lc.size(), 2u);
  for (int i = 0; i < 2; ++i) EXPECT_EQ(la[2 + i], lc[i]) << "step " << 3 + i;
  fs::remove_all(dir);
}

// --val-data: evaluation on a separate file (its loss differs from the held-out split's), all of --data trains;
// combined with an explicit --val-fraction it is a contradiction (exit 1 naming both flags).
TEST(Train, SeparateValidationData) {
  std::string dir = tmpdir("valdata");
  const std::string args = small_setup(dir);  // holds --val-fraction 0.1
  std::string no_frac = args;
  no_frac.erase(no_frac.find(" --val-fraction 0.1"), std::string(" --val-fraction 0.1").size());
  ds::write_file_atomic(dir + "/val.txt", ds::read_file(dir + "/corpus.txt").substr(0, 3000));
  ASSERT_EQ(run("train " + args + " --steps 2 --warmup 1 --threads 1 --out " + dir + "/a"), 0);
  std::string log;
  ASSERT_EQ(run("train " + no_frac + " --steps 2 --warmup 1 --threads 1 --val-data " + dir + "/val.txt --out " + dir +
                "/b", &log), 0);
  EXPECT_NE(log.find("(--val-data)"), std::string::npos) << log;
  auto ma = metrics(dir + "/a/metrics.jsonl"), mb = metrics(dir + "/b/metrics.jsonl");
  ASSERT_TRUE(ma[0].contains("eval_loss") && mb[0].contains("eval_loss"));
  EXPECT_NE(ma[0]["eval_loss"].get<double>(), mb[0]["eval_loss"].get<double>());
  std::string err;
  EXPECT_EQ(run("train " + args + " --steps 1 --val-fraction 0.2 --val-data " + dir + "/val.txt --out " + dir + "/c", &err),
            1);
  EXPECT_NE(err.find("--val-data and --val-fraction"), std::string::npos) << err;
  EXPECT_EQ(run("train " + no_frac + " --steps 1 --val-fraction 0 --val-data " + dir + "/val.txt --out " + dir + "/d"), 0);
  fs::remove_all(dir);
}

// `deltastack eval` of a fresh checkpoint on its own training text: a finite loss, perplexity = exp(loss); the
// same on the CPU twice is bitwise equal; --device cuda without a GPU, or a bad --device, is a clear error.
TEST(Eval, CheckpointLossAndDevices) {
  std::string dir = tmpdir("eval");
  std::string args = small_setup(dir);
  ASSERT_EQ(run("train " + args + " --steps 2 --warmup 1 --threads 1 --out " + dir + "/a"), 0);
  const std::string ev = "eval --model " + dir + "/a/checkpoint-2 --data " + dir + "/corpus.txt --seq-len 32 --threads 1";
  std::string out1, out2, err;
  ASSERT_EQ(run(ev + " --device cpu", &out1), 0);
  ASSERT_EQ(run(ev + " --device cpu", &out2), 0);
  const auto j = nlohmann::json::parse(out1.substr(out1.find('{')));
  const double loss = j["eval_loss"].get<double>();
  EXPECT_TRUE(std::isfinite(loss) && loss > 0 && loss < 20) << out1;
  EXPECT_NEAR(j["perplexity"].get<double>(), std::exp(loss), 1e-3 * std::exp(loss));
  EXPECT_EQ(out1, out2);
  EXPECT_EQ(run(ev + " --device tpu", &err), 1);
  EXPECT_NE(err.find("--device"), std::string::npos) << err;
  if (ds::cuda_device_count() == 0) {
    EXPECT_EQ(run(ev + " --device cuda", &err), 1);
    EXPECT_NE(err.find("cuda"), std::string::npos) << err;
  }
  fs::remove_all(dir);
}

// `deltastack export` of the fp32 HF fixture in bf16 loads to exactly the HF-made release-layout fixture
// (bf16 of every weight, A_log and the gated-norm weight fp32); it refuses a non-empty output directory and
// leaves it untouched, and rejects a dtype other than bf16/f32.
TEST(Export, Bf16MatchesReleaseLayoutFixture) {
  std::string dir = tmpdir("export");
  ASSERT_EQ(run("export " + ds::test::fixture("hf_qwen35_tiny_a") + " " + dir + "/bf16"), 0);
  const auto cfg = nlohmann::json::parse(ds::read_file(dir + "/bf16/config.json"));
  EXPECT_EQ(cfg.value("dtype", std::string()), "bfloat16");
  ds::Qwen35Model ex(ds::ModelConfig::from_file(dir + "/bf16"));
  ex.load(dir + "/bf16");
  ds::Qwen35Model rel(ds::ModelConfig::from_file(ds::test::fixture("hf_qwen35_tiny_a_release_layout")));
  rel.load(ds::test::fixture("hf_qwen35_tiny_a_release_layout"));
  ASSERT_EQ(ex.weights().size(), rel.weights().size());
  EXPECT_TRUE(ex.weights() == rel.weights());
  fs::create_directories(dir + "/taken");
  ds::write_file_atomic(dir + "/taken/keep.txt", "x");
  EXPECT_NE(run("export " + ds::test::fixture("hf_qwen35_tiny_a") + " " + dir + "/taken"), 0);
  EXPECT_EQ(ds::read_file(dir + "/taken/keep.txt"), "x");
  EXPECT_FALSE(fs::exists(dir + "/taken/model.safetensors"));
  EXPECT_NE(run("export " + ds::test::fixture("hf_qwen35_tiny_a") + " " + dir + "/x --dtype f16"), 0);
  // Not into the checkpoint itself; no temporary directory is left next to the outputs.
  ASSERT_EQ(run("export " + dir + "/bf16 " + dir + "/f32 --dtype f32"), 0);
  EXPECT_EQ(run("export " + dir + "/f32 " + dir + "/f32/inner"), 1);
  fs::create_directory_symlink(dir + "/f32", dir + "/lnk");
  EXPECT_EQ(run("export " + dir + "/f32 " + dir + "/lnk/inner"), 1);  // inside the checkpoint through the link
  EXPECT_EQ(run("export " + dir + "/bf16 " + dir + "/lnk"), 1);        // a link as the output
  EXPECT_FALSE(fs::exists(dir + "/f32/inner"));
  EXPECT_FALSE(fs::exists(dir + "/f32/inner"));
  for (const auto& e : fs::directory_iterator(dir))
    EXPECT_EQ(e.path().filename().string().find(".tmp"), std::string::npos) << e.path();
  fs::remove_all(dir);
}

// --keep-last 2 with a checkpoint every step: only the two newest stay, and a resume from the newest may keep
// another number (it is not run-defining); foreign directories are left alone; a resume from an older checkpoint
// never removes what it just saved, and moves the abandoned run's newer checkpoints into OUT/abandoned-K/.
TEST(Train, KeepLastCheckpoints) {
  std::string dir = tmpdir("keep");
  std::string args = small_setup(dir);
  fs::create_directories(dir + "/a/checkpoint-notes");
  ASSERT_EQ(run("train " + args + " --steps 4 --warmup 1 --threads 1 --save-interval 1 --keep-last 2 --out " + dir +
                "/a"), 0);
  for (int s = 1; s <= 4; ++s) EXPECT_EQ(fs::exists(dir + "/a/checkpoint-" + std::to_string(s)), s >= 3) << s;
  EXPECT_TRUE(fs::exists(dir + "/a/checkpoint-notes"));
  ASSERT_EQ(run("train --resume " + dir + "/a/checkpoint-4 --steps 6 --threads 1 --keep-last 1"), 0);
  for (int s = 1; s <= 6; ++s) EXPECT_EQ(fs::exists(dir + "/a/checkpoint-" + std::to_string(s)), s == 6) << s;
  EXPECT_NE(run("train " + args + " --steps 1 --keep-last -1 --out " + dir + "/b"), 0);
  // Resuming an earlier checkpoint into the same directory (a trailing slash too): the new checkpoint-2 stays, the
  // abandoned, higher checkpoint-3 moves whole into c/abandoned-1/; only older ones are pruned.
  ASSERT_EQ(run("train " + args + " --steps 3 --warmup 1 --threads 1 --save-interval 1 --out " + dir + "/c"), 0);
  ASSERT_EQ(run("train --resume " + dir + "/c/checkpoint-1/ --steps 2 --threads 1 --keep-last 1"), 0);
  EXPECT_FALSE(fs::exists(dir + "/c/checkpoint-1"));
  EXPECT_TRUE(fs::exists(dir + "/c/checkpoint-2/model.safetensors"));
  EXPECT_TRUE(fs::exists(dir + "/c/abandoned-1/checkpoint-3/model.safetensors"));
  EXPECT_FALSE(fs::exists(dir + "/c/checkpoint-3"));
  EXPECT_FALSE(fs::exists(dir + "/c/checkpoint-1/checkpoint-2"));
  for (const auto& e : fs::directory_iterator(dir + "/c"))
    EXPECT_EQ(e.path().filename().string().find(".tmp"), std::string::npos) << e.path();
  // A new run (another seed, not a resume) into a directory holding another run's checkpoints: refused, nothing
  // touched; with --move-aside they go to c/previous-1/ as they were and --keep-last prunes only the new run's own.
  std::string log;
  const std::string old3 = ds::read_file(dir + "/c/abandoned-1/checkpoint-3/model.safetensors");
  const std::string new_run = "train " + args + " --steps 4 --warmup 1 --threads 1 --save-interval 2 --keep-last 1 "
                              "--seed 99 --out " + dir + "/c";
  EXPECT_EQ(run(new_run, &log), 1) << log;
  EXPECT_NE(log.find("holds another run's files (checkpoint-2, metrics-abandoned.jsonl, metrics.jsonl)"),
            std::string::npos) << log;
  EXPECT_EQ(ds::read_file(dir + "/c/abandoned-1/checkpoint-3/model.safetensors"), old3);
  ASSERT_EQ(run(new_run + " --move-aside", &log), 0) << log;
  EXPECT_TRUE(fs::exists(dir + "/c/previous-1/checkpoint-2/model.safetensors"));  // the other run's, as it was
  EXPECT_EQ(ds::read_file(dir + "/c/abandoned-1/checkpoint-3/model.safetensors"), old3);
  EXPECT_TRUE(fs::exists(dir + "/c/previous-1/metrics.jsonl"));
  EXPECT_FALSE(fs::exists(dir + "/c/checkpoint-3"));
  EXPECT_FALSE(fs::exists(dir + "/c/checkpoint-2"));  // the new run's own step 2, pruned
  EXPECT_TRUE(fs::exists(dir + "/c/checkpoint-4/model.safetensors"));
  // "--resume CKPT/." continues in the run directory; a *file* named like the next checkpoint stops the save
  // (exit 1) without touching it.
  ASSERT_EQ(run("train --resume " + dir + "/c/checkpoint-4/. --steps 6 --threads 1"), 0);
  EXPECT_TRUE(fs::exists(dir + "/c/checkpoint-6/model.safetensors"));
  EXPECT_FALSE(fs::exists(dir + "/c/checkpoint-4/checkpoint-6"));
  // Resuming an earlier checkpoint with another --save-interval: the abandoned history's later checkpoints (3..6)
  // move into h/abandoned-1/, the resumed history is pruned: after saving 3 and 6 with --keep-last 2, 3 and 6 remain.
  ASSERT_EQ(run("train " + args + " --steps 6 --warmup 1 --threads 1 --save-interval 1 --out " + dir + "/h"), 0);
  ASSERT_EQ(run("train --resume " + dir + "/h/checkpoint-2 --steps 6 --threads 1 --save-interval 3 --keep-last 2"), 0);
  for (int s = 1; s <= 6; ++s)
    EXPECT_EQ(fs::exists(dir + "/h/checkpoint-" + std::to_string(s)), s == 3 || s == 6) << s;
  for (int s = 3; s <= 6; ++s) EXPECT_TRUE(fs::exists(dir + "/h/abandoned-1/checkpoint-" + std::to_string(s))) << s;
  // Input paths are saved absolute (a resume works from any directory).
  const auto st = nlohmann::json::parse(ds::read_file(dir + "/h/checkpoint-6/trainer_state.json"));
  for (const auto& p : st["options"]["data"]) EXPECT_TRUE(fs::path(p.get<std::string>()).is_absolute()) << p;
  ds::write_file_atomic(dir + "/c/checkpoint-8", "not a checkpoint");
  EXPECT_EQ(run("train --resume " + dir + "/c/checkpoint-6 --steps 8 --threads 1", &log), 1);
  EXPECT_NE(log.find("not a directory"), std::string::npos) << log;
  EXPECT_EQ(ds::read_file(dir + "/c/checkpoint-8"), "not a checkpoint");
  fs::remove_all(dir);
}

TEST(Train, NanGuardAndBadInputs) {
  std::string dir = tmpdir("nan");
  std::string args = small_setup(dir);
  // An absurd learning rate blows the weights up: stop exits non-zero without a checkpoint, skip carries on.
  EXPECT_NE(run("train " + args + " --steps 6 --lr 1e30 --clip 0 --warmup 0 --out " + dir + "/stop"), 0);
  EXPECT_FALSE(fs::exists(dir + "/stop/checkpoint-6"));
  EXPECT_EQ(run("train " + args + " --steps 6 --lr 1e30 --clip 0 --warmup 0 --nan-policy skip --out " + dir + "/skip"), 0);
  bool skipped = false;
  for (auto& j : metrics(dir + "/skip/metrics.jsonl")) skipped |= j.value("skipped", false);
  EXPECT_TRUE(skipped);
  // Bad input: exit code 1 (a clean ds::Error, not a crash) and a message naming the flag, field or file.
  auto expect_error = [&](const std::string& a, const std::string& needle) {
    std::string log;
    EXPECT_EQ(run(a, &log), 1) << a << "\n" << log;
    EXPECT_NE(log.find(needle), std::string::npos) << a << "\n" << log;
  };
  expect_error("train " + args + " --steps 1 --seq-len 100000 --out " + dir + "/x", "max_position_embeddings");
  expect_error("train " + args + " --steps 1 --data " + dir + "/missing.txt --out " + dir + "/x", "missing.txt");
  expect_error("train " + args + " --steps 1 --nan-policy maybe --out " + dir + "/x", "--nan-policy");
  expect_error("train " + args + " --steps 1 --micro-batch 0 --out " + dir + "/x", "--micro-batch");
  expect_error("train " + args + " --steps 1 --adam-eps -1 --out " + dir + "/x", "--adam-eps");
  expect_error("train " + args + " --steps 1 --threads 100000 --out " + dir + "/x", "--threads");
  expect_error("train --resume " + dir + "/nowhere --out " + dir + "/x", "nowhere");
  expect_error("train " + args + " --steps 1 --optimizer-state fp8 --out " + dir + "/x", "--optimizer-state");
  expect_error("train " + args + " --steps 1 --memory lots --out " + dir + "/x", "--memory");
  expect_error("train " + args + " --steps 1 --device cpu --optimizer-state bf16 --out " + dir + "/x",
               "--optimizer-state bf16 is a mode of the GPU engine");
  expect_error("train " + args + " --steps 1 --device cpu --optimizer-state 8bit --out " + dir + "/x",
               "--optimizer-state 8bit is a mode of the GPU engine");
  expect_error("train " + args + " --steps 1 --device cpu --recompute full --out " + dir + "/x",
               "--recompute full is a mode of the GPU engine");
  expect_error("train " + args + " --steps 1 --device cpu --max-memory 40 --out " + dir + "/x",
               "--max-memory 40 limits the GPU engine's memory");
  expect_error("train " + args + " --steps 1 --max-memory -1 --out " + dir + "/x", "--max-memory");
  // --resume keeps the checkpoint's options: --steps defaults to the saved total, run-defining flags are refused.
  ASSERT_EQ(run("train " + args + " --steps 2 --warmup 1 --threads 1 --save-interval 1 --out " + dir + "/r"), 0);
  expect_error("train --resume " + dir + "/r/checkpoint-1 --lr 0.5", "--lr cannot change on --resume");
  // --max-memory may be given on a resume (not saved; kResumable): here it reaches the CPU engine's refusal.
  expect_error("train --resume " + dir + "/r/checkpoint-1 --max-memory 40",
               "--max-memory 40 limits the GPU engine's memory");
  ASSERT_EQ(run("train --resume " + dir + "/r/checkpoint-1 --threads 1"), 0);  // continues runs/r to step 2
  auto m = metrics(dir + "/r/metrics.jsonl");
  EXPECT_EQ(m.back().value("step", -1), 2);
  // A checkpoint of a bf16-state (GPU) run resumed on the CPU: the error says it is the checkpoint's mode and
  // what to give; with --optimizer-state fp32 it continues.
  fs::copy(dir + "/r/checkpoint-1", dir + "/b16", fs::copy_options::recursive);
  {
    json st = json::parse(ds::read_file(dir + "/b16/trainer_state.json"));
    st["options"]["optimizer_state"] = "bf16";
    ds::write_file_atomic(dir + "/b16/trainer_state.json", st.dump());
  }
  expect_error("train --resume " + dir + "/b16 --out " + dir + "/b16r --device cpu",
               "is a checkpoint of a run with --optimizer-state bf16");
  EXPECT_FALSE(fs::exists(dir + "/b16r"));  // before --out is made
  EXPECT_EQ(run("train --resume " + dir + "/b16 --out " + dir + "/b16r --device cpu --optimizer-state fp32 --threads 1"),
            0);
  fs::remove_all(dir);
}

// Issue 25 item 17: a micro-batch past the 32-bit token indices, or a model / micro-batch the host memory cannot
// hold on the CPU engine, is refused before the data is read or any weight made, naming the flags or the config.
TEST(Train, WhatCannotFitIsRefusedUpFront) {
  std::string dir = tmpdir("fits");
  const std::string args = small_setup(dir) + " --threads 1 --steps 1";
  std::string log;
  EXPECT_EQ(run("train " + args + " --micro-batch 1000000000 --out " + dir + "/a", &log), 1) << log;
  EXPECT_NE(log.find("error: --micro-batch 1000000000 x --seq-len 32 is more than 2147483647 tokens per micro-batch"),
            std::string::npos) << log;
  EXPECT_EQ(run("train " + args + " --seq-len 4096 --micro-batch 1000000 --out " + dir + "/b", &log), 1) << log;
  EXPECT_NE(log.find("error: --micro-batch 1000000 x --seq-len 4096 is more than"), std::string::npos) << log;
  // 2^30 tokens of 16 + 2 x 32 fp32 activations in each of the 4 layers: 1.25 TiB, more than any test machine.
  EXPECT_EQ(run("train " + args + " --seq-len 1024 --micro-batch 1048576 --out " + dir + "/c", &log), 1) << log;
  EXPECT_NE(log.find("error: --micro-batch 1048576 x --seq-len 1024 (1073741824 tokens) needs at least 1280."),
            std::string::npos) << log;
  EXPECT_NE(log.find("GiB of host memory on the CPU engine"), std::string::npos) << log;
  // 65536 layers at hidden 4096: about 11 trillion parameters.
  json c = json::parse(ds::read_file(dir + "/config.json"));
  c["num_hidden_layers"] = 65536;
  c["hidden_size"] = 4096;
  c["intermediate_size"] = 12288;
  c.erase("layer_types");
  ds::write_file_atomic(dir + "/huge.json", c.dump());
  EXPECT_EQ(run("train " + args + " --model " + dir + "/huge.json --out " + dir + "/d", &log), 1) << log;
  EXPECT_NE(log.find("error: the model (" + dir + "/huge.json: "), std::string::npos) << log;
  EXPECT_NE(log.find("num_hidden_layers 65536, hidden_size 4096"), std::string::npos) << log;
  EXPECT_NE(log.find("of host memory for the CPU engine's weights, gradients and AdamW moments alone"),
            std::string::npos) << log;
  for (const char* out : {"a", "b", "c", "d"}) EXPECT_FALSE(fs::exists(dir + "/" + out + "/metrics.jsonl")) << out;
  fs::remove_all(dir);
}

// A resume from a checkpoint whose optimizer state is corrupt (a negative second moment, a NaN first moment) stops
// with an error naming the file and the tensor, before any step, and leaves the checkpoint as it was: such moments
// would turn the weights into NaN at the first update and write a checkpoint that cannot be loaded.
// A resume from checkpoint-0 (a --steps 0 run) in its own directory keeps the one step-0 evaluation line.
TEST(Train, ResumeFromStepZeroKeepsOneStepZeroEval) {
  const std::string dir = tmpdir("zero");
  const std::string args = small_setup(dir);
  ASSERT_EQ(run("train " + args + " --steps 0 --threads 1 --out " + dir + "/z"), 0);
  ASSERT_TRUE(fs::exists(dir + "/z/checkpoint-0"));
  ASSERT_EQ(run("train --resume " + dir + "/z/checkpoint-0 --steps 1 --threads 1"), 0);
  int step0 = 0;
  for (const auto& j : metrics(dir + "/z/metrics.jsonl")) step0 += j.value("step", -1) == 0 && j.contains("eval_loss");
  EXPECT_EQ(step0, 1);
  fs::remove_all(dir);
}

// An evaluation the run skipped at the step it was due (a signal goes straight to the save) is done by the resume
// from that step, even when no step is left to train; one that exists is not repeated.
TEST(Train, ResumeDoesTheEvaluationItsCheckpointSkipped) {
  const std::string dir = tmpdir("skipped_eval");
  const std::string args = small_setup(dir);
  ASSERT_EQ(run("train " + args + " --steps 4 --eval-interval 2 --threads 1 --out " + dir + "/e"), 0);
  std::string kept;
  int evals4 = 0;
  for (const auto& j : metrics(dir + "/e/metrics.jsonl")) {
    if (j.value("step", -1) == 4 && j.contains("eval_loss")) continue;  // as if the signal had skipped it
    kept += j.dump() + "\n";
  }
  ds::write_file_atomic(dir + "/e/metrics.jsonl", kept);
  ASSERT_EQ(run("train --resume " + dir + "/e/checkpoint-4 --threads 1"), 0);
  ASSERT_EQ(run("train --resume " + dir + "/e/checkpoint-4 --threads 1"), 0);  // now it has it: not again
  for (const auto& j : metrics(dir + "/e/metrics.jsonl")) evals4 += j.value("step", -1) == 4 && j.contains("eval_loss");
  EXPECT_EQ(evals4, 1);
  fs::remove_all(dir);
}

TEST(Train, ResumeRejectsCorruptOptimizerState) {
  namespace fs = std::filesystem;
  const std::string dir = ds::test::fresh_tmpdir("corrupt_opt");
  const std::string args = ds::test::small_setup(dir);
  std::string out;
  ASSERT_EQ(ds::test::run("train " + args + " --steps 2 --out " + dir + "/run", &out), 0) << out;
  const std::string ck = dir + "/run/checkpoint-2", opt = ck + "/optimizer.safetensors";
  const std::string original = ds::read_file(opt);
  // Overwrite every value of one tensor in the file image (the header gives its byte range).
  auto corrupt = [&](const std::string& tensor, float value) {
    const ds::SafetensorsReader r(opt);
    const ds::TensorInfo* t = r.find(tensor);
    ASSERT_NE(t, nullptr) << tensor;
    uint64_t header = 0;
    std::memcpy(&header, original.data(), 8);
    std::string image = original;
    for (uint64_t b = t->begin; b < t->end; b += 4) std::memcpy(image.data() + 8 + header + b, &value, 4);
    ds::write_file_atomic(opt, image);
  };
  const std::string layer = "model.layers.0.mlp.up_proj.weight";
  for (const auto& [tensor, value] : std::vector<std::pair<std::string, float>>{{"exp_avg_sq." + layer, -1.0f},
                                                                                 {"exp_avg." + layer, NAN}}) {
    corrupt(tensor, value);
    const std::string corrupted = ds::read_file(opt);
    EXPECT_EQ(ds::test::run("train --resume " + ck + " --steps 3 --keep-last 1", &out), 1) << out;
    EXPECT_NE(out.find(opt), std::string::npos) << out;
    EXPECT_NE(out.find(tensor), std::string::npos) << out;
    EXPECT_FALSE(fs::exists(dir + "/run/checkpoint-3"));
    EXPECT_EQ(ds::read_file(opt), corrupted);  // untouched
    ds::write_file_atomic(opt, original);
  }
}

// A bad DELTASTACK_<OP> value stops a run before it touches --out (an existing run's metrics.jsonl stays).
TEST(Train, BadKnobFailsBeforeTouchingOut) {
  const std::string dir = ds::test::fresh_tmpdir("bad_knob");
  const std::string args = ds::test::small_setup(dir);
  std::filesystem::create_directories(dir + "/run");
  ds::write_file_atomic(dir + "/run/metrics.jsonl", "{\"step\": 1, \"loss\": 5.0}\n");
  const char* old = std::getenv("DELTASTACK_GATED_DELTA_RULE");
  const std::string saved = old ? old : "";
  setenv("DELTASTACK_GATED_DELTA_RULE", "no-such-backend", 1);
  std::string out;
  const int rc = ds::test::run("train " + args + " --steps 2 --out " + dir + "/run", &out);
  if (old) setenv("DELTASTACK_GATED_DELTA_RULE", saved.c_str(), 1);
  else unsetenv("DELTASTACK_GATED_DELTA_RULE");
  EXPECT_EQ(rc, 1) << out;
  EXPECT_NE(out.find("DELTASTACK_GATED_DELTA_RULE=no-such-backend"), std::string::npos) << out;
  EXPECT_EQ(ds::read_file(dir + "/run/metrics.jsonl"), "{\"step\": 1, \"loss\": 5.0}\n");
}

// The GPU engine's switches (DELTASTACK_ASYNC_OPTIMIZER, DELTASTACK_DP_OVERLAP, DELTASTACK_STREAM_PRIORITY,
// DELTASTACK_ATTENTION_SPLIT: 0 or 1) are checked with the op
// knobs, whatever the device: a bad value stops the run before --out is touched (it was read only once the GPU
// engine existed, after --out was locked, and never on the CPU), and eval / generate stop on it too (with --device
// auto it made the GPU engine fail and the command fall back to the CPU).
TEST(Train, BadEngineSwitchFailsBeforeTouchingOut) {
  const std::string dir = ds::test::fresh_tmpdir("bad_engine_knob");
  const std::string args = ds::test::small_setup(dir);
  for (const char* knob : {"DELTASTACK_ASYNC_OPTIMIZER", "DELTASTACK_DP_OVERLAP", "DELTASTACK_STREAM_PRIORITY",
                           "DELTASTACK_ATTENTION_SPLIT", "DELTASTACK_WGRAD_OVERWRITE", "DELTASTACK_CUDNN_ZERO_WORKSPACE",
                           "DELTASTACK_DIVISION_SIGMOID", "DELTASTACK_EMBED_SPLIT",
                           "DELTASTACK_Q8_BINARY_SEARCH"}) {
    SCOPED_TRACE(knob);
    std::filesystem::remove_all(dir + "/run");
    std::filesystem::create_directories(dir + "/run");
    ds::write_file_atomic(dir + "/run/metrics.jsonl", "{\"step\": 1, \"loss\": 5.0}\n");
    const char* old = std::getenv(knob);
    const std::string saved = old ? old : "";
    setenv(knob, "yes", 1);
    std::string out, gen;
    const int rc = ds::test::run("train " + args + " --steps 2 --out " + dir + "/run", &out);
    const int rc_gen = ds::test::run("generate --model " + dir + "/run --prompt x", &gen);
    if (old) setenv(knob, saved.c_str(), 1);
    else unsetenv(knob);
    EXPECT_EQ(rc, 1) << out;
    EXPECT_NE(out.find(std::string(knob) + " must be 0 or 1, got \"yes\""), std::string::npos) << out;
    EXPECT_EQ(ds::read_file(dir + "/run/metrics.jsonl"), "{\"step\": 1, \"loss\": 5.0}\n");
    EXPECT_EQ(rc_gen, 1) << gen;
    EXPECT_NE(gen.find(std::string(knob) + " must be 0 or 1"), std::string::npos) << gen;
  }
  std::filesystem::remove_all(dir);
}
