#include <cmath>

#include "ops/gated_rmsnorm/gated_rmsnorm.h"

namespace ds::ops {

template <typename T>
static inline T sigmoid(T x) {
  return T(1) / (T(1) + std::exp(-x));
}

template <typename T>
void gated_rmsnorm_forward(const T* x, const T* z, const T* w, T* y, T* rstd, int64_t rows, int64_t d, double eps) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * d;
    const T* zr = z + r * d;
    double ss = 0;
    for (int64_t j = 0; j < d; ++j) ss += static_cast<double>(xr[j]) * xr[j];
    T rs = static_cast<T>(1.0 / std::sqrt(ss / d + eps));
    rstd[r] = rs;
    for (int64_t j = 0; j < d; ++j) y[r * d + j] = xr[j] * rs * w[j] * (zr[j] * sigmoid(zr[j]));
  }
}

template <typename T>
void gated_rmsnorm_backward(const T* x, const T* z, const T* w, const T* rstd, const T* dy, T* dx, T* dz, T* dw,
                            int64_t rows, int64_t d) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * d;
    const T* zr = z + r * d;
    const T* dyr = dy + r * d;
    T rs = rstd[r];
    double dot = 0;
    for (int64_t j = 0; j < d; ++j) {
      T s = sigmoid(zr[j]);
      T xh = xr[j] * rs;
      T dxh = dyr[j] * (zr[j] * s) * w[j];
      dot += static_cast<double>(dxh) * xh;
      dz[r * d + j] = dyr[j] * xh * w[j] * s * (T(1) + zr[j] * (T(1) - s));
    }
    T mean_dot = static_cast<T>(dot / d);
    for (int64_t j = 0; j < d; ++j) {
      T s = sigmoid(zr[j]);
      T dxh = dyr[j] * (zr[j] * s) * w[j];
      dx[r * d + j] = rs * (dxh - xr[j] * rs * mean_dot);
    }
  }
#pragma omp parallel for schedule(static)
  for (int64_t j = 0; j < d; ++j) {
    double acc = 0;
    for (int64_t r = 0; r < rows; ++r) {
      T zv = z[r * d + j];
      acc += static_cast<double>(dy[r * d + j]) * (zv * sigmoid(zv)) * (x[r * d + j] * rstd[r]);
    }
    dw[j] += static_cast<T>(acc);
  }
}

template void gated_rmsnorm_forward<float>(const float*, const float*, const float*, float*, float*, int64_t, int64_t,
                                           double);
template void gated_rmsnorm_forward<double>(const double*, const double*, const double*, double*, double*, int64_t,
                                            int64_t, double);
template void gated_rmsnorm_backward<float>(const float*, const float*, const float*, const float*, const float*,
                                            float*, float*, float*, int64_t, int64_t);
template void gated_rmsnorm_backward<double>(const double*, const double*, const double*, const double*,
                                             const double*, double*, double*, double*, int64_t, int64_t);

}  // namespace ds::ops
