// Fused linear + cross-entropy (HF ForCausalLMLoss on logits = h @ W^T, with optional z-loss as in PaLM):
// walks the tokens in chunks so the [N, V] logits are never held; per token n with label y_n != ignore_index:
//   lse_n = log sum_v exp(l_nv),  loss_n = lse_n - l_{n, y_n} + z_loss * lse_n^2
// The caller picks the reduction: the result carries the sum and the count of valid tokens.
#pragma once
#include <cstdint>

namespace ds::ops {

struct LinearCeOptions {
  int64_t ignore_index = -100;
  double z_loss = 0.0;        // coefficient of lse^2 (0 = off)
  double grad_scale = 1.0;    // gradients are of grad_scale * sum_n loss_n (e.g. 1/num_valid for a mean)
  int64_t chunk_tokens = 1024;  // tokens per chunk: peak extra memory is chunk_tokens * V values
  // The lm head's two gradient GEMMs in FP8 (`--fp8-lm-head`, lossy, opt-in; docs/fp8.md "The lm head's gradient
  // GEMMs"): dh = q(dlogits) q(W) and dW += q(dlogits)^T q(h), where q is core/fp8.h's per-tensor cast: W and h
  // E4M3 at the amax of all of W and of all N rows of h, dlogits E5M2 at the amax bound |grad_scale| (every
  // dlogit is grad_scale * (p - onehot), so |dlogit| <= |grad_scale|: no amax pass). The logits, the loss and its
  // softmax stay as in the exact mode, so the loss value is unchanged. Needs z_loss == 0 (ds::Error otherwise:
  // the z-loss factor 1 + 2 z lse breaks the bound).
  bool fp8_grads = false;
  // dW = the weight gradient instead of dW += it (the first chunk's GEMM writes, beta 0; every element is written,
  // also when no label is valid): the caller need not zero dW first (the GPU model's in-backward slots,
  // model/gpu_model.cpp wgrad_overwrite). The same values as zeroing dW and adding.
  bool dW_overwrite = false;
};

struct LinearCeResult {
  double loss_sum = 0;    // sum over valid tokens of (lse - logit[label]) + z_loss * lse^2
  double z_loss_sum = 0;  // the z-loss part of loss_sum
  int64_t num_valid = 0;  // tokens whose label != ignore_index
};

// h: [N, H]; W: [V, H]; labels: [N] int32 in [0, V) or ignore_index (else ds::Error). opt.fp8_grads: T = float
// only (ds::Error for double).
// dh: [N, H] overwritten (null: skip); dW: [V, H] accumulated, or overwritten with opt.dW_overwrite (null: skip).
// Deterministic.
// logits_out: [N, V] (optional, null = not kept): the raw logits, for tools that must write them.
template <typename T>
LinearCeResult linear_cross_entropy(const T* h, const T* W, const int32_t* labels, int64_t N, int64_t H, int64_t V,
                                    const LinearCeOptions& opt, T* dh, T* dW, T* logits_out = nullptr);

}  // namespace ds::ops
