#include "model/gpu_fp8.h"

#include <algorithm>
#include <cstdlib>
#include <string>

#include <fmt/format.h>

#include "core/error.h"

namespace ds {

Fp8Recipe Fp8Recipe::from_env() {
  Fp8Recipe r;
  if (const char* g = std::getenv("DELTASTACK_FP8_GRAD"); g && *g) {
    const std::string v = g;
    DS_CHECK(v == "e5m2" || v == "e4m3", "DELTASTACK_FP8_GRAD must be e5m2 or e4m3 (got \"{}\")", v);
    r.grad = v == "e5m2" ? Fp8Format::E5M2 : Fp8Format::E4M3;
  }
  if (const char* a = std::getenv("DELTASTACK_FP8_FAST_ACCUM"); a && *a) {
    const std::string v = a;
    DS_CHECK(v == "forward" || v == "all" || v == "none",
             "DELTASTACK_FP8_FAST_ACCUM must be forward, all or none (got \"{}\")", v);
    r.fast_accum_forward = v != "none";
    r.fast_accum_backward = v == "all";
  }
  return r;
}

std::string Fp8Recipe::describe() const {
  return fmt::format("per-tensor current scaling, e4m3 weights/activations, {} gradients, fast accumulation {}",
                     fp8_format_name(grad),
                     fast_accum_backward ? "everywhere" : fast_accum_forward ? "in the forward" : "off");
}

}  // namespace ds

#ifdef DELTASTACK_CUDA
namespace ds {

namespace K = ds::ops::cuda;
using K::Fp8Matrix;
using K::kFp8Slot;

GpuFp8Bufs::Sizes GpuFp8Bufs::sizes(const ModelConfig& c, int64_t max_tokens) {
  const int64_t H = c.hidden_size, I = c.intermediate_size, CD = c.conv_dim(), VD = c.value_dim(),
                Hq = c.num_attention_heads, Hkv = c.num_key_value_heads, hd = c.head_dim;
  const int64_t Np = K::fp8_padded(max_tokens);
  // (inputs, outputs) of every FP8 linear: in_proj_qkv, in_proj_z, out_proj, q|gate, k/v, o_proj, gate|up, down.
  const int64_t lin[][2] = {{H, CD}, {H, VD}, {VD, H}, {H, Hq * 2 * hd}, {H, Hkv * hd}, {Hq * hd, H}, {H, 2 * I}, {I, H}};
  int64_t max_in = 0, max_out = 0, max_w = 0;
  for (const auto& l : lin) {
    max_in = std::max(max_in, l[0]);
    max_out = std::max(max_out, l[1]);
    max_w = std::max(max_w, l[0] * l[1]);
  }
  Sizes s;
  s.x = static_cast<size_t>(std::max(max_tokens * max_in, max_in * Np));
  s.w = static_cast<size_t>(max_w);
  s.dy = static_cast<size_t>(max_tokens * max_out);
  s.dyt = static_cast<size_t>(max_out * Np);
  return s;
}

Fp8Matrix GpuFp8Linear::input(const bf16* x, int64_t M, int64_t K) {
  K::fp8_amax(x, M, K, K, b_.f, s_);
  K::fp8_quantize(x, M, K, K, b_.f, Fp8Format::E4M3, b_.x, K, b_.f + 3 * kFp8Slot, s_);
  return Fp8Matrix{b_.x, M, K, K, Fp8Format::E4M3, b_.f + 3 * kFp8Slot};
}

void GpuFp8Linear::forward(const Fp8Matrix& qx, const bf16* W, int64_t N, bf16* y, bool accumulate) {
  const int64_t Kd = qx.cols;
  K::fp8_amax(W, N, Kd, Kd, b_.f + 1 * kFp8Slot, s_);
  K::fp8_quantize(W, N, Kd, Kd, b_.f + 1 * kFp8Slot, Fp8Format::E4M3, b_.w, Kd, b_.f + 4 * kFp8Slot, s_);
  const Fp8Matrix qw{b_.w, N, Kd, Kd, Fp8Format::E4M3, b_.f + 4 * kFp8Slot};
  K::gemm_fp8(qx, qw, y, false, N, accumulate ? 1.0f : 0.0f, r_.fast_accum_forward, s_);
}

Fp8Matrix GpuFp8Linear::input_t(const bf16* x, int64_t M, int64_t K) {
  const int64_t Mp = K::fp8_padded(M);
  K::fp8_amax(x, M, K, K, b_.f, s_);
  K::fp8_quantize_transpose(x, M, K, K, b_.f, Fp8Format::E4M3, b_.x, Mp, b_.f + 3 * kFp8Slot, s_);
  return Fp8Matrix{b_.x, K, Mp, Mp, Fp8Format::E4M3, b_.f + 3 * kFp8Slot};
}

void GpuFp8Linear::backward(const bf16* dy, int64_t M, const bf16* W, const Fp8Matrix& qxt, int64_t N, bf16* dx,
                            bool accumulate_dx, float* dW) {
  const int64_t Kd = qxt.rows, Mp = qxt.cols;
  DS_CHECK(Mp == K::fp8_padded(M), "fp8 backward: the input was cast over {} rows, the gradient has {}", Mp, M);
  // dy's amax once for both of its casts.
  K::fp8_amax(dy, M, N, N, b_.f + 2 * kFp8Slot, s_);
  // dy cast into both layouts in one pass: q(dy) for the dgrad, q(dy^T) for the wgrad
  K::fp8_quantize_both(dy, M, N, N, b_.f + 2 * kFp8Slot, r_.grad, b_.dy, N, b_.dyt, Mp, b_.f + 6 * kFp8Slot,
                       b_.f + 5 * kFp8Slot, s_);
  // dgrad: dx[M, K] = q(dy)[M, N] . q(W^T)[K, N]^T
  K::fp8_amax(W, N, Kd, Kd, b_.f + 1 * kFp8Slot, s_);
  K::fp8_quantize_transpose(W, N, Kd, Kd, b_.f + 1 * kFp8Slot, Fp8Format::E4M3, b_.w, N, b_.f + 4 * kFp8Slot, s_);
  const Fp8Matrix qdy{b_.dy, M, N, N, r_.grad, b_.f + 5 * kFp8Slot}, qwt{b_.w, Kd, N, N, Fp8Format::E4M3, b_.f + 4 * kFp8Slot};
  K::gemm_fp8(qdy, qwt, dx, false, Kd, accumulate_dx ? 1.0f : 0.0f, r_.fast_accum_backward, s_);
  if (!dW) return;  // a frozen weight (LoRA's base): dgrad only
  // wgrad: dW[N, K] += q(dy^T)[N, Mp] . qxt[K, Mp]^T (the padding columns are zeros in both)
  const Fp8Matrix qdyt{b_.dyt, N, Mp, Mp, r_.grad, b_.f + 6 * kFp8Slot};
  K::gemm_fp8(qdyt, qxt, dW, true, Kd, 1.0f, r_.fast_accum_backward, s_);
}

}  // namespace ds
#endif
