// CUDA AdamW over the flat fp32 master buffer (torch.optim.AdamW semantics, as adamw.h), writing the bf16
// compute copy of the weights in the same pass, and a deterministic global sum of squares for clipping.
#pragma once
#include <cuda_runtime.h>

#include <cstdlib>
#include <string>

#include "core/cuda/cuda_utils.h"
#include "ops/adamw/adamw.h"
#include "ops/adamw/q8_state.h"

namespace ds::ops::cuda {

// Testing knob: true makes the 8-bit update (adamw_update_8bit) find its codes by q8_state.h's binary search
// (count_below, as the CPU reference) instead of the bucketed count (count_below_bucketed, the default); the same
// codes either way (AdamW8bitState.BucketedCountIsTheBinarySearch on the CPU, CudaOps.AdamW8bitState on the GPU
// with both). At start: DELTASTACK_Q8_BINARY_SEARCH=1 sets it, for A/Bs (model/engine.cpp checks the value). One
// flag per process (host code; set it between launches).
inline bool& q8_binary_search() {
  static bool on = [] {
    const char* v = std::getenv("DELTASTACK_Q8_BINARY_SEARCH");
    return v != nullptr && std::string(v) == "1";
  }();
  return on;
}

// param, m, v: fp32 [n] in place; grad: fp32 [n]; param_bf16: bf16 [n] copy of the updated param (may be null).
void adamw_update(float* param, const float* grad, float* m, float* v, ds::cuda::bf16* param_bf16, int64_t n,
                  const ds::ops::AdamWParams& p, cudaStream_t stream);
// The lean mode's AdamW (ops/adamw/bf16_state.h; bitwise ops::adamw_update_bf16): param, m, v bf16 [n] in place
// with stochastic rounding, grad fp32 [n]; index0 = flat parameter index of element 0 (the random stream).
void adamw_update_bf16(ds::cuda::bf16* param, const float* grad, ds::cuda::bf16* m, ds::cuda::bf16* v, int64_t n,
                       const ds::ops::AdamWParams& p, int64_t index0, cudaStream_t stream);
// The 8-bit state's AdamW (ops/adamw/q8_state.h; bitwise ops::adamw_update_8bit, whose comment gives the layout):
// param bf16 [n] in place, grad fp32 [n], m_code / v_code uint8 [n], m_absmax / v_absmax fp32 [num_blocks].
// partials (may be null): also the gradients' sums of squares, sum_squares_partials(grad, n, index0, partials)'s
// values bitwise, from the same read of the gradients (--gradients in-backward: no second pass over them).
// chunk_mask (may be null): one byte per chunk of the partials' partition (32 quantization blocks; chunk j is
// partials[j], sum_squares_partials_count(index0, n) of them); only the chunks whose byte equals mask_want are
// updated (and their partials written), the others left as they are. Updating a range in two calls, one per mask
// value, gives the one call's results bitwise (each chunk runs the same operations). grad null: the gradients all
// zero, not read (the same results as a zero buffer).
void adamw_update_8bit(ds::cuda::bf16* param, const float* grad, uint8_t* m_code, uint8_t* v_code, float* m_absmax,
                       float* v_absmax, int64_t n, const ds::ops::AdamWParams& p, int64_t index0, cudaStream_t stream,
                       double* partials = nullptr, const uint8_t* chunk_mask = nullptr, uint8_t mask_want = 0);
// The same three updates reading bf16 gradients (`--gradients bf16`: the whole-model gradient buffer in bf16),
// each widened exactly to fp32 where the fp32 overloads read the fp32 value: the same results as the fp32 overloads
// given the widened gradients, bitwise. grad: bf16 [n].
void adamw_update(float* param, const ds::cuda::bf16* grad, float* m, float* v, ds::cuda::bf16* param_bf16, int64_t n,
                  const ds::ops::AdamWParams& p, cudaStream_t stream);
void adamw_update_bf16(ds::cuda::bf16* param, const ds::cuda::bf16* grad, ds::cuda::bf16* m, ds::cuda::bf16* v,
                       int64_t n, const ds::ops::AdamWParams& p, int64_t index0, cudaStream_t stream);
void adamw_update_8bit(ds::cuda::bf16* param, const ds::cuda::bf16* grad, uint8_t* m_code, uint8_t* v_code,
                       float* m_absmax, float* v_absmax, int64_t n, const ds::ops::AdamWParams& p, int64_t index0,
                       cudaStream_t stream, double* partials = nullptr, const uint8_t* chunk_mask = nullptr,
                       uint8_t mask_want = 0);
// The bf16 gradient buffer's stochastic-rounded accumulation (bitwise ops::accumulate_grad_bf16): acc bf16 [n] in
// place, acc[i] = SR(float(acc[i]) + g[i]), g fp32 [n] (a unit's gradient slot), key = bf16_state::grad_key(step,
// micro-batch), index0 = the flat parameter index of element 0.
void accumulate_grad_bf16(ds::cuda::bf16* acc, const float* g, int64_t n, uint64_t key, int64_t index0,
                          cudaStream_t stream);
// bf16 -> fp32 (exact).
void widen_bf16(const ds::cuda::bf16* x, float* y, int64_t n, cudaStream_t stream);
// Converts fp32 -> bf16 (round to nearest even).
void to_bf16(const float* x, ds::cuda::bf16* y, int64_t n, cudaStream_t stream);
// A gradient's sum of squares in pieces, the partition of the 8-bit update (so the update can produce them from its
// own read: adamw_update_8bit's partials): x [n] holds flat parameter elements [index0, index0 + n) of one
// parameter; partials [sum_squares_partials_count(index0, n)] (fp64, device) gets, for each run of 32 of the
// range's 256-element quantization blocks (q8_state::num_blocks), the sum of its elements' squares in double in a
// fixed order (the same for fp32 and widened bf16 values of the same numbers). sum_partials adds `count`
// consecutive partials in a fixed order (a function of count) into *out. A unit's gradient norm is its
// parameters' partials, in parameter order, added by one sum_partials (model/gpu_params.h unit_sum_squares).
int64_t sum_squares_partials_count(int64_t index0, int64_t n);
void sum_squares_partials(const float* x, int64_t n, int64_t index0, double* partials, cudaStream_t stream);
void sum_squares_partials(const ds::cuda::bf16* x, int64_t n, int64_t index0, double* partials, cudaStream_t stream);
void sum_partials(const double* partials, int64_t count, double* out, cudaStream_t stream);
// Sum of squares of x [n] in fixed block order into *out (device double). scratch: sum_squares_scratch_bytes(n).
size_t sum_squares_scratch_bytes(int64_t n);
void sum_squares(const float* x, int64_t n, double* out, void* scratch, cudaStream_t stream);
// The same over bf16 values (each widened exactly; the same grid and order as the fp32 one over the widened values).
void sum_squares(const ds::cuda::bf16* x, int64_t n, double* out, void* scratch, cudaStream_t stream);

}  // namespace ds::ops::cuda
