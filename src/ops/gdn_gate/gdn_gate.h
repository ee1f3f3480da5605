// Gated DeltaNet gates (HF Qwen3_5GatedDeltaNet.forward):
//   beta = sigmoid(b)
//   g    = -exp(A_log) * softplus(a + dt_bias)      (softplus with PyTorch's threshold 20)
#pragma once
#include <cstdint>

namespace ds::ops {

// a, b, g, beta: [N, Hv]; A_log, dt_bias: [Hv].
template <typename T>
void gdn_gate_forward(const T* a, const T* b, const T* A_log, const T* dt_bias, T* g, T* beta, int64_t N,
                      int64_t Hv);

// da, db: [N, Hv] (overwritten); dA_log, ddt_bias: [Hv] (accumulated, fixed order).
// dA_log += sum dg * g; ddt_bias += sum dg * (-exp(A_log) * sigmoid(a + dt_bias)); db = dbeta * beta(1-beta).
template <typename T>
void gdn_gate_backward(const T* a, const T* b, const T* A_log, const T* dt_bias, const T* dg, const T* dbeta,
                       T* da, T* db, T* dA_log, T* ddt_bias, int64_t N, int64_t Hv);

}  // namespace ds::ops
