// GPU tests of the chunked tensor-core gated delta rule (ops/gated_delta_rule/chunked_cuda.h) at sizes the other
// suites never reach, where an int32 element offset or a per-sequence loop bound would break:
//   PastTwoToThe31Elements: 2^19 + 777 tokens packed as 259 documents, Hk 20, Hv 40, dk = dv = 128, so v, o, dO
//     and dv hold more than 2^31 elements (q, k, dq, dk 1.3e9) and the saved chunk states and dH
//     (max_chunks · Hv · 128 · 128) 5.5e9. The whole batch runs forward and backward; every output must be finite,
//     and three documents (the first, the one whose v rows cross element 2^31, the last, past it) are copied back
//     and compared with the fp32 CPU reference of that document alone.
//   OneMillionTokenSequence: one document of 2^20 + 39 tokens (a 39-token tail), Hk 1, Hv 2, with a nonzero
//     initial state and final-state gradient, compared over whole tensors with the simple token-recurrent kernel
//     (ops/gated_delta_rule/cuda.h, fp32 state; itself checked against the CPU oracle in tests/test_cuda_gdn.cpp);
//     two runs bitwise equal.
// Inputs are generated on the device (counter hashes, fixed seeds; tests/cuda_large_util.h): uploading gigabytes
// from the host would dominate the run. Need ~74 GiB (the first) and ~20 GiB (the second) of device memory; skipped
// when the device has less free. On a GPU machine:
//   deltastack_tests --gtest_filter='CudaGatedDeltaRuleChunked.PastTwoToThe31Elements:*.OneMillionTokenSequence'
#ifdef DELTASTACK_CUDA

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "core/bf16.h"
#include "core/numerics.h"
#include "cuda_large_util.h"
#include "cuda_test_util.h"
#include "ops/check/check.h"
#include "ops/check/device.h"
#include "ops/elementwise/random.h"
#include "ops/gated_delta_rule/chunked_cuda.h"
#include "ops/gated_delta_rule/cuda.h"
#include "ops/gated_delta_rule/gated_delta_rule.h"

namespace {

using ds::cuda::bf16;
using ds::ops::GdnDims;
using ds::ops::check::Bits;
using ds::ops::check::Buf;
using ds::ops::check::Ctx;
using ds::ops::check::I32;
using ds::ops::check::kForward;
using ds::ops::check::kGateGradient;
// The gated delta rule issue's band for dq, dk, dv, dh0 (tighter than check.h's general 1e-2).
constexpr double kGradient8e3 = 8e-3;
using ds::ops::check::Result;
using ds::ops::check::Vec;
using ds::test::cuda::expect_ok;

constexpr int64_t D = 128;  // dk = dv (the chunked kernel's only size)
constexpr int64_t kTwoTo31 = int64_t(1) << 31;
constexpr double kGiB = double(1 << 30);

// Skips the test when the device has less than `need` bytes free (plus 1 GiB for the CUDA context and the
// reductions' partials).
#define DS_SKIP_WITHOUT_DEVICE_MEMORY(need)                                                                     \
  do {                                                                                                        \
    size_t free_b = 0, total_b = 0;                                                                           \
    DS_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));                                                         \
    if (static_cast<double>(free_b) < static_cast<double>(need) + kGiB)                                       \
      GTEST_SKIP() << "needs " << static_cast<double>(need) / kGiB << " GiB of device memory, "               \
                   << static_cast<double>(free_b) / kGiB << " GiB free of " << static_cast<double>(total_b) / kGiB; \
  } while (0)

// Copies on the test's stream, which is waited for before and after (its kernels finished, the host vector free
// to go): n elements at element offset `at` of a device buffer to the host, and host values (bf16-representable)
// to device bf16 / fp32 at element offset `at`.
void copy(cudaStream_t s, void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
  DS_CUDA_CHECK(cudaStreamSynchronize(s));
  DS_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, kind, s));
  DS_CUDA_CHECK(cudaStreamSynchronize(s));
}
Vec down_bf16(cudaStream_t s, const bf16* p, int64_t at, int64_t n) {
  Bits h(static_cast<size_t>(n));
  copy(s, h.data(), p + at, h.size() * sizeof(bf16), cudaMemcpyDeviceToHost);
  return ds::ops::check::to_f32(h);
}
Vec down_f32(cudaStream_t s, const float* p, int64_t at, int64_t n) {
  Vec h(static_cast<size_t>(n));
  copy(s, h.data(), p + at, h.size() * sizeof(float), cudaMemcpyDeviceToHost);
  return h;
}
void up_bf16(cudaStream_t s, bf16* p, int64_t at, const Vec& h) {
  Bits b(h.size());
  for (size_t i = 0; i < h.size(); ++i) b[i] = ds::f32_to_bf16_bits(h[i]);
  copy(s, p + at, b.data(), b.size() * sizeof(bf16), cudaMemcpyHostToDevice);
}
void up_f32(cudaStream_t s, float* p, int64_t at, const Vec& h) {
  copy(s, p + at, h.data(), h.size() * sizeof(float), cudaMemcpyHostToDevice);
}

// The whole batch on the device, the reference on three of its documents. The last document starts past element
// 2^31 of v / o / dO / dv (asserted below): its rows are only right if every offset into those tensors is 64-bit.
TEST(CudaGatedDeltaRuleChunked, PastTwoToThe31Elements) {
  DS_SKIP_WITHOUT_GPU();
  constexpr int64_t Hk = 20, Hv = 40;
  const int64_t N = (int64_t(1) << 19) + 777;
  std::vector<int> lens;  // 4096, 39, 4000, 1, 4096, ... cut at N: full chunks, tails, 1-token documents
  const int cycle[] = {4096, 39, 4000, 1};
  for (int64_t t = 0; t < N; t += lens.back())
    lens.push_back(static_cast<int>(std::min<int64_t>(cycle[lens.size() % 4], N - t)));
  const I32 cu = ds::ops::check::cu_from_lengths(lens);
  const int64_t num_seqs = static_cast<int64_t>(lens.size());
  ASSERT_EQ(cu.back(), N);

  const ds::ops::cuda::GdnChunkedPlan plan = ds::ops::cuda::gdn_chunked_plan(N, num_seqs, Hk, Hv, D, D);
  const int64_t QK = N * Hk * D, VD = N * Hv * D, G = N * Hv;
  ASSERT_GT(VD, kTwoTo31) << "v / o / dv must hold more than 2^31 elements";
  ASSERT_GT(plan.max_chunks * Hv * D * D, kTwoTo31) << "the saved chunk states must hold more than 2^31 elements";
  // q, k, dq, dk; v, dO, o, dv; g, beta, dg, dbeta; the plan's index, saved buffer and workspace.
  const double need = 4.0 * QK * sizeof(bf16) + 4.0 * VD * sizeof(bf16) + 4.0 * G * sizeof(float) +
                      static_cast<double>(plan.index_bytes() + plan.saved_bytes() + plan.workspace_bytes());
  std::printf("[ info ] %lld tokens, %lld documents, Hk %lld Hv %lld: saved %.1f GiB, workspace %.1f GiB, "
              "%.1f GiB with the tensors\n",
              static_cast<long long>(N), static_cast<long long>(num_seqs), static_cast<long long>(Hk),
              static_cast<long long>(Hv), plan.saved_bytes() / kGiB, plan.workspace_bytes() / kGiB, need / kGiB);
  ASSERT_LT(need, 100 * kGiB) << "the test is sized to stay under 100 GiB";
  DS_SKIP_WITHOUT_DEVICE_MEMORY(need);

  Ctx ctx(31);
  GdnDims d;
  d.N = N, d.num_seqs = num_seqs, d.Hk = Hk, d.Hv = Hv, d.dk = D, d.dv = D;
  d.scale = 1.0 / std::sqrt(static_cast<double>(D));
  Buf<bf16> q(QK), k(QK), v(VD), dO(VD), o(VD), dq(QK), dk(QK), dv(VD);
  Buf<float> g(G), beta(G), dg(G), dbeta(G);
  Buf<unsigned char> index(plan.index_bytes()), saved(plan.saved_bytes()), ws(plan.workspace_bytes());
  auto cu_d = ctx.up(cu);
  // q, k rows l2-normalised; v, dO uniform in [-1, 1); g a realistic log decay in [-1, -0.001); beta in (0.01, 0.99).
  ds::test::cuda::fill_unit_rows(q.get(), N * Hk, D, 101, ctx.s);
  ds::test::cuda::fill_unit_rows(k.get(), N * Hk, D, 102, ctx.s);
  ds::ops::cuda::fill_uniform(v.get(), VD, 103, -1.0f, 1.0f, ctx.s);
  ds::ops::cuda::fill_uniform(dO.get(), VD, 104, -1.0f, 1.0f, ctx.s);
  ds::ops::cuda::fill_uniform(g.get(), G, 105, -1.0f, -0.001f, ctx.s);
  ds::ops::cuda::fill_uniform(beta.get(), G, 106, 0.01f, 0.99f, ctx.s);
  // NaN everywhere a kernel writes: an element it skips (an offset that wrapped) stays NaN and fails below.
  ctx.poison(o), ctx.poison(dq), ctx.poison(dk), ctx.poison(dv), ctx.poison(dg), ctx.poison(dbeta);
  ctx.poison(index), ctx.poison(saved), ctx.poison(ws);

  ds::ops::cuda::gdn_chunked_prepare(plan, cu_d.get(), num_seqs, N, index.get(), ctx.s);
  ds::ops::cuda::gdn_chunked_forward(plan, d, index.get(), q.get(), k.get(), v.get(), Hv * D, g.get(), beta.get(),
                                     nullptr, o.get(), nullptr, saved.get(), ws.get(), ctx.s);
  ds::ops::cuda::gdn_chunked_backward(plan, d, index.get(), q.get(), k.get(), v.get(), Hv * D, g.get(), beta.get(),
                                      saved.get(), dO.get(), nullptr, dq.get(), dk.get(), dv.get(), Hv * D, dg.get(),
                                      dbeta.get(), nullptr, ws.get(), ctx.s);
  DS_CUDA_CHECK(cudaStreamSynchronize(ctx.s));
  DS_CUDA_LAUNCH_CHECK();

  // Every element of every output written and finite, over the whole batch.
  EXPECT_EQ(ds::test::cuda::count_nonfinite(o.get(), VD, ctx.s), 0) << "o";
  EXPECT_EQ(ds::test::cuda::count_nonfinite(dq.get(), QK, ctx.s), 0) << "dq";
  EXPECT_EQ(ds::test::cuda::count_nonfinite(dk.get(), QK, ctx.s), 0) << "dk";
  EXPECT_EQ(ds::test::cuda::count_nonfinite(dv.get(), VD, ctx.s), 0) << "dv";
  EXPECT_EQ(ds::test::cuda::count_nonfinite(dg.get(), G, ctx.s), 0) << "dg";
  EXPECT_EQ(ds::test::cuda::count_nonfinite(dbeta.get(), G, ctx.s), 0) << "dbeta";

  // Document s alone against the CPU reference (the chunked CPU form: the recurrent oracle's backward keeps every
  // token's state, 10 GiB for 4096 tokens x 40 heads), on the rows the device read and wrote.
  auto check_document = [&](int64_t s, const char* which) {
    const int64_t t0 = cu[s], L = cu[s + 1] - cu[s];
    GdnDims dd = d;
    dd.N = L, dd.num_seqs = 1;
    const int32_t cu_doc[2] = {0, static_cast<int32_t>(L)};
    auto rows_k = [&](const bf16* p) { return down_bf16(ctx.s, p, t0 * Hk * D, L * Hk * D); };  // [L, Hk, dk]
    auto rows_v = [&](const bf16* p) { return down_bf16(ctx.s, p, t0 * Hv * D, L * Hv * D); };  // [L, Hv, dv]
    auto rows_g = [&](const float* p) { return down_f32(ctx.s, p, t0 * Hv, L * Hv); };          // [L, Hv]
    const Vec hq = rows_k(q.get()), hk = rows_k(k.get()), hv = rows_v(v.get()), hdO = rows_v(dO.get());
    const Vec hg = rows_g(g.get()), hbeta = rows_g(beta.get());
    Vec ro(hv.size()), rdq(hq.size()), rdk(hk.size()), rdv(hv.size()), rdg(hg.size()), rdbeta(hg.size());
    Result r;
    r.what = std::string("cuda-chunked gated_delta_rule, ") + which + " document " + std::to_string(s) + " of " +
             std::to_string(num_seqs) + " (tokens " + std::to_string(t0) + ".." + std::to_string(t0 + L) +
             ", v elements from " + std::to_string(t0 * Hv * D) + ") Hk 20 Hv 40";
    ds::ops::check::timed(&r.cpu_seconds, [&] {
      ds::ops::chunk_gated_delta_rule_forward<float>(dd, hq.data(), hk.data(), hv.data(), hg.data(), hbeta.data(),
                                                     cu_doc, nullptr, ro.data(), nullptr);
      ds::ops::chunk_gated_delta_rule_backward<float>(dd, hq.data(), hk.data(), hv.data(), hg.data(), hbeta.data(),
                                                      cu_doc, nullptr, hdO.data(), nullptr, rdq.data(), rdk.data(),
                                                      rdv.data(), rdg.data(), rdbeta.data(), nullptr);
    });
    r.add("o", ds::rel_l2(rows_v(o.get()), ro), kForward);
    r.add("dq", ds::rel_l2(rows_k(dq.get()), rdq), kGradient8e3);
    r.add("dk", ds::rel_l2(rows_k(dk.get()), rdk), kGradient8e3);
    r.add("dv", ds::rel_l2(rows_v(dv.get()), rdv), kGradient8e3);
    r.add("dg", ds::rel_l2(rows_g(dg.get()), rdg), kGateGradient);
    r.add("dbeta", ds::rel_l2(rows_g(dbeta.get()), rdbeta), kGateGradient);
    expect_ok(r);
  };
  // The document whose v rows cross element 2^31 (token t with t Hv dv <= 2^31 < (t + 1) Hv dv).
  const int64_t t_cross = kTwoTo31 / (Hv * D);
  const int64_t s_cross = std::upper_bound(cu.begin(), cu.end(), static_cast<int32_t>(t_cross)) - cu.begin() - 1;
  const int64_t s_last = num_seqs - 1;
  ASSERT_GT(int64_t(cu[s_last]) * Hv * D, kTwoTo31) << "the last document must start past element 2^31 of v";
  ASSERT_GT(s_cross, 0);
  ASSERT_LT(s_cross, s_last);
  check_document(0, "first");
  check_document(s_cross, "crossing 2^31");
  check_document(s_last, "last");
}

// One 1M-token document with an initial state and a final-state gradient, against the simple kernel (a different
// algorithm: one block per (sequence, head) walking every token with the fp32 state on chip). The simple kernel
// takes neither an initial state nor a final-state gradient, so its document carries them as extra tokens, exact
// in fp32 (g = 0 leaves the state as it is):
//   128 prefix tokens  k = e_i, beta = 1, v = h0[:, i, :], q = 0, dO = 0: writes row i of the state, so after them
//                      S = h0, and the gradient of h0[:, i, :] is the dv of prefix token i;
//   the 2^20 + 39 tokens of the document, then 25 tokens doing nothing (q = k = v = 0, beta = 0), so the next token
//                      starts a chunk and the simple kernel's saved state there is the final state;
//   128 read-out tokens q = e_i, beta = 0, k = v = 0: o = scale S[:, i, :], so dO = r[:, i, :] puts
//                      dfinal_state = scale r on the final state.
// The chunked kernel runs the document itself (rows 128 .. 128 + N of the same buffers) with h0 and scale r. The
// simple kernel is checked against the CPU oracle in tests/test_cuda_gdn.cpp.
TEST(CudaGatedDeltaRuleChunked, OneMillionTokenSequence) {
  DS_SKIP_WITHOUT_GPU();
  constexpr int64_t Hk = 1, Hv = 2;
  const int64_t N = (int64_t(1) << 20) + 39;
  const int64_t pre = D, gap = (64 - (pre + N) % 64) % 64, post = D, M = pre + N + gap + post;
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));

  GdnDims dc;  // the chunked kernel: the document alone
  dc.N = N, dc.num_seqs = 1, dc.Hk = Hk, dc.Hv = Hv, dc.dk = D, dc.dv = D, dc.scale = scale;
  GdnDims dsim = dc;  // the simple kernel: with the prefix, gap and read-out tokens
  dsim.N = M, dsim.chunk_size = 64;
  const I32 cu_c = {0, static_cast<int32_t>(N)}, cu_s = {0, static_cast<int32_t>(M)};
  const I32 coff = ds::ops::check::chunk_offsets(cu_s, 64);
  const int64_t total_chunks = coff.back(), final_chunk = (pre + N + gap) / 64;
  const ds::ops::cuda::GdnChunkedPlan plan = ds::ops::cuda::gdn_chunked_plan(N, 1, Hk, Hv, D, D);
  const size_t scratch_bytes = ds::ops::cuda::gated_delta_rule_scratch_bytes(dsim, total_chunks);
  const int64_t QK = M * Hk * D, VD = M * Hv * D, G = M * Hv, S = Hv * D * D;
  // Inputs (M tokens: q, k, v, dO, g, beta), the chunked outputs (o and dq twice, dk, dv, dg, dbeta), the simple
  // kernel's (o, dq, dk, dv, dg, dbeta), its chunk states and scratch, the chunked plan's buffers, h0, dfinal_state,
  // final state, dh0.
  const double need = 7.0 * (QK + VD) * sizeof(bf16) + 6.0 * G * sizeof(float) +
                      static_cast<double>(total_chunks) * S * sizeof(float) + static_cast<double>(scratch_bytes) +
                      static_cast<double>(plan.index_bytes() + plan.saved_bytes() + plan.workspace_bytes()) +
                      4.0 * S * sizeof(float);
  std::printf("[ info ] %lld tokens: simple kernel states %.1f GiB + scratch %.1f GiB, chunked saved %.1f GiB + "
              "workspace %.1f GiB, %.1f GiB in all\n",
              static_cast<long long>(N), total_chunks * S * 4.0 / kGiB, scratch_bytes / kGiB,
              plan.saved_bytes() / kGiB, plan.workspace_bytes() / kGiB, need / kGiB);
  ASSERT_LT(need, 40 * kGiB) << "the test is sized to stay under 40 GiB";
  DS_SKIP_WITHOUT_DEVICE_MEMORY(need);

  Ctx ctx(20);
  Buf<bf16> q(QK), k(QK), v(VD), dO(VD);
  Buf<float> g(G), beta(G);
  // The document's rows: q, k l2-normalised, v, dO uniform in [-1, 1), g in [-1, -0.001), beta in [0.01, 0.99).
  ds::test::cuda::fill_unit_rows(q.get() + pre * Hk * D, N * Hk, D, 201, ctx.s);
  ds::test::cuda::fill_unit_rows(k.get() + pre * Hk * D, N * Hk, D, 202, ctx.s);
  ds::ops::cuda::fill_uniform(v.get() + pre * Hv * D, N * Hv * D, 203, -1.0f, 1.0f, ctx.s);
  ds::ops::cuda::fill_uniform(dO.get() + pre * Hv * D, N * Hv * D, 204, -1.0f, 1.0f, ctx.s);
  ds::ops::cuda::fill_uniform(g.get() + pre * Hv, N * Hv, 205, -1.0f, -0.001f, ctx.s);
  ds::ops::cuda::fill_uniform(beta.get() + pre * Hv, N * Hv, 206, 0.01f, 0.99f, ctx.s);
  DS_CUDA_CHECK(cudaStreamSynchronize(ctx.s));
  // h0 and r bf16-representable, so the prefix v and read-out dO carry them exactly.
  const Vec h0 = ctx.uniform_bf16(static_cast<size_t>(S), -0.5, 0.5);
  const Vec rr = ctx.uniform_bf16(static_cast<size_t>(S), -1.0, 1.0);
  Vec dfinal(rr.size());
  for (size_t i = 0; i < rr.size(); ++i) dfinal[i] = static_cast<float>(scale * rr[i]);
  {
    Vec pq(pre * Hk * D, 0.f), pk(pre * Hk * D, 0.f), pv(pre * Hv * D), pdO(pre * Hv * D, 0.f);
    Vec pg(pre * Hv, 0.f), pbeta(pre * Hv, 1.f);
    for (int64_t i = 0; i < pre; ++i) {
      pk[i * Hk * D + i] = 1.f;  // Hk = 1
      for (int64_t h = 0; h < Hv; ++h)
        for (int64_t j = 0; j < D; ++j) pv[(i * Hv + h) * D + j] = h0[(h * D + i) * D + j];
    }
    up_bf16(ctx.s, q.get(), 0, pq), up_bf16(ctx.s, k.get(), 0, pk), up_bf16(ctx.s, v.get(), 0, pv);
    up_bf16(ctx.s, dO.get(), 0, pdO), up_f32(ctx.s, g.get(), 0, pg), up_f32(ctx.s, beta.get(), 0, pbeta);
    const int64_t t1 = pre + N, n2 = gap + post;  // gap and read-out tokens
    Vec sq(n2 * Hk * D, 0.f), szero(n2 * Hk * D, 0.f), sv(n2 * Hv * D, 0.f), sdO(n2 * Hv * D, 0.f);
    Vec sg(n2 * Hv, 0.f), sbeta(n2 * Hv, 0.f);
    for (int64_t i = 0; i < post; ++i) {
      sq[(gap + i) * Hk * D + i] = 1.f;
      for (int64_t h = 0; h < Hv; ++h)
        for (int64_t j = 0; j < D; ++j) sdO[((gap + i) * Hv + h) * D + j] = rr[(h * D + i) * D + j];
    }
    up_bf16(ctx.s, q.get(), t1 * Hk * D, sq), up_bf16(ctx.s, k.get(), t1 * Hk * D, szero);
    up_bf16(ctx.s, v.get(), t1 * Hv * D, sv), up_bf16(ctx.s, dO.get(), t1 * Hv * D, sdO);
    up_f32(ctx.s, g.get(), t1 * Hv, sg), up_f32(ctx.s, beta.get(), t1 * Hv, sbeta);
  }
  auto h0_d = ctx.up(h0), dfinal_d = ctx.up(dfinal);

  // The chunked kernel, twice (the second run's o and dq into their own buffers; everything poisoned first).
  const int64_t cq = pre * Hk * D, cv = pre * Hv * D, cg = pre * Hv;  // the document's rows in the M-token buffers
  Buf<bf16> o_c(N * Hv * D), dq_c(N * Hk * D), dk_c(N * Hk * D), dv_c(N * Hv * D), o_c2(N * Hv * D), dq_c2(N * Hk * D);
  Buf<float> dg_c(N * Hv), dbeta_c(N * Hv), final_c(S), dh0_c(S);
  Buf<unsigned char> index(plan.index_bytes()), saved(plan.saved_bytes()), ws(plan.workspace_bytes());
  auto cu_c_d = ctx.up(cu_c);
  auto run_chunked = [&](bf16* o, bf16* dq) {
    DS_CUDA_CHECK(cudaMemsetAsync(o, 0xFF, N * Hv * D * sizeof(bf16), ctx.s));
    DS_CUDA_CHECK(cudaMemsetAsync(dq, 0xFF, N * Hk * D * sizeof(bf16), ctx.s));
    ctx.poison(dk_c), ctx.poison(dv_c), ctx.poison(dg_c), ctx.poison(dbeta_c), ctx.poison(final_c);
    ctx.poison(dh0_c), ctx.poison(index), ctx.poison(saved), ctx.poison(ws);
    ds::ops::cuda::gdn_chunked_prepare(plan, cu_c_d.get(), 1, N, index.get(), ctx.s);
    ds::ops::cuda::gdn_chunked_forward(plan, dc, index.get(), q.get() + cq, k.get() + cq, v.get() + cv, Hv * D,
                                       g.get() + cg, beta.get() + cg, h0_d.get(), o, final_c.get(), saved.get(),
                                       ws.get(), ctx.s);
    ds::ops::cuda::gdn_chunked_backward(plan, dc, index.get(), q.get() + cq, k.get() + cq, v.get() + cv, Hv * D,
                                        g.get() + cg, beta.get() + cg, saved.get(), dO.get() + cv, dfinal_d.get(), dq,
                                        dk_c.get(), dv_c.get(), Hv * D, dg_c.get(), dbeta_c.get(), dh0_c.get(),
                                        ws.get(), ctx.s);
  };
  run_chunked(o_c.get(), dq_c.get());
  run_chunked(o_c2.get(), dq_c2.get());

  // The simple kernel on the extended document.
  Buf<bf16> o_s(VD), dq_s(QK), dk_s(QK), dv_s(VD);
  Buf<float> dg_s(G), dbeta_s(G), states(total_chunks * S);
  Buf<unsigned char> scratch(scratch_bytes);
  auto cu_s_d = ctx.up(cu_s), coff_d = ctx.up(coff);
  ctx.poison(o_s), ctx.poison(dq_s), ctx.poison(dk_s), ctx.poison(dv_s), ctx.poison(dg_s), ctx.poison(dbeta_s);
  ctx.poison(states), ctx.poison(scratch);
  ds::ops::cuda::gated_delta_rule_forward(dsim, q.get(), k.get(), v.get(), Hv * D, g.get(), beta.get(), cu_s_d.get(),
                                          coff_d.get(), total_chunks, o_s.get(), states.get(), ctx.s);
  ds::ops::cuda::gated_delta_rule_backward(dsim, q.get(), k.get(), v.get(), Hv * D, g.get(), beta.get(),
                                           cu_s_d.get(), coff_d.get(), total_chunks, states.get(), dO.get(),
                                           dq_s.get(), dk_s.get(), dv_s.get(), Hv * D, dg_s.get(), dbeta_s.get(),
                                           scratch.get(), ctx.s);
  DS_CUDA_CHECK(cudaStreamSynchronize(ctx.s));
  DS_CUDA_LAUNCH_CHECK();

  // Whole tensors, relative L2 on the device. dh0 of the simple run: the dv rows of the prefix tokens, [i, h, j]
  // -> [h, i, j].
  Result r;
  r.what = "cuda-chunked vs cuda-simple gated_delta_rule, one document of " + std::to_string(N) +
           " tokens, Hk 1 Hv 2, initial state and final-state gradient";
  r.add("o", ds::test::cuda::rel_l2(o_c.get(), o_s.get() + cv, N * Hv * D, ctx.s), kForward);
  r.add("final state",
        ds::test::cuda::rel_l2(final_c.get(), states.get() + final_chunk * S, S, ctx.s), kForward);
  r.add("dq", ds::test::cuda::rel_l2(dq_c.get(), dq_s.get() + cq, N * Hk * D, ctx.s), kGradient8e3);
  r.add("dk", ds::test::cuda::rel_l2(dk_c.get(), dk_s.get() + cq, N * Hk * D, ctx.s), kGradient8e3);
  r.add("dv", ds::test::cuda::rel_l2(dv_c.get(), dv_s.get() + cv, N * Hv * D, ctx.s), kGradient8e3);
  r.add("dg", ds::test::cuda::rel_l2(dg_c.get(), dg_s.get() + cg, N * Hv, ctx.s), kGateGradient);
  r.add("dbeta", ds::test::cuda::rel_l2(dbeta_c.get(), dbeta_s.get() + cg, N * Hv, ctx.s), kGateGradient);
  {
    const Vec pdv = down_bf16(ctx.s, dv_s.get(), 0, pre * Hv * D), dh0 = down_f32(ctx.s, dh0_c.get(), 0, S);
    Vec dh0_ref(static_cast<size_t>(S));
    for (int64_t i = 0; i < pre; ++i)
      for (int64_t h = 0; h < Hv; ++h)
        for (int64_t j = 0; j < D; ++j) dh0_ref[(h * D + i) * D + j] = pdv[(i * Hv + h) * D + j];
    r.add("dinitial_state", ds::rel_l2(dh0, dh0_ref), kGradient8e3);
  }
  // The simple kernel's read-out tokens see the final state too (bf16 o = scale S[:, i, :]): a check that the
  // construction above is what it claims, independent of the chunked kernel.
  {
    const Vec ro = down_bf16(ctx.s, o_s.get(), (pre + N + gap) * Hv * D, post * Hv * D);
    const Vec fs = down_f32(ctx.s, states.get(), final_chunk * S, S);
    Vec want(ro.size());
    for (int64_t i = 0; i < post; ++i)
      for (int64_t h = 0; h < Hv; ++h)
        for (int64_t j = 0; j < D; ++j)
          want[(i * Hv + h) * D + j] = static_cast<float>(scale * fs[(h * D + i) * D + j]);
    r.add("simple read-out o = scale final state", ds::rel_l2(ro, want), kForward);
  }
  r.exact("two runs bitwise equal (o)", ds::test::cuda::same_bytes(o_c.get(), o_c2.get(), o_c.bytes(), ctx.s));
  r.exact("two runs bitwise equal (dq)", ds::test::cuda::same_bytes(dq_c.get(), dq_c2.get(), dq_c.bytes(), ctx.s));
  expect_ok(r);
}

}  // namespace

#endif  // DELTASTACK_CUDA
