// CUDA op kernels (src/ops/<op>/cuda.cu) against the fp32 CPU references (docs/cuda_backend.md "Tests"):
// fresh random inputs every run (seeds from std::random_device, printed on failure), rounded to bf16 for the
// CPU reference and uploaded as bf16; GPU outputs poisoned with NaN before every run (so an unwritten element
// fails the finite check in rel_l2); relative L2 error within DESIGN.md §5 bands (forward <= 5e-3,
// gradients <= 1e-2); and two identical GPU runs must give bitwise-identical outputs (determinism).
// Every shape list includes odd sizes or unaligned pointers so the scalar fallbacks run too.
// Skipped without a device. On a GPU machine: deltastack_tests --gtest_filter='CudaOps*'
#ifdef DELTASTACK_CUDA

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "core/bf16.h"
#include "core/cuda/cuda_utils.h"
#include "core/cuda/device.h"
#include "cuda_test_util.h"
#include "ops/adamw/adamw.h"
#include "ops/adamw/cuda.h"
#include "ops/attention/attention.h"
#include "ops/conv1d/conv1d.h"
#include "ops/conv1d/cuda.h"
#include "ops/elementwise/cuda.h"
#include "ops/embedding/cuda.h"
#include "ops/embedding/embedding.h"
#include "ops/gated_rmsnorm/cuda.h"
#include "ops/gated_rmsnorm/gated_rmsnorm.h"
#include "ops/gdn_gate/cuda.h"
#include "ops/gdn_gate/gdn_gate.h"
#include "ops/l2norm/cuda.h"
#include "ops/l2norm/l2norm.h"
#include "ops/rmsnorm/cuda.h"
#include "ops/rmsnorm/rmsnorm.h"
#include "ops/rope/cuda.h"
#include "ops/rope/rope.h"
#include "ops/swiglu/cuda.h"
#include "ops/swiglu/swiglu.h"
#include "test_util.h"

namespace {

using ds::test::randn;
using ds::test::randu;
using ds::test::rel_l2;
using namespace ds::test::cuda;
namespace gpu = ds::ops::cuda;

constexpr double kFwdTol = 5e-3;
constexpr double kGradTol = 1e-2;

// Packed documents: random lengths (including 1..3, shorter than a conv kernel) filling N tokens.
std::vector<int32_t> random_cu_seqlens(int64_t N, uint64_t seed, int64_t max_len) {
  ds::Rng r(seed);
  std::vector<int32_t> cu{0};
  while (cu.back() < N) {
    int64_t len = r.below(4) == 0 ? 1 + static_cast<int64_t>(r.below(3)) : 1 + static_cast<int64_t>(r.below(max_len));
    len = std::min<int64_t>(len, N - cu.back());
    cu.push_back(static_cast<int32_t>(cu.back() + len));
  }
  return cu;
}

// ------------------------------------------------------------------------------------------------ device

TEST(CudaOps, DeviceInfo) {
  DS_SKIP_WITHOUT_GPU();
  EXPECT_TRUE(ds::cuda_compiled());
  std::printf("[CudaOps] %d device(s); device 0: %s\n", ds::cuda_device_count(), ds::cuda_device_name().c_str());
}

// ------------------------------------------------------------------------------------------------ rmsnorm

void check_rmsnorm(int64_t rows, int64_t dim, bool zc, size_t off) {
  Seeds s;
  SCOPED_TRACE("rmsnorm " + shape({rows, dim}) + (zc ? " zero-centered" : " plain") + " offset " + std::to_string(off) +
               ", " + s.str());
  const float eps = 1e-6f;
  const int64_t n = rows * dim;
  const auto x = rounded(randn<float>(n, s.next()));
  const auto w = randn<float>(dim, s.next(), 0.2, zc ? 0.0 : 1.0);
  const auto dy = rounded(randn<float>(n, s.next()));
  const auto dw0 = randn<float>(dim, s.next(), 0.5);

  std::vector<float> y_ref(n), rstd_ref(rows), dx_ref(n), dw_ref = dw0;
  ds::ops::rmsnorm_forward<float>(x.data(), w.data(), y_ref.data(), rstd_ref.data(), rows, dim, eps, zc);
  ds::ops::rmsnorm_backward<float>(x.data(), w.data(), rstd_ref.data(), dy.data(), dx_ref.data(), dw_ref.data(), rows,
                                   dim, zc);

  DevBuf<bf16> x_(n, off), dy_(n, off), y_(n, off), dx_(n, off);
  DevBuf<float> w_(dim), rstd_(rows), dw_(dim);
  DevBuf<char> scratch(std::max<size_t>(gpu::rmsnorm_scratch_bytes(rows, dim), 1));
  upload_bf16(x_, x);
  upload(w_, w);
  upload_bf16(dy_, dy);

  struct Out {
    std::vector<uint16_t> y, dx, dx_alias;
    std::vector<float> rstd, dw;
  };
  auto run = [&] {
    Out o;
    y_.poison();
    rstd_.poison();
    gpu::rmsnorm_forward(x_.get(), w_.get(), y_.get(), rstd_.get(), rows, dim, eps, zc, nullptr);
    device_sync();
    o.y = download_bits(y_);
    o.rstd = download(rstd_);
    // Backward from the reference rstd (both sides see identical inputs).
    upload(rstd_, rstd_ref);
    upload(dw_, dw0);
    dx_.poison();
    gpu::rmsnorm_backward(x_.get(), w_.get(), rstd_.get(), dy_.get(), dx_.get(), dw_.get(), rows, dim, zc,
                          scratch.get(), nullptr);
    device_sync();
    o.dx = download_bits(dx_);
    o.dw = download(dw_);
    // dx aliasing dy (allowed by the API): same result.
    DevBuf<bf16> alias(n, off);
    upload_bf16(alias, dy);
    upload(dw_, dw0);
    gpu::rmsnorm_backward(x_.get(), w_.get(), rstd_.get(), alias.get(), alias.get(), dw_.get(), rows, dim, zc,
                          scratch.get(), nullptr);
    device_sync();
    o.dx_alias = download_bits(alias);
    return o;
  };
  const Out a = run(), b = run();
  EXPECT_LE(rel_l2(bits_to_f32(a.y), y_ref), kFwdTol);
  EXPECT_LE(rel_l2(a.rstd, rstd_ref), kFwdTol);
  EXPECT_LE(rel_l2(bits_to_f32(a.dx), dx_ref), kGradTol);
  EXPECT_LE(rel_l2(a.dw, dw_ref), kGradTol);
  EXPECT_TRUE(same_bits(a.dx, a.dx_alias)) << "dx aliasing dy differs";
  EXPECT_TRUE(same_bits(a.y, b.y) && same_bits(a.rstd, b.rstd) && same_bits(a.dx, b.dx) && same_bits(a.dw, b.dw))
      << "two identical runs differ";
}

TEST(CudaOps, RmsNorm) {
  DS_SKIP_WITHOUT_GPU();
  check_rmsnorm(4096, 2048, true, 0);  // block per row, 256 threads x 1 vector
  check_rmsnorm(1000, 5120, true, 0);  // block per row, 224 threads x 3 vectors
  check_rmsnorm(300, 4096, false, 0);  // 256 x 2, plain weight
  check_rmsnorm(200, 1000, true, 0);   // forward warp per row (4 vectors/lane), backward block per row
  check_rmsnorm(3000, 64, true, 0);    // 8 lanes per row
  check_rmsnorm(37, 72, false, 0);     // 9 vectors -> 16 lanes, partial group
  check_rmsnorm(37, 70, true, 0);      // dim % 8 != 0: scalar path
  check_rmsnorm(33, 128, true, 1);     // unaligned pointers: scalar path
  check_rmsnorm(1, 8, true, 0);        // one vector, one row
}

TEST(CudaOps, RmsNormQkHeads) {
  DS_SKIP_WITHOUT_GPU();
  check_rmsnorm(512 * 16, 256, true, 0);  // q norm rows = tokens x heads, head_dim 256: a warp per row
  check_rmsnorm(700 * 4, 128, true, 0);   // head_dim 128: 16 lanes
  check_rmsnorm(999, 32, true, 0);        // head_dim 32: 4 lanes
}

// ------------------------------------------------------------------------------------------------ gated rmsnorm

void check_gated(int64_t rows, int64_t d, size_t off) {
  Seeds s;
  SCOPED_TRACE("gated_rmsnorm " + shape({rows, d}) + " offset " + std::to_string(off) + ", " + s.str());
  const float eps = 1e-6f;
  const int64_t n = rows * d;
  const auto x = rounded(randn<float>(n, s.next()));
  const auto z = rounded(randn<float>(n, s.next(), 2.0));
  const auto w = randn<float>(d, s.next(), 0.3, 1.0);
  const auto dy = rounded(randn<float>(n, s.next()));
  const auto dw0 = randn<float>(d, s.next(), 0.5);

  std::vector<float> y_ref(n), rstd_ref(rows), dx_ref(n), dz_ref(n), dw_ref = dw0;
  ds::ops::gated_rmsnorm_forward<float>(x.data(), z.data(), w.data(), y_ref.data(), rstd_ref.data(), rows, d, eps);
  ds::ops::gated_rmsnorm_backward<float>(x.data(), z.data(), w.data(), rstd_ref.data(), dy.data(), dx_ref.data(),
                                         dz_ref.data(), dw_ref.data(), rows, d);

  DevBuf<bf16> x_(n, off), z_(n, off), y_(n, off), dy_(n, off), dx_(n, off), dz_(n, off);
  DevBuf<float> w_(d), rstd_(rows), dw_(d);
  DevBuf<char> scratch(std::max<size_t>(gpu::gated_rmsnorm_scratch_bytes(rows, d), 1));
  upload_bf16(x_, x);
  upload_bf16(z_, z);
  upload(w_, w);
  upload_bf16(dy_, dy);
  struct Out {
    std::vector<uint16_t> y, dx, dz;
    std::vector<float> rstd, dw;
  };
  auto run = [&] {
    Out o;
    y_.poison();
    rstd_.poison();
    gpu::gated_rmsnorm_forward(x_.get(), z_.get(), w_.get(), y_.get(), rstd_.get(), rows, d, eps, nullptr);
    device_sync();
    o.y = download_bits(y_);
    o.rstd = download(rstd_);
    upload(rstd_, rstd_ref);
    upload(dw_, dw0);
    dx_.poison();
    dz_.poison();
    gpu::gated_rmsnorm_backward(x_.get(), z_.get(), w_.get(), rstd_.get(), dy_.get(), dx_.get(), dz_.get(), dw_.get(),
                                rows, d, scratch.get(), nullptr);
    device_sync();
    o.dx = download_bits(dx_);
    o.dz = download_bits(dz_);
    o.dw = download(dw_);
    return o;
  };
  const Out a = run(), b = run();
  EXPECT_LE(rel_l2(bits_to_f32(a.y), y_ref), kFwdTol);
  EXPECT_LE(rel_l2(a.rstd, rstd_ref), kFwdTol);
  EXPECT_LE(rel_l2(bits_to_f32(a.dx), dx_ref), kGradTol);
  EXPECT_LE(rel_l2(bits_to_f32(a.dz), dz_ref), kGradTol);
  EXPECT_LE(rel_l2(a.dw, dw_ref), kGradTol);
  EXPECT_TRUE(same_bits(a.y, b.y) && same_bits(a.rstd, b.rstd) && same_bits(a.dx, b.dx) && same_bits(a.dz, b.dz) &&
              same_bits(a.dw, b.dw))
      << "two identical runs differ";
}

TEST(CudaOps, GatedRmsNorm) {
  DS_SKIP_WITHOUT_GPU();
  check_gated(2048 * 16, 128, 0);  // tokens x value heads, d = 128: 16 lanes per row
  check_gated(3000, 64, 0);
  check_gated(1000, 16, 0);  // 2 lanes per row
  check_gated(37, 72, 0);    // partial group
  check_gated(37, 70, 0);    // scalar path
  check_gated(41, 128, 1);   // unaligned: scalar path
  check_gated(64, 2048, 0);  // block per row (generality)
}

// ------------------------------------------------------------------------------------------------ l2norm

// Rows of `heads` x `dim` taken from column col0 of a [tokens, stride] buffer (q or k inside the conv output).
void check_l2norm(int64_t tokens, int64_t heads, int64_t dim, int64_t stride, int64_t col0) {
  Seeds s;
  SCOPED_TRACE("l2norm " + shape({tokens, heads, dim}) + " stride " + std::to_string(stride) + " col0 " +
               std::to_string(col0) + ", " + s.str());
  const float eps = 1e-6f;
  const int64_t rows = tokens * heads, n = rows * dim, nbuf = tokens * stride;
  const auto xbuf = rounded(randn<float>(nbuf, s.next()));
  const auto xg = columns(xbuf, stride, col0, heads * dim);
  std::vector<float> y_ref(n), rn_ref(rows), dx_ref(n);
  ds::ops::l2norm_forward<float>(xg.data(), y_ref.data(), rn_ref.data(), rows, dim, eps);
  const auto yb = rounded(y_ref);
  const auto dy = rounded(randn<float>(n, s.next()));
  ds::ops::l2norm_backward<float>(yb.data(), rn_ref.data(), dy.data(), dx_ref.data(), rows, dim);

  DevBuf<bf16> x_(nbuf), y_(n), yin_(n), dy_(n), dx_(nbuf);
  DevBuf<float> rn_(rows), rnin_(rows);
  upload_bf16(x_, xbuf);
  upload_bf16(yin_, yb);
  upload(rnin_, rn_ref);
  upload_bf16(dy_, dy);
  struct Out {
    std::vector<uint16_t> y, dx;
    std::vector<float> rn;
  };
  auto run = [&] {
    Out o;
    y_.poison();
    rn_.poison();
    gpu::l2norm_forward(x_.get() + col0, stride, y_.get(), rn_.get(), tokens, heads, dim, eps, nullptr);
    device_sync();
    o.y = download_bits(y_);
    o.rn = download(rn_);
    dx_.poison();
    gpu::l2norm_backward(yin_.get(), rnin_.get(), dy_.get(), dx_.get() + col0, stride, tokens, heads, dim, nullptr);
    device_sync();
    o.dx = columns(download_bits(dx_), stride, col0, heads * dim);
    return o;
  };
  const Out a = run(), b = run();
  EXPECT_LE(rel_l2(bits_to_f32(a.y), y_ref), kFwdTol);
  EXPECT_LE(rel_l2(a.rn, rn_ref), kFwdTol);
  EXPECT_LE(rel_l2(bits_to_f32(a.dx), dx_ref), kGradTol);
  EXPECT_TRUE(same_bits(a.y, b.y) && same_bits(a.rn, b.rn) && same_bits(a.dx, b.dx)) << "two identical runs differ";
}

TEST(CudaOps, L2Norm) {
  DS_SKIP_WITHOUT_GPU();
  check_l2norm(1024, 16, 128, 3 * 16 * 128, 16 * 128);  // k out of a [q | k | v] conv output
  check_l2norm(1024, 16, 128, 16 * 128, 0);             // contiguous
  check_l2norm(300, 4, 256, 4 * 256 + 64, 64);          // a warp per row
  check_l2norm(77, 3, 24, 80, 8);                       // 3 vectors -> 4 lanes
  check_l2norm(37, 2, 16, 40, 4);                       // x + 4 is not 16-byte aligned: scalar path
  check_l2norm(50, 2, 16, 36, 0);                       // stride % 8 != 0: scalar path
  check_l2norm(37, 3, 30, 95, 1);                       // dim % 8 != 0: scalar path
  check_l2norm(20, 2, 1024, 2048, 0);                   // warp per row, 4 vectors per lane
}

// ------------------------------------------------------------------------------------------------ swiglu

void check_swiglu(int64_t N, int64_t I, size_t off) {
  Seeds s;
  SCOPED_TRACE("swiglu " + shape({N, I}) + " offset " + std::to_string(off) + ", " + s.str());
  const int64_t n = N * I;
  const auto g = rounded(randn<float>(n, s.next(), 2.0));
  const auto u = rounded(randn<float>(n, s.next()));
  const auto dh = rounded(randn<float>(n, s.next()));
  std::vector<float> gu(2 * n);
  for (int64_t t = 0; t < N; ++t)
    for (int64_t c = 0; c < I; ++c) gu[t * 2 * I + c] = g[t * I + c], gu[t * 2 * I + I + c] = u[t * I + c];
  std::vector<float> h_ref(n), dg_ref(n), du_ref(n);
  ds::ops::swiglu_forward<float>(g.data(), u.data(), h_ref.data(), n);
  ds::ops::swiglu_backward<float>(g.data(), u.data(), dh.data(), dg_ref.data(), du_ref.data(), n);

  DevBuf<bf16> gu_(2 * n, off), h_(n, off), dh_(n, off), dgu_(2 * n, off);
  upload_bf16(gu_, gu);
  upload_bf16(dh_, dh);
  struct Out {
    std::vector<uint16_t> h, dgu;
  };
  auto run = [&] {
    Out o;
    h_.poison();
    dgu_.poison();
    gpu::swiglu_forward(gu_.get(), h_.get(), N, I, nullptr);
    gpu::swiglu_backward(gu_.get(), dh_.get(), dgu_.get(), N, I, nullptr);
    device_sync();
    o.h = download_bits(h_);
    o.dgu = download_bits(dgu_);
    return o;
  };
  const Out a = run(), b = run();
  const auto dgu = bits_to_f32(a.dgu);
  std::vector<float> dg(n), du(n);
  for (int64_t t = 0; t < N; ++t)
    for (int64_t c = 0; c < I; ++c) dg[t * I + c] = dgu[t * 2 * I + c], du[t * I + c] = dgu[t * 2 * I + I + c];
  EXPECT_LE(rel_l2(bits_to_f32(a.h), h_ref), kFwdTol);
  EXPECT_LE(rel_l2(dg, dg_ref), kGradTol);
  EXPECT_LE(rel_l2(du, du_ref), kGradTol);
  EXPECT_TRUE(same_bits(a.h, b.h) && same_bits(a.dgu, b.dgu)) << "two identical runs differ";
}

TEST(CudaOps, SwiGlu) {
  DS_SKIP_WITHOUT_GPU();
  check_swiglu(256, 17408, 0);  // Qwen3.5 intermediate size
  check_swiglu(512, 2048, 0);
  check_swiglu(33, 100, 0);   // I % 8 != 0: scalar path
  check_swiglu(64, 256, 1);   // unaligned: scalar path
  check_swiglu(70000, 8, 0);  // more rows than one grid dimension holds
}

// ------------------------------------------------------------------------------------------------ gdn gates

void check_gdn_gate(int64_t N, int64_t Hv) {
  Seeds s;
  SCOPED_TRACE("gdn_gate " + shape({N, Hv}) + ", " + s.str());
  const int64_t n = N * Hv;
  // a spans the softplus threshold (a + dt_bias > 20 for some entries).
  const auto a = rounded(randn<float>(n, s.next(), 8.0));
  const auto b = rounded(randn<float>(n, s.next(), 3.0));
  auto A_log = randu<float>(Hv, s.next(), 0.0, 2.7);
  const auto dt_bias = randn<float>(Hv, s.next(), 1.0);
  const auto dg = randn<float>(n, s.next());
  const auto dbeta = randn<float>(n, s.next());
  const auto dA0 = randn<float>(Hv, s.next(), 0.1);
  const auto ddt0 = randn<float>(Hv, s.next(), 0.1);
  std::vector<float> ab(2 * n);
  for (int64_t t = 0; t < N; ++t)
    for (int64_t h = 0; h < Hv; ++h) ab[t * 2 * Hv + h] = b[t * Hv + h], ab[t * 2 * Hv + Hv + h] = a[t * Hv + h];
  std::vector<float> g_ref(n), beta_ref(n), da_ref(n), db_ref(n), dA_ref = dA0, ddt_ref = ddt0;
  ds::ops::gdn_gate_forward<float>(a.data(), b.data(), A_log.data(), dt_bias.data(), g_ref.data(), beta_ref.data(), N,
                                   Hv);
  ds::ops::gdn_gate_backward<float>(a.data(), b.data(), A_log.data(), dt_bias.data(), dg.data(), dbeta.data(),
                                    da_ref.data(), db_ref.data(), dA_ref.data(), ddt_ref.data(), N, Hv);

  DevBuf<bf16> ab_(2 * n), dab_(2 * n);
  DevBuf<float> A_(Hv), dt_(Hv), g_(n), beta_(n), dg_(n), dbeta_(n), dA_(Hv), ddt_(Hv);
  DevBuf<char> scratch(std::max<size_t>(gpu::gdn_gate_scratch_bytes(N, Hv), 1));
  upload_bf16(ab_, ab);
  upload(A_, A_log);
  upload(dt_, dt_bias);
  upload(dg_, dg);
  upload(dbeta_, dbeta);
  struct Out {
    std::vector<float> g, beta, dA, ddt;
    std::vector<uint16_t> dab;
  };
  auto run = [&] {
    Out o;
    g_.poison();
    beta_.poison();
    dab_.poison();
    upload(dA_, dA0);
    upload(ddt_, ddt0);
    gpu::gdn_gate_forward(ab_.get(), A_.get(), dt_.get(), g_.get(), beta_.get(), N, Hv, nullptr);
    gpu::gdn_gate_backward(ab_.get(), A_.get(), dt_.get(), dg_.get(), dbeta_.get(), dab_.get(), dA_.get(), ddt_.get(),
                           N, Hv, scratch.get(), nullptr);
    device_sync();
    o.g = download(g_);
    o.beta = download(beta_);
    o.dab = download_bits(dab_);
    o.dA = download(dA_);
    o.ddt = download(ddt_);
    return o;
  };
  const Out x = run(), y = run();
  const auto dab = bits_to_f32(x.dab);
  std::vector<float> da(n), db(n);
  for (int64_t t = 0; t < N; ++t)
    for (int64_t h = 0; h < Hv; ++h) db[t * Hv + h] = dab[t * 2 * Hv + h], da[t * Hv + h] = dab[t * 2 * Hv + Hv + h];
  EXPECT_LE(rel_l2(x.g, g_ref), kFwdTol);
  EXPECT_LE(rel_l2(x.beta, beta_ref), kFwdTol);
  EXPECT_LE(rel_l2(da, da_ref), kGradTol);
  EXPECT_LE(rel_l2(db, db_ref), kGradTol);
  EXPECT_LE(rel_l2(x.dA, dA_ref), kGradTol);
  EXPECT_LE(rel_l2(x.ddt, ddt_ref), kGradTol);
  EXPECT_TRUE(same_bits(x.g, y.g) && same_bits(x.beta, y.beta) && same_bits(x.dab, y.dab) && same_bits(x.dA, y.dA) &&
              same_bits(x.ddt, y.ddt))
      << "two identical runs differ";
}

TEST(CudaOps, GdnGate) {
  DS_SKIP_WITHOUT_GPU();
  check_gdn_gate(8192, 32);
  check_gdn_gate(37, 48);  // more heads than one 32-wide chunk
  check_gdn_gate(70, 5);
  check_gdn_gate(1, 16);
}

// ------------------------------------------------------------------------------------------------ embedding

void check_embedding(int64_t N, int64_t V, int64_t H, int64_t distinct, size_t off) {
  Seeds s;
  SCOPED_TRACE("embedding N=" + std::to_string(N) + " V=" + std::to_string(V) + " H=" + std::to_string(H) + " offset " +
               std::to_string(off) + ", " + s.str());
  ds::Rng r(s.next());
  std::vector<int32_t> ids(N);
  for (int64_t i = 0; i < N; ++i)  // many duplicates; one very frequent id
    ids[i] = i % 5 == 0 ? 7 % V : static_cast<int32_t>(r.below(static_cast<uint64_t>(distinct)));
  const auto table = rounded(randn<float>(V * H, s.next()));
  const auto dout = rounded(randn<float>(N * H, s.next()));
  const auto dtable0 = randn<float>(V * H, s.next(), 0.1);
  std::vector<float> out_ref(N * H), dtable_ref = dtable0;
  ds::ops::embedding_forward<float>(ids.data(), N, table.data(), V, H, out_ref.data());
  ds::ops::embedding_backward<float>(ids.data(), N, dout.data(), V, H, dtable_ref.data());

  const IdGroups grp = group_ids(ids);  // positions sorted by id, then by position
  const int64_t U = static_cast<int64_t>(grp.uniq.size());

  DevBuf<int32_t> ids_(N), uniq_(U), starts_(U + 1), pos_(N);
  DevBuf<bf16> table_(V * H, off), out_(N * H, off), dout_(N * H, off);
  DevBuf<float> dtable_(V * H, off);
  upload(ids_, ids);
  upload(uniq_, grp.uniq);
  upload(starts_, grp.starts);
  upload(pos_, grp.positions);
  upload_bf16(table_, table);
  upload_bf16(dout_, dout);
  struct Out {
    std::vector<uint16_t> out;
    std::vector<float> dtable;
  };
  auto run = [&] {
    Out o;
    out_.poison();
    upload(dtable_, dtable0);
    gpu::embedding_forward(ids_.get(), table_.get(), out_.get(), N, H, nullptr);
    gpu::embedding_backward(uniq_.get(), starts_.get(), pos_.get(), U, dout_.get(), dtable_.get(), H, nullptr);
    device_sync();
    o.out = download_bits(out_);
    o.dtable = download(dtable_);
    return o;
  };
  const Out a = run(), b = run();
  EXPECT_LE(rel_l2(bits_to_f32(a.out), out_ref), kFwdTol);
  EXPECT_LE(rel_l2(a.dtable, dtable_ref), kGradTol);
  EXPECT_TRUE(same_bits(a.out, b.out) && same_bits(a.dtable, b.dtable)) << "two identical runs differ";
}

TEST(CudaOps, Embedding) {
  DS_SKIP_WITHOUT_GPU();
  check_embedding(4096, 1000, 2048, 300, 0);  // duplicates; id 7 on every 5th token
  check_embedding(300, 50, 5120, 50, 0);
  check_embedding(50, 20, 100, 20, 0);  // H % 8 != 0: scalar path
  check_embedding(64, 30, 256, 30, 1);  // unaligned: scalar path
}

// ------------------------------------------------------------------------------------------------ conv1d

void check_conv1d(int64_t N, int64_t C, int64_t K, int64_t max_doc, size_t off) {
  Seeds s;
  SCOPED_TRACE("conv1d " + shape({N, C, K}) + " max_doc " + std::to_string(max_doc) + " offset " + std::to_string(off) +
               ", " + s.str());
  const auto cu = random_cu_seqlens(N, s.next(), max_doc);
  const int64_t num_seqs = static_cast<int64_t>(cu.size()) - 1;
  const auto seq_start = seq_starts(cu);
  const auto x = rounded(randn<float>(N * C, s.next()));
  const auto w = randn<float>(C * K, s.next(), 0.5);
  const auto dy = rounded(randn<float>(N * C, s.next()));
  const auto dw0 = randn<float>(C * K, s.next(), 0.1);
  std::vector<float> y_ref(N * C), dx_ref(N * C), dw_ref = dw0;
  ds::ops::conv1d_silu_forward<float>(x.data(), w.data(), cu.data(), num_seqs, N, C, K, y_ref.data());
  ds::ops::conv1d_silu_backward<float>(x.data(), w.data(), dy.data(), cu.data(), num_seqs, N, C, K, dx_ref.data(),
                                       dw_ref.data());

  DevBuf<bf16> x_(N * C, off), y_(N * C, off), dy_(N * C, off), dx_(N * C, off);
  DevBuf<float> w_(C * K), dw_(C * K);
  DevBuf<int32_t> ss_(N);
  DevBuf<char> scratch(std::max<size_t>(gpu::conv1d_scratch_bytes(N, C, K), 1));
  upload_bf16(x_, x);
  upload(w_, w);
  upload_bf16(dy_, dy);
  upload(ss_, seq_start);
  struct Out {
    std::vector<uint16_t> y, dx;
    std::vector<float> dw;
  };
  auto run = [&] {
    Out o;
    y_.poison();
    dx_.poison();
    upload(dw_, dw0);
    gpu::conv1d_silu_forward(x_.get(), w_.get(), ss_.get(), y_.get(), N, C, K, nullptr);
    gpu::conv1d_silu_backward(x_.get(), w_.get(), dy_.get(), ss_.get(), dx_.get(), dw_.get(), N, C, K, scratch.get(),
                              nullptr);
    device_sync();
    o.y = download_bits(y_);
    o.dx = download_bits(dx_);
    o.dw = download(dw_);
    return o;
  };
  const Out a = run(), b = run();
  EXPECT_LE(rel_l2(bits_to_f32(a.y), y_ref), kFwdTol);
  EXPECT_LE(rel_l2(bits_to_f32(a.dx), dx_ref), kGradTol);
  EXPECT_LE(rel_l2(a.dw, dw_ref), kGradTol);
  EXPECT_TRUE(same_bits(a.y, b.y) && same_bits(a.dx, b.dx) && same_bits(a.dw, b.dw)) << "two identical runs differ";
}

TEST(CudaOps, Conv1dPacked) {
  DS_SKIP_WITHOUT_GPU();
  check_conv1d(2048, 10240, 4, 600, 0);  // Qwen3.5 conv_dim; documents span the backward slots
  check_conv1d(1000, 512, 4, 6, 0);      // many documents shorter than K
  check_conv1d(37, 36, 4, 5, 0);         // C % 8 != 0: scalar forward, 4-channel backward
  check_conv1d(37, 34, 3, 9, 0);         // C % 4 != 0: scalar both ways, K = 3
  check_conv1d(100, 64, 4, 40, 1);       // unaligned: scalar both ways
  check_conv1d(300, 128, 2, 50, 0);      // K = 2
  check_conv1d(5, 16, 4, 100, 0);        // fewer tokens than K - 1 + one tile
}

// ------------------------------------------------------------------------------------------------ rope

void check_rope(int64_t N, int64_t H, int64_t hd, int64_t rd, size_t off) {
  Seeds s;
  SCOPED_TRACE("rope " + shape({N, H, hd}) + " rotary " + std::to_string(rd) + " offset " + std::to_string(off) + ", " +
               s.str());
  const auto cu = random_cu_seqlens(N, s.next(), 400);
  const auto pos = positions_in_docs(cu);
  const int64_t half = rd / 2, n = N * H * hd;
  std::vector<float> cos_t(N * half), sin_t(N * half);
  ds::ops::rope_tables<float>(pos.data(), N, rd, 1e7, cos_t.data(), sin_t.data());
  const auto x = rounded(randn<float>(n, s.next()));
  DevBuf<bf16> x_(n, off);
  DevBuf<float> c_(N * half), s_(N * half);
  upload(c_, cos_t);
  upload(s_, sin_t);
  for (bool inverse : {false, true}) {
    SCOPED_TRACE(inverse ? "inverse" : "forward");
    auto ref = x;
    ds::ops::rope_apply<float>(ref.data(), N, H, hd, rd, cos_t.data(), sin_t.data(), inverse);
    auto run = [&] {
      upload_bf16(x_, x);
      gpu::rope_apply(x_.get(), N, H, hd, rd, c_.get(), s_.get(), inverse, nullptr);
      device_sync();
      return download_bits(x_);
    };
    const auto a = run(), b = run();
    EXPECT_LE(rel_l2(bits_to_f32(a), ref), inverse ? kGradTol : kFwdTol);
    EXPECT_TRUE(same_bits(a, b)) << "two identical runs differ";
  }
}

TEST(CudaOps, Rope) {
  DS_SKIP_WITHOUT_GPU();
  check_rope(1024, 16, 256, 64, 0);  // Qwen3.5: 25% of head_dim 256 rotates
  check_rope(512, 4, 128, 128, 0);   // full rotation
  check_rope(77, 3, 72, 36, 0);      // half % 8 != 0: scalar path
  check_rope(64, 2, 256, 64, 1);     // unaligned: scalar path
}

// ------------------------------------------------------------------------------------------------ adamw

void check_adamw(int64_t n, size_t off, bool with_bf16) {
  Seeds s;
  SCOPED_TRACE("adamw n=" + std::to_string(n) + " offset " + std::to_string(off) + ", " + s.str());
  auto param = randn<float>(n, s.next(), 0.02);
  const auto grad = randn<float>(n, s.next(), 1e-3);
  auto m = randn<float>(n, s.next(), 1e-3);
  auto v = randu<float>(n, s.next(), 0.0, 1e-6);
  ds::ops::AdamWParams ap;
  ap.lr = 3e-4, ap.beta1 = 0.9, ap.beta2 = 0.95, ap.eps = 1e-8, ap.weight_decay = 0.1, ap.step = 17;
  ap.grad_scale = 0.7;
  auto p_ref = param, m_ref = m, v_ref = v;
  ds::ops::adamw_update(p_ref.data(), grad.data(), m_ref.data(), v_ref.data(), n, ap);
  const double ss_ref = ds::ops::sum_squares(grad.data(), n);

  DevBuf<float> p_(n, off), g_(n, off), m_(n, off), v_(n, off);
  DevBuf<bf16> pb_(n, off);
  DevBuf<double> ss_(1);
  DevBuf<char> scratch(std::max<size_t>(gpu::sum_squares_scratch_bytes(n), 1));
  upload(g_, grad);
  struct Out {
    std::vector<float> p, m, v;
    std::vector<uint16_t> pb, cvt;
    double ss = 0;
  };
  auto run = [&] {
    Out o;
    upload(p_, param);
    upload(m_, m);
    upload(v_, v);
    pb_.poison();
    ss_.poison();
    gpu::sum_squares(g_.get(), n, ss_.get(), scratch.get(), nullptr);
    gpu::adamw_update(p_.get(), g_.get(), m_.get(), v_.get(), with_bf16 ? pb_.get() : nullptr, n, ap, nullptr);
    device_sync();
    o.p = download(p_);
    o.m = download(m_);
    o.v = download(v_);
    o.pb = download_bits(pb_);
    o.ss = download(ss_)[0];
    pb_.poison();
    gpu::to_bf16(p_.get(), pb_.get(), n, nullptr);
    device_sync();
    o.cvt = download_bits(pb_);
    return o;
  };
  const Out a = run(), b = run();
  EXPECT_LE(rel_l2(a.p, p_ref), kFwdTol);
  EXPECT_LE(rel_l2(a.m, m_ref), kFwdTol);
  EXPECT_LE(rel_l2(a.v, v_ref), kFwdTol);
  // The update itself: compare the step p_new - p_old (much smaller than p), not only p.
  std::vector<double> dp(n), dp_ref(n);
  for (int64_t i = 0; i < n; ++i) dp[i] = double(a.p[i]) - param[i], dp_ref[i] = double(p_ref[i]) - param[i];
  EXPECT_LE(rel_l2(dp, dp_ref), kFwdTol);
  std::vector<float> p_rounded = rounded(a.p);
  if (with_bf16) {
    EXPECT_LE(rel_l2(bits_to_f32(a.pb), p_rounded), kFwdTol);
    EXPECT_TRUE(same_bits(bits_to_f32(a.pb), p_rounded)) << "bf16 copy is not the RNE rounding of the fp32 param";
  }
  EXPECT_TRUE(same_bits(bits_to_f32(a.cvt), p_rounded)) << "to_bf16 is not round-to-nearest-even";
  EXPECT_NEAR(a.ss, ss_ref, 1e-10 * ss_ref);
  EXPECT_TRUE(same_bits(a.p, b.p) && same_bits(a.m, b.m) && same_bits(a.v, b.v) && same_bits(a.pb, b.pb) &&
              same_bits(a.cvt, b.cvt) && std::memcmp(&a.ss, &b.ss, sizeof(double)) == 0)
      << "two identical runs differ";
}

TEST(CudaOps, AdamW) {
  DS_SKIP_WITHOUT_GPU();
  check_adamw(1000003, 0, true);  // float4 body + scalar tail; sum_squares over many blocks
  check_adamw(4096, 0, false);    // no bf16 copy
  check_adamw(1001, 1, true);     // unaligned: scalar path
  check_adamw(3, 0, true);        // shorter than a vector
}

// ------------------------------------------------------------------------------------------------ elementwise

void check_elementwise(int64_t n, size_t off) {
  Seeds s;
  SCOPED_TRACE("elementwise n=" + std::to_string(n) + " offset " + std::to_string(off) + ", " + s.str());
  const auto a = rounded(randn<float>(n, s.next()));
  const auto b = rounded(randn<float>(n, s.next(), 2.0));
  const auto dy = rounded(randn<float>(n, s.next()));
  std::vector<float> add_ref(n), gate_ref(n), dout_ref(n), dgate_ref(n);
  for (int64_t i = 0; i < n; ++i) add_ref[i] = a[i] + b[i];
  ds::ops::output_gate_forward<float>(a.data(), b.data(), gate_ref.data(), n);
  ds::ops::output_gate_backward<float>(a.data(), b.data(), dy.data(), dout_ref.data(), dgate_ref.data(), n);

  DevBuf<bf16> a_(n, off), b_(n, off), dy_(n, off), y_(n, off), g_(n, off), dout_(n, off), dgate_(n, off),
      alias(n, off);
  DevBuf<float> f_(n, off);
  upload_bf16(a_, a);
  upload_bf16(b_, b);
  upload_bf16(dy_, dy);
  struct Out {
    std::vector<uint16_t> add, add_alias, gate, dout, dgate;
    std::vector<float> f32;
  };
  auto run = [&] {
    Out o;
    for (DevBuf<bf16>* d : {&y_, &g_, &dout_, &dgate_}) d->poison();
    f_.poison();
    gpu::add(a_.get(), b_.get(), y_.get(), n, nullptr);
    gpu::output_gate_forward(a_.get(), b_.get(), g_.get(), n, nullptr);
    gpu::output_gate_backward(a_.get(), b_.get(), dy_.get(), dout_.get(), dgate_.get(), n, nullptr);
    gpu::bf16_to_f32(a_.get(), f_.get(), n, nullptr);
    upload_bf16(alias, a);
    gpu::add(alias.get(), b_.get(), alias.get(), n, nullptr);  // y aliases a (residual add in place)
    device_sync();
    o.add = download_bits(y_);
    o.add_alias = download_bits(alias);
    o.gate = download_bits(g_);
    o.dout = download_bits(dout_);
    o.dgate = download_bits(dgate_);
    o.f32 = download(f_);
    return o;
  };
  const Out x = run(), y = run();
  EXPECT_LE(rel_l2(bits_to_f32(x.add), add_ref), kFwdTol);
  EXPECT_TRUE(same_bits(x.add, x.add_alias)) << "in-place add differs";
  EXPECT_TRUE(same_bits(bits_to_f32(x.add), rounded(add_ref))) << "add is not one rounding of the fp32 sum";
  EXPECT_LE(rel_l2(bits_to_f32(x.gate), gate_ref), kFwdTol);
  EXPECT_LE(rel_l2(bits_to_f32(x.dout), dout_ref), kGradTol);
  EXPECT_LE(rel_l2(bits_to_f32(x.dgate), dgate_ref), kGradTol);
  EXPECT_TRUE(same_bits(x.f32, a)) << "bf16_to_f32 is not exact";
  EXPECT_TRUE(same_bits(x.add, y.add) && same_bits(x.gate, y.gate) && same_bits(x.dout, y.dout) &&
              same_bits(x.dgate, y.dgate) && same_bits(x.f32, y.f32))
      << "two identical runs differ";
}

TEST(CudaOps, Elementwise) {
  DS_SKIP_WITHOUT_GPU();
  check_elementwise((1 << 20) + 3, 0);  // 16-byte body + scalar tail
  check_elementwise(1001, 1);           // unaligned: scalar path
  check_elementwise(5, 0);
}

void check_copy_rows(int64_t rows, int64_t cols, int64_t ss, int64_t ds_, size_t off) {
  Seeds s;
  SCOPED_TRACE("copy_rows " + shape({rows, cols}) + " strides " + std::to_string(ss) + "/" + std::to_string(ds_) +
               " offset " + std::to_string(off) + ", " + s.str());
  const auto src = rounded(randn<float>(rows * ss, s.next()));
  const auto dst0 = rounded(randn<float>(rows * ds_, s.next()));
  auto ref = dst0;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) ref[r * ds_ + c] = src[r * ss + c];
  DevBuf<bf16> src_(rows * ss, off), dst_(rows * ds_, off);
  upload_bf16(src_, src);
  auto run = [&] {
    upload_bf16(dst_, dst0);
    gpu::copy_rows(src_.get(), ss, dst_.get(), ds_, rows, cols, nullptr);
    device_sync();
    return download_bits(dst_);
  };
  const auto a = run(), b = run();
  EXPECT_TRUE(same_bits(bits_to_f32(a), ref)) << "copy_rows is not an exact strided copy (or wrote outside the rows)";
  EXPECT_TRUE(same_bits(a, b)) << "two identical runs differ";
}

TEST(CudaOps, CopyRows) {
  DS_SKIP_WITHOUT_GPU();
  check_copy_rows(1000, 2048, 6144, 2048, 0);  // one slice of a fused projection output
  check_copy_rows(100, 64, 96, 80, 0);
  check_copy_rows(70000, 8, 16, 8, 0);  // more rows than one grid dimension holds
  check_copy_rows(37, 13, 20, 15, 0);   // scalar path
  check_copy_rows(37, 64, 64, 64, 1);   // unaligned: scalar path
}

}  // namespace

#endif  // DELTASTACK_CUDA
