// CUDA helpers shared by every CUDA backend: error checks that throw ds::Error (never abort), the bf16 type,
// launch-size helpers. .cu files include this instead of core/error.h: nvcc's C++20 front end rejects fmt's
// consteval format strings, so messages here are built with std::string.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <string>

namespace ds::cuda {

using bf16 = __nv_bfloat16;

// Throws ds::Error(msg). Defined in core/core.cpp.
[[noreturn]] void throw_error(const std::string& msg);

inline void check(cudaError_t e, const char* expr, const char* file, int line) {
  if (e != cudaSuccess)
    throw_error(std::string("CUDA error ") + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ") in " + expr +
                " at " + file + ":" + std::to_string(line));
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Testing knob: true makes the kernels that take their sigmoids by sigmoid_fast_v (core/cuda/kernel_utils.cuh:
// conv1d + SiLU, SwiGLU) use one IEEE division per value instead; the outputs are bitwise the same either way (the
// CudaOps *SigmoidForms* tests and bench ops compare the two). At start: DELTASTACK_DIVISION_SIGMOID=1 sets it, for
// A/Bs of whole steps. One flag per process (host code; set it between launches).
inline bool& division_sigmoid() {
  static bool on = [] {
    const char* v = std::getenv("DELTASTACK_DIVISION_SIGMOID");
    return v != nullptr && std::string(v) == "1";
  }();
  return on;
}

}  // namespace ds::cuda

// DS_CUDA_CHECK(cudaMemcpy(...)): throws ds::Error naming the call, file and line on failure.
#define DS_CUDA_CHECK(expr) ::ds::cuda::check((expr), #expr, __FILE__, __LINE__)
// After a kernel launch: reports launch-configuration errors at once.
#define DS_CUDA_LAUNCH_CHECK() ::ds::cuda::check(cudaGetLastError(), "kernel launch", __FILE__, __LINE__)
// Argument checks in launchers: DS_CUDA_REQUIRE(n > 0, "rmsnorm: rows must be positive").
#define DS_CUDA_REQUIRE(cond, msg)                \
  do {                                            \
    if (!(cond)) ::ds::cuda::throw_error(msg);    \
  } while (0)
