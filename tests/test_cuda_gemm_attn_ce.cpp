// GPU tests: cuBLASLt linear layers and general gemm, the fused linear + cross-entropy, and causal GQA attention
// over packed sequences, against the fp32 CPU references on the same bf16-rounded inputs. Every test skips
// without a device; inputs are fresh random draws (the seed is printed on failure); outputs are poisoned with
// NaN before the GPU run (so every element must be written); two identical runs must agree bitwise.
#ifdef DELTASTACK_CUDA

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "core/bf16.h"
#include "core/cuda/cuda_utils.h"
#include "core/cuda/device.h"
#include "core/rng.h"
#include "cuda_test_util.h"
#include "ops/attention/attention.h"
#include "ops/attention/cuda.h"
#include "ops/attention/cudnn.h"
#include "ops/linear/cuda.h"
#include "ops/linear/linear.h"
#include "ops/linear_cross_entropy/cuda.h"
#include "ops/linear_cross_entropy/linear_cross_entropy.h"
#include "test_util.h"

using ds::test::rel_l2;
using namespace ds::test::cuda;

namespace {

// ---------------------------------------------------------------------------------------------------------
// Linear

void check_linear(int64_t M, int64_t K, int64_t N) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed) + " M=" + std::to_string(M) + " K=" + std::to_string(K) +
               " N=" + std::to_string(N));
  const auto x = rand_bf16(M * K, seed, 1.0);
  const auto W = rand_bf16(N * K, seed + 1, 1.0 / std::sqrt(double(K)));
  const auto dy = rand_bf16(M * N, seed + 2, 1.0);
  const auto dW0 = ds::test::randn<float>(N * K, seed + 3, 10.0);

  std::vector<float> y_ref(M * N), dx_ref(M * K), dW_ref(N * K, 0.0f);
  ds::ops::linear_forward<float>(x.data(), W.data(), y_ref.data(), M, K, N);
  ds::ops::linear_backward<float>(x.data(), W.data(), dy.data(), dx_ref.data(), dW_ref.data(), M, K, N);

  DevBuf<bf16> dx_in(M * K), dW_in(N * K), ddy(M * N), y(M * N), y2(M * N), dx(M * K), dx2(M * K);
  DevBuf<float> dW(N * K), dW2(N * K);
  upload_bf16(dx_in, x);
  upload_bf16(dW_in, W);
  upload_bf16(ddy, dy);
  upload(dW, dW0);
  upload(dW2, dW0);
  for (DevBuf<bf16>* b : {&y, &y2, &dx, &dx2}) b->poison();

  ds::ops::cuda::linear_forward(dx_in.get(), dW_in.get(), y.get(), M, K, N, false, nullptr);
  ds::ops::cuda::linear_backward_data(ddy.get(), dW_in.get(), dx.get(), M, K, N, false, nullptr);
  ds::ops::cuda::linear_backward_weight(ddy.get(), dx_in.get(), dW.get(), M, K, N, nullptr);
  ds::ops::cuda::linear_forward(dx_in.get(), dW_in.get(), y2.get(), M, K, N, false, nullptr);
  ds::ops::cuda::linear_backward_data(ddy.get(), dW_in.get(), dx2.get(), M, K, N, false, nullptr);
  ds::ops::cuda::linear_backward_weight(ddy.get(), dx_in.get(), dW2.get(), M, K, N, nullptr);
  device_sync();

  EXPECT_LE(rel_l2(download_bf16(y), y_ref), 5e-3);
  EXPECT_LE(rel_l2(download_bf16(dx), dx_ref), 1e-2);
  const auto dW_got = download(dW);
  std::vector<double> inc(dW_got.size());
  for (size_t i = 0; i < inc.size(); ++i) inc[i] = double(dW_got[i]) - double(dW0[i]);
  EXPECT_LE(rel_l2(inc, dW_ref), 1e-2);  // dW accumulated onto dW0
  EXPECT_TRUE(same_bits(y, y2));
  EXPECT_TRUE(same_bits(dx, dx2));
  EXPECT_TRUE(same_bits(dW, dW2));
}

TEST(CudaLinear, ForwardBackwardLarge) {
  DS_SKIP_WITHOUT_GPU();
  check_linear(4096, 2048, 6144);
}

TEST(CudaLinear, ForwardBackwardRagged) {
  DS_SKIP_WITHOUT_GPU();
  check_linear(37, 64, 200);
}

TEST(CudaLinear, Accumulate) {
  DS_SKIP_WITHOUT_GPU();
  const int64_t M = 37, K = 64, N = 200;
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const auto x = rand_bf16(M * K, seed, 1.0), W = rand_bf16(N * K, seed + 1, 0.125);
  const auto y0 = rand_bf16(M * N, seed + 2, 1.0), dy = rand_bf16(M * N, seed + 3, 1.0);
  const auto dx0 = rand_bf16(M * K, seed + 4, 1.0);
  std::vector<float> y_ref = y0, dx_ref = dx0;
  ds::ops::linear_forward<float>(x.data(), W.data(), y_ref.data(), M, K, N, true);
  ds::ops::linear_backward<float>(x.data(), W.data(), dy.data(), dx_ref.data(), nullptr, M, K, N, true);
  DevBuf<bf16> dx_in(M * K), dW_in(N * K), ddy(M * N), y(M * N), dx(M * K);
  upload_bf16(dx_in, x);
  upload_bf16(dW_in, W);
  upload_bf16(ddy, dy);
  upload_bf16(y, y0);
  upload_bf16(dx, dx0);
  ds::ops::cuda::linear_forward(dx_in.get(), dW_in.get(), y.get(), M, K, N, true, nullptr);
  ds::ops::cuda::linear_backward_data(ddy.get(), dW_in.get(), dx.get(), M, K, N, true, nullptr);
  device_sync();
  EXPECT_LE(rel_l2(download_bf16(y), y_ref), 5e-3);
  EXPECT_LE(rel_l2(download_bf16(dx), dx_ref), 1e-2);
}

// General gemm: every transposition, padded leading dimensions, alpha / beta, fp32 and bf16 C.
TEST(CudaGemm, TransposesAndLeadingDims) {
  DS_SKIP_WITHOUT_GPU();
  const int64_t M = 33, N = 40, K = 24, pad = 8;
  const float alpha = 0.5f, beta = 0.25f;
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  for (int c_f32 = 0; c_f32 < 2; ++c_f32)
    for (int ta = 0; ta < 2; ++ta)
      for (int tb = 0; tb < 2; ++tb) {
        SCOPED_TRACE("ta=" + std::to_string(ta) + " tb=" + std::to_string(tb) + " c_f32=" + std::to_string(c_f32));
        const int64_t arows = ta ? K : M, acols = ta ? M : K, lda = acols + pad;
        const int64_t brows = tb ? N : K, bcols = tb ? K : N, ldb = bcols + pad;
        const int64_t ldc = N + pad;
        const auto A = rand_bf16(arows * lda, seed + 10 * ta + tb, 1.0);
        const auto B = rand_bf16(brows * ldb, seed + 100 + 10 * ta + tb, 1.0);
        const auto C0 = rand_bf16(M * ldc, seed + 200, 1.0);
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
        DevBuf<bf16> dA(A.size()), dB(B.size());
        upload_bf16(dA, A);
        upload_bf16(dB, B);
        std::vector<double> got(M * N);
        if (c_f32) {
          DevBuf<float> dC(C0.size());
          upload(dC, C0);
          ds::ops::cuda::gemm(ta, tb, M, N, K, alpha, dA.get(), lda, dB.get(), ldb, beta, dC.get(), true, ldc, nullptr);
          const auto c = download(dC);
          for (int64_t i = 0; i < M; ++i) {
            for (int64_t j = 0; j < N; ++j) got[i * N + j] = c[i * ldc + j];
            for (int64_t j = N; j < ldc; ++j) EXPECT_EQ(c[i * ldc + j], C0[i * ldc + j]) << "padding overwritten";
          }
        } else {
          DevBuf<bf16> dC(C0.size());
          upload_bf16(dC, C0);
          ds::ops::cuda::gemm(ta, tb, M, N, K, alpha, dA.get(), lda, dB.get(), ldb, beta, dC.get(), false, ldc,
                              nullptr);
          const auto c = download_bf16(dC);
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

void check_linear_ce(int64_t N, int64_t H, int64_t V, int64_t chunk) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed) + " N=" + std::to_string(N) + " H=" + std::to_string(H) +
               " V=" + std::to_string(V) + " chunk=" + std::to_string(chunk));
  const auto h = rand_bf16(N * H, seed, 1.0);
  const auto W = rand_bf16(V * H, seed + 1, 2.0 / std::sqrt(double(H)));  // logits with std ~2
  std::vector<int32_t> labels(N);
  ds::Rng rng(seed + 2);
  for (auto& y : labels) y = rng.uniform() < 0.1 ? -100 : static_cast<int32_t>(rng.below(V));
  labels[0] = -100;
  labels[N - 1] = static_cast<int32_t>(V - 1);
  int64_t valid = 0;
  for (auto y : labels) valid += y != -100;

  ds::ops::LinearCeOptions opt;
  opt.z_loss = 1e-4;
  opt.grad_scale = 1.0 / double(valid);
  std::vector<float> dh_ref(N * H), dW_ref(V * H, 0.0f);
  const auto ref = ds::ops::linear_cross_entropy<float>(h.data(), W.data(), labels.data(), N, H, V, opt, dh_ref.data(),
                                                        dW_ref.data());
  ASSERT_EQ(ref.num_valid, valid);

  opt.chunk_tokens = chunk;
  DevBuf<bf16> dh_in(N * H), dW_in(V * H), dh(N * H), dh2(N * H);
  DevBuf<float> dW(V * H), dW2(V * H);
  DevBuf<int32_t> dlab(N);
  DevBuf<double> loss(2), loss2(2), loss3(2);
  DevBuf<unsigned char> scratch(ds::ops::cuda::linear_cross_entropy_scratch_bytes(N, H, V, chunk));
  upload_bf16(dh_in, h);
  upload_bf16(dW_in, W);
  upload(dlab, labels);
  dW.zero();
  dW2.zero();
  for (DevBuf<bf16>* b : {&dh, &dh2}) b->poison();
  loss.poison();
  loss2.poison();
  loss3.poison();
  scratch.poison();

  ds::ops::cuda::linear_cross_entropy(dh_in.get(), dW_in.get(), dlab.get(), N, H, V, opt, loss.get(), dh.get(),
                                      dW.get(), scratch.get(), nullptr);
  ds::ops::cuda::linear_cross_entropy(dh_in.get(), dW_in.get(), dlab.get(), N, H, V, opt, loss2.get(), dh2.get(),
                                      dW2.get(), scratch.get(), nullptr);
  ds::ops::cuda::linear_cross_entropy(dh_in.get(), dW_in.get(), dlab.get(), N, H, V, opt, loss3.get(), nullptr, nullptr,
                                      scratch.get(),
                                      nullptr);  // forward only
  device_sync();

  const auto l = download(loss);
  EXPECT_NEAR(l[0], ref.loss_sum, 1e-4 * std::abs(ref.loss_sum));
  EXPECT_NEAR(l[1], ref.z_loss_sum, 1e-4 * std::abs(ref.z_loss_sum));
  EXPECT_LE(rel_l2(download_bf16(dh), dh_ref), 1e-2);
  EXPECT_LE(rel_l2(download(dW), dW_ref), 1e-2);
  EXPECT_TRUE(same_bits(loss, loss2));
  EXPECT_TRUE(same_bits(loss, loss3));
  EXPECT_TRUE(same_bits(dh, dh2));
  EXPECT_TRUE(same_bits(dW, dW2));
}

TEST(CudaLinearCrossEntropy, MatchesCpu) {
  DS_SKIP_WITHOUT_GPU();
  check_linear_ce(1024, 256, 50000, 384);  // 3 chunks, the last one partial; V % 4 == 0 (vector path)
}

TEST(CudaLinearCrossEntropy, OddVocab) {
  DS_SKIP_WITHOUT_GPU();
  check_linear_ce(100, 64, 4999, 64);  // V % 4 != 0 (scalar path)
}

// ---------------------------------------------------------------------------------------------------------
// Attention

// Attention over documents `lens` (packed in this order), GQA Hq/Hkv, against the fp32 reference; forward twice
// and backward twice agree bitwise. With cudnn_bounds, through cuDNN's SDPA built for those bounds (max_seqs may
// exceed the batch's count, so graphs have unused entries; max_tokens 0: the batch's), else the simple kernel.
void check_attention(int64_t hd, int64_t Hq, int64_t Hkv, const std::vector<int>& lens,
                     const ds::ops::cudnn::AttnBounds* cudnn_bounds = nullptr) {
  std::vector<int32_t> cu{0};
  for (int l : lens) cu.push_back(cu.back() + l);
  ds::ops::AttnDims d;
  d.N = cu.back();
  d.num_seqs = static_cast<int64_t>(lens.size());
  d.Hq = Hq;
  d.Hkv = Hkv;
  d.head_dim = hd;
  d.scale = 1.0 / std::sqrt(double(hd));
  const int64_t max_len = *std::max_element(lens.begin(), lens.end());
  const int64_t N = d.N;
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed) + " head_dim " + std::to_string(hd) + (cudnn_bounds ? " cuDNN" : ""));
  const auto q = rand_bf16(N * Hq * hd, seed, 1.0), k = rand_bf16(N * Hkv * hd, seed + 1, 1.0);
  const auto v = rand_bf16(N * Hkv * hd, seed + 2, 1.0), dout = rand_bf16(N * Hq * hd, seed + 3, 1.0);

  std::vector<float> o_ref(N * Hq * hd), lse_ref(N * Hq);
  ds::ops::attention_forward<float>(d, q.data(), k.data(), v.data(), cu.data(), o_ref.data(), lse_ref.data());

  std::unique_ptr<ds::ops::cudnn::Attention> att;
  if (cudnn_bounds) {
    ds::ops::cudnn::AttnBounds b = *cudnn_bounds;
    b.scale = d.scale;
    if (b.max_tokens == 0) b.max_tokens = N;
    att = std::make_unique<ds::ops::cudnn::Attention>(b);
  }
  DevBuf<bf16> dq_in(q.size()), dk_in(k.size()), dv_in(v.size()), ddo(dout.size());
  DevBuf<bf16> o(q.size()), o2(q.size()), dq(q.size()), dq2(q.size()), dk(k.size()), dk2(k.size()), dv(v.size()),
      dv2(v.size());
  DevBuf<float> lse(N * Hq), lse2(N * Hq);
  DevBuf<int32_t> dcu(cu.size());
  DevBuf<unsigned char> scratch(att ? att->workspace_bytes() : ds::ops::cuda::attention_scratch_bytes(d)),
      meta(att ? att->meta_bytes() : 0);
  upload_bf16(dq_in, q);
  upload_bf16(dk_in, k);
  upload_bf16(dv_in, v);
  upload_bf16(ddo, dout);
  upload(dcu, cu);
  for (DevBuf<bf16>* b : {&o, &o2, &dq, &dq2, &dk, &dk2, &dv, &dv2}) b->poison();
  lse.poison();
  lse2.poison();
  scratch.poison();
  if (att) {
    ASSERT_TRUE(att->set_batch(cu.data(), d.num_seqs, meta.get(), nullptr));
  }
  auto forward = [&](DevBuf<bf16>& o_, DevBuf<float>& lse_) {
    if (att)
      att->forward(dq_in.get(), dk_in.get(), dv_in.get(), o_.get(), lse_.get(), scratch.get(), nullptr);
    else
      ds::ops::cuda::attention_forward(d, dq_in.get(), dk_in.get(), dv_in.get(), dcu.get(), max_len, o_.get(),
                                       lse_.get(), nullptr);
  };
  auto backward = [&](DevBuf<bf16>& dq_, DevBuf<bf16>& dk_, DevBuf<bf16>& dv_) {
    if (att)
      att->backward(dq_in.get(), dk_in.get(), dv_in.get(), o.get(), lse.get(), ddo.get(), dq_.get(), dk_.get(),
                    dv_.get(), scratch.get(), nullptr);
    else
      ds::ops::cuda::attention_backward(d, dq_in.get(), dk_in.get(), dv_in.get(), o.get(), lse.get(), ddo.get(),
                                        dcu.get(), max_len, dq_.get(), dk_.get(), dv_.get(), scratch.get(), nullptr);
  };
  forward(o, lse);
  forward(o2, lse2);
  backward(dq, dk, dv);
  backward(dq2, dk2, dv2);
  device_sync();

  const auto o_gpu = download_bf16(o);
  EXPECT_LE(rel_l2(o_gpu, o_ref), 5e-3);
  EXPECT_LE(rel_l2(download(lse), lse_ref), 5e-3);

  // The CPU backward sees the outputs the GPU backward saw: the GPU's bf16 o, and the (fp32) lse.
  std::vector<float> dq_ref(q.size()), dk_ref(k.size()), dv_ref(v.size());
  ds::ops::attention_backward<float>(d, q.data(), k.data(), v.data(), o_gpu.data(), lse_ref.data(), dout.data(),
                                     cu.data(), dq_ref.data(), dk_ref.data(), dv_ref.data());
  EXPECT_LE(rel_l2(download_bf16(dq), dq_ref), 1e-2);
  EXPECT_LE(rel_l2(download_bf16(dk), dk_ref), 1e-2);
  EXPECT_LE(rel_l2(download_bf16(dv), dv_ref), 1e-2);

  EXPECT_TRUE(same_bits(o, o2));
  EXPECT_TRUE(same_bits(lse, lse2));
  EXPECT_TRUE(same_bits(dq, dq2));
  EXPECT_TRUE(same_bits(dk, dk2));
  EXPECT_TRUE(same_bits(dv, dv2));
}

void check_attention(int64_t hd) { check_attention(hd, 8, 2, {1, 100, 257, 0, 600}); }

TEST(CudaAttention, HeadDim256) {
  DS_SKIP_WITHOUT_GPU();
  check_attention(256);
}
TEST(CudaAttention, HeadDim128) {
  DS_SKIP_WITHOUT_GPU();
  check_attention(128);
}
TEST(CudaAttention, HeadDim64) {
  DS_SKIP_WITHOUT_GPU();
  check_attention(64);
}
TEST(CudaAttention, HeadDim32) {
  DS_SKIP_WITHOUT_GPU();
  check_attention(32);
}

// ---------------------------------------------------------------------------------------------------------
// Attention through cuDNN's fused SDPA (skips where cuDNN is unavailable: the probe then selects the kernel above)

#define DS_SKIP_WITHOUT_CUDNN()                                                                    \
  do {                                                                                             \
    DS_SKIP_WITHOUT_GPU();                                                                         \
    if (std::string why = ds::ops::cudnn::attention_unavailable(); !why.empty()) GTEST_SKIP() << why; \
  } while (0)

// Buckets 1..64, 65..128, 129..256, 257..512, 513..600 with interleaved documents, an empty one, lengths at
// the bucket edges (64, 65, 128, 129).
TEST(CudnnAttention, PackedBucketsHeadDim256) {
  DS_SKIP_WITHOUT_CUDNN();
  const ds::ops::cudnn::AttnBounds b{0, 16, 600, 8, 2, 256, 0};
  check_attention(256, 8, 2, {1, 100, 257, 0, 600, 64, 65, 128, 129, 7}, &b);
}
TEST(CudnnAttention, PackedBucketsHeadDim128Gqa4) {
  DS_SKIP_WITHOUT_CUDNN();
  const ds::ops::cudnn::AttnBounds b{0, 8, 512, 8, 2, 128, 0};
  check_attention(128, 8, 2, {300, 5, 64, 1, 33, 200}, &b);
}
TEST(CudnnAttention, OneDocumentHeadDim64) {
  DS_SKIP_WITHOUT_CUDNN();
  const ds::ops::cudnn::AttnBounds b{0, 1, 777, 4, 4, 64, 0};
  check_attention(64, 4, 4, {777}, &b);
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
  DevBuf<unsigned char> meta(att.meta_bytes());
  std::vector<int32_t> many{0}, few{0, 200, 256};
  for (int i = 0; i < 64; ++i) many.push_back(many.back() + 4);
  EXPECT_FALSE(att.set_batch(many.data(), 64, meta.get(), nullptr));
  EXPECT_TRUE(att.set_batch(few.data(), 2, meta.get(), nullptr));
  device_sync();
}

}  // namespace

#endif  // DELTASTACK_CUDA
