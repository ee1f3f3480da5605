// L2 normalisation over the last dimension (FLA l2norm_fwd, HF l2norm): y = x / sqrt(sum(x^2) + eps),
// eps inside the sqrt and added to the sum (not the mean), eps = 1e-6 for Qwen3.5.
#pragma once
#include <cstdint>

namespace ds::ops {

// x, y: [rows, dim]; rnorm (out): [rows] = 1/sqrt(sum(x^2) + eps).
template <typename T>
void l2norm_forward(const T* x, T* y, T* rnorm, int64_t rows, int64_t dim, double eps);

// dx = rnorm * (dy - y * (dy . y)). dx: [rows, dim] (overwritten).
template <typename T>
void l2norm_backward(const T* y, const T* rnorm, const T* dy, T* dx, int64_t rows, int64_t dim);

}  // namespace ds::ops
