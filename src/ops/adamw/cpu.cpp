#include <cmath>
#include <vector>

#include "ops/adamw/adamw.h"
#include "ops/adamw/bf16_state.h"

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
