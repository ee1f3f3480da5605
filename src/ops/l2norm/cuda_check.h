// Numeric check of the CUDA l2norm (ops/l2norm/cuda.h) against the fp32 CPU reference (ops/l2norm/l2norm.h),
// shared by the registry's start-up probe and tests/test_cuda_ops.cpp, tests/test_cuda_real_shapes.cpp; contract
// in ops/check/check.h.
#pragma once
#include <cstdint>
#include <vector>

#include "ops/check/check.h"

namespace ds::ops {

// As in the GDN layer: x is `tokens` x `heads` rows of `dim` bf16 values read at column col0 of [tokens, stride]
// rows (q or k inside the conv output); dx is written back the same way into a poisoned [tokens, stride] buffer.
// Values: y, rnorm (forward band); dx (gradient band); nothing written outside dx's columns; with twice, two runs
// bitwise equal. The backward reads the bf16-rounded reference y and the reference rnorm (what the forward stores).
struct L2normCase {
  int64_t tokens = 48, heads = 2, dim = 128, stride = 1024, col0 = 256;
  float eps = 1e-6f;
  uint64_t seed = 1;
  bool twice = true;
};
check::Result check_l2norm(const L2normCase& c);
// The start-up probe: 48 tokens x 2 heads x 128, rows of stride 1024 at column 256.
std::vector<L2normCase> l2norm_probe_cases();
// The registry's probe: check::probe("l2norm", l2norm_probe_cases(), check_l2norm).
double probe_cuda_l2norm();

}  // namespace ds::ops
