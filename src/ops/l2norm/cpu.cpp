// CPU reference of l2norm (see l2norm.h): y = x·ρ, ρ = (Σx² + eps)^-½ per row (FLA l2norm_fwd / HF l2norm),
// backward dx = ρ·(dy − y·(dy·y)) (docs/model.md §4). Row sums are accumulated in double in a fixed order;
// rows run in parallel, so results do not depend on the thread count.
#include "ops/l2norm/l2norm.h"

#include <cmath>

#include "core/error.h"

namespace ds::ops {

template <typename T>
void l2norm_forward(const T* x, T* y, T* rnorm, int64_t rows, int64_t dim, double eps) {
  DS_CHECK(rows >= 0 && dim > 0, "l2norm: rows ({}) must be >= 0 and dim ({}) > 0", rows, dim);
  DS_CHECK(eps >= 0, "l2norm: eps ({}) must be >= 0", eps);
  DS_CHECK(rows == 0 || (x && y), "l2norm: null x or y");
#pragma omp parallel for schedule(static) if (rows * dim >= (int64_t(1) << 15))
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * dim;
    T* yr = y + r * dim;
    double s = 0;
    for (int64_t i = 0; i < dim; ++i) s += static_cast<double>(xr[i]) * static_cast<double>(xr[i]);
    const T rn = static_cast<T>(1.0 / std::sqrt(s + eps));
    if (rnorm) rnorm[r] = rn;
    for (int64_t i = 0; i < dim; ++i) yr[i] = xr[i] * rn;
  }
}

template <typename T>
void l2norm_backward(const T* y, const T* rnorm, const T* dy, T* dx, int64_t rows, int64_t dim) {
  DS_CHECK(rows >= 0 && dim > 0, "l2norm: rows ({}) must be >= 0 and dim ({}) > 0", rows, dim);
  DS_CHECK(rows == 0 || (y && rnorm && dy && dx), "l2norm: null argument to backward");
#pragma omp parallel for schedule(static) if (rows * dim >= (int64_t(1) << 15))
  for (int64_t r = 0; r < rows; ++r) {
    const T* yr = y + r * dim;
    const T* dyr = dy + r * dim;
    T* dxr = dx + r * dim;
    double s = 0;
    for (int64_t i = 0; i < dim; ++i) s += static_cast<double>(dyr[i]) * static_cast<double>(yr[i]);
    const T dot = static_cast<T>(s), rn = rnorm[r];
    for (int64_t i = 0; i < dim; ++i) dxr[i] = rn * (dyr[i] - yr[i] * dot);
  }
}

template void l2norm_forward<float>(const float*, float*, float*, int64_t, int64_t, double);
template void l2norm_forward<double>(const double*, double*, double*, int64_t, int64_t, double);
template void l2norm_backward<float>(const float*, const float*, const float*, float*, int64_t, int64_t);
template void l2norm_backward<double>(const double*, const double*, const double*, double*, int64_t, int64_t);

}  // namespace ds::ops
