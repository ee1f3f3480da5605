#include "model/params.h"

#include <map>
#include <string>

#include "core/error.h"

namespace ds {

ParamLayout::ParamLayout(const ModelConfig& c, const std::vector<ParamSpec>& params) {
  std::map<std::string, const ParamSpec*> by_name;
  for (const ParamSpec& p : params) by_name[p.name] = &p;
  // Offset of `name`, after checking its shape.
  auto at = [&](const std::string& name, std::vector<int64_t> shape) {
    auto it = by_name.find(name);
    DS_CHECK(it != by_name.end(), "parameter layout: {} is missing", name);
    DS_CHECK(it->second->shape == shape, "parameter layout: {} has an unexpected shape", name);
    return it->second->offset;
  };
  // Offset of `second`, which must start where `first` (at offset `first_off`, numel elements) ends.
  auto adjacent = [&](const std::string& first, int64_t first_off, int64_t numel, const std::string& second,
                      std::vector<int64_t> shape) {
    const int64_t off = at(second, std::move(shape));
    DS_CHECK(off == first_off + numel,
             "parameter layout: {} must directly follow {} in the flat buffer (one fused GEMM reads both)", second,
             first);
    return off;
  };
  const int64_t H = c.hidden_size, I = c.intermediate_size, Hv = c.linear_num_value_heads;
  model_.embed_tokens = at("model.embed_tokens.weight", {c.vocab_size, H});
  model_.norm = at("model.norm.weight", {H});
  model_.lm_head = c.tie_word_embeddings ? model_.embed_tokens : at("lm_head.weight", {c.vocab_size, H});
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const std::string L = "model.layers." + std::to_string(i) + ".";
    LayerParams<int64_t> o{};
    o.full_attention = c.is_full_attention(i);
    o.input_layernorm = at(L + "input_layernorm.weight", {H});
    o.post_attention_layernorm = at(L + "post_attention_layernorm.weight", {H});
    if (o.full_attention) {
      const int64_t Hq = c.num_attention_heads, Hkv = c.num_key_value_heads, hd = c.head_dim;
      o.attn.q_proj = at(L + "self_attn.q_proj.weight", {Hq * hd * 2, H});
      o.attn.k_proj = at(L + "self_attn.k_proj.weight", {Hkv * hd, H});
      o.attn.v_proj = at(L + "self_attn.v_proj.weight", {Hkv * hd, H});
      o.attn.o_proj = at(L + "self_attn.o_proj.weight", {H, Hq * hd});
      o.attn.q_norm = at(L + "self_attn.q_norm.weight", {hd});
      o.attn.k_norm = at(L + "self_attn.k_norm.weight", {hd});
    } else {
      o.gdn.in_proj_qkv = at(L + "linear_attn.in_proj_qkv.weight", {c.conv_dim(), H});
      o.gdn.in_proj_z = at(L + "linear_attn.in_proj_z.weight", {c.value_dim(), H});
      o.gdn.in_proj_ba = at(L + "linear_attn.in_proj_b.weight", {Hv, H});
      o.gdn.in_proj_a = adjacent(L + "linear_attn.in_proj_b.weight", o.gdn.in_proj_ba, Hv * H,
                                 L + "linear_attn.in_proj_a.weight", {Hv, H});
      o.gdn.conv1d = at(L + "linear_attn.conv1d.weight", {c.conv_dim(), 1, c.linear_conv_kernel_dim});
      o.gdn.dt_bias = at(L + "linear_attn.dt_bias", {Hv});
      o.gdn.A_log = at(L + "linear_attn.A_log", {Hv});
      o.gdn.norm = at(L + "linear_attn.norm.weight", {c.linear_value_head_dim});
      o.gdn.out_proj = at(L + "linear_attn.out_proj.weight", {H, c.value_dim()});
    }
    o.mlp.gate_up = at(L + "mlp.gate_proj.weight", {I, H});
    o.mlp.up = adjacent(L + "mlp.gate_proj.weight", o.mlp.gate_up, I * H, L + "mlp.up_proj.weight", {I, H});
    o.mlp.down = at(L + "mlp.down_proj.weight", {H, I});
    layers_.push_back(o);
  }
}

}  // namespace ds
