// `deltastack plan` and plan_gpu_memory (model/gpu_plan.h): the CUDA engine's memory plan on the host, from the
// same layout function the engine allocates with. Checked against peaks measured on the H200 on 2026-12-01
// (docs/results/2026-12-01_h200_bench_step.txt: 2B 61.5 GiB, 0.8B 36.8 GiB at seq 8192 x micro-batch 2, chunked
// gated delta rule, cuDNN attention): the plan's total must be within 5 % of each. Needs a CUDA build (no device).
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "core/cuda/device.h"
#include "model/config.h"
#include "model/gpu_plan.h"
#include "train_test_util.h"

namespace {

constexpr double kGiB = 1073741824.0;

double planned_gib(const char* preset, int64_t seq, int64_t mb) {
  return ds::plan_gpu_memory(ds::ModelConfig::preset(preset), ds::GpuPlan::windows(mb, seq, 1)).total / kGiB;
}

TEST(Plan, MatchesMeasuredPeaks) {
  if (!ds::cuda_compiled()) GTEST_SKIP() << "plan needs a CUDA build";
  EXPECT_NEAR(planned_gib("2b", 8192, 2), 61.5, 0.05 * 61.5);
  EXPECT_NEAR(planned_gib("0.8b", 8192, 2), 36.8, 0.05 * 36.8);
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

TEST(Plan, CommandEndsWithTheVerdictAndExitsZero) {
  if (!ds::cuda_compiled()) GTEST_SKIP() << "plan needs a CUDA build";
  std::string out;
  ASSERT_EQ(ds::test::run("plan --model 2b --seq-len 8192 --micro-batch 2", &out), 0) << out;
  EXPECT_NE(out.find("\ntotal 61."), std::string::npos) << out;
  EXPECT_NE(out.find("GiB of 140.40 GiB: fits\n"), std::string::npos) << out;
  ASSERT_EQ(ds::test::run("plan --model 9b --seq-len 8192 --micro-batch 1", &out), 0) << out;
  EXPECT_NE(out.find("GiB of 140.40 GiB: does not fit\n"), std::string::npos) << out;
  ASSERT_EQ(ds::test::run("plan --model 2b --seq-len 8192 --micro-batch 2 --device-memory 40", &out), 0) << out;
  EXPECT_NE(out.find("of 40.00 GiB: does not fit"), std::string::npos) << out;
  EXPECT_EQ(ds::test::run("plan --model 2b --seq-len 0", &out), 1);
  EXPECT_NE(out.find("--seq-len"), std::string::npos) << out;
  EXPECT_EQ(ds::test::run("plan --model 2b --attention flash", &out), 1);
  EXPECT_NE(out.find("attention"), std::string::npos) << out;
}

}  // namespace
