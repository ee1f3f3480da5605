// Numeric check of the CUDA rmsnorm (ops/rmsnorm/cuda.h) against the fp32 CPU reference (ops/rmsnorm/rmsnorm.h),
// shared by the registry's start-up probe and tests/test_cuda_ops.cpp; contract in ops/check/check.h.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

#include "ops/check/check.h"

namespace ds::ops {

// x, dy: [rows, dim] bf16 (normal); w: [dim] fp32 (normal, std 0.2, around 0 when zero-centered, around 1 when
// plain). Values: y, rstd (forward band); dx, dw (gradient band; dw accumulated onto a random start, the increment
// compared); dx computed in place over dy (dx aliasing dy, allowed by the API) bitwise equal to dx; with twice,
// two runs bitwise equal. The backward reads the reference rstd (both sides see the same inputs).
struct RmsnormCase {
  int64_t rows = 64, dim = 256;
  bool zero_centered = true;
  size_t offset = 0;  // elements by which the bf16 pointers are shifted (1: unaligned, the scalar path)
  float eps = 1e-6f;
  uint64_t seed = 1;
  bool twice = true;
};
check::Result check_rmsnorm(const RmsnormCase& c);
// The start-up probe: 64 x 256 zero-centered; 37 x 128 plain (a partial row group).
std::vector<RmsnormCase> rmsnorm_probe_cases();
// The registry's probe: check::probe("rmsnorm", rmsnorm_probe_cases(), check_rmsnorm).
double probe_cuda_rmsnorm();

}  // namespace ds::ops
