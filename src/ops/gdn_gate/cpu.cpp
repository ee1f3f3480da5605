// CPU reference of the Gated DeltaNet gates (see gdn_gate.h; HF Qwen3_5GatedDeltaNet.forward):
//   x = a + dt_bias,  sp = softplus(x) = log1p(exp(x)) for x <= 20, x above (PyTorch's threshold 20),
//   g = -exp(A_log)·sp,  beta = sigmoid(b).
// Backward (docs/model.md §4): ∂g/∂x = -exp(A_log)·sp'(x) with sp'(x) = sigmoid(x) for x <= 20 and 1 above
// (PyTorch's softplus_backward, the exact derivative of the thresholded forward), ∂g/∂A_log = g,
// ∂beta/∂b = beta(1-beta). Per-head parameter gradients are summed over tokens in ascending order (in double)
// within one thread per head, so they do not depend on the thread count.
#include "ops/gdn_gate/gdn_gate.h"

#include <cmath>

#include "core/error.h"

namespace ds::ops {
namespace {

constexpr double kSoftplusThreshold = 20.0;

template <typename T>
inline T sigmoid(T x) {
  if (x >= T(0)) return T(1) / (T(1) + std::exp(-x));
  const T e = std::exp(x);
  return e / (T(1) + e);
}

template <typename T>
inline T softplus(T x) {
  return x > T(kSoftplusThreshold) ? x : std::log1p(std::exp(x));
}

}  // namespace

template <typename T>
void gdn_gate_forward(const T* a, const T* b, const T* A_log, const T* dt_bias, T* g, T* beta, int64_t N,
                      int64_t Hv) {
  DS_CHECK(N >= 0 && Hv > 0, "gdn_gate: N ({}) must be >= 0 and Hv ({}) > 0", N, Hv);
  DS_CHECK(N == 0 || (a && b && A_log && dt_bias && g && beta), "gdn_gate: null argument to forward");
#pragma omp parallel for schedule(static) if (N * Hv >= (int64_t(1) << 14))
  for (int64_t n = 0; n < N; ++n)
    for (int64_t h = 0; h < Hv; ++h) {
      const int64_t i = n * Hv + h;
      g[i] = -std::exp(A_log[h]) * softplus(a[i] + dt_bias[h]);
      beta[i] = sigmoid(b[i]);
    }
}

template <typename T>
void gdn_gate_backward(const T* a, const T* b, const T* A_log, const T* dt_bias, const T* dg, const T* dbeta,
                       T* da, T* db, T* dA_log, T* ddt_bias, int64_t N, int64_t Hv) {
  DS_CHECK(N >= 0 && Hv > 0, "gdn_gate: N ({}) must be >= 0 and Hv ({}) > 0", N, Hv);
  DS_CHECK(N == 0 || (a && b && A_log && dt_bias && dg && dbeta), "gdn_gate: null argument to backward");
#pragma omp parallel for schedule(static) if (N * Hv >= (int64_t(1) << 14))
  for (int64_t h = 0; h < Hv; ++h) {
    const T ea = std::exp(A_log[h]);
    double sA = 0, sdt = 0;
    for (int64_t n = 0; n < N; ++n) {
      const int64_t i = n * Hv + h;
      const T x = a[i] + dt_bias[h];
      const T g = -ea * softplus(x);
      const T dsp = x > T(kSoftplusThreshold) ? T(1) : sigmoid(x);
      const T dai = dg[i] * (-ea * dsp);
      if (da) da[i] = dai;
      if (db) {
        const T bt = sigmoid(b[i]);
        db[i] = dbeta[i] * bt * (T(1) - bt);
      }
      sA += static_cast<double>(dg[i]) * static_cast<double>(g);
      sdt += static_cast<double>(dai);
    }
    if (dA_log) dA_log[h] += static_cast<T>(sA);
    if (ddt_bias) ddt_bias[h] += static_cast<T>(sdt);
  }
}

template void gdn_gate_forward<float>(const float*, const float*, const float*, const float*, float*, float*,
                                      int64_t, int64_t);
template void gdn_gate_forward<double>(const double*, const double*, const double*, const double*, double*,
                                       double*, int64_t, int64_t);
template void gdn_gate_backward<float>(const float*, const float*, const float*, const float*, const float*,
                                       const float*, float*, float*, float*, float*, int64_t, int64_t);
template void gdn_gate_backward<double>(const double*, const double*, const double*, const double*,
                                        const double*, const double*, double*, double*, double*, double*,
                                        int64_t, int64_t);

}  // namespace ds::ops
