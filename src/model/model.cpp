#include "model/model.h"

#include <memory>
#include <set>
#include <string_view>
#include <unordered_map>

#include <algorithm>
#include <cmath>
#include <filesystem>

#include "core/cu_seqlens.h"
#include "core/error.h"
#include "core/files.h"
#include "core/fp8.h"
#include "core/log.h"
#include "core/numerics.h"
#include "core/rng.h"
#include "model/dims.h"
#include "model/gpu_fp8.h"
#include "ops/attention/attention.h"
#include "ops/conv1d/conv1d.h"
#include "ops/embedding/embedding.h"
#include "ops/gated_delta_rule/dispatch.h"
#include "ops/gated_rmsnorm/gated_rmsnorm.h"
#include "ops/gdn_gate/gdn_gate.h"
#include "ops/l2norm/l2norm.h"
#include "ops/linear/linear.h"
#include "ops/linear_cross_entropy/linear_cross_entropy.h"
#include "ops/rmsnorm/rmsnorm.h"
#include "ops/rope/rope.h"
#include "ops/swiglu/swiglu.h"

namespace ds {

using Buf = std::vector<float>;

// ---------------------------------------------------------------------------------------------------------------
// Parameters

std::vector<ParamSpec> qwen35_params(const ModelConfig& c) {
  std::vector<ParamSpec> params;
  auto add = [&](const std::string& name, std::vector<int64_t> shape, bool decay) {
    ParamSpec p;
    p.name = name;
    p.numel = 1;
    for (int64_t d : shape) p.numel *= d;
    p.shape = std::move(shape);
    p.offset = params.empty() ? 0 : params.back().offset + params.back().numel;
    p.weight_decay = decay;
    params.push_back(std::move(p));
  };
  const int64_t H = c.hidden_size, I = c.intermediate_size;
  add("model.embed_tokens.weight", {c.vocab_size, H}, true);
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    std::string L = "model.layers." + std::to_string(i) + ".";
    add(L + "input_layernorm.weight", {H}, false);
    if (c.is_full_attention(i)) {
      add(L + "self_attn.q_proj.weight", {c.num_attention_heads * c.head_dim * 2, H}, true);
      add(L + "self_attn.k_proj.weight", {c.num_key_value_heads * c.head_dim, H}, true);
      add(L + "self_attn.v_proj.weight", {c.num_key_value_heads * c.head_dim, H}, true);
      add(L + "self_attn.o_proj.weight", {H, c.num_attention_heads * c.head_dim}, true);
      add(L + "self_attn.q_norm.weight", {c.head_dim}, false);
      add(L + "self_attn.k_norm.weight", {c.head_dim}, false);
    } else {
      add(L + "linear_attn.in_proj_qkv.weight", {c.conv_dim(), H}, true);
      add(L + "linear_attn.in_proj_z.weight", {c.value_dim(), H}, true);
      add(L + "linear_attn.in_proj_b.weight", {c.linear_num_value_heads, H}, true);
      add(L + "linear_attn.in_proj_a.weight", {c.linear_num_value_heads, H}, true);
      add(L + "linear_attn.conv1d.weight", {c.conv_dim(), 1, c.linear_conv_kernel_dim}, false);
      add(L + "linear_attn.dt_bias", {c.linear_num_value_heads}, false);
      add(L + "linear_attn.A_log", {c.linear_num_value_heads}, false);
      add(L + "linear_attn.norm.weight", {c.linear_value_head_dim}, false);
      add(L + "linear_attn.out_proj.weight", {H, c.value_dim()}, true);
    }
    add(L + "post_attention_layernorm.weight", {H}, false);
    add(L + "mlp.gate_proj.weight", {I, H}, true);
    add(L + "mlp.up_proj.weight", {I, H}, true);
    add(L + "mlp.down_proj.weight", {H, I}, true);
  }
  add("model.norm.weight", {H}, false);
  if (!c.tie_word_embeddings) add("lm_head.weight", {c.vocab_size, H}, true);
  return params;
}

std::vector<ParamUnit> param_units(const ModelConfig& c, const std::vector<ParamSpec>& params) {
  std::unordered_map<std::string_view, int64_t> offsets;  // one pass: a scan per layer is quadratic in the layers
  for (const ParamSpec& p : params) offsets.emplace(p.name, p.offset);
  auto offset_of = [&](const std::string& name) {
    const auto it = offsets.find(name);
    DS_CHECK(it != offsets.end(), "param_units: no parameter {}", name);
    return it->second;
  };
  // Each unit starts at its first tensor (qwen35_params' order) and ends where the next one starts.
  std::vector<int64_t> starts{offset_of("model.embed_tokens.weight")};
  for (int64_t i = 0; i < c.num_hidden_layers; ++i)
    starts.push_back(offset_of("model.layers." + std::to_string(i) + ".input_layernorm.weight"));
  starts.push_back(offset_of("model.norm.weight"));
  const int64_t end = params.back().offset + params.back().numel;
  std::vector<ParamUnit> units;
  for (size_t u = 0; u < starts.size(); ++u) {
    const int64_t hi = u + 1 < starts.size() ? starts[u + 1] : end;
    DS_CHECK(starts[u] < hi, "param_units: unit {} is empty or out of order", u);
    units.push_back({starts[u], hi});
  }
  DS_CHECK(units.front().lo == 0, "param_units: the embedding is not first");
  return units;
}

std::vector<int64_t> Qwen35Model::unit_order(bool backward) const {
  const int64_t L = cfg_.num_hidden_layers;
  std::vector<int64_t> order;
  for (int64_t u = 0; u <= L + 1; ++u) order.push_back(u);  // embedding, layers, head
  if (cfg_.tie_word_embeddings) order.push_back(0);         // lm_head
  if (backward)
    for (int64_t i = L - 1; i >= 0; --i) order.push_back(1 + i);
  return order;
}

Qwen35Model::Qwen35Model(ModelConfig config) : Qwen35Model(std::move(config), Deferred{}) {
  weights_.assign(static_cast<size_t>(num_parameters()), 0.0f);
}

Qwen35Model::Qwen35Model(ModelConfig config, Deferred) : cfg_(std::move(config)) {
  cfg_.validate();
  params_ = qwen35_params(cfg_);
  for (size_t i = 0; i < params_.size(); ++i) by_name_[params_[i].name] = i;
  layout_ = std::make_shared<const ParamLayout>(cfg_, params_);
  units_ = param_units(cfg_, params_);
}

void Qwen35Model::defer_init(uint64_t seed) {
  std::vector<float>().swap(weights_);
  // By value: the model may be moved before the values are taken.
  deferred_ = [cfg = cfg_, params = params_, seed](size_t k, float* dst) { init_param(cfg, params, k, seed, dst); };
}

void Qwen35Model::defer_load(const std::string& path) {
  std::vector<float>().swap(weights_);
  auto ck = std::make_shared<const CheckpointWeights>(path, cfg_, params_);
  const size_t embed = by_name_.at("model.embed_tokens.weight");
  deferred_ = [ck, params = params_, embed](size_t k, float* dst) {
    const std::vector<float> v = ck->read(params[k]);
    std::copy(v.begin(), v.end(), dst);
    if (k == embed) ck->check_tied_head(params[k], dst);
  };
}

void Qwen35Model::fill_param(size_t k, float* dst) const {
  DS_CHECK(k < params_.size(), "model: no parameter {}", k);
  const ParamSpec& p = params_[k];
  if (deferred_) return deferred_(k, dst);
  DS_CHECK(weights_.size() == static_cast<size_t>(num_parameters()), "model: the weights were released");
  std::copy(weights_.begin() + p.offset, weights_.begin() + p.offset + p.numel, dst);
}

void Qwen35Model::materialize() {
  if (!deferred_) return;
  weights_.assign(static_cast<size_t>(num_parameters()), 0.0f);
  for (size_t k = 0; k < params_.size(); ++k) deferred_(k, weights_.data() + params_[k].offset);
  deferred_ = nullptr;
}

void Qwen35Model::set_adapter(std::shared_ptr<LoraAdapter> a) {
  if (a) {
    DS_CHECK(a->num_layers() == cfg_.num_hidden_layers, "LoRA: the adapter has {} layers, the model {}",
             a->num_layers(), cfg_.num_hidden_layers);
    for (const LoraTensorSpec& s : a->specs()) {
      const std::string name = "model.layers." + std::to_string(s.layer) + "." + lora_module_path(s.module) + ".weight";
      DS_CHECK(by_name_.count(name) && spec(name).shape == std::vector<int64_t>({s.out, s.in}),
               "LoRA: the adapter of {} does not fit this model's {}", a->key(s, false), name);
    }
  }
  adapter_ = std::move(a);
}

const ParamSpec& Qwen35Model::spec(const std::string& name) const {
  auto it = by_name_.find(name);
  DS_CHECK(it != by_name_.end(), "unknown parameter \"{}\"", name);
  return params_[it->second];
}

void Qwen35Model::zero_grads() {
  grads_.assign(weights_.size(), 0.0f);  // allocated at first use: a GPU run never needs host gradients
}

void Qwen35Model::release_buffers() {
  deferred_ = nullptr;
  std::vector<float>().swap(weights_);
  std::vector<float>().swap(grads_);
}

void Qwen35Model::init_weights(uint64_t seed) {
  deferred_ = nullptr;
  weights_.assign(static_cast<size_t>(num_parameters()), 0.0f);
  for (size_t pi = 0; pi < params_.size(); ++pi) init_param(cfg_, params_, pi, seed, weights_.data() + params_[pi].offset);
}

void Qwen35Model::init_param(const ModelConfig& cfg, const std::vector<ParamSpec>& params, size_t pi, uint64_t seed,
                             float* w) {
  const ParamSpec& p = params[pi];
  Rng rng(seed, pi + 1);
  auto ends_with = [&](const char* suf) {
    std::string s(suf);
    return p.name.size() >= s.size() && p.name.compare(p.name.size() - s.size(), s.size(), s) == 0;
  };
  if (ends_with("linear_attn.norm.weight") || ends_with("dt_bias")) {
    std::fill(w, w + p.numel, 1.0f);
  } else if (ends_with("A_log")) {
    for (int64_t i = 0; i < p.numel; ++i) w[i] = static_cast<float>(std::log(0.01 + (16.0 - 0.01) * rng.uniform()));
  } else if (ends_with("layernorm.weight") || ends_with("norm.weight")) {
    std::fill(w, w + p.numel, 0.0f);  // zero-centered RMSNorm: effective scale 1
  } else {
    // Blocks of 64k values, each from its own counter range: the same values for any thread count.
    const int64_t block = 65536;
#pragma omp parallel for schedule(static)
    for (int64_t b0 = 0; b0 < p.numel; b0 += block) {
      Rng r(seed, pi + 1);
      r.set_counter(static_cast<uint64_t>(2 * b0));
      for (int64_t i = b0; i < std::min(p.numel, b0 + block); ++i)
        w[i] = static_cast<float>(cfg.initializer_range * r.normal());
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Checkpoint I/O

CheckpointWeights::CheckpointWeights(const std::string& path, const ModelConfig& cfg, const std::vector<ParamSpec>& params)
    : path_(path), ck_(path), tied_(cfg.tie_word_embeddings) {
  // Find the text-model prefix the checkpoint uses.
  if (ck_.has("model.embed_tokens.weight")) prefix_ = "model.";
  else if (ck_.has("model.language_model.embed_tokens.weight")) prefix_ = "model.language_model.";
  else fail("{}: no embed_tokens weight (looked for model.embed_tokens.weight and "
            "model.language_model.embed_tokens.weight)", path);
  std::set<std::string> ours;
  for (const ParamSpec& p : params) {
    ours.insert(p.name);
    const std::string name = name_of(p);
    DS_CHECK(ck_.has(name), "{}: missing tensor \"{}\"", path, name);
    const TensorInfo& info = ck_.info(name);
    DS_CHECK(info.shape == p.shape, "{}: tensor \"{}\" has shape [{}] but the config needs [{}]", path, name,
             fmt::join(info.shape, ", "), fmt::join(p.shape, ", "));
    DS_CHECK(is_float_dtype(info.dtype), "{}: tensor \"{}\" has dtype {}, but a parameter must be stored as a float "
             "dtype (F32, BF16, F16 or F64)", path, name, dtype_name(info.dtype));
  }
  // Tensors of the text model that the config has no place for (more layers, a GDN tensor in an attention
  // layer, ...) mean config and weights disagree: an error, never silently dropped. Vision and MTP tensors
  // and a tied lm_head copy are expected extras.
  for (const std::string& name : ck_.names()) {
    if (name.rfind(prefix_, 0) != 0) continue;  // model.visual.*, mtp.*, lm_head.weight
    if (prefix_ == "model." && name.rfind("model.language_model.", 0) == 0) continue;
    if (prefix_ == "model." && name.rfind("model.visual.", 0) == 0) continue;
    DS_CHECK(ours.count("model." + name.substr(prefix_.size())),
             "{}: tensor \"{}\" does not fit the config ({}): config.json and the weights "
             "disagree (e.g. num_hidden_layers or layer_types)", path, name, cfg.source);
  }
}

std::string CheckpointWeights::name_of(const ParamSpec& p) const {
  if (p.name.rfind("model.", 0) == 0) return prefix_ + p.name.substr(6);
  return p.name;  // lm_head.weight stays at top level
}

std::vector<float> CheckpointWeights::read(const ParamSpec& p) const {
  const std::string name = name_of(p);
  std::vector<float> v = ck_.read_f32(name);
  const int64_t bad = first_non_finite(v.data(), static_cast<int64_t>(v.size()));
  DS_CHECK(bad < 0, "{}: tensor \"{}\" holds a non-finite value at index {}", path_, name, bad);
  return v;
}

void CheckpointWeights::check_tied_head(const ParamSpec& embed, const float* loaded) const {
  if (!tied_ || !ck_.has("lm_head.weight")) return;
  std::vector<float> own;
  if (!loaded) loaded = (own = read(embed)).data();
  std::vector<float> lm = ck_.read_f32("lm_head.weight");
  DS_CHECK(static_cast<int64_t>(lm.size()) == embed.numel && std::equal(lm.begin(), lm.end(), loaded),
           "{}: config ties word embeddings but lm_head.weight differs from embed_tokens; set "
           "tie_word_embeddings=false in config.json to use it", path_);
}

void Qwen35Model::load(const std::string& path) {
  const CheckpointWeights ck(path, cfg_, params_);
  deferred_ = nullptr;
  weights_.assign(static_cast<size_t>(num_parameters()), 0.0f);
  for (const ParamSpec& p : params_) {
    const std::vector<float> v = ck.read(p);
    std::copy(v.begin(), v.end(), weights_.begin() + p.offset);
  }
  const ParamSpec& e = spec("model.embed_tokens.weight");
  ck.check_tied_head(e, weights_.data() + e.offset);
}

// A_log and the gated-norm weight stay fp32 as in released Qwen3.5 checkpoints (docs/model.md §5.3).
DType stored_dtype(const ParamSpec& p, DType dtype) {
  bool keep_f32 = p.name.find("A_log") != std::string::npos || p.name.find("linear_attn.norm.weight") != std::string::npos;
  return keep_f32 ? DType::F32 : dtype;
}

void save_model_dir(const std::string& dir, const ModelConfig& cfg, const std::vector<SaveTensor>& tensors,
                    DType dtype, int64_t max_shard_bytes) {
  namespace fs = std::filesystem;
  DS_CHECK(max_shard_bytes > 0, "save: max_shard_bytes must be positive");
  fs::create_directories(dir);
  nlohmann::json cj = cfg.to_json();
  if (dtype == DType::BF16) cj["dtype"] = "bfloat16";
  write_file_atomic((fs::path(dir) / "config.json").string(), cj.dump(2) + "\n");
  write_safetensors_sharded(dir, "model", tensors, max_shard_bytes, {{"format", "pt"}});
}

std::vector<SaveTensor> Qwen35Model::to_tensors(const std::vector<float>& buffer, DType dtype) const {
  std::vector<SaveTensor> out;
  for (const ParamSpec& p : params_)
    out.push_back(make_tensor_f32_view(p.name, p.shape, buffer.data() + p.offset, stored_dtype(p, dtype)));
  return out;
}

void Qwen35Model::save(const std::string& dir, DType dtype, int64_t max_shard_bytes) const {
  save_model_dir(dir, cfg_, to_tensors(weights_, dtype), dtype, max_shard_bytes);
}

// ---------------------------------------------------------------------------------------------------------------
// Forward / backward

namespace {


// Activations one layer keeps for its backward.
struct LayerCache {
  Buf x_in, xn1, rstd1, h_mid, xn2, rstd2, gate, up, act;
  // GDN
  Buf mixed, zz, aa, bb, conv_out, qc, kc, vc, qn, kn, rq, rk, g, beta, core, rstd_g, y;
  // attention
  Buf qraw, graw, kraw, vraw, rstd_q, rstd_k, qr, kr, ao, lse, og;
};

void add_into(Buf& dst, const Buf& src) {
  for (size_t i = 0; i < dst.size(); ++i) dst[i] += src[i];
}

}  // namespace

struct Qwen35Model::Impl {
  Qwen35Model& m;
  const ModelConfig& c;
  const PackedBatch& batch;
  int64_t N, H, I;
  int64_t num_seqs;
  Buf cos_t, sin_t;

  DecodeState* dec = nullptr;  // generation: the state carried from the earlier tokens (one sequence)
  int64_t layer = 0;           // the layer running (its slot in dec)

  Impl(Qwen35Model& model, const PackedBatch& b)
      : m(model), c(model.cfg_), batch(b), N(b.size()), H(model.cfg_.hidden_size),
        I(model.cfg_.intermediate_size), num_seqs(static_cast<int64_t>(b.cu_seqlens.size()) - 1),
        fp8(model.precision_ == Precision::Fp8), grad_format(fp8 ? Fp8Recipe::from_env().grad : Fp8Format::E5M2) {}

  // --- The matrix GEMMs (in_proj_qkv, in_proj_z, out_proj, q/k/v/o_proj, gate/up/down_proj). With `--precision
  // fp8` (docs/fp8.md) each reads its operands as the GPU's FP8 GEMMs do (model/gpu_fp8.h, core/fp8.h): x and W
  // cast to E4M3, an output gradient to the recipe's format, each with its own per-tensor scale, except that
  // gate_proj and up_proj (one gate|up tensor on the GPU) share the amax of both (w_amax / dy_amax >= 0). The
  // values are then multiplied in fp32 as in bf16 mode.
  const bool fp8;
  const Fp8Format grad_format;
  const float* cast(const float* x, int64_t n, Fp8Format f, Buf& keep, float amax = -1) const {
    if (!fp8) return x;
    keep.assign(x, x + n);
    fp8_fake_quantize(keep.data(), n, f, amax >= 0 ? amax : fp8_amax(x, n));
    return keep.data();
  }
  float joint_amax(const float* a, const float* b, int64_t n) const {
    return fp8 ? std::max(fp8_amax(a, n), fp8_amax(b, n)) : -1.0f;
  }
  // y [N, n] (= or +=) x [N, K] W[n, K]^T
  void lin_fwd(const float* x, const float* W, float* y, int64_t K, int64_t n, bool acc = false, float w_amax = -1) {
    Buf qx, qw;
    ops::linear_forward(cast(x, N * K, Fp8Format::E4M3, qx), cast(W, n * K, Fp8Format::E4M3, qw, w_amax), y, N, K, n,
                        acc);
    if (const LoraLinear* l = lora_of(W)) lora_fwd(*l, x, y, K, n);
  }
  // dx [N, K] (= or +=) dy W, dW += dy^T x
  void lin_bwd(const float* x, const float* W, const float* dy, float* dx, float* dW, int64_t K, int64_t n,
               bool acc_dx = false, float w_amax = -1, float dy_amax = -1) {
    Buf qx, qw, qdy;
    ops::linear_backward(cast(x, N * K, Fp8Format::E4M3, qx), cast(W, n * K, Fp8Format::E4M3, qw, w_amax),
                         cast(dy, N * n, grad_format, qdy, dy_amax), dx, m.adapter_ ? nullptr : dW, N, K, n, acc_dx);
    if (const LoraLinear* l = lora_of(W)) lora_bwd(*l, x, dy, dx, K, n);
  }

  // --- LoRA (docs/lora.md): the adapted linear layers of the layer running, found by their base weight (the W
  // lin_fwd / lin_bwd get). y += scaling * (x A^T) B^T; the term reads x and dy as given (not through FP8).
  struct LoraLinear {
    const float* W;         // the base weight, in the layer's view
    const float *A, *B;     // lora_A [r, in], lora_B [out, r]
    float *dA, *dB;         // their gradients (null in a forward alone)
    size_t spec;            // its index in the adapter's specs() (its dropout mask)
  };
  // Training with lora_dropout > 0 and a dropout key set (LoraAdapter::set_dropout_key): lora_A reads dropout(x).
  bool lora_dropout = false;
  std::vector<LoraLinear> lora;
  void lora_layer(int64_t i, const LayerParams<float*>& w) {
    lora.clear();
    LoraAdapter* a = m.adapter_.get();
    if (!a) return;
    for (size_t k : a->layer_specs(i)) {
      const LoraTensorSpec& s = a->specs()[k];
      float* g = a->grads().empty() ? nullptr : a->grads().data();
      lora.push_back({base_weight(w, s.module), a->values().data() + s.a_offset, a->values().data() + s.b_offset,
                      g ? g + s.a_offset : nullptr, g ? g + s.b_offset : nullptr, k});
    }
  }
  static const float* base_weight(const LayerParams<float*>& w, LoraModule m) {
    switch (m) {
      case LoraModule::in_proj_qkv: return w.gdn.in_proj_qkv;
      case LoraModule::in_proj_z: return w.gdn.in_proj_z;
      case LoraModule::out_proj: return w.gdn.out_proj;
      case LoraModule::q_proj: return w.attn.q_proj;
      case LoraModule::k_proj: return w.attn.k_proj;
      case LoraModule::v_proj: return w.attn.v_proj;
      case LoraModule::o_proj: return w.attn.o_proj;
      case LoraModule::gate_proj: return w.mlp.gate_up;
      case LoraModule::up_proj: return w.mlp.up;
      case LoraModule::down_proj: return w.mlp.down;
    }
    return nullptr;
  }
  const LoraLinear* lora_of(const float* W) const {
    for (const LoraLinear& l : lora)
      if (l.W == W) return &l;
    return nullptr;
  }
  // lora_A's input: x, or in training with dropout x * mask (LoraAdapter::dropout_mask, kept in `mask`).
  const float* lora_input(const LoraLinear& l, const float* x, int64_t K, Buf& mask, Buf& xd) const {
    if (!lora_dropout) return x;
    mask.resize(static_cast<size_t>(N * K));
    m.adapter_->dropout_mask(l.spec, N, mask.data());
    xd.resize(mask.size());
    for (size_t e = 0; e < xd.size(); ++e) xd[e] = x[e] * mask[e];
    return xd.data();
  }
  // y [N, n] += scaling * (dropout(x) [N, K] A^T) B^T
  void lora_fwd(const LoraLinear& l, const float* x, float* y, int64_t K, int64_t n) const {
    const int64_t r = m.adapter_->config().r;
    Buf u(static_cast<size_t>(N * r)), mask, xd;
    ops::linear_forward(lora_input(l, x, K, mask, xd), l.A, u.data(), N, K, r);
    const float s = static_cast<float>(m.adapter_->config().scaling());
    for (float& e : u) e *= s;
    ops::linear_forward(u.data(), l.B, y, N, r, n, /*accumulate=*/true);
  }
  // With x' = dropout(x) (the forward's mask, regenerated) and u = scaling * x' A^T: dB += dy^T u,
  // dA += (scaling * dy B)^T x', dx [N, K] += mask * ((scaling * dy B) A) (without dropout: mask = 1).
  void lora_bwd(const LoraLinear& l, const float* x, const float* dy, float* dx, int64_t K, int64_t n) const {
    const int64_t r = m.adapter_->config().r;
    const float s = static_cast<float>(m.adapter_->config().scaling());
    Buf u(static_cast<size_t>(N * r)), du(static_cast<size_t>(N * r)), mask, xd;
    const float* xa = lora_input(l, x, K, mask, xd);
    ops::linear_forward(xa, l.A, u.data(), N, K, r);
    for (float& e : u) e *= s;
    ops::linear_backward(u.data(), l.B, dy, du.data(), l.dB, N, r, n);
    for (float& e : du) e *= s;
    if (!lora_dropout) return ops::linear_backward(x, l.A, du.data(), dx, l.dA, N, K, r, /*accumulate_dx=*/true);
    Buf dxd(static_cast<size_t>(N * K));
    ops::linear_backward(xa, l.A, du.data(), dxd.data(), l.dA, N, K, r);
    for (size_t e = 0; e < dxd.size(); ++e) dx[e] += dxd[e] * mask[e];
  }

  // The weights and gradients unit by unit (model.h: UnitSource): from the source when one is set, else views of
  // weights() / grads(). A unit's pointer is its first element; the layout's offsets are rebased to it.
  int64_t head_unit() const { return c.num_hidden_layers + 1; }
  float* acquire(int64_t u) { return m.source_ ? m.source_->acquire(u) : m.weights_.data() + unit_lo(u); }
  void release(int64_t u) {
    if (m.source_) m.source_->release(u);
  }
  float* grads_of(int64_t u) { return m.source_ ? m.source_->grads(u) : m.grads_.data() + unit_lo(u); }
  void grads_done(int64_t u) {
    if (m.source_) m.source_->grads_done(u);
  }
  // With an adapter the base is frozen: no base gradient is kept. The matrices' weight-gradient GEMMs are skipped
  // (lin_bwd; in their view the matrices are null), the embedding's and lm_head's are not computed; the small
  // parameters' gradients of a layer (norms, conv taps, A_log, dt_bias), which the ops compute with dx, go into a
  // scratch of their size and are dropped.
  bool frozen() const { return m.adapter_ != nullptr; }
  Buf scratch;
  LayerParams<float*> layer_grads(int64_t i) {
    if (!frozen()) return layer_view(i, grads_of(1 + i));
    const ParamUnit& u = m.units_[static_cast<size_t>(1 + i)];
    std::unordered_map<int64_t, int64_t> small;  // offset -> place in the scratch, for the parameters without decay
    int64_t n = 0;
    for (const ParamSpec& p : m.params_)
      if (p.offset >= u.lo && p.offset < u.hi && !p.weight_decay) small[p.offset] = n, n += p.numel;
    scratch.assign(static_cast<size_t>(n), 0.0f);
    return map_layer(m.layout_->layer_offsets(i), [&](int64_t off) -> float* {
      const auto it = small.find(off);
      return it == small.end() ? nullptr : scratch.data() + it->second;
    });
  }
  int64_t unit_lo(int64_t u) const { return m.units_[static_cast<size_t>(u)].lo; }
  // Tensor `off` (a flat offset inside unit u) in a unit buffer that starts at `base`.
  float* at(float* base, int64_t u, int64_t off) const { return base + (off - unit_lo(u)); }
  LayerParams<float*> layer_view(int64_t i, float* base) const {
    const int64_t lo = unit_lo(1 + i);
    return map_layer(m.layout_->layer_offsets(i), [base, lo](int64_t off) -> float* {
      return off < 0 ? nullptr : base + (off - lo);
    });
  }
  const ModelParams<int64_t>& mo() const { return m.layout_->model_offsets(); }
  float* head_w = nullptr;  // the head unit, acquired from the final norm's forward until the caller releases it


  // --- Gated DeltaNet mixer (HF Qwen3_5GatedDeltaNet.forward, docs/model.md §2.6) ---
  void gdn_forward(const LayerParams<float*>& w, LayerCache& s, Buf& out) {
    const int64_t CD = c.conv_dim(), KD = c.key_dim(), VD = c.value_dim(), Hv = c.linear_num_value_heads;
    const int64_t K = c.linear_conv_kernel_dim;
    s.mixed.resize(N * CD);
    s.zz.resize(N * VD);
    s.bb.resize(N * Hv);
    s.aa.resize(N * Hv);
    lin_fwd(s.xn1.data(), w.gdn.in_proj_qkv, s.mixed.data(), H, CD);
    lin_fwd(s.xn1.data(), w.gdn.in_proj_z, s.zz.data(), H, VD);
    ops::linear_forward(s.xn1.data(), w.gdn.in_proj_ba, s.bb.data(), N, H, Hv);
    ops::linear_forward(s.xn1.data(), w.gdn.in_proj_a, s.aa.data(), N, H, Hv);
    s.conv_out.resize(N * CD);
    if (dec) {  // the conv over [the earlier tokens' last K-1 rows | these], keeping the last K-1 rows again
      std::vector<float>& tail = dec->conv_tail[static_cast<size_t>(layer)];
      if (tail.empty()) tail.assign(static_cast<size_t>((K - 1) * CD), 0.0f);  // the causal conv's zero padding
      Buf ext(tail);
      ext.insert(ext.end(), s.mixed.begin(), s.mixed.end());
      Buf ext_out(ext.size());
      const int32_t cu[2] = {0, static_cast<int32_t>(K - 1 + N)};
      ops::conv1d_silu_forward(ext.data(), w.gdn.conv1d, cu, 1, K - 1 + N, CD, K, ext_out.data());
      std::copy(ext_out.begin() + (K - 1) * CD, ext_out.end(), s.conv_out.begin());
      std::copy(ext.end() - (K - 1) * CD, ext.end(), tail.begin());
    } else {
      ops::conv1d_silu_forward(s.mixed.data(), w.gdn.conv1d, batch.cu_seqlens.data(), num_seqs, N, CD, K,
                               s.conv_out.data());
    }
    s.qc.resize(N * KD);
    s.kc.resize(N * KD);
    s.vc.resize(N * VD);
    for (int64_t t = 0; t < N; ++t) {
      const float* row = s.conv_out.data() + t * CD;
      std::copy(row, row + KD, s.qc.data() + t * KD);
      std::copy(row + KD, row + 2 * KD, s.kc.data() + t * KD);
      std::copy(row + 2 * KD, row + CD, s.vc.data() + t * VD);
    }
    const int64_t rows_k = N * c.linear_num_key_heads, dk = c.linear_key_head_dim;
    s.qn.resize(N * KD);
    s.kn.resize(N * KD);
    s.rq.resize(rows_k);
    s.rk.resize(rows_k);
    ops::l2norm_forward(s.qc.data(), s.qn.data(), s.rq.data(), rows_k, dk, 1e-6);
    ops::l2norm_forward(s.kc.data(), s.kn.data(), s.rk.data(), rows_k, dk, 1e-6);
    s.g.resize(N * Hv);
    s.beta.resize(N * Hv);
    ops::gdn_gate_forward(s.aa.data(), s.bb.data(), w.gdn.A_log, w.gdn.dt_bias, s.g.data(), s.beta.data(), N, Hv);
    s.core.resize(N * VD);
    std::vector<float>* S = dec ? &dec->state[static_cast<size_t>(layer)] : nullptr;
    if (S && S->empty()) S->assign(static_cast<size_t>(Hv * c.linear_key_head_dim * c.linear_value_head_dim), 0.0f);
    Buf S_next(S ? S->size() : 0);
    ops::gated_delta_rule_forward(gdn_dims(c, N, num_seqs), s.qn.data(), s.kn.data(), s.vc.data(), s.g.data(),
                                        s.beta.data(), batch.cu_seqlens.data(), S ? static_cast<const float*>(S->data()) : nullptr,
                                        s.core.data(), S ? S_next.data() : static_cast<float*>(nullptr));
    if (S) *S = S_next;
    const int64_t rows_v = N * Hv, dv = c.linear_value_head_dim;
    s.rstd_g.resize(rows_v);
    s.y.resize(N * VD);
    ops::gated_rmsnorm_forward(s.core.data(), s.zz.data(), w.gdn.norm, s.y.data(), s.rstd_g.data(), rows_v, dv,
                               c.rms_norm_eps);
    lin_fwd(s.y.data(), w.gdn.out_proj, out.data(), VD, H);
  }

  // dout: [N, H] gradient of the mixer output; dxn (out): [N, H] gradient of the normed input.
  void gdn_backward(const LayerParams<float*>& w, const LayerParams<float*>& gw, LayerCache& s, const Buf& dout, Buf& dxn) {
    const int64_t CD = c.conv_dim(), KD = c.key_dim(), VD = c.value_dim(), Hv = c.linear_num_value_heads;
    const int64_t K = c.linear_conv_kernel_dim, dk = c.linear_key_head_dim, dv = c.linear_value_head_dim;
    Buf dy(N * VD);
    lin_bwd(s.y.data(), w.gdn.out_proj, dout.data(), dy.data(), gw.gdn.out_proj, VD, H);
    Buf dcore(N * VD), dz(N * VD);
    ops::gated_rmsnorm_backward(s.core.data(), s.zz.data(), w.gdn.norm, s.rstd_g.data(), dy.data(), dcore.data(),
                                dz.data(), gw.gdn.norm, N * Hv, dv);
    Buf dqn(N * KD), dkn(N * KD), dvc(N * VD), dg(N * Hv), dbeta(N * Hv);
    ops::gated_delta_rule_backward(gdn_dims(c, N, num_seqs), s.qn.data(), s.kn.data(), s.vc.data(), s.g.data(),
                                         s.beta.data(), batch.cu_seqlens.data(), static_cast<const float*>(nullptr),
                                         dcore.data(), static_cast<const float*>(nullptr), dqn.data(), dkn.data(),
                                         dvc.data(), dg.data(), dbeta.data(), static_cast<float*>(nullptr));
    Buf dq(N * KD), dkk(N * KD);
    const int64_t rows_k = N * c.linear_num_key_heads;
    ops::l2norm_backward(s.qn.data(), s.rq.data(), dqn.data(), dq.data(), rows_k, dk);
    ops::l2norm_backward(s.kn.data(), s.rk.data(), dkn.data(), dkk.data(), rows_k, dk);
    Buf da(N * Hv), db(N * Hv);
    ops::gdn_gate_backward(s.aa.data(), s.bb.data(), w.gdn.A_log, w.gdn.dt_bias, dg.data(), dbeta.data(), da.data(),
                           db.data(), gw.gdn.A_log, gw.gdn.dt_bias, N, Hv);
    Buf dconv(N * CD);
    for (int64_t t = 0; t < N; ++t) {
      float* row = dconv.data() + t * CD;
      std::copy(dq.data() + t * KD, dq.data() + (t + 1) * KD, row);
      std::copy(dkk.data() + t * KD, dkk.data() + (t + 1) * KD, row + KD);
      std::copy(dvc.data() + t * VD, dvc.data() + (t + 1) * VD, row + 2 * KD);
    }
    Buf dmixed(N * CD);
    ops::conv1d_silu_backward(s.mixed.data(), w.gdn.conv1d, dconv.data(), batch.cu_seqlens.data(), num_seqs, N, CD, K,
                              dmixed.data(), gw.gdn.conv1d);
    lin_bwd(s.xn1.data(), w.gdn.in_proj_qkv, dmixed.data(), dxn.data(), gw.gdn.in_proj_qkv, H, CD, false);
    lin_bwd(s.xn1.data(), w.gdn.in_proj_z, dz.data(), dxn.data(), gw.gdn.in_proj_z, H, VD, true);
    ops::linear_backward(s.xn1.data(), w.gdn.in_proj_ba, db.data(), dxn.data(), frozen() ? nullptr : gw.gdn.in_proj_ba, N, H, Hv,
                         true);
    ops::linear_backward(s.xn1.data(), w.gdn.in_proj_a, da.data(), dxn.data(), frozen() ? nullptr : gw.gdn.in_proj_a, N, H, Hv,
                         true);
  }

  // --- Gated full attention (HF Qwen3_5Attention, docs/model.md §2.5) ---
  void attn_forward(const LayerParams<float*>& w, LayerCache& s, Buf& out) {
    const int64_t Hq = c.num_attention_heads, Hkv = c.num_key_value_heads, hd = c.head_dim;
    Buf qg(N * Hq * 2 * hd);
    lin_fwd(s.xn1.data(), w.attn.q_proj, qg.data(), H, Hq * 2 * hd);
    s.qraw.resize(N * Hq * hd);
    s.graw.resize(N * Hq * hd);
    for (int64_t t = 0; t < N; ++t)
      for (int64_t h = 0; h < Hq; ++h) {
        const float* src = qg.data() + (t * Hq + h) * 2 * hd;  // per head: [query(hd) | gate(hd)]
        std::copy(src, src + hd, s.qraw.data() + (t * Hq + h) * hd);
        std::copy(src + hd, src + 2 * hd, s.graw.data() + (t * Hq + h) * hd);
      }
    s.kraw.resize(N * Hkv * hd);
    s.vraw.resize(N * Hkv * hd);
    lin_fwd(s.xn1.data(), w.attn.k_proj, s.kraw.data(), H, Hkv * hd);
    lin_fwd(s.xn1.data(), w.attn.v_proj, s.vraw.data(), H, Hkv * hd);
    s.qr.resize(N * Hq * hd);
    s.kr.resize(N * Hkv * hd);
    s.rstd_q.resize(N * Hq);
    s.rstd_k.resize(N * Hkv);
    ops::rmsnorm_forward(s.qraw.data(), w.attn.q_norm, s.qr.data(), s.rstd_q.data(), N * Hq, hd, c.rms_norm_eps, true);
    ops::rmsnorm_forward(s.kraw.data(), w.attn.k_norm, s.kr.data(), s.rstd_k.data(), N * Hkv, hd, c.rms_norm_eps, true);
    ops::rope_apply(s.qr.data(), N, Hq, hd, c.rotary_dim(), cos_t.data(), sin_t.data(), false);
    ops::rope_apply(s.kr.data(), N, Hkv, hd, c.rotary_dim(), cos_t.data(), sin_t.data(), false);
    s.ao.resize(N * Hq * hd);
    s.lse.resize(N * Hq);
    if (dec) attn_decode(s);
    else
      ops::attention_forward(attn_dims(c, N, num_seqs), s.qr.data(), s.kr.data(), s.vraw.data(),
                             batch.cu_seqlens.data(), s.ao.data(), s.lse.data());
    s.og.resize(N * Hq * hd);
    ops::output_gate_forward(s.ao.data(), s.graw.data(), s.og.data(), N * Hq * hd);
    lin_fwd(s.og.data(), w.attn.o_proj, out.data(), Hq * hd, H);
  }

  // Generation: these N tokens' keys and values appended to the layer's cache, then each query's causal softmax
  // over every cached position up to its own (the math of ops/attention/attention.h, sums in double).
  void attn_decode(LayerCache& s) {
    const int64_t Hq = c.num_attention_heads, Hkv = c.num_key_value_heads, hd = c.head_dim, group = Hq / Hkv;
    std::vector<float>& K = dec->keys[static_cast<size_t>(layer)];
    std::vector<float>& V = dec->values[static_cast<size_t>(layer)];
    K.insert(K.end(), s.kr.begin(), s.kr.end());
    V.insert(V.end(), s.vraw.begin(), s.vraw.end());
    const double scale = attn_dims(c, N, 1).scale;
    std::vector<double> p;
    for (int64_t t = 0; t < N; ++t) {
      const int64_t upto = dec->length + t;  // the query's own position
      p.resize(static_cast<size_t>(upto + 1));
      for (int64_t h = 0; h < Hq; ++h) {
        const float* q = s.qr.data() + (t * Hq + h) * hd;
        const int64_t g = h / group;
        double mx = -INFINITY;
        for (int64_t j = 0; j <= upto; ++j) {
          const float* k = K.data() + (j * Hkv + g) * hd;
          double d = 0;
          for (int64_t e = 0; e < hd; ++e) d += static_cast<double>(q[e]) * k[e];
          p[static_cast<size_t>(j)] = d * scale;
          mx = std::max(mx, p[static_cast<size_t>(j)]);
        }
        double total = 0;
        for (int64_t j = 0; j <= upto; ++j) total += p[static_cast<size_t>(j)] = std::exp(p[static_cast<size_t>(j)] - mx);
        float* o = s.ao.data() + (t * Hq + h) * hd;
        for (int64_t e = 0; e < hd; ++e) {
          double acc = 0;
          for (int64_t j = 0; j <= upto; ++j) acc += p[static_cast<size_t>(j)] * V[static_cast<size_t>((j * Hkv + g) * hd + e)];
          o[e] = static_cast<float>(acc / total);
        }
        s.lse[static_cast<size_t>(t * Hq + h)] = static_cast<float>(mx + std::log(total));
      }
    }
  }

  void attn_backward(const LayerParams<float*>& w, const LayerParams<float*>& gw, LayerCache& s, const Buf& dout, Buf& dxn) {
    const int64_t Hq = c.num_attention_heads, Hkv = c.num_key_value_heads, hd = c.head_dim;
    Buf dog(N * Hq * hd);
    lin_bwd(s.og.data(), w.attn.o_proj, dout.data(), dog.data(), gw.attn.o_proj, Hq * hd, H);
    Buf dao(N * Hq * hd), dgate(N * Hq * hd);
    ops::output_gate_backward(s.ao.data(), s.graw.data(), dog.data(), dao.data(), dgate.data(), N * Hq * hd);
    Buf dqr(N * Hq * hd), dkr(N * Hkv * hd), dvv(N * Hkv * hd);
    ops::attention_backward(attn_dims(c, N, num_seqs), s.qr.data(), s.kr.data(), s.vraw.data(), s.ao.data(),
                            s.lse.data(), dao.data(), batch.cu_seqlens.data(), dqr.data(), dkr.data(), dvv.data());
    ops::rope_apply(dqr.data(), N, Hq, hd, c.rotary_dim(), cos_t.data(), sin_t.data(), true);
    ops::rope_apply(dkr.data(), N, Hkv, hd, c.rotary_dim(), cos_t.data(), sin_t.data(), true);
    Buf dq(N * Hq * hd), dk(N * Hkv * hd);
    ops::rmsnorm_backward(s.qraw.data(), w.attn.q_norm, s.rstd_q.data(), dqr.data(), dq.data(), gw.attn.q_norm, N * Hq, hd, true);
    ops::rmsnorm_backward(s.kraw.data(), w.attn.k_norm, s.rstd_k.data(), dkr.data(), dk.data(), gw.attn.k_norm, N * Hkv, hd,
                          true);
    Buf dqg(N * Hq * 2 * hd);
    for (int64_t t = 0; t < N; ++t)
      for (int64_t h = 0; h < Hq; ++h) {
        float* dst = dqg.data() + (t * Hq + h) * 2 * hd;
        std::copy(dq.data() + (t * Hq + h) * hd, dq.data() + (t * Hq + h + 1) * hd, dst);
        std::copy(dgate.data() + (t * Hq + h) * hd, dgate.data() + (t * Hq + h + 1) * hd, dst + hd);
      }
    lin_bwd(s.xn1.data(), w.attn.q_proj, dqg.data(), dxn.data(), gw.attn.q_proj, H, Hq * 2 * hd, false);
    lin_bwd(s.xn1.data(), w.attn.k_proj, dk.data(), dxn.data(), gw.attn.k_proj, H, Hkv * hd, true);
    lin_bwd(s.xn1.data(), w.attn.v_proj, dvv.data(), dxn.data(), gw.attn.v_proj, H, Hkv * hd, true);
  }

  // --- Decoder layer (HF Qwen3_5DecoderLayer, docs/model.md §2.3): h_out = h_mid + mlp(norm2(h_mid)),
  //     h_mid = h_in + mixer(norm1(h_in)). `h` is updated in place.
  void layer_forward(int64_t i, const LayerParams<float*>& w, LayerCache& s, Buf& h) {
    lora_layer(i, w);
    s.x_in = h;
    s.xn1.resize(N * H);
    s.rstd1.resize(N);
    ops::rmsnorm_forward(h.data(), w.input_layernorm, s.xn1.data(), s.rstd1.data(), N, H, c.rms_norm_eps, true);
    Buf mix(N * H);
    if (c.is_full_attention(i)) attn_forward(w, s, mix);
    else gdn_forward(w, s, mix);
    add_into(h, mix);
    s.h_mid = h;
    s.xn2.resize(N * H);
    s.rstd2.resize(N);
    ops::rmsnorm_forward(h.data(), w.post_attention_layernorm, s.xn2.data(), s.rstd2.data(), N, H, c.rms_norm_eps, true);
    s.gate.resize(N * I);
    s.up.resize(N * I);
    s.act.resize(N * I);
    const float gu_amax = joint_amax(w.mlp.gate_up, w.mlp.up, I * H);  // gate|up: one tensor on the GPU
    lin_fwd(s.xn2.data(), w.mlp.gate_up, s.gate.data(), H, I, false, gu_amax);
    lin_fwd(s.xn2.data(), w.mlp.up, s.up.data(), H, I, false, gu_amax);
    ops::swiglu_forward(s.gate.data(), s.up.data(), s.act.data(), N * I);
    lin_fwd(s.act.data(), w.mlp.down, h.data(), I, H, /*acc=*/true);
  }

  // dh: gradient of the layer output on entry, of the layer input on exit.
  // w, gw: the layer's weights and the gradients they get (added).
  void layer_backward(int64_t i, const LayerParams<float*>& w, const LayerParams<float*>& gw, LayerCache& s, Buf& dh) {
    lora_layer(i, w);
    Buf dact(N * I), dgate(N * I), dup(N * I), dxn(N * H), tmp(N * H);
    lin_bwd(s.act.data(), w.mlp.down, dh.data(), dact.data(), gw.mlp.down, I, H);
    ops::swiglu_backward(s.gate.data(), s.up.data(), dact.data(), dgate.data(), dup.data(), N * I);
    const float gu_amax = joint_amax(w.mlp.gate_up, w.mlp.up, I * H), dgu_amax = joint_amax(dgate.data(), dup.data(), N * I);
    lin_bwd(s.xn2.data(), w.mlp.gate_up, dgate.data(), dxn.data(), gw.mlp.gate_up, H, I, false, gu_amax, dgu_amax);
    lin_bwd(s.xn2.data(), w.mlp.up, dup.data(), dxn.data(), gw.mlp.up, H, I, true, gu_amax, dgu_amax);
    ops::rmsnorm_backward(s.h_mid.data(), w.post_attention_layernorm, s.rstd2.data(), dxn.data(), tmp.data(), gw.post_attention_layernorm, N, H, true);
    add_into(dh, tmp);  // dh is now d h_mid
    if (c.is_full_attention(i)) attn_backward(w, gw, s, dh, dxn);
    else gdn_backward(w, gw, s, dh, dxn);
    ops::rmsnorm_backward(s.x_in.data(), w.input_layernorm, s.rstd1.data(), dxn.data(), tmp.data(), gw.input_layernorm, N, H, true);
    add_into(dh, tmp);  // d h_in
  }

  // Runs embedding + all layers + final norm. Returns the final normed hidden states; fills caches. The head unit
  // stays acquired (head_w) for the loss and the final norm's backward: the caller releases it.
  void trunk_forward(std::vector<LayerCache>& caches, Buf& h, Buf& hf, Buf& rstd_f, ForwardCapture* cap) {
    batch.check(batch_limits(c));
    h.resize(N * H);
    float* e = acquire(0);
    ops::embedding_forward(batch.input_ids.data(), N, at(e, 0, mo().embed_tokens), c.vocab_size, H, h.data());
    release(0);
    cos_t.resize(N * c.rotary_dim() / 2);
    sin_t.resize(N * c.rotary_dim() / 2);
    ops::rope_tables(batch.positions.data(), N, c.rotary_dim(), c.rope_theta, cos_t.data(), sin_t.data());
    if (cap && cap->hidden_states) cap->hidden.push_back(h);
    caches.resize(static_cast<size_t>(c.num_hidden_layers));
    for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
      layer = i;
      layer_forward(i, layer_view(i, acquire(1 + i)), caches[static_cast<size_t>(i)], h);
      release(1 + i);
      if (cap && cap->hidden_states && i + 1 < c.num_hidden_layers) cap->hidden.push_back(h);
    }
    hf.resize(N * H);
    rstd_f.resize(N);
    head_w = acquire(head_unit());
    ops::rmsnorm_forward(h.data(), at(head_w, head_unit(), mo().norm), hf.data(), rstd_f.data(), N, H,
                         c.rms_norm_eps, true);
    if (cap && cap->hidden_states) cap->hidden.push_back(hf);
  }

  // lm_head's unit: the head, or the embedding when tied.
  int64_t lm_head_unit() const { return c.tie_word_embeddings ? 0 : head_unit(); }
  // lm_head's weights in weights() (generation: no unit source).
  const float* lm_head_w() const { return m.weights_.data() + mo().lm_head; }

  LossResult run(double grad_scale, double z_loss, ForwardCapture* cap) {
    std::vector<LayerCache> caches;
    Buf h, hf, rstd_f;
    trunk_forward(caches, h, hf, rstd_f, cap);
    const bool backward = grad_scale != 0.0;
    ops::LinearCeOptions opt;
    opt.z_loss = z_loss;
    opt.grad_scale = grad_scale;
    opt.fp8_grads = m.fp8_lm_head_ && m.precision_ == Precision::Fp8;  // as the GPU (ce_plan)
    Buf dhf;
    if (backward) dhf.resize(N * H);
    if (cap && cap->logits) cap->logits_values.resize(N * c.vocab_size);
    const int64_t hu = head_unit(), lu = lm_head_unit();
    const bool tied = lu != hu;
    float* lm_w = tied ? acquire(lu) : head_w;
    const bool base_grads = backward && !frozen();
    float* lm_g = base_grads ? grads_of(lu) : nullptr;  // untied: the head's gradients, the final norm's too
    ops::LinearCeResult ce = ops::linear_cross_entropy(
        hf.data(), at(lm_w, lu, mo().lm_head), batch.targets.data(), N, H, c.vocab_size, opt,
        backward ? dhf.data() : nullptr, base_grads ? at(lm_g, lu, mo().lm_head) : nullptr,
        cap && cap->logits ? cap->logits_values.data() : nullptr);
    LossResult r{ce.loss_sum, ce.z_loss_sum, ce.num_valid};
    if (tied) {
      if (base_grads) grads_done(lu);  // the embedding's lm_head part; its lookup part comes last
      release(lu);
    }
    if (!backward) {
      release(hu);
      return r;
    }
    Buf dh(N * H), norm_scratch;
    float* head_g = !base_grads ? nullptr : tied ? grads_of(hu) : lm_g;
    if (!base_grads) norm_scratch.assign(static_cast<size_t>(H), 0.0f);
    ops::rmsnorm_backward(h.data(), at(head_w, hu, mo().norm), rstd_f.data(), dhf.data(), dh.data(),
                          base_grads ? at(head_g, hu, mo().norm) : norm_scratch.data(), N, H, true);
    if (base_grads) grads_done(hu);
    release(hu);
    for (int64_t i = c.num_hidden_layers - 1; i >= 0; --i) {
      const LayerParams<float*> w = layer_view(i, acquire(1 + i)), gw = layer_grads(i);
      layer_backward(i, w, gw, caches[static_cast<size_t>(i)], dh);
      if (base_grads) grads_done(1 + i);
      release(1 + i);
    }
    if (!base_grads) return r;
    float* ge = grads_of(0);
    ops::embedding_backward(batch.input_ids.data(), N, dh.data(), c.vocab_size, H, at(ge, 0, mo().embed_tokens));
    grads_done(0);
    return r;
  }
};

LossResult Qwen35Model::forward_backward(const PackedBatch& batch, double grad_scale, double z_loss,
                                         ForwardCapture* capture) {
  DS_CHECK(source_ || weights_.size() == static_cast<size_t>(num_parameters()), "model: the weights were released");
  if (!source_ && !adapter_ && grad_scale != 0.0 && grads_.size() != weights_.size())
    grads_.assign(weights_.size(), 0.0f);
  DS_CHECK(!(source_ && adapter_), "LoRA: an adapter cannot be used with --shard full yet");
  if (adapter_ && grad_scale != 0.0 && adapter_->grads().empty()) adapter_->zero_grads();
  Impl impl(*this, batch);
  impl.lora_dropout = adapter_ && grad_scale != 0.0 && adapter_->dropout_key() && adapter_->config().lora_dropout > 0;
  return impl.run(grad_scale, z_loss, capture);
}

std::vector<float> Qwen35Model::decode(DecodeState& st, const std::vector<int32_t>& ids) {
  DS_CHECK(!source_ && weights_.size() == static_cast<size_t>(num_parameters()), "decode: the model's weights are "
           "not in weights() (released, or read from a unit source)");
  DS_CHECK(!ids.empty(), "decode: no tokens");
  const size_t L = static_cast<size_t>(cfg_.num_hidden_layers);
  if (st.conv_tail.size() != L) st.conv_tail.assign(L, {}), st.state.assign(L, {}), st.keys.assign(L, {}), st.values.assign(L, {});
  PackedBatch b;
  b.input_ids = ids;
  b.targets.assign(ids.size(), -100);
  b.cu_seqlens = {0, static_cast<int32_t>(ids.size())};
  b.finalize("decode");
  for (int32_t& p : b.positions) p += static_cast<int32_t>(st.length);  // absolute positions (RoPE)
  Impl impl(*this, b);
  impl.dec = &st;
  std::vector<LayerCache> caches;
  Buf h, hf, rstd_f;
  impl.trunk_forward(caches, h, hf, rstd_f, nullptr);  // checks positions < max_position_embeddings
  impl.release(impl.head_unit());
  st.length += static_cast<int64_t>(ids.size());
  const int64_t H = cfg_.hidden_size;
  std::vector<float> logits(static_cast<size_t>(cfg_.vocab_size));
  ops::linear_forward(hf.data() + (b.size() - 1) * H, impl.lm_head_w(), logits.data(), 1, H, cfg_.vocab_size);
  return logits;
}

std::vector<float> Qwen35Model::last_logits(const PackedBatch& batch) {
  DS_CHECK(!source_ && weights_.size() == static_cast<size_t>(num_parameters()), "last_logits: the model's weights "
           "are not in weights() (released, or read from a unit source)");
  DS_CHECK(batch.size() > 0, "last_logits: an empty batch has no last position");
  Impl impl(*this, batch);
  std::vector<LayerCache> caches;
  Buf h, hf, rstd_f;
  impl.trunk_forward(caches, h, hf, rstd_f, nullptr);
  impl.release(impl.head_unit());
  const int64_t H = cfg_.hidden_size;
  std::vector<float> logits(static_cast<size_t>(cfg_.vocab_size));
  ops::linear_forward(hf.data() + (batch.size() - 1) * H, impl.lm_head_w(), logits.data(), 1, H, cfg_.vocab_size);
  return logits;
}

}  // namespace ds
