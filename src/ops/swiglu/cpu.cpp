#include <cmath>

#include "ops/swiglu/swiglu.h"

namespace ds::ops {

template <typename T>
void swiglu_forward(const T* gate, const T* up, T* h, int64_t n) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    T s = T(1) / (T(1) + std::exp(-gate[i]));
    h[i] = gate[i] * s * up[i];
  }
}

template <typename T>
void swiglu_backward(const T* gate, const T* up, const T* dh, T* dgate, T* dup, int64_t n) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    T g = gate[i];
    T s = T(1) / (T(1) + std::exp(-g));
    dgate[i] = dh[i] * up[i] * s * (T(1) + g * (T(1) - s));
    dup[i] = dh[i] * g * s;
  }
}

template void swiglu_forward<float>(const float*, const float*, float*, int64_t);
template void swiglu_forward<double>(const double*, const double*, double*, int64_t);
template void swiglu_backward<float>(const float*, const float*, const float*, float*, float*, int64_t);
template void swiglu_backward<double>(const double*, const double*, const double*, double*, double*, int64_t);

}  // namespace ds::ops
