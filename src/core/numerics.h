// Error metrics shared by the library (the CUDA op checks in src/ops/*/cuda_check.cpp, the CPU chunked-GDN
// probe in src/ops/gated_delta_rule/dispatch.cpp) and the tests: one definition of "relative L2 error".
#pragma once
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/bf16.h"

namespace ds {

// A read-only view of bf16 values stored as raw bits (what a device download of a bf16 buffer gives), read as
// fp32: rel_l2(bf16_view(bits), ref).
struct Bf16View {
  const uint16_t* bits = nullptr;
  size_t n = 0;
  size_t size() const { return n; }
  float operator[](size_t i) const { return bf16_bits_to_f32(bits[i]); }
};
inline Bf16View bf16_view(const std::vector<uint16_t>& bits) { return {bits.data(), bits.size()}; }

// The first index of x [n] that is not finite (or, with `nonnegative`, below 0), or -1; on all cores past 1 Mi
// elements, the same answer for any thread count (the checks of checkpoint tensors as they are read).
inline int64_t first_non_finite(const float* x, int64_t n, bool nonnegative = false) {
  int64_t first = n;
#pragma omp parallel for schedule(static) reduction(min : first) if (n >= (int64_t{1} << 20))
  for (int64_t i = 0; i < n; ++i)
    if (!std::isfinite(x[i]) || (nonnegative && x[i] < 0.0f)) first = std::min(first, i);
  return first < n ? first : -1;
}

// ||got - ref|| / max(||ref||, 1e-300), accumulated in double, over any two indexable ranges of numbers
// (std::vector<float>, std::vector<double>, Bf16View, ...). 0 when they are equal (also both zero);
// +infinity when the sizes differ or either side holds a NaN or an infinity (a NaN-poisoned output element that
// a kernel never wrote, an overflow).
template <typename A, typename B>
double rel_l2(const A& got, const B& ref) {
  if (got.size() != ref.size()) return INFINITY;
  double num = 0, den = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double x = static_cast<double>(got[i]), y = static_cast<double>(ref[i]);
    if (!std::isfinite(x) || !std::isfinite(y)) return INFINITY;
    num += (x - y) * (x - y);
    den += y * y;
  }
  if (num == 0) return 0;
  return std::sqrt(num) / std::max(std::sqrt(den), 1e-300);
}

// |got - ref| / max(|ref|, 1e-300) for one scalar (a loss sum); 0 when equal, +infinity when either is not finite.
inline double rel_scalar(double got, double ref) {
  if (!std::isfinite(got) || !std::isfinite(ref)) return INFINITY;
  if (got == ref) return 0;
  return std::fabs(got - ref) / std::max(std::fabs(ref), 1e-300);
}

}  // namespace ds
