// CUDA op kernels (src/ops/<op>/cuda.cu) against the fp32 CPU references through the op checks of
// src/ops/<op>/cuda_check.h (fixed seeds; bf16-rounded inputs; outputs poisoned with NaN; accumulated gradients
// compared as increments over a random start; forward <= 5e-3, gradients <= 1e-2; two identical runs bitwise
// equal). CudaProbeCases runs exactly the cases the op registry probes at start-up; the other tests run the same
// checks at more shapes: odd sizes and unaligned pointers (offset 1) for the scalar fallbacks, Qwen3.5 sizes for
// the vector paths. Skipped without a device.
// On a GPU machine: deltastack_tests --gtest_filter='CudaOps*:CudaProbeCases*'
#ifdef DELTASTACK_CUDA

#include <gtest/gtest.h>

#include <cstdio>
#include <string>
#include <tuple>

#include "core/cuda/device.h"
#include "cuda_test_util.h"
#include "ops/adamw/adamw.h"
#include "ops/adamw/bf16_state.h"
#include "ops/adamw/cuda.h"
#include "ops/adamw/cuda_check.h"
#include "ops/adamw/q8_state.h"
#include "ops/check/device.h"
#include "ops/attention/cuda_check.h"
#include "ops/attention/cudnn.h"
#include "ops/conv1d/cuda_check.h"
#include "ops/elementwise/cuda_check.h"
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

using namespace ds::ops;
using ds::test::cuda::expect_ok;

TEST(CudaOps, DeviceInfo) {
  DS_SKIP_WITHOUT_GPU();
  EXPECT_TRUE(ds::cuda_compiled());
  std::printf("[CudaOps] %d device(s); device 0: %s\n", ds::cuda_device_count(), ds::cuda_device_name().c_str());
}

// ------------------------------------------------------------------------------------------------ probe cases

// The registry's start-up probe cases, every value against its own band (the registry compares only the worst
// one with the op's band).
TEST(CudaProbeCases, AllOps) {
  DS_SKIP_WITHOUT_GPU();
  expect_ok(check_rmsnorm, rmsnorm_probe_cases());
  expect_ok(check_gated_rmsnorm, gated_rmsnorm_probe_cases());
  expect_ok(check_l2norm, l2norm_probe_cases());
  expect_ok(check_swiglu, swiglu_probe_cases());
  expect_ok(check_gdn_gate, gdn_gate_probe_cases());
  expect_ok(check_embedding, embedding_probe_cases());
  expect_ok(check_conv1d, conv1d_probe_cases());
  expect_ok(check_rope, rope_probe_cases());
  expect_ok(check_elementwise, elementwise_probe_cases());
  expect_ok(check_copy_rows, copy_rows_probe_cases());
  expect_ok(check_linear, linear_probe_cases());
  expect_ok(check_linear_cross_entropy, linear_cross_entropy_probe_cases());
  expect_ok(check_attention, attention_probe_cases());
  expect_ok(check_gated_delta_rule, gated_delta_rule_probe_cases());
  expect_ok(check_adamw, adamw_probe_cases());
}

TEST(CudaProbeCases, Cudnn) {
  DS_SKIP_WITHOUT_GPU();
  if (std::string why = cudnn::attention_unavailable(); !why.empty()) GTEST_SKIP() << why;
  expect_ok(check_attention, cudnn_attention_probe_cases());
}

// The probes are deterministic: the same error twice.
TEST(CudaProbeCases, Deterministic) {
  DS_SKIP_WITHOUT_GPU();
  EXPECT_EQ(probe_cuda_rmsnorm(), probe_cuda_rmsnorm());
  EXPECT_EQ(probe_cuda_gated_delta_rule(), probe_cuda_gated_delta_rule());
  EXPECT_EQ(probe_cuda_output_gate(), probe_cuda_output_gate());
}

// ------------------------------------------------------------------------------------------------ rmsnorm

TEST(CudaOps, RmsNorm) {
  DS_SKIP_WITHOUT_GPU();
  expect_ok(check_rmsnorm({.rows = 4096, .dim = 2048}));  // block per row, 256 threads x 1 vector
  expect_ok(check_rmsnorm({.rows = 1000, .dim = 5120}));  // block per row, 224 threads x 3 vectors
  expect_ok(check_rmsnorm({.rows = 300, .dim = 4096, .zero_centered = false}));  // 256 x 2, plain weight
  expect_ok(check_rmsnorm({.rows = 200, .dim = 1000}));  // forward warp per row (4 vectors/lane), backward block
  expect_ok(check_rmsnorm({.rows = 3000, .dim = 64}));   // 8 lanes per row
  expect_ok(check_rmsnorm({.rows = 37, .dim = 72, .zero_centered = false}));  // 9 vectors -> 16 lanes, partial group
  expect_ok(check_rmsnorm({.rows = 37, .dim = 70}));                          // dim % 8 != 0: scalar path
  expect_ok(check_rmsnorm({.rows = 33, .dim = 128, .offset = 1}));            // unaligned pointers: scalar path
  expect_ok(check_rmsnorm({.rows = 1, .dim = 8}));                            // one vector, one row
}

TEST(CudaOps, RmsNormQkHeads) {
  DS_SKIP_WITHOUT_GPU();
  expect_ok(check_rmsnorm({.rows = 512 * 16, .dim = 256}));  // q norm rows = tokens x heads, hd 256: a warp per row
  expect_ok(check_rmsnorm({.rows = 700 * 4, .dim = 128}));   // head_dim 128: 16 lanes
  expect_ok(check_rmsnorm({.rows = 999, .dim = 32}));        // head_dim 32: 4 lanes
}

// ------------------------------------------------------------------------------------------------ gated rmsnorm

TEST(CudaOps, GatedRmsNorm) {
  DS_SKIP_WITHOUT_GPU();
  expect_ok(check_gated_rmsnorm({.rows = 2048 * 16, .d = 128}));  // tokens x value heads, d = 128: 16 lanes per row
  expect_ok(check_gated_rmsnorm({.rows = 3000, .d = 64}));
  expect_ok(check_gated_rmsnorm({.rows = 1000, .d = 16}));              // 2 lanes per row
  expect_ok(check_gated_rmsnorm({.rows = 37, .d = 72}));                // partial group
  expect_ok(check_gated_rmsnorm({.rows = 37, .d = 70}));                // scalar path
  expect_ok(check_gated_rmsnorm({.rows = 41, .d = 128, .offset = 1}));  // unaligned: scalar path
  expect_ok(check_gated_rmsnorm({.rows = 64, .d = 2048}));              // block per row (generality)
}

// ------------------------------------------------------------------------------------------------ l2norm

TEST(CudaOps, L2Norm) {
  DS_SKIP_WITHOUT_GPU();
  expect_ok(check_l2norm({.tokens = 1024, .heads = 16, .dim = 128, .stride = 3 * 16 * 128, .col0 = 16 * 128}));  // k
  expect_ok(check_l2norm({.tokens = 1024, .heads = 16, .dim = 128, .stride = 16 * 128, .col0 = 0}));     // contiguous
  expect_ok(check_l2norm({.tokens = 300, .heads = 4, .dim = 256, .stride = 4 * 256 + 64, .col0 = 64}));  // warp/row
  expect_ok(check_l2norm({.tokens = 77, .heads = 3, .dim = 24, .stride = 80, .col0 = 8}));  // 3 vectors -> 4 lanes
  expect_ok(check_l2norm({.tokens = 37, .heads = 2, .dim = 16, .stride = 40, .col0 = 4}));  // x + 4 unaligned: scalar
  expect_ok(check_l2norm({.tokens = 50, .heads = 2, .dim = 16, .stride = 36, .col0 = 0}));  // stride % 8 != 0
  expect_ok(check_l2norm({.tokens = 37, .heads = 3, .dim = 30, .stride = 95, .col0 = 1}));  // dim % 8 != 0
  expect_ok(check_l2norm({.tokens = 20, .heads = 2, .dim = 1024, .stride = 2048, .col0 = 0}));  // 4 vectors per lane
}

// ------------------------------------------------------------------------------------------------ swiglu

TEST(CudaOps, SwiGlu) {
  DS_SKIP_WITHOUT_GPU();
  expect_ok(check_swiglu({.N = 256, .I = 17408}));  // Qwen3.5 intermediate size
  expect_ok(check_swiglu({.N = 512, .I = 2048}));
  expect_ok(check_swiglu({.N = 33, .I = 100}));               // I % 8 != 0: scalar path
  expect_ok(check_swiglu({.N = 64, .I = 256, .offset = 1}));  // unaligned: scalar path
  expect_ok(check_swiglu({.N = 70000, .I = 8}));              // more rows than one grid dimension holds
  expect_ok(check_swiglu({.N = 256, .I = 6144, .split = true}));             // two dense arrays (deltastack.torch)
  expect_ok(check_swiglu({.N = 33, .I = 100, .split = true}));               // split, scalar path
  expect_ok(check_swiglu({.N = 64, .I = 256, .offset = 1, .split = true}));  // split, unaligned
}

// The kernels' sigmoid (core/cuda/kernel_utils.cuh sigmoid_fast_v) gives bitwise what one IEEE division per value
// gives: h and the gradients, vector and scalar paths, with gates of std 2 and of std 60 (far below -87, where
// 1 + e^-g >= 2^126 takes the division).
TEST(CudaOps, SwigluSigmoidFormsAreBitwiseEqual) {
  DS_SKIP_WITHOUT_GPU();
  expect_ok(check_swiglu({.N = 512, .I = 6144, .division = true}));
  expect_ok(check_swiglu({.N = 256, .I = 2048, .gate_std = 60, .division = true}));
  expect_ok(check_swiglu({.N = 33, .I = 100, .gate_std = 60, .division = true}));
}

// ------------------------------------------------------------------------------------------------ gdn gates

TEST(CudaOps, GdnGate) {
  DS_SKIP_WITHOUT_GPU();
  expect_ok(check_gdn_gate({.N = 8192, .Hv = 32}));
  expect_ok(check_gdn_gate({.N = 37, .Hv = 48}));  // more heads than one 32-wide chunk
  expect_ok(check_gdn_gate({.N = 70, .Hv = 5}));
  expect_ok(check_gdn_gate({.N = 1, .Hv = 16}));
}

// ------------------------------------------------------------------------------------------------ embedding

TEST(CudaOps, Embedding) {
  DS_SKIP_WITHOUT_GPU();
  expect_ok(check_embedding({.N = 4096, .V = 1000, .H = 2048, .distinct = 300}));  // duplicates; id 7 every 5th
  expect_ok(check_embedding({.N = 300, .V = 50, .H = 5120, .distinct = 50}));
  expect_ok(check_embedding({.N = 50, .V = 20, .H = 100, .distinct = 20}));               // H % 8 != 0: scalar path
  expect_ok(check_embedding({.N = 64, .V = 30, .H = 256, .distinct = 30, .offset = 1}));  // unaligned: scalar path
}

// ------------------------------------------------------------------------------------------------ conv1d

TEST(CudaOps, Conv1dPacked) {
  DS_SKIP_WITHOUT_GPU();
  // Qwen3.5 conv_dim; documents span the backward slots
  expect_ok(check_conv1d({.lens = {}, .N = 2048, .max_doc = 600, .C = 10240, .K = 4}));
  // many documents shorter than K
  expect_ok(check_conv1d({.lens = {}, .N = 1000, .max_doc = 6, .C = 512, .K = 4}));
  // C % 8 != 0: scalar forward, 4-channel backward
  expect_ok(check_conv1d({.lens = {}, .N = 37, .max_doc = 5, .C = 36, .K = 4}));
  // C % 4 != 0: scalar both ways, K = 3
  expect_ok(check_conv1d({.lens = {}, .N = 37, .max_doc = 9, .C = 34, .K = 3}));
  // unaligned: scalar both ways
  expect_ok(check_conv1d({.lens = {}, .N = 100, .max_doc = 40, .C = 64, .K = 4, .offset = 1}));
  // K = 2
  expect_ok(check_conv1d({.lens = {}, .N = 300, .max_doc = 50, .C = 128, .K = 2}));
  // fewer tokens than K - 1 + one tile
  expect_ok(check_conv1d({.lens = {}, .N = 5, .max_doc = 100, .C = 16, .K = 4}));
}

// The kernels' sigmoid (core/cuda/kernel_utils.cuh sigmoid_fast_v: the division's fast path for a thread's values,
// one branch to the division for those outside it) gives bitwise what one IEEE division per value gives: y, dx, dw,
// at the 2B layer's conv_dim (16-byte forward, 8-byte backward) and on the scalar path, with x of std 1 and of std 60
// (pre-activations far below -87, where 1 + e^-p >= 2^126 takes the division, and far above).
TEST(CudaOps, Conv1dSigmoidFormsAreBitwiseEqual) {
  DS_SKIP_WITHOUT_GPU();
  expect_ok(check_conv1d({.lens = {}, .N = 3000, .max_doc = 700, .C = 6144, .K = 4, .division = true}));
  expect_ok(check_conv1d({.lens = {}, .N = 2000, .max_doc = 300, .C = 512, .K = 4, .x_std = 60, .division = true}));
  expect_ok(check_conv1d({.lens = {}, .N = 300, .max_doc = 40, .C = 34, .K = 3, .x_std = 60, .division = true}));
}

// ------------------------------------------------------------------------------------------------ rope

// Random documents of up to 400 tokens (positions restart at each).
TEST(CudaOps, Rope) {
  DS_SKIP_WITHOUT_GPU();
  // Qwen3.5: 25% of head_dim 256 rotates
  expect_ok(check_rope({.lens = {}, .N = 1024, .H = 16, .head_dim = 256, .rotary_dim = 64}));
  // full rotation
  expect_ok(check_rope({.lens = {}, .N = 512, .H = 4, .head_dim = 128, .rotary_dim = 128}));
  // half % 8 != 0: scalar path
  expect_ok(check_rope({.lens = {}, .N = 77, .H = 3, .head_dim = 72, .rotary_dim = 36}));
  // unaligned: scalar path
  expect_ok(check_rope({.lens = {}, .N = 64, .H = 2, .head_dim = 256, .rotary_dim = 64, .offset = 1}));
}

// ------------------------------------------------------------------------------------------------ adamw

TEST(CudaOps, AdamW) {
  DS_SKIP_WITHOUT_GPU();
  expect_ok(check_adamw({.n = 1000003}));                   // float4 body + scalar tail; sum_squares many blocks
  expect_ok(check_adamw({.n = 9000011}));                   // many blocks
  expect_ok(check_adamw({.n = 4096, .with_bf16 = false}));  // no bf16 copy
  expect_ok(check_adamw({.n = 1001, .offset = 1}));         // unaligned: scalar path
  expect_ok(check_adamw({.n = 3}));                         // shorter than a vector
}

TEST(CudaOps, AdamWBf16State) {
  DS_SKIP_WITHOUT_GPU();
  expect_ok(check_adamw_bf16({.n = 1000003}));            // 4-wide body + scalar tail
  expect_ok(check_adamw_bf16({.n = 9000011}));            // many blocks
  expect_ok(check_adamw_bf16({.n = 1001, .offset = 1}));  // unaligned: scalar path
  expect_ok(check_adamw_bf16({.n = 3}));                  // shorter than a vector
}

// The 8-bit state: kernel bitwise the CPU reference over three steps (ops/adamw/q8_state.h), with both of the
// kernel's code searches (ops/adamw/cuda.h q8_binary_search: the bucketed count by default, the binary search the
// CPU reference runs).
TEST(CudaOps, AdamW8bitState) {
  DS_SKIP_WITHOUT_GPU();
  const bool saved = ds::ops::cuda::q8_binary_search();
  for (bool search : {false, true}) {
    SCOPED_TRACE(search ? "binary search" : "bucketed");
    ds::ops::cuda::q8_binary_search() = search;
    // moments and gradients over 35-40 decades, zeros, blocks of zero gradients and zero state (cuda_check.h wide)
    expect_ok(check_adamw_8bit({.n = 1000003, .seed = 8, .wide = true}));
    expect_ok(check_adamw_8bit({.n = 1000003}));              // many blocks, partial first and last (index0 1001: lanes element by element)
    expect_ok(check_adamw_8bit({.n = 1000003, .seed = 8}));   // index0 1008: the 8-element vector path, partial ends
    // index0 1004: every lane's fp32 gradients 16-byte aligned, its bf16 weights and codes not: the update goes element
    // by element where the standalone sum of squares (and its fp32 read of bf16 gradients) loads 8 at once
    expect_ok(check_adamw_8bit({.n = 1000003, .seed = 4}));
    expect_ok(check_adamw_8bit({.n = 9000011, .seed = 2}));   // many CUDA blocks
    expect_ok(check_adamw_8bit({.n = 1001, .offset = 1}));    // unaligned pointers (element by element)
    expect_ok(check_adamw_8bit({.n = 3}));                    // one short block
    expect_ok(check_adamw_8bit({.n = 256, .seed = 24}));      // index0 1024: exactly one whole block
  }
  ds::ops::cuda::q8_binary_search() = saved;
}

// --gradients bf16's kernels (ops/adamw/cuda.h): the stochastic-rounded accumulation is bitwise the host's
// (ops::accumulate_grad_bf16), and the sum of squares and the AdamW updates of the three states reading the bf16
// gradients are bitwise the fp32-gradient kernels given the widened values; aligned (vector path) and shifted by one
// element (scalar path).
TEST(CudaOps, Bf16GradientKernels) {
  DS_SKIP_WITHOUT_GPU();
  namespace C = ds::ops::check;
  namespace K = ds::ops::cuda;
  using C::Buf;
  for (const size_t offset : {size_t{0}, size_t{1}}) {
    SCOPED_TRACE("offset " + std::to_string(offset));
    C::Ctx ctx(7 + offset);
    const int64_t n = 100003, index0 = 1000;
    const uint64_t key = bf16_state::grad_key(3, 1);
    const C::Vec acc0 = ctx.randn_bf16(n, 1e-2), g = ctx.randn(n, 1e-3);
    C::Bits want(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) want[i] = ds::f32_to_bf16_bits(acc0[i]);
    accumulate_grad_bf16(want.data(), g.data(), n, key, index0);
    Buf<C::bf16> acc_d = ctx.up_bf16(acc0, offset);
    Buf<float> g_d = ctx.up(g, offset);
    K::accumulate_grad_bf16(acc_d.get(), g_d.get(), n, key, index0, ctx.s);
    ASSERT_TRUE(ctx.bits(acc_d) == want);
    Buf<float> gw_d = ctx.up(C::to_f32(want), offset);  // the same gradients in fp32
    const C::bf16* gb = acc_d.get();
    const float* gf = gw_d.get();

    Buf<double> s1(1), s2(1);
    Buf<unsigned char> scratch(K::sum_squares_scratch_bytes(n));
    K::sum_squares(gb, n, s1.get(), scratch.get(), ctx.s);
    const std::vector<double> ss_b = ctx.down(s1);
    K::sum_squares(gf, n, s2.get(), scratch.get(), ctx.s);
    EXPECT_EQ(ss_b, ctx.down(s2));

    const C::Vec p0 = ctx.randn(n, 0.02), m0 = ctx.randn(n, 1e-3), v0 = ctx.uniform(n, 0, 1e-6);
    const AdamWParams hp{3e-4, 0.9, 0.95, 1e-8, 0.1, 17, 0.7};
    auto run_fp32 = [&](const auto* grad) {
      Buf<float> p = ctx.up(p0, offset), m = ctx.up(m0, offset), v = ctx.up(v0, offset);
      Buf<C::bf16> pb(static_cast<size_t>(n), offset);
      K::adamw_update(p.get(), grad, m.get(), v.get(), pb.get(), n, hp, ctx.s);
      return std::make_tuple(ctx.down(p), ctx.down(m), ctx.down(v), ctx.bits(pb));
    };
    EXPECT_TRUE(run_fp32(gb) == run_fp32(gf));
    auto run_bf16 = [&](const auto* grad) {
      Buf<C::bf16> p = ctx.up_bf16(p0, offset), m = ctx.up_bf16(m0, offset), v = ctx.up_bf16(v0, offset);
      K::adamw_update_bf16(p.get(), grad, m.get(), v.get(), n, hp, index0, ctx.s);
      return std::make_tuple(ctx.bits(p), ctx.bits(m), ctx.bits(v));
    };
    EXPECT_TRUE(run_bf16(gb) == run_bf16(gf));
    auto run_8bit = [&](const auto* grad) {  // from zero moments (zero codes and scales)
      const size_t nb = static_cast<size_t>(q8_state::num_blocks(index0, n));
      Buf<C::bf16> p = ctx.up_bf16(p0, offset);
      Buf<uint8_t> mc(static_cast<size_t>(n), offset), vc(static_cast<size_t>(n), offset);
      Buf<float> ma(nb), va(nb);
      for (void* x : {static_cast<void*>(mc.get()), static_cast<void*>(vc.get())})
        DS_CUDA_CHECK(cudaMemsetAsync(x, 0, static_cast<size_t>(n), ctx.s));
      for (float* x : {ma.get(), va.get()}) DS_CUDA_CHECK(cudaMemsetAsync(x, 0, nb * sizeof(float), ctx.s));
      K::adamw_update_8bit(p.get(), grad, mc.get(), vc.get(), ma.get(), va.get(), n, hp, index0, ctx.s);
      return std::make_tuple(ctx.bits(p), ctx.down(mc), ctx.down(vc), ctx.down(ma), ctx.down(va));
    };
    EXPECT_TRUE(run_8bit(gb) == run_8bit(gf));
  }
}

// ------------------------------------------------------------------------------------------------ elementwise

TEST(CudaOps, Elementwise) {
  DS_SKIP_WITHOUT_GPU();
  expect_ok(check_elementwise({.n = (1 << 20) + 3}));      // 16-byte body + scalar tail
  expect_ok(check_elementwise({.n = 1001, .offset = 1}));  // unaligned: scalar path
  expect_ok(check_elementwise({.n = 5}));
}

TEST(CudaOps, CopyRows) {
  DS_SKIP_WITHOUT_GPU();
  // one slice of a fused projection output
  expect_ok(check_copy_rows(
      {.rows = 1000, .cols = 2048, .src_stride = 6144, .src_col = 0, .dst_stride = 2048, .dst_col = 0}));
  expect_ok(check_copy_rows({.rows = 100, .cols = 64, .src_stride = 96, .src_col = 0, .dst_stride = 80, .dst_col = 0}));
  // more rows than one grid dimension holds
  expect_ok(check_copy_rows({.rows = 70000, .cols = 8, .src_stride = 16, .src_col = 0, .dst_stride = 8, .dst_col = 0}));
  // scalar path
  expect_ok(check_copy_rows({.rows = 37, .cols = 13, .src_stride = 20, .src_col = 0, .dst_stride = 15, .dst_col = 0}));
  // unaligned: scalar path
  expect_ok(check_copy_rows(
      {.rows = 37, .cols = 64, .src_stride = 64, .src_col = 0, .dst_stride = 64, .dst_col = 0, .offset = 1}));
}

}  // namespace

#endif  // DELTASTACK_CUDA
