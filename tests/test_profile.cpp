// The host side of `bench step --profile` (core/profile.h): aggregation of timed scopes by (family, role) into
// per-step means, the family order, the roofline arithmetic and the printed table. The CUDA events that feed it
// (core/cuda/profile.h) need a GPU and are not tested here.
#include <gtest/gtest.h>

#include <string>

#include "core/profile.h"

using namespace ds;

namespace {

constexpr double kGemm = 699e12, kCopy = 4.23e12;

// Two steps of a small made-up profile, scopes added out of family order.
ProfileTable two_steps() {
  ProfileTable t;
  for (int step = 0; step < 2; ++step) {
    t.add("norm", "rmsnorm", 1.0, 0, 4.23e9);      // 4.23 GB in 1 ms: 4.23 TB/s, the copy ceiling
    t.add("gemm", "mlp down", 2.0, 699e9);         // 699 GFLOP in 2 ms: 349.5 TFLOP/s, half the ceiling
    t.add("gemm", "mlp gate_up", 3.0 + step, 0);   // FLOPs unknown; 3 ms then 4 ms
    t.add("gemm", "mlp down", 2.0, 699e9);         // a second scope of the same role
    t.add("copy", "loss download (D2H)", 0.5);
    t.end_step(step == 0 ? 12.0 : 14.0);
  }
  return t;
}

}  // namespace

TEST(Profile, RooflineFromFlopsOrBytes) {
  Roofline g = roofline(2.0, 699e9, 0, kGemm, kCopy);
  EXPECT_NEAR(g.fraction, 0.5, 1e-12);
  EXPECT_EQ(g.rate, "349.5 TFLOP/s");
  Roofline m = roofline(1.0, 0, 2.115e9, kGemm, kCopy);
  EXPECT_NEAR(m.fraction, 0.5, 1e-12);
  EXPECT_EQ(m.rate, "2.12 TB/s");
  Roofline both = roofline(1.0, 699e9, 4.23e9, kGemm, kCopy);  // FLOPs win
  EXPECT_NEAR(both.fraction, 1.0, 1e-12);
  EXPECT_EQ(roofline(1.0, 0, 0, kGemm, kCopy).fraction, -1);
  EXPECT_EQ(roofline(1.0, 0, 0, kGemm, kCopy).rate, "-");
  EXPECT_EQ(roofline(0.0, 1e9, 0, kGemm, kCopy).fraction, -1);  // no time: no rate
}

TEST(Profile, RowsArePerStepMeansInFamilyOrder) {
  const ProfileTable t = two_steps();
  EXPECT_EQ(t.steps(), 2);
  const std::vector<ProfileTable::Row> r = t.rows();
  ASSERT_EQ(r.size(), 4u);
  // gemm before norm before copy (profile_families()), roles by first appearance
  EXPECT_EQ(r[0].family, "gemm");
  EXPECT_EQ(r[0].role, "mlp down");
  EXPECT_DOUBLE_EQ(r[0].ms, 4.0);      // 2 scopes x 2 ms per step
  EXPECT_DOUBLE_EQ(r[0].flops, 1398e9);
  EXPECT_DOUBLE_EQ(r[0].calls, 2.0);
  EXPECT_EQ(r[1].role, "mlp gate_up");
  EXPECT_DOUBLE_EQ(r[1].ms, 3.5);      // (3 + 4) / 2
  EXPECT_DOUBLE_EQ(r[1].calls, 1.0);
  EXPECT_EQ(r[2].family, "norm");
  EXPECT_DOUBLE_EQ(r[2].bytes, 4.23e9);
  EXPECT_EQ(r[3].family, "copy");
  EXPECT_DOUBLE_EQ(r[3].ms, 0.5);
  EXPECT_DOUBLE_EQ(t.scope_ms(), 4.0 + 3.5 + 1.0 + 0.5);
  EXPECT_DOUBLE_EQ(t.wall_ms(), 13.0);
  EXPECT_DOUBLE_EQ(t.gaps_ms(), 13.0 - 9.0);
}

TEST(Profile, UnknownFamiliesComeLastInFirstAppearanceOrder) {
  ProfileTable t;
  t.add("zeta", "a", 1);
  t.add("optimizer", "adamw", 1);
  t.add("alpha", "b", 1);
  t.add("zeta", "c", 1);
  t.add("gemm", "attn qkv", 1);
  t.end_step(5);
  const std::vector<ProfileTable::Row> r = t.rows();
  ASSERT_EQ(r.size(), 5u);
  EXPECT_EQ(r[0].family, "gemm");
  EXPECT_EQ(r[1].family, "optimizer");
  EXPECT_EQ(r[2].family + "/" + r[2].role, "zeta/a");
  EXPECT_EQ(r[3].family + "/" + r[3].role, "zeta/c");
  EXPECT_EQ(r[4].family, "alpha");
}

TEST(Profile, TableLinesTotalsAndGaps) {
  const std::string s = two_steps().format(kGemm, kCopy, 12.5);
  auto line_of = [&](const std::string& key) {
    const size_t at = s.find(key);
    EXPECT_NE(at, std::string::npos) << key << " in\n" << s;
    if (at == std::string::npos) return std::string();
    const size_t b = s.rfind('\n', at) + 1, e = s.find('\n', at);
    return s.substr(b, e - b);
  };
  // gemm has two roles: a total line (7.5 ms = 57.7% of 13 ms; FLOPs of gate_up unknown, so no rate) and the roles
  const std::string gemm = line_of("  gemm ");
  EXPECT_NE(gemm.find("7.500"), std::string::npos) << gemm;
  EXPECT_NE(gemm.find("57.7%"), std::string::npos) << gemm;
  EXPECT_EQ(gemm.find("TFLOP/s"), std::string::npos) << gemm;
  const std::string down = line_of("    mlp down");
  EXPECT_NE(down.find("4.000"), std::string::npos) << down;
  EXPECT_NE(down.find("349.5 TFLOP/s"), std::string::npos) << down;
  EXPECT_NE(down.find("50.0%"), std::string::npos) << down;
  // one-role families: "family: role" on one line
  const std::string norm = line_of("norm: rmsnorm");
  EXPECT_NE(norm.find("4.23 TB/s"), std::string::npos) << norm;
  EXPECT_NE(norm.find("100.0%"), std::string::npos) << norm;
  const std::string copy = line_of("copy: loss download (D2H)");
  EXPECT_NE(copy.find("0.500"), std::string::npos) << copy;
  const std::string gaps = line_of("gaps (wall - sum of scopes)");
  EXPECT_NE(gaps.find("4.000"), std::string::npos) << gaps;
  EXPECT_NE(gaps.find("30.8%"), std::string::npos) << gaps;
  const std::string sum = line_of("  sum of scopes ");
  EXPECT_NE(sum.find("9.000 ms of wall 13.000 ms per step (mean of 2 steps; median 12.500 ms); gaps 4.000 ms (30.8%)"),
            std::string::npos)
      << sum;
  // family order in the text
  EXPECT_LT(s.find("  gemm "), s.find("norm: rmsnorm"));
  EXPECT_LT(s.find("norm: rmsnorm"), s.find("copy: loss"));
}
