// RMSNorm over the last dimension, rows independent. Qwen3.5 uses the zero-centered form
// (HF Qwen3_5RMSNorm): y = x * rsqrt(mean(x^2) + eps) * (1 + w); the plain form scales by w.
// Used for input/post-attention layernorms, the final norm and the attention q/k norms.
#pragma once
#include <cstdint>

namespace ds::ops {

// x, y: [rows, dim]; w: [dim]; rstd (out): [rows] = rsqrt(mean(x^2) + eps), kept for backward.
template <typename T>
void rmsnorm_forward(const T* x, const T* w, T* y, T* rstd, int64_t rows, int64_t dim, double eps,
                     bool zero_centered);

// Backward (docs/model.md §4): dx = rstd * (dxh - xh * mean(dxh * xh)), dxh = dy * gamma,
// dw += sum_rows dy * xh. dx: [rows, dim] (overwritten); dw: [dim] (accumulated, fixed order).
template <typename T>
void rmsnorm_backward(const T* x, const T* w, const T* rstd, const T* dy, T* dx, T* dw, int64_t rows,
                      int64_t dim, bool zero_centered);

}  // namespace ds::ops
