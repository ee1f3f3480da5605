// Numeric check of the FP8 linear layer (ops/linear/fp8.h: casts + cuBLASLt FP8 GEMMs) against the CPU emulation
// (core/fp8.h), shared by the registry's start-up probe of "linear_fp8" and tests/test_fp8.cpp; contract in
// ops/check/check.h.
#pragma once
#include <cstdint>
#include <vector>

#include "core/fp8.h"
#include "ops/check/check.h"

namespace ds::ops {

// x: [M, K] (bf16, scaled by x_scale so the amax is far from 1), W: [N, K], dy: [M, N]. Values: the casts of x
// (row-major and transposed with its zero padding), W^T and dy (the grad format) bitwise equal to fp8_encode of the
// CPU emulation, and their dequantization scales; y = x W^T, dx = dy W (dx accumulated onto a random start when
// accumulate), dW += dy^T x, each against the float64 product of the emulated casts (forward / gradient bands);
// with twice, two runs bitwise equal.
struct LinearFp8Case {
  int64_t M = 70, K = 256, N = 192;
  Fp8Format grad = Fp8Format::E5M2;
  double x_scale = 30.0;
  bool accumulate = true;
  bool fast_accum = false;
  uint64_t seed = 1;
  bool twice = true;
};
check::Result check_linear_fp8(const LinearFp8Case& c);
std::vector<LinearFp8Case> linear_fp8_probe_cases();
// The registry's probe: check::probe("linear_fp8", linear_fp8_probe_cases(), check_linear_fp8).
double probe_cuda_linear_fp8();

}  // namespace ds::ops
