// The GPU engine's FP8 linear layers (`--precision fp8`; docs/fp8.md): the decoder's matrix GEMMs (in_proj_qkv,
// in_proj_z, out_proj, q|gate, k, v, o_proj, gate|up, down) with per-tensor current scaling (ops/linear/fp8.h),
// forward, dgrad and wgrad. Everything else of the step stays as in bf16 (embedding, lm head + loss, norms, conv1d,
// in_proj_b|a, the gated delta rule, attention, A_log, dt_bias).
//
// The casts go into a few scratch buffers of the activation plan (GpuFp8Bufs), rewritten by every GEMM: x (a
// forward input, or a backward input cast transposed), w (a weight, or its transpose), dy and dyt (an output
// gradient and its transpose). One stream: each buffer is read by its GEMM before the next cast rewrites it.
// Formats: E4M3 for weights and activations; output gradients in E5M2 (default) or E4M3
// (DELTASTACK_FP8_GRAD=e5m2|e4m3). Forward GEMMs use the tensor cores' fast accumulation, the backward's promote
// to fp32 (DELTASTACK_FP8_FAST_ACCUM=forward|all|none; TransformerEngine's default split).
#pragma once
#include <cstdint>
#include <string>

#include "core/fp8.h"

namespace ds {

// The FP8 formats and accumulation of a run, from the environment (DELTASTACK_FP8_GRAD, DELTASTACK_FP8_FAST_ACCUM);
// ds::Error naming the variable for a bad value.
struct Fp8Recipe {
  Fp8Format grad = Fp8Format::E5M2;
  bool fast_accum_forward = true, fast_accum_backward = false;
  static Fp8Recipe from_env();
  std::string describe() const;
};

}  // namespace ds

#ifdef DELTASTACK_CUDA
#include <cuda_runtime.h>

#include "core/cuda/cuda_utils.h"
#include "model/config.h"
#include "ops/linear/fp8.h"

namespace ds {

// The FP8 scratch of the activation plan (null when the precision is bf16).
struct GpuFp8Bufs {
  uint8_t *x = nullptr, *w = nullptr, *dy = nullptr, *dyt = nullptr;
  float* f = nullptr;  // 8 slots kFp8Slot floats apart: amax x, amax w, amax dy, then scales x, w, dy, dyt
  // Bytes of each buffer for config c and micro-batches of max_tokens tokens.
  struct Sizes {
    size_t x = 0, w = 0, dy = 0, dyt = 0;
  };
  static Sizes sizes(const ModelConfig& c, int64_t max_tokens);
};

// One linear layer family's FP8 GEMMs over the scratch buffers. M: tokens; a linear maps K inputs to N outputs
// (W: [N, K] bf16, the compute copy). Every call is enqueued on `stream`.
class GpuFp8Linear {
 public:
  using bf16 = ds::cuda::bf16;
  GpuFp8Linear(const GpuFp8Bufs& b, const Fp8Recipe& r, cudaStream_t s) : b_(b), r_(r), s_(s) {}

  // Whether the FP8 path takes a linear K -> N (cuBLASLt FP8: K and N multiples of 16); the caller runs the bf16
  // GEMMs otherwise.
  static bool takes(int64_t K, int64_t N) { return K % 16 == 0 && N % 16 == 0; }

  // x [M, K] cast (E4M3) into the x buffer: the forward input of one or more linears that read x.
  ops::cuda::Fp8Matrix input(const bf16* x, int64_t M, int64_t K);
  // y [M, N] (= or +=) qx . q(W)^T, W [N, K] cast into the w buffer.
  void forward(const ops::cuda::Fp8Matrix& qx, const bf16* W, int64_t N, bf16* y, bool accumulate);

  // x [M, K] cast transposed (E4M3, [K, pad16(M)]) into the x buffer: the wgrad input of the linears that read x.
  ops::cuda::Fp8Matrix input_t(const bf16* x, int64_t M, int64_t K);
  // One linear's backward: dx [M, K] (= or +=) q(dy) . q(W^T)^T and dW [N, K] += q(dy^T) . qxt^T (fp32), with
  // dy [M, N] cast once for both layouts (the grad format). qxt from input_t of the layer's input. dW null (a frozen
  // weight): the dgrad only, and qxt gives only its shape (rows K, cols fp8_padded(M); data may be null).
  void backward(const bf16* dy, int64_t M, const bf16* W, const ops::cuda::Fp8Matrix& qxt, int64_t N, bf16* dx,
                bool accumulate_dx, float* dW);

 private:
  GpuFp8Bufs b_;
  Fp8Recipe r_;
  cudaStream_t s_;
};

}  // namespace ds
#endif
