// Numeric check of the CUDA partial RoPE (ops/rope/cuda.h) against the fp32 CPU reference (ops/rope/rope.h),
// shared by the registry's start-up probe and tests/test_cuda_ops.cpp, tests/test_cuda_real_shapes.cpp; contract
// in ops/check/check.h.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

#include "ops/check/check.h"

namespace ds::ops {

// x: [N, H, head_dim] bf16, rotated in place over its first rotary_dim values; positions restart at every document
// (explicit lengths, or random lengths filling N tokens, documents up to 400); fp32 cos / sin tables from the CPU
// rope_tables. Values: forward (forward band), inverse = the backward (gradient band); with twice, two runs of
// each bitwise equal.
struct RopeCase {
  std::vector<int> lens;  // document lengths; empty: random lengths filling N
  int64_t N = 0;
  int64_t H = 3, head_dim = 128, rotary_dim = 32;
  double theta = 1e7;
  size_t offset = 0;  // bf16 pointer shift in elements (1: unaligned, the scalar path)
  uint64_t seed = 1;
  bool twice = true;
};
check::Result check_rope(const RopeCase& c);
// The start-up probe: packed {1, 70, 0, 130}, H 3, head_dim 128, rotary 32.
std::vector<RopeCase> rope_probe_cases();
// The registry's probe: check::probe("rope", rope_probe_cases(), check_rope).
double probe_cuda_rope();

}  // namespace ds::ops
