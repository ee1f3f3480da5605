// The 8-bit AdamW state's CPU reference (ops/adamw/q8_state.h, ops::adamw_update_8bit): the code tables are the
// documented construction, quantization is nearest and inverted by dequantization, a quantize / dequantize / quantize
// round trip is bitwise (what a resume relies on), steps track an fp64 AdamW within a stated band, a v far below its
// block's largest never turns into a blow-up, and a range split at a block boundary (a --shard optimizer share)
// takes the same steps. The CUDA kernel's bitwise equality with this reference: CudaOps.AdamW8bitState.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <iterator>
#include <vector>

#include "core/bf16.h"
#include "core/rng.h"
#include "ops/adamw/adamw.h"
#include "ops/adamw/q8_state.h"

using namespace ds;
namespace Q = ds::ops::q8_state;

namespace {

// bitsandbytes' dynamic-tree construction (scripts/gen_q8_tables.py) in double: the values of decade i (10^(i-6)).
std::vector<double> decade(int i, int n) {
  static const double kScale[7] = {1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0};
  std::vector<double> out;
  for (int q = 0; q < n; ++q) out.push_back(kScale[i] * (0.1 + 0.9 * (2 * q + 1) / (2.0 * n)));
  return out;
}

// fp64 AdamW (torch.optim.AdamW) on one element.
struct Adam64 {
  double p, m = 0, v = 0;
  void step(double g, const ops::AdamWParams& a) {
    p *= 1 - a.lr * a.weight_decay;
    m = a.beta1 * m + (1 - a.beta1) * g;
    v = a.beta2 * v + (1 - a.beta2) * g * g;
    const double bc1 = 1 - std::pow(a.beta1, a.step), bc2 = 1 - std::pow(a.beta2, a.step);
    p -= a.lr / bc1 * m / (std::sqrt(v) / std::sqrt(bc2) + a.eps);
  }
};

double rel_l2(const std::vector<double>& a, const std::vector<double>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) num += (a[i] - b[i]) * (a[i] - b[i]), den += b[i] * b[i];
  return std::sqrt(num / den);
}

}  // namespace

// The tables are the fp32 roundings of the construction docs/memory.md describes (bnb's maps, m's largest value
// moved to 1.0), and each threshold the fp32 rounding of its neighbours' mean (r's first: 0).
TEST(AdamW8bitState, TablesAreTheDocumentedDynamicCode) {
  std::vector<double> mag{0.0}, r{0.0};
  for (int i = 0; i < 7; ++i) {
    for (double x : decade(i, 1 << i)) mag.push_back(x);
    for (double x : decade(i, 2 << i)) r.push_back(x);
  }
  mag.back() = 1.0;
  r.push_back(1.0);
  ASSERT_EQ(mag.size(), 128u);
  ASSERT_EQ(r.size(), 256u);
  for (size_t j = 0; j < 128; ++j) EXPECT_EQ(Q::kMMagnitudes[j], static_cast<float>(mag[j])) << j;
  for (size_t j = 0; j < 256; ++j) EXPECT_EQ(Q::kRValues[j], static_cast<float>(r[j])) << j;
  for (size_t j = 0; j < 127; ++j) {
    EXPECT_LT(Q::kMMagnitudes[j], Q::kMMagnitudes[j + 1]);
    EXPECT_EQ(Q::kMThresholds[j], static_cast<float>((double{Q::kMMagnitudes[j]} + Q::kMMagnitudes[j + 1]) / 2)) << j;
  }
  for (size_t j = 0; j < 255; ++j) {
    EXPECT_LT(Q::kRValues[j], Q::kRValues[j + 1]);
    if (j > 0) {
      EXPECT_EQ(Q::kRThresholds[j], static_cast<float>((double{Q::kRValues[j]} + Q::kRValues[j + 1]) / 2)) << j;
    }
  }
  EXPECT_EQ(Q::kRThresholds[0], 0.0f);
  EXPECT_EQ(Q::kMMagnitudes[127], 1.0f);
  EXPECT_EQ(Q::kRValues[255], 1.0f);
  EXPECT_NEAR(Q::kMMagnitudes[1], 5.5e-7, 1e-13);  // 1e-6 * 0.55
  EXPECT_NEAR(Q::kRValues[1], 3.25e-7, 1e-13);     // 1e-6 * 0.325
}

// Known values, and for every code decode then encode gives it back (0x80, -0, is never written: it encodes as 0);
// encode is the nearest code over a sweep of inputs, except that a positive r never becomes 0.
TEST(AdamW8bitState, EncodeIsNearestAndInvertsDecode) {
  const Q::Tables t = Q::host_tables();
  EXPECT_EQ(Q::encode_m(1.0f, t), 127);
  EXPECT_EQ(Q::encode_m(-1.0f, t), 0xff);
  EXPECT_EQ(Q::encode_m(0.0f, t), 0);
  EXPECT_EQ(Q::encode_m(-0.0f, t), 0);
  EXPECT_EQ(Q::encode_m(NAN, t), 0);
  EXPECT_EQ(Q::encode_m(1e-7f, t), 0);  // below half the smallest magnitude, 5.5e-7
  EXPECT_EQ(Q::encode_m(4e-7f, t), 1);
  // 0.5: decade 10^0's 64 values 0.1 + 0.9 (2q + 1) / 128; q = 28 (0.50078) is nearest, index 63 + 28 + 1.
  EXPECT_EQ(Q::encode_m(0.5f, t), 92);
  EXPECT_EQ(Q::encode_m(-0.5f, t), 0x80 | 92);
  EXPECT_FLOAT_EQ(Q::decode_m(0x80 | 92, t), -0.50078125f);
  EXPECT_EQ(Q::encode_r(0.0f, t), 0);
  EXPECT_EQ(Q::encode_r(1e-30f, t), 1);  // a positive r never quantizes to 0
  EXPECT_EQ(Q::encode_r(1.0f, t), 255);
  for (int c = 0; c < 256; ++c) {
    EXPECT_EQ(Q::encode_m(Q::decode_m(static_cast<uint8_t>(c), t), t), c == 0x80 ? 0 : c) << c;
    EXPECT_EQ(Q::encode_r(Q::decode_r(static_cast<uint8_t>(c), t), t), c) << c;
  }
  Rng rng(5);
  for (int k = 0; k < 20000; ++k) {
    // Log-uniform magnitudes over 9 decades, both signs.
    const float x = static_cast<float>(std::pow(10.0, -9 * rng.uniform()) * (rng.uniform() < 0.5 ? -1 : 1));
    const uint8_t cm = Q::encode_m(x, t), cr = Q::encode_r(std::fabs(x), t);
    double best_m = 1e9, best_r = 1e9;
    for (int c = 0; c < 256; ++c) {
      best_m = std::min(best_m, std::fabs(double{Q::decode_m(static_cast<uint8_t>(c), t)} - x));
      if (c > 0) best_r = std::min(best_r, std::fabs(double{Q::decode_r(static_cast<uint8_t>(c), t)} - std::fabs(x)));
    }
    EXPECT_EQ(std::fabs(double{Q::decode_m(cm, t)} - x), best_m) << x;
    EXPECT_EQ(std::fabs(double{Q::decode_r(cr, t)} - std::fabs(x)), best_r) << x;
  }
}

// What a resume does with a checkpoint's fp32 moments: quantize(dequantize(codes, scales)) is the same codes and
// scales, for m and v, blocks over 24 decades of scale and over heavy-tailed values, a partial first and last block;
// a block whose largest value is below 2^-40 is stored as zero.
TEST(AdamW8bitState, QuantizeDequantizeRoundTripIsBitwise) {
  Rng rng(7);
  const int64_t n = 256 * 400 + 77, index0 = 1000;  // 1000 % 256 = 232: a 24-element first block, a 53-element last
  const int64_t nb = Q::num_blocks(index0, n);
  ASSERT_EQ(nb, 402);
  std::vector<float> m(static_cast<size_t>(n)), v(m.size());
  for (int64_t b = 0; b < nb; ++b) {
    const double scale = std::pow(10.0, -12 + 24 * rng.uniform());
    for (int64_t i = std::max<int64_t>(0, b * 256 - index0 % 256); i < std::min(n, (b + 1) * 256 - index0 % 256); ++i) {
      const double x = scale * std::exp(3 * rng.normal()) * (b % 7 == 0 ? 1e-15 : 1.0);  // some blocks below 2^-40
      m[static_cast<size_t>(i)] = static_cast<float>(rng.uniform() < 0.5 ? -x : x);
      v[static_cast<size_t>(i)] = static_cast<float>(x * x);
    }
  }
  for (int which = 0; which < 2; ++which) {
    const std::vector<float>& x = which == 0 ? m : v;
    std::vector<uint8_t> c(x.size()), c2(x.size());
    std::vector<float> a(static_cast<size_t>(nb)), a2(a.size()), d(x.size());
    ops::quantize_moment_8bit(which, x.data(), n, index0, c.data(), a.data());
    ops::dequantize_moment_8bit(which, c.data(), a.data(), n, index0, d.data());
    ops::quantize_moment_8bit(which, d.data(), n, index0, c2.data(), a2.data());
    EXPECT_TRUE(c == c2) << which;
    EXPECT_TRUE(a == a2) << which;
    int zero_blocks = 0, scales_used = 0;
    for (float s : a) {
      EXPECT_TRUE(s == 0.0f || s >= Q::kMinAbsmax) << s;
      zero_blocks += s == 0.0f;
      scales_used += s > 1e-6f;
    }
    EXPECT_GT(zero_blocks, 0) << which;   // some blocks were all below 2^-40
    EXPECT_GT(scales_used, 50) << which;  // and many far above it
    // The dequantized values are within half the code's widest gap of the originals (m's 0.979 .. 1: 1.06 % of absmax).
    for (int64_t i = 0; i < n; ++i) {
      const float s = a[static_cast<size_t>((index0 + i) / 256 - index0 / 256)];
      const double want = which == 0 ? x[static_cast<size_t>(i)] : std::sqrt(double{x[static_cast<size_t>(i)]});
      const double got = which == 0 ? d[static_cast<size_t>(i)] : std::sqrt(double{d[static_cast<size_t>(i)]});
      if (s > 0) {
        EXPECT_LE(std::fabs(got - want), 0.0106 * s + 1e-6 * std::fabs(want)) << which << " " << i;
      }
    }
  }
}

// 300 steps on 4096 elements from bf16 weights, gradients signal + noise with per-element scales spread over
// `decades` inside each block: the weights' total change, m and v against fp64 AdamW from the same start, and the
// bf16 state's weights' change for reference. Measured (relative L2): spread 1 decade: weights 3.3 % (bf16 state
// 3.0 %), m 2.8 %, v 2.1 %; spread 4 decades: weights 7.9 % (bf16 state 3.0 %), m 2.6 %, v 1.8 % (elements 10^-4
// below their block's largest keep only the code's coarse low decades). Bands about 1.5x those.
struct TrackErrors {
  double weights, weights_bf16_state, m, v;
};
TrackErrors track_fp64_adamw(double decades) {
  const int64_t n = 4096, index0 = 300;
  Rng rng(11);
  std::vector<uint16_t> p(static_cast<size_t>(n));
  std::vector<uint8_t> mq(p.size(), 0), vq(p.size(), 0);
  const int64_t nb = Q::num_blocks(index0, n);
  std::vector<float> ma(static_cast<size_t>(nb), 0.0f), va(ma.size(), 0.0f);
  std::vector<Adam64> ref;
  std::vector<double> scale(p.size()), bias(p.size()), start(p.size());
  for (size_t i = 0; i < p.size(); ++i) {
    p[i] = f32_to_bf16_bits(static_cast<float>(0.05 * rng.normal()));
    start[i] = bf16_bits_to_f32(p[i]);
    ref.push_back({start[i]});
    scale[i] = 1e-3 * std::pow(10.0, -decades * rng.uniform());
    bias[i] = 0.5 * rng.normal();
  }
  std::vector<uint16_t> pb = p, mb(p.size(), 0), vb(p.size(), 0);
  std::vector<float> g(p.size());
  ops::AdamWParams a{1e-3, 0.9, 0.95, 1e-8, 0.1, 1, 1.0};
  for (int64_t t = 1; t <= 300; ++t) {
    for (size_t i = 0; i < g.size(); ++i) g[i] = static_cast<float>(scale[i] * (bias[i] + rng.normal()));
    a.step = t;
    ops::adamw_update_8bit(p.data(), g.data(), mq.data(), vq.data(), ma.data(), va.data(), n, a, index0);
    ops::adamw_update_bf16(pb.data(), g.data(), mb.data(), vb.data(), n, a, index0);
    for (size_t i = 0; i < g.size(); ++i) ref[i].step(g[i], a);
  }
  std::vector<float> m(p.size()), v(p.size());
  ops::dequantize_moment_8bit(0, mq.data(), ma.data(), n, index0, m.data());
  ops::dequantize_moment_8bit(1, vq.data(), va.data(), n, index0, v.data());
  std::vector<double> dp, dpb, dp_ref, m8, m64, v8, v64;
  for (size_t i = 0; i < p.size(); ++i) {
    dp.push_back(bf16_bits_to_f32(p[i]) - start[i]);
    dpb.push_back(bf16_bits_to_f32(pb[i]) - start[i]);
    dp_ref.push_back(ref[i].p - start[i]);
    m8.push_back(m[i]), m64.push_back(ref[i].m);
    v8.push_back(v[i]), v64.push_back(ref[i].v);
  }
  const TrackErrors e{rel_l2(dp, dp_ref), rel_l2(dpb, dp_ref), rel_l2(m8, m64), rel_l2(v8, v64)};
  std::printf("8-bit state vs fp64 AdamW, 300 steps, gradient scales over %.0f decade(s): weights' change %.4f (bf16 "
              "state %.4f), m %.4f, v %.4f (relative L2)\n", decades, e.weights, e.weights_bf16_state, e.m, e.v);
  return e;
}

TEST(AdamW8bitState, StepsTrackFp64AdamW) {
  const TrackErrors one = track_fp64_adamw(1), four = track_fp64_adamw(4);
  EXPECT_LT(one.weights, 0.05);
  EXPECT_LT(one.m, 0.045);
  EXPECT_LT(one.v, 0.035);
  EXPECT_LT(four.weights, 0.12);
  EXPECT_LT(four.m, 0.04);
  EXPECT_LT(four.v, 0.03);
  EXPECT_LT(one.weights_bf16_state, 0.045);  // the bf16 state's own noise (stochastic rounding of the weights)
  EXPECT_GT(one.m, 1e-3);                    // the moments are really quantized (not an fp32 state)
}

// The case a v code without small values gets wrong: one element of the block had a large gradient (the block's
// r = sqrt(v) scale stays large, r decays by sqrt(b2) a step) while the others have gradients 10^-9 of it; their
// true r is then far below the smallest code (3.25e-7 of the scale), but their m, next to m's fast-decaying scale,
// is not. Rounded to 0, v would give updates of m / eps, 10.1 lr, once their gradient stops. Here r rounds up to the
// smallest code instead and every update stays below 2 lr (fp64 AdamW's are at most about 1 lr).
TEST(AdamW8bitState, ATinySecondMomentNeverBlowsUpTheUpdate) {
  const int64_t n = 256;
  std::vector<uint16_t> p(n, 0);  // zero weights, no decay: each step's change is the update itself
  std::vector<uint8_t> mq(n, 0), vq(n, 0);
  float ma = 0, va = 0;
  std::vector<float> g(n);
  ops::AdamWParams a{1e-3, 0.9, 0.95, 1e-8, 0.0, 1, 1.0};
  const Q::Tables t = Q::host_tables();
  double worst = 0;
  bool below_smallest_code = false;
  for (int64_t s = 1; s <= 80; ++s) {
    g[0] = s == 1 ? 1e3f : 0.0f;
    for (int64_t i = 1; i < n; ++i) g[i] = s <= 60 ? 1e-6f : 0.0f;  // then they stop
    std::vector<uint16_t> before = p;
    a.step = s;
    ops::adamw_update_8bit(p.data(), g.data(), mq.data(), vq.data(), &ma, &va, n, a, 0);
    for (int64_t i = 1; i < n; ++i)
      worst = std::max(worst, std::fabs(double{bf16_bits_to_f32(p[i])} - bf16_bits_to_f32(before[i])) / a.lr);
    if (s >= 2) {
      EXPECT_EQ(vq[1], 1) << s;  // rounded up to the smallest code, never to 0
    }
    if (s == 60) {
      // The true r of element 1 (at most 1e-6) is below half the smallest code of its block's scale, while its m
      // is above half the smallest m code: the state a v rounded to 0 turns into updates of m / eps.
      below_smallest_code = 1e-6 / va < Q::kRValues[1] / 2;
      EXPECT_GT(Q::decode_m(mq[1], t), 0.0f);
      std::printf("step 60: m %.3g (scale %.3g), r code %d (scale %.3g)\n", Q::dequantize_m(mq[1], ma, t), ma,
                  vq[1], va);
    }
  }
  EXPECT_TRUE(below_smallest_code);
  EXPECT_LT(worst, 2.0);
  EXPECT_GT(worst, 0.0);  // the small elements did move
  std::printf("largest update of the small elements: %.3g lr\n", worst);
}

// The same range updated in one call, or in two split at a 256-aligned flat index (a share boundary): the same
// weights, codes and scales bitwise (blocks are the flat 256-chunks, whatever the split).
TEST(AdamW8bitState, ASplitAtABlockBoundaryTakesTheSameSteps) {
  const int64_t n = 3000, index0 = 77, cut = 1024 - index0;  // flat 1024
  Rng rng(3);
  std::vector<uint16_t> p(static_cast<size_t>(n));
  for (auto& x : p) x = f32_to_bf16_bits(static_cast<float>(0.02 * rng.normal()));
  std::vector<uint16_t> p2 = p;
  std::vector<uint8_t> mq(p.size(), 0), vq(p.size(), 0), mq2 = mq, vq2 = vq;
  const int64_t nb = Q::num_blocks(index0, n), nb1 = Q::num_blocks(index0, cut);
  ASSERT_EQ(nb, nb1 + Q::num_blocks(1024, n - cut));
  std::vector<float> ma(static_cast<size_t>(nb), 0), va(ma.size(), 0), ma2 = ma, va2 = va;
  std::vector<float> g(p.size());
  ops::AdamWParams a{1e-3, 0.9, 0.95, 1e-8, 0.1, 1, 0.7};
  for (int64_t s = 1; s <= 5; ++s) {
    for (auto& x : g) x = static_cast<float>(1e-3 * rng.normal());
    a.step = s;
    ops::adamw_update_8bit(p.data(), g.data(), mq.data(), vq.data(), ma.data(), va.data(), n, a, index0);
    ops::adamw_update_8bit(p2.data(), g.data(), mq2.data(), vq2.data(), ma2.data(), va2.data(), cut, a, index0);
    ops::adamw_update_8bit(p2.data() + cut, g.data() + cut, mq2.data() + cut, vq2.data() + cut, ma2.data() + nb1,
                           va2.data() + nb1, n - cut, a, 1024);
  }
  EXPECT_TRUE(p == p2);
  EXPECT_TRUE(mq == mq2);
  EXPECT_TRUE(vq == vq2);
  EXPECT_TRUE(ma == ma2);
  EXPECT_TRUE(va == va2);
  // The weights follow the bf16 state's update where the moments agree: at step 1 (moments from zero, exact), the
  // 8-bit state's weights are the bf16 state's bitwise.
  std::vector<uint16_t> pa(p.size()), pb(p.size());
  Rng r2(9);
  for (size_t i = 0; i < pa.size(); ++i) pa[i] = pb[i] = f32_to_bf16_bits(static_cast<float>(0.02 * r2.normal()));
  std::vector<uint16_t> mb(p.size(), 0), vb(p.size(), 0);
  std::fill(mq.begin(), mq.end(), 0), std::fill(vq.begin(), vq.end(), 0);
  std::fill(ma.begin(), ma.end(), 0.0f), std::fill(va.begin(), va.end(), 0.0f);
  a.step = 1;
  ops::adamw_update_8bit(pa.data(), g.data(), mq.data(), vq.data(), ma.data(), va.data(), n, a, index0);
  ops::adamw_update_bf16(pb.data(), g.data(), mb.data(), vb.data(), n, a, index0);
  EXPECT_TRUE(pa == pb);
}

// The CUDA kernel's bucketed count (q8_state.h count_below_bucketed) against the binary search (count_below) the
// CPU reference runs: at every bucket edge and every threshold (and 3 floats either side), the special values, and
// a million random floats in (0, 1] (uniform bits: every binade alike) and above.
TEST(AdamW8bitState, BucketedCountIsTheBinarySearch) {
  namespace Q = ds::ops::q8_state;
  float m_thr[127 + Q::kBucketSpan], r_thr[255 + Q::kBucketSpan];
  std::copy(std::begin(Q::kMThresholds), std::end(Q::kMThresholds), m_thr);
  std::copy(std::begin(Q::kRThresholds), std::end(Q::kRThresholds), r_thr);
  for (int j = 0; j < Q::kBucketSpan; ++j) m_thr[127 + j] = r_thr[255 + j] = INFINITY;
  const Q::Tables t{Q::kMMagnitudes, m_thr, Q::kRValues, r_thr};
  const Q::BucketTables bt{Q::kMBucketLo.data(), Q::kRBucketLo.data()};
  int64_t checked = 0;
  auto same = [&](float x) {
    ++checked;
    EXPECT_EQ(Q::encode_m(x, t), Q::encode_m(x, t, bt)) << x;
    EXPECT_EQ(Q::encode_m(-x, t), Q::encode_m(-x, t, bt)) << x;
    EXPECT_EQ(Q::encode_r(x, t), Q::encode_r(x, t, bt)) << x;
  };
  auto around = [&](float x) {
    uint32_t u = std::bit_cast<uint32_t>(x);
    for (uint32_t d = 0; d <= 6; ++d)
      if (u + d >= 3) same(std::bit_cast<float>(u + d - 3));
  };
  for (uint32_t b = 0; b < static_cast<uint32_t>(Q::kMBuckets) + 2; ++b)
    around(std::bit_cast<float>((Q::kMBucketBase + b) << Q::kBucketShift));
  for (uint32_t b = 0; b < static_cast<uint32_t>(Q::kRBuckets) + 2; ++b)
    around(std::bit_cast<float>((Q::kRBucketBase + b) << Q::kBucketShift));
  for (float x : Q::kMThresholds) around(x);
  for (float x : Q::kRThresholds) around(x);
  for (float x : {0.0f, -0.0f, NAN, -NAN, INFINITY, -INFINITY, 1.0f, 2.0f, 1e-45f, 1e-38f, 1e30f}) same(x);
  Rng rng(11);
  for (int k = 0; k < 1000000; ++k) {
    const uint32_t u = static_cast<uint32_t>(rng.below(std::bit_cast<uint32_t>(1.0f))) + 1;  // (0, 1]
    same(std::bit_cast<float>(u));
  }
  for (int k = 0; k < 1000; ++k) same(static_cast<float>(1.0 + 1e3 * rng.uniform()));
  EXPECT_GT(checked, 1000000);
}

// The embedding's update split marks the chunks of its update that hold a row of the batch's ids
// (q8_state.h row_chunk_mask): against marking every element's chunk one by one, for rows that divide a chunk
// (2048: 4 rows per chunk), that span two (2560, 5120, 1000), and a parameter that starts mid-block and mid-chunk.
TEST(AdamW8bitState, RowChunkMaskMarksEveryChunkOfARow) {
  Rng rng(13);
  for (const int64_t row : {int64_t{2048}, int64_t{2560}, int64_t{5120}, int64_t{1000}}) {
    for (const int64_t index0 : {int64_t{0}, int64_t{1000}, int64_t{8192 * 3 + 77}}) {
      SCOPED_TRACE(std::to_string(row) + " from " + std::to_string(index0));
      const int64_t rows = 700, n = rows * row;
      std::vector<int32_t> ids;
      for (int k = 0; k < 60; ++k) ids.push_back(static_cast<int32_t>(rng.below(rows)));
      ids.push_back(0);
      ids.push_back(static_cast<int32_t>(rows - 1));
      std::vector<uint8_t> want(static_cast<size_t>(Q::num_chunks(index0, n)), 0);
      const int64_t c0 = index0 / Q::kBlock;
      for (const int32_t r : ids)
        for (int64_t e = index0 + r * row; e < index0 + (r + 1) * row; ++e)
          want[static_cast<size_t>((e / Q::kBlock - c0) / Q::kPartialBlocks)] = 1;
      const std::vector<uint8_t> got = Q::row_chunk_mask(index0, n, row, ids);
      EXPECT_EQ(got, want);
      EXPECT_GT(std::count(got.begin(), got.end(), 0), 0);  // some chunks are left for the early part
    }
  }
}
