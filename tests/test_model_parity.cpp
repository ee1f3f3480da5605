// Parity with transformers 5.17's own Qwen3.5 code (fp32, CPU): the fixture in tests/fixtures/hf_qwen35_tiny_a
// (see tests/fixtures/README.md) through the `deltastack forward` command, end to end.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <sys/wait.h>

#include <cstdlib>
#include <filesystem>
#include <set>
#include <string>

#include "core/bf16.h"
#include "core/files.h"
#include "model/model.h"
#include "model/safetensors.h"
#include "test_util.h"

namespace fs = std::filesystem;
using ds::test::fixture;
using ds::test::rel_l2;

namespace {

std::string tmpdir(const std::string& name) {
  fs::path p = fs::temp_directory_path() / ("deltastack_test_" + name + "_" + std::to_string(::getpid()));
  fs::create_directories(p);
  return p.string();
}

int run(const std::string& args) {
  std::string cmd = std::string(DELTASTACK_BIN) + " " + args + " 2>&1";
  return std::system(cmd.c_str());
}

}  // namespace

TEST(ModelParity, ForwardAndGradsMatchTransformers) {
  std::string dir = tmpdir("parity");
  std::string out = dir + "/out.safetensors", grads = dir + "/grads.safetensors";
  ASSERT_EQ(run("forward --model " + fixture("hf_qwen35_tiny_a") + " --inputs " +
                fixture("hf_qwen35_tiny_a/inputs.safetensors") + " --output " + out + " --grads " + grads),
            0);
  ds::SafetensorsReader got(out), want(fixture("hf_qwen35_tiny_a/outputs.safetensors"));
  for (const auto& t : want.tensors()) {
    SCOPED_TRACE(t.name);
    ASSERT_TRUE(got.has(t.name));
    EXPECT_EQ(got.find(t.name)->shape, t.shape);
    double e = rel_l2(got.read_f32(t.name), want.read_f32(t.name));
    EXPECT_LE(e, 1e-4) << t.name;
  }
  // Gradients. Layer 0's GDN heads decay hard (A_log ~ 2.4: g ~ -13 per token, so a chunk's cumulative gate
  // reaches ~ -800) and their gate gradients are tiny (1e-8 .. 1e-6) sums with heavy cancellation; transformers'
  // fp32 torch_chunk_gated_delta_rule loses digits there. For those three tensors the fixture is only good to
  // ~1e-2, so they are held to that band against the fixture AND to 1e-4 between our two independent GDN
  // algorithms (chunked vs token-recurrent, DELTASTACK_GATED_DELTA_RULE=reference), which agree to ~1e-5.
  // docs/parity.md has the numbers.
  ASSERT_EQ(std::system(("DELTASTACK_GATED_DELTA_RULE=reference " + std::string(DELTASTACK_BIN) + " forward --model " +
                         fixture("hf_qwen35_tiny_a") + " --inputs " + fixture("hf_qwen35_tiny_a/inputs.safetensors") +
                         " --output " + dir + "/out_ref.safetensors --grads " + dir + "/grads_ref.safetensors 2>/dev/null")
                            .c_str()),
            0);
  ds::SafetensorsReader g(grads), gref(dir + "/grads_ref.safetensors"), gw(fixture("hf_qwen35_tiny_a/grads.safetensors"));
  EXPECT_EQ(g.tensors().size(), gw.tensors().size());
  const std::set<std::string> fp32_noisy = {"model.layers.0.linear_attn.A_log", "model.layers.0.linear_attn.dt_bias",
                                            "model.layers.0.linear_attn.in_proj_a.weight"};
  for (const auto& t : gw.tensors()) {
    SCOPED_TRACE(t.name);
    ASSERT_TRUE(g.has(t.name));
    double e = rel_l2(g.read_f32(t.name), gw.read_f32(t.name));
    double self = rel_l2(g.read_f32(t.name), gref.read_f32(t.name));
    EXPECT_LE(self, 1e-4) << t.name << " chunked vs recurrent";
    EXPECT_LE(e, fp32_noisy.count(t.name) ? 1e-2 : 1e-4) << t.name;
  }
  fs::remove_all(dir);
}

TEST(ModelParity, ReleaseLayoutLoadsAsBf16OfFixture) {
  ds::Qwen35Model fp32(ds::ModelConfig::from_file(fixture("hf_qwen35_tiny_a")));
  fp32.load(fixture("hf_qwen35_tiny_a"));
  ds::ModelConfig rc = ds::ModelConfig::from_file(fixture("hf_qwen35_tiny_a_release_layout"));
  EXPECT_EQ(rc.hidden_size, 64);
  EXPECT_FALSE(rc.tie_word_embeddings);
  ds::Qwen35Model rel(rc);
  rel.load(fixture("hf_qwen35_tiny_a_release_layout"));
  ASSERT_EQ(fp32.weights().size(), rel.weights().size());
  for (const auto& p : fp32.params()) {
    bool kept_f32 = p.name.find("A_log") != std::string::npos || p.name.find("linear_attn.norm.weight") != std::string::npos;
    for (int64_t i = 0; i < p.numel; ++i) {
      float a = fp32.weights()[p.offset + i];
      float want = kept_f32 ? a : ds::round_bf16(a);
      ASSERT_EQ(rel.weights()[p.offset + i], want) << p.name << "[" << i << "]";
    }
  }
}

TEST(ModelParity, PackedEqualsSeparateDocuments) {
  // Two documents packed in one row (cu_seqlens) give the same logits as each run alone.
  ds::Qwen35Model m(ds::ModelConfig::from_file(fixture("hf_qwen35_tiny_a")));
  m.load(fixture("hf_qwen35_tiny_a"));
  auto ids = ds::test::randu<double>(150, 7, 0, 255.99);
  auto make = [&](int64_t b, int64_t e) {
    ds::PackedBatch pb;
    for (int64_t i = b; i < e; ++i) pb.input_ids.push_back(static_cast<int32_t>(ids[i]));
    pb.targets.assign(pb.input_ids.size(), -100);
    for (size_t i = 0; i + 1 < pb.input_ids.size(); ++i) pb.targets[i] = pb.input_ids[i + 1];
    pb.cu_seqlens = {0, static_cast<int32_t>(pb.input_ids.size())};
    pb.finalize();
    return pb;
  };
  ds::PackedBatch a = make(0, 70), b = make(70, 150), packed;
  packed.input_ids = a.input_ids;
  packed.input_ids.insert(packed.input_ids.end(), b.input_ids.begin(), b.input_ids.end());
  packed.targets = a.targets;
  packed.targets.insert(packed.targets.end(), b.targets.begin(), b.targets.end());
  packed.cu_seqlens = {0, 70, 150};
  packed.finalize();
  ds::ForwardCapture ca, cb, cp;
  ca.logits = cb.logits = cp.logits = true;
  auto ra = m.forward_backward(a, 0.0, 0.0, &ca);
  auto rb = m.forward_backward(b, 0.0, 0.0, &cb);
  auto rp = m.forward_backward(packed, 0.0, 0.0, &cp);
  std::vector<float> joined = ca.logits_values;
  joined.insert(joined.end(), cb.logits_values.begin(), cb.logits_values.end());
  EXPECT_LE(rel_l2(cp.logits_values, joined), 1e-6);
  EXPECT_EQ(rp.num_valid, ra.num_valid + rb.num_valid);
  EXPECT_NEAR(rp.loss_sum, ra.loss_sum + rb.loss_sum, 1e-3);
}

TEST(ModelParity, BadInputsAreClearErrors) {
  std::string dir = tmpdir("badin");
  auto expect_error = [&](const std::string& a, const std::string& needle) {
    std::string cmd = std::string(DELTASTACK_BIN) + " " + a + " > " + dir + "/log 2>&1";
    int st = std::system(cmd.c_str());
    EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 1) << a << " (a crash is not a clean error)";
    std::string log = ds::read_file(dir + "/log");
    EXPECT_NE(log.find(needle), std::string::npos) << a << "\n" << log;
  };
  int64_t ids[3] = {1, 2, 999};  // 999 is outside the fixture's vocabulary of 256
  ds::write_safetensors(dir + "/in.safetensors", {ds::make_tensor_i64("input_ids", {1, 3}, ids)});
  expect_error("forward --model " + fixture("hf_qwen35_tiny_a") + " --inputs " + dir + "/in.safetensors --output " +
                   dir + "/o.safetensors",
               "999");
  EXPECT_FALSE(fs::exists(dir + "/o.safetensors"));
  expect_error("forward --model " + dir + "/nope --inputs " + dir + "/in.safetensors --output " + dir + "/o.safetensors",
               "nope");
  // A config with fewer layers than the checkpoint's weights: refused, naming the first unused tensor.
  fs::create_directories(dir + "/short");
  auto cfg = nlohmann::json::parse(ds::read_file(fixture("hf_qwen35_tiny_a/config.json")));
  cfg["num_hidden_layers"] = 2;
  cfg["layer_types"] = {"linear_attention", "linear_attention"};
  ds::write_file_atomic(dir + "/short/config.json", cfg.dump());
  fs::copy_file(fixture("hf_qwen35_tiny_a/model.safetensors"), dir + "/short/model.safetensors");
  expect_error("inspect " + dir + "/short", "model.layers.2.");
  fs::remove_all(dir);
}

TEST(ModelParity, ShardedSaveRoundTrips) {
  // A small shard limit forces model-0000k-of-0000n.safetensors + index.json; loading them back gives the same
  // weights bitwise, and bf16 saves round to nearest even (A_log and the gated-norm weight stay fp32).
  ds::Qwen35Model m(ds::ModelConfig::from_file(fixture("hf_qwen35_tiny_a")));
  m.load(fixture("hf_qwen35_tiny_a"));
  std::string dir = tmpdir("sharded");
  m.save(dir + "/f32", ds::DType::F32, 100000);
  EXPECT_TRUE(fs::exists(dir + "/f32/model.safetensors.index.json"));
  EXPECT_FALSE(fs::exists(dir + "/f32/model.safetensors"));
  int shards = 0;
  for (auto& e : fs::directory_iterator(dir + "/f32")) shards += e.path().filename().string().rfind("model-", 0) == 0;
  EXPECT_GE(shards, 5);
  ds::Qwen35Model back(ds::ModelConfig::from_file(dir + "/f32"));
  back.load(dir + "/f32");
  EXPECT_TRUE(back.weights() == m.weights());
  m.save(dir + "/bf16", ds::DType::BF16);
  ds::Qwen35Model half(ds::ModelConfig::from_file(dir + "/bf16"));
  half.load(dir + "/bf16");
  for (const auto& p : m.params()) {
    bool f32 = p.name.find("A_log") != std::string::npos || p.name.find("linear_attn.norm.weight") != std::string::npos;
    for (int64_t i = 0; i < p.numel; i += 7) {
      float w = m.weights()[p.offset + i];
      ASSERT_EQ(half.weights()[p.offset + i], f32 ? w : ds::round_bf16(w)) << p.name;
    }
  }
  fs::remove_all(dir);
}
