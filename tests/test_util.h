// Shared helpers for the GoogleTest suite: deterministic random tensors, relative L2 error, and a central
// finite-difference gradient check in float64.
#pragma once
#include <cmath>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/rng.h"

namespace ds::test {

inline std::string fixture(const std::string& rel) { return std::string(DELTASTACK_FIXTURES) + "/" + rel; }
inline std::string data_path(const std::string& rel) { return std::string(DELTASTACK_DATA) + "/" + rel; }

template <typename T>
std::vector<T> randn(size_t n, uint64_t seed, double stddev = 1.0, double mean = 0.0) {
  Rng r(seed);
  std::vector<T> v(n);
  for (auto& x : v) x = static_cast<T>(mean + stddev * r.normal());
  return v;
}

template <typename T>
std::vector<T> randu(size_t n, uint64_t seed, double lo, double hi) {
  Rng r(seed);
  std::vector<T> v(n);
  for (auto& x : v) x = static_cast<T>(lo + (hi - lo) * r.uniform());
  return v;
}

// ||a - b|| / max(||b||, tiny). Returns +inf if sizes differ or any value is non-finite.
template <typename A, typename B>
double rel_l2(const A& a, const B& b) {
  if (a.size() != b.size()) return INFINITY;
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    double x = static_cast<double>(a[i]), y = static_cast<double>(b[i]);
    if (!std::isfinite(x) || !std::isfinite(y)) return INFINITY;
    num += (x - y) * (x - y);
    den += y * y;
  }
  return std::sqrt(num) / std::max(std::sqrt(den), 1e-300);
}

// Central differences of a scalar function f over every entry of x (float64), step h.
inline std::vector<double> numeric_grad(std::vector<double>& x, const std::function<double()>& f, double h = 1e-6) {
  std::vector<double> g(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    double keep = x[i];
    x[i] = keep + h;
    double fp = f();
    x[i] = keep - h;
    double fm = f();
    x[i] = keep;
    g[i] = (fp - fm) / (2 * h);
  }
  return g;
}

// sum(a * b): the scalar loss used by gradient checks (L = <out, w> for a fixed random w).
inline double dot(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

}  // namespace ds::test
