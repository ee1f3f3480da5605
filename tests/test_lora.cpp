// LoRA adapters in PEFT's format (model/lora.h, docs/lora.md): the CPU engine against PEFT 0.21.2's own adapter on
// the tiny fixture in true float64 (tests/fixtures/README.md: peft_lora_tiny_a), the adapter files' checks, and
// the writer round trip.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/files.h"
#include "core/rng.h"
#include "model/forward_inputs.h"
#include "model/lora.h"
#include "model/model.h"
#include "model/safetensors.h"
#include "test_util.h"

namespace fs = std::filesystem;
using ds::test::error_of;
using ds::test::fixture;
using ds::test::rel_l2;

namespace {

std::string tmpdir(const std::string& name) {
  fs::path p = fs::temp_directory_path() / ("deltastack_test_lora_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(p);
  fs::create_directories(p);
  return p.string();
}

const std::string kAdapter = "peft_lora_tiny_a/adapter";

ds::Qwen35Model base_model() {
  ds::Qwen35Model m(ds::ModelConfig::from_file(fixture("hf_qwen35_tiny_a")));
  m.load(fixture("hf_qwen35_tiny_a"));
  return m;
}

// The fixture's inputs through m: logits [B*T*V]; with grad_scale 1 / valid targets (d mean loss).
std::vector<float> logits_of(ds::Qwen35Model& m, bool backward = false) {
  ds::SafetensorsReader in(fixture("hf_qwen35_tiny_a/inputs.safetensors"));
  ds::ForwardInputs fi = ds::read_forward_inputs(in, m.config().vocab_size);
  ds::ForwardCapture cap;
  cap.logits = true;
  const double scale = backward ? 1.0 / static_cast<double>(fi.batch.num_targets()) : 0.0;
  m.forward_backward(fi.batch, scale, 0.0, &cap);
  return cap.logits_values;
}

// A copy of the fixture's adapter in a fresh directory, its config edited by `edit`.
std::string adapter_copy(const std::string& dir, const std::function<void(nlohmann::json&)>& edit) {
  fs::remove_all(dir);
  fs::create_directories(dir);
  fs::copy_file(fixture(kAdapter + "/adapter_model.safetensors"), dir + "/adapter_model.safetensors");
  auto j = nlohmann::json::parse(ds::read_file(fixture(kAdapter + "/adapter_config.json")));
  edit(j);
  ds::write_file_atomic(dir + "/adapter_config.json", j.dump(2));
  return dir;
}

}  // namespace

// `deltastack forward --adapter` (CPU engine) against PEFT's float64 run: logits, loss and d loss / d every one of
// the 50 lora_A / lora_B tensors within rel. L2 2e-5; the gradient file holds exactly the adapter's keys.
TEST(Lora, ForwardAndGradsMatchPeftFloat64Goldens) {
  const std::string dir = tmpdir("parity");
  const std::string out = dir + "/out.safetensors", grads = dir + "/grads.safetensors";
  ASSERT_EQ(std::system((std::string(DELTASTACK_BIN) + " forward --device cpu --model " + fixture("hf_qwen35_tiny_a") +
                         " --inputs " + fixture("hf_qwen35_tiny_a/inputs.safetensors") + " --adapter " +
                         fixture(kAdapter) + " --output " + out + " --grads " + grads + " > " + dir + "/log 2>&1")
                            .c_str()),
            0)
      << ds::read_file(dir + "/log");
  ds::SafetensorsReader want_out(fixture("peft_lora_tiny_a/outputs_f64.safetensors")),
      want_grads(fixture("peft_lora_tiny_a/grads_f64.safetensors")), got_out(out), got_grads(grads);
  ASSERT_EQ(want_grads.tensors().size(), 50u);
  EXPECT_EQ(got_grads.tensors().size(), want_grads.tensors().size());
  double worst = 0;
  std::string worst_name;
  for (auto [want, got] : {std::pair{&want_out, &got_out}, std::pair{&want_grads, &got_grads}})
    for (const ds::TensorInfo& t : want->tensors()) {
      ASSERT_TRUE(got->has(t.name)) << t.name;
      EXPECT_EQ(got->find(t.name)->shape, t.shape) << t.name;
      const double e = rel_l2(got->read_f32(t.name), want->read_f64(t.name));
      EXPECT_LE(e, 2e-5) << t.name;
      if (e > worst) worst = e, worst_name = t.name;
    }
  std::printf("[ measured ] LoRA vs PEFT float64 goldens: worst rel L2 %.3e (%s)\n", worst, worst_name.c_str());
  fs::remove_all(dir);
}

// The adapter moves the logits (so the parity above is not the base model's), B = 0 (PEFT's initialisation) gives
// the base model's logits exactly, and the frozen matrices get no gradient.
TEST(Lora, ZeroLoraBIsTheBaseModelAndBaseIsFrozen) {
  ds::Qwen35Model plain = base_model();
  const std::vector<float> base = logits_of(plain);
  ds::Qwen35Model m = base_model();
  auto a = std::make_shared<ds::LoraAdapter>(ds::LoraAdapter::load(fixture(kAdapter), m.config()));
  m.set_adapter(a);
  EXPECT_GT(rel_l2(logits_of(m), base), 1e-3);
  for (const ds::LoraTensorSpec& s : a->specs())
    std::fill(a->values().begin() + s.b_offset, a->values().begin() + s.b_offset + s.out * a->config().r, 0.0f);
  m.zero_grads();
  EXPECT_EQ(logits_of(m, /*backward=*/true), base);
  double lora_a_grad = 0;
  for (const ds::LoraTensorSpec& s : a->specs())  // with B = 0 only lora_B gets a gradient
    for (int64_t e = 0; e < a->config().r * s.in; ++e) lora_a_grad += std::fabs(a->grads()[s.a_offset + e]);
  EXPECT_EQ(lora_a_grad, 0.0);
  const ds::LoraTensorSpec& s0 = a->specs().front();
  double lora_b_grad = 0;
  for (int64_t e = 0; e < s0.out * a->config().r; ++e) lora_b_grad += std::fabs(a->grads()[s0.b_offset + e]);
  EXPECT_GT(lora_b_grad, 0.0);
  const ds::ParamSpec& q = m.spec("model.layers.3.self_attn.q_proj.weight");
  for (int64_t e = 0; e < q.numel; ++e) ASSERT_EQ(m.grads()[q.offset + e], 0.0f) << "frozen q_proj got a gradient";
}

// use_rslora: scaling lora_alpha / sqrt(r). r = 4, so lora_alpha 4 with rsLoRA is the fixture's lora_alpha 8 / r.
TEST(Lora, RsLoraScaling) {
  const std::string dir = tmpdir("rslora");
  ds::Qwen35Model want = base_model(), got = base_model();
  want.set_adapter(std::make_shared<ds::LoraAdapter>(ds::LoraAdapter::load(fixture(kAdapter), want.config())));
  adapter_copy(dir + "/a", [](nlohmann::json& j) {
    j["use_rslora"] = true;
    j["lora_alpha"] = 4;
  });
  auto a = std::make_shared<ds::LoraAdapter>(ds::LoraAdapter::load(dir + "/a", got.config()));
  EXPECT_DOUBLE_EQ(a->config().scaling(), 2.0);
  got.set_adapter(a);
  EXPECT_EQ(logits_of(got), logits_of(want));
  fs::remove_all(dir);
}

// save() writes PEFT's files: loading them gives the same config and values, under either key layout; the
// multimodal layout's keys are base_model.model.model.language_model.layers.N...
TEST(Lora, SaveLoadRoundTrip) {
  const std::string dir = tmpdir("roundtrip");
  const ds::ModelConfig c = ds::ModelConfig::from_file(fixture("hf_qwen35_tiny_a"));
  const ds::LoraAdapter a = ds::LoraAdapter::load(fixture(kAdapter), c);
  EXPECT_FALSE(a.multimodal_keys());
  EXPECT_EQ(a.config().r, 4);
  EXPECT_EQ(a.config().lora_alpha, 8.0);
  EXPECT_EQ(a.config().target_modules.size(), 10u);
  EXPECT_EQ(a.specs().size(), 25u);
  for (bool mm : {false, true}) {
    ds::LoraAdapter b(c, a.config(), mm);
    b.values() = a.values();
    const std::string d = dir + (mm ? "/mm" : "/text");
    b.save(d, "tiny");
    const ds::LoraAdapter r = ds::LoraAdapter::load(d, c);
    EXPECT_EQ(r.multimodal_keys(), mm);
    EXPECT_EQ(r.values(), a.values());
    EXPECT_EQ(r.config().target_modules, a.config().target_modules);
    EXPECT_EQ(r.config().lora_alpha, 8.0);
    ds::SafetensorsReader f(d + "/adapter_model.safetensors");
    EXPECT_TRUE(f.has(mm ? "base_model.model.model.language_model.layers.0.linear_attn.in_proj_qkv.lora_A.weight"
                         : "base_model.model.model.layers.0.linear_attn.in_proj_qkv.lora_A.weight"));
    auto j = nlohmann::json::parse(ds::read_file(d + "/adapter_config.json"));
    EXPECT_EQ(j["peft_type"], "LORA");
    EXPECT_EQ(j["base_model_name_or_path"], "tiny");
  }
  fs::remove_all(dir);
}

// Every unsupported adapter_config.json field is an error naming the file and the field.
TEST(Lora, UnsupportedConfigFieldsAreClearErrors) {
  const std::string dir = tmpdir("config");
  const ds::ModelConfig c = ds::ModelConfig::from_file(fixture("hf_qwen35_tiny_a"));
  struct Case {
    const char* field;
    nlohmann::json value;
    const char* needle;
  };
  const Case cases[] = {
      {"use_dora", true, "\"use_dora\""},
      {"bias", "all", "bias"},
      {"fan_in_fan_out", true, "\"fan_in_fan_out\""},
      {"modules_to_save", {"lm_head"}, "\"modules_to_save\""},
      {"layers_to_transform", {0}, "\"layers_to_transform\""},
      {"rank_pattern", {{"q_proj", 8}}, "\"rank_pattern\""},
      {"alpha_pattern", {{"q_proj", 8}}, "\"alpha_pattern\""},
      {"some_future_feature", {{"on", true}}, "\"some_future_feature\""},
      {"peft_type", "IA3", "peft_type"},
      {"target_modules", ".*q_proj", "regular expression"},
      {"target_modules", {"q_proj", "in_proj_b"}, "in_proj_b"},
      {"r", 0, "r must be"},
      {"r", 4.0, "r must be"},
      {"r", nlohmann::json(uint64_t{18446744073709551615u}), "r must be"},  // not wrapped to a signed value
      {"r", (1 << 20) + 1, "r must be"},
      {"lora_dropout", 1.5, "lora_dropout"},
  };
  for (const Case& k : cases) {
    const std::string d = adapter_copy(dir + "/a", [&](nlohmann::json& j) { j[k.field] = k.value; });
    const std::string e = error_of([&] { ds::LoraAdapter::load(d, c); });
    EXPECT_NE(e.find(k.needle), std::string::npos) << k.field << ": " << e;
    EXPECT_NE(e.find("adapter_config.json"), std::string::npos) << k.field << ": " << e;
  }
  // A missing field, and a missing file.
  const std::string d = adapter_copy(dir + "/a", [](nlohmann::json& j) { j.erase("lora_alpha"); });
  EXPECT_NE(error_of([&] { ds::LoraAdapter::load(d, c); }).find("lora_alpha"), std::string::npos);
  EXPECT_NE(error_of([&] { ds::LoraAdapter::load(dir + "/none", c); }).find("adapter_config.json"),
            std::string::npos);
  fs::remove_all(dir);
}

// The tensor file: a missing key, a misshapen one, an extra one (a module the config does not target) and a
// non-finite value are errors naming the file and key.
TEST(Lora, BadAdapterTensorsAreClearErrors) {
  const std::string dir = tmpdir("tensors");
  const ds::ModelConfig c = ds::ModelConfig::from_file(fixture("hf_qwen35_tiny_a"));
  const ds::LoraAdapter a = ds::LoraAdapter::load(fixture(kAdapter), c);
  const std::string d = adapter_copy(dir + "/a", [](nlohmann::json&) {});
  const std::string file = d + "/adapter_model.safetensors";
  const std::string k0 = "base_model.model.model.layers.0.linear_attn.in_proj_qkv.lora_A.weight";
  auto rewrite = [&](const std::function<void(std::vector<ds::SaveTensor>&)>& edit) {
    std::vector<ds::SaveTensor> t = a.tensors(a.values());
    edit(t);
    ds::write_safetensors(file, t);
    return error_of([&] { ds::LoraAdapter::load(d, c); });
  };
  std::string e = rewrite([&](std::vector<ds::SaveTensor>& t) { t.erase(t.begin()); });
  EXPECT_NE(e.find("missing tensor \"" + k0 + "\""), std::string::npos) << e;
  e = rewrite([&](std::vector<ds::SaveTensor>& t) { t[0].shape = {2, t[0].shape[1] * 2}; });
  EXPECT_NE(e.find(k0), std::string::npos) << e;
  EXPECT_NE(e.find("shape"), std::string::npos) << e;
  const float extra[4] = {};
  e = rewrite([&](std::vector<ds::SaveTensor>& t) {
    t.push_back(ds::make_tensor_f32("base_model.model.model.layers.0.linear_attn.in_proj_b.lora_A.weight", {4, 1},
                                    extra));
  });
  EXPECT_NE(e.find("in_proj_b.lora_A.weight"), std::string::npos) << e;
  std::vector<float> bad = a.values();
  bad[static_cast<size_t>(a.specs()[0].a_offset + 3)] = NAN;
  ds::write_safetensors(file, a.tensors(bad));
  e = error_of([&] { ds::LoraAdapter::load(d, c); });
  EXPECT_NE(e.find("non-finite"), std::string::npos) << e;
  EXPECT_NE(e.find(k0), std::string::npos) << e;
  fs::remove_all(dir);
}

// Generation's paths apply the adapter too: the carried decode state, token by token, gives last_logits of the
// whole sequence (up to fp32 rounding), and both differ from the base model's.
TEST(Lora, DecodeAndLastLogitsApplyTheAdapter) {
  ds::Qwen35Model plain = base_model(), m = base_model();
  m.set_adapter(std::make_shared<ds::LoraAdapter>(ds::LoraAdapter::load(fixture(kAdapter), m.config())));
  const std::vector<int32_t> ids = {5, 17, 200, 3, 99, 42, 7};
  ds::PackedBatch b;
  b.input_ids = ids;
  b.targets.assign(ids.size(), -100);
  b.cu_seqlens = {0, static_cast<int32_t>(ids.size())};
  b.finalize("test");
  const std::vector<float> whole = m.last_logits(b);
  ds::Qwen35Model::DecodeState st;
  std::vector<float> step = m.decode(st, {ids.begin(), ids.begin() + 3});
  for (size_t t = 3; t < ids.size(); ++t) step = m.decode(st, {ids[t]});
  EXPECT_LE(rel_l2(step, whole), 1e-5);
  EXPECT_GT(rel_l2(whole, plain.last_logits(b)), 1e-3);
}

// --precision fp8 (the CPU engine's exact FP8 emulation of the base GEMMs, docs/fp8.md) applies the LoRA term too:
// with lora_B = 0 the logits are the FP8 base model's bit for bit, with the fixture's adapter they move.
TEST(Lora, Fp8BaseGemmsKeepTheLoraTerm) {
  ds::Qwen35Model plain = base_model(), m = base_model();
  plain.set_precision(ds::Precision::Fp8);
  m.set_precision(ds::Precision::Fp8);
  const std::vector<float> base = logits_of(plain);
  auto a = std::make_shared<ds::LoraAdapter>(ds::LoraAdapter::load(fixture(kAdapter), m.config()));
  m.set_adapter(a);
  EXPECT_GT(rel_l2(logits_of(m), base), 1e-3);
  for (const ds::LoraTensorSpec& s : a->specs())
    std::fill(a->values().begin() + s.b_offset, a->values().begin() + s.b_offset + s.out * a->config().r, 0.0f);
  EXPECT_EQ(logits_of(m), base);
}

// The dropout masks are one draw shared by both engines (core/rng.h dropout_drops; the GPU engine's kernel in
// ops/elementwise/dropout.cu calls the same function): the counter-indexed values are Rng's sequence, and
// dropout_mask is exactly 0 where dropout_drops says so and 1 / (1 - p) elsewhere, at the rate p.
TEST(Lora, DropoutMaskIsTheSharedCounterDraw) {
  ds::Rng rng(0x5eed, 7);
  const uint64_t key = ds::rng_stream_key(0x5eed, 7);
  for (uint64_t i = 0; i < 1000; ++i) ASSERT_EQ(rng.uniform(), ds::rng_uniform_at(key, i)) << i;
  const ds::ModelConfig c = ds::ModelConfig::from_file(fixture("hf_qwen35_tiny_a"));
  ds::LoraConfig cfg = ds::LoraAdapter::load(fixture(kAdapter), c).config();
  cfg.lora_dropout = 0.25;
  ds::LoraAdapter a(c, cfg);
  a.set_dropout_key(ds::LoraAdapter::dropout_key(99, 3));
  const size_t k = a.specs().size() - 1;
  const int64_t rows = 37, n = rows * a.specs()[k].in;
  std::vector<float> mask(static_cast<size_t>(n));
  a.dropout_mask(k, rows, mask.data());
  const uint64_t stream = a.dropout_stream(k);
  EXPECT_NE(stream, a.dropout_stream(k - 1));
  int64_t dropped = 0;
  for (int64_t e = 0; e < n; ++e) {
    const bool d = ds::dropout_drops(stream, static_cast<uint64_t>(e), 0.25);
    ASSERT_EQ(mask[static_cast<size_t>(e)], d ? 0.0f : static_cast<float>(1.0 / 0.75)) << e;
    dropped += d;
  }
  EXPECT_NEAR(static_cast<double>(dropped) / static_cast<double>(n), 0.25, 0.02);
  a.set_dropout_key(std::nullopt);
  EXPECT_NE(error_of([&] { a.dropout_stream(k); }).find("without a dropout key"), std::string::npos);
}

// lora_tensor_specs (what the GPU plan sizes the adapters with) is the adapter's own layout.
TEST(Lora, TensorSpecsWithoutValuesAreTheAdaptersLayout) {
  const ds::ModelConfig c = ds::ModelConfig::from_file(fixture("hf_qwen35_tiny_a"));
  const ds::LoraAdapter a = ds::LoraAdapter::load(fixture(kAdapter), c);
  const std::vector<ds::LoraTensorSpec> specs = ds::lora_tensor_specs(c, a.config());
  ASSERT_EQ(specs.size(), a.specs().size());
  for (size_t k = 0; k < specs.size(); ++k) {
    EXPECT_EQ(specs[k].a_offset, a.specs()[k].a_offset);
    EXPECT_EQ(specs[k].b_offset, a.specs()[k].b_offset);
    EXPECT_EQ(specs[k].in, a.specs()[k].in);
    EXPECT_EQ(specs[k].out, a.specs()[k].out);
  }
  EXPECT_EQ(ds::lora_num_values(specs, a.config().r), static_cast<int64_t>(a.values().size()));
  ds::LoraConfig none = a.config();
  none.r = 0;
  EXPECT_NE(error_of([&] { ds::lora_tensor_specs(c, none); }).find("r must be positive"), std::string::npos);
}
