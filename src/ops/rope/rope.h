// Partial rotary position embedding, half-split pairs (HF apply_rotary_pos_emb with rotate_half, Qwen3.5's
// interleaved M-RoPE reduced to text positions; docs/model.md §2.2). For each head vector x of head_dim,
// only the first rotary_dim values rotate; pair (i, i + rotary_dim/2) for i < rotary_dim/2:
//   x1' = x1 cos - x2 sin;   x2' = x2 cos + x1 sin,   angle = pos * theta^(-2i / rotary_dim).
#pragma once
#include <cstdint>

namespace ds::ops {

// cos_t, sin_t (out): [N, rotary_dim/2] for positions [N] (int32). Angles are computed as HF does: inv_freq
// in fp32, then inv_freq * pos in fp32, then cos/sin.
template <typename T>
void rope_tables(const int32_t* positions, int64_t N, int64_t rotary_dim, double theta, T* cos_t, T* sin_t);

// In place on x: [N, H, head_dim]. inverse = true applies the transposed rotation (the backward: dx from dy).
template <typename T>
void rope_apply(T* x, int64_t N, int64_t H, int64_t head_dim, int64_t rotary_dim, const T* cos_t, const T* sin_t,
                bool inverse);

}  // namespace ds::ops
