// Gated RMSNorm (HF Qwen3_5RMSNormGated in fp32; FLA FusedRMSNormGated): per row of d values
//   y = x * rsqrt(mean(x^2) + eps) * w * silu(z)
// w is a plain multiplier (init ones) shared by all rows (rows = tokens x value heads).
#pragma once
#include <cstdint>

namespace ds::ops {

// x, z, y: [rows, d]; w: [d]; rstd (out): [rows].
template <typename T>
void gated_rmsnorm_forward(const T* x, const T* z, const T* w, T* y, T* rstd, int64_t rows, int64_t d, double eps);

// dx, dz: [rows, d] (overwritten); dw: [d] (accumulated, fixed order). docs/model.md §4 "Gated RMSNorm".
template <typename T>
void gated_rmsnorm_backward(const T* x, const T* z, const T* w, const T* rstd, const T* dy, T* dx, T* dz, T* dw,
                            int64_t rows, int64_t d);

}  // namespace ds::ops
