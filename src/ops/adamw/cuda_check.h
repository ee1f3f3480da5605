// Numeric check of the CUDA optimizer kernels (ops/adamw/cuda.h: adamw_update with its bf16 copy, to_bf16,
// sum_squares) against the CPU reference (ops/adamw/adamw.h), shared by the registry's start-up probe and
// tests/test_cuda_ops.cpp; contract in ops/check/check.h.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

#include "ops/adamw/adamw.h"
#include "ops/check/check.h"

namespace ds::ops {

// n fp32 values: param (std 0.02), grad (std 1e-3), m (std 1e-3), v (uniform [0, 1e-6)). Values: param, m, v and
// their updates new - old (the step is small next to the value; forward band); the bf16 copy of the new param
// (forward band, and exactly its round-to-nearest-even), to_bf16(grad) exact, sum_squares(grad) (band 1e-10);
// with twice, two runs bitwise equal.
struct AdamwCase {
  int64_t n = 5003;
  size_t offset = 0;      // pointer shift in elements (1: unaligned, the scalar path)
  bool with_bf16 = true;  // adamw_update also writes the bf16 compute copy
  AdamWParams hp{3e-4, 0.9, 0.95, 1e-8, 0.1, 17, 0.7};
  uint64_t seed = 1;
  bool twice = true;
  // check_adamw_8bit only: the starting moments scaled per block by 1e-30 .. 1e10 (v by its square, so the
  // smallest underflow to 0 while m does not), the gradients per element by 1e-25 .. 1e10, every 7th block's
  // starting state zero, every 5th block's gradients zero in every step, 1 in 50 gradients exactly zero: zero,
  // tiny and huge operands of the update's square root and divisions.
  bool wide = false;
};
check::Result check_adamw(const AdamwCase& c);
// The lean mode's kernel (adamw_update_bf16: bf16 param / m / v with stochastic rounding) against its CPU
// reference: bitwise equal (same fp32 operations, same random stream), two runs bitwise equal. with_bf16 unused.
check::Result check_adamw_bf16(const AdamwCase& c);
// The 8-bit state's kernel (adamw_update_8bit) against its CPU reference, three steps (the second with gradients
// 100x smaller, so scales shrink) from random quantized moments, over the flat range [1000 + seed, + n) (a partial
// first block): weights, codes and block scales bitwise equal; two runs bitwise equal. with_bf16 unused.
check::Result check_adamw_8bit(const AdamwCase& c);
// The start-up probe: n 5003 (a vector body and a scalar tail).
std::vector<AdamwCase> adamw_probe_cases();
// The registry's probe: check::probe("adamw", adamw_probe_cases(), check_adamw).
double probe_cuda_adamw();

}  // namespace ds::ops
