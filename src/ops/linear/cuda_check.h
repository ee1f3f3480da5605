// Numeric check of the CUDA linear layer (ops/linear/cuda.h, cuBLASLt) against the fp32 CPU reference
// (ops/linear/linear.h), shared by the registry's start-up probe and tests/test_cuda_gemm_attn_ce.cpp,
// tests/test_cuda_real_shapes.cpp; contract in ops/check/check.h.
#pragma once
#include <cstdint>
#include <vector>

#include "ops/check/check.h"

namespace ds::ops {

// x: [M, K], W: [N, K] (std K^-1/2), dy: [M, N], all bf16. Values: y = x W^T (forward band), y accumulated onto a
// bf16 y0 (accumulate = true), dx = dy W and dx accumulated onto a bf16 dx0 (gradient band), dW = dy^T x (fp32,
// always accumulated: onto a random start, the increment compared); with twice, two runs bitwise equal.
struct LinearCase {
  int64_t M = 70, K = 256, N = 192;
  bool accumulate = true;  // also check the accumulating forms of y and dx
  uint64_t seed = 1;
  bool twice = true;
};
check::Result check_linear(const LinearCase& c);
// The start-up probe: M 70, K 256, N 192.
std::vector<LinearCase> linear_probe_cases();
// The registry's probe: check::probe("linear", linear_probe_cases(), check_linear).
double probe_cuda_linear();

}  // namespace ds::ops
