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

// The 8-bit state's AdamW (q8_state.h): param bf16 bits [n] updated in place with stochastic rounding (the bf16
// state's), grad fp32 [n]; m_code, v_code: the codes [n] of m and sqrt(v); m_absmax, v_absmax: their scales, one per
// block of the flat range [index0, index0 + n) (q8_state::num_blocks of them: blocks are the 256-aligned chunks of
// the flat index, cut at index0 and index0 + n, so the range must be one parameter or a share's part of it).
// Bitwise what ops::cuda::adamw_update_8bit computes.
void adamw_update_8bit(uint16_t* param, const float* grad, uint8_t* m_code, uint8_t* v_code, float* m_absmax,
                       float* v_absmax, int64_t n, const AdamWParams& p, int64_t index0);
// The 8-bit state's moments to and from fp32 (q8_state.h), blocks as adamw_update_8bit's. which 0: exp_avg (m,
// signed code); 1: exp_avg_sq (v >= 0; stored as the code of sqrt(v), dequantized as r * r). quantize: x [n] fp32
// -> code [n], absmax [num_blocks]; [index0, index0 + n) must hold whole blocks. dequantize: code [n] of flat
// elements [index0, index0 + n) with the scales of their blocks (absmax[0]: the block holding index0) -> x [n].
// dequantize then quantize gives back the codes and scales bitwise.
void quantize_moment_8bit(int which, const float* x, int64_t n, int64_t index0, uint8_t* code, float* absmax);
void dequantize_moment_8bit(int which, const uint8_t* code, const float* absmax, int64_t n, int64_t index0, float* x);

// The bf16 gradient buffer's accumulation (`--gradients bf16`; bf16_state.h accumulate_grad): acc bf16 bits [n] in
// place, acc[i] = SR(widen(acc[i]) + g[i]) with the random bits of (key, index0 + i); key: bf16_state::grad_key(step,
// micro-batch). Bitwise what ops::cuda::accumulate_grad_bf16 computes.
void accumulate_grad_bf16(uint16_t* acc, const float* g, int64_t n, uint64_t key, int64_t index0);

// Sum of squares of grad[0..n) in double, reduced in a fixed order (independent of thread count).
double sum_squares(const float* grad, int64_t n);

}  // namespace ds::ops
