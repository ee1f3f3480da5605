// Typed views of the model's parameters: where each tensor of each layer sits in a flat parameter buffer,
// resolved by name once (ParamLayout, from the ParamSpec table of model.h) and then used by both engines as
// plain pointers (no name lookups in a step). Shapes follow the HF checkpoint (docs/model.md §5.3); H =
// hidden_size, I = intermediate_size, CD = conv_dim, KD = key_dim, VD = value_dim, Hv = linear_num_value_heads,
// Hq = num_attention_heads, Hkv = num_key_value_heads, hd = head_dim, K = linear_conv_kernel_dim.
//
// Fused views: the GPU engine runs gate_proj|up_proj as one [2I, H] GEMM and in_proj_b|in_proj_a as one [2Hv, H]
// GEMM. That needs the second tensor to start exactly where the first ends in the flat buffer; ParamLayout checks
// this adjacency when it is built (ds::Error otherwise), so a change to the parameter order cannot silently
// break those GEMMs.
#pragma once
#include <cstdint>
#include <vector>

#include <string>

#include "model/config.h"

namespace ds {

// One parameter of the flat buffers (both engines lay them out in this order).
struct ParamSpec {
  std::string name;             // HF name, e.g. "model.layers.0.linear_attn.A_log"
  std::vector<int64_t> shape;   // HF shape
  int64_t offset = 0;           // into the flat buffer (floats)
  int64_t numel = 0;
  bool weight_decay = false;    // matrices decay; norms, A_log, dt_bias, conv taps do not
};


// P is int64_t (offsets into the flat buffer, in elements) or a pointer type (a view of one buffer).
template <typename P>
struct MlpParams {
  P gate_up;  // [2I, H]: gate_proj rows, then up_proj rows (HF mlp.gate_proj.weight, mlp.up_proj.weight)
  P up;       // [I, H]: == gate_up + I*H
  P down;     // [H, I]  mlp.down_proj.weight
};

template <typename P>
struct GdnParams {
  P in_proj_qkv;  // [CD, H]: q (KD) | k (KD) | v (VD) rows
  P in_proj_z;    // [VD, H]
  P in_proj_ba;   // [2Hv, H]: in_proj_b rows, then in_proj_a rows
  P in_proj_a;    // [Hv, H]: == in_proj_ba + Hv*H
  P conv1d;       // [CD, 1, K]
  P dt_bias;      // [Hv]
  P A_log;        // [Hv]
  P norm;         // [dv]  linear_attn.norm.weight (gated RMSNorm, plain weight)
  P out_proj;     // [H, VD]
};

template <typename P>
struct AttnParams {
  P q_proj;  // [Hq*2*hd, H]: per head, hd query rows then hd gate rows
  P k_proj;  // [Hkv*hd, H]
  P v_proj;  // [Hkv*hd, H]
  P o_proj;  // [H, Hq*hd]
  P q_norm;  // [hd] zero-centered
  P k_norm;  // [hd] zero-centered
};

template <typename P>
struct LayerParams {
  bool full_attention = false;     // attention layer (attn valid) or Gated DeltaNet layer (gdn valid)
  P input_layernorm;               // [H] zero-centered
  P post_attention_layernorm;      // [H] zero-centered
  GdnParams<P> gdn;
  AttnParams<P> attn;
  MlpParams<P> mlp;
};

template <typename P>
struct ModelParams {
  P embed_tokens;  // [V, H]
  P norm;          // [H] final zero-centered norm
  P lm_head;       // [V, H]: == embed_tokens when tie_word_embeddings
};

// A GEMM operand (a 2-D weight: the projections, the embedding and lm_head), which the GPU engine reads in bf16;
// every other parameter (norm weights, conv taps, A_log, dt_bias) it reads in fp32.
inline bool is_matrix(const ParamSpec& p) { return p.shape.size() == 2; }

// Every offset of o through f (an int64_t -> Q function), keeping full_attention and leaving the other mixer's
// fields value-initialised.
template <typename F>
auto map_layer(const LayerParams<int64_t>& o, F f) {
  using Q = decltype(f(int64_t{}));
  LayerParams<Q> v{};
  v.full_attention = o.full_attention;
  v.input_layernorm = f(o.input_layernorm);
  v.post_attention_layernorm = f(o.post_attention_layernorm);
  if (o.full_attention) {
    v.attn = {f(o.attn.q_proj), f(o.attn.k_proj), f(o.attn.v_proj), f(o.attn.o_proj), f(o.attn.q_norm), f(o.attn.k_norm)};
  } else {
    v.gdn = {f(o.gdn.in_proj_qkv), f(o.gdn.in_proj_z), f(o.gdn.in_proj_ba), f(o.gdn.in_proj_a), f(o.gdn.conv1d),
             f(o.gdn.dt_bias),     f(o.gdn.A_log),     f(o.gdn.norm),       f(o.gdn.out_proj)};
  }
  v.mlp = {f(o.mlp.gate_up), f(o.mlp.up), f(o.mlp.down)};
  return v;
}
template <typename F>
auto map_model(const ModelParams<int64_t>& o, F f) {
  using Q = decltype(f(int64_t{}));
  return ModelParams<Q>{f(o.embed_tokens), f(o.norm), f(o.lm_head)};
}

// Offsets of every parameter, resolved from the ParamSpec table once. Throws ds::Error naming the parameter when
// one is missing or has an unexpected shape, or when a fused pair is not adjacent.
class ParamLayout {
 public:
  ParamLayout(const ModelConfig& c, const std::vector<ParamSpec>& params);

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }
  const LayerParams<int64_t>& layer_offsets(int64_t i) const { return layers_[static_cast<size_t>(i)]; }
  const ModelParams<int64_t>& model_offsets() const { return model_; }

  // The same layout with every offset replaced by f(offset) (a buffer that holds only some parameters, compacted:
  // f returns -1 for the ones it does not hold).
  template <typename F>
  ParamLayout remapped(F f) const {
    ParamLayout r;
    for (const LayerParams<int64_t>& o : layers_) r.layers_.push_back(map_layer(o, f));
    r.model_ = map_model(model_, f);
    return r;
  }

  // Views of one flat buffer (weights, gradients, a bf16 compute copy: any element type); an offset of -1 (a
  // parameter the buffer does not hold, see remapped) gives nullptr.
  template <typename T>
  LayerParams<T*> layer(int64_t i, T* base) const {
    return map_layer(layer_offsets(i), at(base));
  }
  template <typename T>
  ModelParams<T*> model(T* base) const {
    return map_model(model_, at(base));
  }

 private:
  ParamLayout() = default;
  template <typename T>
  static auto at(T* base) {
    return [base](int64_t off) -> T* { return off < 0 ? nullptr : base + off; };
  }
  std::vector<LayerParams<int64_t>> layers_;
  ModelParams<int64_t> model_{};
};

}  // namespace ds
