// Shared helpers for the GoogleTest suite: deterministic random tensors, relative L2 error (core/numerics.h),
// and a central finite-difference gradient check in float64.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/numerics.h"
#include "core/rng.h"

namespace ds::test {

inline std::string fixture(const std::string& rel) { return std::string(DELTASTACK_FIXTURES) + "/" + rel; }
inline std::string data_path(const std::string& rel) { return std::string(DELTASTACK_DATA) + "/" + rel; }

// The message of the ds::Error that `f` throws, or "(no error)".
inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const ds::Error& e) {
    return e.what();
  }
  return "(no error)";
}

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

// The one relative L2 error of the library and the tests (core/numerics.h).
using ::ds::rel_l2;

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

// Sets an environment variable for a scope and restores its earlier value (or its absence) when the scope ends,
// also when a run inside throws.
struct EnvSet {
  std::string name;
  std::optional<std::string> old;
  EnvSet(const char* n, const char* value) : name(n) {
    if (const char* v = std::getenv(n)) old = v;
    setenv(n, value, 1);
  }
  ~EnvSet() {
    if (old) setenv(name.c_str(), old->c_str(), 1);
    else unsetenv(name.c_str());
  }
  EnvSet(const EnvSet&) = delete;
  EnvSet& operator=(const EnvSet&) = delete;
};

}  // namespace ds::test
