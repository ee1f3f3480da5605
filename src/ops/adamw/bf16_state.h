// AdamW on bf16 weights and bf16 moments with stochastic rounding: the lean optimizer-state mode
// (`--optimizer-state bf16`, docs/memory.md). Shared by the CPU reference (cpu.cpp) and the CUDA kernel (cuda.cu)
// so that both run the same fp32 operations in the same order (explicit fmaf, no contraction left to the
// compiler) and draw the same random bits: the two agree bitwise.
//
// Per element, with g = grad * grad_scale and every bf16 value widened exactly to fp32:
//   p' = p (1 - lr wd);  m' = fma(b1, m, (1-b1) g);  v' = fma(b2, v, ((1-b2) g) g);
//   p' = p' - (lr / (1-b1^t)) m' / fma(sqrt(v'), 1/sqrt(1-b2^t), eps)          (torch.optim.AdamW's update)
// then p', m', v' are rounded to bf16 stochastically: x is rounded up to the next bf16 with probability equal to
// its distance from the bf16 below, in units of the bf16 spacing (so E[round(x)] = x; Gupta et al. 2015, "Deep
// learning with limited numerical precision", §3). Round-to-nearest would drop every update smaller than half a
// bf16 step (|Δp| < 2^-9 |p|), which is most of them late in training; stochastic rounding keeps them in
// expectation. NaN and infinities pass through unchanged.
//
// The random bits are a counter-based stream (no state): 64 bits per element from the splitmix64 finaliser
// (Steele, Lea & Flood 2014) of a key made from the step and the element's flat parameter index, 16 bits each for
// p, m and v. The same step, index and seed give the same bits on every device and every run, so a resumed run
// continues bitwise.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

#include "ops/adamw/adamw.h"

#if defined(__CUDACC__)
#define DS_ADAM_HD __host__ __device__ __forceinline__
#else
#define DS_ADAM_HD inline
#endif

namespace ds::ops::bf16_state {

DS_ADAM_HD uint64_t mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  x ^= x >> 31;
  return x;
}

// The per-step key (host): every element of step `step` draws from mix64(key + index * golden ratio).
inline uint64_t step_key(uint64_t seed, int64_t step) {
  return mix64(seed ^ mix64(static_cast<uint64_t>(step) * 0x9e3779b97f4a7c15ULL + 0x632be59bd9b4e019ULL));
}
DS_ADAM_HD uint64_t element_bits(uint64_t key, uint64_t index) { return mix64(key + index * 0x9e3779b97f4a7c15ULL); }

DS_ADAM_HD uint32_t f32_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
#endif
}
DS_ADAM_HD float bits_f32(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float x;
  std::memcpy(&x, &u, 4);
  return x;
#endif
}
// a * b rounded once (never fused into a following add by the compiler; the host file is built with
// -ffp-contract=off for the same reason, CMakeLists.txt).
DS_ADAM_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
DS_ADAM_HD float widen(uint16_t b) { return bits_f32(static_cast<uint32_t>(b) << 16); }

// x rounded to bf16 bits, up with probability (x - down(x)) / spacing, given 16 uniform random bits r16.
// Written as selects (an early return for NaN and infinity before; the same values for every x and r16).
DS_ADAM_HD uint16_t round_stochastic(float x, uint32_t r16) {
  const uint32_t u = f32_bits(x);
  const uint32_t rounded = (u + (r16 & 0xffffu)) >> 16;  // no carry out of 32 bits: u <= 0xff7fffff when finite
  const uint32_t special = (u & 0x007fffffu) ? ((u >> 16) | 0x0040u) : (u >> 16);  // NaN (kept quiet) or infinity
  return static_cast<uint16_t>((u & 0x7f800000u) == 0x7f800000u ? special : rounded);
}

// The step's constants in fp32, computed on the host in double (as the fp32 AdamW).
struct Consts {
  float b1, one_minus_b1, b2, one_minus_b2, decay, step_size, inv_sqrt_bc2, eps, grad_scale;
  uint64_t key;
};

// The seed of the rounding stream (fixed: the stream varies with the step and the element, not the run).
constexpr uint64_t kSeed = 0x5d2b6a1c9e3f4071ULL;

inline Consts consts(const AdamWParams& p) {
  const double bc1 = 1.0 - std::pow(p.beta1, static_cast<double>(p.step));
  const double bc2 = 1.0 - std::pow(p.beta2, static_cast<double>(p.step));
  Consts k;
  k.b1 = static_cast<float>(p.beta1);
  k.one_minus_b1 = static_cast<float>(1.0 - p.beta1);
  k.b2 = static_cast<float>(p.beta2);
  k.one_minus_b2 = static_cast<float>(1.0 - p.beta2);
  k.decay = static_cast<float>(1.0 - p.lr * p.weight_decay);
  k.step_size = static_cast<float>(p.lr / bc1);
  k.inv_sqrt_bc2 = static_cast<float>(1.0 / std::sqrt(bc2));
  k.eps = static_cast<float>(p.eps);
  k.grad_scale = static_cast<float>(p.grad_scale);
  k.key = step_key(kSeed, p.step);
  return k;
}

// The new moments from the old ones (fp32) and the gradient g (grad_scale not yet applied).
DS_ADAM_HD float new_exp_avg(float m, float g, const Consts& k) { return fmaf(k.b1, m, k.one_minus_b1 * (g * k.grad_scale)); }
DS_ADAM_HD float new_exp_avg_sq(float v, float g, const Consts& k) {
  g = g * k.grad_scale;
  return fmaf(k.b2, v, (k.one_minus_b2 * g) * g);
}
// The bf16 weight p after the step with the new moments mm, vv, rounded stochastically with the 16 bits r16.
DS_ADAM_HD uint16_t new_weight(uint16_t p, float mm, float vv, const Consts& k, uint32_t r16) {
  float pp = mul_rn(widen(p), k.decay);
  pp = pp - (k.step_size * mm) / fmaf(sqrtf(vv), k.inv_sqrt_bc2, k.eps);
  return round_stochastic(pp, r16);
}

// One element: p, m, v bf16 bits in place; index is the element's flat parameter index (the random stream).
DS_ADAM_HD void update(uint16_t& p, float g, uint16_t& m, uint16_t& v, const Consts& k, uint64_t index) {
  const float mm = new_exp_avg(widen(m), g, k), vv = new_exp_avg_sq(widen(v), g, k);
  const uint64_t r = element_bits(k.key, index);
  p = new_weight(p, mm, vv, k, static_cast<uint32_t>(r));
  m = round_stochastic(mm, static_cast<uint32_t>(r >> 16));
  v = round_stochastic(vv, static_cast<uint32_t>(r >> 32));
}

// Gradients::Bf16 (`--gradients bf16`, docs/memory.md): one micro-batch's fp32 gradient g added into the bf16
// gradient buffer's element acc, rounded stochastically as above: SR(widen(acc) + g). The 16 random bits are the
// low ones of the counter-based stream keyed by grad_key(step, micro) and the element's flat parameter index (a
// seed of its own, so they are independent of the update's bits for the same step and element). The first
// micro-batch of a step adds onto zero: SR(g).
constexpr uint64_t kGradSeed = 0x3c6ef372fe94f82bULL;
// step: the trainer's step (1-based); micro: the micro-batch's index within it (0-based).
inline uint64_t grad_key(int64_t step, int64_t micro) {
  return step_key(kGradSeed ^ mix64(static_cast<uint64_t>(micro) + 1), step);
}
DS_ADAM_HD uint16_t accumulate_grad(uint16_t acc, float g, uint64_t key, uint64_t index) {
  return round_stochastic(widen(acc) + g, static_cast<uint32_t>(element_bits(key, index)));
}

}  // namespace ds::ops::bf16_state
