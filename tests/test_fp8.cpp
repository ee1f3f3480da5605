// `--precision fp8` (docs/fp8.md). On the CPU (CI): the E4M3 / E5M2 casts of core/fp8.h against known codes, an
// independent nearest-value search over every finite code (ties to the even code), NVIDIA's own host conversion
// (cuda_fp8.h) where the build has CUDA, the per-tensor scale's edge cases; the CPU engine under Precision::Fp8
// (deterministic, near the fp32 result, not equal to it). On a GPU: the hardware casts against the emulation for
// every bf16 value in range, the FP8 linear layer's check (ops/linear/fp8_check.h), and the GPU engine in fp8
// against the CPU engine's emulation.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <cstdio>
#include <cstdint>
#include <limits>
#include <vector>

#include "core/bf16.h"
#include "core/fp8.h"
#include "core/rng.h"
#include "model/config.h"
#include "model/model.h"
#include "test_util.h"
#include "train_test_util.h"

#ifdef DELTASTACK_CUDA
#include <cuda_fp8.h>

#include "cuda_test_util.h"
#include "model/engine.h"
#include "model/gpu_model.h"
#include "ops/conv1d/cuda.h"
#include "ops/elementwise/cuda.h"
#include "ops/gated_rmsnorm/cuda.h"
#include "ops/rmsnorm/cuda.h"
#include "ops/swiglu/cuda.h"
#include "ops/linear/fp8.h"
#include "ops/linear/fp8_check.h"
#endif

namespace {

using ds::Fp8Format;
using ds::fp8_decode;
using ds::fp8_encode;
constexpr Fp8Format E4 = Fp8Format::E4M3, E5 = Fp8Format::E5M2;

// Random token ids packed as documents with these cu_seqlens; each position predicts the next token of its document.
ds::PackedBatch random_batch(const std::vector<int32_t>& cu, uint64_t vocab, uint64_t seed) {
  ds::PackedBatch b;
  ds::Rng rng(seed);
  b.cu_seqlens = cu;
  const int32_t n = cu.back();
  for (int32_t t = 0; t < n; ++t) b.input_ids.push_back(static_cast<int32_t>(rng.below(vocab)));
  b.targets.assign(static_cast<size_t>(n), -100);
  for (size_t s = 0; s + 1 < cu.size(); ++s)
    for (int32_t t = cu[s]; t + 1 < cu[s + 1]; ++t) b.targets[static_cast<size_t>(t)] = b.input_ids[static_cast<size_t>(t + 1)];
  b.finalize("fp8 test batch");
  return b;
}

TEST(Fp8, KnownCodes) {
  // E4M3: 1 = 0.0111.000; 448 the largest finite; 464 halfway to the next binade step rounds to even (448);
  // anything larger, infinities included, saturates; 2^-9 the smallest subnormal, 2^-10 a tie that rounds to 0.
  EXPECT_EQ(fp8_encode(1.0f, E4), 0x38);
  EXPECT_EQ(fp8_encode(-1.0f, E4), 0xb8);
  EXPECT_EQ(fp8_encode(448.0f, E4), 0x7e);
  EXPECT_EQ(fp8_encode(464.0f, E4), 0x7e);
  EXPECT_EQ(fp8_encode(1e30f, E4), 0x7e);
  EXPECT_EQ(fp8_encode(std::numeric_limits<float>::infinity(), E4), 0x7e);
  EXPECT_EQ(fp8_encode(-std::numeric_limits<float>::infinity(), E4), 0xfe);
  EXPECT_EQ(fp8_encode(std::numeric_limits<float>::quiet_NaN(), E4), 0x7f);
  EXPECT_EQ(fp8_encode(std::ldexp(1.0f, -9), E4), 0x01);
  EXPECT_EQ(fp8_encode(std::ldexp(1.0f, -10), E4), 0x00);
  EXPECT_EQ(fp8_encode(std::ldexp(3.0f, -11), E4), 0x01);       // 0.75 of the subnormal step
  EXPECT_EQ(fp8_encode(std::ldexp(3.0f, -10), E4), 0x02);       // 1.5 steps: tie to the even code 2
  EXPECT_EQ(fp8_encode(1.0625f, E4), 0x38);                     // halfway between 1 and 1.125: even (1)
  EXPECT_EQ(fp8_encode(1.1875f, E4), 0x3a);                     // halfway between 1.125 and 1.25: even (1.25)
  EXPECT_EQ(fp8_encode(-0.0f, E4), 0x80);
  EXPECT_FLOAT_EQ(fp8_decode(0x7e, E4), 448.0f);
  EXPECT_FLOAT_EQ(fp8_decode(0x01, E4), std::ldexp(1.0f, -9));
  EXPECT_TRUE(std::isnan(fp8_decode(0x7f, E4)));
  EXPECT_TRUE(std::isnan(fp8_decode(0xff, E4)));
  // E5M2: 1 = 0.01111.00; 57344 the largest finite; 61440 (a tie between 57344 and 65536) rounds to the even
  // 65536, which saturates; 2^-16 the smallest subnormal; exponent 31 holds the infinities and NaNs.
  EXPECT_EQ(fp8_encode(1.0f, E5), 0x3c);
  EXPECT_EQ(fp8_encode(57344.0f, E5), 0x7b);
  EXPECT_EQ(fp8_encode(61440.0f, E5), 0x7b);
  EXPECT_EQ(fp8_encode(std::numeric_limits<float>::infinity(), E5), 0x7b);
  EXPECT_EQ(fp8_encode(std::ldexp(1.0f, -16), E5), 0x01);
  EXPECT_EQ(fp8_encode(std::ldexp(1.0f, -17), E5), 0x00);
  EXPECT_TRUE(std::isinf(fp8_decode(0x7c, E5)));
  EXPECT_TRUE(std::isnan(fp8_decode(0x7d, E5)));
  EXPECT_FLOAT_EQ(fp8_decode(0x7b, E5), 57344.0f);
}

// Every finite code decodes to a value that encodes back to it; and for random values over the whole range the
// code is the nearest finite value by an exhaustive search in double (ties: the even code), saturated.
TEST(Fp8, NearestEvenAgainstExhaustiveSearch) {
  for (Fp8Format f : {E4, E5}) {
    std::vector<std::pair<double, uint8_t>> finite;  // non-negative finite values and their codes
    for (int c = 0; c < 256; ++c) {
      const float v = fp8_decode(static_cast<uint8_t>(c), f);
      if (!std::isfinite(v)) continue;
      if (c != 0x80) {
        EXPECT_EQ(fp8_encode(v, f), c) << ds::fp8_format_name(f) << " code " << c;
      }
      if (c < 0x80) finite.emplace_back(v, static_cast<uint8_t>(c));
    }
    ds::Rng rng(5);
    const double maxv = ds::fp8_max(f);
    for (int i = 0; i < 200000; ++i) {
      // log-uniform magnitudes over the format's range and beyond, some exactly halfway between two codes
      const double mag = std::ldexp(1.0, static_cast<int>(rng.below(40)) - 24) * (1.0 + rng.uniform());
      float x = static_cast<float>(mag);
      if (i % 7 == 0) {
        const size_t k = rng.below(finite.size() - 1);
        x = static_cast<float>((finite[k].first + finite[k + 1].first) / 2);
      }
      double best = -1;
      uint8_t code = 0;
      for (const auto& [v, c] : finite) {
        const double d = std::fabs(v - x), bd = std::fabs(best - x);
        if (best < 0 || d < bd || (d == bd && (c & 1) == 0)) best = v, code = c;
      }
      if (x > maxv) code = static_cast<uint8_t>(f == E4 ? 0x7e : 0x7b);
      ASSERT_EQ(fp8_encode(x, f), code) << ds::fp8_format_name(f) << " x " << x;
      ASSERT_EQ(fp8_encode(-x, f), code | 0x80) << ds::fp8_format_name(f) << " x " << -x;
    }
  }
}

TEST(Fp8, PerTensorScale) {
  EXPECT_EQ(ds::fp8_inv_scale(0.0f, E4), 1.0f);  // all zeros: any scale; 1 keeps them zero
  EXPECT_EQ(ds::fp8_inv_scale(448.0f, E4), 1.0f);
  EXPECT_EQ(ds::fp8_inv_scale(2.0f, E5), 28672.0f);
  EXPECT_TRUE(std::isnan(ds::fp8_inv_scale(std::numeric_limits<float>::quiet_NaN(), E4)));
  EXPECT_TRUE(std::isnan(ds::fp8_inv_scale(std::numeric_limits<float>::infinity(), E4)));
  EXPECT_EQ(ds::fp8_inv_scale(1e-44f, E4), 3.402823466e38f);  // a subnormal amax: the largest finite multiplier
  // The amax lands on the largest finite value, a NaN anywhere makes the whole cast NaN.
  std::vector<float> x = {0.5f, -3.0f, 1e-3f, 2.25f};
  const float amax = ds::fp8_amax(x.data(), 4);
  EXPECT_EQ(amax, 3.0f);
  ds::fp8_fake_quantize(x.data(), 4, E4, amax);
  EXPECT_FLOAT_EQ(x[1], -3.0f);
  EXPECT_NE(x[2], 1e-3f);  // 1e-3 * 448 / 3 is not an E4M3 value
  EXPECT_NEAR(x[2], 1e-3f, 1e-3f * 0.07f);
  std::vector<float> y = {1.0f, std::numeric_limits<float>::quiet_NaN()};
  EXPECT_TRUE(std::isnan(ds::fp8_amax(y.data(), 2)));
  ds::fp8_fake_quantize(y.data(), 2, E4, ds::fp8_amax(y.data(), 2));
  EXPECT_TRUE(std::isnan(y[0]));
}

#ifdef DELTASTACK_CUDA
// NVIDIA's own conversion (cuda_fp8.h, its host path here) agrees with the emulation code for code, over every
// bf16 value and a sweep of fp32 values around each code's rounding boundaries.
TEST(Fp8, MatchesCudaFp8HostConversion) {
  auto nv = [](float x, Fp8Format f) {
    return static_cast<uint8_t>(__nv_cvt_float_to_fp8(x, __NV_SATFINITE, f == E4 ? __NV_E4M3 : __NV_E5M2));
  };
  for (Fp8Format f : {E4, E5}) {
    for (uint32_t b = 0; b < 65536; ++b) {
      const float x = ds::bf16_bits_to_f32(static_cast<uint16_t>(b));
      if (std::isnan(x)) continue;  // both give a NaN code (tested in KnownCodes)
      ASSERT_EQ(fp8_encode(x, f), nv(x, f)) << ds::fp8_format_name(f) << " x " << x;
    }
    for (int c = 0; c < 0x7f; ++c) {
      const float v = fp8_decode(static_cast<uint8_t>(c), f), w = fp8_decode(static_cast<uint8_t>(c + 1), f);
      if (!std::isfinite(v) || !std::isfinite(w)) continue;
      const float mid = (v + w) / 2;
      for (float x : {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1e9f)})
        ASSERT_EQ(fp8_encode(x, f), nv(x, f)) << ds::fp8_format_name(f) << " x " << x;
    }
  }
}
#endif

// The CPU engine's emulation: deterministic, close to the fp32 model, and really different from it.
TEST(Fp8, CpuEngineEmulatesTheCasts) {
  ds::ModelConfig c = ds::ModelConfig::preset("tiny");
  c.vocab_size = 512;
  ds::Qwen35Model m(c);
  m.init_weights(3);
  const ds::PackedBatch b = random_batch({0, 40, 64}, 512, 9);
  auto run = [&](ds::Precision p) {
    m.set_precision(p);
    m.zero_grads();
    const double loss = m.forward_backward(b, 1.0 / 62).loss_sum / 62;
    return std::make_pair(loss, m.grads());
  };
  const auto ref = run(ds::Precision::Bf16);
  m.set_fp8_lm_head(true);  // --fp8-lm-head: the loss unchanged, the gradients FP8's
  const auto head = run(ds::Precision::Fp8);
  m.set_fp8_lm_head(false);
  const auto a = run(ds::Precision::Fp8), a2 = run(ds::Precision::Fp8);
  EXPECT_EQ(head.first, a.first);
  EXPECT_GT(ds::test::rel_l2(head.second, a.second), 1e-4);
  EXPECT_LT(ds::test::rel_l2(head.second, a.second), 0.3);
  EXPECT_EQ(a.first, a2.first);
  EXPECT_TRUE(a.second == a2.second);
  EXPECT_NE(a.first, ref.first);
  EXPECT_LE(std::abs(a.first - ref.first) / ref.first, 5e-3);
  const double g = ds::test::rel_l2(a.second, ref.second);
  EXPECT_GT(g, 1e-4);
  std::printf("[ measured ] cpu fp8 emulation vs fp32: loss rel %.3e, grads rel L2 %.3e\n", std::abs(a.first - ref.first) / ref.first, g);
  EXPECT_LT(g, 0.3);
}

#ifdef DELTASTACK_CUDA
// The hardware cast (cvt.rn.satfinite through fp8_quantize) against the emulation for every finite bf16 value up
// to the format's largest: a tensor whose amax is the largest finite value casts with scale 1, so each code is
// fp8_encode(x) itself.
TEST(CudaFp8, HardwareCastMatchesEmulationForEveryBf16) {
  DS_SKIP_WITHOUT_GPU();
  using namespace ds::ops::check;
  for (Fp8Format f : {E4, E5}) {
    std::vector<float> xs;
    for (uint32_t b = 0; b < 65536; ++b) {
      const float x = ds::bf16_bits_to_f32(static_cast<uint16_t>(b));
      if (std::isfinite(x) && std::fabs(x) <= ds::fp8_max(f)) xs.push_back(x);
    }
    xs.push_back(ds::fp8_max(f));
    while (xs.size() % 16) xs.push_back(0.0f);
    Ctx ctx(1);
    auto x_d = ctx.up_bf16(xs);
    Buf<uint8_t> q(xs.size());
    Buf<float> amax(1), scale(1);
    const int64_t cols = 16, rows = static_cast<int64_t>(xs.size()) / cols;
    ds::ops::cuda::fp8_amax(x_d.get(), rows, cols, cols, amax.get(), ctx.s);
    ds::ops::cuda::fp8_quantize(x_d.get(), rows, cols, cols, amax.get(), f, q.get(), cols, scale.get(), ctx.s);
    const std::vector<uint8_t> got = ctx.down(q);
    EXPECT_EQ(ctx.down(amax)[0], ds::fp8_max(f));
    EXPECT_EQ(ctx.down(scale)[0], 1.0f);
    size_t bad = 0;
    for (size_t i = 0; i < xs.size(); ++i)
      if (got[i] != fp8_encode(xs[i], f) && bad++ < 5)
        ADD_FAILURE() << ds::fp8_format_name(f) << " x " << xs[i] << ": gpu " << int(got[i]) << " cpu "
                      << int(fp8_encode(xs[i], f));
    EXPECT_EQ(bad, 0u);
  }
}

// fp8_transpose (the FP8-stored frozen base's dgrad operand, model/gpu_fp8.h fp8_stored_base) of a row-major cast
// is bitwise the transposed cast of the same bf16 values with the same amax (fp8_quantize_transpose), zero padding
// rows included: tile edges (rows and columns not multiples of 64), a padded leading dimension, one row.
TEST(CudaFp8, TransposeOfTheCastIsTheTransposedCast) {
  DS_SKIP_WITHOUT_GPU();
  namespace K = ds::ops::cuda;
  using namespace ds::ops::check;
  Ctx ctx(11);
  for (const auto& [rows, cols] : std::vector<std::pair<int64_t, int64_t>>{{256, 512}, {100, 36}, {1, 64}, {777, 132}}) {
    const size_t n = static_cast<size_t>(rows * cols);
    auto x = ctx.up_bf16(ctx.randn_bf16(n, 3.0));
    Buf<float> amax(1), s1(1), s2(1);
    K::fp8_amax(x.get(), rows, cols, cols, amax.get(), ctx.s);
    const int64_t ldqt = K::fp8_padded(rows) + 16;
    Buf<uint8_t> q(n), want(static_cast<size_t>(cols * ldqt)), got(static_cast<size_t>(cols * ldqt));
    DS_CUDA_CHECK(cudaMemsetAsync(got.get(), 0xAB, got.bytes(), ctx.s));  // every byte written by the transpose
    K::fp8_quantize(x.get(), rows, cols, cols, amax.get(), E4, q.get(), cols, s1.get(), ctx.s);
    K::fp8_quantize_transpose(x.get(), rows, cols, cols, amax.get(), E4, want.get(), ldqt, s2.get(), ctx.s);
    K::fp8_transpose(q.get(), rows, cols, cols, got.get(), ldqt, ctx.s);
    const std::vector<uint8_t> g = ctx.down(got), w = ctx.down(want);
    EXPECT_EQ(ctx.down(s1)[0], ctx.down(s2)[0]);
    size_t bad = 0, nonzero = 0;
    for (size_t i = 0; i < g.size(); ++i) {
      nonzero += w[i] != 0;
      if (g[i] != w[i] && bad++ < 5)
        ADD_FAILURE() << rows << " x " << cols << " at column " << i / ldqt << " row " << i % ldqt << ": "
                      << int(g[i]) << " want " << int(w[i]);
    }
    EXPECT_EQ(bad, 0u) << rows << " x " << cols;
    EXPECT_GT(nonzero, n / 2);
  }
}

TEST(CudaFp8, LinearLayerMatchesEmulation) {
  DS_SKIP_WITHOUT_GPU();
  using ds::ops::LinearFp8Case;
  ds::test::cuda::expect_ok(ds::ops::check_linear_fp8, ds::ops::linear_fp8_probe_cases());
  ds::test::cuda::expect_ok(ds::ops::check_linear_fp8,
                            std::vector<LinearFp8Case>{{.M = 1000, .K = 512, .N = 384, .grad = E5, .x_scale = 0.01},
                                                       {.M = 333, .K = 1024, .N = 256, .grad = E4, .x_scale = 3000,
                                                        .accumulate = false, .fast_accum = true}});
}

// The amax the producer kernels fuse (core/cuda/kernel_utils.cuh amax_commit) is bit for bit the amax pass
// (fp8_amax) over what they store: RMSNorm, the gated RMSNorm (forward, and dz in its backward), SwiGLU forward and
// backward, the residual add, the output gate and conv1d's backward (its dx), on their vectorised and scalar paths (an odd width or a pointer off the 16-byte grid), and a NaN
// anywhere in the output wins, as in fp8_amax.
TEST(CudaFp8, FusedAmaxIsTheAmaxPass) {
  DS_SKIP_WITHOUT_GPU();
  namespace K = ds::ops::cuda;
  using namespace ds::ops::check;
  Ctx ctx(5);
  Buf<float> fused(1), pass(1);
  // The amax pass over y [rows, cols] beside the fused value; `what` names the case.
  auto expect_same = [&](const Buf<bf16>& y, int64_t rows, int64_t cols, const char* what) {
    K::fp8_amax(y.get(), rows, cols, cols, pass.get(), ctx.s);
    const float f = ctx.down(fused)[0], p = ctx.down(pass)[0];
    uint32_t fb, pb;
    std::memcpy(&fb, &f, 4);
    std::memcpy(&pb, &p, 4);
    EXPECT_EQ(fb, pb) << what << ": fused " << f << " amax pass " << p;
    EXPECT_GT(p, 0.0f) << what;
  };
  auto zero = [&] { DS_CUDA_CHECK(cudaMemsetAsync(fused.get(), 0, sizeof(float), ctx.s)); };
  for (const int64_t dim : {2048, 256, 100}) {
    for (const size_t off : {size_t(0), size_t(1)}) {
      const int64_t rows = 37;
      const size_t n = static_cast<size_t>(rows * dim);
      auto x = ctx.up_bf16(ctx.randn_bf16(n, 2.0), off), z = ctx.up_bf16(ctx.randn_bf16(n), off);
      auto w = ctx.up(ctx.randn(static_cast<size_t>(dim), 0.3));
      Buf<bf16> y(n, off);
      Buf<float> rstd(static_cast<size_t>(rows));
      const std::string tag = "dim " + std::to_string(dim) + (off ? " unaligned" : "");
      zero();
      K::rmsnorm_forward(x.get(), w.get(), y.get(), rstd.get(), rows, dim, 1e-6f, true, ctx.s, fused.get());
      expect_same(y, rows, dim, ("rmsnorm " + tag).c_str());
      zero();
      K::gated_rmsnorm_forward(x.get(), z.get(), w.get(), y.get(), rstd.get(), rows, dim, 1e-6f, ctx.s, fused.get());
      expect_same(y, rows, dim, ("gated rmsnorm " + tag).c_str());
      zero();
      K::add(x.get(), z.get(), y.get(), static_cast<int64_t>(n), ctx.s, fused.get());
      expect_same(y, rows, dim, ("add " + tag).c_str());
      zero();
      K::output_gate_forward(x.get(), z.get(), y.get(), static_cast<int64_t>(n), ctx.s, fused.get());
      expect_same(y, rows, dim, ("output gate " + tag).c_str());
      // SwiGLU: gu [rows, 2 dim] -> h [rows, dim]; backward dh -> dgu [rows, 2 dim]
      auto gu = ctx.up_bf16(ctx.randn_bf16(2 * n, 2.0), off);
      Buf<bf16> dgu(2 * n, off);
      zero();
      K::swiglu_forward(gu.get(), y.get(), rows, dim, ctx.s, fused.get());
      expect_same(y, rows, dim, ("swiglu " + tag).c_str());
      zero();
      K::swiglu_backward(gu.get(), x.get(), dgu.get(), rows, dim, ctx.s, fused.get());
      expect_same(dgu, rows, 2 * dim, ("swiglu backward " + tag).c_str());
      // gated RMSNorm backward: the amax of dz (in_proj_z's output gradient)
      Buf<bf16> dxg(n, off);
      Buf<float> dw(static_cast<size_t>(dim));
      DS_CUDA_CHECK(cudaMemsetAsync(dw.get(), 0, dw.bytes(), ctx.s));  // accumulated into
      Buf<unsigned char> scratch(K::gated_rmsnorm_scratch_bytes(rows, dim));
      K::gated_rmsnorm_forward(x.get(), z.get(), w.get(), y.get(), rstd.get(), rows, dim, 1e-6f, ctx.s);
      zero();
      K::gated_rmsnorm_backward(x.get(), z.get(), w.get(), rstd.get(), gu.get(), dxg.get(), y.get(), dw.get(), rows,
                                dim, scratch.get(), ctx.s, fused.get());
      expect_same(y, rows, dim, ("gated rmsnorm backward dz " + tag).c_str());
      // conv1d + SiLU backward (kernel 4, two documents): the amax of dx (in_proj_qkv's output gradient)
      std::vector<int32_t> starts(static_cast<size_t>(rows));
      for (int64_t t = 0; t < rows; ++t) starts[static_cast<size_t>(t)] = t < 20 ? 0 : 20;
      auto ss = ctx.up(starts);
      auto cw = ctx.up(ctx.randn(static_cast<size_t>(dim * 4), 0.5));
      Buf<float> cdw(static_cast<size_t>(dim * 4));
      DS_CUDA_CHECK(cudaMemsetAsync(cdw.get(), 0, cdw.bytes(), ctx.s));
      Buf<unsigned char> cscratch(K::conv1d_scratch_bytes(rows, dim, 4));
      zero();
      K::conv1d_silu_backward(x.get(), cw.get(), z.get(), ss.get(), y.get(), cdw.get(), rows, dim, 4, cscratch.get(),
                              ctx.s, fused.get());
      expect_same(y, rows, dim, ("conv1d backward " + tag).c_str());
    }
  }
  // A NaN in the output: both amaxes are NaN.
  const int64_t n = 4096;
  ds::ops::check::Vec a = ctx.randn_bf16(n), b = ctx.randn_bf16(n);
  a[1234] = std::numeric_limits<float>::quiet_NaN();
  auto ad = ctx.up_bf16(a), bd = ctx.up_bf16(b);
  Buf<bf16> y(static_cast<size_t>(n));
  zero();
  K::add(ad.get(), bd.get(), y.get(), n, ctx.s, fused.get());
  K::fp8_amax(y.get(), 1, n, n, pass.get(), ctx.s);
  EXPECT_TRUE(std::isnan(ctx.down(fused)[0]));
  EXPECT_TRUE(std::isnan(ctx.down(pass)[0]));
}

// The amax table and the fused amax (DELTASTACK_FP8_AMAX=fused, the default) against an amax pass before every cast
// (=separate): bitwise the same losses, gradients and weights over steps with updates between them (a weight's amax
// is recomputed after its update), with every recompute policy (the backward's casts reuse the forward's amax). And
// the policies against each other: recompute none keeps the FP8-only GEMM inputs as their transposed FP8 casts
// (model/gpu_fp8.h fp8_keeps_inputs), the others rebuild them and cast again, bitwise the same.
TEST(CudaFp8, FusedAmaxStepIsBitwiseTheSeparatePasses) {
  DS_SKIP_WITHOUT_GPU();
  ds::ModelConfig cfg = ds::ModelConfig::preset("tiny");
  cfg.vocab_size = 4096;
  ds::Qwen35Model host(cfg);
  host.init_weights(23);
  const ds::PackedBatch b = random_batch({0, 100, 101, 256}, 4096, 5);
  std::pair<std::vector<double>, std::vector<float>> first;
  for (const ds::Recompute rc :
       {ds::Recompute::None, ds::Recompute::Selective, ds::Recompute::Mlp, ds::Recompute::Full}) {
    SCOPED_TRACE(ds::recompute_name(rc));
    auto run = [&](const char* amax) {
      setenv("DELTASTACK_FP8_AMAX", amax, 1);
      ds::GpuPlan plan;
      plan.max_tokens = b.size();
      plan.max_seqs = 3;
      plan.precision = ds::Precision::Fp8;
      plan.recompute = rc;
      std::unique_ptr<ds::Engine> gpu = ds::make_engine("cuda", host, plan);
      unsetenv("DELTASTACK_FP8_AMAX");
      std::vector<double> losses;
      std::vector<float> g;
      ds::ops::AdamWParams ap;
      ap.lr = 1e-2;
      for (int64_t t = 1; t <= 3; ++t) {
        ap.step = t;
        gpu->zero_grads();
        losses.push_back(gpu->forward_backward(b, 1.0 / static_cast<double>(b.num_targets())).loss_sum);
        losses.push_back(gpu->grad_sum_squares());
        gpu->optimizer_step(ap);
      }
      losses.push_back(gpu->forward_backward(b, 0.0).loss_sum);  // an evaluation pass after the last update
      return std::make_pair(losses, ds::test::tensor_values(gpu->weight_tensors(ds::DType::F32)));
    };
    const auto fused = run("fused"), separate = run("separate");
    EXPECT_EQ(fused.first, separate.first);
    EXPECT_TRUE(fused.second == separate.second);
    EXPECT_NE(fused.first[0], fused.first[2]);  // the updates moved the loss
    if (rc == ds::Recompute::None) {
      first = fused;
    } else {
      EXPECT_EQ(fused.first, first.first) << "against recompute none (the FP8-kept inputs)";
      EXPECT_TRUE(fused.second == first.second) << "against recompute none (the FP8-kept inputs)";
    }
  }
}

// The GPU engine's loss and gradients of one forward_backward of `b` (grad_scale `scale`) from `cpu`'s weights.
std::pair<double, std::vector<float>> gpu_step(const ds::Qwen35Model& cpu, const ds::PackedBatch& b, double scale,
                                               ds::Precision p, bool fp8_lm_head = false) {
  ds::GpuPlan plan;
  plan.max_tokens = b.size();
  plan.max_seqs = 3;
  plan.precision = p;
  plan.fp8_lm_head = fp8_lm_head;
  ds::GpuModel gpu(cpu, plan);
  EXPECT_EQ(gpu.precision(), p);
  const ds::LossResult r = gpu.forward_backward(b, scale);
  std::vector<float> g;
  gpu.download_grads(g);
  return {r.loss_sum, g};
}

// The GPU engine with --precision fp8 against the CPU engine's emulation of the same casts (bf16 activations on the
// GPU move some values across an fp8 rounding boundary: a wider band than bf16's), deterministic, and really FP8
// (not the bf16 engine's result). With --fp8-lm-head too: the loss bitwise the FP8 engine's without it (the logits
// stay exact), the gradients the CPU's emulation of the head's casts, deterministic, and not those without it.
TEST(CudaFp8, EngineMatchesCpuEmulation) {
  DS_SKIP_WITHOUT_GPU();
  ds::ModelConfig c = ds::ModelConfig::preset("tiny");
  c.vocab_size = 4096;
  ds::Qwen35Model cpu(c);
  cpu.init_weights(11);
  const ds::PackedBatch b = random_batch({0, 100, 101, 256}, 4096, 4);
  const double scale = 1.0 / static_cast<double>(b.num_targets());
  auto cpu_step = [&](bool fp8_lm_head) {
    cpu.set_precision(ds::Precision::Fp8);
    cpu.set_fp8_lm_head(fp8_lm_head);
    cpu.zero_grads();
    const ds::LossResult r = cpu.forward_backward(b, scale);
    return std::make_pair(r.loss_sum, cpu.grads());
  };
  const auto ref = cpu_step(false), ref_head = cpu_step(true);
  const auto f1 = gpu_step(cpu, b, scale, ds::Precision::Fp8), f2 = gpu_step(cpu, b, scale, ds::Precision::Fp8),
             bf = gpu_step(cpu, b, scale, ds::Precision::Bf16);
  std::printf("[ measured ] fp8 engine: loss rel diff vs CPU emulation %.3e, grads rel L2 %.3e; vs bf16 engine "
              "loss %.3e grads %.3e\n", std::abs(f1.first - ref.first) / ref.first, ds::test::rel_l2(f1.second, ref.second),
              std::abs(f1.first - bf.first) / bf.first, ds::test::rel_l2(f1.second, bf.second));
  EXPECT_LE(std::abs(f1.first - ref.first) / ref.first, 1e-2);
  EXPECT_LE(ds::test::rel_l2(f1.second, ref.second), 8e-2);
  EXPECT_EQ(f1.first, f2.first);
  EXPECT_TRUE(f1.second == f2.second);
  EXPECT_NE(f1.first, bf.first);

  const auto h1 = gpu_step(cpu, b, scale, ds::Precision::Fp8, true), h2 = gpu_step(cpu, b, scale, ds::Precision::Fp8, true);
  std::printf("[ measured ] fp8 lm head: grads rel L2 %.3e vs its CPU emulation, %.3e vs the fp8 engine without it\n",
              ds::test::rel_l2(h1.second, ref_head.second), ds::test::rel_l2(h1.second, f1.second));
  EXPECT_EQ(h1.first, f1.first);
  EXPECT_LE(ds::test::rel_l2(h1.second, ref_head.second), 8e-2);
  EXPECT_TRUE(h1.second == h2.second);
  EXPECT_FALSE(h1.second == f1.second);
}

// The FP8 lm head's own gradient in the engine: an untied head's dW over 1000 tokens (one chunk, the casts of h
// padded to 1008), against the CPU engine's emulation and against the GPU's bf16 head. Its distance to the emulation
// is mostly the FP8 decoder's (h itself differs between the engines as in EngineMatchesCpuEmulation: 6.8e-2 over all
// gradients); the head's casts alone match their emulation to 1.2e-4 (dW) and 1.7e-3 (dh) in
// CudaLinearCrossEntropy.MatchesCpu. Measured on the H200 (tenth session): 4.48e-2 to the emulation, 2.66e-2 to the
// bf16 head (the E5M2 dlogits' rounding).
TEST(CudaFp8, LmHeadGradientIsItsEmulation) {
  DS_SKIP_WITHOUT_GPU();
  ds::ModelConfig c = ds::ModelConfig::preset("tiny");
  c.vocab_size = 4096;
  c.tie_word_embeddings = false;
  ds::Qwen35Model cpu(c);
  cpu.init_weights(12);
  const ds::PackedBatch b = random_batch({0, 300, 301, 1000}, 4096, 5);
  const double scale = 1.0 / static_cast<double>(b.num_targets());
  const int64_t off = cpu.layout().model_offsets().lm_head, n = c.vocab_size * c.hidden_size;
  auto head = [&](const std::vector<float>& g) { return std::vector<float>(g.begin() + off, g.begin() + off + n); };
  cpu.set_precision(ds::Precision::Fp8);
  cpu.set_fp8_lm_head(true);
  cpu.zero_grads();
  cpu.forward_backward(b, scale);
  const std::vector<float> ref = head(cpu.grads());
  const auto on = gpu_step(cpu, b, scale, ds::Precision::Fp8, true), off_ = gpu_step(cpu, b, scale, ds::Precision::Fp8);
  const double to_emulation = ds::test::rel_l2(head(on.second), ref), to_bf16 = ds::test::rel_l2(head(on.second), head(off_.second));
  std::printf("[ measured ] fp8 lm head dW: rel L2 %.3e vs its CPU emulation, %.3e vs the bf16 head\n", to_emulation,
              to_bf16);
  // Within the FP8 engine's distance to its emulation, and really the FP8 head's (apart from the bf16 head's).
  EXPECT_LE(to_emulation, 6e-2);
  EXPECT_GE(to_bf16, 1e-2);
}
#endif

}  // namespace
