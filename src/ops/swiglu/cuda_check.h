// Numeric check of the CUDA SwiGLU (ops/swiglu/cuda.h) against the fp32 CPU reference (ops/swiglu/swiglu.h),
// shared by the registry's start-up probe and tests/test_cuda_ops.cpp, tests/test_cuda_real_shapes.cpp; contract
// in ops/check/check.h.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

#include "ops/check/check.h"

namespace ds::ops {

// gu: the fused [N, 2I] gate | up projection output, bf16 (gate std 2, up std 1), or with split gate and up as two
// [N, I] arrays; dh: [N, I] bf16. Values: h
// (forward band); dgate, dup (the two halves of dgu, gradient band); with twice, two runs bitwise equal.
struct SwigluCase {
  int64_t N = 64, I = 256;
  size_t offset = 0;  // bf16 pointer shift in elements (1: unaligned, the scalar path)
  uint64_t seed = 1;
  bool twice = true;
  bool split = false;  // gate and up as two dense [N, I] arrays (swiglu_*_rows with stride I; deltastack.torch)
  double gate_std = 2.0;  // the gate's standard deviation (60: values far past the sigmoid's fast range, |g| > 87)
  bool division = false;  // also with the kernels' division sigmoid (ds::cuda::division_sigmoid): bitwise equal
};
check::Result check_swiglu(const SwigluCase& c);
// The start-up probe: N 64, I 256.
std::vector<SwigluCase> swiglu_probe_cases();
// The registry's probe: check::probe("swiglu", swiglu_probe_cases(), check_swiglu).
double probe_cuda_swiglu();

}  // namespace ds::ops
