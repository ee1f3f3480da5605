// Device-side random fills for probes and benchmarks (never for training math): a counter hash of
// (seed, index), so fills are reproducible and independent of launch shape.
#pragma once
#include <cuda_runtime.h>

#include "core/cuda/cuda_utils.h"

namespace ds::ops::cuda {

// x[i] = lo + (hi - lo) * u(seed, i), u uniform in [0, 1).
void fill_uniform(ds::cuda::bf16* x, int64_t n, uint64_t seed, float lo, float hi, cudaStream_t stream);
void fill_uniform(float* x, int64_t n, uint64_t seed, float lo, float hi, cudaStream_t stream);
// x[i] = uniform integer in [0, n_values).
void fill_uniform_int(int32_t* x, int64_t n, uint64_t seed, int32_t n_values, cudaStream_t stream);

}  // namespace ds::ops::cuda
