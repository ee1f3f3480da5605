// Numeric check of the CUDA fused linear + cross-entropy (ops/linear_cross_entropy/cuda.h) against the fp32 CPU
// reference (ops/linear_cross_entropy/linear_cross_entropy.h), shared by the registry's start-up probe and
// tests/test_cuda_gemm_attn_ce.cpp, tests/test_cuda_real_shapes.cpp; contract in ops/check/check.h.
#pragma once
#include <cstdint>
#include <vector>

#include "ops/check/check.h"

namespace ds::ops {

// h: [N, H] bf16 (std 1); W: [V, H] bf16 (std 2 H^-1/2: logits of std ~2); labels: about 10% ignored (-100, the
// first token always), the last token the last vocabulary row; z-loss 1e-4, mean reduction (grad_scale
// 1 / valid tokens), chunks of chunk_tokens. Values: loss sum, z-loss sum (band 1e-4), the forward-only call
// (no dh / dW) giving the same loss bitwise, dh (gradient band), dW (fp32, accumulated onto a random start;
// gradient band); with twice, two runs bitwise equal; with dW, LinearCeOptions::dW_overwrite into a NaN-poisoned dW
// bitwise the gradient added into zeros. fp8: the FP8 lm head (LinearCeOptions::fp8_grads; z-loss
// 0) against the CPU's emulation of its casts, and its dh at least 2e-3 (rel. L2) away from the exact dh, so a run
// that ignored the option fails; H, V and chunk_tokens multiples of 16.
struct LinearCeCase {
  int64_t N = 64, H = 128, V = 1000, chunk_tokens = 24;
  uint64_t seed = 1;
  bool twice = true;
  bool fp8 = false;
  bool dW = true;  // false: the GPU runs without dW (a frozen head, LoRA's), its scratch planned for that
};
check::Result check_linear_cross_entropy(const LinearCeCase& c);
// The start-up probe: N 64, H 128, V 1000, chunks of 24 (three, the last one partial).
std::vector<LinearCeCase> linear_cross_entropy_probe_cases();
// The registry's probe: check::probe("linear_cross_entropy", ..._probe_cases(), check_linear_cross_entropy).
double probe_cuda_linear_cross_entropy();

}  // namespace ds::ops
