// The shared error metric (core/numerics.h) and the op-check result bookkeeping (ops/check/check.h), on the host.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "core/bf16.h"
#include "core/cuda/device.h"
#include "core/numerics.h"
#include "ops/check/check.h"

namespace {

TEST(Numerics, RelL2) {
  const std::vector<float> ref = {3.f, 4.f};
  EXPECT_EQ(ds::rel_l2(ref, ref), 0.0);
  EXPECT_EQ(ds::rel_l2(std::vector<double>{0, 0}, std::vector<float>{0, 0}), 0.0);  // both zero: equal
  EXPECT_DOUBLE_EQ(ds::rel_l2(std::vector<double>{3, 5}, ref), 1.0 / 5.0);
  EXPECT_EQ(ds::rel_l2(std::vector<float>{3.f}, ref), INFINITY);       // sizes differ
  EXPECT_EQ(ds::rel_l2(std::vector<float>{NAN, 4.f}, ref), INFINITY);  // a NaN (a poisoned output)
  EXPECT_EQ(ds::rel_l2(std::vector<float>{INFINITY, 4.f}, ref), INFINITY);
  EXPECT_EQ(ds::rel_l2(ref, std::vector<float>{3.f, NAN}), INFINITY);
}

TEST(Numerics, RelL2Bf16Bits) {
  const std::vector<float> ref = {1.f, -2.5f, 0.375f};
  std::vector<uint16_t> bits;
  for (float v : ref) bits.push_back(ds::f32_to_bf16_bits(v));
  EXPECT_EQ(ds::rel_l2(ds::bf16_view(bits), ref), 0.0);
  bits[1] = 0xFFFF;  // the NaN poison a kernel never overwrote
  EXPECT_EQ(ds::rel_l2(ds::bf16_view(bits), ref), INFINITY);
}

TEST(Numerics, RelScalar) {
  EXPECT_EQ(ds::rel_scalar(2.0, 2.0), 0.0);
  EXPECT_NEAR(ds::rel_scalar(2.25, 2.0), 0.125, 1e-15);
  EXPECT_EQ(ds::rel_scalar(NAN, 2.0), INFINITY);
}

TEST(OpCheck, ResultWorstAndBands) {
  ds::ops::check::Result r;
  r.what = "op";
  EXPECT_EQ(r.worst(), 0.0);
  EXPECT_TRUE(r.ok());
  r.add("y", 1e-3, 5e-3);
  r.exact("two runs bitwise equal", true);
  EXPECT_EQ(r.worst(), 1e-3);
  EXPECT_TRUE(r.ok());
  r.add("dx", 2e-2, 1e-2);
  EXPECT_FALSE(r.ok());
  r.exact("written only inside its rows", false);
  EXPECT_EQ(r.worst(), INFINITY);
  r.add("nan", NAN, 1.0);
  EXPECT_EQ(r.worst(), INFINITY);
  EXPECT_EQ(r.str().rfind("op: y 1.00e-03, ", 0), 0u);
}

// Without a device (or in a build without CUDA) a probe is +infinity: the op's "cuda" selection falls to its
// reference entry and nothing else changes.
TEST(OpCheck, ProbeWithoutDeviceIsInfinite) {
  if (ds::cuda_device_count() > 0) GTEST_SKIP() << "a CUDA device is present";
  bool ran = false;
  EXPECT_EQ(ds::ops::check::probe_cases("op", 1,
                                        [&](size_t) {
                                          ran = true;
                                          return ds::ops::check::Result{};
                                        }),
            INFINITY);
  EXPECT_FALSE(ran);
}

}  // namespace
