// Checkpoints of the 8bit optimizer state store each GEMM weight's moments as their 8-bit codes and block scales
// (model/engine.h moment_scale_name): 1 byte per element where F32 took 4. The GPU engine writes them; the reader
// (train/checkpoint.cpp load_optimizer_state) dequantizes them exactly as the kernel decodes, by the flat offset's
// 256-element blocks, for any engine and state (a resume may switch states). Here on the CPU engine: a file of
// codes loads as their dequantized values bitwise, and a damaged one is refused naming the tensor.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/rng.h"
#include "model/engine.h"
#include "model/model.h"
#include "model/params.h"
#include "model/safetensors.h"
#include "ops/adamw/adamw.h"
#include "ops/adamw/q8_state.h"
#include "train/checkpoint.h"
#include "train_test_util.h"

namespace {

namespace fs = std::filesystem;

struct Moments {
  std::vector<ds::SaveTensor> tensors;  // the file's entries
  std::vector<float> m, v;              // what loading them must give, flat
};

// Random moments for every parameter: the matrices' as 8-bit codes + scales (U8 / F32), the rest F32.
Moments make_moments(const std::vector<ds::ParamSpec>& params, uint64_t seed) {
  Moments out;
  const ds::ParamSpec& last = params.back();
  out.m.resize(static_cast<size_t>(last.offset + last.numel));
  out.v.resize(out.m.size());
  ds::Rng rng(seed);
  for (const ds::ParamSpec& p : params) {
    std::vector<float> m(static_cast<size_t>(p.numel)), v(m.size());
    for (size_t i = 0; i < m.size(); ++i) {
      m[i] = static_cast<float>(1e-3 * rng.normal());
      v[i] = static_cast<float>(1e-6 * rng.uniform());
    }
    for (int which = 0; which < 2; ++which) {
      std::vector<float>& x = which == 0 ? m : v;
      const std::string name = (which == 0 ? "exp_avg." : "exp_avg_sq.") + p.name;
      float* dst = (which == 0 ? out.m : out.v).data() + p.offset;
      if (!ds::is_matrix(p)) {
        std::copy(x.begin(), x.end(), dst);
        out.tensors.push_back(ds::make_tensor_f32(name, p.shape, x.data()));
        continue;
      }
      const int64_t blocks = ds::ops::q8_state::num_blocks(p.offset, p.numel);
      ds::SaveTensor codes;
      codes.name = name;
      codes.dtype = ds::DType::U8;
      codes.shape = p.shape;
      codes.bytes.resize(static_cast<size_t>(p.numel));
      std::vector<float> scale(static_cast<size_t>(blocks));
      ds::ops::quantize_moment_8bit(which, x.data(), p.numel, p.offset, codes.bytes.data(), scale.data());
      ds::ops::dequantize_moment_8bit(which, codes.bytes.data(), scale.data(), p.numel, p.offset, dst);
      out.tensors.push_back(std::move(codes));
      out.tensors.push_back(ds::make_tensor_f32(ds::moment_scale_name(name), {blocks}, scale.data()));
    }
  }
  return out;
}

std::vector<float> engine_moment(ds::Engine& e, const std::string& prefix) {
  std::vector<float> out;
  for (const ds::SaveTensor& t : e.optimizer_tensors()) {
    if (t.name.rfind(prefix, 0) != 0) continue;
    int64_t n = 1;
    for (int64_t d : t.shape) n *= d;
    EXPECT_TRUE(t.f32_source) << t.name;
    out.insert(out.end(), t.f32_source, t.f32_source + n);
  }
  return out;
}

TEST(CheckpointCodes, EightBitMomentsLoadAsTheirDequantizedValues) {
  const std::string dir = ds::test::fresh_tmpdir("codes");
  ds::Qwen35Model host(ds::ModelConfig::preset("tiny"));
  host.init_weights(3);
  std::unique_ptr<ds::Engine> e = ds::make_engine("cpu", host, ds::GpuPlan::windows(1, 64, 1));
  Moments mo = make_moments(e->params(), 11);
  ASSERT_EQ(ds::moment_scale_name("exp_avg_sq.model.layers.0.mlp.down_proj.weight"),
            "exp_avg_sq_scale.model.layers.0.mlp.down_proj.weight");
  // A parameter that starts inside a 256-element block: the codes' blocks are the flat range's, not the tensor's.
  bool unaligned = false;
  for (const ds::ParamSpec& p : e->params()) unaligned |= ds::is_matrix(p) && p.offset % 256 != 0;
  EXPECT_TRUE(unaligned);
  ds::write_safetensors(dir + "/optimizer.safetensors", mo.tensors);
  ds::load_optimizer_state(*e, dir);
  // The fp32 moments of the CPU engine, in ParamSpec (= flat) order.
  EXPECT_TRUE(engine_moment(*e, "exp_avg.") == mo.m);
  EXPECT_TRUE(engine_moment(*e, "exp_avg_sq.") == mo.v);

  // Damage: each is refused, naming the file and tensor.
  auto refused = [&](const std::function<void(std::vector<ds::SaveTensor>&)>& damage, const std::string& needle) {
    Moments bad = make_moments(e->params(), 11);
    damage(bad.tensors);
    ds::write_safetensors(dir + "/optimizer.safetensors", bad.tensors);
    try {
      ds::load_optimizer_state(*e, dir);
      ADD_FAILURE() << "no error for " << needle;
    } catch (const ds::Error& err) {
      EXPECT_NE(std::string(err.what()).find(needle), std::string::npos) << err.what();
      EXPECT_NE(std::string(err.what()).find("optimizer.safetensors"), std::string::npos) << err.what();
    }
  };
  auto find = [](std::vector<ds::SaveTensor>& ts, const std::string& prefix) -> ds::SaveTensor& {
    for (ds::SaveTensor& t : ts)
      if (t.name.rfind(prefix, 0) == 0) return t;
    throw std::runtime_error("no tensor " + prefix);
  };
  std::vector<float> nan_scale;
  refused([&](std::vector<ds::SaveTensor>& ts) {
    ds::SaveTensor& s = find(ts, "exp_avg_scale.");
    nan_scale.assign(reinterpret_cast<const float*>(s.bytes.data()),
                     reinterpret_cast<const float*>(s.bytes.data()) + s.bytes.size() / 4);
    nan_scale[0] = std::nanf("");
    s = ds::make_tensor_f32(s.name, s.shape, nan_scale.data());
  }, "a block scale must be finite");
  std::vector<float> huge_scale;
  refused([&](std::vector<ds::SaveTensor>& ts) {  // sqrt(v)'s scale whose square overflows: v would be inf
    ds::SaveTensor& s = find(ts, "exp_avg_sq_scale.");
    huge_scale.assign(reinterpret_cast<const float*>(s.bytes.data()),
                      reinterpret_cast<const float*>(s.bytes.data()) + s.bytes.size() / 4);
    huge_scale[0] = 1e20f;
    s = ds::make_tensor_f32(s.name, s.shape, huge_scale.data());
  }, "its square finite too");
  refused([&](std::vector<ds::SaveTensor>& ts) {
    ds::SaveTensor& s = find(ts, "exp_avg_sq_scale.");
    s.shape = {s.shape[0] - 1};
    s.bytes.resize(s.bytes.size() - 4);
  }, "block scales, expected");
  refused([&](std::vector<ds::SaveTensor>& ts) {
    ds::SaveTensor& s = find(ts, "exp_avg_scale.");
    s.name = "unrelated_scale";  // the codes without their scales (and a tensor of no parameter)
  }, "without its block scales");
  fs::remove_all(dir);
}

// checkpoint_bytes_estimate (train/checkpoint.h), what the trainer checks the free space against before it trains,
// is the bytes the engines' checkpoint tensors take plus the slack, exactly: the fp32 state's from the CPU engine's
// own tensors; the 8bit state's moments from the file layout above (U8 codes and F32 block scales of the matrices,
// F32 for the rest) beside BF16 matrix weights. (The GPU engine's own 8bit tensors: CudaEngine.
// EightBitCheckpointStoresCodesAndResumesBitwise.) The sharded 8bit state stores its moments as F32.
TEST(CheckpointCodes, TheSizeEstimateIsWhatTheEnginesWrite) {
  ds::Qwen35Model host(ds::ModelConfig::preset("tiny"));
  host.init_weights(3);
  const ds::ModelConfig& c = host.config();
  std::unique_ptr<ds::Engine> e = ds::make_engine("cpu", host, ds::GpuPlan::windows(1, 64, 1));
  EXPECT_EQ(ds::stored_bytes(e->checkpoint_weight_tensors()) + ds::stored_bytes(e->optimizer_tensors()) +
                ds::kCheckpointSlackBytes,
            ds::checkpoint_bytes_estimate(c, "fp32"));
  int64_t weights_bf16 = 0, numel = 0, matrix = 0;
  for (const ds::ParamSpec& p : e->params()) {
    weights_bf16 += p.numel * (ds::is_matrix(p) ? 2 : 4);
    numel += p.numel;
    matrix += ds::is_matrix(p) ? p.numel : 0;
  }
  EXPECT_EQ(ds::stored_bytes(make_moments(e->params(), 1).tensors) + weights_bf16 + ds::kCheckpointSlackBytes,
            ds::checkpoint_bytes_estimate(c, "8bit"));
  EXPECT_EQ(ds::checkpoint_bytes_estimate(c, "8bit", "optimizer"),
            weights_bf16 + 8 * numel + ds::kCheckpointSlackBytes);
  EXPECT_EQ(ds::checkpoint_bytes_estimate(c, "bf16"), weights_bf16 + 8 * numel - 4 * matrix + ds::kCheckpointSlackBytes);
  // 27B in the 8bit state (the H200's /dev/shm holds it; the disk does not): about 4.03 bytes per parameter.
  const ds::ModelConfig big = ds::ModelConfig::preset("27b");
  int64_t n27 = 0;
  for (const ds::ParamSpec& p : ds::qwen35_params(big)) n27 += p.numel;
  const double per_param = static_cast<double>(ds::checkpoint_bytes_estimate(big, "8bit")) / static_cast<double>(n27);
  EXPECT_GT(per_param, 4.0);
  EXPECT_LT(per_param, 4.1);
  // docs/memory.md's figures: 101.1 GiB in all, of which the matrices' BF16 weights 50.1 and their codes and
  // scales 50.9; the 5 bytes a parameter assumed before made it 125 GiB.
  constexpr double GiB = 1073741824.0;
  int64_t matrices27 = 0, codes27 = 0;
  for (const ds::ParamSpec& p : ds::qwen35_params(big))
    if (ds::is_matrix(p)) {
      matrices27 += 2 * p.numel;
      codes27 += 2 * (p.numel + 4 * ds::ops::q8_state::num_blocks(p.offset, p.numel));
    }
  EXPECT_NEAR(static_cast<double>(ds::checkpoint_bytes_estimate(big, "8bit")) / GiB, 101.1, 0.05);
  EXPECT_NEAR(static_cast<double>(matrices27) / GiB, 50.1, 0.05);
  EXPECT_NEAR(static_cast<double>(codes27) / GiB, 50.9, 0.05);
  EXPECT_NEAR(5.0 * static_cast<double>(n27) / GiB, 125, 0.5);
}

}  // namespace
