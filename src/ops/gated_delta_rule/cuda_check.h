// Numeric check of the CUDA chunked gated delta rule (ops/gated_delta_rule/cuda.h) against the fp32 CPU reference
// (ops/gated_delta_rule/gated_delta_rule.h: the token-recurrent oracle, or the chunked form for long sequences),
// shared by the registry's start-up probe and tests/test_cuda_gdn.cpp, tests/test_cuda_real_shapes.cpp; contract
// in ops/check/check.h.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "ops/check/check.h"

namespace ds::ops {

// Documents packed in the order of `lens` (a length may be 0), Hk key heads, Hv = Hk * ratio value heads, zero
// initial state, no final-state gradient. q, k: [N, Hk, dk] bf16, each row l2-normalised; v: [N, Hv, dv] bf16 read
// at column v_col of rows of v_col + Hv dv + v_pad elements (the other columns hold 1e30), as v inside the conv
// output; dO: [N, Hv, dv] bf16; g: [N, Hv] fp32 uniform in [g_lo, g_hi); beta: [N, Hv] fp32 uniform in
// [0.01, 0.99). dv is written the same way (column dv_col, pad dv_pad) into poisoned rows. The scratch and the
// chunk states are poisoned too. Values: o (forward band); dq, dk, dv (gradient band); dg, dbeta (gate band);
// dv written only inside its columns; every chunk state written; the state saved at the start of each document's
// first chunk is the zero initial state; with twice, two runs bitwise equal.
struct GatedDeltaRuleCase {
  std::vector<int> lens = {1, 70, 0, 130};
  int64_t Hk = 2, ratio = 2, dk = 32, dv = 32;
  double g_lo = -2.0, g_hi = -0.01;
  int64_t chunk = 64;
  int64_t v_col = 0, v_pad = 8, dv_col = 0, dv_pad = 24;
  bool chunked_forward_ref = false;   // CPU forward reference: the chunked form instead of the recurrent oracle
  bool chunked_backward_ref = false;  // the same for the backward (the oracle keeps every state: too big for long
                                      // sequences)
  uint64_t seed = 1;
  bool twice = true;
  // Empty: the simple kernel's launchers (cuda.h) with their private contract checked too (chunk states). Else an
  // op plan's backend name ("cuda-simple", "cuda-chunked"): the kernel runs through plan.h (prepare on the device,
  // saved buffer and workspace poisoned first) and the public outputs are checked.
  std::string backend;
  // With a backend: the plan's limits exceed the batch by this many tokens / documents, as in the engine, whose
  // plan is sized for the largest micro-batch (chunk grids then run past the batch's chunks and must exit).
  int64_t plan_extra_tokens = 0, plan_extra_seqs = 0;
};
check::Result check_gated_delta_rule(const GatedDeltaRuleCase& c);
// The start-up probe: packed {1, 70, 0, 130}, GVA 2, dk = dv = 32 (Hk 2) and 128 (Hk 1); v read from and dv
// written into [N, q | k | v] conv-output rows (column 2 Hk dk).
std::vector<GatedDeltaRuleCase> gated_delta_rule_probe_cases();
// The registry's probe: check::probe("gated_delta_rule", ..._probe_cases(), check_gated_delta_rule).
double probe_cuda_gated_delta_rule();
// The chunked kernel's probe: packed {1, 70, 0, 130} and {64, 39, 1, 127} with g down to -60, dk = dv = 128,
// GVA 1 and 2, through its plan.
std::vector<GatedDeltaRuleCase> gated_delta_rule_chunked_probe_cases();
double probe_cuda_gated_delta_rule_chunked();

}  // namespace ds::ops
