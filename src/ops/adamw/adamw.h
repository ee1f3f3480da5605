// AdamW (Loshchilov & Hutter 2019, decoupled weight decay; torch.optim.AdamW semantics) and the global
// gradient L2 norm used for clipping (torch.nn.utils.clip_grad_norm_).
#pragma once
#include <cstdint>

namespace ds::ops {

struct AdamWParams {
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.95, eps = 1e-8, weight_decay = 0.0;
  int64_t step = 1;          // 1-based step count for bias correction
  double grad_scale = 1.0;   // grads are multiplied by this first (clipping factor)
};

// In place on param, m, v: [n] fp32. p -= lr*wd*p; m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
// p -= lr * (m / (1-b1^t)) / (sqrt(v / (1-b2^t)) + eps).
void adamw_update(float* param, const float* grad, float* m, float* v, int64_t n, const AdamWParams& p);

// The lean mode's AdamW (bf16_state.h): param, m, v bf16 bits [n] updated in place with stochastic rounding;
// grad fp32 [n]; index0 is the flat parameter index of element 0 (it selects the random stream). Bitwise what
// ops::cuda::adamw_update_bf16 computes.
void adamw_update_bf16(uint16_t* param, const float* grad, uint16_t* m, uint16_t* v, int64_t n, const AdamWParams& p,
                       int64_t index0);

// Sum of squares of grad[0..n) in double, reduced in a fixed order (independent of thread count).
double sum_squares(const float* grad, int64_t n);

}  // namespace ds::ops
