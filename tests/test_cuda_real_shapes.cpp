// Every CUDA op at the real Qwen3.5-2B and 9B layer shapes (ModelConfig::preset "2b" / "9b") through the op checks
// of src/ops/<op>/cuda_check.h (the functions the registry's start-up probes run at small shapes): the
// memory-bound ops at T = 8192 and 32768 tokens, the linear layers at M = 8192 rows, the gated delta rule at
// T = 8192 (both presets' head counts, packed and unpacked) and T = 32768 (9B heads) against the CPU chunked form,
// attention at the 2B shape (B2 x T4096 packed and one T8192 document) and cuDNN at the 9B heads, and the fused
// linear + cross-entropy at N = 4096, H = 2048, V = 248320. Fixed seeds, outputs poisoned with NaN, relative L2
// error within forward 5e-3 / gradients 1e-2 (dg, dbeta 2e-2), two identical GPU runs bitwise equal. Each case
// prints one "[ measured ]" line with its errors and the CPU reference time.
// Slow (CPU references at full size, up to ~30 GB of host memory): every test skips unless a device exists AND
// DELTASTACK_REAL_SHAPES=1. On a GPU machine:
//   DELTASTACK_REAL_SHAPES=1 deltastack_tests --gtest_filter='*CudaRealShapes*'
#ifdef DELTASTACK_CUDA

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "cuda_test_util.h"
#include "model/config.h"
#include "ops/attention/cuda_check.h"
#include "ops/attention/cudnn.h"
#include "ops/conv1d/cuda_check.h"
#include "ops/embedding/cuda_check.h"
#include "ops/gated_delta_rule/cuda_check.h"
#include "ops/gated_rmsnorm/cuda_check.h"
#include "ops/gdn_gate/cuda_check.h"
#include "ops/l2norm/cuda_check.h"
#include "ops/linear/cuda_check.h"
#include "ops/linear_cross_entropy/cuda_check.h"
#include "ops/rmsnorm/cuda_check.h"
#include "ops/rope/cuda_check.h"
#include "ops/swiglu/cuda_check.h"

namespace {

using ds::ModelConfig;
using namespace ds::ops;
using ds::test::cuda::expect_ok;

bool real_shapes_enabled() {
  const char* e = std::getenv("DELTASTACK_REAL_SHAPES");
  return e != nullptr && std::string(e) == "1";
}

#define DS_REQUIRE_REAL_SHAPES()                                                             \
  do {                                                                                       \
    if (!real_shapes_enabled()) GTEST_SKIP() << "slow: set DELTASTACK_REAL_SHAPES=1 to run"; \
    DS_SKIP_WITHOUT_GPU();                                                                   \
  } while (0)

// Packed documents: {3000, 1, 4000, 1191} repeated to fill T (a multiple of 8192).
std::vector<int> packed_lengths(int64_t T) {
  std::vector<int> lens;
  for (int64_t t = 0; t < T; t += 8192)
    for (int len : {3000, 1, 4000, 1191}) lens.push_back(len);
  return lens;
}

// ------------------------------------------------------------------------------------------------ memory-bound ops

struct RealShape {
  const char* preset;
  int64_t T;
};

// The memory-bound ops at T tokens of one preset (a test per op keeps each test's CPU time short).
class CudaRealShapesTokens : public ::testing::TestWithParam<RealShape> {
 protected:
  void SetUp() override { DS_REQUIRE_REAL_SHAPES(); }
  ModelConfig cfg() const { return ModelConfig::preset(GetParam().preset); }
  int64_t T() const { return GetParam().T; }
};

TEST_P(CudaRealShapesTokens, RmsNorm) {
  const ModelConfig c = cfg();
  const auto eps = static_cast<float>(c.rms_norm_eps);
  expect_ok(check_rmsnorm({.rows = T(), .dim = c.hidden_size, .eps = eps}));
  // attention q norm: rows = tokens x heads
  expect_ok(check_rmsnorm({.rows = T() * c.num_attention_heads, .dim = c.head_dim, .eps = eps}));
}

TEST_P(CudaRealShapesTokens, SwiGlu) { expect_ok(check_swiglu({.N = T(), .I = cfg().intermediate_size})); }

TEST_P(CudaRealShapesTokens, Conv1dPacked) {
  const ModelConfig c = cfg();
  expect_ok(check_conv1d({.lens = packed_lengths(T()), .C = c.conv_dim(), .K = c.linear_conv_kernel_dim}));
}

// q (column 0) and k (column key_dim) heads read straight out of the conv output [T, conv_dim], as in the model.
TEST_P(CudaRealShapesTokens, L2Norm) {
  const ModelConfig c = cfg();
  const int64_t Hk = c.linear_num_key_heads, dk = c.linear_key_head_dim;
  expect_ok(check_l2norm({.tokens = T(), .heads = Hk, .dim = dk, .stride = c.conv_dim(), .col0 = 0}));
  expect_ok(check_l2norm({.tokens = T(), .heads = Hk, .dim = dk, .stride = c.conv_dim(), .col0 = c.key_dim()}));
}

TEST_P(CudaRealShapesTokens, GatedRmsNorm) {
  const ModelConfig c = cfg();
  expect_ok(check_gated_rmsnorm({.rows = T() * c.linear_num_value_heads,
                                 .d = c.linear_value_head_dim,
                                 .eps = static_cast<float>(c.rms_norm_eps)}));
}

TEST_P(CudaRealShapesTokens, GdnGate) { expect_ok(check_gdn_gate({.N = T(), .Hv = cfg().linear_num_value_heads})); }

TEST_P(CudaRealShapesTokens, RopePacked) {
  const ModelConfig c = cfg();
  for (int64_t H : {c.num_attention_heads, c.num_key_value_heads})
    expect_ok(check_rope({.lens = packed_lengths(T()),
                          .H = H,
                          .head_dim = c.head_dim,
                          .rotary_dim = c.rotary_dim(),
                          .theta = c.rope_theta}));
}

TEST_P(CudaRealShapesTokens, Embedding) {
  const ModelConfig c = cfg();
  expect_ok(check_embedding({.N = T(), .V = c.vocab_size, .H = c.hidden_size}));
}

INSTANTIATE_TEST_SUITE_P(Qwen35, CudaRealShapesTokens,
                         ::testing::Values(RealShape{"2b", 8192}, RealShape{"2b", 32768}, RealShape{"9b", 8192},
                                           RealShape{"9b", 32768}),
                         [](const ::testing::TestParamInfo<RealShape>& p) {
                           return std::string(p.param.preset) + "_T" + std::to_string(p.param.T);
                         });

// ------------------------------------------------------------------------------------------------ linear layers

// Every distinct [K -> N] projection of a layer (GDN qkv / z / b|a / out, attention q|gate / k, v / o, MLP
// gate|up / down) at M = 8192 rows (the accumulating forms are covered by the small-shape tests).
void check_linear_layers(const std::string& preset) {
  const ModelConfig c = ModelConfig::preset(preset);
  const int64_t H = c.hidden_size, I = c.intermediate_size, Hq = c.num_attention_heads, Hkv = c.num_key_value_heads,
                hd = c.head_dim, Hv = c.linear_num_value_heads;
  const std::vector<std::pair<int64_t, int64_t>> all = {{H, c.conv_dim()},  {H, c.value_dim()}, {H, 2 * Hv},
                                                        {c.value_dim(), H}, {H, 2 * Hq * hd},   {H, Hkv * hd},
                                                        {Hq * hd, H},       {H, 2 * I},         {I, H}};
  std::vector<std::pair<int64_t, int64_t>> layers;
  for (const auto& kn : all)
    if (std::find(layers.begin(), layers.end(), kn) == layers.end()) layers.push_back(kn);
  for (const auto& [K, N] : layers) expect_ok(check_linear({.M = 8192, .K = K, .N = N, .accumulate = false}));
}

TEST(CudaRealShapes, Linear2B) {
  DS_REQUIRE_REAL_SHAPES();
  check_linear_layers("2b");
}

TEST(CudaRealShapes, Linear9B) {
  DS_REQUIRE_REAL_SHAPES();
  check_linear_layers("9b");
}

// ------------------------------------------------------------------------------------------------ gated delta rule

// One GDN layer of the preset over documents `lens`, with the model's layout: v read from, and dv written into,
// [N, conv_dim] rows at column 2 * key_dim. CPU reference: the chunked form (forward and backward); g in
// [-2, -0.001): slow (long memory) to fast decay.
GatedDeltaRuleCase gdn_layer(const std::string& preset, std::vector<int> lens) {
  const ModelConfig c = ModelConfig::preset(preset);
  GatedDeltaRuleCase g;
  g.lens = std::move(lens);
  g.Hk = c.linear_num_key_heads, g.ratio = c.linear_num_value_heads / c.linear_num_key_heads;
  g.dk = c.linear_key_head_dim, g.dv = c.linear_value_head_dim;
  g.g_lo = -2.0, g.g_hi = -0.001;
  g.v_col = g.dv_col = 2 * c.key_dim();
  g.v_pad = g.dv_pad = 0;
  g.chunked_forward_ref = g.chunked_backward_ref = true;
  return g;
}

TEST(CudaRealShapes, GatedDeltaRule2B_T8192_Packed) {
  DS_REQUIRE_REAL_SHAPES();
  expect_ok(check_gated_delta_rule(gdn_layer("2b", packed_lengths(8192))));
}
TEST(CudaRealShapes, GatedDeltaRule2B_T8192_OneDoc) {
  DS_REQUIRE_REAL_SHAPES();
  expect_ok(check_gated_delta_rule(gdn_layer("2b", {8192})));
}
TEST(CudaRealShapes, GatedDeltaRule9B_T8192_Packed) {
  DS_REQUIRE_REAL_SHAPES();
  expect_ok(check_gated_delta_rule(gdn_layer("9b", packed_lengths(8192))));
}
TEST(CudaRealShapes, GatedDeltaRule9B_T8192_OneDoc) {
  DS_REQUIRE_REAL_SHAPES();
  expect_ok(check_gated_delta_rule(gdn_layer("9b", {8192})));
}
// T = 32768 with the 9B heads (Hv = 2 Hk: the GVA group sums of dq / dk over the longest state chain).
TEST(CudaRealShapes, GatedDeltaRule9B_T32768_OneDoc) {
  DS_REQUIRE_REAL_SHAPES();
  expect_ok(check_gated_delta_rule(gdn_layer("9b", {32768})));
}

// ------------------------------------------------------------------------------------------------ attention

// Causal GQA attention at a preset's heads over documents `lens`.
AttentionCase attention_layer(const std::string& preset, std::vector<int> lens, bool cudnn) {
  const ModelConfig c = ModelConfig::preset(preset);
  return AttentionCase{.lens = std::move(lens),
                       .Hq = c.num_attention_heads,
                       .Hkv = c.num_key_value_heads,
                       .head_dim = c.head_dim,
                       .cudnn = cudnn};
}

TEST(CudaRealShapes, Attention2B_B2xT4096) {
  DS_REQUIRE_REAL_SHAPES();
  expect_ok(check_attention(attention_layer("2b", {4096, 4096}, false)));
}
TEST(CudaRealShapes, Attention2B_T8192) {
  DS_REQUIRE_REAL_SHAPES();
  expect_ok(check_attention(attention_layer("2b", {8192}, false)));
}
// cuDNN's fused SDPA (the engine's default backend where cuDNN loads) at the same shapes, and at the 9B heads
// (Hq 16, Hkv 4) over a packed T = 8192 with documents in four length buckets.
TEST(CudaRealShapes, AttentionCudnn2B_B2xT4096) {
  DS_REQUIRE_REAL_SHAPES();
  if (std::string why = ds::ops::cudnn::attention_unavailable(); !why.empty()) GTEST_SKIP() << why;
  expect_ok(check_attention(attention_layer("2b", {4096, 4096}, true)));
}
TEST(CudaRealShapes, AttentionCudnn9B_T8192_Packed) {
  DS_REQUIRE_REAL_SHAPES();
  if (std::string why = ds::ops::cudnn::attention_unavailable(); !why.empty()) GTEST_SKIP() << why;
  expect_ok(check_attention(attention_layer("9b", {5000, 100, 2900, 1, 191}, true)));
}

// ------------------------------------------------------------------------------------------------ linear + CE

// The 2B head: N = 4096 tokens, H = 2048, V = 248320 (10% ignored labels, the last vocabulary row used), z-loss
// 1e-4, mean reduction, the model's 2048-token chunks.
TEST(CudaRealShapes, LinearCrossEntropy2B) {
  DS_REQUIRE_REAL_SHAPES();
  const ModelConfig c = ModelConfig::preset("2b");
  expect_ok(check_linear_cross_entropy({.N = 4096, .H = c.hidden_size, .V = c.vocab_size, .chunk_tokens = 2048}));
}

}  // namespace

#endif  // DELTASTACK_CUDA
