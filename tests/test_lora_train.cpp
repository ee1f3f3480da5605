// LoRA training on the CPU engine (train/lora_train.h, docs/lora.md, issue 26): PEFT's initialisation, the engine's
// adapter-only AdamW step against a hand AdamW on PEFT's own float64 gradients, the gradient with dropout against
// finite differences, and through `deltastack train`: the loss falls, resume is bitwise, the base is checked by its
// fingerprint, `export` writes the adapter or the merged model, and eval / generate --adapter agree with the merge.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <signal.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "core/files.h"
#include "model/engine.h"
#include "model/forward_inputs.h"
#include "model/lora.h"
#include "model/model.h"
#include "model/safetensors.h"
#include "test_util.h"
#include "train/lora_train.h"
#include "train_test_util.h"

namespace fs = std::filesystem;
using json = nlohmann::json;
using ds::test::fixture;
using ds::test::rel_l2;
using ds::test::run;

namespace {

const std::string kBase = "hf_qwen35_tiny_a", kAdapter = "peft_lora_tiny_a/adapter";

ds::Qwen35Model fixture_base() {
  ds::Qwen35Model m(ds::ModelConfig::from_file(fixture(kBase)));
  m.load(fixture(kBase));
  return m;
}

ds::PackedBatch fixture_batch(const ds::ModelConfig& c) {
  ds::SafetensorsReader in(fixture(kBase + "/inputs.safetensors"));
  return ds::read_forward_inputs(in, c.vocab_size).batch;
}

// The fixture's base with `adapter` on the CPU engine.
std::unique_ptr<ds::Engine> fixture_engine(std::shared_ptr<ds::LoraAdapter> adapter) {
  ds::Qwen35Model m = fixture_base();
  m.set_adapter(std::move(adapter));
  return ds::make_engine("cpu", std::move(m), ds::GpuPlan{});
}

std::vector<float> floats_of(const ds::SaveTensor& t) {
  int64_t n = 1;
  for (int64_t d : t.shape) n *= d;
  return {t.f32_source, t.f32_source + n};
}

// A fresh directory with the small model of train_test_util.h as a base checkpoint (its checkpoint-0: HF weights)
// and `train` arguments on it (--model the base, no LoRA flag yet).
struct LoraSetup {
  std::string dir, base, args;
};
LoraSetup lora_setup(const std::string& tag) {
  LoraSetup s;
  s.dir = ds::test::fresh_tmpdir(tag);
  const std::string small = ds::test::small_setup(s.dir);
  EXPECT_EQ(run("train " + small + " --steps 0 --out " + s.dir + "/base"), 0);
  s.base = s.dir + "/base/checkpoint-0";
  s.args = small;
  s.args.replace(s.args.find(s.dir + "/config.json"), s.dir.size() + 12, s.base);
  return s;
}

}  // namespace

// PEFT's init: lora_A uniform in [-1/sqrt(in), 1/sqrt(in)] (kaiming-uniform, a = sqrt(5)), filling that range,
// lora_B zero; the same seed gives the same bits, another seed other values.
TEST(LoraTrain, PeftInitIsSeededKaimingUniformAndZeroB) {
  const ds::ModelConfig c = ds::ModelConfig::from_file(fixture(kBase));
  ds::LoraConfig cfg;
  cfg.r = 4;
  cfg.lora_alpha = 8;
  cfg.target_modules = ds::parse_lora_targets({"all-linear"}, "test");
  ds::LoraAdapter a(c, cfg), b(c, cfg), other(c, cfg);
  a.init_peft(7);
  b.init_peft(7);
  other.init_peft(8);
  EXPECT_EQ(a.values(), b.values());
  EXPECT_NE(a.values(), other.values());
  for (const ds::LoraTensorSpec& s : a.specs()) {
    const double bound = 1.0 / std::sqrt(static_cast<double>(s.in));
    double largest = 0, sum_sq = 0;
    const int64_t n = cfg.r * s.in;
    for (int64_t e = 0; e < n; ++e) {
      const double v = a.values()[static_cast<size_t>(s.a_offset + e)];
      largest = std::max(largest, std::fabs(v));
      sum_sq += v * v;
    }
    EXPECT_LE(largest, bound) << a.key(s, false);
    EXPECT_GT(largest, 0.9 * bound) << a.key(s, false);
    // U(-b, b) has variance b^2 / 3; n >= 256 draws: within 30%.
    EXPECT_NEAR(sum_sq / static_cast<double>(n), bound * bound / 3, 0.3 * bound * bound / 3) << a.key(s, false);
    for (int64_t e = 0; e < s.out * cfg.r; ++e) ASSERT_EQ(a.values()[static_cast<size_t>(s.b_offset + e)], 0.0f);
  }
}

// The engine's first LoRA step (grad norm, clipping, AdamW with decay on lora_A / lora_B) on PEFT's adapter equals
// AdamW by hand on PEFT's float64 gradients; the base's weights stay bitwise as loaded, the optimizer state is
// the adapter's moments under PEFT's keys, and the gradients handed out are the adapter's only.
TEST(LoraTrain, FirstStepIsHandAdamWOnPeftGradsAndTheBaseStays) {
  const ds::ModelConfig c = ds::ModelConfig::from_file(fixture(kBase));
  auto adapter = std::make_shared<ds::LoraAdapter>(ds::LoraAdapter::load(fixture(kAdapter), c));
  const std::vector<float> before = adapter->values();
  const std::vector<float> base_weights = fixture_base().weights();
  std::unique_ptr<ds::Engine> e = fixture_engine(adapter);
  const ds::PackedBatch batch = fixture_batch(c);
  e->zero_grads();
  e->forward_backward(batch, 1.0 / static_cast<double>(batch.num_targets()));
  const double gnorm = std::sqrt(e->grad_sum_squares());
  // PEFT's gradients (float64) in the adapter's flat order, and their norm.
  ds::SafetensorsReader golden(fixture("peft_lora_tiny_a/grads_f64.safetensors"));
  std::vector<double> g(before.size());
  double want_sq = 0;
  for (const ds::LoraTensorSpec& s : adapter->specs())
    for (bool b : {false, true}) {
      const std::vector<double> v = golden.read_f64(adapter->key(s, b));
      std::copy(v.begin(), v.end(), g.begin() + (b ? s.b_offset : s.a_offset));
      for (double x : v) want_sq += x * x;
    }
  EXPECT_NEAR(gnorm, std::sqrt(want_sq), 2e-5 * std::sqrt(want_sq));
  ds::ops::AdamWParams p;
  p.lr = 1e-3;
  p.beta1 = 0.9;
  p.beta2 = 0.95;
  p.eps = 1e-8;
  p.weight_decay = 0.1;
  p.step = 1;
  p.grad_scale = 0.5 * std::sqrt(want_sq) / gnorm;  // clipped to half the norm
  const std::vector<float> ours = adapter->grads();
  e->optimizer_step(p);
  // Step 1: m_hat = g, v_hat = g^2 (bias-corrected), so p' = p (1 - lr wd) - lr g / (|g| + eps), g clipped. On the
  // engine's own gradients: to fp32 rounding. On PEFT's float64 ones: where |g| >> eps (elsewhere g / (|g| + eps)
  // amplifies the gradients' fp32 rounding), within 0.1% of lr.
  auto hand = [&](size_t i, double grad) {
    const double gi = p.grad_scale * grad;
    return before[i] * (1 - p.lr * p.weight_decay) - p.lr * gi / (std::fabs(gi) + p.eps);
  };
  double worst_ours = 0, worst_peft = 0;
  size_t compared = 0;
  for (size_t i = 0; i < g.size(); ++i) {
    const double got = adapter->values()[i];
    worst_ours = std::max(worst_ours, std::fabs(got - hand(i, ours[i])) / (1e-5 * p.lr + 1e-6 * std::fabs(got)));
    if (std::fabs(p.grad_scale * g[i]) < 1e-6) continue;
    worst_peft = std::max(worst_peft, std::fabs(got - hand(i, g[i])));
    ++compared;
  }
  EXPECT_LT(worst_ours, 1.0) << "the step differs from AdamW on the engine's gradients";
  EXPECT_LT(worst_peft, 1e-3 * p.lr) << "the step differs from AdamW on PEFT's gradients";
  EXPECT_GT(compared, g.size() * 9 / 10);
  // The base: bitwise as loaded; no base gradient handed out.
  std::vector<float> now;
  for (const ds::SaveTensor& t : e->weight_tensors()) {
    const std::vector<float> v = floats_of(t);
    now.insert(now.end(), v.begin(), v.end());
  }
  ASSERT_EQ(now.size(), base_weights.size());
  EXPECT_EQ(std::memcmp(now.data(), base_weights.data(), now.size() * sizeof(float)), 0);
  // No host gradient buffer for the frozen base: a backward with an adapter leaves the model's grads() unallocated.
  ds::Qwen35Model m = fixture_base();
  m.set_adapter(std::make_shared<ds::LoraAdapter>(ds::LoraAdapter::load(fixture(kAdapter), c)));
  m.forward_backward(batch, 1.0);
  EXPECT_TRUE(m.grads().empty());
  EXPECT_FALSE(m.adapter()->grads().empty());
  const std::vector<ds::SaveTensor> grads = e->grad_tensors();
  EXPECT_EQ(grads.size(), 2 * adapter->specs().size());
  for (const ds::SaveTensor& t : grads) EXPECT_EQ(t.name.rfind("base_model.model.model.layers.", 0), 0u) << t.name;
  const std::vector<ds::SaveTensor> moments = e->optimizer_tensors();
  ASSERT_EQ(moments.size(), 4 * adapter->specs().size());
  EXPECT_EQ(moments.front().name, "exp_avg." + adapter->key(adapter->specs().front(), false));
  EXPECT_EQ(moments.back().name, "exp_avg_sq." + adapter->key(adapter->specs().back(), true));
}

// With lora_dropout the gradient is that of the loss under the micro-batch's masks (regenerated in the backward):
// d loss / d lora_A and lora_B of the first and last layers match central differences of the same masked loss, and
// differ from the gradient without dropout. The same key gives the same bits, another key other masks.
TEST(LoraTrain, DropoutGradientMatchesFiniteDifferences) {
  const ds::ModelConfig c = ds::ModelConfig::from_file(fixture(kBase));
  ds::LoraAdapter loaded = ds::LoraAdapter::load(fixture(kAdapter), c);
  ds::LoraConfig cfg = loaded.config();
  cfg.lora_dropout = 0.3;
  auto adapter = std::make_shared<ds::LoraAdapter>(c, cfg);
  adapter->values() = loaded.values();
  std::unique_ptr<ds::Engine> e = fixture_engine(adapter);
  const ds::PackedBatch batch = fixture_batch(c);
  const double scale = 1.0 / static_cast<double>(batch.num_targets());
  auto grads_with = [&](std::optional<uint64_t> key) {
    adapter->set_dropout_key(key);
    e->zero_grads();
    e->forward_backward(batch, scale);
    return adapter->grads();
  };
  const uint64_t key = ds::LoraAdapter::dropout_key(1234, 5);
  const std::vector<float> g = grads_with(key);
  EXPECT_EQ(grads_with(key), g);
  EXPECT_NE(grads_with(ds::LoraAdapter::dropout_key(1234, 6)), g);
  EXPECT_GT(rel_l2(grads_with(std::nullopt), g), 1e-2);
  // The masked mean loss (a backward, so that dropout applies; its gradients are not read).
  auto loss = [&] {
    adapter->set_dropout_key(key);
    e->zero_grads();
    return e->forward_backward(batch, scale).loss_sum * scale;
  };
  const ds::LoraTensorSpec& first = adapter->specs().front();
  const ds::LoraTensorSpec& last = adapter->specs().back();
  int checked = 0;
  for (const ds::LoraTensorSpec* s : {&first, &last})
    for (bool b : {false, true}) {
      // The entry of the tensor with the largest gradient (well above the differences' rounding).
      const int64_t off = b ? s->b_offset : s->a_offset, n = b ? s->out * cfg.r : cfg.r * s->in;
      int64_t at = off;
      for (int64_t i = off; i < off + n; ++i)
        if (std::fabs(g[static_cast<size_t>(i)]) > std::fabs(g[static_cast<size_t>(at)])) at = i;
      float& v = adapter->values()[static_cast<size_t>(at)];
      const float v0 = v, h = 1e-2f;
      v = v0 + h;
      const double up = loss();
      v = v0 - h;
      const double down = loss();
      v = v0;
      const double fd = (up - down) / (2.0 * h);
      EXPECT_NEAR(fd, g[static_cast<size_t>(at)], 2e-2 * std::fabs(g[static_cast<size_t>(at)]) + 1e-5)
          << adapter->key(*s, b) << " entry " << at - off;
      ++checked;
    }
  EXPECT_EQ(checked, 4);
}

// The release (multimodal) checkpoint layout is seen, so a new adapter takes PEFT's multimodal keys.
TEST(LoraTrain, MultimodalLayoutOfTheBase) {
  EXPECT_TRUE(ds::multimodal_layout(fixture("hf_qwen35_tiny_a_release_layout")));
  EXPECT_FALSE(ds::multimodal_layout(fixture(kBase)));
  EXPECT_FALSE(ds::multimodal_layout("tiny"));
}

// A base in the released multimodal layout (model.language_model.*): the trained adapter, its checkpoint and its
// export take PEFT's multimodal keys (base_model.model.model.language_model.layers.N...), and eval --adapter reads
// them onto that base.
TEST(LoraTrain, MultimodalBaseGivesMultimodalAdapterKeys) {
  const auto [dir, base, args] = lora_setup("lora_mm");
  const std::string mm = dir + "/mm";
  fs::create_directories(mm);
  for (const char* f : {"config.json", "tokenizer.json"}) fs::copy_file(base + "/" + f, mm + "/" + f);
  ds::Qwen35Model b(ds::ModelConfig::from_file(base));
  b.load(base);
  std::vector<ds::SaveTensor> tensors = b.to_tensors(b.weights());
  for (ds::SaveTensor& t : tensors)
    if (t.name.rfind("model.", 0) == 0) t.name = "model.language_model." + t.name.substr(6);
  ds::write_safetensors(mm + "/model.safetensors", tensors);
  std::string lora = args;
  lora.replace(lora.find(base), base.size(), mm);
  std::string log;
  ASSERT_EQ(run("train " + lora + " --lora-rank 2 --steps 1 --threads 1 --out " + dir + "/a", &log), 0) << log;
  ASSERT_EQ(run("export " + dir + "/a/checkpoint-1 " + dir + "/adapter", &log), 0) << log;
  const std::string key = "base_model.model.model.language_model.layers.0.linear_attn.in_proj_qkv.lora_A.weight";
  for (const std::string& d : {dir + "/a/checkpoint-1", dir + "/adapter"}) {
    ds::SafetensorsReader f(d + "/adapter_model.safetensors");
    EXPECT_TRUE(f.has(key)) << d;
    EXPECT_TRUE(ds::LoraAdapter::load(d, b.config()).multimodal_keys()) << d;
  }
  EXPECT_EQ(run("eval --model " + mm + " --adapter " + dir + "/adapter --data " + dir + "/corpus.txt --seq-len 32",
                &log), 0) << log;
  fs::remove_all(dir);
}

// `train --lora-rank` on a base checkpoint (the small model's checkpoint-0): the evaluation loss falls, the
// checkpoints hold the adapter (PEFT files), its moments and the base's fingerprint but no weights, a resume
// continues bitwise, --keep-last prunes them, and --adapter continues from one.
TEST(LoraTrain, TrainsResumesBitwiseAndKeepsLast) {
  const auto [dir, base, args] = lora_setup("lora_train");
  const std::string lora = args + " --lora-rank 8 --lora-alpha 16 --lora-dropout 0.1 --lr 0.05 --warmup 0 --schedule constant --threads 1";
  std::string log;
  ASSERT_EQ(run("train " + lora + " --steps 10 --save-interval 5 --out " + dir + "/a", &log), 0) << log;
  std::vector<double> evals;
  for (const json& j : ds::test::metrics(dir + "/a/metrics.jsonl"))
    if (j.contains("eval_loss")) evals.push_back(j["eval_loss"].get<double>());
  ASSERT_EQ(evals.size(), 2u);
  EXPECT_LT(evals[1], evals[0] - 0.01) << "the LoRA run did not lower the evaluation loss";
  const std::string ck = dir + "/a/checkpoint-5";
  for (const char* f : {"adapter_config.json", "adapter_model.safetensors", "optimizer.safetensors", "config.json",
                        "tokenizer.json", "trainer_state.json"})
    EXPECT_TRUE(fs::exists(ck + "/" + f)) << f;
  EXPECT_FALSE(fs::exists(ck + "/model.safetensors"));
  const json st = json::parse(ds::read_file(ck + "/trainer_state.json"));
  ds::Qwen35Model b(ds::ModelConfig::from_file(base));
  b.load(base);
  EXPECT_EQ(st["lora"]["base_fingerprint"], ds::weights_fingerprint(b.weights()));
  EXPECT_EQ(st["options"]["lora_rank"], 8);
  ds::SafetensorsReader opt(ck + "/optimizer.safetensors");
  EXPECT_TRUE(opt.has("exp_avg_sq.base_model.model.model.layers.0.linear_attn.in_proj_qkv.lora_A.weight"));
  // Resume into another directory: steps 6..10 and the final adapter and moments bitwise as the uninterrupted run.
  ASSERT_EQ(run("train --resume " + ck + " --threads 1 --out " + dir + "/b", &log), 0) << log;
  const std::vector<double> la = ds::test::train_losses(dir + "/a/metrics.jsonl"),
                            lb = ds::test::train_losses(dir + "/b/metrics.jsonl");
  ASSERT_EQ(la.size(), 10u);
  ASSERT_EQ(lb.size(), 5u);
  for (size_t i = 0; i < 5; ++i) EXPECT_EQ(la[5 + i], lb[i]) << "step " << 6 + i;
  for (const char* f : {"adapter_model.safetensors", "optimizer.safetensors"})
    EXPECT_EQ(ds::read_file(dir + "/a/checkpoint-10/" + f), ds::read_file(dir + "/b/checkpoint-10/" + f)) << f;
  // --keep-last 1 with a save every step: only the newest LoRA checkpoint stays.
  ASSERT_EQ(run("train " + lora + " --steps 3 --save-interval 1 --keep-last 1 --out " + dir + "/k", &log), 0) << log;
  EXPECT_FALSE(fs::exists(dir + "/k/checkpoint-1"));
  EXPECT_FALSE(fs::exists(dir + "/k/checkpoint-2"));
  EXPECT_TRUE(fs::exists(dir + "/k/checkpoint-3/adapter_model.safetensors"));
  // --adapter: a new run from the trained adapter starts where it ended (its step-0 evaluation is the final one).
  ASSERT_EQ(run("train " + args + " --adapter " + dir + "/a/checkpoint-10 --steps 1 --threads 1 --out " + dir + "/c",
                &log), 0) << log;
  const json first = ds::test::metrics(dir + "/c/metrics.jsonl").front();
  EXPECT_EQ(first["eval_loss"].get<double>(), evals[1]);
  fs::remove_all(dir);
}

// SIGINT mid-run of a LoRA run: the step finishes, its checkpoint (the adapter) is saved, exit 130; the resume then
// continues bitwise like a run that was never stopped (the adapter, its moments and the losses).
TEST(LoraTrain, SigintSavesTheAdapterAndResumesBitwise) {
  const auto [dir, base, args] = lora_setup("lora_sigint");
  // A constant lr (no warmup): a run of N steps is a prefix of a longer one.
  const std::string lora = args + " --lora-rank 4 --lora-dropout 0.1 --schedule constant --warmup 0 --threads 1";
  const std::string out = dir + "/o";
  const pid_t pid = ds::test::spawn("train " + lora + " --steps 100000 --out " + out, dir + "/log");
  ASSERT_TRUE(ds::test::wait_for([&] { return ds::test::last_train_step(out + "/metrics.jsonl") >= 2; }))
      << ds::read_file(dir + "/log");
  ::kill(pid, SIGINT);
  EXPECT_EQ(ds::test::wait_exit(pid), 130) << ds::read_file(dir + "/log");
  const int64_t n = ds::test::last_train_step(out + "/metrics.jsonl");
  const std::string ck = out + "/checkpoint-" + std::to_string(n);
  ASSERT_TRUE(fs::exists(ck + "/adapter_model.safetensors")) << ds::read_file(dir + "/log");
  std::string log;
  const std::string steps = " --steps " + std::to_string(n + 2);
  ASSERT_EQ(run("train --resume " + ck + steps + " --threads 1", &log), 0) << log;
  ASSERT_EQ(run("train " + lora + steps + " --out " + dir + "/ref", &log), 0) << log;
  EXPECT_EQ(ds::test::train_losses(out + "/metrics.jsonl"), ds::test::train_losses(dir + "/ref/metrics.jsonl"));
  const std::string last = "/checkpoint-" + std::to_string(n + 2) + "/";
  for (const char* f : {"adapter_model.safetensors", "optimizer.safetensors"})
    EXPECT_EQ(ds::read_file(out + last + f), ds::read_file(dir + "/ref" + last + f)) << f;
  fs::remove_all(dir);
}

// A resume whose base weights changed since (the same path, other values) stops with the fingerprints; so do an
// export --merge of its checkpoint and the checkpoint as eval / generate / forward / train --adapter on that base;
// a base that is gone is named as such, and a base made from a config.json is not needed at its path.
TEST(LoraTrain, ResumeAndMergeCheckTheBaseFingerprint) {
  const auto [dir, base, lora] = lora_setup("lora_fingerprint");
  std::string log;
  ASSERT_EQ(run("train " + lora + " --lora-rank 2 --steps 2 --save-interval 1 --threads 1 --out " + dir + "/a", &log),
            0) << log;
  ds::Qwen35Model b(ds::ModelConfig::from_file(base));
  b.load(base);
  b.weight("model.layers.0.mlp.down_proj.weight")[3] += 1e-3f;
  fs::remove(base + "/model.safetensors");
  b.save(base);
  EXPECT_EQ(run("train --resume " + dir + "/a/checkpoint-1 --threads 1 --out " + dir + "/b", &log), 1);
  EXPECT_NE(log.find("the base changed since"), std::string::npos) << log;
  EXPECT_NE(log.find("fingerprint"), std::string::npos) << log;
  EXPECT_EQ(run("export " + dir + "/a/checkpoint-2 " + dir + "/m --merge", &log), 1);
  EXPECT_NE(log.find("the base changed since"), std::string::npos) << log;
  EXPECT_FALSE(fs::exists(dir + "/m"));
  // The checkpoint as --adapter of the changed base (the same shapes): refused by eval, generate, forward and train,
  // naming both fingerprints, where it once applied silently.
  const std::string fp = json::parse(ds::read_file(dir + "/a/checkpoint-2/trainer_state.json"))["lora"]["base_fingerprint"];
  ds::write_file_atomic(dir + "/text.txt", "To be, or not to be, that is the question.");
  for (const std::string& cmd : {"eval --model " + base + " --data " + dir + "/text.txt --seq-len 16",
                                 "generate --model " + base + " --prompt To --max-new-tokens 2",
                                 "forward --model " + base + " --inputs " + fixture(kBase + "/inputs.safetensors") +
                                     " --output " + dir + "/o.safetensors",
                                 "train " + lora + " --steps 1 --out " + dir + "/c"}) {
    SCOPED_TRACE(cmd);
    EXPECT_EQ(run(cmd + " --threads 1 --adapter " + dir + "/a/checkpoint-2", &log), 1);
    EXPECT_NE(log.find("an adapter fits only the base it was trained on"), std::string::npos) << log;
    EXPECT_NE(log.find(fp), std::string::npos) << log;
  }
  EXPECT_FALSE(fs::exists(dir + "/o.safetensors"));
  // The base gone (the checkpoint holds only the adapter): both say so, naming its path.
  fs::rename(dir + "/base", dir + "/moved");
  EXPECT_EQ(run("train --resume " + dir + "/a/checkpoint-1 --threads 1 --out " + dir + "/b", &log), 1);
  EXPECT_NE(log.find("its base model " + base + " (options.model) does not exist"), std::string::npos) << log;
  EXPECT_EQ(run("export " + dir + "/a/checkpoint-2 " + dir + "/m --merge", &log), 1);
  EXPECT_NE(log.find("its base model " + base + " (options.model) does not exist"), std::string::npos) << log;
  // A base made from a config.json and the seed needs nothing at its path: with the file gone, resume and
  // export --merge rebuild it from the checkpoint's config.json (its fingerprint checked).
  std::string small = ds::test::small_setup(dir);
  fs::copy_file(dir + "/config.json", dir + "/base.json");
  small.replace(small.find(dir + "/config.json"), dir.size() + 12, dir + "/base.json");
  ASSERT_EQ(run("train " + small + " --lora-rank 2 --steps 1 --threads 1 --out " + dir + "/d", &log), 0) << log;
  fs::remove(dir + "/base.json");
  EXPECT_EQ(run("train --resume " + dir + "/d/checkpoint-1 --steps 2 --threads 1", &log), 0) << log;
  EXPECT_EQ(run("export " + dir + "/d/checkpoint-2 " + dir + "/dm --merge", &log), 0) << log;
  EXPECT_TRUE(fs::exists(dir + "/dm/model.safetensors"));
  fs::remove_all(dir);
}

// `export` of a LoRA checkpoint: the PEFT adapter directory (the checkpoint's adapter values, its tokenizer), and
// with --merge the base with the adapter merged, whose logits are the base-with-adapter's within 1e-5; eval and
// generate --adapter on the base give what the merged model gives. A full checkpoint refuses --merge; an adapter
// given as --model is an error saying to give it as --adapter; an export into a missing parent creates it.
TEST(LoraTrain, ExportAdapterAndMergedModelAgreeWithEvalAndGenerate) {
  const auto [dir, base, lora] = lora_setup("lora_export");
  std::string log;
  ASSERT_EQ(run("train " + lora + " --lora-rank 4 --lr 0.05 --steps 3 --threads 1 --out " + dir + "/a", &log), 0)
      << log;
  const std::string ck = dir + "/a/checkpoint-3";
  ASSERT_EQ(run("export " + ck + " " + dir + "/adapter", &log), 0) << log;
  ASSERT_EQ(run("export " + ck + " " + dir + "/merged --merge --dtype f32", &log), 0) << log;
  EXPECT_TRUE(fs::exists(dir + "/adapter/tokenizer.json"));
  EXPECT_FALSE(fs::exists(dir + "/adapter/model.safetensors"));
  const json cfg = json::parse(ds::read_file(dir + "/adapter/adapter_config.json"));
  EXPECT_EQ(cfg["base_model_name_or_path"], base);
  EXPECT_EQ(cfg["r"], 4);
  const ds::ModelConfig c = ds::ModelConfig::from_file(base);
  auto adapter = std::make_shared<ds::LoraAdapter>(ds::LoraAdapter::load(dir + "/adapter", c));
  EXPECT_EQ(adapter->values(), ds::LoraAdapter::load(ck, c).values());
  // Logits: the merged model against the base with the adapter (and both against the base alone).
  ds::PackedBatch batch;
  batch.input_ids = {9, 400, 151000, 77, 3, 12000, 5, 5};
  batch.targets.assign(batch.input_ids.size(), -100);
  batch.cu_seqlens = {0, 5, 8};
  batch.finalize("test");
  auto logits = [&](ds::Qwen35Model& m) {
    ds::ForwardCapture cap;
    cap.logits = true;
    m.forward_backward(batch, 0.0, 0.0, &cap);
    return cap.logits_values;
  };
  ds::Qwen35Model plain(c), with(c), merged(ds::ModelConfig::from_file(dir + "/merged"));
  plain.load(base);
  with.load(base);
  with.set_adapter(adapter);
  merged.load(dir + "/merged");
  const std::vector<float> lw = logits(with);
  EXPECT_LE(rel_l2(logits(merged), lw), 1e-5);
  EXPECT_GT(rel_l2(logits(plain), lw), 1e-4) << "the trained adapter does not change the model";
  // eval / generate with --adapter (the exported directory, or the checkpoint itself) on the base = the merged model.
  std::string e_adapter, e_merged, e_ck;
  const std::string data = " --data " + dir + "/corpus.txt --seq-len 32 --device cpu";
  ASSERT_EQ(run("eval --model " + base + " --adapter " + dir + "/adapter" + data, &e_adapter), 0) << e_adapter;
  ASSERT_EQ(run("eval --model " + dir + "/merged" + data, &e_merged), 0) << e_merged;
  ASSERT_EQ(run("eval --model " + base + " --adapter " + ck + data, &e_ck), 0) << e_ck;
  auto eval_loss = [](const std::string& out) {
    return json::parse(out.substr(out.rfind("{\"eval_loss\""))).at("eval_loss").get<double>();
  };
  EXPECT_NEAR(eval_loss(e_adapter), eval_loss(e_merged), 1e-5 * eval_loss(e_merged));
  EXPECT_EQ(eval_loss(e_adapter), eval_loss(e_ck));
  std::string g_adapter, g_merged;
  const std::string gen = " --prompt Hello --max-new-tokens 6 --temperature 0 --device cpu";
  ASSERT_EQ(run("generate --model " + base + " --adapter " + dir + "/adapter" + gen, &g_adapter), 0) << g_adapter;
  ASSERT_EQ(run("generate --model " + dir + "/merged" + gen, &g_merged), 0) << g_merged;
  EXPECT_EQ(g_adapter.substr(g_adapter.rfind("Hello")), g_merged.substr(g_merged.rfind("Hello")));
  // --merge of a full checkpoint is an error.
  EXPECT_EQ(run("export " + base + " " + dir + "/full --merge", &log), 1);
  EXPECT_NE(log.find("is not a LoRA checkpoint"), std::string::npos) << log;
  // README's `export CKPT out/adapter` into a fresh out/: the missing parent is created.
  ASSERT_EQ(run("export " + ck + " " + dir + "/out/adapter", &log), 0) << log;
  EXPECT_TRUE(ds::read_file(dir + "/out/adapter/adapter_model.safetensors") ==
              ds::read_file(dir + "/adapter/adapter_model.safetensors"));
  // The adapter given as --model (it holds no weights): the error says how to give it.
  for (const std::string& a : {dir + "/adapter", ck}) {
    EXPECT_EQ(run("generate --model " + a + gen, &log), 1);
    EXPECT_NE(log.find(a + ": holds a LoRA adapter (adapter_config.json), not a model's weights: give the base model "
                       "as --model and this directory as --adapter"), std::string::npos) << log;
  }
  fs::remove_all(dir);
}

// Contradictory or out-of-range LoRA flags are errors naming the flag, before anything is written.
TEST(LoraTrain, ContradictoryFlagsAreClearErrors) {
  const std::string dir = ds::test::fresh_tmpdir("lora_flags");
  const std::string args = ds::test::small_setup(dir) + " --steps 1 --out " + dir + "/x ";
  const std::pair<std::string, std::string> cases[] = {
      {"--lora-rank 0", "--lora-rank 0: a LoRA rank must be at least 1"},
      {"--lora-rank 4 --adapter " + fixture(kAdapter), "--lora-rank and --adapter contradict each other"},
      {"--lora-alpha 16", "--lora-alpha needs --lora-rank"},
      {"--use-rslora", "--use-rslora needs --lora-rank"},
      {"--adapter " + fixture(kAdapter) + " --lora-dropout 0.1", "--lora-dropout contradicts --adapter"},
      {"--lora-rank 4 --shard full", "--shard full: LoRA trains with --shard none"},
      {"--lora-rank 4 --shard optimizer", "--shard optimizer: LoRA trains with --shard none"},
      {"--lora-rank 4 --lora-dropout 1", "--lora-dropout must be in [0, 1)"},
      {"--lora-rank 4 --lora-targets q_proj,,v_proj", "an empty module name"},
      {"--lora-rank 4 --lora-targets q_proj,lm_head", "target module \"lm_head\" is not one deltastack adapts"},
  };
  for (const auto& [flags, needle] : cases) {
    std::string log;
    EXPECT_EQ(run("train " + args + flags, &log), 1) << flags;
    EXPECT_NE(log.find(needle), std::string::npos) << flags << ": " << log;
  }
  fs::remove_all(dir);
}

// The base's fingerprint fed in pieces (model_fingerprint: parameter by parameter, so a GPU run's deferred base is
// never whole on the host) is the whole buffer's, for any split (odd ones leave a value waiting for its pair); one
// changed bit changes it.
TEST(LoraTrain, FingerprintInPiecesIsTheWholeBuffers) {
  std::vector<float> w(1001);
  for (size_t i = 0; i < w.size(); ++i) w[i] = std::sin(0.37f * static_cast<float>(i));
  const std::string whole = ds::weights_fingerprint(w);
  for (int64_t split : {0, 1, 2, 7, 500, 1000, 1001}) {
    ds::WeightsFingerprint f(static_cast<int64_t>(w.size()));
    f.add(w.data(), split);
    f.add(w.data() + split, 3 < static_cast<int64_t>(w.size()) - split ? 3 : static_cast<int64_t>(w.size()) - split);
    const int64_t done = split + std::min<int64_t>(3, static_cast<int64_t>(w.size()) - split);
    f.add(w.data() + done, static_cast<int64_t>(w.size()) - done);
    EXPECT_EQ(f.hex(), whole) << "split " << split;
  }
  std::vector<float> v = w;
  uint32_t bits = 0;
  std::memcpy(&bits, &v[1000], 4);
  bits ^= 1;
  std::memcpy(&v[1000], &bits, 4);
  EXPECT_NE(ds::weights_fingerprint(v), whole);
  // A deferred model (what a GPU run builds) and the loaded one.
  const ds::Qwen35Model loaded = fixture_base();
  ds::Qwen35Model deferred(ds::ModelConfig::from_file(fixture(kBase)), ds::Qwen35Model::Deferred{});
  deferred.defer_load(fixture(kBase));
  EXPECT_EQ(ds::model_fingerprint(deferred), ds::weights_fingerprint(loaded.weights()));
  EXPECT_TRUE(deferred.deferred());
  EXPECT_EQ(ds::model_fingerprint(loaded), ds::weights_fingerprint(loaded.weights()));
}
