// Dispatching entry points of the gated delta rule (fp32): the registry picks the chunked form (fast) or the
// token-recurrent oracle (reference) per DELTASTACK_GATED_DELTA_RULE and the self-probe. Contracts as in
// gated_delta_rule.h.
#pragma once
#include "ops/gated_delta_rule/gated_delta_rule.h"

namespace ds::ops {

void gated_delta_rule_forward(const GdnDims& d, const float* q, const float* k, const float* v, const float* g,
                              const float* beta, const int32_t* cu_seqlens, const float* initial_state, float* o,
                              float* final_state);
void gated_delta_rule_backward(const GdnDims& d, const float* q, const float* k, const float* v, const float* g,
                               const float* beta, const int32_t* cu_seqlens, const float* initial_state,
                               const float* dout, const float* dfinal_state, float* dq, float* dk, float* dv,
                               float* dg, float* dbeta, float* dinitial_state);

// Self-probe of the chunked form against the recurrent oracle: fixed-seed random fp32 inputs with GVA 2, a packed
// batch of lengths {1, 64, 70, 0, 129} (partial chunks), an initial state and a final-state gradient; returns
// the largest relative L2 error over o, final state and all gradients.
double probe_chunked_gated_delta_rule();

}  // namespace ds::ops
