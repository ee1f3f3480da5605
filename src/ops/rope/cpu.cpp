// CPU reference for partial, half-split RoPE (docs/model.md §2.2, backward §4).
// Tables follow HF Qwen3_5TextRotaryEmbedding for T = float:
//   inv_freq[i] = 1.0f / powf(theta_f, float(2i) / float(rotary_dim))     (fp32 division, pow, reciprocal)
//   angle       = inv_freq[i] * float(pos)                               (one fp32 product)
//   cos, sin    = cos(angle), sin(angle) rounded to fp32
// For T = double every step is in double. Rotation of pair (x1 = x[i], x2 = x[i + rotary_dim/2]):
//   forward: x1' = x1 c - x2 s,  x2' = x2 c + x1 s
//   inverse (= transpose = backward): x1' = x1 c + x2 s,  x2' = x2 c - x1 s
#include <cmath>
#include <type_traits>
#include <vector>

#include "core/error.h"
#include "ops/rope/rope.h"

namespace ds::ops {

template <typename T>
void rope_tables(const int32_t* positions, int64_t N, int64_t rotary_dim, double theta, T* cos_t, T* sin_t) {
  DS_CHECK(rotary_dim > 0 && rotary_dim % 2 == 0, "rope: rotary_dim ({}) must be positive and even", rotary_dim);
  DS_CHECK(theta > 0, "rope: theta ({}) must be positive", theta);
  DS_CHECK(N >= 0, "rope: N ({}) must be >= 0", N);
  const int64_t half = rotary_dim / 2;
  std::vector<T> inv(static_cast<size_t>(half));
  for (int64_t i = 0; i < half; ++i) {
    if constexpr (std::is_same_v<T, float>) {
      const float expo = static_cast<float>(2 * i) / static_cast<float>(rotary_dim);
      inv[i] = 1.0f / std::pow(static_cast<float>(theta), expo);
    } else {
      inv[i] = static_cast<T>(1.0 / std::pow(theta, static_cast<double>(2 * i) / static_cast<double>(rotary_dim)));
    }
  }
#pragma omp parallel for schedule(static) if (N * half > 32768)
  for (int64_t n = 0; n < N; ++n) {
    const T pos = static_cast<T>(positions[n]);
    for (int64_t i = 0; i < half; ++i) {
      const T angle = inv[i] * pos;  // rounded to T (fp32 for float, as HF)
      // cos/sin of the rounded angle, evaluated in double then rounded to T (within 1 ulp of torch's fp32 cos).
      cos_t[n * half + i] = static_cast<T>(std::cos(static_cast<double>(angle)));
      sin_t[n * half + i] = static_cast<T>(std::sin(static_cast<double>(angle)));
    }
  }
}

template <typename T>
void rope_apply(T* x, int64_t N, int64_t H, int64_t head_dim, int64_t rotary_dim, const T* cos_t, const T* sin_t,
                bool inverse) {
  DS_CHECK(rotary_dim > 0 && rotary_dim % 2 == 0 && rotary_dim <= head_dim,
           "rope: rotary_dim ({}) must be positive, even and <= head_dim ({})", rotary_dim, head_dim);
  const int64_t half = rotary_dim / 2;
  const T sgn = inverse ? T(-1) : T(1);
#pragma omp parallel for schedule(static) if (N * H * half > 32768)
  for (int64_t n = 0; n < N; ++n) {
    const T* c = cos_t + n * half;
    const T* s0 = sin_t + n * half;
    for (int64_t h = 0; h < H; ++h) {
      T* xv = x + (n * H + h) * head_dim;
      for (int64_t i = 0; i < half; ++i) {
        const T x1 = xv[i], x2 = xv[i + half], s = sgn * s0[i];
        xv[i] = x1 * c[i] - x2 * s;
        xv[i + half] = x2 * c[i] + x1 * s;
      }
    }
  }
}

template void rope_tables<float>(const int32_t*, int64_t, int64_t, double, float*, float*);
template void rope_tables<double>(const int32_t*, int64_t, int64_t, double, double*, double*);
template void rope_apply<float>(float*, int64_t, int64_t, int64_t, int64_t, const float*, const float*, bool);
template void rope_apply<double>(double*, int64_t, int64_t, int64_t, int64_t, const double*, const double*, bool);

}  // namespace ds::ops
