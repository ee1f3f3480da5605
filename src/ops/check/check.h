// The numeric checks of the CUDA ops against their fp32 CPU references, shared by the op registry's start-up
// self-probes (src/ops/registry.cpp) and the GoogleTest CUDA suite (tests/test_cuda_*.cpp).
//
// Every op folder with CUDA kernels has src/ops/<op>/cuda_check.{h,cpp}: a case struct (shape, layout, a fixed
// seed), one function check_<op>(case) -> Result, and <op>_probe_cases(), the fixed cases the registry probes at
// start-up. A check draws its inputs from the case's seed (same case, same inputs, on every machine), rounds the
// bf16 ones to bf16 so the CPU reference sees what the device sees, poisons every device output with NaN
// (0xFF bytes) so an element a kernel never writes fails, starts accumulated (+=) outputs from random values that
// are subtracted again (an overwrite fails), runs the CUDA launchers on a stream of its own, and reports one
// Value per output: its relative L2 error (core/numerics.h) and the band it must stay within. Exact properties
// (bitwise equal runs, nothing written outside a strided view, exact conversions) are Values of error 0 or
// +infinity with band 0.
//
// The registry's probe of an op is probe(op, <op>_probe_cases(), check_<op>): the largest error over all values
// of all cases, compared with the op's band in the registry. The tests run the same check functions (the probe
// cases themselves and larger shapes) and assert every value against its own band.
//
// Plain C++ (no CUDA types): the declarations are usable everywhere; the definitions exist only in a build with
// DELTASTACK_CUDA (the .cpp files compile to nothing otherwise). A check throws ds::Error when a launcher refuses
// its arguments or a CUDA call fails.
#pragma once
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace ds::ops::check {

// Bands of relative L2 error (docs/cuda_backend.md "Tests"): forward outputs, gradients, and the gated delta
// rule's gate gradients dg / dbeta.
constexpr double kForward = 5e-3;
constexpr double kGradient = 1e-2;
constexpr double kGateGradient = 2e-2;

struct Value {
  std::string name;  // "y", "dw (accumulated)", "two runs bitwise equal", ...
  double error = 0;  // relative L2 error, or 0 / +infinity for an exact property
  double band = 0;   // the largest accepted error
};

struct Result {
  std::string what;  // the op and case, e.g. "rmsnorm [64x256] zero-centered"
  std::vector<Value> values;
  double cpu_seconds = 0;  // time spent in the CPU reference

  void add(std::string name, double error, double band);
  void exact(std::string name, bool holds) { add(std::move(name), holds ? 0.0 : INFINITY, 0.0); }
  double worst() const;     // largest error (0 without values); +infinity if any error is NaN
  bool ok() const;          // every error within its band
  std::string str() const;  // "what: y 1.2e-03, dx 3.4e-03, ..."
};

// A registry probe: runs check(cases[i]) for every case and returns the worst error over them; +infinity when no
// CUDA device is present or a check throws (the message is logged as a warning). Each value is logged at debug
// level (DELTASTACK_LOG=debug). Deterministic: the cases carry fixed seeds.
double probe_cases(const char* op, size_t count, const std::function<Result(size_t)>& check);

template <typename Case>
double probe(const char* op, const std::vector<Case>& cases, Result (*check)(const Case&)) {
  return probe_cases(op, cases.size(), [&](size_t i) { return check(cases[i]); });
}

}  // namespace ds::ops::check
