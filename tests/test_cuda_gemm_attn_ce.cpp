// GPU tests: cuBLASLt linear layers and general gemm, the fused linear + cross-entropy, and causal GQA attention
// over packed sequences (the simple kernel and cuDNN's fused SDPA), through the op checks of
// src/ops/{linear,linear_cross_entropy,attention}/cuda_check.h (the functions the registry's start-up probes run:
// fp32 CPU references on the same bf16-rounded inputs, fixed seeds, outputs poisoned with NaN, two identical runs
// bitwise equal), plus the general gemm and cuDNN's bucket plan directly. Every test skips without a device
// (BucketPlan is host math and always runs). On a GPU machine:
//   deltastack_tests --gtest_filter='CudaLinear*:CudaGemm*:CudaLinearCrossEntropy*:CudaAttention*:CudnnAttention*'
#ifdef DELTASTACK_CUDA

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "core/bf16.h"
#include "core/cuda/cuda_utils.h"
#include "core/fp8.h"
#include "core/rng.h"
#include "cuda_test_util.h"
#include "ops/attention/cuda_check.h"
#include "ops/attention/cudnn.h"
#include "ops/linear/cuda.h"
#include "ops/linear/cuda_check.h"
#include "ops/linear/fp8.h"
#include "ops/linear_cross_entropy/cuda_check.h"

using namespace ds::ops;
using namespace ds::ops::check;
using ds::rel_l2;
using ds::test::cuda::expect_ok;

namespace {

// ---------------------------------------------------------------------------------------------------------
// Linear: y, dx (both overwriting and accumulating), dW accumulated

TEST(CudaLinear, ForwardBackwardLarge) {
  DS_SKIP_WITHOUT_GPU();
  expect_ok(check_linear({.M = 4096, .K = 2048, .N = 6144}));
}

TEST(CudaLinear, ForwardBackwardRagged) {
  DS_SKIP_WITHOUT_GPU();
  expect_ok(check_linear({.M = 37, .K = 64, .N = 200}));
}

TEST(CudaLinear, Accumulate) {
  DS_SKIP_WITHOUT_GPU();
  expect_ok(check_linear({.M = 37, .K = 64, .N = 200, .accumulate = true, .seed = 2}));
  expect_ok(check_linear({.M = 1, .K = 8, .N = 8, .accumulate = true}));
}

// General gemm: every transposition, padded leading dimensions, alpha / beta, fp32 and bf16 C.
// The residual stream's add in the GEMM's epilogue (linear_forward's residual, gemm_fp8's C_in): y = x W^T + r, r
// left as it was. bf16: the residual form rounds once, so it is held to one bf16 rounding of |x W^T| + |r| against
// the float64 sum. The older accumulate form (y = r; y += x W^T in place, as the backward's dx accumulation uses) was
// measured on the H200 (2026-12-02) at up to 1.81 of that bound: it rounds x W^T to bf16 before the add, so it is
// held to two roundings, u |x W^T| + u (|x W^T| + |r|). A dropped or doubled residual is off by |r|, far outside
// either bound. FP8: exact integer codes, so the product is exact and the epilogue's add is the only rounding.
TEST(CudaLinear, ResidualInTheEpilogue) {
  DS_SKIP_WITHOUT_GPU();
  Ctx ctx(41);
  const int64_t M = 300, K = 256, N = 384;
  const Vec xh = ctx.randn_bf16(static_cast<size_t>(M * K)), wh = ctx.randn_bf16(static_cast<size_t>(N * K), 0.05),
            rh = ctx.randn_bf16(static_cast<size_t>(M * N), 3.0);
  auto x = ctx.up_bf16(xh), w = ctx.up_bf16(wh), r = ctx.up_bf16(rh), acc = ctx.up_bf16(rh);
  Buf<ds::cuda::bf16> y(static_cast<size_t>(M * N));
  cuda::linear_forward(x.get(), w.get(), y.get(), M, K, N, false, ctx.s, r.get());
  cuda::linear_forward(x.get(), w.get(), acc.get(), M, K, N, true, ctx.s);
  const Vec got = ctx.down_bf16(y), acc_form = ctx.down_bf16(acc), r_after = ctx.down_bf16(r);
  EXPECT_TRUE(r_after == rh);
  for (const auto& [form, vals] : {std::make_pair("residual", &got), std::make_pair("accumulate", &acc_form)}) {
    size_t bad = 0;
    double worst = 0;
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j) {
        double xw = 0;
        for (int64_t k = 0; k < K; ++k) xw += double(xh[i * K + k]) * wh[j * K + k];
        const double want = xw + rh[i * N + j], err = std::abs((*vals)[i * N + j] - want);
        const double one_rounding = (std::abs(xw) + std::abs(rh[i * N + j])) * (1.0 / 256) + 1e-6;
        const double tol = vals == &got ? one_rounding : one_rounding + std::abs(xw) * (1.0 / 256);
        worst = std::max(worst, err / tol);
        if (err > tol && bad++ < 5)
          ADD_FAILURE() << form << " form (" << i << ", " << j << "): " << (*vals)[i * N + j] << ", float64 " << want;
      }
    EXPECT_EQ(bad, 0u) << form;
    std::printf("[ measured ] %s form: worst error / bound %.3f\n", form, worst);
  }
  EXPECT_GT(rel_l2(got, rh), 1e-2);  // the product is really there
  // FP8: unit scales, codes of small integers (exact in E4M3), so the product is exact and the epilogue's add is the
  // only rounding: y = bf16(float(q(x) q(W)^T) + r).
  std::vector<uint8_t> qx(static_cast<size_t>(M * K)), qw(static_cast<size_t>(N * K));
  Vec xf(qx.size()), wf(qw.size());
  ds::Rng rng(7);
  for (size_t i = 0; i < qx.size(); ++i) {
    xf[i] = static_cast<float>(static_cast<int>(rng.next_u64() % 5) - 2);
    qx[i] = ds::fp8_encode(xf[i], ds::Fp8Format::E4M3);
  }
  for (size_t i = 0; i < qw.size(); ++i) {
    wf[i] = static_cast<float>(static_cast<int>(rng.next_u64() % 3) - 1);
    qw[i] = ds::fp8_encode(wf[i], ds::Fp8Format::E4M3);
  }
  auto qxd = ctx.up(qx), qwd = ctx.up(qw);
  auto one = ctx.up(std::vector<float>(64, 1.0f));
  const cuda::Fp8Matrix A{qxd.get(), M, K, K, ds::Fp8Format::E4M3, one.get()},
      B{qwd.get(), N, K, K, ds::Fp8Format::E4M3, one.get()};
  cuda::gemm_fp8(A, B, y.get(), false, N, 1.0f, true, ctx.s, cuda::Fp8ScaleMode::Tensor, r.get());
  const Vec g8 = ctx.down_bf16(y);
  size_t bad = 0;
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) {
      double dot = 0;
      for (int64_t k = 0; k < K; ++k) dot += double(xf[i * K + k]) * wf[j * K + k];
      const float want8 = ds::round_bf16(static_cast<float>(dot) + rh[i * N + j]);
      if (g8[i * N + j] != want8 && bad++ < 5)
        ADD_FAILURE() << "fp8 (" << i << ", " << j << "): " << g8[i * N + j] << " want " << want8;
    }
  EXPECT_EQ(bad, 0u);
}

TEST(CudaGemm, TransposesAndLeadingDims) {
  DS_SKIP_WITHOUT_GPU();
  const int64_t M = 33, N = 40, K = 24, pad = 8;
  const float alpha = 0.5f, beta = 0.25f;
  Ctx ctx(1);
  for (int c_f32 = 0; c_f32 < 2; ++c_f32)
    for (int ta = 0; ta < 2; ++ta)
      for (int tb = 0; tb < 2; ++tb) {
        SCOPED_TRACE("ta=" + std::to_string(ta) + " tb=" + std::to_string(tb) + " c_f32=" + std::to_string(c_f32));
        const int64_t arows = ta ? K : M, acols = ta ? M : K, lda = acols + pad;
        const int64_t brows = tb ? N : K, bcols = tb ? K : N, ldb = bcols + pad;
        const int64_t ldc = N + pad;
        const auto A = ctx.randn_bf16(arows * lda);
        const auto B = ctx.randn_bf16(brows * ldb);
        const auto C0 = ctx.randn_bf16(M * ldc);
        std::vector<double> ref(M * N);
        for (int64_t i = 0; i < M; ++i)
          for (int64_t j = 0; j < N; ++j) {
            double s = 0;
            for (int64_t k = 0; k < K; ++k) {
              const double a = ta ? A[k * lda + i] : A[i * lda + k];
              const double b = tb ? B[j * ldb + k] : B[k * ldb + j];
              s += a * b;
            }
            ref[i * N + j] = alpha * s + beta * C0[i * ldc + j];
          }
        auto dA = ctx.up_bf16(A), dB = ctx.up_bf16(B);
        std::vector<double> got(M * N);
        if (c_f32) {
          auto dC = ctx.up(C0);
          ds::ops::cuda::gemm(ta, tb, M, N, K, alpha, dA.get(), lda, dB.get(), ldb, beta, dC.get(), true, ldc, ctx.s);
          const auto c = ctx.down(dC);
          for (int64_t i = 0; i < M; ++i) {
            for (int64_t j = 0; j < N; ++j) got[i * N + j] = c[i * ldc + j];
            for (int64_t j = N; j < ldc; ++j) EXPECT_EQ(c[i * ldc + j], C0[i * ldc + j]) << "padding overwritten";
          }
        } else {
          auto dC = ctx.up_bf16(C0);
          ds::ops::cuda::gemm(ta, tb, M, N, K, alpha, dA.get(), lda, dB.get(), ldb, beta, dC.get(), false, ldc, ctx.s);
          const auto c = ctx.down_bf16(dC);
          for (int64_t i = 0; i < M; ++i) {
            for (int64_t j = 0; j < N; ++j) got[i * N + j] = c[i * ldc + j];
            for (int64_t j = N; j < ldc; ++j) EXPECT_EQ(c[i * ldc + j], C0[i * ldc + j]) << "padding overwritten";
          }
        }
        EXPECT_LE(rel_l2(got, ref), c_f32 ? 1e-5 : 5e-3);
      }
}

// ---------------------------------------------------------------------------------------------------------
// Fused linear + cross-entropy

TEST(CudaLinearCrossEntropy, MatchesCpu) {
  DS_SKIP_WITHOUT_GPU();
  // 3 chunks, the last one partial; V % 4 == 0 (vector path)
  expect_ok(check_linear_cross_entropy({.N = 1024, .H = 256, .V = 50000, .chunk_tokens = 384}));
  // --fp8-lm-head: 1000 tokens (the casts of h padded to 1008), chunks of 384, the last one 232 (padded to 240)
  expect_ok(check_linear_cross_entropy({.N = 1000, .H = 256, .V = 50000, .chunk_tokens = 384, .fp8 = true}));
  // a frozen head (LoRA): dh only, the scratch without the casts for dW; and fewer tokens than one FP8 tile (16)
  expect_ok(check_linear_cross_entropy({.N = 200, .H = 256, .V = 50000, .chunk_tokens = 64, .fp8 = true, .dW = false}));
  expect_ok(check_linear_cross_entropy({.N = 7, .H = 64, .V = 4096, .chunk_tokens = 16, .fp8 = true}));
}

TEST(CudaLinearCrossEntropy, OddVocab) {
  DS_SKIP_WITHOUT_GPU();
  expect_ok(check_linear_cross_entropy({.N = 100, .H = 64, .V = 4999, .chunk_tokens = 64}));  // V % 4 != 0: scalar
  // V / 4 = 5 float4s over a cluster of 8 blocks: three parts empty, the rest one float4 each
  expect_ok(check_linear_cross_entropy({.N = 50, .H = 32, .V = 20, .chunk_tokens = 16}));
}

// ---------------------------------------------------------------------------------------------------------
// Attention (the simple kernel), GQA 4 over documents {1, 100, 257, 0, 600}

AttentionCase simple(int64_t hd) {
  return AttentionCase{.lens = {1, 100, 257, 0, 600}, .Hq = 8, .Hkv = 2, .head_dim = hd};
}

TEST(CudaAttention, HeadDim256) {
  DS_SKIP_WITHOUT_GPU();
  expect_ok(check_attention(simple(256)));
}
TEST(CudaAttention, HeadDim128) {
  DS_SKIP_WITHOUT_GPU();
  expect_ok(check_attention(simple(128)));
}
TEST(CudaAttention, HeadDim64) {
  DS_SKIP_WITHOUT_GPU();
  expect_ok(check_attention(simple(64)));
}
TEST(CudaAttention, HeadDim32) {
  DS_SKIP_WITHOUT_GPU();
  expect_ok(check_attention(simple(32)));
}

// ---------------------------------------------------------------------------------------------------------
// Attention through cuDNN's fused SDPA (skips where cuDNN is unavailable: the probe then selects the kernel above)

#define DS_SKIP_WITHOUT_CUDNN()                                                                       \
  do {                                                                                                \
    DS_SKIP_WITHOUT_GPU();                                                                            \
    if (std::string why = ds::ops::cudnn::attention_unavailable(); !why.empty()) GTEST_SKIP() << why; \
  } while (0)

// Buckets 1..64, 65..128, 129..256, 257..512, 513..600 with interleaved documents, an empty one, lengths at
// the bucket edges (64, 65, 128, 129); graphs built for 16 documents (unused entries).
ds::ops::AttentionCase packed_buckets_hd256() {
  return {.lens = {1, 100, 257, 0, 600, 64, 65, 128, 129, 7},
          .Hq = 8,
          .Hkv = 2,
          .head_dim = 256,
          .cudnn = true,
          .max_seqs = 16,
          .max_seqlen = 600};
}
// Six documents across four buckets, graphs for 8 documents, head_dim 128, GQA 4 (Hq / Hkv heads).
ds::ops::AttentionCase packed_buckets_hd128(int64_t Hq, int64_t Hkv) {
  return {.lens = {300, 5, 64, 1, 33, 200},
          .Hq = Hq,
          .Hkv = Hkv,
          .head_dim = 128,
          .cudnn = true,
          .max_seqs = 8,
          .max_seqlen = 512};
}
TEST(CudnnAttention, PackedBucketsHeadDim256) {
  DS_SKIP_WITHOUT_CUDNN();
  expect_ok(check_attention(packed_buckets_hd256()));
}
TEST(CudnnAttention, PackedBucketsHeadDim128Gqa4) {
  DS_SKIP_WITHOUT_CUDNN();
  expect_ok(check_attention(packed_buckets_hd128(8, 2)));
}
// The backward by head groups (AttnBounds::head_groups, the engine's DELTASTACK_ATTENTION_SPLIT): each group's call
// writes its own heads' dq, dk, dv at the full rows' strides; the same buckets as above.
TEST(CudnnAttention, PackedBucketsInHeadGroups) {
  DS_SKIP_WITHOUT_CUDNN();
  ds::ops::AttentionCase a = packed_buckets_hd256(), b = packed_buckets_hd128(12, 4);
  a.head_groups = 2;
  b.head_groups = 4;
  expect_ok(check_attention(a));
  expect_ok(check_attention(b));
}
// What the groups are for: cuDNN's own workspace (its dP of B x Hq x S^2 bf16 on Hopper) shrinks with the heads of
// one call, as the memory plan (model/gpu_plan.cpp) assumes; a group count that does not divide Hkv is an error.
TEST(CudnnAttention, HeadGroupsShrinkTheWorkspace) {
  DS_SKIP_WITHOUT_CUDNN();
  ds::ops::cudnn::AttnBounds b{8192, 1, 8192, 8, 2, 256, 0.0625, 1};
  ds::ops::cudnn::Attention one(b);
  b.head_groups = 2;
  ds::ops::cudnn::Attention two(b);
  const double dp = 8.0 * 8192 * 8192 * 2;  // bytes of dP over all 8 heads
  EXPECT_GE(static_cast<double>(one.workspace_bytes()), dp);
  EXPECT_LE(static_cast<double>(two.workspace_bytes()), 0.6 * static_cast<double>(one.workspace_bytes()));
  b.head_groups = 3;
  EXPECT_THROW(ds::ops::cudnn::Attention bad(b), ds::Error);
}
// Full buckets (every entry a document of exactly the bucket's S tokens: the trainer's windows of one document) skip
// the workspace memset before cuDNN's calls (ops/attention/cudnn.cpp run): with the workspace poisoned with NaN, the
// forward and backward are still right and bitwise repeatable, and with finite garbage in it bitwise what an Attention
// zeroing it before every call gives (check_attention), at the 2B layer's heads (Hq 8, Hkv 2, head_dim 256) in two
// documents of one bucket, at 1024 tokens, in head groups (DELTASTACK_ATTENTION_SPLIT's calls), and in four of a
// smaller bucket (the one below unused); a bucket not full (a shorter document, an empty entry) still zeroes.
TEST(CudnnAttention, FullBucketsSkipTheWorkspaceZeroing) {
  DS_SKIP_WITHOUT_CUDNN();
  expect_ok(check_attention({.lens = {256, 256}, .Hq = 8, .Hkv = 2, .head_dim = 256, .cudnn = true, .max_seqs = 2,
                             .max_seqlen = 256, .full_buckets = 1}));
  expect_ok(check_attention({.lens = {1024, 1024}, .Hq = 8, .Hkv = 2, .head_dim = 256, .cudnn = true, .max_seqs = 2,
                             .max_seqlen = 1024, .full_buckets = 1}));
  expect_ok(check_attention({.lens = {256, 256}, .Hq = 8, .Hkv = 2, .head_dim = 256, .cudnn = true, .max_seqs = 2,
                             .max_seqlen = 256, .head_groups = 2, .full_buckets = 1}));
  expect_ok(check_attention({.lens = {128, 128, 128, 128}, .Hq = 4, .Hkv = 1, .head_dim = 128, .cudnn = true,
                             .max_seqs = 4, .max_seqlen = 128, .max_tokens = 512, .full_buckets = 1}));
  expect_ok(check_attention({.lens = {200, 256}, .Hq = 8, .Hkv = 2, .head_dim = 256, .cudnn = true, .max_seqs = 2,
                             .max_seqlen = 256, .full_buckets = 0}));
  expect_ok(check_attention({.lens = {256}, .Hq = 8, .Hkv = 2, .head_dim = 256, .cudnn = true, .max_seqs = 2,
                             .max_seqlen = 256, .max_tokens = 512, .full_buckets = 0}));  // one entry of two empty
}
TEST(CudnnAttention, OneDocumentHeadDim64) {
  DS_SKIP_WITHOUT_CUDNN();
  expect_ok(check_attention(
      {.lens = {777}, .Hq = 4, .Hkv = 4, .head_dim = 64, .cudnn = true, .max_seqs = 1, .max_seqlen = 777}));
}

// The bucket plan (host math, runs without a device): S doubles from 64 and ends at max_seqlen; entry counts from
// the token budget, tightened by the window structure; the first bucket capped at max_tokens / 32.
TEST(CudnnAttention, BucketPlan) {
  using ds::ops::cudnn::attention_buckets;
  // The 2B trainer plan: 2 windows of 8192 tokens, up to 100 documents.
  auto b = attention_buckets({16384, 100, 8192, 8, 2, 256, 0.0625, 2});
  ASSERT_EQ(b.size(), 8u);
  const int64_t S[] = {64, 128, 256, 512, 1024, 2048, 4096, 8192};
  const int64_t lo[] = {1, 65, 129, 257, 513, 1025, 2049, 4097};
  const int64_t bmax[] = {100, 100, 100, 62, 30, 14, 6, 2};  // min(100, 2 * (8192 / lo)), first: min(100, 512)
  for (size_t i = 0; i < b.size(); ++i) {
    EXPECT_EQ(b[i].S, S[i]) << i;
    EXPECT_EQ(b[i].lo, lo[i]) << i;
    EXPECT_EQ(b[i].bmax, bmax[i]) << i;
  }
  // Without the windows: the token budget alone (16384 / 4097 = 3 in the last bucket).
  EXPECT_EQ(attention_buckets({16384, 100, 8192, 8, 2, 256, 0.0625, 0}).back().bmax, 3);
  // Many short documents: the first bucket is capped at max_tokens / 32.
  EXPECT_EQ(attention_buckets({16384, 100000, 8192, 8, 2, 256, 0.0625, 2}).front().bmax, 512);
  // max_seqlen not a power of two, and below 64.
  auto c = attention_buckets({1200, 10, 600, 4, 1, 64, 0.125, 2});
  ASSERT_EQ(c.size(), 5u);
  EXPECT_EQ(c.back().S, 600);
  EXPECT_EQ(c.back().lo, 513);
  EXPECT_EQ(c.back().bmax, 2);
  auto d = attention_buckets({40, 4, 20, 4, 1, 64, 0.125, 2});
  ASSERT_EQ(d.size(), 1u);
  EXPECT_EQ(d[0].S, 20);
  EXPECT_EQ(d[0].bmax, 1);  // max(1, 40 / 32)
}

// More short documents than the first bucket was built for (max_tokens / 32): set_batch refuses the batch
// (the GPU engine then runs the simple kernel); a batch that fits is accepted.
TEST(CudnnAttention, RefusesTooManyShortDocuments) {
  DS_SKIP_WITHOUT_CUDNN();
  ds::ops::cudnn::Attention att({256, 256, 256, 2, 1, 64, 0.125});
  Buf<unsigned char> meta(att.meta_bytes());
  std::vector<int32_t> many{0}, few{0, 200, 256};
  for (int i = 0; i < 64; ++i) many.push_back(many.back() + 4);
  EXPECT_FALSE(att.set_batch(many.data(), 64, meta.get(), nullptr));
  EXPECT_TRUE(att.set_batch(few.data(), 2, meta.get(), nullptr));
  DS_CUDA_CHECK(cudaDeviceSynchronize());
}

}  // namespace

#endif  // DELTASTACK_CUDA
