// CUDA Gated DeltaNet gates over the fused projection output ab [N, 2Hv] (b at [n*2Hv + h], a at
// [n*2Hv + Hv + h]); math of gdn_gate.h / cpu.cpp:
//   x = a + dt_bias,  sp = x > 20 ? x : log1p(exp(x)),  g = -exp(A_log) * sp,  beta = sigmoid(b);
//   da = dg * (-exp(A_log) * (x > 20 ? 1 : sigmoid(x))),  db = dbeta * beta (1 - beta),
//   dA_log += sum_n dg * g,  ddt_bias += sum_n da.
// Forward: one thread per (token, head). Backward: blocks of 32 heads x 8 token lanes over fixed token slots
// (a function of N only); each slot reduces its 8 lanes in a fixed order and writes partial rows
// [slot, 2Hv] = (dA_log part | ddt_bias part); a second kernel sums the slots in a fixed order and ADDS into
// dA_log / ddt_bias. Deterministic, no atomics. fp32 math throughout (accurate expf/log1pf).
#include <cstdint>

#include "core/cuda/kernel_utils.cuh"
#include "ops/gdn_gate/cuda.h"

namespace ds::ops::cuda {
namespace {

using namespace ds::cuda;

constexpr float kSoftplusThreshold = 20.0f;
constexpr int64_t kMaxSlots = 256;
constexpr int64_t kMinTokensPerSlot = 64;

Slots slots_for(int64_t n) { return make_slots(n, kMaxSlots, kMinTokensPerSlot); }

__device__ __forceinline__ float sigmoid_stable(float x) {
  if (x >= 0.f) return 1.0f / (1.0f + expf(-x));
  const float e = expf(x);
  return e / (1.0f + e);
}
__device__ __forceinline__ float softplus_t(float x) { return x > kSoftplusThreshold ? x : log1pf(expf(x)); }

__global__ void gdn_gate_fwd_kernel(const bf16* __restrict__ ab, const float* __restrict__ A_log,
                                    const float* __restrict__ dt_bias, float* __restrict__ g, float* __restrict__ beta,
                                    int64_t total, int64_t Hv) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t n = i / Hv, h = i - n * Hv;
    const float b = __bfloat162float(ab[n * 2 * Hv + h]);
    const float a = __bfloat162float(ab[n * 2 * Hv + Hv + h]);
    g[i] = -expf(A_log[h]) * softplus_t(a + dt_bias[h]);
    beta[i] = sigmoid_stable(b);
  }
}

// grid.x = slots; block (32, 8): threadIdx.x = head within a 32-head chunk, threadIdx.y = token lane.
__global__ void __launch_bounds__(256)
    gdn_gate_bwd_kernel(const bf16* __restrict__ ab, const float* __restrict__ A_log, const float* __restrict__ dt_bias,
                        const float* __restrict__ dg, const float* __restrict__ dbeta, bf16* __restrict__ dab,
                        float* __restrict__ partial, int64_t N, int64_t Hv, int64_t per) {
  __shared__ float sA[8][33], sdt[8][33];
  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * per;
  const int64_t n1 = n0 + per < N ? n0 + per : N;
  const int tx = threadIdx.x, ty = threadIdx.y;
  for (int64_t h0 = 0; h0 < Hv; h0 += 32) {
    const int64_t h = h0 + tx;
    float accA = 0.f, accdt = 0.f;
    if (h < Hv) {
      const float ea = expf(A_log[h]), dtb = dt_bias[h];
      for (int64_t n = n0 + ty; n < n1; n += 8) {
        const int64_t i = n * Hv + h;
        const float b = __bfloat162float(ab[n * 2 * Hv + h]);
        const float x = __bfloat162float(ab[n * 2 * Hv + Hv + h]) + dtb;
        const float gv = -ea * softplus_t(x);
        const float dsp = x > kSoftplusThreshold ? 1.0f : sigmoid_stable(x);
        const float dgi = dg[i];
        const float da = dgi * (-ea * dsp);
        const float bt = sigmoid_stable(b);
        dab[n * 2 * Hv + h] = __float2bfloat16_rn(dbeta[i] * bt * (1.0f - bt));
        dab[n * 2 * Hv + Hv + h] = __float2bfloat16_rn(da);
        accA += dgi * gv;
        accdt += da;
      }
    }
    sA[ty][tx] = accA;
    sdt[ty][tx] = accdt;
    __syncthreads();
    if (ty == 0 && h < Hv) {
      float a = 0.f, d = 0.f;
#pragma unroll
      for (int q = 0; q < 8; ++q) a += sA[q][tx], d += sdt[q][tx];
      partial[static_cast<int64_t>(blockIdx.x) * 2 * Hv + h] = a;
      partial[static_cast<int64_t>(blockIdx.x) * 2 * Hv + Hv + h] = d;
    }
    __syncthreads();
  }
}

void check_shape(const char* fn, int64_t N, int64_t Hv) {
  DS_CUDA_REQUIRE(N >= 0 && Hv > 0, std::string(fn) + ": N must be >= 0 and Hv > 0, got N=" + std::to_string(N) +
                                        " Hv=" + std::to_string(Hv));
}

}  // namespace

void gdn_gate_forward(const ds::cuda::bf16* ab, const float* A_log, const float* dt_bias, float* g, float* beta,
                      int64_t N, int64_t Hv, cudaStream_t stream) {
  check_shape("gdn_gate_forward", N, Hv);
  if (N == 0) return;
  DS_CUDA_REQUIRE(ab && A_log && dt_bias && g && beta, "gdn_gate_forward: null pointer argument");
  const int64_t total = N * Hv;
  int64_t blocks = (total + 255) / 256;
  if (blocks > 65535) blocks = 65535;
  gdn_gate_fwd_kernel<<<static_cast<unsigned>(blocks), 256, 0, stream>>>(ab, A_log, dt_bias, g, beta, total, Hv);
  DS_CUDA_LAUNCH_CHECK();
}

size_t gdn_gate_scratch_bytes(int64_t N, int64_t Hv) {
  if (N <= 0 || Hv <= 0) return 0;
  return static_cast<size_t>(slots_for(N).count) * 2 * static_cast<size_t>(Hv) * sizeof(float);
}

void gdn_gate_backward(const ds::cuda::bf16* ab, const float* A_log, const float* dt_bias, const float* dg,
                       const float* dbeta, ds::cuda::bf16* dab, float* dA_log, float* ddt_bias, int64_t N, int64_t Hv,
                       void* scratch, cudaStream_t stream) {
  check_shape("gdn_gate_backward", N, Hv);
  if (N == 0) return;
  DS_CUDA_REQUIRE(ab && A_log && dt_bias && dg && dbeta && dab && dA_log && ddt_bias,
                  "gdn_gate_backward: null pointer argument");
  DS_CUDA_REQUIRE(scratch != nullptr, "gdn_gate_backward: scratch is null (need gdn_gate_scratch_bytes)");
  const Slots s = slots_for(N);
  float* partial = static_cast<float*>(scratch);
  gdn_gate_bwd_kernel<<<static_cast<unsigned>(s.count), dim3(32, 8), 0, stream>>>(ab, A_log, dt_bias, dg, dbeta, dab,
                                                                                  partial, N, Hv, s.per);
  DS_CUDA_LAUNCH_CHECK();
  launch_sum_partials(partial, s.count, 2 * Hv, Hv, dA_log, stream);
  DS_CUDA_LAUNCH_CHECK();
  launch_sum_partials(partial + Hv, s.count, 2 * Hv, Hv, ddt_bias, stream);
  DS_CUDA_LAUNCH_CHECK();
}

}  // namespace ds::ops::cuda
