// Numeric check of the CUDA causal depthwise conv1d + SiLU (ops/conv1d/cuda.h) against the fp32 CPU reference
// (ops/conv1d/conv1d.h), shared by the registry's start-up probe and tests/test_cuda_ops.cpp,
// tests/test_cuda_real_shapes.cpp; contract in ops/check/check.h.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

#include "ops/check/check.h"

namespace ds::ops {

// Packed documents (explicit lengths, or random lengths filling N tokens: a quarter of them 1..3 tokens, the
// rest up to max_doc); x, dy: [N, C] bf16; w: [C, K] fp32 (std 0.5). Values: y (forward band); dx, dw (gradient
// band; dw accumulated onto a random start); with twice, two runs bitwise equal; with division, a run with the
// kernels' division sigmoid bitwise equal to the default's.
struct Conv1dCase {
  std::vector<int> lens;       // document lengths (a length may be 0); empty: random, see N and max_doc
  int64_t N = 0, max_doc = 0;  // with lens empty
  int64_t C = 96, K = 4;
  size_t offset = 0;  // bf16 pointer shift in elements (1: unaligned, the scalar path)
  uint64_t seed = 1;
  bool twice = true;
  double x_std = 1.0;     // x's standard deviation (60: pre-activations far past the sigmoid's fast range, |p| > 87)
  bool division = false;  // also with the kernels' division sigmoid (ds::cuda::division_sigmoid): bitwise equal
};
check::Result check_conv1d(const Conv1dCase& c);
// The start-up probe: packed {1, 70, 0, 130} (a one-token document, an empty one), C 96, K 4.
std::vector<Conv1dCase> conv1d_probe_cases();
// The registry's probe: check::probe("conv1d", conv1d_probe_cases(), check_conv1d).
double probe_cuda_conv1d();

}  // namespace ds::ops
