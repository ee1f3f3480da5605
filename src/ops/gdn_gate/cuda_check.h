// Numeric check of the CUDA GDN gates (ops/gdn_gate/cuda.h) against the fp32 CPU reference
// (ops/gdn_gate/gdn_gate.h), shared by the registry's start-up probe and tests/test_cuda_ops.cpp,
// tests/test_cuda_real_shapes.cpp; contract in ops/check/check.h.
#pragma once
#include <cstdint>
#include <vector>

#include "ops/check/check.h"

namespace ds::ops {

// ab: the fused [N, 2Hv] in_proj_b | in_proj_a output, bf16 (a std 8, b std 3; the first token's a are 20..25, so
// a + dt_bias crosses the softplus threshold 20); A_log: [Hv] fp32 uniform in [0, 2.7); dt_bias: [Hv] normal;
// dg, dbeta: [N, Hv] fp32. Values: g, beta (forward band); da, db (the halves of dab), dA_log, ddt_bias (gradient
// band; dA_log and ddt_bias accumulated onto random starts); with twice, two runs bitwise equal.
struct GdnGateCase {
  int64_t N = 64, Hv = 32;
  uint64_t seed = 1;
  bool twice = true;
};
check::Result check_gdn_gate(const GdnGateCase& c);
// The start-up probe: N 64, Hv 32.
std::vector<GdnGateCase> gdn_gate_probe_cases();
// The registry's probe: check::probe("gdn_gate", gdn_gate_probe_cases(), check_gdn_gate).
double probe_cuda_gdn_gate();

}  // namespace ds::ops
