// CPU reference tests: causal GQA attention (+ output gate), partial RoPE, causal depthwise conv1d + SiLU,
// fused linear + cross-entropy. Naive float64 references are written here from the formulas in
// docs/model.md §2.2, §2.5, §2.6, §2.8 and §4; gradients are checked with central finite differences.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/fp8.h"
#include "core/parallel.h"
#include "ops/attention/attention.h"
#include "ops/conv1d/conv1d.h"
#include "ops/linear_cross_entropy/linear_cross_entropy.h"
#include "ops/rope/rope.h"
#include "test_util.h"

using namespace ds;
using namespace ds::ops;
using ds::test::dot;
using ds::test::numeric_grad;
using ds::test::randn;
using ds::test::rel_l2;

namespace {

std::vector<int32_t> cu_from_lengths(const std::vector<int>& lens) {
  std::vector<int32_t> cu{0};
  for (int l : lens) cu.push_back(cu.back() + l);
  return cu;
}

template <typename A>
std::vector<double> to_d(const std::vector<A>& v) {
  return std::vector<double>(v.begin(), v.end());
}
template <typename T>
std::vector<T> cast(const std::vector<double>& v) {
  return std::vector<T>(v.begin(), v.end());
}

bool bitwise_equal(const void* a, const void* b, size_t bytes) { return std::memcmp(a, b, bytes) == 0; }

// Restores the thread count a test changed.
struct ThreadGuard {
  int saved = ds::num_threads();
  ~ThreadGuard() { ds::set_num_threads(saved); }
};

// ---------------------------------------------------------------------------------------------------------
// Attention

// Naive float64 attention with an explicit [N, N] block-diagonal causal mask.
void naive_attention(const AttnDims& d, const std::vector<double>& q, const std::vector<double>& k,
                     const std::vector<double>& v, const std::vector<int32_t>& cu, std::vector<double>& o,
                     std::vector<double>& lse) {
  const int64_t N = d.N, hd = d.head_dim;
  std::vector<int> doc(N, -1);
  for (int64_t s = 0; s < d.num_seqs; ++s)
    for (int64_t t = cu[s]; t < cu[s + 1]; ++t) doc[t] = static_cast<int>(s);
  std::vector<char> mask(N * N);
  for (int64_t t = 0; t < N; ++t)
    for (int64_t j = 0; j < N; ++j) mask[t * N + j] = doc[t] == doc[j] && j <= t;
  o.assign(N * d.Hq * hd, 0.0);
  lse.assign(N * d.Hq, 0.0);
  std::vector<double> sc(N);
  for (int64_t h = 0; h < d.Hq; ++h) {
    const int64_t g = h / (d.Hq / d.Hkv);
    for (int64_t t = 0; t < N; ++t) {
      double m = -INFINITY;
      for (int64_t j = 0; j < N; ++j) {
        double s = -INFINITY;
        if (mask[t * N + j]) {
          s = 0;
          for (int64_t i = 0; i < hd; ++i) s += q[(t * d.Hq + h) * hd + i] * k[(j * d.Hkv + g) * hd + i];
          s *= d.scale;
        }
        sc[j] = s;
        m = std::max(m, s);
      }
      double z = 0;
      for (int64_t j = 0; j < N; ++j) z += std::exp(sc[j] - m);
      for (int64_t j = 0; j < N; ++j) {
        const double p = std::exp(sc[j] - m) / z;
        for (int64_t i = 0; i < hd; ++i) o[(t * d.Hq + h) * hd + i] += p * v[(j * d.Hkv + g) * hd + i];
      }
      lse[t * d.Hq + h] = m + std::log(z);
    }
  }
}

struct AttnCase {
  AttnDims d;
  std::vector<int32_t> cu;
  std::vector<double> q, k, v, dout;
};

AttnCase make_attn_case(const std::vector<int>& lens, int64_t Hq, int64_t Hkv, int64_t hd, uint64_t seed) {
  AttnCase c;
  c.cu = cu_from_lengths(lens);
  c.d.N = c.cu.back();
  c.d.num_seqs = static_cast<int64_t>(lens.size());
  c.d.Hq = Hq;
  c.d.Hkv = Hkv;
  c.d.head_dim = hd;
  c.d.scale = 1.0 / std::sqrt(static_cast<double>(hd));
  c.q = randn<double>(c.d.N * Hq * hd, seed + 1);
  c.k = randn<double>(c.d.N * Hkv * hd, seed + 2);
  c.v = randn<double>(c.d.N * Hkv * hd, seed + 3);
  c.dout = randn<double>(c.d.N * Hq * hd, seed + 4);
  return c;
}

template <typename T>
struct AttnOut {
  std::vector<T> o, lse, dq, dk, dv;
};

template <typename T>
AttnOut<T> run_attention(const AttnCase& c) {
  const auto q = cast<T>(c.q), k = cast<T>(c.k), v = cast<T>(c.v), dout = cast<T>(c.dout);
  AttnOut<T> r;
  const int64_t N = c.d.N, hd = c.d.head_dim;
  r.o.assign(N * c.d.Hq * hd, T(-7));
  r.lse.assign(N * c.d.Hq, T(-7));
  r.dq.assign(q.size(), T(-7));
  r.dk.assign(k.size(), T(-7));
  r.dv.assign(v.size(), T(-7));
  attention_forward<T>(c.d, q.data(), k.data(), v.data(), c.cu.data(), r.o.data(), r.lse.data());
  attention_backward<T>(c.d, q.data(), k.data(), v.data(), r.o.data(), r.lse.data(), dout.data(), c.cu.data(),
                        r.dq.data(), r.dk.data(), r.dv.data());
  return r;
}

}  // namespace

TEST(AttentionCpu, ForwardMatchesNaiveMaskedSoftmax) {
  const std::vector<int> lens{1, 5, 17, 0, 33};
  for (int ratio : {1, 2, 4}) {
    SCOPED_TRACE("GQA ratio " + std::to_string(ratio));
    const AttnCase c = make_attn_case(lens, 2 * ratio, 2, 16, 100 + ratio);
    std::vector<double> o_ref, lse_ref;
    naive_attention(c.d, c.q, c.k, c.v, c.cu, o_ref, lse_ref);
    const auto r64 = run_attention<double>(c);
    EXPECT_LE(rel_l2(r64.o, o_ref), 1e-13);
    EXPECT_LE(rel_l2(r64.lse, lse_ref), 1e-13);
    const auto r32 = run_attention<float>(c);
    EXPECT_LE(rel_l2(r32.o, o_ref), 1e-6);
    EXPECT_LE(rel_l2(r32.lse, lse_ref), 1e-6);
    // fp32 backward within the fp32 band of the float64 one.
    EXPECT_LE(rel_l2(r32.dq, r64.dq), 1e-5);
    EXPECT_LE(rel_l2(r32.dk, r64.dk), 1e-5);
    EXPECT_LE(rel_l2(r32.dv, r64.dv), 1e-5);
    // The first token of every document attends only to itself: o = v of its kv head.
    for (size_t s = 0; s + 1 < c.cu.size(); ++s) {
      if (c.cu[s] == c.cu[s + 1]) continue;
      const int64_t t = c.cu[s];
      for (int64_t h = 0; h < c.d.Hq; ++h)
        for (int64_t i = 0; i < c.d.head_dim; ++i)
          EXPECT_NEAR(r64.o[(t * c.d.Hq + h) * 16 + i], c.v[(t * 2 + h / ratio) * 16 + i], 1e-15);
    }
  }
}

TEST(AttentionCpu, BackwardMatchesFiniteDifferences) {
  for (int ratio : {1, 2}) {
    SCOPED_TRACE("GQA ratio " + std::to_string(ratio));
    AttnCase c = make_attn_case({3, 0, 4}, 2 * ratio, 2, 4, 7 + ratio);
    const auto r = run_attention<double>(c);
    // L = <o, dout>: its gradient is what attention_backward returns for dout.
    auto loss = [&]() {
      std::vector<double> o(c.q.size()), lse(c.d.N * c.d.Hq);
      attention_forward<double>(c.d, c.q.data(), c.k.data(), c.v.data(), c.cu.data(), o.data(), lse.data());
      return dot(o, c.dout);
    };
    EXPECT_LE(rel_l2(r.dq, numeric_grad(c.q, loss)), 1e-6);
    EXPECT_LE(rel_l2(r.dk, numeric_grad(c.k, loss)), 1e-6);
    EXPECT_LE(rel_l2(r.dv, numeric_grad(c.v, loss)), 1e-6);
  }
}

TEST(AttentionCpu, PackedEqualsEachDocumentAlone) {
  const std::vector<int> lens{1, 5, 17, 0, 33};
  const AttnCase c = make_attn_case(lens, 4, 2, 8, 55);
  const auto packed = run_attention<double>(c);
  const int64_t Hq = c.d.Hq, Hkv = c.d.Hkv, hd = c.d.head_dim;
  for (size_t s = 0; s < lens.size(); ++s) {
    if (lens[s] == 0) continue;
    const int64_t a = c.cu[s], n = lens[s];
    AttnCase one = c;
    one.d.N = n;
    one.d.num_seqs = 1;
    one.cu = {0, static_cast<int32_t>(n)};
    one.q.assign(c.q.begin() + a * Hq * hd, c.q.begin() + (a + n) * Hq * hd);
    one.dout.assign(c.dout.begin() + a * Hq * hd, c.dout.begin() + (a + n) * Hq * hd);
    one.k.assign(c.k.begin() + a * Hkv * hd, c.k.begin() + (a + n) * Hkv * hd);
    one.v.assign(c.v.begin() + a * Hkv * hd, c.v.begin() + (a + n) * Hkv * hd);
    const auto alone = run_attention<double>(one);
    auto slice = [&](const std::vector<double>& x, int64_t w) {
      return std::vector<double>(x.begin() + a * w, x.begin() + (a + n) * w);
    };
    EXPECT_LE(rel_l2(slice(packed.o, Hq * hd), alone.o), 1e-12);
    EXPECT_LE(rel_l2(slice(packed.lse, Hq), alone.lse), 1e-12);
    EXPECT_LE(rel_l2(slice(packed.dq, Hq * hd), alone.dq), 1e-12);
    EXPECT_LE(rel_l2(slice(packed.dk, Hkv * hd), alone.dk), 1e-12);
    EXPECT_LE(rel_l2(slice(packed.dv, Hkv * hd), alone.dv), 1e-12);
  }
}

TEST(AttentionCpu, BitwiseIndependentOfThreadCount) {
  ThreadGuard guard;
  const AttnCase c = make_attn_case({9, 40, 2, 21}, 8, 2, 32, 77);
  ds::set_num_threads(1);
  const auto r1 = run_attention<float>(c);
  for (int threads : {2, 3}) {
    ds::set_num_threads(threads);
    const auto r2 = run_attention<float>(c);
    EXPECT_TRUE(bitwise_equal(r1.o.data(), r2.o.data(), r1.o.size() * sizeof(float))) << threads;
    EXPECT_TRUE(bitwise_equal(r1.lse.data(), r2.lse.data(), r1.lse.size() * sizeof(float))) << threads;
    EXPECT_TRUE(bitwise_equal(r1.dq.data(), r2.dq.data(), r1.dq.size() * sizeof(float))) << threads;
    EXPECT_TRUE(bitwise_equal(r1.dk.data(), r2.dk.data(), r1.dk.size() * sizeof(float))) << threads;
    EXPECT_TRUE(bitwise_equal(r1.dv.data(), r2.dv.data(), r1.dv.size() * sizeof(float))) << threads;
  }
}

TEST(AttentionCpu, RejectsBadCuSeqlens) {
  AttnDims d;
  d.N = 4;
  d.num_seqs = 2;
  d.Hq = 2;
  d.Hkv = 1;
  d.head_dim = 2;
  d.scale = 1;
  std::vector<float> q(16), k(8), v(8), o(16), lse(8);
  const std::vector<int32_t> bad_end{0, 2, 3};
  EXPECT_THROW(attention_forward<float>(d, q.data(), k.data(), v.data(), bad_end.data(), o.data(), lse.data()),
               ds::Error);
  const std::vector<int32_t> decreasing{0, 3, 2};
  EXPECT_THROW(attention_forward<float>(d, q.data(), k.data(), v.data(), decreasing.data(), o.data(), lse.data()),
               ds::Error);
  d.Hq = 3;
  d.Hkv = 2;
  const std::vector<int32_t> ok{0, 2, 4};
  EXPECT_THROW(attention_forward<float>(d, q.data(), k.data(), v.data(), ok.data(), o.data(), lse.data()),
               ds::Error);
}

TEST(OutputGateCpu, ForwardAndBackward) {
  const size_t n = 37;
  auto o = randn<double>(n, 1), gate = randn<double>(n, 2, 2.0), w = randn<double>(n, 3);
  std::vector<double> y(n), dout(n), dgate(n);
  output_gate_forward<double>(o.data(), gate.data(), y.data(), n);
  for (size_t i = 0; i < n; ++i) EXPECT_NEAR(y[i], o[i] / (1.0 + std::exp(-gate[i])), 1e-15);
  output_gate_backward<double>(o.data(), gate.data(), w.data(), dout.data(), dgate.data(), n);
  auto loss = [&]() {
    std::vector<double> yy(n);
    output_gate_forward<double>(o.data(), gate.data(), yy.data(), n);
    return dot(yy, w);
  };
  EXPECT_LE(rel_l2(dout, numeric_grad(o, loss)), 1e-8);
  EXPECT_LE(rel_l2(dgate, numeric_grad(gate, loss)), 1e-8);
  // float matches double
  auto of = cast<float>(o), gf = cast<float>(gate), wf = cast<float>(w);
  std::vector<float> yf(n), dof(n), dgf(n);
  output_gate_forward<float>(of.data(), gf.data(), yf.data(), n);
  output_gate_backward<float>(of.data(), gf.data(), wf.data(), dof.data(), dgf.data(), n);
  EXPECT_LE(rel_l2(yf, y), 1e-6);
  EXPECT_LE(rel_l2(dof, dout), 1e-6);
  EXPECT_LE(rel_l2(dgf, dgate), 1e-6);
}

// ---------------------------------------------------------------------------------------------------------
// RoPE

TEST(RopeCpu, TablesMatchHandComputedAngles) {
  // theta 10000, rotary_dim 8: inv_freq = 10000^(-2i/8) = 1, 0.1, 0.01, 0.001.
  const std::vector<int32_t> pos{0, 5, 1};
  std::vector<double> c(3 * 4), s(3 * 4);
  rope_tables<double>(pos.data(), 3, 8, 10000.0, c.data(), s.data());
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(c[i], 1.0);
    EXPECT_EQ(s[i], 0.0);
  }
  const double inv[4] = {1.0, 0.1, 0.01, 0.001};
  for (int i = 0; i < 4; ++i) {
    EXPECT_NEAR(c[4 + i], std::cos(5 * inv[i]), 1e-15);
    EXPECT_NEAR(s[4 + i], std::sin(5 * inv[i]), 1e-15);
    EXPECT_NEAR(c[8 + i], std::cos(inv[i]), 1e-15);
  }
  EXPECT_NEAR(c[5], 0.8775825618903728, 1e-15);  // pos 5, i = 1: angle 5 * 10000^(-2/8) = 0.5
  EXPECT_NEAR(s[5], 0.479425538604203, 1e-15);

  std::vector<float> cf(3 * 4), sf(3 * 4);
  rope_tables<float>(pos.data(), 3, 8, 10000.0, cf.data(), sf.data());
  EXPECT_EQ(cf[0], 1.0f);
  EXPECT_EQ(sf[0], 0.0f);
  EXPECT_NEAR(cf[5], 0.8775825618903728, 1e-7);
  EXPECT_NEAR(sf[5], 0.479425538604203, 1e-7);
}

TEST(RopeCpu, FloatTablesFollowHfFp32Rounding) {
  // Qwen3.5: theta 1e7, rotary_dim 64. HF: inv_freq = 1.0f / powf(1e7f, float(2i)/64.f), angle = inv * float(pos)
  // in fp32. At large positions the fp32 angle differs from the exact one by many ulps of cos.
  const int64_t rd = 64, half = 32;
  const std::vector<int32_t> pos{0, 1, 7, 4095, 123457};
  const int64_t N = static_cast<int64_t>(pos.size());
  std::vector<float> cf(N * half), sf(N * half);
  rope_tables<float>(pos.data(), N, rd, 1e7, cf.data(), sf.data());
  int differs_from_exact = 0;
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t i = 0; i < half; ++i) {
      const float inv = 1.0f / std::pow(1e7f, static_cast<float>(2 * i) / 64.0f);
      const float angle = inv * static_cast<float>(pos[n]);
      EXPECT_NEAR(cf[n * half + i], std::cos(static_cast<double>(angle)), 1e-7);
      EXPECT_NEAR(sf[n * half + i], std::sin(static_cast<double>(angle)), 1e-7);
      const double exact = pos[n] * std::pow(1e7, -static_cast<double>(2 * i) / 64.0);
      if (std::fabs(cf[n * half + i] - std::cos(exact)) > 1e-5) ++differs_from_exact;
    }
  }
  EXPECT_GT(differs_from_exact, 0);  // the fp32 rounding is visible, so the test above is meaningful
}

TEST(RopeCpu, ApplyRotatesHalfSplitPairsAndInverseIsIdentity) {
  const int64_t N = 6, H = 3, hd = 12, rd = 8, half = 4;
  std::vector<int32_t> pos{0, 1, 2, 3, 50, 1000};
  std::vector<double> c(N * half), s(N * half);
  rope_tables<double>(pos.data(), N, rd, 10000.0, c.data(), s.data());
  const auto x0 = randn<double>(N * H * hd, 9);
  auto x = x0;
  rope_apply<double>(x.data(), N, H, hd, rd, c.data(), s.data(), false);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t h = 0; h < H; ++h) {
      const double* a = x0.data() + (n * H + h) * hd;
      const double* b = x.data() + (n * H + h) * hd;
      for (int64_t i = 0; i < half; ++i) {
        EXPECT_NEAR(b[i], a[i] * c[n * half + i] - a[i + half] * s[n * half + i], 1e-15);
        EXPECT_NEAR(b[i + half], a[i + half] * c[n * half + i] + a[i] * s[n * half + i], 1e-15);
      }
      for (int64_t i = rd; i < hd; ++i) EXPECT_EQ(b[i], a[i]);  // pass-through dims untouched
    }
  rope_apply<double>(x.data(), N, H, hd, rd, c.data(), s.data(), true);
  EXPECT_LE(rel_l2(x, x0), 1e-15);

  std::vector<float> cf(N * half), sf(N * half);
  rope_tables<float>(pos.data(), N, rd, 10000.0, cf.data(), sf.data());
  auto xf = cast<float>(x0);
  rope_apply<float>(xf.data(), N, H, hd, rd, cf.data(), sf.data(), false);
  rope_apply<float>(xf.data(), N, H, hd, rd, cf.data(), sf.data(), true);
  EXPECT_LE(rel_l2(xf, x0), 1e-6);
}

TEST(RopeCpu, InverseIsTheTransposeByFiniteDifferences) {
  const int64_t N = 5, H = 2, hd = 10, rd = 6, half = 3;
  std::vector<int32_t> pos{3, 0, 17, 2, 9};
  std::vector<double> c(N * half), s(N * half);
  rope_tables<double>(pos.data(), N, rd, 1e4, c.data(), s.data());
  auto x = randn<double>(N * H * hd, 21), w = randn<double>(N * H * hd, 22);
  auto loss = [&]() {
    auto y = x;
    rope_apply<double>(y.data(), N, H, hd, rd, c.data(), s.data(), false);
    return dot(y, w);
  };
  auto dx = w;
  rope_apply<double>(dx.data(), N, H, hd, rd, c.data(), s.data(), true);
  EXPECT_LE(rel_l2(dx, numeric_grad(x, loss)), 1e-8);
}

// ---------------------------------------------------------------------------------------------------------
// conv1d + SiLU

namespace {

void naive_conv(const std::vector<double>& x, const std::vector<double>& w, const std::vector<int32_t>& cu,
                int64_t C, int64_t K, std::vector<double>& y) {
  const int64_t N = cu.back();
  y.assign(N * C, 0.0);
  for (size_t s = 0; s + 1 < cu.size(); ++s)
    for (int64_t t = cu[s]; t < cu[s + 1]; ++t)
      for (int64_t c = 0; c < C; ++c) {
        double p = 0;
        for (int64_t j = 0; j < K; ++j) {
          const int64_t src = t - (K - 1) + j;
          if (src >= cu[s]) p += w[c * K + j] * x[src * C + c];
        }
        y[t * C + c] = p / (1.0 + std::exp(-p));
      }
}

}  // namespace

TEST(Conv1dCpu, ForwardMatchesNaiveWithShortSegments) {
  const std::vector<int> lens{1, 2, 3, 7};
  const auto cu = cu_from_lengths(lens);
  const int64_t N = cu.back(), C = 5, K = 4, S = static_cast<int64_t>(lens.size());
  const auto x = randn<double>(N * C, 31), w = randn<double>(C * K, 32, 0.5);
  std::vector<double> ref, y(N * C);
  naive_conv(x, w, cu, C, K, ref);
  conv1d_silu_forward<double>(x.data(), w.data(), cu.data(), S, N, C, K, y.data());
  EXPECT_LE(rel_l2(y, ref), 1e-15);
  auto xf = cast<float>(x), wf = cast<float>(w);
  std::vector<float> yf(N * C);
  conv1d_silu_forward<float>(xf.data(), wf.data(), cu.data(), S, N, C, K, yf.data());
  EXPECT_LE(rel_l2(yf, ref), 1e-6);
  // A one-token document sees only its own tap: y = silu(w[:, K-1] * x).
  for (int64_t c = 0; c < C; ++c) {
    const double p = w[c * K + K - 1] * x[c];
    EXPECT_NEAR(y[c], p / (1 + std::exp(-p)), 1e-15);
  }
}

TEST(Conv1dCpu, NoTapCrossesADocument) {
  const std::vector<int> lens{1, 2, 3, 7};
  const auto cu = cu_from_lengths(lens);
  const int64_t N = cu.back(), C = 5, K = 4, S = static_cast<int64_t>(lens.size());
  const auto x = randn<float>(N * C, 41), w = randn<float>(C * K, 42, 0.5), dy = randn<float>(N * C, 43);
  auto x2 = x;
  for (int64_t t = cu[1]; t < cu[2]; ++t)
    for (int64_t c = 0; c < C; ++c) x2[t * C + c] += 3.0f;  // change document 1 only
  std::vector<float> y1(N * C), y2(N * C), dx1(N * C), dx2(N * C), dw1(C * K, 0.f), dw2(C * K, 0.f);
  conv1d_silu_forward<float>(x.data(), w.data(), cu.data(), S, N, C, K, y1.data());
  conv1d_silu_forward<float>(x2.data(), w.data(), cu.data(), S, N, C, K, y2.data());
  conv1d_silu_backward<float>(x.data(), w.data(), dy.data(), cu.data(), S, N, C, K, dx1.data(), dw1.data());
  conv1d_silu_backward<float>(x2.data(), w.data(), dy.data(), cu.data(), S, N, C, K, dx2.data(), dw2.data());
  for (int64_t s = 0; s < S; ++s) {
    const size_t a = cu[s] * C, b = cu[s + 1] * C;
    const bool same_y = bitwise_equal(y1.data() + a, y2.data() + a, (b - a) * sizeof(float));
    const bool same_dx = bitwise_equal(dx1.data() + a, dx2.data() + a, (b - a) * sizeof(float));
    if (s == 1) {
      EXPECT_FALSE(same_y);
      EXPECT_FALSE(same_dx);
    } else {
      EXPECT_TRUE(same_y) << "document " << s;
      EXPECT_TRUE(same_dx) << "document " << s;
    }
  }
}

TEST(Conv1dCpu, BackwardMatchesFiniteDifferences) {
  const std::vector<int> lens{1, 2, 3, 7};
  const auto cu = cu_from_lengths(lens);
  const int64_t N = cu.back(), C = 3, K = 4, S = static_cast<int64_t>(lens.size());
  auto x = randn<double>(N * C, 51), w = randn<double>(C * K, 52, 0.5), r = randn<double>(N * C, 53);
  auto loss = [&]() {
    std::vector<double> y(N * C);
    conv1d_silu_forward<double>(x.data(), w.data(), cu.data(), S, N, C, K, y.data());
    return dot(y, r);
  };
  std::vector<double> dx(N * C, 99.0), dw(C * K, 0.0);
  conv1d_silu_backward<double>(x.data(), w.data(), r.data(), cu.data(), S, N, C, K, dx.data(), dw.data());
  EXPECT_LE(rel_l2(dx, numeric_grad(x, loss)), 1e-8);
  EXPECT_LE(rel_l2(dw, numeric_grad(w, loss)), 1e-8);
  // dw accumulates.
  auto dw2 = dw;
  conv1d_silu_backward<double>(x.data(), w.data(), r.data(), cu.data(), S, N, C, K, dx.data(), dw2.data());
  for (size_t i = 0; i < dw.size(); ++i) EXPECT_NEAR(dw2[i], 2 * dw[i], 1e-14);
  // fp32 backward within the fp32 band.
  auto xf = cast<float>(x), wf = cast<float>(w), rf = cast<float>(r);
  std::vector<float> dxf(N * C), dwf(C * K, 0.f);
  conv1d_silu_backward<float>(xf.data(), wf.data(), rf.data(), cu.data(), S, N, C, K, dxf.data(), dwf.data());
  EXPECT_LE(rel_l2(dxf, dx), 1e-6);
  EXPECT_LE(rel_l2(dwf, dw), 1e-6);
}

// ---------------------------------------------------------------------------------------------------------
// Fused linear + cross-entropy

namespace {

struct NaiveCe {
  double loss_sum = 0, z_sum = 0;
  int64_t num_valid = 0;
  std::vector<double> logits, dh, dW;
};

// Full [N, V] logits in float64; gradients of grad_scale * sum_n loss_n.
NaiveCe naive_ce(const std::vector<double>& h, const std::vector<double>& W, const std::vector<int32_t>& labels,
                 int64_t N, int64_t H, int64_t V, double z, double gs) {
  NaiveCe r;
  r.logits.assign(N * V, 0.0);
  r.dh.assign(N * H, 0.0);
  r.dW.assign(V * H, 0.0);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t v = 0; v < V; ++v)
      for (int64_t i = 0; i < H; ++i) r.logits[n * V + v] += h[n * H + i] * W[v * H + i];
  for (int64_t n = 0; n < N; ++n) {
    if (labels[n] == -100) continue;
    ++r.num_valid;
    const double* l = r.logits.data() + n * V;
    double m = -INFINITY, sum = 0;
    for (int64_t v = 0; v < V; ++v) m = std::max(m, l[v]);
    for (int64_t v = 0; v < V; ++v) sum += std::exp(l[v] - m);
    const double lse = m + std::log(sum);
    r.loss_sum += lse - l[labels[n]] + z * lse * lse;
    r.z_sum += z * lse * lse;
    for (int64_t v = 0; v < V; ++v) {
      const double g = gs * (std::exp(l[v] - lse) * (1 + 2 * z * lse) - (v == labels[n] ? 1.0 : 0.0));
      for (int64_t i = 0; i < H; ++i) {
        r.dh[n * H + i] += g * W[v * H + i];
        r.dW[v * H + i] += g * h[n * H + i];
      }
    }
  }
  return r;
}

template <typename T>
struct CeRun {
  LinearCeResult res;
  std::vector<T> dh, dW, logits;
};

template <typename T>
CeRun<T> run_ce(const std::vector<double>& h, const std::vector<double>& W, const std::vector<int32_t>& labels,
                int64_t N, int64_t H, int64_t V, LinearCeOptions opt, bool keep_logits = false) {
  const auto hT = cast<T>(h), WT = cast<T>(W);
  CeRun<T> r;
  r.dh.assign(N * H, T(5));  // overwritten
  r.dW.assign(V * H, T(0));  // accumulated
  if (keep_logits) r.logits.assign(N * V, T(0));
  r.res = linear_cross_entropy<T>(hT.data(), WT.data(), labels.data(), N, H, V, opt, r.dh.data(), r.dW.data(),
                                  keep_logits ? r.logits.data() : nullptr);
  return r;
}

}  // namespace

TEST(LinearCeCpu, LossAndGradsMatchNaiveFullLogits) {
  const int64_t N = 13, H = 6, V = 11;
  const auto h = randn<double>(N * H, 61), W = randn<double>(V * H, 62);
  std::vector<int32_t> labels(N);
  for (int64_t n = 0; n < N; ++n) labels[n] = static_cast<int32_t>((n * 7 + 3) % V);
  labels[0] = labels[5] = labels[12] = -100;
  for (double z : {0.0, 1e-4, 0.1}) {
    SCOPED_TRACE("z_loss " + std::to_string(z));
    LinearCeOptions opt;
    opt.z_loss = z;
    opt.grad_scale = 1.0 / 10;
    opt.chunk_tokens = 4;
    const NaiveCe ref = naive_ce(h, W, labels, N, H, V, z, opt.grad_scale);
    const auto r = run_ce<double>(h, W, labels, N, H, V, opt, true);
    EXPECT_EQ(r.res.num_valid, 10);
    EXPECT_EQ(ref.num_valid, 10);
    EXPECT_NEAR(r.res.loss_sum, ref.loss_sum, 1e-12 * std::fabs(ref.loss_sum));
    EXPECT_NEAR(r.res.z_loss_sum, ref.z_sum, 1e-12 * std::fabs(ref.z_sum) + 1e-300);
    if (z == 0) {
      EXPECT_EQ(r.res.z_loss_sum, 0.0);
    }
    EXPECT_LE(rel_l2(r.logits, ref.logits), 1e-14);
    EXPECT_LE(rel_l2(r.dh, ref.dh), 1e-12);
    EXPECT_LE(rel_l2(r.dW, ref.dW), 1e-12);
    for (int64_t i = 0; i < H; ++i) EXPECT_EQ(r.dh[5 * H + i], 0.0);  // ignored token: zero gradient
    const auto f = run_ce<float>(h, W, labels, N, H, V, opt, true);
    EXPECT_EQ(f.res.num_valid, 10);
    EXPECT_NEAR(f.res.loss_sum, ref.loss_sum, 1e-5 * std::fabs(ref.loss_sum));
    EXPECT_LE(rel_l2(f.logits, ref.logits), 1e-6);
    EXPECT_LE(rel_l2(f.dh, ref.dh), 1e-5);
    EXPECT_LE(rel_l2(f.dW, ref.dW), 1e-5);
    // Without gradient outputs the loss is unchanged.
    const auto hf = cast<float>(h), Wf = cast<float>(W);
    const LinearCeResult fwd =
        linear_cross_entropy<float>(hf.data(), Wf.data(), labels.data(), N, H, V, opt, nullptr, nullptr);
    EXPECT_EQ(fwd.loss_sum, f.res.loss_sum);
  }
}

TEST(LinearCeCpu, GradientsMatchFiniteDifferences) {
  const int64_t N = 5, H = 3, V = 7;
  auto h = randn<double>(N * H, 71), W = randn<double>(V * H, 72);
  const std::vector<int32_t> labels{2, -100, 6, 0, 2};
  LinearCeOptions opt;
  opt.z_loss = 0.05;
  opt.grad_scale = 0.37;
  opt.chunk_tokens = 2;
  auto loss = [&]() {
    return opt.grad_scale *
           linear_cross_entropy<double>(h.data(), W.data(), labels.data(), N, H, V, opt, nullptr, nullptr).loss_sum;
  };
  const auto r = run_ce<double>(h, W, labels, N, H, V, opt);
  EXPECT_LE(rel_l2(r.dh, numeric_grad(h, loss)), 1e-6);
  EXPECT_LE(rel_l2(r.dW, numeric_grad(W, loss)), 1e-6);
}

TEST(LinearCeCpu, ChunkSizeDoesNotChangeResults) {
  const int64_t N = 29, H = 8, V = 53;
  const auto h = randn<double>(N * H, 81), W = randn<double>(V * H, 82);
  std::vector<int32_t> labels(N);
  for (int64_t n = 0; n < N; ++n) labels[n] = n % 6 == 1 ? -100 : static_cast<int32_t>((n * 13) % V);
  LinearCeOptions a, b;
  a.z_loss = b.z_loss = 1e-4;
  a.chunk_tokens = 2;
  b.chunk_tokens = 1024;
  const auto ra = run_ce<double>(h, W, labels, N, H, V, a), rb = run_ce<double>(h, W, labels, N, H, V, b);
  EXPECT_NEAR(ra.res.loss_sum, rb.res.loss_sum, 1e-12 * std::fabs(rb.res.loss_sum));
  EXPECT_EQ(ra.res.num_valid, rb.res.num_valid);
  EXPECT_LE(rel_l2(ra.dh, rb.dh), 1e-12);
  EXPECT_LE(rel_l2(ra.dW, rb.dW), 1e-12);
}

// LinearCeOptions::dW_overwrite: dW (here full of 7s) becomes the gradient itself, bitwise what adding into zeros
// gives; with no valid label it becomes zero (the GPU's check of the first: ops/linear_cross_entropy/cuda_check.cpp,
// run by CudaLinearCrossEntropy.* and the probe).
TEST(LinearCeCpu, OverwriteIsTheGradientAddedIntoZeros) {
  const int64_t N = 29, H = 8, V = 53;
  const auto h = randn<double>(N * H, 91), W = randn<double>(V * H, 92);
  std::vector<int32_t> labels(N);
  for (int64_t n = 0; n < N; ++n) labels[n] = n % 5 == 2 ? -100 : static_cast<int32_t>((n * 7) % V);
  LinearCeOptions opt;
  opt.chunk_tokens = 4;
  const auto added = run_ce<float>(h, W, labels, N, H, V, opt);
  std::vector<float> dh(N * H), dW(V * H, 7.0f);
  const auto hf = cast<float>(h), Wf = cast<float>(W);
  opt.dW_overwrite = true;
  linear_cross_entropy<float>(hf.data(), Wf.data(), labels.data(), N, H, V, opt, dh.data(), dW.data());
  EXPECT_EQ(dW, added.dW);
  std::vector<int32_t> none(N, -100);
  std::fill(dW.begin(), dW.end(), 7.0f);
  linear_cross_entropy<float>(hf.data(), Wf.data(), none.data(), N, H, V, opt, dh.data(), dW.data());
  EXPECT_EQ(dW, std::vector<float>(V * H, 0.0f));
}

TEST(LinearCeCpu, FloatLargeVocabMatchesDouble) {
  // Exercises the vectorised exp and the blocked sums over a wide row, with a wide logit range.
  const int64_t N = 37, H = 16, V = 5003;
  const auto h = randn<double>(N * H, 91, 1.0), W = randn<double>(V * H, 92, 1.5);
  std::vector<int32_t> labels(N);
  for (int64_t n = 0; n < N; ++n) labels[n] = n % 9 == 4 ? -100 : static_cast<int32_t>((n * 977) % V);
  LinearCeOptions opt;
  opt.z_loss = 1e-4;
  opt.chunk_tokens = 8;
  opt.grad_scale = 1.0 / 33;
  const auto d = run_ce<double>(h, W, labels, N, H, V, opt);
  const auto f = run_ce<float>(h, W, labels, N, H, V, opt);
  EXPECT_NEAR(f.res.loss_sum, d.res.loss_sum, 1e-5 * std::fabs(d.res.loss_sum));
  EXPECT_NEAR(f.res.z_loss_sum, d.res.z_loss_sum, 1e-5 * std::fabs(d.res.z_loss_sum));
  EXPECT_LE(rel_l2(f.dh, d.dh), 1e-5);
  EXPECT_LE(rel_l2(f.dW, d.dW), 1e-5);
}

TEST(LinearCeCpu, BitwiseIndependentOfThreadCount) {
  ThreadGuard guard;
  const int64_t N = 40, H = 32, V = 3001;
  const auto h = randn<double>(N * H, 101), W = randn<double>(V * H, 102, 0.3);
  std::vector<int32_t> labels(N);
  for (int64_t n = 0; n < N; ++n) labels[n] = static_cast<int32_t>((n * 31) % V);
  LinearCeOptions opt;
  opt.chunk_tokens = 16;
  ds::set_num_threads(1);
  const auto r1 = run_ce<float>(h, W, labels, N, H, V, opt);
  for (int threads : {2, 3}) {
    ds::set_num_threads(threads);
    const auto r2 = run_ce<float>(h, W, labels, N, H, V, opt);
    EXPECT_EQ(r1.res.loss_sum, r2.res.loss_sum) << threads;
    EXPECT_TRUE(bitwise_equal(r1.dh.data(), r2.dh.data(), r1.dh.size() * sizeof(float))) << threads;
    EXPECT_TRUE(bitwise_equal(r1.dW.data(), r2.dW.data(), r1.dW.size() * sizeof(float))) << threads;
  }
}

TEST(LinearCeCpu, OutOfRangeLabelIsAnError) {
  const int64_t N = 5, H = 3, V = 7;
  const auto h = randn<double>(N * H, 111), W = randn<double>(V * H, 112);
  for (int32_t bad : {7, -1, -99, 1000}) {
    std::vector<int32_t> labels{1, -100, 2, bad, 0};
    std::vector<double> dh(N * H), dW(V * H);
    try {
      linear_cross_entropy<double>(h.data(), W.data(), labels.data(), N, H, V, LinearCeOptions{}, dh.data(),
                                   dW.data());
      ADD_FAILURE() << "label " << bad << " accepted";
    } catch (const ds::Error& e) {
      EXPECT_NE(std::string(e.what()).find("token 3"), std::string::npos) << e.what();
    }
  }
}

// --fp8-lm-head (LinearCeOptions::fp8_grads): dh and dW are the float64 products of the casts the GPU's FP8 GEMMs
// multiply (W and all N rows of h E4M3 at their amax, the dlogits E5M2 at the bound |grad_scale|), the loss is the
// exact mode's bit for bit, and the gradients are really FP8's (away from the exact ones by the casts' error).
TEST(LinearCeCpu, Fp8GradsAreTheFloat64ProductsOfTheCasts) {
  const int64_t N = 37, H = 24, V = 300;
  const auto h = randn<double>(N * H, 141), W = randn<double>(V * H, 142);
  std::vector<int32_t> labels(N);
  for (int64_t n = 0; n < N; ++n) labels[n] = static_cast<int32_t>((n * 13 + 5) % V);
  labels[2] = labels[30] = -100;
  LinearCeOptions opt;
  opt.grad_scale = 1.0 / 35;
  opt.chunk_tokens = 8;
  const auto exact = run_ce<float>(h, W, labels, N, H, V, opt);
  opt.fp8_grads = true;
  const auto f8 = run_ce<float>(h, W, labels, N, H, V, opt);
  EXPECT_EQ(f8.res.loss_sum, exact.res.loss_sum);

  auto cast_of = [](std::vector<float> x, ds::Fp8Format f, float amax) {
    ds::fp8_fake_quantize(x.data(), static_cast<int64_t>(x.size()), f, amax);
    return std::vector<double>(x.begin(), x.end());
  };
  const auto hf = cast<float>(h), Wf = cast<float>(W);
  const auto hq = cast_of(hf, ds::Fp8Format::E4M3, ds::fp8_amax(hf.data(), N * H));
  const auto Wq = cast_of(Wf, ds::Fp8Format::E4M3, ds::fp8_amax(Wf.data(), V * H));
  const NaiveCe ref = naive_ce(to_d(hf), to_d(Wf), labels, N, H, V, 0.0, opt.grad_scale);
  std::vector<float> g(N * V, 0.0f);  // dlogits in float64, then their E5M2 casts
  for (int64_t n = 0; n < N; ++n) {
    if (labels[n] == -100) continue;
    const double* l = ref.logits.data() + n * V;
    double m = -INFINITY, sum = 0;
    for (int64_t v = 0; v < V; ++v) m = std::max(m, l[v]);
    for (int64_t v = 0; v < V; ++v) sum += std::exp(l[v] - m);
    for (int64_t v = 0; v < V; ++v)
      g[n * V + v] = static_cast<float>(opt.grad_scale * (std::exp(l[v] - m) / sum - (v == labels[n] ? 1.0 : 0.0)));
  }
  const auto gq = cast_of(g, ds::Fp8Format::E5M2, static_cast<float>(opt.grad_scale));
  std::vector<double> dh(N * H, 0.0), dW(V * H, 0.0);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t v = 0; v < V; ++v)
      for (int64_t i = 0; i < H; ++i) {
        dh[n * H + i] += gq[n * V + v] * Wq[v * H + i];
        dW[v * H + i] += gq[n * V + v] * hq[n * H + i];
      }
  EXPECT_LE(rel_l2(f8.dh, dh), 1e-4);
  EXPECT_LE(rel_l2(f8.dW, dW), 1e-4);
  const double off = rel_l2(exact.dh, dh);
  EXPECT_GT(off, 2e-3);  // the casts' error: E5M2 keeps 2 mantissa bits
  EXPECT_LT(off, 0.15);
  std::printf("[ measured ] fp8 lm head vs exact: dh rel L2 %.3e, dW %.3e\n", off, rel_l2(exact.dW, dW));

  opt.z_loss = 1e-4;  // the z-loss factor breaks the dlogits' bound: refused
  EXPECT_THROW(run_ce<float>(h, W, labels, N, H, V, opt), ds::Error);
  opt.z_loss = 0;
  EXPECT_THROW(run_ce<double>(h, W, labels, N, H, V, opt), ds::Error);  // the emulation is float's
}

TEST(LinearCeCpu, AllLabelsIgnored) {
  const int64_t N = 6, H = 4, V = 9;
  const auto h = randn<double>(N * H, 121), W = randn<double>(V * H, 122);
  const std::vector<int32_t> labels(N, -100);
  LinearCeOptions opt;
  opt.z_loss = 1e-4;
  for (bool keep : {false, true}) {
    const auto r = run_ce<float>(h, W, labels, N, H, V, opt, keep);
    EXPECT_EQ(r.res.num_valid, 0);
    EXPECT_EQ(r.res.loss_sum, 0.0);
    EXPECT_EQ(r.res.z_loss_sum, 0.0);
    for (float x : r.dh) EXPECT_EQ(x, 0.0f);
    for (float x : r.dW) EXPECT_EQ(x, 0.0f);
  }
}

TEST(LinearCeCpu, NonFiniteInputGivesNonFiniteLoss) {
  const int64_t N = 3, H = 4, V = 40;
  auto h = randn<double>(N * H, 131);
  const auto W = randn<double>(V * H, 132);
  h[H + 2] = std::numeric_limits<double>::quiet_NaN();  // token 1
  const std::vector<int32_t> labels{1, 2, 3};
  const auto f = run_ce<float>(h, W, labels, N, H, V, LinearCeOptions{});
  const auto d = run_ce<double>(h, W, labels, N, H, V, LinearCeOptions{});
  EXPECT_TRUE(std::isnan(f.res.loss_sum));
  EXPECT_TRUE(std::isnan(d.res.loss_sum));
}
