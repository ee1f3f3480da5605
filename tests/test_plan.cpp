// `deltastack plan` and plan_gpu_memory (model/gpu_plan.h): the CUDA engine's memory plan on the host, from the
// same layout function the engine allocates with. Checked against peaks measured on the H200 on 2026-12-02
// (docs/results/2026-12-02_h200_s6_call5_bench_memory.txt, bench step with the fp32 state, selective recompute and
// fp32 gradients: 2B 59.5 GiB, 0.8B 34.8 GiB at seq 8192 x micro-batch 2, chunked gated delta rule, cuDNN
// attention; the fused loss's scratch shares the op scratch's bytes since then): the plan's total must be within 5 %
// of each. Needs a CUDA build (no device).
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <filesystem>
#include <string>

#include "core/cuda/device.h"
#include "core/files.h"
#include "model/config.h"
#include "model/engine.h"
#include "model/gpu_fp8.h"
#include "model/gpu_params.h"
#include "model/gpu_plan.h"
#include "model/lora.h"
#include "model/model.h"
#include "model/params.h"
#include "test_util.h"
#include "train_test_util.h"

namespace {

constexpr double kGiB = 1073741824.0;

// LoRA rank 16, alpha 8, on every linear layer: the shape of issue 26's runs and of the peer's.
ds::LoraConfig lora_r16() {
  ds::LoraConfig l;
  l.r = 16;
  l.lora_alpha = 8;
  l.target_modules = ds::parse_lora_targets({"all-linear"}, "test");
  return l;
}

double planned_gib(const char* preset, int64_t seq, int64_t mb) {  // fp32 state, selective recompute
  return ds::plan_gpu_memory(ds::ModelConfig::preset(preset), ds::GpuPlan::windows(mb, seq, 1)).total / kGiB;
}

TEST(Plan, MatchesMeasuredPeaks) {
  if (!ds::cuda_compiled()) GTEST_SKIP() << "plan needs a CUDA build";
  EXPECT_NEAR(planned_gib("2b", 8192, 2), 59.5, 0.05 * 59.5);
  EXPECT_NEAR(planned_gib("0.8b", 8192, 2), 34.8, 0.05 * 34.8);
}

TEST(Plan, CategoriesAddUpAndScale) {
  if (!ds::cuda_compiled()) GTEST_SKIP() << "plan needs a CUDA build";
  const ds::GpuMemoryPlan p = ds::plan_gpu_memory(ds::ModelConfig::preset("2b"), ds::GpuPlan::windows(2, 8192, 1));
  size_t sum = 0;
  for (size_t b : p.by_use) sum += b;
  EXPECT_EQ(sum, p.allocation);
  EXPECT_EQ(p.total, p.allocation + ds::kCudaContextBytes);
  // fp32 master (4 B) + bf16 copy (2 B) per parameter, fp32 gradients (4 B), two fp32 moments (8 B), each within
  // the 256-byte alignment of its buffers.
  const double P = static_cast<double>(ds::ModelConfig::preset("2b").num_parameters());
  EXPECT_NEAR(p.by_use[static_cast<size_t>(ds::MemoryUse::Parameters)], 6 * P, 1e4);
  EXPECT_NEAR(p.by_use[static_cast<size_t>(ds::MemoryUse::Gradients)], 4 * P, 1e4);
  EXPECT_NEAR(p.by_use[static_cast<size_t>(ds::MemoryUse::Optimizer)], 8 * P, 1e4);
  EXPECT_EQ(p.gated_delta_rule, "cuda-chunked");
  // Activations grow with the tokens; the model's own state does not.
  const ds::GpuMemoryPlan q = ds::plan_gpu_memory(ds::ModelConfig::preset("2b"), ds::GpuPlan::windows(1, 8192, 1));
  EXPECT_EQ(q.by_use[static_cast<size_t>(ds::MemoryUse::Optimizer)], p.by_use[static_cast<size_t>(ds::MemoryUse::Optimizer)]);
  EXPECT_LT(q.by_use[static_cast<size_t>(ds::MemoryUse::Kept)], p.by_use[static_cast<size_t>(ds::MemoryUse::Kept)]);
}

// --shard optimizer on the GPU engine (model/gpu_params.h ParamShard): each of N ranks plans only its share of the
// moments; the flat buffers grow by at most the padding to N · 128 elements (N · 256 in the 8bit state).
TEST(Plan, ShardedOptimizerStateIsEachRanksShare) {
  if (!ds::cuda_compiled()) GTEST_SKIP() << "plan needs a CUDA build";
  const ds::ModelConfig c = ds::ModelConfig::preset("2b");
  const double P = static_cast<double>(c.num_parameters());
  const auto use = [](const ds::GpuMemoryPlan& p, ds::MemoryUse u) { return static_cast<double>(p.by_use[static_cast<size_t>(u)]); };
  for (const ds::OptimizerState st : {ds::OptimizerState::Fp32, ds::OptimizerState::Bf16, ds::OptimizerState::EightBit}) {
    ds::GpuPlan plan = ds::GpuPlan::windows(2, 8192, 1);
    const double align = static_cast<double>(ds::share_align(st));
    plan.optimizer_state = st;
    const ds::GpuMemoryPlan whole = ds::plan_gpu_memory(c, plan);
    for (int world : {1, 3, 8}) {
      double optimizer = 0;
      for (int r = 0; r < world; ++r) {
        plan.shard_rank = r;
        plan.shard_world = world;
        const ds::GpuMemoryPlan p = ds::plan_gpu_memory(c, plan);
        optimizer += use(p, ds::MemoryUse::Optimizer);
        EXPECT_NEAR(use(p, ds::MemoryUse::Gradients), 4 * P, 4.0 * align * world + 1e4);
        EXPECT_NEAR(use(p, ds::MemoryUse::Parameters), use(whole, ds::MemoryUse::Parameters), 6.0 * align * world + 1e4);
        // Rank r's moments: about 1/world of the whole (fp32: 8 B per element of the share; bf16: 4 B; 8bit: 2 B
        // and the scales of its blocks; plus the small parameters' fp32 moments of its range).
        EXPECT_NEAR(use(p, ds::MemoryUse::Optimizer), use(whole, ds::MemoryUse::Optimizer) / world,
                    0.02 * use(whole, ds::MemoryUse::Optimizer) / world + 1e4)
            << "rank " << r << " of " << world;
      }
      EXPECT_NEAR(optimizer, use(whole, ds::MemoryUse::Optimizer), 2e4 * world) << world << " ranks";
    }
  }
}

#ifdef DELTASTACK_CUDA
// The shares tile the flat parameters and, in the bf16 layout, the compacted master of the small parameters, in
// rank order, with equal padded shares (what NCCL's in-place reduce-scatter and all-gather need).
TEST(Plan, ShardsTileTheParameters) {
  const ds::ModelConfig c = ds::ModelConfig::preset("tiny");
  const std::vector<ds::ParamSpec> params = ds::qwen35_params(c);
  const ds::ParamLayout layout(c, params);
  const int64_t P = params.back().offset + params.back().numel;
  for (const ds::OptimizerState st : {ds::OptimizerState::Fp32, ds::OptimizerState::Bf16, ds::OptimizerState::EightBit})
    for (int world : {1, 2, 3, 7}) {
      int64_t next = 0, next32 = 0;
      const int64_t align = ds::share_align(st);  // 256 in the 8bit state: shares hold whole quantization blocks
      EXPECT_EQ(align, st == ds::OptimizerState::EightBit ? 256 : 128);
      for (int r = 0; r < world; ++r) {
        const ds::GpuParamStore s(layout, params, st, ds::ParamShard{r, world});
        EXPECT_EQ(s.padded_size() % (align * world), 0);
        EXPECT_EQ(s.share_lo() % align, 0);
        EXPECT_GE(s.padded_size(), P);
        EXPECT_LT(s.padded_size(), P + align * world);
        EXPECT_EQ(s.share_size() * world, s.padded_size());
        EXPECT_EQ(s.share_lo(), next) << "rank " << r << " of " << world;
        next = s.share_hi();
        const auto [a, b] = s.fp32_range_of(r);
        if (b > a) {
          EXPECT_EQ(a, next32) << "rank " << r << " of " << world;
          next32 = b;
        }
      }
      EXPECT_EQ(next, P);
      int64_t small = 0;
      for (const ds::ParamSpec& p : params) small += ds::is_matrix(p) ? 0 : p.numel;
      EXPECT_EQ(next32, st == ds::OptimizerState::Fp32 ? P : small);
    }
}
#endif

TEST(Plan, CommandEndsWithTheVerdictAndExitsZero) {
  if (!ds::cuda_compiled()) GTEST_SKIP() << "plan needs a CUDA build";
  std::string out;
  ASSERT_EQ(ds::test::run("plan --model 2b --seq-len 8192 --micro-batch 2 --memory fixed", &out), 0) << out;
  EXPECT_NE(out.find("optimizer state fp32 (fp32 master"), std::string::npos) << out;
  EXPECT_NE(out.find("recompute selective (norm"), std::string::npos) << out;
  EXPECT_NE(out.find("\ntotal 58."), std::string::npos) << out;
  EXPECT_NE(out.find("GiB of 140.40 GiB: fits\n"), std::string::npos) << out;
  ASSERT_EQ(ds::test::run("plan --model 9b --seq-len 8192 --micro-batch 1 --memory fixed", &out), 0) << out;
  EXPECT_NE(out.find("GiB of 140.40 GiB: does not fit\n"), std::string::npos) << out;
  ASSERT_EQ(ds::test::run("plan --model 2b --seq-len 8192 --micro-batch 2 --device-memory 40 --memory fixed", &out), 0);
  EXPECT_NE(out.find("of 40.00 GiB: does not fit"), std::string::npos) << out;
  EXPECT_EQ(ds::test::run("plan --model 2b --seq-len 0", &out), 1);
  EXPECT_NE(out.find("--seq-len"), std::string::npos) << out;
  EXPECT_EQ(ds::test::run("plan --model 2b --attention flash", &out), 1);
  EXPECT_NE(out.find("attention"), std::string::npos) << out;
  EXPECT_EQ(ds::test::run("plan --model 2b --optimizer-state fp16", &out), 1);
  EXPECT_NE(out.find("--optimizer-state must be auto, fp32, bf16 or 8bit"), std::string::npos) << out;
  ASSERT_EQ(ds::test::run("plan --model 2b --seq-len 8192 --micro-batch 2 --optimizer-state 8bit", &out), 0) << out;
  EXPECT_NE(out.find("optimizer state 8bit (bf16 GEMM weights with stochastic rounding, 8-bit blockwise moments)"),
            std::string::npos) << out;
  EXPECT_EQ(ds::test::run("plan --model 2b --recompute some", &out), 1);
  EXPECT_NE(out.find("--recompute must be"), std::string::npos) << out;
  // bench step checks the same flags before it looks for a GPU or makes the model
  EXPECT_EQ(ds::test::run("bench step --preset 9b --recompute ful", &out), 1);
  EXPECT_NE(out.find("--recompute must be"), std::string::npos) << out;
  EXPECT_EQ(ds::test::run("bench step --preset 9b --memory lots", &out), 1);
  EXPECT_NE(out.find("--memory must be"), std::string::npos) << out;
  EXPECT_EQ(ds::test::run("bench step --preset 9b --max-memory -1", &out), 1);
  EXPECT_NE(out.find("--max-memory must be GiB >= 0"), std::string::npos) << out;
}

// `plan --help` and `bench step --help` name every --recompute policy (they said "auto, none, selective or full"
// after mlp was added), from the list parse_recompute takes.
TEST(Plan, HelpNamesEveryRecomputePolicy) {
  EXPECT_EQ(ds::recompute_choices(), "auto, none, selective, mlp or full");
  for (const char* cmd : {"plan --help", "bench step --help"}) {
    std::string out;
    ASSERT_EQ(ds::test::run(cmd, &out), 0) << out;
    EXPECT_NE(out.find("auto, none, selective, mlp or full"), std::string::npos) << cmd << "\n" << out;
  }
  std::string out;
  EXPECT_EQ(ds::test::run("plan --model 2b --recompute mlpp", &out), 1);
  EXPECT_NE(out.find("--recompute must be auto, none, selective, mlp or full, got \"mlpp\""), std::string::npos) << out;
}

// `plan --hf-config`: the preset's config.json as deltastack writes it (scripts/peer_step.py --config builds the
// transformers model from it), on any build, CPU-only included.
TEST(Plan, HfConfigWritesThePresetAsTransformersLoadsIt) {
  const std::string dir = ds::test::fresh_tmpdir("plan_hf_config"), out = dir + "/2b.json";
  std::string log;
  ASSERT_EQ(ds::test::run("plan --model 2b --hf-config " + out, &log), 0) << log;
  EXPECT_NE(log.find(std::to_string(ds::ModelConfig::preset("2b").num_parameters()) + " parameters) written to " + out),
            std::string::npos)
      << log;
  const nlohmann::json j = nlohmann::json::parse(ds::read_file(out));
  EXPECT_EQ(j.at("model_type"), "qwen3_5_text");
  EXPECT_EQ(j.at("architectures"), nlohmann::json::array({"Qwen3_5ForCausalLM"}));
  EXPECT_EQ(j.at("hidden_size"), 2048);
  EXPECT_EQ(j.at("num_hidden_layers"), 24);
  EXPECT_EQ(j.at("intermediate_size"), 6144);
  EXPECT_EQ(j.at("vocab_size"), 248320);
  EXPECT_EQ(j.at("tie_word_embeddings"), true);
  EXPECT_EQ(j.at("linear_num_value_heads"), 16);
  int full = 0;
  for (const auto& t : j.at("layer_types")) full += t == "full_attention";
  EXPECT_EQ(j.at("layer_types").size(), 24u);
  EXPECT_EQ(full, 6);  // every fourth layer
  // It reads back as the same model; an existing file is replaced only with --overwrite.
  const ds::ModelConfig back = ds::ModelConfig::from_file(out), want = ds::ModelConfig::preset("2b");
  EXPECT_EQ(back.num_parameters(), want.num_parameters());
  EXPECT_EQ(back.layer_types, want.layer_types);
  EXPECT_EQ(ds::test::run("plan --model 2b --hf-config " + out, &log), 1);
  EXPECT_NE(log.find("--overwrite"), std::string::npos) << log;
  EXPECT_EQ(ds::test::run("plan --model 9b --hf-config " + out + " --overwrite", &log), 0) << log;
  EXPECT_EQ(nlohmann::json::parse(ds::read_file(out)).at("hidden_size"), 4096);
  // Never over the config it reads.
  EXPECT_EQ(ds::test::run("plan --model " + out + " --hf-config " + out + " --overwrite", &log), 1);
  // Nor over a file of a pre-tokenized dataset, --overwrite or not.
  ds::write_file_atomic(dir + "/c.txt", "Some text.\n\nMore text.\n");
  ASSERT_EQ(ds::test::run("tokenize --tokenizer " + ds::test::data_path("qwen3_tokenizer/tokenizer.json") + " --input " +
                              dir + "/c.txt --output " + dir + "/ds --format dataset", &log), 0) << log;
  const std::string index = ds::read_file(dir + "/ds/index.json");
  EXPECT_EQ(ds::test::run("plan --model 2b --hf-config " + dir + "/ds/index.json --overwrite", &log), 1);
  EXPECT_NE(log.find("would replace a file of the pre-tokenized dataset"), std::string::npos) << log;
  EXPECT_EQ(ds::read_file(dir + "/ds/index.json"), index);
  std::filesystem::remove_all(dir);
}

ds::GpuMemoryPlan plan_modes(const char* preset, int64_t seq, int64_t mb, ds::OptimizerState s, ds::Recompute r,
                             ds::Gradients g = ds::Gradients::Fp32) {
  ds::GpuPlan plan = ds::GpuPlan::windows(mb, seq, 1);
  plan.optimizer_state = s;
  plan.recompute = r;
  plan.gradients = g;
  return ds::plan_gpu_memory(ds::ModelConfig::preset(preset), plan);
}
size_t use(const ds::GpuMemoryPlan& p, ds::MemoryUse u) { return p.by_use[static_cast<size_t>(u)]; }

TEST(Plan, Bf16StateTakesTenBytesPerParameter) {
  if (!ds::cuda_compiled()) GTEST_SKIP() << "plan needs a CUDA build";
  using ds::MemoryUse;
  const ds::ModelConfig c = ds::ModelConfig::preset("2b");
  // bf16 GEMM weights (2 B) + an fp32 master of the small parameters; fp32 gradients (4 B); bf16 moments (4 B)
  // + fp32 moments of the small parameters. The small ones: norms, conv taps, A_log, dt_bias.
  double P = static_cast<double>(c.num_parameters()), small = 0;
  for (const ds::ParamSpec& p : ds::qwen35_params(c))
    if (!ds::is_matrix(p)) small += static_cast<double>(p.numel);
  EXPECT_GT(small, 0);
  EXPECT_LT(small, 1e-3 * P);
  const ds::GpuMemoryPlan b = plan_modes("2b", 8192, 2, ds::OptimizerState::Bf16, ds::Recompute::Selective);
  const ds::GpuMemoryPlan f = plan_modes("2b", 8192, 2, ds::OptimizerState::Fp32, ds::Recompute::Selective);
  const double slack = 256.0 * 1000;  // per-buffer alignment
  EXPECT_NEAR(use(b, MemoryUse::Parameters), 2 * P + 4 * small, slack);
  EXPECT_NEAR(use(b, MemoryUse::Gradients), 4 * P, slack);
  EXPECT_NEAR(use(b, MemoryUse::Optimizer), 4 * P + 8 * small, slack);
  // the activations do not depend on the state (but for where the 256-byte alignment falls)
  EXPECT_NEAR(use(b, MemoryUse::Kept), use(f, MemoryUse::Kept), 256.0 * 200);
  EXPECT_NEAR(static_cast<double>(f.total - b.total), 8 * P - 12 * small, slack);
}

// --gradients bf16: the flat gradient buffer in bf16 (2 bytes per parameter) beside the in-backward mode's fp32 unit
// slots; never a candidate of --gradients auto (lossy: opt-in), and when given, the (state, recompute) pairs in
// the usual order with it; `plan` names it.
TEST(Plan, Bf16GradientsTakeTwoBytesPerParameterAndAreOptIn) {
  if (!ds::cuda_compiled()) GTEST_SKIP() << "plan needs a CUDA build";
  using ds::Gradients;
  using ds::MemoryUse;
  using ds::OptimizerState;
  using ds::Recompute;
  using M = ds::MemoryModes;
  const double P = static_cast<double>(ds::ModelConfig::preset("2b").num_parameters());
  auto grads = [&](Gradients g) {
    return static_cast<double>(use(plan_modes("2b", 8192, 2, OptimizerState::Bf16, Recompute::Selective, g),
                                   MemoryUse::Gradients));
  };
  EXPECT_NEAR(grads(Gradients::Bf16) - grads(Gradients::InBackward), 2 * P, 256.0);
  EXPECT_NEAR(grads(Gradients::Fp32), 4 * P, 256.0);
  // Less than the fp32 buffer, but at 2B not by half: the embedding's fp32 slot is a quarter of the parameters.
  EXPECT_LT(grads(Gradients::Bf16), 0.85 * grads(Gradients::Fp32));
  for (const bool norm_pass : {true, false})
    for (const M& m : ds::memory_candidates(OptimizerState::Auto, Recompute::Auto, Gradients::Auto, norm_pass))
      EXPECT_NE(m.gradients, Gradients::Bf16);
  const auto all = ds::memory_candidates(OptimizerState::Auto, Recompute::Auto);
  const auto given = ds::memory_candidates(OptimizerState::Auto, Recompute::Auto, Gradients::Bf16);
  ASSERT_EQ(given.size(), all.size());
  for (size_t k = 0; k < all.size(); ++k) EXPECT_EQ(given[k], (M{all[k].state, all[k].recompute, Gradients::Bf16}));
  std::string out;
  ASSERT_EQ(ds::test::run("plan --model 2b --gradients bf16", &out), 0) << out;
  EXPECT_NE(out.find("gradients: bf16 (one buffer of every parameter, 2 bytes each"), std::string::npos) << out;
}

// The 8bit state: the bf16 state's weights and gradients, and 1-byte codes of m and sqrt(v) per parameter plus one
// fp32 scale each per block (256 flat elements cut at parameter ends): about 8 bytes per parameter.
TEST(Plan, EightBitStateTakesEightBytesPerParameter) {
  if (!ds::cuda_compiled()) GTEST_SKIP() << "plan needs a CUDA build";
  using ds::MemoryUse;
  const ds::ModelConfig c = ds::ModelConfig::preset("2b");
  double P = static_cast<double>(c.num_parameters()), small = 0, blocks = 0;
  for (const ds::ParamSpec& p : ds::qwen35_params(c)) {
    if (!ds::is_matrix(p)) small += static_cast<double>(p.numel);
    else blocks += static_cast<double>((p.offset + p.numel + 255) / 256 - p.offset / 256);
  }
  EXPECT_NEAR(blocks, P / 256, 0.01 * P / 256);
  const ds::GpuMemoryPlan q = plan_modes("2b", 8192, 2, ds::OptimizerState::EightBit, ds::Recompute::Selective);
  const ds::GpuMemoryPlan b = plan_modes("2b", 8192, 2, ds::OptimizerState::Bf16, ds::Recompute::Selective);
  const double slack = 256.0 * 10;  // per-buffer alignment
  EXPECT_NEAR(use(q, MemoryUse::Parameters), use(b, MemoryUse::Parameters), slack);
  EXPECT_NEAR(use(q, MemoryUse::Gradients), use(b, MemoryUse::Gradients), slack);
  EXPECT_NEAR(use(q, MemoryUse::Optimizer), 2 * P + 8 * blocks + 8 * small, slack);
  EXPECT_NEAR(static_cast<double>(use(q, MemoryUse::Parameters) + use(q, MemoryUse::Gradients) +
                                  use(q, MemoryUse::Optimizer)) / P, 8.03, 0.01);
  EXPECT_NEAR(static_cast<double>(b.total - q.total), 2 * P - 8 * blocks, 256.0 * 1000);
}

TEST(Plan, RecomputePoliciesOrderTheActivationMemory) {
  if (!ds::cuda_compiled()) GTEST_SKIP() << "plan needs a CUDA build";
  using ds::MemoryUse;
  using ds::Recompute;
  const auto S = ds::OptimizerState::Fp32;
  const ds::GpuMemoryPlan none = plan_modes("2b", 8192, 2, S, Recompute::None),
                          sel = plan_modes("2b", 8192, 2, S, Recompute::Selective),
                          full = plan_modes("2b", 8192, 2, S, Recompute::Full);
  const ds::ModelConfig c = ds::ModelConfig::preset("2b");
  const double N = 16384, L = static_cast<double>(c.num_hidden_layers), H = static_cast<double>(c.hidden_size);
  // full keeps the residual stream per layer (L + 1 windows of N x H bf16) plus one layer's set per mixer kind.
  EXPECT_LT(use(full, MemoryUse::Kept), use(sel, MemoryUse::Kept) / 5);
  EXPECT_GT(use(full, MemoryUse::Kept), (L + 1) * N * H * 2);
  EXPECT_LT(use(full, MemoryUse::GdnSaved), use(sel, MemoryUse::GdnSaved) / 10);  // one GDN layer's instead of 18
  // none keeps per layer what selective rebuilds: at least xn1, xn2 and the SwiGLU output of every layer more.
  const double I = static_cast<double>(c.intermediate_size);
  EXPECT_GT(static_cast<double>(use(none, MemoryUse::Kept)) - use(sel, MemoryUse::Kept), L * N * (2 * H + I) * 2 * 0.99);
  EXPECT_LT(use(none, MemoryUse::Recomputed), use(sel, MemoryUse::Recomputed));
  EXPECT_EQ(use(none, MemoryUse::Optimizer), use(full, MemoryUse::Optimizer));
}

TEST(Plan, AutoPicksExactModesBeforeLossyAndCheapRecomputeBeforeFull) {
  if (!ds::cuda_compiled()) GTEST_SKIP() << "plan needs a CUDA build";
  using ds::OptimizerState;
  using ds::Recompute;
  using ds::Gradients;
  using M = ds::MemoryModes;
  const auto all = ds::memory_candidates(OptimizerState::Auto, Recompute::Auto);
  ASSERT_EQ(all.size(), 12u);
  EXPECT_EQ(all.front(), (M{OptimizerState::Fp32, Recompute::None, Gradients::Fp32}));
  EXPECT_EQ(all[1], (M{OptimizerState::Fp32, Recompute::Selective, Gradients::Fp32}));  // exact before lossy
  EXPECT_EQ(all[2], (M{OptimizerState::Fp32, Recompute::Mlp, Gradients::Fp32}));  // + the gate|up GEMM (~4 %)
  EXPECT_EQ(all[3], (M{OptimizerState::Bf16, Recompute::None, Gradients::Fp32}));
  EXPECT_EQ(all[6], (M{OptimizerState::EightBit, Recompute::None, Gradients::Fp32}));  // 8-bit moments after bf16 ones
  EXPECT_EQ(all[7], (M{OptimizerState::EightBit, Recompute::Selective, Gradients::Fp32}));
  EXPECT_EQ(all[8], (M{OptimizerState::EightBit, Recompute::Mlp, Gradients::Fp32}));
  EXPECT_EQ(all[9], (M{OptimizerState::Fp32, Recompute::Full, Gradients::Fp32}));
  EXPECT_EQ(all.back(), (M{OptimizerState::EightBit, Recompute::Full, Gradients::Fp32}));
  EXPECT_EQ(ds::memory_candidates(OptimizerState::Fp32, Recompute::Auto).size(), 4u);  // a given mode is kept
  EXPECT_EQ(ds::memory_candidates(OptimizerState::Bf16, Recompute::Full).size(), 1u);
  EXPECT_EQ(ds::memory_candidates(OptimizerState::EightBit, Recompute::Auto).size(), 4u);
  // --gradients auto: with a norm pass (+85 % per step) the in-backward gradients after everything else; without
  // one (the same speed, the same step) right after the fp32 buffer at each state and recompute.
  const auto with_pass = ds::memory_candidates(OptimizerState::Auto, Recompute::Auto, Gradients::Auto, true);
  ASSERT_EQ(with_pass.size(), 24u);
  for (size_t k = 0; k < 12; ++k) {
    EXPECT_EQ(with_pass[k], all[k]);
    EXPECT_EQ(with_pass[12 + k], (M{all[k].state, all[k].recompute, Gradients::InBackward}));
  }
  const auto no_pass = ds::memory_candidates(OptimizerState::Auto, Recompute::Auto, Gradients::Auto, false);
  ASSERT_EQ(no_pass.size(), 24u);
  for (size_t k = 0; k < 12; ++k) {
    EXPECT_EQ(no_pass[2 * k], all[k]);
    EXPECT_EQ(no_pass[2 * k + 1], (M{all[k].state, all[k].recompute, Gradients::InBackward}));
  }
  EXPECT_EQ(ds::memory_candidates(OptimizerState::EightBit, Recompute::Full, Gradients::InBackward).size(), 1u);
  const ds::ModelConfig c = ds::ModelConfig::preset("2b");
  auto pick = [&](double gib) {
    ds::GpuPlan plan = ds::GpuPlan::windows(2, 8192, 1);
    plan.optimizer_state = OptimizerState::Auto;
    plan.recompute = Recompute::Auto;
    const ds::GpuPlan r = ds::resolve_memory_modes(c, plan, [&](const ds::GpuMemoryPlan& p) { return p.total <= gib * kGiB; });
    EXPECT_EQ(r.gradients, Gradients::Fp32);  // not Auto here: the buffer stays
    return std::make_pair(r.optimizer_state, r.recompute);
  };
  EXPECT_EQ(pick(140), std::make_pair(OptimizerState::Fp32, Recompute::None));
  EXPECT_EQ(pick(64), std::make_pair(OptimizerState::Fp32, Recompute::Selective));  // 59.5 GiB; fp32 + none 73.5
  EXPECT_EQ(pick(50), std::make_pair(OptimizerState::Fp32, Recompute::Mlp));  // 49.75 GiB; bf16 + none 58.3
  EXPECT_EQ(pick(45), std::make_pair(OptimizerState::Bf16, Recompute::Selective));  // 44.4 GiB; fp32 + mlp 49.75
  EXPECT_EQ(pick(36), std::make_pair(OptimizerState::Bf16, Recompute::Mlp));  // 35.7 GiB; 8bit + selective 40.9
  EXPECT_EQ(pick(30), std::make_pair(OptimizerState::Bf16, Recompute::Full));    // 25.9 GiB; fp32 + full 39.9
  EXPECT_EQ(pick(1), std::make_pair(OptimizerState::EightBit, Recompute::Full));  // nothing fits: the leanest
  // With --gradients auto, what fits nowhere else fits with the gradients in the backward: 27B on an H200 (the
  // 8bit state, full recompute, in-backward: 125 GiB measured), and at 2B the slots win over full recompute only
  // without a norm pass.
  auto pick3 = [&](const ds::ModelConfig& m, int64_t mb, double gib, bool norm_pass) {
    ds::GpuPlan plan = ds::GpuPlan::windows(mb, 8192, 1);
    plan.optimizer_state = OptimizerState::Auto;
    plan.recompute = Recompute::Auto;
    plan.gradients = Gradients::Auto;
    plan.norm_pass = norm_pass;
    const ds::GpuPlan r = ds::resolve_memory_modes(m, plan, [&](const ds::GpuMemoryPlan& p) { return p.total <= gib * kGiB; });
    return M{r.optimizer_state, r.recompute, r.gradients};
  };
  EXPECT_EQ(pick3(ds::ModelConfig::preset("27b"), 1, 140.4, true),
            (M{OptimizerState::EightBit, Recompute::Full, Gradients::InBackward}));
  EXPECT_EQ(pick3(c, 2, 140, true), (M{OptimizerState::Fp32, Recompute::None, Gradients::Fp32}));
  EXPECT_EQ(pick3(c, 2, 42, true), (M{OptimizerState::Bf16, Recompute::Mlp, Gradients::Fp32}));  // 35.7 GiB
  EXPECT_EQ(pick3(c, 2, 42, false), (M{OptimizerState::Bf16, Recompute::Selective, Gradients::InBackward}));  // 39.7
  std::string out;
  ASSERT_EQ(ds::test::run("plan --model 27b --seq-len 8192 --micro-batch 1", &out), 0) << out;
  EXPECT_NE(out.find("gradients: in-backward (each unit updated in the backward; fp32 slots of the embedding, head and "
                     "three layers; with --clip a norm-only pass first"), std::string::npos) << out;
  EXPECT_NE(out.find("chosen by --memory auto"), std::string::npos) << out;
  EXPECT_NE(out.find("GiB of 140.40 GiB: fits\n"), std::string::npos) << out;
  // the 9B shape of the issue fits an H200 only with the bf16 state
  ASSERT_EQ(ds::test::run("plan --model 9b --seq-len 8192 --micro-batch 1", &out), 0) << out;
  EXPECT_NE(out.find("optimizer state bf16"), std::string::npos) << out;
  EXPECT_NE(out.find("GiB of 140.40 GiB: fits\n"), std::string::npos) << out;
}

// eval's engine (GpuPlan::forward_windows) leaves the modes to the device: a 9B checkpoint that trained on an H200
// (bf16 state) is evaluated there too, not refused for the fp32 state's 200 GiB and sent to the CPU.
TEST(Plan, EvalLeavesTheModesToTheDevice) {
  if (!ds::cuda_compiled()) GTEST_SKIP() << "plan needs a CUDA build";
  const ds::GpuPlan plan = ds::GpuPlan::forward_windows(1, 8192, 1);
  EXPECT_EQ(plan.optimizer_state, ds::OptimizerState::Auto);
  EXPECT_EQ(plan.recompute, ds::Recompute::Auto);
  EXPECT_EQ(plan.max_tokens, ds::GpuPlan::windows(1, 8192, 1).max_tokens);
  const ds::ModelConfig c = ds::ModelConfig::preset("9b");
  const auto fits = [](const ds::GpuMemoryPlan& p) { return p.allocation + (512u << 20) < 139.0 * kGiB; };
  const ds::GpuPlan r = ds::resolve_memory_modes(c, plan, fits);
  EXPECT_TRUE(fits(ds::plan_gpu_memory(c, r)));
  ds::GpuPlan fixed = ds::GpuPlan::windows(1, 8192, 1);  // what eval asked for before
  EXPECT_FALSE(fits(ds::plan_gpu_memory(c, fixed)));
}

}  // namespace

// A LoRA plan (GpuPlan::lora; model/gpu_lora.h): the base frozen in the bf16 layout (2 B per parameter + an fp32
// master of the small ones), no base gradient (only a scratch of one unit's small parameters) and no base optimizer
// state; the adapters' fp32 master + bf16 copy (6 B), gradients (4 B) and two moments (8 B) per adapter value. The
// optimizer-state and gradient flags do not apply (resolved), in-backward and --shard optimizer are errors, and
// `plan --lora-rank` prints it.
// Recompute by layer (GpuPlan::kept_layers): the first k layers of selective or mlp keep what those policies rebuild,
// so the bytes grow with k from the policy's to none's; `auto` takes the most layers that fit (none's speed for
// them), and a policy the user gave keeps every layer rebuilding. The shape is issue 26's: 9B LoRA, FP8 base, seq
// 8192, within a budget halfway between selective's plan and none's (with the base stored in FP8 both fit the
// 64.9 GiB transformers + PEFT took: none 60.6 GiB).
TEST(Plan, AutoKeepsTheMostLayersThatFit) {
  if (!ds::cuda_compiled()) GTEST_SKIP() << "plan needs a CUDA build";
  const ds::ModelConfig c = ds::ModelConfig::preset("9b");
  const int64_t L = c.num_hidden_layers;
  ds::GpuPlan plan = ds::GpuPlan::windows(1, 8192, 1);
  plan.precision = ds::Precision::Fp8;
  plan.lora = lora_r16();
  auto total = [&](ds::Recompute r, int64_t kept) {
    ds::GpuPlan p = plan;
    p.recompute = r;
    p.kept_layers = kept;
    return ds::plan_gpu_memory(c, p).total;
  };
  for (ds::Recompute r : {ds::Recompute::Selective, ds::Recompute::Mlp, ds::Recompute::Full}) {
    size_t last = total(r, 0);
    for (int64_t k : {int64_t{1}, L / 2, L - 1}) {
      EXPECT_GT(total(r, k), last) << ds::recompute_name(r) << " " << k;
      last = total(r, k);
    }
    EXPECT_EQ(total(r, L), total(ds::Recompute::None, 0)) << "every layer kept is none's layout";
  }
  const double budget = (static_cast<double>(total(ds::Recompute::Selective, 0)) +
                         static_cast<double>(total(ds::Recompute::None, 0))) / 2;
  auto fits = [&](const ds::GpuMemoryPlan& p) { return static_cast<double>(p.total) <= budget; };
  plan.recompute = ds::Recompute::Auto;
  const ds::GpuPlan r = ds::resolve_memory_modes(c, plan, fits);
  EXPECT_EQ(r.recompute, ds::Recompute::Selective);
  EXPECT_GT(r.kept_layers, 0);
  EXPECT_LT(r.kept_layers, L);
  EXPECT_LE(static_cast<double>(total(ds::Recompute::Selective, r.kept_layers)), budget);
  EXPECT_GT(static_cast<double>(total(ds::Recompute::Selective, r.kept_layers + 1)), budget);
  EXPECT_EQ(ds::recompute_label(r, L), fmt::format("selective, the first {} of {} layers keeping their activations",
                                                   r.kept_layers, L));
  plan.recompute = ds::Recompute::Selective;  // given: every layer rebuilds
  EXPECT_EQ(ds::resolve_memory_modes(c, plan, fits).kept_layers, 0);
  EXPECT_EQ(ds::recompute_label(plan, L), "selective");
  plan.recompute = ds::Recompute::Auto;  // room for none: none, nothing kept by layer
  const ds::GpuPlan roomy = ds::resolve_memory_modes(c, plan, [](const ds::GpuMemoryPlan&) { return true; });
  EXPECT_EQ(roomy.recompute, ds::Recompute::None);
  EXPECT_EQ(roomy.kept_layers, 0);
  // Between mlp and full: full, with its first layers either keeping all of their activations or rebuilding only
  // mlp's (GpuPlan::mlp_layers), whichever saves more of the forward: in the bytes of L / 4 kept layers, more than
  // twice as many mlp layers fit, each saving all of its forward but the gate|up GEMM (under half of it here).
  const double tight = static_cast<double>(total(ds::Recompute::Full, L / 4));
  auto fits_tight = [&](const ds::GpuMemoryPlan& p) { return static_cast<double>(p.total) <= tight; };
  ASSERT_GT(static_cast<double>(total(ds::Recompute::Mlp, 0)), tight);
  const ds::GpuPlan f = ds::resolve_memory_modes(c, plan, fits_tight);
  EXPECT_EQ(f.recompute, ds::Recompute::Full);
  EXPECT_EQ(f.kept_layers, 0);
  EXPECT_GT(f.mlp_layers, 2 * (L / 4));
  EXPECT_LE(static_cast<double>(ds::plan_gpu_memory(c, f).total), tight);
  EXPECT_EQ(ds::recompute_label(f, L), fmt::format("full, the first {} of {} rebuilding only mlp's activations",
                                                   f.mlp_layers, L));
}

// Recompute mlp with layers keeping their gate|up output (GpuPlan::selective_layers): between mlp's plan and
// selective's, `auto` takes mlp with the most such layers that fit and no kept layer (a layer's gate|up saves its
// GEMM, more time per byte than a kept layer's copies of the rest); the bytes grow by one gate|up (N x 2I bf16) a
// layer, and all L of them are selective's layout. The shape is issue 24's 2B goal: fp8, 8-bit state, in-backward
// gradients, seq 8192 x 2.
TEST(Plan, AutoKeepsGateUpOutputsBeforeLayers) {
  if (!ds::cuda_compiled()) GTEST_SKIP() << "plan needs a CUDA build";
  const ds::ModelConfig c = ds::ModelConfig::preset("2b");
  const int64_t L = c.num_hidden_layers;
  ds::GpuPlan plan = ds::GpuPlan::windows(2, 8192, 1);
  plan.precision = ds::Precision::Fp8;
  plan.optimizer_state = ds::OptimizerState::EightBit;
  plan.gradients = ds::Gradients::InBackward;
  plan.layer_slots = 2;  // (the slots' own choice: Plan.InBackwardTakesAThirdLayerSlotWhereTheModesStay)
  auto total = [&](ds::Recompute r, int64_t sel, int64_t kept = 0) {
    ds::GpuPlan p = plan;
    p.recompute = r;
    p.selective_layers = sel;
    p.kept_layers = kept;
    return ds::plan_gpu_memory(c, p).total;
  };
  const size_t gate_up = static_cast<size_t>(plan.max_tokens * 2 * c.intermediate_size) * 2;
  EXPECT_EQ(total(ds::Recompute::Mlp, 1), total(ds::Recompute::Mlp, 0) + gate_up);
  EXPECT_EQ(total(ds::Recompute::Mlp, L / 2), total(ds::Recompute::Mlp, 0) + static_cast<size_t>(L / 2) * gate_up);
  EXPECT_EQ(total(ds::Recompute::Mlp, L), total(ds::Recompute::Selective, 0)) << "every layer's gate|up kept";
  EXPECT_LT(total(ds::Recompute::Mlp, 1), total(ds::Recompute::Mlp, 0, 1)) << "a kept layer takes more";
  const double budget = (static_cast<double>(total(ds::Recompute::Mlp, 0)) +
                         static_cast<double>(total(ds::Recompute::Selective, 0))) / 2;
  auto fits = [&](const ds::GpuMemoryPlan& p) { return static_cast<double>(p.total) <= budget; };
  plan.recompute = ds::Recompute::Auto;
  const ds::GpuPlan r = ds::resolve_memory_modes(c, plan, fits);
  EXPECT_EQ(r.recompute, ds::Recompute::Mlp);
  EXPECT_EQ(r.kept_layers, 0);
  EXPECT_GT(r.selective_layers, 0);
  EXPECT_LT(r.selective_layers, L);
  EXPECT_LE(static_cast<double>(total(ds::Recompute::Mlp, r.selective_layers)), budget);
  EXPECT_GT(static_cast<double>(total(ds::Recompute::Mlp, r.selective_layers + 1)), budget);
  EXPECT_EQ(ds::recompute_label(r, L), fmt::format("mlp, the first {} of {} keeping their gate|up output",
                                                   r.selective_layers, L));
  plan.recompute = ds::Recompute::Mlp;  // given: every layer rebuilds its gate|up
  EXPECT_EQ(ds::resolve_memory_modes(c, plan, fits).selective_layers, 0);
  ds::GpuPlan both = r;
  both.kept_layers = 2;
  EXPECT_EQ(ds::recompute_label(both, L),
            fmt::format("mlp, the first 2 of {} layers keeping their activations, the next {} of {} keeping their "
                        "gate|up output", L, r.selective_layers, L));
}

// DELTASTACK_ATTENTION_SPLIT=1 (model/engine.h): cuDNN's attention backward once per key/value head. The plan's
// estimate of cuDNN's workspace, bf16 dP of Hq x S^2 plus an eighth, shrinks to one head group's Hq / Hkv heads. At
// 27B, seq 16384 x 1, it is the largest scratch either way (3.4 GiB split, above the fused loss's 1.9).
TEST(Plan, AttentionSplitDividesTheWorkspaceByTheKeyValueHeads) {
  if (!ds::cuda_compiled()) GTEST_SKIP() << "plan needs a CUDA build";
  const ds::ModelConfig c = ds::ModelConfig::preset("27b");
  ds::GpuPlan plan = ds::GpuPlan::windows(1, 16384, 1);
  plan.recompute = ds::Recompute::Full;
  const auto workspace = [&] { return static_cast<double>(use(ds::plan_gpu_memory(c, plan), ds::MemoryUse::Workspace)); };
  const double whole = workspace();
  double split = 0;
  {
    ds::test::EnvSet on(ds::kAttentionSplitKnob, "1");
    split = workspace();
  }
  const double dp = 2.0 * static_cast<double>(c.num_attention_heads) * 16384 * 16384;
  ASSERT_EQ(c.num_key_value_heads, 4);
  EXPECT_NEAR(whole - split, dp * 9 / 8 * 3 / 4, 1024);  // the rest of the workspace (batch data) is the same
  EXPECT_GT(split, dp / 4 * 9 / 8);                        // and the split estimate still the largest scratch
  EXPECT_GT(dp / 4 * 9 / 8, 2048.0 * 248320 * 4);
  EXPECT_EQ(workspace(), whole);  // the variable is gone again
  ds::test::EnvSet bad(ds::kAttentionSplitKnob, "yes");
  EXPECT_NE(ds::test::error_of(workspace).find("DELTASTACK_ATTENTION_SPLIT must be 0 or 1"), std::string::npos);
}

// DELTASTACK_LAYER_SLOTS=3 (an A/B knob, docs/gpu.md): the in-backward gradients take one layer's fp32 slot more;
// another value is refused naming the variable.
TEST(Plan, ThirdLayerSlotTakesOneLayersGradients) {
  if (!ds::cuda_compiled()) GTEST_SKIP() << "plan needs a CUDA build";
  const ds::ModelConfig c = ds::ModelConfig::preset("9b");
  ds::GpuPlan plan = ds::GpuPlan::windows(1, 8192, 1);
  plan.optimizer_state = ds::OptimizerState::EightBit;
  plan.gradients = ds::Gradients::InBackward;
  const auto grads = [&] { return static_cast<double>(use(ds::plan_gpu_memory(c, plan), ds::MemoryUse::Gradients)); };
  const double two = grads();
  double three = 0;
  {
    ds::test::EnvSet on("DELTASTACK_LAYER_SLOTS", "3");
    three = grads();
  }
  const ds::Qwen35Model m(c, ds::Qwen35Model::Deferred{});
  const std::vector<ds::ParamUnit> units = ds::param_units(c, m.params());
  int64_t layer = 0;  // the largest layer's parameters (units 1 .. L)
  for (size_t u = 1; u + 1 < units.size(); ++u) layer = std::max(layer, units[u].hi - units[u].lo);
  EXPECT_NEAR(three - two, 4.0 * static_cast<double>(layer), 4.0 * 256);
  ds::test::EnvSet bad("DELTASTACK_LAYER_SLOTS", "5");
  EXPECT_NE(ds::test::error_of(grads).find("DELTASTACK_LAYER_SLOTS must be 2, 3 or 4"), std::string::npos);
}

// GpuPlan::layer_slots 0 (the default): in-backward, resolve_memory_modes takes a third layer slot where the modes it
// resolves stay those of two slots with at most two layers fewer kept (the 9B goal's shape with --recompute auto
// within 76 GiB: selective either way, two kept layers fewer with three), and two where three would change them (a
// budget between selective with two slots and with three: a cheaper recompute policy then) or would cost more layers
// (9B at seq 4096 within 60 GiB: selective, 8 kept layers with two slots, 4 with three). Given slots (the field, or
// DELTASTACK_LAYER_SLOTS) stay; the fp32 gradient buffer has no slots to choose (2, unused).
TEST(Plan, InBackwardTakesAThirdLayerSlotWhereTheModesStay) {
  if (!ds::cuda_compiled()) GTEST_SKIP() << "plan needs a CUDA build";
  const ds::ModelConfig c = ds::ModelConfig::preset("9b");
  ds::GpuPlan plan = ds::GpuPlan::windows(1, 8192, 1);
  plan.precision = ds::Precision::Fp8;
  plan.optimizer_state = ds::OptimizerState::EightBit;
  plan.gradients = ds::Gradients::InBackward;
  plan.recompute = ds::Recompute::Auto;
  const double GiB = 1073741824.0;
  const auto within = [](double bytes) {
    return [bytes](const ds::GpuMemoryPlan& p) { return static_cast<double>(p.total) <= bytes; };
  };
  const ds::GpuPlan r = ds::resolve_memory_modes(c, plan, within(76 * GiB));
  EXPECT_EQ(r.layer_slots, 3);
  EXPECT_EQ(r.recompute, ds::Recompute::Selective);
  {
    ds::GpuPlan half = plan;
    half.max_tokens = half.max_seqlen = 4096;
    const ds::GpuPlan h = ds::resolve_memory_modes(c, half, within(60 * GiB));
    EXPECT_EQ(h.layer_slots, 2);
    EXPECT_EQ(h.recompute, ds::Recompute::Selective);
    half.layer_slots = 3;
    EXPECT_LT(ds::resolve_memory_modes(c, half, within(60 * GiB)).kept_layers + 2, h.kept_layers);
  }
  ds::GpuPlan given = plan;
  given.layer_slots = 2;
  const ds::GpuPlan r2 = ds::resolve_memory_modes(c, given, within(76 * GiB));
  EXPECT_EQ(r2.layer_slots, 2);
  EXPECT_EQ(r2.recompute, ds::Recompute::Selective);
  EXPECT_GE(r2.kept_layers, r.kept_layers);
  EXPECT_LE(r2.kept_layers, r.kept_layers + 2);
  // selective with no kept layer: its total with two slots and with three
  ds::GpuPlan sel = given;
  sel.recompute = ds::Recompute::Selective;
  const double sel2 = static_cast<double>(ds::plan_gpu_memory(c, sel).total);
  sel.layer_slots = 3;
  const double sel3 = static_cast<double>(ds::plan_gpu_memory(c, sel).total);
  ASSERT_GT(sel3, sel2);
  const ds::GpuPlan tight = ds::resolve_memory_modes(c, plan, within((sel2 + sel3) / 2));
  EXPECT_EQ(tight.layer_slots, 2);
  EXPECT_EQ(tight.recompute, ds::Recompute::Selective);
  {
    ds::test::EnvSet knob("DELTASTACK_LAYER_SLOTS", "2");
    EXPECT_EQ(ds::resolve_memory_modes(c, plan, within(76 * GiB)).layer_slots, 2);
  }
  plan.gradients = ds::Gradients::Fp32;
  plan.optimizer_state = ds::OptimizerState::EightBit;
  EXPECT_EQ(ds::resolve_memory_modes(c, plan, within(140 * GiB)).layer_slots, 2);
}

// --fp8-lm-head: the loss scratch gains the casts of W (vocab x hidden bytes), of h (hidden x tokens) and of one
// chunk's dlogits transposed (vocab x chunk; these two not for LoRA's frozen head), nothing without --precision fp8
// (the engine's check refuses that);
// a vocabulary the FP8 GEMMs cannot take is refused naming vocab_size.
TEST(Plan, Fp8LmHeadAddsItsCastsToTheLossScratch) {
  if (!ds::cuda_compiled()) GTEST_SKIP() << "plan needs a CUDA build";
  ds::ModelConfig c = ds::ModelConfig::preset("9b");
  ds::GpuPlan plan = ds::GpuPlan::windows(1, 8192, 1);
  plan.precision = ds::Precision::Fp8;
  const auto scratch = [&] { return static_cast<double>(ds::ce_plan(c, plan).workspace_bytes()); };
  const double bf16_head = scratch();
  plan.fp8_lm_head = true;
  const double V = static_cast<double>(c.vocab_size), H = static_cast<double>(c.hidden_size);
  EXPECT_NEAR(scratch() - bf16_head, V * H + H * 8192 + V * 2048, 4096);
  EXPECT_NEAR((scratch() - bf16_head) / kGiB, 1.45, 0.01);  // the number docs/fp8.md gives
  plan.lora = lora_r16();  // a frozen head (LoRA): the dgrad's cast of W only
  EXPECT_NEAR(scratch() - bf16_head, V * H, 4096);
  plan.lora = {};
  plan.precision = ds::Precision::Bf16;
  EXPECT_EQ(scratch(), bf16_head);
  EXPECT_NE(ds::test::error_of([&] { ds::check_fp8_lm_head(true, ds::Precision::Bf16); }).find("--fp8-lm-head needs "
            "--precision fp8"), std::string::npos);
  EXPECT_NE(ds::test::error_of([&] { ds::check_fp8_lm_head(true, ds::Precision::Fp8, 1e-4); }).find("--z-loss"),
            std::string::npos);
  plan.precision = ds::Precision::Fp8;
  c.vocab_size = 151930;
  EXPECT_NE(ds::test::error_of(scratch).find("vocab_size 151930 is not a multiple of 16"), std::string::npos);
}

// --offload-activations: the layer inputs full recompute keeps leave the device plan but for a ring of three and
// the last layer's output (L - 3 inputs of N x hidden bf16 less, that many in pinned host memory); it needs full
// recompute (auto: full, and the memory it frees keeps more layers), and `plan` names the host memory it takes.
TEST(Plan, OffloadKeepsThreeLayerInputsOnTheDevice) {
  if (!ds::cuda_compiled()) GTEST_SKIP() << "plan needs a CUDA build";
  const ds::ModelConfig c = ds::ModelConfig::preset("27b");
  ds::GpuPlan plan = ds::GpuPlan::windows(1, 8192, 1);
  plan.recompute = ds::Recompute::Full;
  const double kept = static_cast<double>(use(ds::plan_gpu_memory(c, plan), ds::MemoryUse::Kept));
  plan.offload_activations = true;
  const double off = static_cast<double>(use(ds::plan_gpu_memory(c, plan), ds::MemoryUse::Kept));
  const double input = 8192.0 * static_cast<double>(c.hidden_size) * 2;
  EXPECT_NEAR(kept - off, static_cast<double>(c.num_hidden_layers - 3) * input, 256.0 * 64);
  EXPECT_EQ(ds::offload_host_bytes(c, plan), static_cast<size_t>(c.num_hidden_layers - 3) * 8192 * 5120 * 2);
  plan.recompute = ds::Recompute::Selective;
  EXPECT_NE(ds::test::error_of([&] { ds::plan_gpu_memory(c, plan); }).find("needs --recompute full or auto"),
            std::string::npos);
  plan.recompute = ds::Recompute::Auto;
  plan.optimizer_state = ds::OptimizerState::EightBit;
  plan.gradients = ds::Gradients::InBackward;
  const auto fits = [](const ds::GpuMemoryPlan& p) { return p.total < static_cast<size_t>(140.4 * kGiB); };
  const ds::GpuPlan chosen = ds::resolve_memory_modes(c, plan, fits);
  plan.offload_activations = false;
  const ds::GpuPlan without = ds::resolve_memory_modes(c, plan, fits);
  EXPECT_EQ(chosen.recompute, ds::Recompute::Full);
  EXPECT_EQ(without.recompute, ds::Recompute::Full);
  EXPECT_GT(chosen.kept_layers + chosen.mlp_layers, without.kept_layers + without.mlp_layers);
  // --recompute auto takes it by itself as the last resort: 27B LoRA (bf16 base) needs 65.3 GiB with full recompute
  // and about 60.6 with the inputs offloaded; within 62 GiB auto offloads, within 70 it does not, and within 50
  // (nothing fits) the offloaded plan is the leanest, the one a refusal reports.
  ds::GpuPlan lora = ds::GpuPlan::windows(1, 8192, 1);
  lora.lora = lora_r16();
  lora.recompute = ds::Recompute::Auto;
  const auto within = [](double gib) {
    return [gib](const ds::GpuMemoryPlan& p) { return static_cast<double>(p.total) < gib * kGiB; };
  };
  const ds::GpuPlan tight = ds::resolve_memory_modes(c, lora, within(62)), roomy = ds::resolve_memory_modes(c, lora, within(70));
  EXPECT_TRUE(tight.offload_activations);
  EXPECT_EQ(tight.recompute, ds::Recompute::Full);
  EXPECT_LT(static_cast<double>(ds::plan_gpu_memory(c, tight).total), 62 * kGiB);
  EXPECT_FALSE(roomy.offload_activations);
  EXPECT_TRUE(ds::resolve_memory_modes(c, lora, within(50)).offload_activations);  // nothing fits: the leanest plan
  std::string out;
  ASSERT_EQ(ds::test::run("plan --model 27b --lora-rank 16 --recompute full --offload-activations", &out), 0) << out;
  EXPECT_NE(out.find("recompute full, the layer inputs offloaded to host memory"), std::string::npos) << out;
  EXPECT_NE(out.find("offload: 61 of the 64 layer inputs in 4.77 GiB of pinned host memory"), std::string::npos) << out;
  // --memory fixed takes full recompute with it (not fixed's selective); another --recompute is refused by name
  ASSERT_EQ(ds::test::run("plan --model 2b --memory fixed --offload-activations", &out), 0) << out;
  EXPECT_NE(out.find("recompute full, the layer inputs offloaded"), std::string::npos) << out;
  EXPECT_EQ(ds::test::run("plan --model 2b --recompute mlp --offload-activations", &out), 1) << out;
  EXPECT_NE(out.find("--offload-activations and --recompute mlp contradict each other"), std::string::npos) << out;
}

TEST(Plan, LoraFreezesTheBaseAndCountsTheAdapters) {
  if (!ds::cuda_compiled()) GTEST_SKIP() << "plan needs a CUDA build";
  using ds::MemoryUse;
  const ds::ModelConfig c = ds::ModelConfig::preset("9b");
  ds::GpuPlan plan = ds::GpuPlan::windows(1, 8192, 1);
  plan.recompute = ds::Recompute::Selective;
  plan.lora = lora_r16();
  const double A = static_cast<double>(ds::lora_num_values(ds::lora_tensor_specs(c, plan.lora), 16));
  double P = static_cast<double>(c.num_parameters()), small = 0;
  for (const ds::ParamSpec& p : ds::qwen35_params(c))
    if (!ds::is_matrix(p)) small += static_cast<double>(p.numel);
  EXPECT_GT(A, 1e7);     // 9B at rank 16: tens of millions of adapter values,
  EXPECT_LT(A, 1e-2 * P);  // under 1 % of the base
  const ds::GpuMemoryPlan l = ds::plan_gpu_memory(c, plan);
  const double slack = 256.0 * 2000;
  EXPECT_NEAR(use(l, MemoryUse::Parameters), 2 * P + 4 * small + 6 * A, slack);
  EXPECT_LT(use(l, MemoryUse::Gradients), 4 * A + 4 * small + slack);
  EXPECT_GT(use(l, MemoryUse::Gradients), 4 * A);
  EXPECT_NEAR(use(l, MemoryUse::Optimizer), 8 * A, slack);
  // against the full run's leanest state with the same activations: 8 B per base parameter less, about
  const ds::GpuMemoryPlan f = plan_modes("9b", 8192, 1, ds::OptimizerState::Bf16, ds::Recompute::Selective);
  EXPECT_GT(static_cast<double>(f.total - l.total), 7.5 * P);
  EXPECT_NEAR(use(l, MemoryUse::Kept), use(f, MemoryUse::Kept), 256.0 * 400);
  // the memory flags of a full run are resolved away; the modes LoRA does not run are errors
  plan.optimizer_state = ds::OptimizerState::EightBit;
  EXPECT_EQ(ds::plan_gpu_memory(c, plan).total, l.total);
  plan.gradients = ds::Gradients::InBackward;
  EXPECT_NE(ds::test::error_of([&] { ds::plan_gpu_memory(c, plan); }).find("--gradients in-backward with LoRA"),
            std::string::npos);
  plan.gradients = ds::Gradients::Fp32;
  plan.shard_world = 2;
  EXPECT_NE(ds::test::error_of([&] { ds::plan_gpu_memory(c, plan); }).find("--shard optimizer with LoRA"),
            std::string::npos);
  std::string log;
  ASSERT_EQ(ds::test::run("plan --model 9b --seq-len 8192 --micro-batch 1 --lora-rank 16 --device-memory 139", &log), 0)
      << log;
  EXPECT_NE(log.find("LoRA rank 16 (all-linear): the base frozen in bf16"), std::string::npos) << log;
  EXPECT_NE(log.find("fits"), std::string::npos) << log;
  EXPECT_EQ(ds::test::run("plan --model 9b --lora-rank -1", &log), 1);
  EXPECT_NE(log.find("--lora-rank must be >= 0"), std::string::npos) << log;
}

// LoRA under --precision fp8: the frozen base's GEMM weights stored as their FP8 casts only (model/gpu_fp8.h
// fp8_stored_base): the units are exactly the decoder's FP8 linears (in_proj_qkv, in_proj_z, out_proj, q/k/v/o_proj,
// gate|up as one, down_proj; not in_proj_b/a, the embedding or the head), each group only where every shape takes
// the FP8 GEMM; the plan's parameters shrink by one byte per stored element; DELTASTACK_FP8_FROZEN_BASE=0 keeps
// them in bf16; `plan` says so.
TEST(Plan, LoraFp8BaseStoresTheGemmWeightsAsOneByteCasts) {
  if (!ds::cuda_compiled()) GTEST_SKIP() << "plan needs a CUDA build";
  const ds::ModelConfig c = ds::ModelConfig::preset("9b");
  const std::vector<ds::ParamSpec> params = ds::qwen35_params(c);
  const ds::ParamLayout layout(c, params);
  const std::vector<ds::Fp8WeightUnit> units = ds::fp8_weight_units(c, layout);
  double stored = 0, linears = 0;
  for (const ds::Fp8WeightUnit& u : units) stored += static_cast<double>(u.numel());
  for (const ds::ParamSpec& p : params)
    for (const char* n : {"in_proj_qkv.", "in_proj_z.", "out_proj.", "q_proj.", "k_proj.", "v_proj.", "o_proj.",
                          "gate_proj.", "up_proj.", "down_proj."})
      if (p.name.find(n) != std::string::npos) linears += static_cast<double>(p.numel);
  EXPECT_EQ(stored, linears);
  int64_t attention = 0;
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) attention += c.is_full_attention(i);
  EXPECT_EQ(static_cast<int64_t>(units.size()), attention * 6 + (c.num_hidden_layers - attention) * 5);
  EXPECT_EQ(units[3].weight, 4);  // layer 0 (GDN): qkv, z, out_proj, gate|up (gate_proj and up_proj as one), down
  EXPECT_EQ(units[3].rows, 2 * c.intermediate_size);
  // a group whose shapes the FP8 GEMM does not take stays in bf16 (an intermediate size not a multiple of 16)
  ds::ModelConfig odd = ds::ModelConfig::preset("tiny");
  odd.intermediate_size = 100;
  const std::vector<ds::ParamSpec> odd_params = ds::qwen35_params(odd);
  for (const ds::Fp8WeightUnit& u : ds::fp8_weight_units(odd, ds::ParamLayout(odd, odd_params)))
    EXPECT_LT(u.weight, 4) << "layer " << u.layer;
  // the plan: one byte less per stored element (alignment aside)
  ds::GpuPlan plan = ds::GpuPlan::windows(1, 8192, 1);
  plan.recompute = ds::Recompute::Selective;
  plan.precision = ds::Precision::Fp8;
  plan.lora = lora_r16();
  const double fp8 = static_cast<double>(use(ds::plan_gpu_memory(c, plan), ds::MemoryUse::Parameters));
  double bf16 = 0;
  {
    ds::test::EnvSet off(ds::kFp8FrozenBaseKnob, "0");
    bf16 = static_cast<double>(use(ds::plan_gpu_memory(c, plan), ds::MemoryUse::Parameters));
  }
  EXPECT_NEAR(bf16 - fp8, stored, 256.0 * static_cast<double>(params.size() + units.size()));
  plan.precision = ds::Precision::Bf16;  // bf16 GEMMs: the base in bf16 whatever the variable says
  EXPECT_EQ(static_cast<double>(use(ds::plan_gpu_memory(c, plan), ds::MemoryUse::Parameters)), bf16);
  std::string log;
  ASSERT_EQ(ds::test::run("plan --model 9b --lora-rank 16 --precision fp8 --device-memory 139", &log), 0) << log;
  EXPECT_NE(log.find("its FP8 GEMM weights stored as their E4M3 casts only"), std::string::npos) << log;
}

// Full recompute with layers that rebuild only mlp's activations (GpuPlan::mlp_layers, after the kept layers): the
// bytes grow with them from full's toward mlp's; `auto` takes them where they save more of the forward than kept
// layers would (27B LoRA, FP8-stored base, within the 68.2 GiB transformers + PEFT held: a kept layer costs about 1.5
// GiB over full, an mlp layer about 0.5, and saves 1.7 times as much per byte), and `plan` names them; a policy
// given on the command line keeps every layer at it.
TEST(Plan, FullRecomputeTakesLayersRebuildingOnlyMlps) {
  if (!ds::cuda_compiled()) GTEST_SKIP() << "plan needs a CUDA build";
  const ds::ModelConfig c = ds::ModelConfig::preset("27b");
  const int64_t L = c.num_hidden_layers;
  ds::GpuPlan plan = ds::GpuPlan::windows(1, 8192, 1);
  plan.precision = ds::Precision::Fp8;
  plan.offload_activations = true;
  plan.lora = lora_r16();
  auto total = [&](int64_t kept, int64_t m) {
    ds::GpuPlan p = plan;
    p.recompute = ds::Recompute::Full;
    p.kept_layers = kept;
    p.mlp_layers = m;
    return static_cast<double>(ds::plan_gpu_memory(c, p).total);
  };
  EXPECT_LT(total(0, 0), total(0, 10));
  EXPECT_LT(total(0, 10), total(0, 30));
  EXPECT_LT(total(0, 30), total(10, 30));
  const double per_mlp = (total(0, 30) - total(0, 10)) / 20, per_kept = (total(10, 0) - total(0, 0)) / 10;
  EXPECT_GT(per_kept, 2.5 * per_mlp);
  const double budget = 68.2 * kGiB;
  auto fits = [&](const ds::GpuMemoryPlan& p) { return static_cast<double>(p.total) <= budget; };
  plan.recompute = ds::Recompute::Auto;
  const ds::GpuPlan r = ds::resolve_memory_modes(c, plan, fits);
  EXPECT_EQ(r.recompute, ds::Recompute::Full);
  EXPECT_EQ(r.kept_layers, 0);
  EXPECT_GT(r.mlp_layers, 30);
  EXPECT_LE(total(0, r.mlp_layers), budget);
  EXPECT_GT(total(0, r.mlp_layers + 1), budget);
  EXPECT_EQ(ds::recompute_label(r, L), fmt::format("full, the first {} of {} rebuilding only mlp's activations, the layer "
                                                   "inputs offloaded to host memory", r.mlp_layers, L));
  ds::GpuPlan both = r;
  both.kept_layers = 2;
  EXPECT_EQ(ds::recompute_label(both, L), fmt::format("full, the first 2 of {} layers keeping their activations, the "
                                                      "next {} of {} rebuilding only mlp's activations, the layer inputs "
                                                      "offloaded to host memory", L, r.mlp_layers, L));
  plan.recompute = ds::Recompute::Full;  // given: every layer runs it
  const ds::GpuPlan given = ds::resolve_memory_modes(c, plan, fits);
  EXPECT_EQ(given.mlp_layers, 0);
  EXPECT_EQ(given.kept_layers, 0);
}
