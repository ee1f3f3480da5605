#include <cmath>
#include <vector>

#include "ops/rmsnorm/rmsnorm.h"

namespace ds::ops {

// Accumulator type: statistics of fp32 data are summed in double so the fp32 reference stays close to
// float64; a double op accumulates in double.
template <typename T>
void rmsnorm_forward(const T* x, const T* w, T* y, T* rstd, int64_t rows, int64_t dim, double eps,
                     bool zero_centered) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * dim;
    double ss = 0;
    for (int64_t j = 0; j < dim; ++j) ss += static_cast<double>(xr[j]) * xr[j];
    T rs = static_cast<T>(1.0 / std::sqrt(ss / dim + eps));
    rstd[r] = rs;
    T* yr = y + r * dim;
    for (int64_t j = 0; j < dim; ++j) {
      T gamma = zero_centered ? T(1) + w[j] : w[j];
      yr[j] = xr[j] * rs * gamma;
    }
  }
}

template <typename T>
void rmsnorm_backward(const T* x, const T* w, const T* rstd, const T* dy, T* dx, T* dw, int64_t rows, int64_t dim,
                      bool zero_centered) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * dim;
    const T* dyr = dy + r * dim;
    T rs = rstd[r];
    double dot = 0;  // sum_j dxh_j * xh_j
    for (int64_t j = 0; j < dim; ++j) {
      T gamma = zero_centered ? T(1) + w[j] : w[j];
      dot += static_cast<double>(dyr[j] * gamma) * (xr[j] * rs);
    }
    T mean_dot = static_cast<T>(dot / dim);
    T* dxr = dx + r * dim;
    for (int64_t j = 0; j < dim; ++j) {
      T gamma = zero_centered ? T(1) + w[j] : w[j];
      dxr[j] = rs * (dyr[j] * gamma - xr[j] * rs * mean_dot);
    }
  }
  // dw: parallel over columns, rows summed in order (thread-count independent).
#pragma omp parallel for schedule(static)
  for (int64_t j = 0; j < dim; ++j) {
    double acc = 0;
    for (int64_t r = 0; r < rows; ++r) acc += static_cast<double>(dy[r * dim + j]) * (x[r * dim + j] * rstd[r]);
    dw[j] += static_cast<T>(acc);
  }
}

template void rmsnorm_forward<float>(const float*, const float*, float*, float*, int64_t, int64_t, double, bool);
template void rmsnorm_forward<double>(const double*, const double*, double*, double*, int64_t, int64_t, double, bool);
template void rmsnorm_backward<float>(const float*, const float*, const float*, const float*, float*, float*, int64_t,
                                      int64_t, bool);
template void rmsnorm_backward<double>(const double*, const double*, const double*, const double*, double*, double*,
                                       int64_t, int64_t, bool);

}  // namespace ds::ops
