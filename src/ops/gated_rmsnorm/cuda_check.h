// Numeric check of the CUDA gated rmsnorm (ops/gated_rmsnorm/cuda.h) against the fp32 CPU reference
// (ops/gated_rmsnorm/gated_rmsnorm.h), shared by the registry's start-up probe and tests/test_cuda_ops.cpp;
// contract in ops/check/check.h.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

#include "ops/check/check.h"

namespace ds::ops {

// x, z (std 2), dy: [rows, d] bf16; w: [d] fp32 (normal around 1, std 0.3). Values: y, rstd (forward band); dx,
// dz, dw (gradient band; dw accumulated onto a random start); with twice, two runs bitwise equal. The backward
// reads the reference rstd.
struct GatedRmsnormCase {
  int64_t rows = 64, d = 128;
  size_t offset = 0;  // bf16 pointer shift in elements (1: unaligned, the scalar path)
  float eps = 1e-6f;
  uint64_t seed = 1;
  bool twice = true;
};
check::Result check_gated_rmsnorm(const GatedRmsnormCase& c);
// The start-up probe: 64 x 128.
std::vector<GatedRmsnormCase> gated_rmsnorm_probe_cases();
// The registry's probe: check::probe("gated_rmsnorm", gated_rmsnorm_probe_cases(), check_gated_rmsnorm).
double probe_cuda_gated_rmsnorm();

}  // namespace ds::ops
