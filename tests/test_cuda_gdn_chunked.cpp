// GPU tests of the chunked tensor-core gated delta rule (ops/gated_delta_rule/chunked_cuda.h) through its op plan
// (ops/gated_delta_rule/plan.h) and check_gated_delta_rule (ops/gated_delta_rule/cuda_check.h, the function the
// registry's start-up probe runs): against the fp32 CPU recurrent oracle (the chunked CPU form for the long case) on
// the same bf16-rounded inputs. Cases of docs/model.md §7.4: partial chunks with strong decay (g <= -50), g == 0,
// every length 1..127 (39-token tails among them), empty documents, more than 2047 documents in one batch, GVA 1 and
// 2, v / dv inside wider conv-output rows; every case twice, bitwise equal; outputs, saved buffer and workspace
// poisoned first. On a GPU machine: deltastack_tests --gtest_filter='CudaGatedDeltaRuleChunked*'
#ifdef DELTASTACK_CUDA

#include <gtest/gtest.h>

#include <numeric>
#include <vector>

#include "cuda_test_util.h"
#include "ops/gated_delta_rule/cuda_check.h"

using ds::ops::check_gated_delta_rule;
using ds::ops::GatedDeltaRuleCase;
using ds::test::cuda::expect_ok;

namespace {

GatedDeltaRuleCase chunked(std::vector<int> lens, int64_t Hk, int64_t ratio) {
  GatedDeltaRuleCase c;
  c.lens = std::move(lens);
  c.dk = c.dv = 128;
  c.Hk = Hk, c.ratio = ratio;
  c.backend = "cuda-chunked";
  return c;
}

TEST(CudaGatedDeltaRuleChunked, PackedPartialChunks) {
  DS_SKIP_WITHOUT_GPU();
  expect_ok(check_gated_delta_rule(chunked({1, 63, 64, 65, 200, 0, 17}, 2, 1)));
  expect_ok(check_gated_delta_rule(chunked({1, 63, 64, 65, 200, 0, 17}, 2, 2)));
}

TEST(CudaGatedDeltaRuleChunked, StrongDecayAndZeroGate) {
  DS_SKIP_WITHOUT_GPU();
  GatedDeltaRuleCase c = chunked({39, 64, 103, 1}, 1, 2);
  c.g_lo = -80.0, c.g_hi = -50.0;
  expect_ok(check_gated_delta_rule(c));
  c.g_lo = 0.0, c.g_hi = 0.0;  // no decay at all: the state only grows
  expect_ok(check_gated_delta_rule(c));
}

TEST(CudaGatedDeltaRuleChunked, EveryLengthUpTo127) {
  DS_SKIP_WITHOUT_GPU();
  std::vector<int> lens(127);
  std::iota(lens.begin(), lens.end(), 1);
  expect_ok(check_gated_delta_rule(chunked(lens, 1, 2)));
}

TEST(CudaGatedDeltaRuleChunked, ManyTinyDocumentsAndEmptyOnes) {
  DS_SKIP_WITHOUT_GPU();
  std::vector<int> lens;
  for (int i = 0; i < 2100; ++i) lens.push_back(i % 5 == 0 ? 0 : 1 + i % 3);  // > 2047 documents, empty ones between
  expect_ok(check_gated_delta_rule(chunked(lens, 1, 1)));
}

TEST(CudaGatedDeltaRuleChunked, LongSequenceAgainstChunkedReference) {
  DS_SKIP_WITHOUT_GPU();
  GatedDeltaRuleCase c = chunked({4096, 1000}, 2, 2);
  c.chunked_forward_ref = c.chunked_backward_ref = true;
  c.g_lo = -1.0, c.g_hi = -0.001;
  expect_ok(check_gated_delta_rule(c));
}

// The engine sizes its plan for the largest micro-batch: smaller batches leave chunk blocks past the batch and an
// index table longer than the batch's documents.
TEST(CudaGatedDeltaRuleChunked, PlanLargerThanTheBatch) {
  DS_SKIP_WITHOUT_GPU();
  GatedDeltaRuleCase c = chunked({1, 63, 64, 65, 200, 0, 17}, 2, 2);
  c.plan_extra_tokens = 500, c.plan_extra_seqs = 5;
  expect_ok(check_gated_delta_rule(c));
  c = chunked({39}, 1, 1);
  c.plan_extra_tokens = 8192, c.plan_extra_seqs = 64;
  expect_ok(check_gated_delta_rule(c));
}

TEST(CudaGatedDeltaRuleChunked, ProbeCases) {
  DS_SKIP_WITHOUT_GPU();
  for (const GatedDeltaRuleCase& c : ds::ops::gated_delta_rule_chunked_probe_cases()) expect_ok(check_gated_delta_rule(c));
}

}  // namespace

#endif  // DELTASTACK_CUDA
