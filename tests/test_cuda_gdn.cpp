// GPU tests of the gated delta rule (ops/gated_delta_rule/cuda.h) through check_gated_delta_rule
// (ops/gated_delta_rule/cuda_check.h, the function the registry's start-up probe runs): against the fp32 CPU
// recurrent oracle on the same bf16-rounded inputs (zero initial state, no final-state gradient), packed sequences
// with partial chunks and an empty one, GVA ratios 1 and 2, dk = dv = 128 / 64 / 16 and mixed shapes, strong decay
// (g <= -50), thousands of tiny sequences (grid > 65535 blocks), a longer 8192-token sequence, small chunk sizes,
// odd v / dv strides. Every case runs forward + backward twice (bitwise equal), outputs, states and scratch
// poisoned first, the padding between the strided dv rows left untouched; fixed seeds.
// On a GPU machine: deltastack_tests --gtest_filter='CudaGatedDeltaRule*'
#ifdef DELTASTACK_CUDA

#include <gtest/gtest.h>

#include <utility>
#include <vector>

#include "core/rng.h"
#include "cuda_test_util.h"
#include "ops/gated_delta_rule/cuda.h"
#include "ops/gated_delta_rule/cuda_check.h"

using ds::ops::check_gated_delta_rule;
using ds::ops::GatedDeltaRuleCase;
using ds::test::cuda::expect_ok;

namespace {

GatedDeltaRuleCase packed(int64_t dk, int64_t dv, int64_t Hk, int64_t ratio) {
  GatedDeltaRuleCase c;
  c.lens = {1, 63, 64, 65, 200, 0, 17};
  c.dk = dk, c.dv = dv, c.Hk = Hk, c.ratio = ratio;
  return c;
}

TEST(CudaGatedDeltaRule, Packed128NoGva) {
  DS_SKIP_WITHOUT_GPU();
  expect_ok(check_gated_delta_rule(packed(128, 128, 2, 1)));
}

TEST(CudaGatedDeltaRule, Packed128Gva2) {
  DS_SKIP_WITHOUT_GPU();
  expect_ok(check_gated_delta_rule(packed(128, 128, 2, 2)));
}

TEST(CudaGatedDeltaRule, Packed64) {
  DS_SKIP_WITHOUT_GPU();
  expect_ok(check_gated_delta_rule(packed(64, 64, 2, 1)));
  expect_ok(check_gated_delta_rule(packed(64, 64, 2, 2)));
}

TEST(CudaGatedDeltaRule, Packed16) {
  DS_SKIP_WITHOUT_GPU();
  expect_ok(check_gated_delta_rule(packed(16, 16, 1, 1)));
  expect_ok(check_gated_delta_rule(packed(16, 16, 1, 2)));
}

TEST(CudaGatedDeltaRule, MixedHeadDims) {
  DS_SKIP_WITHOUT_GPU();
  for (auto [dk, dv] : std::vector<std::pair<int, int>>{{32, 64}, {128, 32}, {64, 128}, {16, 128}, {128, 16}, {32, 16}})
    expect_ok(check_gated_delta_rule(packed(dk, dv, 1, 2)));
}

// Strong decay: every gate <= -50, partial last chunks; dg is tiny but must stay accurate.
TEST(CudaGatedDeltaRule, StrongDecay) {
  DS_SKIP_WITHOUT_GPU();
  GatedDeltaRuleCase c = packed(128, 128, 2, 2);
  c.g_lo = -80.0, c.g_hi = -50.0;
  expect_ok(check_gated_delta_rule(c));
  c = packed(64, 64, 1, 1);
  c.g_lo = -80.0, c.g_hi = -50.0;
  expect_ok(check_gated_delta_rule(c));
}

// Chunk sizes 16 and 1: many chunk boundaries, chunk-start states and reverse chunk walks.
TEST(CudaGatedDeltaRule, SmallChunk) {
  DS_SKIP_WITHOUT_GPU();
  GatedDeltaRuleCase c = packed(64, 64, 2, 2);
  c.chunk = 16;
  expect_ok(check_gated_delta_rule(c));
  c = packed(32, 32, 1, 1);
  c.chunk = 1;
  expect_ok(check_gated_delta_rule(c));
}

// 4096 tiny documents (lengths 0..9) with Hv = 16: 65536 (sequence, head) blocks.
TEST(CudaGatedDeltaRule, ManyTinySequences) {
  DS_SKIP_WITHOUT_GPU();
  GatedDeltaRuleCase c;
  c.lens.clear();
  ds::Rng r(4096);
  for (int i = 0; i < 4096; ++i) c.lens.push_back(static_cast<int>(r.below(10)));
  c.Hk = 8, c.ratio = 2, c.dk = 16, c.dv = 16;
  expect_ok(check_gated_delta_rule(c));
}

// A longer sequence: N = 8192, Hk = 2, Hv = 4, 128². The backward reference is the CPU chunked form (validated
// against the recurrent oracle in test_gated_delta_rule.cpp), since the recurrent oracle would keep all 8193
// states per head (0.5 GB each).
TEST(CudaGatedDeltaRule, Long8192) {
  DS_SKIP_WITHOUT_GPU();
  GatedDeltaRuleCase c;
  c.lens = {8192};
  c.Hk = 2, c.ratio = 2, c.dk = 128, c.dv = 128;
  c.chunked_backward_ref = true;
  expect_ok(check_gated_delta_rule(c));
}

// Unaligned v / dv rows (odd strides): the scalar load path.
TEST(CudaGatedDeltaRule, OddStrides) {
  DS_SKIP_WITHOUT_GPU();
  GatedDeltaRuleCase c = packed(64, 64, 1, 2);
  c.v_pad = 3, c.dv_pad = 5;
  expect_ok(check_gated_delta_rule(c));
}

TEST(CudaGatedDeltaRule, RejectsBadShapes) {
  DS_SKIP_WITHOUT_GPU();
  ds::ops::GdnDims d;
  d.N = 4, d.num_seqs = 1, d.Hk = 1, d.Hv = 1, d.dk = 96, d.dv = 64, d.scale = 0.1;
  EXPECT_ANY_THROW(ds::ops::cuda::gated_delta_rule_forward(d, nullptr, nullptr, nullptr, 64, nullptr, nullptr, nullptr,
                                                           nullptr, 1, nullptr, nullptr, nullptr));
  d.dk = 64, d.chunk_size = 128;
  EXPECT_ANY_THROW(ds::ops::cuda::gated_delta_rule_forward(d, nullptr, nullptr, nullptr, 64, nullptr, nullptr, nullptr,
                                                           nullptr, 1, nullptr, nullptr, nullptr));
}

}  // namespace

#endif  // DELTASTACK_CUDA
