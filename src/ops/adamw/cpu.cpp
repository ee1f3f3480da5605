#include <algorithm>
#include <cmath>
#include <vector>

#include "ops/adamw/adamw.h"
#include "ops/adamw/bf16_state.h"
#include "ops/adamw/q8_state.h"

namespace ds::ops {

void adamw_update(float* param, const float* grad, float* m, float* v, int64_t n, const AdamWParams& p) {
  const double bc1 = 1.0 - std::pow(p.beta1, static_cast<double>(p.step));
  const double bc2 = 1.0 - std::pow(p.beta2, static_cast<double>(p.step));
  const float b1 = static_cast<float>(p.beta1), b2 = static_cast<float>(p.beta2);
  const float decay = static_cast<float>(1.0 - p.lr * p.weight_decay);
  const float step_size = static_cast<float>(p.lr / bc1);
  const float inv_sqrt_bc2 = static_cast<float>(1.0 / std::sqrt(bc2));
  const float eps = static_cast<float>(p.eps), gs = static_cast<float>(p.grad_scale);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    float g = grad[i] * gs;
    param[i] *= decay;
    m[i] = b1 * m[i] + (1.0f - b1) * g;
    v[i] = b2 * v[i] + (1.0f - b2) * g * g;
    param[i] -= step_size * m[i] / (std::sqrt(v[i]) * inv_sqrt_bc2 + eps);
  }
}

void adamw_update_bf16(uint16_t* param, const float* grad, uint16_t* m, uint16_t* v, int64_t n, const AdamWParams& p,
                       int64_t index0) {
  const bf16_state::Consts k = bf16_state::consts(p);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i)
    bf16_state::update(param[i], grad[i], m[i], v[i], k, static_cast<uint64_t>(index0 + i));
}

void adamw_update_8bit(uint16_t* param, const float* grad, uint8_t* m_code, uint8_t* v_code, float* m_absmax,
                       float* v_absmax, int64_t n, const AdamWParams& p, int64_t index0) {
  namespace Q = q8_state;
  const bf16_state::Consts k = bf16_state::consts(p);
  const Q::Tables t = Q::host_tables();
  const int64_t nb = Q::num_blocks(index0, n), c0 = index0 / Q::kBlock;
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t lo = std::max(index0, (c0 + b) * Q::kBlock) - index0;
    const int64_t hi = std::min(index0 + n, (c0 + b + 1) * Q::kBlock) - index0;
    float mm[Q::kBlock], rr[Q::kBlock];
    float am = 0.0f, ar = 0.0f;
    for (int64_t i = lo; i < hi; ++i) {
      const float m_old = Q::dequantize_m(m_code[i], m_absmax[b], t);
      const float r_old = Q::dequantize_r(v_code[i], v_absmax[b], t);
      Q::update_element(param[i], grad[i], m_old, r_old, k, static_cast<uint64_t>(index0 + i), mm[i - lo], rr[i - lo]);
      am = fmaxf(am, fabsf(mm[i - lo]));
      ar = fmaxf(ar, rr[i - lo]);
    }
    am = Q::block_scale(am);
    ar = Q::block_scale(ar);
    for (int64_t i = lo; i < hi; ++i) {
      m_code[i] = Q::encode_m(Q::normalized(mm[i - lo], am), t);
      v_code[i] = Q::encode_r(Q::normalized(rr[i - lo], ar), t);
    }
    m_absmax[b] = am;
    v_absmax[b] = ar;
  }
}

void quantize_moment_8bit(int which, const float* x, int64_t n, int64_t index0, uint8_t* code, float* absmax) {
  namespace Q = q8_state;
  const Q::Tables t = Q::host_tables();
  const int64_t nb = Q::num_blocks(index0, n), c0 = index0 / Q::kBlock;
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t lo = std::max(index0, (c0 + b) * Q::kBlock) - index0;
    const int64_t hi = std::min(index0 + n, (c0 + b + 1) * Q::kBlock) - index0;
    auto value = [&](int64_t i) { return which == 0 ? x[i] : sqrtf(x[i]); };
    float a = 0.0f;
    for (int64_t i = lo; i < hi; ++i) a = fmaxf(a, fabsf(value(i)));
    a = Q::block_scale(a);
    for (int64_t i = lo; i < hi; ++i)
      code[i] = which == 0 ? Q::encode_m(Q::normalized(value(i), a), t) : Q::encode_r(Q::normalized(value(i), a), t);
    absmax[b] = a;
  }
}

void dequantize_moment_8bit(int which, const uint8_t* code, const float* absmax, int64_t n, int64_t index0, float* x) {
  namespace Q = q8_state;
  const Q::Tables t = Q::host_tables();
  const int64_t c0 = index0 / Q::kBlock;
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const float a = absmax[(index0 + i) / Q::kBlock - c0];
    if (which == 0) {
      x[i] = Q::dequantize_m(code[i], a, t);
    } else {
      const float r = Q::dequantize_r(code[i], a, t);
      x[i] = bf16_state::mul_rn(r, r);
    }
  }
}

void accumulate_grad_bf16(uint16_t* acc, const float* g, int64_t n, uint64_t key, int64_t index0) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i)
    acc[i] = bf16_state::accumulate_grad(acc[i], g[i], key, static_cast<uint64_t>(index0 + i));
}

double sum_squares(const float* grad, int64_t n) {
  // Fixed blocks of 4096 summed in order: the same result for any thread count.
  const int64_t block = 4096;
  const int64_t nb = (n + block - 1) / block;
  std::vector<double> part(static_cast<size_t>(nb), 0.0);
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < nb; ++b) {
    double s = 0;
    for (int64_t i = b * block; i < std::min(n, (b + 1) * block); ++i) s += static_cast<double>(grad[i]) * grad[i];
    part[static_cast<size_t>(b)] = s;
  }
  double total = 0;
  for (double s : part) total += s;
  return total;
}

}  // namespace ds::ops
