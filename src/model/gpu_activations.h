// The GPU engine's activation plan: every activation, gradient and scratch buffer of a step, laid out once for
// the largest micro-batch (GpuPlan) in the engine's one allocation.
//
// Kept per layer for the backward: the residual stream entering it, h_mid, the norm statistics, gu (gate|up),
// and per mixer GDN: mixed (qkv before the conv), z, ab (b|a), g, beta, the l2norm statistics, the core output
// and the gated-norm statistics, plus the GDN plan's saved buffer; attention: q/gate/k/v before and after norm and
// RoPE, the attention output and its lse. Cheap to recompute from those (one norm, elementwise or conv pass each)
// and therefore shared by all layers, rewritten by the same kernel on the same inputs in the backward (bitwise
// the forward's values): xn1, xn2, the SwiGLU output, the conv output, qn, kn, the gated-norm output y and the
// gated attention output og. That is the `selective` recompute policy (Recompute, model/engine.h); with `none`
// those get a buffer per layer too and are never rebuilt; with `full` only hs is kept per layer and every other
// buffer exists once (once per mixer kind), the backward running each layer's forward again before its backward.
#pragma once
#ifdef DELTASTACK_CUDA
#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/cuda/cuda_utils.h"
#include "model/config.h"
#include "model/engine.h"
#include "model/gpu_fp8.h"
#include "model/gpu_memory.h"

namespace ds {

// The policy decoder layer `layer` runs under the plan's rc: none for the first kept_layers layers of selective, mlp
// or full (GpuPlan::kept_layers: they keep their own copy of what the policy rebuilds; under full all of their
// activations, and their forward does not run again); under full, mlp for the mlp_layers after them
// (GpuPlan::mlp_layers); under mlp, selective for the selective_layers after them (GpuPlan::selective_layers:
// they keep their gate|up output); rc otherwise.
inline Recompute layer_recompute(Recompute rc, int64_t kept_layers, int64_t mlp_layers, int64_t selective_layers,
                                 int64_t layer) {
  if (rebuilds_activations(rc) && layer < kept_layers) return Recompute::None;
  if (rc == Recompute::Full && layer < kept_layers + mlp_layers) return Recompute::Mlp;
  if (rc == Recompute::Mlp && layer < kept_layers + selective_layers) return Recompute::Selective;
  return rc;
}

struct GpuLayerActs {
  using bf16 = ds::cuda::bf16;
  bf16 *xn1, *h_mid, *xn2, *gu, *act;
  float *rstd1, *rstd2;
  // GDN
  bf16 *mixed = nullptr, *z = nullptr, *ab = nullptr, *conv_out = nullptr, *qn = nullptr, *kn = nullptr,
       *core = nullptr, *y = nullptr;
  float *rq = nullptr, *rk = nullptr, *g = nullptr, *beta = nullptr, *rstd_g = nullptr;
  void* gdn_saved = nullptr;  // the GDN plan's saved buffer of this layer
  // attention
  bf16 *qraw = nullptr, *graw = nullptr, *kraw = nullptr, *vraw = nullptr, *qr = nullptr, *kr = nullptr,
       *ao = nullptr, *og = nullptr;
  float *rstd_q = nullptr, *rstd_k = nullptr, *lse = nullptr;
  // --precision fp8 keeping the FP8-only GEMM inputs (model/gpu_fp8.h fp8_keeps_inputs): their transposed casts, by
  // Fp8Input (MixerOut, MlpIn, MlpOut; null otherwise). Their bf16 values then live in one buffer for all layers.
  uint8_t* t8[4] = {nullptr, nullptr, nullptr, nullptr};
};

// The per-micro-batch inputs on the device (uploaded by the engine, read by every layer).
struct GpuBatchBufs {
  int32_t *ids = nullptr, *targets = nullptr, *cu = nullptr, *seq_start = nullptr, *emb_uniq = nullptr,
          *emb_starts = nullptr, *emb_pos = nullptr;
  float *cos_t = nullptr, *sin_t = nullptr;
  double* loss = nullptr;       // [2]: loss sum, z-loss sum
  uint8_t* emb_chunks = nullptr;  // the embedding's update split (model/gpu_model.cpp split_embed): a byte per chunk
  void* gdn_batch = nullptr;    // the GDN plan's per-batch indices
  void* attn_batch = nullptr;   // the attention plan's per-batch metadata
};

// Gradients flowing backward through a layer (one set, reused by every layer). dhf is dxn's buffer; dact is null
// unless a LoRA run (the layer's act buffer holds it), and gate|up's gradient has no buffer (it is made in place of
// the layer's gu): GpuActivations::reserve.
struct GpuGradBufs {
  using bf16 = ds::cuda::bf16;
  bf16 *dh, *dxn, *dhf, *dact, *dmixed, *dconv, *dz, *dab, *dcore, *dy, *dqn, *dkn, *dog, *dao, *dgate,
       *dqr, *dkr, *dvv, *dqg;
  float *dg, *dbeta;
};

struct GpuActivations {
  using bf16 = ds::cuda::bf16;
  std::vector<bf16*> hs;  // residual stream entering each layer; hs[L] = the last layer's output
  // offload (GpuPlan::offload_activations): hs[0..L-1] share a ring of kOffloadRing device buffers (model/engine.h),
  // hs[i] in buffer i % kOffloadRing, copied to pinned host memory during a training pass's forward and back before
  // its layer's backward (model/gpu_model.cpp); hs[L] keeps its own.
  std::vector<GpuLayerActs> layers;
  bf16 *hf = nullptr, *qg = nullptr;
  float* rstd_f = nullptr;
  GpuBatchBufs batch;
  GpuGradBufs grad{};
  void* op_scratch = nullptr;  // shared by every op call (the largest need of any op or plan)
  void* ce_scratch = nullptr;  // the fused loss's scratch: the same bytes as op_scratch (never live at once)
  GpuFp8Bufs fp8;  // --precision fp8: the GEMM operands' casts (model/gpu_fp8.h); null otherwise

  struct Sizes {
    int64_t max_tokens = 0, max_seqs = 0;
    size_t gdn_saved = 0, gdn_batch = 0, attn_batch = 0;  // from the op plans
    size_t op_scratch = 0, ce_scratch = 0;                // the largest scratch of any op / the fused loss
    Recompute recompute = Recompute::Selective;           // resolved (not Auto)
    int64_t kept_layers = 0;                              // selective / mlp / full: layers that keep them (GpuPlan)
    int64_t mlp_layers = 0;                               // full: the layers after them that run mlp (GpuPlan)
    int64_t selective_layers = 0;                         // mlp: the layers after them that run selective (GpuPlan)
    bool fp8 = false;                                     // --precision fp8: reserve the FP8 casts' buffers
    bool fp8_saved = false;                               // and keep the FP8-only inputs in FP8 (fp8_keeps_inputs)
    bool offload = false;                                 // hs[0..L-1] in a ring (GpuPlan::offload_activations)
    bool lora = false;                                    // a LoRA run (its adapters read act after dact is made)
  };
  // Lays every buffer out in `a` for config c and the sizes.
  void reserve(Arena& a, const ModelConfig& c, const Sizes& s);
};

}  // namespace ds
#endif
