#include "model/gpu_activations.h"

#include <algorithm>

#ifdef DELTASTACK_CUDA
#include "core/error.h"
#include "ops/adamw/q8_state.h"

namespace ds {

void GpuActivations::reserve(Arena& a, const ModelConfig& c, const Sizes& s) {
  const int64_t N = s.max_tokens, S = s.max_seqs, H = c.hidden_size, I = c.intermediate_size;
  const int64_t CD = c.conv_dim(), KD = c.key_dim(), VD = c.value_dim(), Hv = c.linear_num_value_heads,
                Hk = c.linear_num_key_heads, Hq = c.num_attention_heads, Hkv = c.num_key_value_heads, hd = c.head_dim;
  GpuBatchBufs& b = batch;
  a.use = MemoryUse::Kept;
  b.ids = a.take<int32_t>(N);
  b.targets = a.take<int32_t>(N);
  b.cu = a.take<int32_t>(S + 1);
  b.seq_start = a.take<int32_t>(N);
  b.emb_uniq = a.take<int32_t>(N);
  b.emb_starts = a.take<int32_t>(N + 1);
  b.emb_pos = a.take<int32_t>(N);
  b.cos_t = a.take<float>(N * c.rotary_dim() / 2);
  b.sin_t = a.take<float>(N * c.rotary_dim() / 2);
  b.loss = a.take<double>(2);
  // The embedding's update split (model/gpu_model.cpp): a byte per chunk of its update (q8_state.h num_chunks), at
  // the most chunks any start can give (a start one element short of a 256-element block boundary).
  b.emb_chunks = a.take<uint8_t>(
      static_cast<size_t>(ops::q8_state::num_chunks(ops::q8_state::kBlock - 1, c.vocab_size * c.hidden_size)));
  a.use = MemoryUse::Workspace;
  b.gdn_batch = s.gdn_batch ? a.bytes(s.gdn_batch) : nullptr;
  b.attn_batch = s.attn_batch ? a.bytes(s.attn_batch) : nullptr;
  a.use = MemoryUse::Kept;
  hs.assign(static_cast<size_t>(c.num_hidden_layers + 1), nullptr);
  if (s.offload) {  // the layer inputs in a ring (the rest of each lives in pinned host memory), the output apart
    const int64_t R = offload_ring(c.num_hidden_layers);
    for (int64_t i = 0; i < R; ++i) hs[static_cast<size_t>(i)] = a.take<bf16>(N * H);
    for (int64_t i = R; i < c.num_hidden_layers; ++i) hs[static_cast<size_t>(i)] = hs[static_cast<size_t>(i % R)];
    hs.back() = a.take<bf16>(N * H);
  } else {
    for (auto& h : hs) h = a.take<bf16>(N * H);
  }
  layers.assign(static_cast<size_t>(c.num_hidden_layers), GpuLayerActs{});
  bool any_gdn = false, any_attn = false;
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) (c.is_full_attention(i) ? any_attn : any_gdn) = true;
  const Recompute rc = s.recompute;
  DS_CHECK(rc == Recompute::None || rc == Recompute::Selective || rc == Recompute::Mlp || rc == Recompute::Full,
           "gpu: the recompute policy must be resolved before the activations are laid out");
  // The rebuilt activations (selective, mlp, full): one buffer each, shared by all layers; with none, one per layer.
  struct Rebuilt {
    bf16 *xn1 = nullptr, *xn2 = nullptr, *act = nullptr, *conv = nullptr, *qn = nullptr, *kn = nullptr, *y = nullptr,
         *og = nullptr;
  };
  // --precision fp8 keeping the FP8-only GEMM inputs in FP8 (recompute none; model/gpu_fp8.h fp8_keeps_inputs): their
  // bf16 values (xn2, act, y, og) are read only by the forward's cast, so one buffer each serves every layer.
  const bool t8 = s.fp8_saved;  // (fp8 and recompute none, by fp8_keeps_inputs)
  Rebuilt transient;
  if (t8) {
    a.use = MemoryUse::Recomputed;
    transient.xn2 = a.take<bf16>(N * H);
    transient.act = a.take<bf16>(N * I);
    if (any_gdn) transient.y = a.take<bf16>(N * VD);
    if (any_attn) transient.og = a.take<bf16>(N * Hq * hd);
    a.use = MemoryUse::Kept;
  }
  // One layer's own set (per_layer: none, or a kept layer) or the set all rebuilding layers share.
  auto rebuilt = [&](bool gdn, bool attn, bool per_layer) {
    Rebuilt r;
    r.xn1 = a.take<bf16>(N * H);
    r.xn2 = t8 ? transient.xn2 : per_layer ? a.take<bf16>(N * H) : r.xn1;  // rebuilt in turn: one buffer
    r.act = t8 ? transient.act : a.take<bf16>(N * I);
    if (gdn) {
      r.conv = a.take<bf16>(N * CD);
      r.qn = a.take<bf16>(N * KD);
      r.kn = a.take<bf16>(N * KD);
      r.y = t8 ? transient.y : a.take<bf16>(N * VD);
    }
    if (attn) r.og = t8 ? transient.og : a.take<bf16>(N * Hq * hd);
    return r;
  };
  // Each layer's policy: none for the kept ones, then (full) the mlp layers, then the plan's.
  auto layer_rc = [&](int64_t i) { return layer_recompute(rc, s.kept_layers, s.mlp_layers, s.selective_layers, i); };
  auto keeps = [&](int64_t i) { return layer_rc(i) == Recompute::None; };
  bool any_mlp = false;
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) any_mlp |= layer_rc(i) == Recompute::Mlp;
  Rebuilt shared;
  bf16* shared_gu = nullptr;  // mlp: the gate|up output, rebuilt in the backward (its GEMM again)
  if (!keeps(c.num_hidden_layers - 1)) {  // some layer rebuilds (the kept ones come first)
    a.use = MemoryUse::Recomputed;
    shared = rebuilt(any_gdn, any_attn, false);
    if (any_mlp) shared_gu = a.take<bf16>(N * 2 * I);
  }
  a.use = MemoryUse::Kept;
  // With full recompute only the residual stream (hs) is kept per layer; everything else below exists once for
  // all layers (once per mixer kind), rewritten by the layer's forward that the backward runs again first. The
  // first kept_layers layers (kept first, before any shared set) keep their own, as with none.
  const GpuLayerActs* first_of[2] = {nullptr, nullptr};  // [attention?]: the first rebuilding layer of each kind
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    GpuLayerActs& L = layers[static_cast<size_t>(i)];
    const bool attn = c.is_full_attention(i);
    const bool shares = layer_rc(i) == Recompute::Full;  // this layer's forward runs again
    if (shares && first_of[attn]) {
      L = *first_of[attn];
      continue;
    }
    const Rebuilt r = keeps(i) ? rebuilt(!attn, attn, true) : shared;
    const GpuLayerActs* other = shares ? first_of[!attn] : nullptr;
    L.xn1 = r.xn1;
    L.xn2 = r.xn2;
    L.act = r.act;
    if (t8) {  // the kept transposed FP8 casts, [K, pad16(N)] bytes
      const int64_t Np = ops::cuda::fp8_padded(N);
      L.t8[static_cast<int>(Fp8Input::MixerOut)] = a.take<uint8_t>(Np * (attn ? Hq * hd : VD));
      L.t8[static_cast<int>(Fp8Input::MlpIn)] = a.take<uint8_t>(Np * H);
      L.t8[static_cast<int>(Fp8Input::MlpOut)] = a.take<uint8_t>(Np * I);
    }
    if (other) {  // full: the parts every layer has, shared with the other mixer kind's set too
      L.rstd1 = other->rstd1, L.h_mid = other->h_mid, L.rstd2 = other->rstd2, L.gu = other->gu;
    } else {
      L.rstd1 = a.take<float>(N);
      L.h_mid = a.take<bf16>(N * H);
      L.rstd2 = a.take<float>(N);
      L.gu = layer_rc(i) == Recompute::Mlp ? shared_gu : a.take<bf16>(N * 2 * I);  // (null while sizing)
    }
    if (attn) {
      L.qraw = a.take<bf16>(N * Hq * hd);
      L.graw = a.take<bf16>(N * Hq * hd);
      L.kraw = a.take<bf16>(N * Hkv * hd);
      L.vraw = a.take<bf16>(N * Hkv * hd);
      L.qr = a.take<bf16>(N * Hq * hd);
      L.kr = a.take<bf16>(N * Hkv * hd);
      L.ao = a.take<bf16>(N * Hq * hd);
      L.og = r.og;
      L.rstd_q = a.take<float>(N * Hq);
      L.rstd_k = a.take<float>(N * Hkv);
      L.lse = a.take<float>(N * Hq);
    } else {
      L.mixed = a.take<bf16>(N * CD);
      L.z = a.take<bf16>(N * VD);
      L.ab = a.take<bf16>(N * 2 * Hv);
      L.conv_out = r.conv;
      L.qn = r.qn;
      L.kn = r.kn;
      L.rq = a.take<float>(N * Hk);
      L.rk = a.take<float>(N * Hk);
      L.g = a.take<float>(N * Hv);
      L.beta = a.take<float>(N * Hv);
      a.use = MemoryUse::GdnSaved;
      L.gdn_saved = a.bytes(s.gdn_saved);
      a.use = MemoryUse::Kept;
      L.core = a.take<bf16>(N * VD);
      L.rstd_g = a.take<float>(N * Hv);
      L.y = r.y;
    }
    if (shares && !first_of[attn]) first_of[attn] = &L;
  }
  hf = a.take<bf16>(N * H);
  rstd_f = a.take<float>(N);
  a.use = MemoryUse::Recomputed;
  GpuGradBufs& d = grad;
  d.dh = a.take<bf16>(N * H);
  d.dxn = a.take<bf16>(N * H);
  // The loss's dh (the final norm's output gradient) is read only by the final norm's backward, before any layer's
  // backward writes dxn: one buffer.
  d.dhf = d.dxn;
  // The MLP's activation gradient goes into the act buffer of the layer in its backward (layer_backward): act is
  // read only by the down projection's wgrad, whose FP8 cast (or bf16 GEMM, run before the dgrad:
  // linears_backward) is made before the dgrad writes dact. A LoRA run reads act again for the adapter's
  // gradient after the dgrad: its own buffer then. gate|up's gradient overwrites gate|up in place (swiglu_backward
  // reads each position's gate and up before writing it; nothing reads gate|up after).
  d.dact = s.lora ? a.take<bf16>(N * I) : nullptr;
  // A layer's backward is a GDN layer's or an attention layer's, and each mixer's gradient buffers are read and
  // written only inside its own backward (model/gpu_model.cpp gdn_backward, attn_backward), in stream order: the two
  // sets share their bytes (the larger of the two).
  const size_t mixers_at = a.off;
  d.dmixed = a.take<bf16>(N * CD);
  d.dconv = a.take<bf16>(N * CD);
  d.dz = a.take<bf16>(N * VD);
  d.dab = a.take<bf16>(N * 2 * Hv);
  d.dcore = a.take<bf16>(N * VD);
  d.dy = a.take<bf16>(N * VD);
  d.dqn = a.take<bf16>(N * KD);
  d.dkn = a.take<bf16>(N * KD);
  d.dg = a.take<float>(N * Hv);
  d.dbeta = a.take<float>(N * Hv);
  const size_t gdn_end = a.off;
  a.off = mixers_at;
  d.dog = a.take<bf16>(N * Hq * hd);
  d.dao = a.take<bf16>(N * Hq * hd);
  d.dgate = a.take<bf16>(N * Hq * hd);
  d.dqr = a.take<bf16>(N * Hq * hd);
  d.dkr = a.take<bf16>(N * Hkv * hd);
  d.dvv = a.take<bf16>(N * Hkv * hd);
  d.dqg = a.take<bf16>(N * Hq * 2 * hd);
  const size_t attn_end = a.off;
  a.off = std::max(gdn_end, attn_end);
  a.by_use[static_cast<size_t>(MemoryUse::Recomputed)] -= std::min(gdn_end, attn_end) - mixers_at;  // counted twice
  a.use = MemoryUse::Workspace;
  // One region for both scratches: the fused loss (ce_scratch) runs between the last layer's forward and the final
  // norm's backward, on the step's stream, with no op of a layer in flight, and no op keeps anything in either
  // scratch past its own call (model/gpu_model.cpp), so the two never hold live bytes at once.
  // The same region holds, at fixed offsets, the buffers live only between a GEMM's operand cast and its last GEMM
  // (the FP8 casts x, dy and dyt: model/gpu_model.cpp linears_forward / linears_backward, which run no other op in
  // between) and the q|gate projection's output (qg, from its GEMM to the two copy_rows after it): none of them is
  // live across an op that uses the scratch or across the loss. The FP8 weight cast (w) stays apart: small, and
  // the LoRA frozen base's transposed codes are made there.
  const GpuFp8Bufs::Sizes f = s.fp8 ? GpuFp8Bufs::sizes(c, N) : GpuFp8Bufs::Sizes{};
  size_t in_scratch = 0;
  auto place = [&](size_t bytes) {  // the next 256-byte-aligned offset in the region for `bytes`
    const size_t at = in_scratch;
    in_scratch = (in_scratch + bytes + 255) / 256 * 256;
    return at;
  };
  const size_t at_x = place(f.x), at_dy = place(f.dy), at_dyt = place(f.dyt);
  const size_t at_qg = any_attn ? place(static_cast<size_t>(N * Hq * 2 * hd) * sizeof(bf16)) : 0;
  op_scratch = a.bytes(std::max({s.op_scratch, s.ce_scratch, in_scratch}));
  ce_scratch = op_scratch;
  char* region = static_cast<char*>(op_scratch);  // (null while sizing)
  auto at = [&](size_t off) { return region ? region + off : nullptr; };
  qg = any_attn ? reinterpret_cast<bf16*>(at(at_qg)) : nullptr;
  fp8 = GpuFp8Bufs{};
  if (s.fp8) {
    fp8.x = reinterpret_cast<uint8_t*>(at(at_x));
    fp8.w = a.take<uint8_t>(f.w);
    fp8.dy = reinterpret_cast<uint8_t*>(at(at_dy));
    fp8.dyt = reinterpret_cast<uint8_t*>(at(at_dyt));
    fp8.f = a.take<float>(8 * ops::cuda::kFp8Slot);
    fp8.amax = a.take<float>(f.amax);
    if (t8) fp8.saved_scale = a.take<float>(f.saved_scale);
  }
}

}  // namespace ds
#endif
