// Causal depthwise conv1d + SiLU over packed sequences (Dao causal_conv1d_fn with seq_idx, activation
// "silu", no bias). Token-major layout as in HF after in_proj_qkv: x [N, C].
//   p[t, c] = sum_{j<K} w[c, j] * x[t - (K-1) + j, c]   (terms before the segment start are zero)
//   y = silu(p)
#pragma once
#include <cstdint>

namespace ds::ops {

// x, y: [N, C]; w: [C, K]; cu_seqlens: [num_seqs + 1] int32, cu_seqlens[0] = 0, cu_seqlens[num_seqs] = N.
template <typename T>
void conv1d_silu_forward(const T* x, const T* w, const int32_t* cu_seqlens, int64_t num_seqs, int64_t N,
                         int64_t C, int64_t K, T* y);

// dx: [N, C] (overwritten); dw: [C, K] (accumulated, fixed order). Recomputes p from x.
template <typename T>
void conv1d_silu_backward(const T* x, const T* w, const T* dy, const int32_t* cu_seqlens, int64_t num_seqs,
                          int64_t N, int64_t C, int64_t K, T* dx, T* dw);

}  // namespace ds::ops
