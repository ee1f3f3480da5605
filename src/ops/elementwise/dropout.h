// Dropout masks drawn on the device exactly as the host draws them (core/rng.h dropout_drops: element e of the
// stream with key `key` is dropped with probability p), for the GPU engine's LoRA dropout (model/gpu_lora.h), whose
// masks are then the CPU engine's (model/lora.h LoraAdapter::dropout_mask). The 0/1 mask only: the 1 / (1 - p)
// scale of kept values is the caller's (a GEMM's alpha), so the masked bf16 values are exact.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "core/cuda/cuda_utils.h"

namespace ds::ops::cuda {

// y[e] = dropped(e) ? 0 : x[e] for e in [0, n) (bf16 [n]; y may alias x).
void dropout_select(const ds::cuda::bf16* x, ds::cuda::bf16* y, int64_t n, uint64_t key, double p,
                    cudaStream_t stream);
// dx[e] += dropped(e) ? 0 : d[e] (bf16 [n], the sum in fp32, one rounding).
void dropout_select_add(const ds::cuda::bf16* d, ds::cuda::bf16* dx, int64_t n, uint64_t key, double p,
                        cudaStream_t stream);

}  // namespace ds::ops::cuda
