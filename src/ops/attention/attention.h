// Causal grouped-query softmax attention over packed sequences (HF sdpa/eager with a block-diagonal causal
// mask), plus Qwen3.5's sigmoid output gate (HF Qwen3_5Attention: o * sigmoid(gate)).
//   o[t, h] = sum_{s in seg(t), s <= t} softmax_s(scale * q[t,h] . k[s, h/(Hq/Hkv)]) v[s, h/(Hq/Hkv)]
#pragma once
#include <cstdint>

namespace ds::ops {

struct AttnDims {
  int64_t N = 0, num_seqs = 0, Hq = 0, Hkv = 0, head_dim = 0;
  double scale = 0;  // head_dim^-0.5 for Qwen3.5
};

// q, o: [N, Hq, hd]; k, v: [N, Hkv, hd]; cu_seqlens: [num_seqs + 1]; lse (out): [N, Hq] log-sum-exp of the
// scaled scores (natural log), kept for backward.
template <typename T>
void attention_forward(const AttnDims& d, const T* q, const T* k, const T* v, const int32_t* cu_seqlens, T* o,
                       T* lse);

// dq: [N, Hq, hd]; dk, dv: [N, Hkv, hd] (all overwritten; dk/dv summed over the q heads of a group in fixed
// order). Recomputes probabilities from q, k, lse.
template <typename T>
void attention_backward(const AttnDims& d, const T* q, const T* k, const T* v, const T* o, const T* lse,
                        const T* dout, const int32_t* cu_seqlens, T* dq, T* dk, T* dv);

// y = o * sigmoid(gate), elementwise over n values.
template <typename T>
void output_gate_forward(const T* o, const T* gate, T* y, int64_t n);
// do = dy * sigmoid(gate); dgate = dy * o * sigmoid(gate) * (1 - sigmoid(gate)). Overwritten.
template <typename T>
void output_gate_backward(const T* o, const T* gate, const T* dy, T* dout, T* dgate, int64_t n);

}  // namespace ds::ops
