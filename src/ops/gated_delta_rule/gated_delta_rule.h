// Gated delta rule (Gated DeltaNet core; Yang et al. 2024, "Gated Delta Networks", eq. for S_t), over packed
// sequences. Per sequence and value head h (q/k head j = h / (Hv/Hk), GVA), starting from S_0 (zero or given):
//   S̄_t = exp(g_t) S_{t-1};   u_t = beta_t (v_t - S̄_t^T k_t);   S_t = S̄_t + k_t u_t^T;   o_t = scale * S_t^T q_t
// q and k arrive already l2-normalised (ops/l2norm); scale is usually dk^-0.5. S is [dk, dv].
// Layouts (token-major, as in HF after the conv):
//   q, k: [N, Hk, dk];  v, o: [N, Hv, dv];  g, beta: [N, Hv] (g in log space, natural log);
//   cu_seqlens: [num_seqs + 1] int32 from 0 to N (an empty sequence is allowed);
//   initial_state, final_state: [num_seqs, Hv, dk, dv] (either may be null: zero start / not wanted).
#pragma once
#include <cstdint>

namespace ds::ops {

struct GdnDims {
  int64_t N = 0;         // total tokens
  int64_t num_seqs = 0;  // number of packed sequences
  int64_t Hk = 0, Hv = 0, dk = 0, dv = 0;
  double scale = 0;       // multiplies q (dk^-0.5 in Qwen3.5)
  int64_t chunk_size = 64;
};

// Chunked (WY / UT-transform) form with chunk_size tokens per chunk, as HF torch_chunk_gated_delta_rule
// (docs/model.md §3.2) but per packed sequence: the state resets at every cu_seqlens boundary.
template <typename T>
void chunk_gated_delta_rule_forward(const GdnDims& d, const T* q, const T* k, const T* v, const T* g,
                                    const T* beta, const int32_t* cu_seqlens, const T* initial_state, T* o,
                                    T* final_state);

// Backward of the above. Inputs as in forward plus do: [N, Hv, dv] and dfinal_state ([num_seqs, Hv, dk, dv]
// or null = zero). Outputs (all overwritten; null pointers are skipped): dq, dk: [N, Hk, dk] (summed over the
// Hv/Hk value heads sharing a k-head); dv: [N, Hv, dv]; dg, dbeta: [N, Hv]; dinitial_state: [num_seqs, Hv, dk, dv].
template <typename T>
void chunk_gated_delta_rule_backward(const GdnDims& d, const T* q, const T* k, const T* v, const T* g,
                                     const T* beta, const int32_t* cu_seqlens, const T* initial_state,
                                     const T* dout, const T* dfinal_state, T* dq, T* dk, T* dv, T* dg, T* dbeta,
                                     T* dinitial_state);

// Token-by-token recurrent oracle (HF torch_recurrent_gated_delta_rule order). Same contract as the chunked form.
template <typename T>
void recurrent_gated_delta_rule_forward(const GdnDims& d, const T* q, const T* k, const T* v, const T* g,
                                        const T* beta, const int32_t* cu_seqlens, const T* initial_state, T* o,
                                        T* final_state);

// Reverse-time backward of the recurrent form (docs/model.md §4). Same contract as the chunked backward.
template <typename T>
void recurrent_gated_delta_rule_backward(const GdnDims& d, const T* q, const T* k, const T* v, const T* g,
                                         const T* beta, const int32_t* cu_seqlens, const T* initial_state,
                                         const T* dout, const T* dfinal_state, T* dq, T* dk, T* dv, T* dg,
                                         T* dbeta, T* dinitial_state);

}  // namespace ds::ops
