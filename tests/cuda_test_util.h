// Shared helpers of the CUDA tests (tests/test_cuda_*.cpp; conventions in docs/cuda_backend.md "Tests"): the
// skip-without-device macro, and expect_ok, which asserts every value of an op check (src/ops/<op>/cuda_check.h,
// the functions the registry's start-up probes run) against its band and prints one "[ measured ] ..." line.
// Tests that drive launchers directly use the device helpers of ops/check/device.h (Buf, Ctx, ...).
#pragma once
#ifdef DELTASTACK_CUDA

#include <gtest/gtest.h>

#include <cstdio>
#include <vector>

#include "core/cuda/device.h"
#include "ops/check/check.h"
#include "ops/check/device.h"

// Every CUDA test starts with this: skipped (not failed) on a machine without a device.
#define DS_SKIP_WITHOUT_GPU()                                             \
  do {                                                                    \
    if (::ds::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device"; \
  } while (0)

namespace ds::test::cuda {

// Every value within its band (a NaN error fails too); one "[ measured ]" line with all of them.
inline void expect_ok(const ::ds::ops::check::Result& r) {
  for (const auto& v : r.values) EXPECT_LE(v.error, v.band) << r.what << ": " << v.name;
  std::printf("[ measured ] %s (cpu ref %.1f s)\n", r.str().c_str(), r.cpu_seconds);
  std::fflush(stdout);
}

// check(c) for every case, each asserted.
template <typename Case>
void expect_ok(::ds::ops::check::Result (*check)(const Case&), const std::vector<Case>& cases) {
  for (const Case& c : cases) expect_ok(check(c));
}

}  // namespace ds::test::cuda

#endif  // DELTASTACK_CUDA
