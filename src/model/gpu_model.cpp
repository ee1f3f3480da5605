// GPU model: the layer sequence of model.cpp (HF Qwen3_5ForCausalLM, qwen35_model.md §2) on CUDA backends.
// Compiled only with DELTASTACK_CUDA; the stub at the bottom reports a clear error otherwise.
#include "model/gpu_model.h"

#include "core/error.h"

#ifdef DELTASTACK_CUDA
#include <algorithm>
#include <cmath>
#include <map>

#include "core/bf16.h"
#include "core/cuda/cuda_utils.h"
#include "core/cuda/device.h"
#include "core/log.h"
#include "model/dims.h"
#include "ops/adamw/cuda.h"
#include "ops/attention/cuda.h"
#include "ops/attention/cudnn.h"
#include "ops/conv1d/cuda.h"
#include "ops/elementwise/cuda.h"
#include "ops/embedding/cuda.h"
#include "ops/gated_delta_rule/cuda.h"
#include "ops/gated_rmsnorm/cuda.h"
#include "ops/gdn_gate/cuda.h"
#include "ops/l2norm/cuda.h"
#include "ops/linear/cuda.h"
#include "ops/linear_cross_entropy/cuda.h"
#include "ops/registry.h"
#include "ops/rmsnorm/cuda.h"
#include "ops/rope/cuda.h"
#include "ops/rope/rope.h"
#include "ops/swiglu/cuda.h"

namespace ds {

using ds::cuda::bf16;
namespace K = ds::ops::cuda;

namespace {

// Bump allocator over one device allocation. Run the layout once with base == nullptr to size it, then again
// with the real base.
struct Arena {
  char* base = nullptr;
  size_t off = 0;
  template <typename T>
  T* take(size_t n) {
    off = (off + 255) / 256 * 256;
    T* p = reinterpret_cast<T*>(base + off);
    off += n * sizeof(T);
    return base ? p : nullptr;
  }
  void* bytes(size_t n) { return take<char>(n); }
};

struct LayerBufs {
  bf16 *xn1, *h_mid, *xn2, *gu, *act;
  float *rstd1, *rstd2;
  // GDN
  bf16 *mixed = nullptr, *z = nullptr, *ab = nullptr, *conv_out = nullptr, *qn = nullptr, *kn = nullptr,
       *core = nullptr, *y = nullptr;
  float *rq = nullptr, *rk = nullptr, *g = nullptr, *beta = nullptr, *states = nullptr, *rstd_g = nullptr;
  // attention
  bf16 *qraw = nullptr, *graw = nullptr, *kraw = nullptr, *vraw = nullptr, *qr = nullptr, *kr = nullptr,
       *ao = nullptr, *og = nullptr;
  float *rstd_q = nullptr, *rstd_k = nullptr, *lse = nullptr;
};

}  // namespace

struct GpuModel::Impl {
  ModelConfig c;
  std::vector<ParamSpec> params;
  std::map<std::string, size_t> by_name;
  GpuPlan plan;
  int64_t P = 0;  // parameter count
  cudaStream_t stream = nullptr;
  char* arena_base = nullptr;
  size_t arena_bytes = 0;
  size_t peak = 0;

  // parameters
  float *w = nullptr, *gw = nullptr, *m = nullptr, *v = nullptr;
  bf16* wb = nullptr;
  // per-batch inputs
  int32_t *ids = nullptr, *targets = nullptr, *cu = nullptr, *seq_start = nullptr, *chunk_off = nullptr,
          *emb_uniq = nullptr, *emb_starts = nullptr, *emb_pos = nullptr;
  float *cos_t = nullptr, *sin_t = nullptr;
  double* loss_dev = nullptr;
  double* sumsq_dev = nullptr;
  // activations
  std::vector<bf16*> hs;  // residual stream entering each layer, hs[L] = last layer's output
  std::vector<LayerBufs> layers;
  bf16 *hf = nullptr, *tmpH = nullptr, *qg = nullptr;
  float* rstd_f = nullptr;
  // backward scratch
  bf16 *dh = nullptr, *dtmp = nullptr, *dxn = nullptr, *dact = nullptr, *dgu = nullptr, *dmixed = nullptr,
       *dconv = nullptr, *dz = nullptr, *dab = nullptr, *dcore = nullptr, *dy = nullptr, *dqn = nullptr,
       *dkn = nullptr, *dog = nullptr, *dao = nullptr, *dgate = nullptr, *dqr = nullptr, *dkr = nullptr,
       *dvv = nullptr, *dqg = nullptr, *dhf = nullptr;
  float *dg = nullptr, *dbeta = nullptr;
  void* op_scratch = nullptr;
  size_t op_scratch_bytes = 0;
  void* ce_scratch = nullptr;
  void* sumsq_scratch = nullptr;
  // cuDNN fused attention (when the registry selects it); per batch it may fall back to the simple kernel.
  std::unique_ptr<ops::cudnn::Attention> cudnn_attn;
  void* cudnn_meta = nullptr;
  bool cudnn_batch = false;    // the current batch runs on cuDNN
  bool cudnn_warned = false;

  int64_t max_chunks() const { return plan.max_tokens / 64 + plan.max_seqs + 1; }

  void layout(Arena& a) {
    const int64_t N = plan.max_tokens, S = plan.max_seqs, H = c.hidden_size, I = c.intermediate_size;
    const int64_t CD = c.conv_dim(), KD = c.key_dim(), VD = c.value_dim(), Hv = c.linear_num_value_heads,
                  Hk = c.linear_num_key_heads, Hq = c.num_attention_heads, Hkv = c.num_key_value_heads,
                  hd = c.head_dim;
    w = a.take<float>(P);
    gw = a.take<float>(P);
    m = a.take<float>(P);
    v = a.take<float>(P);
    wb = a.take<bf16>(P);
    ids = a.take<int32_t>(N);
    targets = a.take<int32_t>(N);
    cu = a.take<int32_t>(S + 1);
    seq_start = a.take<int32_t>(N);
    chunk_off = a.take<int32_t>(S + 1);
    emb_uniq = a.take<int32_t>(N);
    emb_starts = a.take<int32_t>(N + 1);
    emb_pos = a.take<int32_t>(N);
    cos_t = a.take<float>(N * c.rotary_dim() / 2);
    sin_t = a.take<float>(N * c.rotary_dim() / 2);
    loss_dev = a.take<double>(2);
    sumsq_dev = a.take<double>(1);
    hs.assign(static_cast<size_t>(c.num_hidden_layers + 1), nullptr);
    for (auto& h : hs) h = a.take<bf16>(N * H);
    layers.assign(static_cast<size_t>(c.num_hidden_layers), LayerBufs{});
    size_t scratch = 0;
    // Activations that are cheap to recompute from what a layer keeps (one norm, elementwise or conv pass each)
    // are not kept per layer: one buffer each, shared by all layers, written in the forward and rewritten by the
    // same kernel on the same inputs in the backward (so the values are bitwise the forward's). Kept per layer:
    // the residual stream, h_mid, the statistics, gu, mixed, z, ab, g, beta, core, the GDN chunk states and the
    // attention q/k/v/gate/output.
    bool any_gdn = false, any_attn = false;
    for (int64_t i = 0; i < c.num_hidden_layers; ++i) (c.is_full_attention(i) ? any_attn : any_gdn) = true;
    bf16* xn_s = a.take<bf16>(N * H);
    bf16* act_s = a.take<bf16>(N * I);
    bf16 *conv_s = nullptr, *qn_s = nullptr, *kn_s = nullptr, *y_s = nullptr, *og_s = nullptr;
    if (any_gdn) {
      conv_s = a.take<bf16>(N * CD);
      qn_s = a.take<bf16>(N * KD);
      kn_s = a.take<bf16>(N * KD);
      y_s = a.take<bf16>(N * VD);
    }
    if (any_attn) og_s = a.take<bf16>(N * Hq * hd);
    for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
      LayerBufs& L = layers[static_cast<size_t>(i)];
      L.xn1 = xn_s;  // recomputed
      L.rstd1 = a.take<float>(N);
      L.h_mid = a.take<bf16>(N * H);
      L.xn2 = xn_s;  // recomputed
      L.rstd2 = a.take<float>(N);
      L.gu = a.take<bf16>(N * 2 * I);
      L.act = act_s;  // recomputed
      if (c.is_full_attention(i)) {
        L.qraw = a.take<bf16>(N * Hq * hd);
        L.graw = a.take<bf16>(N * Hq * hd);
        L.kraw = a.take<bf16>(N * Hkv * hd);
        L.vraw = a.take<bf16>(N * Hkv * hd);
        L.qr = a.take<bf16>(N * Hq * hd);
        L.kr = a.take<bf16>(N * Hkv * hd);
        L.ao = a.take<bf16>(N * Hq * hd);
        L.og = og_s;  // recomputed
        L.rstd_q = a.take<float>(N * Hq);
        L.rstd_k = a.take<float>(N * Hkv);
        L.lse = a.take<float>(N * Hq);
      } else {
        L.mixed = a.take<bf16>(N * CD);
        L.z = a.take<bf16>(N * VD);
        L.ab = a.take<bf16>(N * 2 * Hv);
        L.conv_out = conv_s;  // recomputed
        L.qn = qn_s;          // recomputed
        L.kn = kn_s;          // recomputed
        L.rq = a.take<float>(N * Hk);
        L.rk = a.take<float>(N * Hk);
        L.g = a.take<float>(N * Hv);
        L.beta = a.take<float>(N * Hv);
        L.states = a.take<float>(static_cast<size_t>(max_chunks() * Hv * c.linear_key_head_dim * c.linear_value_head_dim));
        L.core = a.take<bf16>(N * VD);
        L.rstd_g = a.take<float>(N * Hv);
        L.y = y_s;  // recomputed
      }
    }
    hf = a.take<bf16>(N * H);
    rstd_f = a.take<float>(N);
    tmpH = a.take<bf16>(N * H);
    qg = a.take<bf16>(N * Hq * 2 * hd);
    dh = a.take<bf16>(N * H);
    dtmp = a.take<bf16>(N * H);
    dxn = a.take<bf16>(N * H);
    dhf = a.take<bf16>(N * H);
    dact = a.take<bf16>(N * I);
    dgu = a.take<bf16>(N * 2 * I);
    dmixed = a.take<bf16>(N * CD);
    dconv = a.take<bf16>(N * CD);
    dz = a.take<bf16>(N * VD);
    dab = a.take<bf16>(N * 2 * Hv);
    dcore = a.take<bf16>(N * VD);
    dy = a.take<bf16>(N * VD);
    dqn = a.take<bf16>(N * KD);
    dkn = a.take<bf16>(N * KD);
    dg = a.take<float>(N * Hv);
    dbeta = a.take<float>(N * Hv);
    dog = a.take<bf16>(N * Hq * hd);
    dao = a.take<bf16>(N * Hq * hd);
    dgate = a.take<bf16>(N * Hq * hd);
    dqr = a.take<bf16>(N * Hq * hd);
    dkr = a.take<bf16>(N * Hkv * hd);
    dvv = a.take<bf16>(N * Hkv * hd);
    dqg = a.take<bf16>(N * Hq * 2 * hd);
    scratch = std::max({scratch, K::rmsnorm_scratch_bytes(N, H), K::rmsnorm_scratch_bytes(N * Hq, hd),
                        K::rmsnorm_scratch_bytes(N * Hkv, hd), K::gated_rmsnorm_scratch_bytes(N * Hv, c.linear_value_head_dim),
                        K::gdn_gate_scratch_bytes(N, Hv), K::conv1d_scratch_bytes(N, CD, c.linear_conv_kernel_dim),
                        K::gated_delta_rule_scratch_bytes(gdn_dims(c, N, S), max_chunks()),
                        K::attention_scratch_bytes(attn_dims(c, N, S)),
                        cudnn_attn ? cudnn_attn->workspace_bytes() : size_t{0}});
    if (cudnn_attn) cudnn_meta = a.bytes(cudnn_attn->meta_bytes());
    op_scratch_bytes = scratch;
    op_scratch = a.bytes(scratch);
    ce_scratch = a.bytes(K::linear_cross_entropy_scratch_bytes(N, H, c.vocab_size, plan.ce_chunk_tokens));
    sumsq_scratch = a.bytes(K::sum_squares_scratch_bytes(P));
  }

  float* W(const std::string& name) { return w + spec(name).offset; }
  float* G(const std::string& name) { return gw + spec(name).offset; }
  bf16* WB(const std::string& name) { return wb + spec(name).offset; }
  const ParamSpec& spec(const std::string& name) const {
    auto it = by_name.find(name);
    DS_CHECK(it != by_name.end(), "gpu model: unknown parameter {}", name);
    return params[it->second];
  }
  static std::string L(int64_t i, const char* rest) { return "model.layers." + std::to_string(i) + "." + rest; }

  // ---------------------------------------------------------------------------------------------------------
  void upload_batch(const PackedBatch& b) {
    const int64_t N = b.size(), S = static_cast<int64_t>(b.cu_seqlens.size()) - 1;
    DS_CHECK(N <= plan.max_tokens && S <= plan.max_seqs,
             "gpu: batch of {} tokens / {} documents exceeds the plan ({} / {})", N, S, plan.max_tokens, plan.max_seqs);
    b.check(c);
    std::vector<int32_t> ss(static_cast<size_t>(N)), co(static_cast<size_t>(S + 1), 0);
    for (int64_t s = 0; s < S; ++s) {
      for (int32_t t = b.cu_seqlens[s]; t < b.cu_seqlens[s + 1]; ++t) ss[static_cast<size_t>(t)] = b.cu_seqlens[s];
      int64_t len = b.cu_seqlens[s + 1] - b.cu_seqlens[s];
      co[static_cast<size_t>(s + 1)] = co[static_cast<size_t>(s)] + static_cast<int32_t>((len + 63) / 64);
    }
    // Embedding backward grouping: positions sorted by id (stable), unique ids with offsets.
    std::vector<int32_t> pos(static_cast<size_t>(N));
    for (int64_t t = 0; t < N; ++t) pos[static_cast<size_t>(t)] = static_cast<int32_t>(t);
    std::stable_sort(pos.begin(), pos.end(), [&](int32_t x, int32_t y) { return b.input_ids[x] < b.input_ids[y]; });
    std::vector<int32_t> uniq, starts;
    for (int64_t i = 0; i < N; ++i) {
      if (i == 0 || b.input_ids[pos[i]] != b.input_ids[pos[i - 1]]) {
        uniq.push_back(b.input_ids[pos[i]]);
        starts.push_back(static_cast<int32_t>(i));
      }
    }
    starts.push_back(static_cast<int32_t>(N));
    num_uniq = static_cast<int64_t>(uniq.size());
    std::vector<float> ct(static_cast<size_t>(N * c.rotary_dim() / 2)), st(ct.size());
    ops::rope_tables(b.positions.data(), N, c.rotary_dim(), c.rope_theta, ct.data(), st.data());
    auto up = [&](void* dst, const void* src, size_t bytes) {
      if (bytes) DS_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream));
    };
    up(ids, b.input_ids.data(), N * 4);
    up(targets, b.targets.data(), N * 4);
    up(cu, b.cu_seqlens.data(), (S + 1) * 4);
    up(seq_start, ss.data(), N * 4);
    up(chunk_off, co.data(), (S + 1) * 4);
    up(emb_uniq, uniq.data(), uniq.size() * 4);
    up(emb_starts, starts.data(), starts.size() * 4);
    up(emb_pos, pos.data(), N * 4);
    up(cos_t, ct.data(), ct.size() * 4);
    up(sin_t, st.data(), st.size() * 4);
    total_chunks = co.back();
    max_seqlen = 0;
    for (int64_t s = 0; s < S; ++s) max_seqlen = std::max<int64_t>(max_seqlen, b.cu_seqlens[s + 1] - b.cu_seqlens[s]);
    cudnn_batch = false;
    if (cudnn_attn) {
      DS_CHECK(max_seqlen <= plan.max_seqlen, "gpu: a document of {} tokens exceeds the plan's max_seqlen {}",
               max_seqlen, plan.max_seqlen);
      cudnn_batch = cudnn_attn->set_batch(b.cu_seqlens.data(), S, cudnn_meta, stream);
      if (!cudnn_batch && !cudnn_warned) {
        cudnn_warned = true;
        log_warn("attention: a batch holds more short documents than cuDNN's smallest length buckets were built "
                 "for; such batches use the simple attention kernel");
      }
    }
    DS_CUDA_CHECK(cudaStreamSynchronize(stream));  // host vectors die at return
  }
  int64_t num_uniq = 0, total_chunks = 0, max_seqlen = 0;

  // ---------------------------------------------------------------------------------------------------------
  void gdn_forward(int64_t i, LayerBufs& Lb, int64_t N, int64_t S) {
    const int64_t H = c.hidden_size, CD = c.conv_dim(), KD = c.key_dim(), VD = c.value_dim(),
                  Hv = c.linear_num_value_heads, Hk = c.linear_num_key_heads, dk = c.linear_key_head_dim,
                  dv = c.linear_value_head_dim;
    K::linear_forward(Lb.xn1, WB(L(i, "linear_attn.in_proj_qkv.weight")), Lb.mixed, N, H, CD, false, stream);
    K::linear_forward(Lb.xn1, WB(L(i, "linear_attn.in_proj_z.weight")), Lb.z, N, H, VD, false, stream);
    // in_proj_b and in_proj_a are adjacent in the flat buffer: one [2Hv, H] GEMM gives [b | a] per token.
    K::linear_forward(Lb.xn1, WB(L(i, "linear_attn.in_proj_b.weight")), Lb.ab, N, H, 2 * Hv, false, stream);
    K::conv1d_silu_forward(Lb.mixed, W(L(i, "linear_attn.conv1d.weight")), seq_start, Lb.conv_out, N, CD,
                           c.linear_conv_kernel_dim, stream);
    K::l2norm_forward(Lb.conv_out, CD, Lb.qn, Lb.rq, N, Hk, dk, 1e-6f, stream);
    K::l2norm_forward(Lb.conv_out + KD, CD, Lb.kn, Lb.rk, N, Hk, dk, 1e-6f, stream);
    K::gdn_gate_forward(Lb.ab, W(L(i, "linear_attn.A_log")), W(L(i, "linear_attn.dt_bias")), Lb.g, Lb.beta, N, Hv,
                        stream);
    K::gated_delta_rule_forward(gdn_dims(c, N, S), Lb.qn, Lb.kn, Lb.conv_out + 2 * KD, CD, Lb.g, Lb.beta, cu, chunk_off,
                                total_chunks, Lb.core, Lb.states, stream);
    K::gated_rmsnorm_forward(Lb.core, Lb.z, W(L(i, "linear_attn.norm.weight")), Lb.y, Lb.rstd_g, N * Hv, dv,
                             static_cast<float>(c.rms_norm_eps), stream);
    K::linear_forward(Lb.y, WB(L(i, "linear_attn.out_proj.weight")), tmpH, N, VD, H, false, stream);
  }

  void gdn_backward(int64_t i, LayerBufs& Lb, int64_t N, int64_t S) {
    const int64_t H = c.hidden_size, CD = c.conv_dim(), KD = c.key_dim(), VD = c.value_dim(),
                  Hv = c.linear_num_value_heads, Hk = c.linear_num_key_heads, dk = c.linear_key_head_dim,
                  dv = c.linear_value_head_dim;
    // Recompute y, conv_out, qn, kn (shared buffers) exactly as gdn_forward made them.
    K::gated_rmsnorm_forward(Lb.core, Lb.z, W(L(i, "linear_attn.norm.weight")), Lb.y, Lb.rstd_g, N * Hv, dv,
                             static_cast<float>(c.rms_norm_eps), stream);
    K::conv1d_silu_forward(Lb.mixed, W(L(i, "linear_attn.conv1d.weight")), seq_start, Lb.conv_out, N, CD,
                           c.linear_conv_kernel_dim, stream);
    K::l2norm_forward(Lb.conv_out, CD, Lb.qn, Lb.rq, N, Hk, dk, 1e-6f, stream);
    K::l2norm_forward(Lb.conv_out + KD, CD, Lb.kn, Lb.rk, N, Hk, dk, 1e-6f, stream);
    K::linear_backward_data(dh, WB(L(i, "linear_attn.out_proj.weight")), dy, N, VD, H, false, stream);
    K::linear_backward_weight(dh, Lb.y, G(L(i, "linear_attn.out_proj.weight")), N, VD, H, stream);
    K::gated_rmsnorm_backward(Lb.core, Lb.z, W(L(i, "linear_attn.norm.weight")), Lb.rstd_g, dy, dcore, dz,
                              G(L(i, "linear_attn.norm.weight")), N * Hv, dv, op_scratch, stream);
    K::gated_delta_rule_backward(gdn_dims(c, N, S), Lb.qn, Lb.kn, Lb.conv_out + 2 * KD, CD, Lb.g, Lb.beta, cu,
                                 chunk_off, total_chunks, Lb.states, dcore, dqn, dkn, dconv + 2 * KD, CD, dg, dbeta,
                                 op_scratch, stream);
    K::l2norm_backward(Lb.qn, Lb.rq, dqn, dconv, CD, N, Hk, dk, stream);
    K::l2norm_backward(Lb.kn, Lb.rk, dkn, dconv + KD, CD, N, Hk, dk, stream);
    K::gdn_gate_backward(Lb.ab, W(L(i, "linear_attn.A_log")), W(L(i, "linear_attn.dt_bias")), dg, dbeta, dab,
                         G(L(i, "linear_attn.A_log")), G(L(i, "linear_attn.dt_bias")), N, Hv, op_scratch, stream);
    K::conv1d_silu_backward(Lb.mixed, W(L(i, "linear_attn.conv1d.weight")), dconv, seq_start, dmixed,
                            G(L(i, "linear_attn.conv1d.weight")), N, CD, c.linear_conv_kernel_dim, op_scratch, stream);
    K::linear_backward_data(dmixed, WB(L(i, "linear_attn.in_proj_qkv.weight")), dxn, N, H, CD, false, stream);
    K::linear_backward_data(dz, WB(L(i, "linear_attn.in_proj_z.weight")), dxn, N, H, VD, true, stream);
    K::linear_backward_data(dab, WB(L(i, "linear_attn.in_proj_b.weight")), dxn, N, H, 2 * Hv, true, stream);
    K::linear_backward_weight(dmixed, Lb.xn1, G(L(i, "linear_attn.in_proj_qkv.weight")), N, H, CD, stream);
    K::linear_backward_weight(dz, Lb.xn1, G(L(i, "linear_attn.in_proj_z.weight")), N, H, VD, stream);
    K::linear_backward_weight(dab, Lb.xn1, G(L(i, "linear_attn.in_proj_b.weight")), N, H, 2 * Hv, stream);
  }

  void attn_forward(int64_t i, LayerBufs& Lb, int64_t N, int64_t S) {
    const int64_t H = c.hidden_size, Hq = c.num_attention_heads, Hkv = c.num_key_value_heads, hd = c.head_dim;
    K::linear_forward(Lb.xn1, WB(L(i, "self_attn.q_proj.weight")), qg, N, H, Hq * 2 * hd, false, stream);
    // per head: [query (hd) | gate (hd)]
    K::copy_rows(qg, 2 * hd, Lb.qraw, hd, N * Hq, hd, stream);
    K::copy_rows(qg + hd, 2 * hd, Lb.graw, hd, N * Hq, hd, stream);
    K::linear_forward(Lb.xn1, WB(L(i, "self_attn.k_proj.weight")), Lb.kraw, N, H, Hkv * hd, false, stream);
    K::linear_forward(Lb.xn1, WB(L(i, "self_attn.v_proj.weight")), Lb.vraw, N, H, Hkv * hd, false, stream);
    const float eps = static_cast<float>(c.rms_norm_eps);
    K::rmsnorm_forward(Lb.qraw, W(L(i, "self_attn.q_norm.weight")), Lb.qr, Lb.rstd_q, N * Hq, hd, eps, true, stream);
    K::rmsnorm_forward(Lb.kraw, W(L(i, "self_attn.k_norm.weight")), Lb.kr, Lb.rstd_k, N * Hkv, hd, eps, true, stream);
    K::rope_apply(Lb.qr, N, Hq, hd, c.rotary_dim(), cos_t, sin_t, false, stream);
    K::rope_apply(Lb.kr, N, Hkv, hd, c.rotary_dim(), cos_t, sin_t, false, stream);
    if (cudnn_batch)
      cudnn_attn->forward(Lb.qr, Lb.kr, Lb.vraw, Lb.ao, Lb.lse, op_scratch, stream);
    else
      K::attention_forward(attn_dims(c, N, S), Lb.qr, Lb.kr, Lb.vraw, cu, max_seqlen, Lb.ao, Lb.lse, stream);
    K::output_gate_forward(Lb.ao, Lb.graw, Lb.og, N * Hq * hd, stream);
    K::linear_forward(Lb.og, WB(L(i, "self_attn.o_proj.weight")), tmpH, N, Hq * hd, H, false, stream);
  }

  void attn_backward(int64_t i, LayerBufs& Lb, int64_t N, int64_t S) {
    const int64_t H = c.hidden_size, Hq = c.num_attention_heads, Hkv = c.num_key_value_heads, hd = c.head_dim;
    K::output_gate_forward(Lb.ao, Lb.graw, Lb.og, N * Hq * hd, stream);  // recompute og (shared buffer)
    K::linear_backward_data(dh, WB(L(i, "self_attn.o_proj.weight")), dog, N, Hq * hd, H, false, stream);
    K::linear_backward_weight(dh, Lb.og, G(L(i, "self_attn.o_proj.weight")), N, Hq * hd, H, stream);
    K::output_gate_backward(Lb.ao, Lb.graw, dog, dao, dgate, N * Hq * hd, stream);
    if (cudnn_batch)
      cudnn_attn->backward(Lb.qr, Lb.kr, Lb.vraw, Lb.ao, Lb.lse, dao, dqr, dkr, dvv, op_scratch, stream);
    else
      K::attention_backward(attn_dims(c, N, S), Lb.qr, Lb.kr, Lb.vraw, Lb.ao, Lb.lse, dao, cu, max_seqlen, dqr, dkr, dvv,
                            op_scratch, stream);
    K::rope_apply(dqr, N, Hq, hd, c.rotary_dim(), cos_t, sin_t, true, stream);
    K::rope_apply(dkr, N, Hkv, hd, c.rotary_dim(), cos_t, sin_t, true, stream);
    K::rmsnorm_backward(Lb.qraw, W(L(i, "self_attn.q_norm.weight")), Lb.rstd_q, dqr, dqr,
                        G(L(i, "self_attn.q_norm.weight")), N * Hq, hd, true, op_scratch, stream);
    K::rmsnorm_backward(Lb.kraw, W(L(i, "self_attn.k_norm.weight")), Lb.rstd_k, dkr, dkr,
                        G(L(i, "self_attn.k_norm.weight")), N * Hkv, hd, true, op_scratch, stream);
    K::copy_rows(dqr, hd, dqg, 2 * hd, N * Hq, hd, stream);
    K::copy_rows(dgate, hd, dqg + hd, 2 * hd, N * Hq, hd, stream);
    K::linear_backward_data(dqg, WB(L(i, "self_attn.q_proj.weight")), dxn, N, H, Hq * 2 * hd, false, stream);
    K::linear_backward_data(dkr, WB(L(i, "self_attn.k_proj.weight")), dxn, N, H, Hkv * hd, true, stream);
    K::linear_backward_data(dvv, WB(L(i, "self_attn.v_proj.weight")), dxn, N, H, Hkv * hd, true, stream);
    K::linear_backward_weight(dqg, Lb.xn1, G(L(i, "self_attn.q_proj.weight")), N, H, Hq * 2 * hd, stream);
    K::linear_backward_weight(dkr, Lb.xn1, G(L(i, "self_attn.k_proj.weight")), N, H, Hkv * hd, stream);
    K::linear_backward_weight(dvv, Lb.xn1, G(L(i, "self_attn.v_proj.weight")), N, H, Hkv * hd, stream);
  }

  // Decoder layer i: hs[i] -> hs[i+1] (qwen35_model.md §2.3).
  void layer_forward(int64_t i, int64_t N, int64_t S) {
    const int64_t H = c.hidden_size, I = c.intermediate_size;
    LayerBufs& Lb = layers[static_cast<size_t>(i)];
    const float eps = static_cast<float>(c.rms_norm_eps);
    K::rmsnorm_forward(hs[i], W(L(i, "input_layernorm.weight")), Lb.xn1, Lb.rstd1, N, H, eps, true, stream);
    if (c.is_full_attention(i)) attn_forward(i, Lb, N, S);
    else gdn_forward(i, Lb, N, S);
    K::add(hs[i], tmpH, Lb.h_mid, N * H, stream);
    K::rmsnorm_forward(Lb.h_mid, W(L(i, "post_attention_layernorm.weight")), Lb.xn2, Lb.rstd2, N, H, eps, true, stream);
    // gate_proj and up_proj are adjacent: one [2I, H] GEMM gives [gate | up] per token.
    K::linear_forward(Lb.xn2, WB(L(i, "mlp.gate_proj.weight")), Lb.gu, N, H, 2 * I, false, stream);
    K::swiglu_forward(Lb.gu, Lb.act, N, I, stream);
    K::linear_forward(Lb.act, WB(L(i, "mlp.down_proj.weight")), tmpH, N, I, H, false, stream);
    K::add(Lb.h_mid, tmpH, hs[i + 1], N * H, stream);
  }

  // dh holds d hs[i+1] on entry and d hs[i] on exit.
  void layer_backward(int64_t i, int64_t N, int64_t S) {
    const int64_t H = c.hidden_size, I = c.intermediate_size;
    LayerBufs& Lb = layers[static_cast<size_t>(i)];
    const float eps = static_cast<float>(c.rms_norm_eps);
    // Recompute act and xn2 (shared buffers) exactly as layer_forward made them.
    K::swiglu_forward(Lb.gu, Lb.act, N, I, stream);
    K::rmsnorm_forward(Lb.h_mid, W(L(i, "post_attention_layernorm.weight")), Lb.xn2, Lb.rstd2, N, H, eps, true, stream);
    K::linear_backward_data(dh, WB(L(i, "mlp.down_proj.weight")), dact, N, I, H, false, stream);
    K::linear_backward_weight(dh, Lb.act, G(L(i, "mlp.down_proj.weight")), N, I, H, stream);
    K::swiglu_backward(Lb.gu, dact, dgu, N, I, stream);
    K::linear_backward_data(dgu, WB(L(i, "mlp.gate_proj.weight")), dxn, N, H, 2 * I, false, stream);
    K::linear_backward_weight(dgu, Lb.xn2, G(L(i, "mlp.gate_proj.weight")), N, H, 2 * I, stream);
    K::rmsnorm_backward(Lb.h_mid, W(L(i, "post_attention_layernorm.weight")), Lb.rstd2, dxn, dtmp,
                        G(L(i, "post_attention_layernorm.weight")), N, H, true, op_scratch, stream);
    K::add(dh, dtmp, dh, N * H, stream);
    K::rmsnorm_forward(hs[i], W(L(i, "input_layernorm.weight")), Lb.xn1, Lb.rstd1, N, H, eps, true, stream);  // xn1
    if (c.is_full_attention(i)) attn_backward(i, Lb, N, S);
    else gdn_backward(i, Lb, N, S);
    K::rmsnorm_backward(hs[i], W(L(i, "input_layernorm.weight")), Lb.rstd1, dxn, dtmp, G(L(i, "input_layernorm.weight")),
                        N, H, true, op_scratch, stream);
    K::add(dh, dtmp, dh, N * H, stream);
  }

  const std::string& lm_name() const {
    static const std::string tied = "model.embed_tokens.weight", untied = "lm_head.weight";
    return c.tie_word_embeddings ? tied : untied;
  }

  LossResult run(const PackedBatch& b, double grad_scale, double z_loss, ForwardCapture* cap) {
    upload_batch(b);
    const int64_t N = b.size(), S = static_cast<int64_t>(b.cu_seqlens.size()) - 1, H = c.hidden_size;
    K::embedding_forward(ids, WB("model.embed_tokens.weight"), hs[0], N, H, stream);
    for (int64_t i = 0; i < c.num_hidden_layers; ++i) layer_forward(i, N, S);
    K::rmsnorm_forward(hs[c.num_hidden_layers], W("model.norm.weight"), hf, rstd_f, N, H,
                       static_cast<float>(c.rms_norm_eps), true, stream);
    const bool backward = grad_scale != 0.0;
    ops::LinearCeOptions opt;
    opt.z_loss = z_loss;
    opt.grad_scale = grad_scale;
    opt.chunk_tokens = plan.ce_chunk_tokens;
    if (cap) capture(cap, N);
    K::linear_cross_entropy(hf, WB(lm_name()), targets, N, H, c.vocab_size, opt, loss_dev, backward ? dhf : nullptr,
                            backward ? G(lm_name()) : nullptr, ce_scratch, stream);
    double loss[2];
    DS_CUDA_CHECK(cudaMemcpyAsync(loss, loss_dev, sizeof(loss), cudaMemcpyDeviceToHost, stream));
    LossResult r;
    r.num_valid = b.num_targets();
    if (backward) {
      K::rmsnorm_backward(hs[c.num_hidden_layers], W("model.norm.weight"), rstd_f, dhf, dh, G("model.norm.weight"),
                          N, H, true, op_scratch, stream);
      for (int64_t i = c.num_hidden_layers - 1; i >= 0; --i) layer_backward(i, N, S);
      K::embedding_backward(emb_uniq, emb_starts, emb_pos, num_uniq, dh, G("model.embed_tokens.weight"), H, stream);
    }
    DS_CUDA_CHECK(cudaStreamSynchronize(stream));
    note_peak();
    r.loss_sum = loss[0];
    r.z_loss_sum = loss[1];
    return r;
  }

  // Hidden states (bf16 -> fp32) and full fp32 logits, for `deltastack forward --device cuda` on small inputs.
  void capture(ForwardCapture* cap, int64_t N) {
    const int64_t H = c.hidden_size, V = c.vocab_size;
    auto down_bf16 = [&](const bf16* src, int64_t n) {
      std::vector<uint16_t> raw(static_cast<size_t>(n));
      DS_CUDA_CHECK(cudaMemcpyAsync(raw.data(), src, n * 2, cudaMemcpyDeviceToHost, stream));
      DS_CUDA_CHECK(cudaStreamSynchronize(stream));
      std::vector<float> out(raw.size());
      for (size_t k = 0; k < raw.size(); ++k) out[k] = bf16_bits_to_f32(raw[k]);
      return out;
    };
    if (cap->hidden_states) {
      cap->hidden.clear();
      for (int64_t i = 0; i < c.num_hidden_layers; ++i) cap->hidden.push_back(down_bf16(hs[i], N * H));
      cap->hidden.push_back(down_bf16(hf, N * H));
    }
    if (cap->logits) {
      float* logits = nullptr;  // a one-off tool path, outside any training loop
      DS_CUDA_CHECK(cudaMalloc(&logits, static_cast<size_t>(N * V) * sizeof(float)));
      K::gemm(false, true, N, V, H, 1.0f, hf, H, WB(lm_name()), H, 0.0f, logits, true, V, stream);
      cap->logits_values.resize(static_cast<size_t>(N * V));
      DS_CUDA_CHECK(cudaMemcpyAsync(cap->logits_values.data(), logits, N * V * sizeof(float), cudaMemcpyDeviceToHost,
                                    stream));
      DS_CUDA_CHECK(cudaStreamSynchronize(stream));
      DS_CUDA_CHECK(cudaFree(logits));
    }
  }

  float* buffer(Buffer which) const;

  void note_peak() {
    size_t free_b = 0, total_b = 0;
    if (cudaMemGetInfo(&free_b, &total_b) == cudaSuccess) peak = std::max(peak, total_b - free_b);
  }
};

GpuModel::GpuModel(const Qwen35Model& host, const GpuPlan& plan) : impl_(std::make_unique<Impl>()) {
  DS_CHECK(cuda_device_count() > 0, "--device cuda: no CUDA device is available");
  DS_CHECK(plan.max_tokens > 0 && plan.max_seqs > 0, "gpu plan: max_tokens and max_seqs must be positive");
  // Numeric self-probe of every CUDA op against the CPU reference (once per process); a failing kernel stops
  // here with its op name, error and band instead of training on wrong numbers.
  ops::require_cuda_backends();
  Impl& m = *impl_;
  m.c = host.config();
  // Shapes the CUDA kernels are instantiated for (docs/cuda_backend.md); others need --device cpu.
  auto one_of = [](int64_t v, std::initializer_list<int64_t> ok) { return std::find(ok.begin(), ok.end(), v) != ok.end(); };
  DS_CHECK(one_of(m.c.linear_key_head_dim, {16, 32, 64, 128}) && one_of(m.c.linear_value_head_dim, {16, 32, 64, 128}),
           "--device cuda: linear_key_head_dim / linear_value_head_dim must be 16, 32, 64 or 128 (got {} / {}); use "
           "--device cpu", m.c.linear_key_head_dim, m.c.linear_value_head_dim);
  DS_CHECK(one_of(m.c.head_dim, {32, 64, 128, 256}), "--device cuda: head_dim must be 32, 64, 128 or 256 (got {}); use "
           "--device cpu", m.c.head_dim);
  DS_CHECK(m.c.linear_conv_kernel_dim <= 4, "--device cuda: linear_conv_kernel_dim must be at most 4 (got {})",
           m.c.linear_conv_kernel_dim);
  m.params = host.params();
  for (size_t i = 0; i < m.params.size(); ++i) m.by_name[m.params[i].name] = i;
  m.plan = plan;
  m.P = host.num_parameters();
  if (m.plan.max_seqlen <= 0) m.plan.max_seqlen = m.plan.max_tokens;
  DS_CHECK(m.plan.max_seqlen <= m.plan.max_tokens, "gpu: max_seqlen {} exceeds max_tokens {}", m.plan.max_seqlen,
           m.plan.max_tokens);
  DS_CUDA_CHECK(cudaStreamCreateWithFlags(&m.stream, cudaStreamNonBlocking));
  bool has_attention = false;
  for (int64_t i = 0; i < m.c.num_hidden_layers; ++i) has_attention = has_attention || m.c.is_full_attention(i);
  if (has_attention && ops::select_backend("attention", "cuda").name.rfind("cudnn", 0) == 0) {
    ops::cudnn::AttnBounds ab{m.plan.max_tokens, m.plan.max_seqs, m.plan.max_seqlen, m.c.num_attention_heads,
                              m.c.num_key_value_heads, m.c.head_dim, attn_dims(m.c, 1, 1).scale, m.plan.rows};
    try {
      m.cudnn_attn = std::make_unique<ops::cudnn::Attention>(ab);
    } catch (const std::exception& e) {
      log_warn("attention: {}; using the simple attention kernel", e.what());
    }
  }
  Arena sizing;
  m.layout(sizing);
  m.arena_bytes = sizing.off;
  size_t free_b = 0, total_b = 0;
  DS_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  if (m.cudnn_attn && m.arena_bytes + (512u << 20) >= free_b) {
    // cuDNN's deterministic backward keeps an S^2 workspace; when that is what does not fit, drop to the simple
    // kernel (no workspace) rather than fail.
    log_warn("attention: the plan with cuDNN's {:.2f} GiB workspace does not fit in {:.2f} GiB free; using the "
             "simple attention kernel", m.cudnn_attn->workspace_bytes() / 1073741824.0, free_b / 1073741824.0);
    m.cudnn_attn.reset();
    sizing = Arena{};
    m.layout(sizing);
    m.arena_bytes = sizing.off;
  }
  DS_CHECK(m.arena_bytes + (512u << 20) < free_b,
           "gpu: the memory plan needs {:.2f} GiB but only {:.2f} GiB is free; lower --micro-batch or --seq-len",
           m.arena_bytes / 1073741824.0, free_b / 1073741824.0);
  DS_CUDA_CHECK(cudaMalloc(&m.arena_base, m.arena_bytes));
  Arena real;
  real.base = m.arena_base;
  m.layout(real);
  DS_CUDA_CHECK(cudaMemcpy(m.w, host.weights().data(), m.P * sizeof(float), cudaMemcpyHostToDevice));
  DS_CUDA_CHECK(cudaMemset(m.gw, 0, m.P * sizeof(float)));
  DS_CUDA_CHECK(cudaMemset(m.m, 0, m.P * sizeof(float)));
  DS_CUDA_CHECK(cudaMemset(m.v, 0, m.P * sizeof(float)));
  K::to_bf16(m.w, m.wb, m.P, m.stream);
  DS_CUDA_CHECK(cudaStreamSynchronize(m.stream));
  m.note_peak();
  log_info("gpu: {} ({}), one allocation of {:.2f} GiB for {} tokens x {} documents per micro-batch",
           cuda_device_name(), "bf16 compute, fp32 master", m.arena_bytes / 1073741824.0, plan.max_tokens,
           plan.max_seqs);
}

GpuModel::~GpuModel() {
  if (impl_) {
    impl_->cudnn_attn.reset();  // its handle and plans before the stream and memory they were used with
    if (impl_->arena_base) cudaFree(impl_->arena_base);
    if (impl_->stream) cudaStreamDestroy(impl_->stream);
  }
}

LossResult GpuModel::forward_backward(const PackedBatch& batch, double grad_scale, double z_loss,
                                      ForwardCapture* capture) {
  return impl_->run(batch, grad_scale, z_loss, capture);
}

void GpuModel::zero_grads() {
  DS_CUDA_CHECK(cudaMemsetAsync(impl_->gw, 0, impl_->P * sizeof(float), impl_->stream));
}

double GpuModel::grad_sum_squares() {
  K::sum_squares(impl_->gw, impl_->P, impl_->sumsq_dev, impl_->sumsq_scratch, impl_->stream);
  double s = 0;
  DS_CUDA_CHECK(cudaMemcpyAsync(&s, impl_->sumsq_dev, sizeof(double), cudaMemcpyDeviceToHost, impl_->stream));
  DS_CUDA_CHECK(cudaStreamSynchronize(impl_->stream));
  return s;
}

void GpuModel::adamw_step(const ops::AdamWParams& p, double weight_decay) {
  Impl& m = *impl_;
  for (const ParamSpec& s : m.params) {
    ops::AdamWParams q = p;
    q.weight_decay = s.weight_decay ? weight_decay : 0.0;
    K::adamw_update(m.w + s.offset, m.gw + s.offset, m.m + s.offset, m.v + s.offset, m.wb + s.offset, s.numel, q,
                    m.stream);
  }
  DS_CUDA_CHECK(cudaStreamSynchronize(m.stream));
}

float* GpuModel::Impl::buffer(Buffer which) const {
  switch (which) {
    case Buffer::Weights: return w;
    case Buffer::Grads: return gw;
    case Buffer::ExpAvg: return m;
    case Buffer::ExpAvgSq: return v;
  }
  return nullptr;
}

void GpuModel::read(Buffer which, int64_t first, int64_t count, float* dst) const {
  DS_CHECK(first >= 0 && count >= 0 && first + count <= impl_->P, "gpu: read of [{}, {}) outside the {} parameters",
           first, first + count, impl_->P);
  if (count == 0) return;
  DS_CUDA_CHECK(cudaMemcpyAsync(dst, impl_->buffer(which) + first, count * sizeof(float), cudaMemcpyDeviceToHost,
                                impl_->stream));
  DS_CUDA_CHECK(cudaStreamSynchronize(impl_->stream));
}

void GpuModel::write(Buffer which, int64_t first, int64_t count, const float* src) {
  DS_CHECK(first >= 0 && count >= 0 && first + count <= impl_->P, "gpu: write of [{}, {}) outside the {} parameters",
           first, first + count, impl_->P);
  if (count == 0) return;
  DS_CUDA_CHECK(cudaMemcpyAsync(impl_->buffer(which) + first, src, count * sizeof(float), cudaMemcpyHostToDevice,
                                impl_->stream));
  DS_CUDA_CHECK(cudaStreamSynchronize(impl_->stream));
}

void GpuModel::download_grads(std::vector<float>& out) const {
  out.resize(static_cast<size_t>(impl_->P));
  read(Buffer::Grads, 0, impl_->P, out.data());
}
size_t GpuModel::planned_bytes() const { return impl_->arena_bytes; }
size_t GpuModel::peak_bytes() const { return impl_->peak; }

}  // namespace ds

#else  // !DELTASTACK_CUDA

namespace ds {
struct GpuModel::Impl {};
GpuModel::GpuModel(const Qwen35Model&, const GpuPlan&) {
  fail("--device cuda: this build has no CUDA support (configure with -DDELTASTACK_CUDA=ON and nvcc on PATH)");
}
GpuModel::~GpuModel() = default;
LossResult GpuModel::forward_backward(const PackedBatch&, double, double, ForwardCapture*) { return {}; }
void GpuModel::zero_grads() {}
double GpuModel::grad_sum_squares() { return 0; }
void GpuModel::adamw_step(const ops::AdamWParams&, double) {}
void GpuModel::read(Buffer, int64_t, int64_t, float*) const {}
void GpuModel::write(Buffer, int64_t, int64_t, const float*) {}
void GpuModel::download_grads(std::vector<float>&) const {}
size_t GpuModel::planned_bytes() const { return 0; }
size_t GpuModel::peak_bytes() const { return 0; }
}  // namespace ds

#endif
