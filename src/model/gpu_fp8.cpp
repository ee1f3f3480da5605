#include "model/gpu_fp8.h"

#include <algorithm>
#include <cstdlib>
#include <string>
#include <tuple>

#include <fmt/format.h>

#include "core/error.h"
#include "model/engine.h"

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
  if (const char* a = std::getenv("DELTASTACK_FP8_AMAX"); a && *a) {
    const std::string v = a;
    DS_CHECK(v == "fused" || v == "separate", "DELTASTACK_FP8_AMAX must be fused or separate (got \"{}\")", v);
    r.fused_amax = v == "fused";
  }
  return r;
}

std::string Fp8Recipe::describe() const {
  return fmt::format("per-tensor current scaling, e4m3 weights/activations, {} gradients, fast accumulation {}, amax {}",
                     fp8_format_name(grad),
                     fast_accum_backward ? "everywhere" : fast_accum_forward ? "in the forward" : "off",
                     fused_amax ? "fused into the producers and kept for the pass" : "a pass before every cast");
}

bool fp8_keeps_inputs(const ModelConfig& c, bool fp8, bool recompute_none, bool lora) {
  if (!fp8 || !recompute_none || lora) return false;
  const int64_t H = c.hidden_size, I = c.intermediate_size;
  // out_proj VD -> H, o_proj Hq hd -> H, gate|up H -> 2I, down I -> H
  return fp8_gemm_takes(c.value_dim(), H) && fp8_gemm_takes(c.num_attention_heads * c.head_dim, H) &&
         fp8_gemm_takes(H, 2 * I) && fp8_gemm_takes(I, H);
}

bool fp8_stored_base(bool fp8, bool lora) { return fp8 && lora && engine_knob(kFp8FrozenBaseKnob); }

std::vector<Fp8WeightUnit> fp8_weight_units(const ModelConfig& c, const ParamLayout& layout) {
  const int64_t H = c.hidden_size, I = c.intermediate_size, CD = c.conv_dim(), VD = c.value_dim(),
                Hq = c.num_attention_heads, Hkv = c.num_key_value_heads, hd = c.head_dim;
  std::vector<Fp8WeightUnit> out;
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const LayerParams<int64_t>& o = layout.layer_offsets(i);
    // Each group as model/gpu_model.cpp's linears_forward runs it: (weight index, offset, N) per linear, and K.
    auto group = [&](int64_t K, std::initializer_list<std::tuple<int, int64_t, int64_t>> ls) {
      for (const auto& [w, off, n] : ls)
        if (!fp8_gemm_takes(K, n)) return;
      for (const auto& [w, off, n] : ls) out.push_back({i, w, off, n, K});
    };
    if (c.is_full_attention(i)) {
      group(H, {{0, o.attn.q_proj, Hq * 2 * hd}, {1, o.attn.k_proj, Hkv * hd}, {2, o.attn.v_proj, Hkv * hd}});
      group(Hq * hd, {{3, o.attn.o_proj, H}});
    } else {
      group(H, {{0, o.gdn.in_proj_qkv, CD}, {1, o.gdn.in_proj_z, VD}});
      group(VD, {{3, o.gdn.out_proj, H}});
    }
    group(H, {{4, o.mlp.gate_up, 2 * I}});
    group(I, {{5, o.mlp.down, H}});
  }
  return out;
}

std::vector<Fp8WeightUnit> fp8_stored_units(const ModelConfig& c, const ParamLayout& layout, bool fp8, bool lora) {
  return fp8_stored_base(fp8, lora) ? fp8_weight_units(c, layout) : std::vector<Fp8WeightUnit>{};
}

size_t fp8_kept_bytes(const ModelConfig& c, int64_t max_tokens) {
  const int64_t Np = (max_tokens + 15) / 16 * 16, H = c.hidden_size, I = c.intermediate_size;
  int64_t per_token = 0;  // the mixer's output projection's input, gate|up's, down's: as GpuActivations::reserve
  for (int64_t i = 0; i < c.num_hidden_layers; ++i)
    per_token += (c.is_full_attention(i) ? c.num_attention_heads * c.head_dim : c.value_dim()) + H + I;
  return static_cast<size_t>(Np * per_token);
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
  s.amax = static_cast<size_t>(GpuFp8Bufs::amax_slots(c.num_hidden_layers));
  s.saved_scale = static_cast<size_t>(c.num_hidden_layers * 4 * kFp8Slot);
  return s;
}

float* GpuFp8Linear::kept_scale(int64_t layer, Fp8Input role) const {
  DS_CHECK(b_.saved_scale, "internal: fp8: no kept inputs in this plan");
  (void)input_slot(layer, role);  // its range check
  return b_.saved_scale + (layer * 4 + static_cast<int64_t>(role)) * kFp8Slot;
}

Fp8Matrix GpuFp8Linear::input_keeping_t(const bf16* x, int64_t M, int64_t K, int64_t layer, Fp8Input role,
                                        uint8_t* xt) {
  const float* a = amax_of(input_slot(layer, role), x, M, K);
  K::fp8_quantize_both(x, M, K, K, a, Fp8Format::E4M3, b_.x, K, xt, K::fp8_padded(M), kept_scale(layer, role),
                       b_.f + 3 * kFp8Slot, s_);
  return Fp8Matrix{b_.x, M, K, K, Fp8Format::E4M3, b_.f + 3 * kFp8Slot};
}

Fp8Matrix GpuFp8Linear::kept_t(const uint8_t* xt, int64_t M, int64_t K, int64_t layer, Fp8Input role) const {
  const int64_t Mp = K::fp8_padded(M);
  return Fp8Matrix{xt, K, Mp, Mp, Fp8Format::E4M3, kept_scale(layer, role)};
}

GpuFp8Linear::GpuFp8Linear(const GpuFp8Bufs& b, const Fp8Recipe& r, cudaStream_t s, int64_t layers,
                           bool frozen_weights)
    : b_(b), r_(r), s_(s), layers_(layers), frozen_weights_(frozen_weights),
      have_(static_cast<size_t>(GpuFp8Bufs::amax_slots(layers)), 0) {
  DS_CHECK(b_.amax, "internal: the FP8 scratch has no amax table");
}

void GpuFp8Linear::use_stored_weights(const std::vector<StoredWeight>& weights) {
  stored_.assign(have_.size(), StoredWeight{});
  for (const StoredWeight& w : weights) {
    DS_CHECK(w.q && w.scale, "internal: fp8: stored weight {} of layer {} without codes", w.unit.weight, w.unit.layer);
    stored_[static_cast<size_t>(weight_slot(w.unit.layer, w.unit.weight))] = w;
  }
}

const GpuFp8Linear::StoredWeight* GpuFp8Linear::stored(int64_t layer, int weight, int64_t N, int64_t K) const {
  if (stored_.empty()) return nullptr;
  const StoredWeight& w = stored_[static_cast<size_t>(weight_slot(layer, weight))];
  if (!w.q) return nullptr;
  DS_CHECK(w.unit.rows == N && w.unit.cols == K, "internal: fp8: stored weight [{}, {}] used as [{}, {}]", w.unit.rows,
           w.unit.cols, N, K);
  return &w;
}

int64_t GpuFp8Linear::input_slot(int64_t layer, Fp8Input role) const {
  DS_CHECK(layer >= 0 && layer < layers_, "internal: fp8 amax table: layer {} of {}", layer, layers_);
  return layer * GpuFp8Bufs::kPerLayer + static_cast<int64_t>(role);
}

int64_t GpuFp8Linear::weight_slot(int64_t layer, int weight) const {
  DS_CHECK(layer >= 0 && layer < layers_ && weight >= 0 && weight < 6, "internal: fp8 amax table: layer {} weight {}",
           layer, weight);
  return layer * GpuFp8Bufs::kPerLayer + 4 + weight;
}

float* GpuFp8Linear::amax_of(int64_t slot, const bf16* x, int64_t rows, int64_t cols, bool all_passes) {
  float* a = b_.amax + slot;
  uint64_t& have = have_[static_cast<size_t>(slot)];
  if (!r_.fused_amax || (all_passes ? have == 0 : have != pass_)) {
    K::fp8_amax(x, rows, cols, cols, a, s_);
    have = pass_;
  }
  return a;
}

float* GpuFp8Linear::fused_input_amax(int64_t layer, Fp8Input role) {
  if (!r_.fused_amax) return nullptr;
  const int64_t slot = input_slot(layer, role);
  DS_CUDA_CHECK(cudaMemsetAsync(b_.amax + slot, 0, sizeof(float), s_));
  have_[static_cast<size_t>(slot)] = pass_;
  return b_.amax + slot;
}

float* GpuFp8Linear::fused_grad_amax(int k) {
  DS_CHECK(k >= 0 && k < GpuFp8Bufs::kGradSlots, "internal: fp8 gradient amax slot {}", k);
  if (!r_.fused_amax) return nullptr;
  float* a = b_.amax + layers_ * GpuFp8Bufs::kPerLayer + k;
  DS_CUDA_CHECK(cudaMemsetAsync(a, 0, sizeof(float), s_));
  return a;
}

Fp8Matrix GpuFp8Linear::input(const bf16* x, int64_t M, int64_t K, int64_t layer, Fp8Input role) {
  const float* a = amax_of(input_slot(layer, role), x, M, K);
  K::fp8_quantize(x, M, K, K, a, Fp8Format::E4M3, b_.x, K, b_.f + 3 * kFp8Slot, s_);
  return Fp8Matrix{b_.x, M, K, K, Fp8Format::E4M3, b_.f + 3 * kFp8Slot};
}

void GpuFp8Linear::forward(const Fp8Matrix& qx, const bf16* W, int64_t N, bf16* y, bool accumulate, int64_t layer,
                           int weight, const bf16* residual) {
  DS_CHECK(!(accumulate && residual), "internal: fp8 forward with accumulate and a residual");
  const int64_t Kd = qx.cols;
  Fp8Matrix qw{b_.w, N, Kd, Kd, Fp8Format::E4M3, b_.f + 4 * kFp8Slot};
  if (const StoredWeight* sw = stored(layer, weight, N, Kd)) {  // its cast as stored (W is only the store's key)
    qw = Fp8Matrix{sw->q, N, Kd, Kd, Fp8Format::E4M3, sw->scale};
  } else {
    const float* a = amax_of(weight_slot(layer, weight), W, N, Kd, frozen_weights_);
    K::fp8_quantize(W, N, Kd, Kd, a, Fp8Format::E4M3, b_.w, Kd, b_.f + 4 * kFp8Slot, s_);
  }
  K::gemm_fp8(qx, qw, y, false, N, accumulate || residual ? 1.0f : 0.0f, r_.fast_accum_forward, s_,
              K::Fp8ScaleMode::Tensor, residual);
}

Fp8Matrix GpuFp8Linear::input_t(const bf16* x, int64_t M, int64_t K, int64_t layer, Fp8Input role) {
  const int64_t Mp = K::fp8_padded(M);
  const float* a = amax_of(input_slot(layer, role), x, M, K);
  K::fp8_quantize_transpose(x, M, K, K, a, Fp8Format::E4M3, b_.x, Mp, b_.f + 3 * kFp8Slot, s_);
  return Fp8Matrix{b_.x, K, Mp, Mp, Fp8Format::E4M3, b_.f + 3 * kFp8Slot};
}

void GpuFp8Linear::backward(const bf16* dy, int64_t M, const bf16* W, const Fp8Matrix& qxt, int64_t N, bf16* dx,
                            bool accumulate_dx, float* dW, int64_t layer, int weight, const float* dy_amax,
                            bool overwrite_dw) {
  const int64_t Kd = qxt.rows, Mp = qxt.cols;
  DS_CHECK(Mp == K::fp8_padded(M), "fp8 backward: the input was cast over {} rows, the gradient has {}", Mp, M);
  // dy's amax once for both of its casts (or its producer's).
  if (!dy_amax) {
    K::fp8_amax(dy, M, N, N, b_.f + 2 * kFp8Slot, s_);
    dy_amax = b_.f + 2 * kFp8Slot;
  }
  // dy cast into both layouts in one pass: q(dy) for the dgrad, q(dy^T) for the wgrad
  K::fp8_quantize_both(dy, M, N, N, dy_amax, r_.grad, b_.dy, N, b_.dyt, Mp, b_.f + 6 * kFp8Slot,
                       b_.f + 5 * kFp8Slot, s_);
  // dgrad: dx[M, K] = q(dy)[M, N] . q(W^T)[K, N]^T
  const float* wscale = b_.f + 4 * kFp8Slot;
  if (const StoredWeight* sw = stored(layer, weight, N, Kd)) {  // the stored cast transposed: same codes, scale
    K::fp8_transpose(sw->q, N, Kd, Kd, b_.w, N, s_);
    wscale = sw->scale;
  } else {
    const float* wa = amax_of(weight_slot(layer, weight), W, N, Kd, frozen_weights_);
    K::fp8_quantize_transpose(W, N, Kd, Kd, wa, Fp8Format::E4M3, b_.w, N, b_.f + 4 * kFp8Slot, s_);
  }
  const Fp8Matrix qdy{b_.dy, M, N, N, r_.grad, b_.f + 5 * kFp8Slot}, qwt{b_.w, Kd, N, N, Fp8Format::E4M3, wscale};
  K::gemm_fp8(qdy, qwt, dx, false, Kd, accumulate_dx ? 1.0f : 0.0f, r_.fast_accum_backward, s_);
  if (!dW) return;  // a frozen weight (LoRA's base): dgrad only
  // wgrad: dW[N, K] (+)= q(dy^T)[N, Mp] . qxt[K, Mp]^T (the padding columns are zeros in both)
  const Fp8Matrix qdyt{b_.dyt, N, Mp, Mp, r_.grad, b_.f + 6 * kFp8Slot};
  K::gemm_fp8(qdyt, qxt, dW, true, Kd, overwrite_dw ? 0.0f : 1.0f, r_.fast_accum_backward, s_);
}

}  // namespace ds
#endif
