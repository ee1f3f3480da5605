// Embedding, (zero-centered) RMSNorm, gated RMSNorm, SwiGLU, linear and AdamW against closed forms and
// central finite differences in float64.
#include <gtest/gtest.h>

#include <cmath>

#include "core/bf16.h"
#include "core/cpu_blas.h"
#include "core/error.h"
#include "ops/adamw/adamw.h"
#include "ops/adamw/bf16_state.h"
#include "ops/embedding/embedding.h"
#include "ops/gated_rmsnorm/gated_rmsnorm.h"
#include "ops/linear/linear.h"
#include "ops/rmsnorm/rmsnorm.h"
#include "ops/swiglu/swiglu.h"
#include "test_util.h"

using namespace ds;
using ds::test::dot;
using ds::test::numeric_grad;
using ds::test::randn;
using ds::test::rel_l2;

TEST(RmsNorm, ForwardMatchesClosedForm) {
  const int64_t R = 3, D = 5;
  auto x = randn<double>(R * D, 1), w = randn<double>(D, 2, 0.1);
  std::vector<double> y(R * D), rstd(R);
  ops::rmsnorm_forward(x.data(), w.data(), y.data(), rstd.data(), R, D, 1e-6, true);
  for (int64_t r = 0; r < R; ++r) {
    double ms = 0;
    for (int64_t j = 0; j < D; ++j) ms += x[r * D + j] * x[r * D + j] / D;
    for (int64_t j = 0; j < D; ++j) EXPECT_NEAR(y[r * D + j], x[r * D + j] / std::sqrt(ms + 1e-6) * (1 + w[j]), 1e-12);
  }
}

TEST(RmsNorm, BackwardMatchesFiniteDifferences) {
  for (bool zc : {true, false}) {
    const int64_t R = 4, D = 6;
    auto x = randn<double>(R * D, 3), w = randn<double>(D, 4, 0.5), wy = randn<double>(R * D, 5);
    auto f = [&]() {
      std::vector<double> y(R * D), rs(R);
      ops::rmsnorm_forward(x.data(), w.data(), y.data(), rs.data(), R, D, 1e-6, zc);
      return dot(y, wy);
    };
    std::vector<double> y(R * D), rs(R), dx(R * D), dw(D, 0.0);
    ops::rmsnorm_forward(x.data(), w.data(), y.data(), rs.data(), R, D, 1e-6, zc);
    ops::rmsnorm_backward(x.data(), w.data(), rs.data(), wy.data(), dx.data(), dw.data(), R, D, zc);
    EXPECT_LE(rel_l2(dx, numeric_grad(x, f)), 1e-6);
    EXPECT_LE(rel_l2(dw, numeric_grad(w, f)), 1e-6);
  }
}

TEST(GatedRmsNorm, BackwardMatchesFiniteDifferences) {
  const int64_t R = 5, D = 4;
  auto x = randn<double>(R * D, 6), z = randn<double>(R * D, 7, 2.0), w = randn<double>(D, 8, 0.3, 1.0),
       wy = randn<double>(R * D, 9);
  auto f = [&]() {
    std::vector<double> y(R * D), rs(R);
    ops::gated_rmsnorm_forward(x.data(), z.data(), w.data(), y.data(), rs.data(), R, D, 1e-6);
    return dot(y, wy);
  };
  std::vector<double> y(R * D), rs(R), dx(R * D), dz(R * D), dw(D, 0.0);
  ops::gated_rmsnorm_forward(x.data(), z.data(), w.data(), y.data(), rs.data(), R, D, 1e-6);
  // closed form for one entry
  double ms = 0;
  for (int j = 0; j < D; ++j) ms += x[j] * x[j] / D;
  EXPECT_NEAR(y[1], x[1] / std::sqrt(ms + 1e-6) * w[1] * z[1] / (1 + std::exp(-z[1])), 1e-12);
  ops::gated_rmsnorm_backward(x.data(), z.data(), w.data(), rs.data(), wy.data(), dx.data(), dz.data(), dw.data(), R, D);
  EXPECT_LE(rel_l2(dx, numeric_grad(x, f)), 1e-6);
  EXPECT_LE(rel_l2(dz, numeric_grad(z, f)), 1e-6);
  EXPECT_LE(rel_l2(dw, numeric_grad(w, f)), 1e-6);
}

TEST(SwiGlu, BackwardMatchesFiniteDifferences) {
  const int64_t n = 17;
  auto g = randn<double>(n, 10, 3.0), u = randn<double>(n, 11), wy = randn<double>(n, 12);
  auto f = [&]() {
    std::vector<double> h(n);
    ops::swiglu_forward(g.data(), u.data(), h.data(), n);
    return dot(h, wy);
  };
  std::vector<double> h(n), dg(n), du(n);
  ops::swiglu_forward(g.data(), u.data(), h.data(), n);
  EXPECT_NEAR(h[3], g[3] / (1 + std::exp(-g[3])) * u[3], 1e-14);
  ops::swiglu_backward(g.data(), u.data(), wy.data(), dg.data(), du.data(), n);
  EXPECT_LE(rel_l2(dg, numeric_grad(g, f)), 1e-6);
  EXPECT_LE(rel_l2(du, numeric_grad(u, f)), 1e-6);
}

TEST(Linear, ForwardBackwardMatchNaive) {
  const int64_t M = 3, K = 4, N = 5;
  auto x = randn<double>(M * K, 13), W = randn<double>(N * K, 14), wy = randn<double>(M * N, 15);
  auto f = [&]() {
    std::vector<double> y(M * N);
    ops::linear_forward(x.data(), W.data(), y.data(), M, K, N);
    return dot(y, wy);
  };
  std::vector<double> y(M * N);
  ops::linear_forward(x.data(), W.data(), y.data(), M, K, N);
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) {
      double s = 0;
      for (int64_t k = 0; k < K; ++k) s += x[i * K + k] * W[j * K + k];
      EXPECT_NEAR(y[i * N + j], s, 1e-12);
    }
  std::vector<double> dx(M * K), dW(N * K, 0.0);
  ops::linear_backward(x.data(), W.data(), wy.data(), dx.data(), dW.data(), M, K, N);
  EXPECT_LE(rel_l2(dx, numeric_grad(x, f)), 1e-6);
  EXPECT_LE(rel_l2(dW, numeric_grad(W, f)), 1e-6);
}

TEST(Embedding, GatherScatterAndRangeCheck) {
  const int64_t V = 5, D = 3;
  auto table = randn<double>(V * D, 16);
  std::vector<int32_t> ids = {4, 0, 4};
  std::vector<double> out(3 * D);
  ops::embedding_forward(ids.data(), 3, table.data(), V, D, out.data());
  for (int j = 0; j < D; ++j) EXPECT_EQ(out[2 * D + j], table[4 * D + j]);
  std::vector<double> dout = randn<double>(3 * D, 17), dt(V * D, 0.0);
  ops::embedding_backward(ids.data(), 3, dout.data(), V, D, dt.data());
  for (int j = 0; j < D; ++j) {
    EXPECT_DOUBLE_EQ(dt[4 * D + j], dout[0 * D + j] + dout[2 * D + j]);
    EXPECT_DOUBLE_EQ(dt[1 * D + j], 0.0);
  }
  std::vector<int32_t> bad = {5};
  EXPECT_THROW(ops::embedding_forward(bad.data(), 1, table.data(), V, D, out.data()), ds::Error);
}

TEST(AdamW, MatchesTorchFormulaForTwoSteps) {
  // torch.optim.AdamW: p *= 1 - lr*wd; m, v updates; p -= lr/bc1 * m / (sqrt(v)/sqrt(bc2) + eps)
  std::vector<float> p = {1.0f, -2.0f}, m(2, 0.0f), v(2, 0.0f);
  std::vector<float> g1 = {0.5f, -0.25f}, g2 = {-0.1f, 0.3f};
  ops::AdamWParams ap;
  ap.lr = 0.1;
  ap.weight_decay = 0.01;
  ap.beta1 = 0.9;
  ap.beta2 = 0.999;
  ap.eps = 1e-8;
  double P[2] = {1.0, -2.0}, M[2] = {0, 0}, Vv[2] = {0, 0};
  for (int step = 1; step <= 2; ++step) {
    const auto& g = step == 1 ? g1 : g2;
    ap.step = step;
    ops::adamw_update(p.data(), g.data(), m.data(), v.data(), 2, ap);
    for (int i = 0; i < 2; ++i) {
      P[i] *= 1 - 0.1 * 0.01;
      M[i] = 0.9 * M[i] + 0.1 * g[i];
      Vv[i] = 0.999 * Vv[i] + 0.001 * g[i] * g[i];
      double bc1 = 1 - std::pow(0.9, step), bc2 = 1 - std::pow(0.999, step);
      P[i] -= 0.1 / bc1 * M[i] / (std::sqrt(Vv[i]) / std::sqrt(bc2) + 1e-8);
      EXPECT_NEAR(p[i], P[i], 5e-6);  // fp32 update vs float64 formula
    }
  }
  std::vector<float> big(10000, 0.5f);
  EXPECT_DOUBLE_EQ(ops::sum_squares(big.data(), 10000), 2500.0);
}

// The lean optimizer-state mode (ops/adamw/bf16_state.h).
TEST(AdamWBf16State, StochasticRoundingIsExactlyUnbiasedOverAllRandomBits) {
  namespace S = ops::bf16_state;
  for (float x : {1.0f + 0.3f / 128, -3.14159f, 7.5e-39f /* subnormal */, 1e-6f, 0.0f, 65504.123f}) {
    const uint32_t u = S::f32_bits(x);
    const float down = S::widen(static_cast<uint16_t>(u >> 16));
    const float up = S::widen(static_cast<uint16_t>((u >> 16) + 1));
    double sum = 0;
    int64_t ups = 0;
    for (uint32_t r = 0; r < 65536; ++r) {
      const float y = S::widen(S::round_stochastic(x, r));
      ASSERT_TRUE(y == down || y == up) << x;  // one of the two bf16 neighbours
      ups += y == up;
      sum += y;
    }
    EXPECT_EQ(ups, static_cast<int64_t>(u & 0xffffu)) << x;  // up with probability (x - down) / spacing
    EXPECT_EQ(sum / 65536.0, static_cast<double>(x)) << x;  // the mean over every r16 is x exactly
  }
  EXPECT_TRUE(std::isnan(S::widen(S::round_stochastic(std::nanf(""), 0xffff))));
  EXPECT_EQ(S::widen(S::round_stochastic(INFINITY, 0xffff)), INFINITY);
  EXPECT_EQ(S::widen(S::round_stochastic(-INFINITY, 0xffff)), -INFINITY);
}

TEST(AdamWBf16State, KeepsUpdatesSmallerThanHalfABf16StepInExpectation) {
  // p = 1, one step of lr 1e-4 (and decay 1e-5): the step is 1/35 of bf16's spacing just below 1.0 (2^-8), so
  // round-to-nearest would leave every p at 1.0. With stochastic rounding the mean of n independent elements is fp32 AdamW's value.
  const int64_t n = 200000;
  ops::AdamWParams ap;
  ap.lr = 1e-4;
  ap.weight_decay = 0.1;
  ap.step = 1;
  std::vector<uint16_t> p(n, f32_to_bf16_bits(1.0f)), m(n, 0), v(n, 0);
  std::vector<float> g(n, 1e-3f);
  ops::adamw_update_bf16(p.data(), g.data(), m.data(), v.data(), n, ap, 0);
  float pf = 1.0f, mf = 0, vf = 0;
  ops::adamw_update(&pf, g.data(), &mf, &vf, 1, ap);
  double mean = 0, mean_m = 0, mean_v = 0;
  int64_t moved = 0;
  for (int64_t i = 0; i < n; ++i) {
    mean += bf16_bits_to_f32(p[i]) / n;
    mean_m += bf16_bits_to_f32(m[i]) / n;
    mean_v += bf16_bits_to_f32(v[i]) / n;
    moved += p[i] != f32_to_bf16_bits(1.0f);
  }
  EXPECT_GT(moved, n / 50);  // about 2.8% of the elements took the step down (RNE: none)
  EXPECT_LT(moved, n / 25);
  // standard error of the mean: 2^-8 (spacing below 1.0) * sqrt(q (1 - q) / n) ~ 1e-6
  EXPECT_NEAR(mean, pf, 6e-6);
  EXPECT_NEAR(mean_m, mf, 1e-3 * mf);
  EXPECT_NEAR(mean_v, vf, 1e-3 * vf);
  // Deterministic: the same step and indices give the same bits; another index range another stream.
  std::vector<uint16_t> p2(n, f32_to_bf16_bits(1.0f)), m2(n, 0), v2(n, 0), p3 = p2, m3 = m2, v3 = v2;
  ops::adamw_update_bf16(p2.data(), g.data(), m2.data(), v2.data(), n, ap, 0);
  ops::adamw_update_bf16(p3.data(), g.data(), m3.data(), v3.data(), n, ap, n);
  EXPECT_EQ(p2, p);
  EXPECT_NE(p3, p);
}

// OpenBLAS's kernel set by the CPU's features (core/cpu_blas.h): what the binary re-executes with.
TEST(CpuBlas, OverrideOnlyAnOlderLibraryChoiceAndNeverTheUsers) {
  EXPECT_TRUE(ds::blas_core_older("Prescott", "SkylakeX"));  // a current Xeon on Debian 12's OpenBLAS
  EXPECT_TRUE(ds::blas_core_older("Haswell", "SkylakeX"));
  EXPECT_FALSE(ds::blas_core_older("Cooperlake", "SkylakeX"));  // as good or newer: left alone
  EXPECT_FALSE(ds::blas_core_older("Zen", "Haswell"));
  EXPECT_FALSE(ds::blas_core_older("SomethingNew", "Haswell"));  // not understood: left alone
  EXPECT_EQ(ds::blas_override(nullptr, false, "Prescott", "SkylakeX"), "SkylakeX");
  EXPECT_EQ(ds::blas_override("Haswell", false, "Haswell", "SkylakeX"), "");  // the user's OPENBLAS_CORETYPE wins
  EXPECT_EQ(ds::blas_override(nullptr, true, "Prescott", "SkylakeX"), "");    // DELTASTACK_BLAS_CORETYPE=keep
  EXPECT_EQ(ds::blas_override(nullptr, false, "Prescott", ""), "");           // no vector unit to ask for
  // This CPU's choice follows its features.
  __builtin_cpu_init();
  const std::string want = ds::blas_coretype_for_cpu();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("avx512vl")) {
    EXPECT_EQ(want, "SkylakeX");
  } else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    EXPECT_EQ(want, "Haswell");
  }
  EXPECT_FALSE(ds::blas_corename().empty());
}
