#include "model/gpu_plan.h"

#include "core/checked.h"
#include "core/error.h"
#include "model/engine.h"

#include <algorithm>
#include <string>

#ifdef DELTASTACK_CUDA
#include <algorithm>
#include <initializer_list>
#include <memory>
#include <optional>
#include <tuple>

#include "model/dims.h"
#include "model/gpu_activations.h"
#include "model/gpu_lora.h"
#include "model/gpu_optimizer.h"
#include "model/gpu_params.h"
#include "model/model.h"
#include "ops/attention/cuda.h"
#include "ops/gated_rmsnorm/cuda.h"
#include "ops/gdn_gate/cuda.h"
#include "ops/rmsnorm/cuda.h"

namespace ds {

namespace K = ds::ops::cuda;

GpuPlan resolved(GpuPlan plan) {
  if (plan.max_seqlen <= 0) plan.max_seqlen = plan.max_tokens;
  DS_CHECK(!plan.offload_activations || plan.recompute == Recompute::Full || plan.recompute == Recompute::Auto,
           "--offload-activations moves the layer inputs that --recompute full keeps to host memory: it needs "
           "--recompute full or auto, not {}", recompute_name(plan.recompute));
  if (plan.lora.r > 0) {
    DS_CHECK(plan.gradients == Gradients::Auto || plan.gradients == Gradients::Fp32, "--gradients {} with LoRA "
             "(--lora-rank / --adapter) is not supported (the adapters' gradients are small: use --gradients fp32)",
             gradients_name(plan.gradients));
    DS_CHECK(plan.shard_world == 0, "--shard optimizer with LoRA on the GPU engine is not supported: LoRA trains "
             "with --shard none (every rank holds the adapters' small AdamW state; the frozen base has none)");
    plan.optimizer_state = OptimizerState::Bf16;  // the frozen base's layout (model/gpu_params.h)
    plan.gradients = Gradients::Fp32;             // the adapters' flat gradient buffer
  }
  return plan;
}

K::GdnLimits gdn_limits(const ModelConfig& c, const GpuPlan& plan) {
  const ops::GdnDims d = gdn_dims(c, 1, 1);
  return K::GdnLimits{plan.max_tokens, plan.max_seqs, d.Hk, d.Hv, d.dk, d.dv, d.scale};
}

K::AttnLimits attn_limits(const ModelConfig& c, const GpuPlan& plan) {
  K::AttnLimits l;
  l.max_tokens = plan.max_tokens;
  l.max_seqs = plan.max_seqs;
  l.max_seqlen = resolved(plan).max_seqlen;
  l.rows = plan.rows;
  l.Hq = c.num_attention_heads;
  l.Hkv = c.num_key_value_heads;
  l.head_dim = c.head_dim;
  l.scale = attn_dims(c, 1, 1).scale;
  // DELTASTACK_ATTENTION_SPLIT=1 (model/engine.h): cuDNN's backward once per key/value head, its dP workspace
  // divided by Hkv.
  l.head_groups = engine_knob(kAttentionSplitKnob, false) ? c.num_key_value_heads : 1;
  return l;
}

K::Conv1dPlan conv_plan(const ModelConfig& c, const GpuPlan& plan) {
  return K::Conv1dPlan(plan.max_tokens, c.conv_dim(), c.linear_conv_kernel_dim);
}

K::LinearCrossEntropyPlan ce_plan(const ModelConfig& c, const GpuPlan& plan) {
  const bool fp8_head = plan.fp8_lm_head && plan.precision == Precision::Fp8;
  if (fp8_head) {
    const std::string why = K::linear_cross_entropy_fp8_unsupported(c.hidden_size, c.vocab_size, plan.ce_chunk_tokens);
    DS_CHECK(why.empty(), "--fp8-lm-head: the FP8 lm head's GEMMs need sizes in multiples of 16, and {} (use the "
             "bf16 lm head: leave --fp8-lm-head out)", why);
  }
  return K::LinearCrossEntropyPlan(plan.max_tokens, c.hidden_size, c.vocab_size, plan.ce_chunk_tokens,
                                   fp8_head, /*head_grads=*/plan.lora.r == 0);  // LoRA freezes the head
}

void lay_out_gpu_memory(Arena& a, const ModelConfig& c, const GpuPlan& plan, GpuParamStore& store,
                        GpuOptimizer* optimizer, GpuLora* lora, GpuActivations& acts, const GpuOpSizes& ops) {
  const int64_t N = plan.max_tokens, S = plan.max_seqs, H = c.hidden_size, Hv = c.linear_num_value_heads, Hq = c.num_attention_heads, Hkv = c.num_key_value_heads, hd = c.head_dim;
  store.reserve(a);
  if (optimizer) optimizer->reserve(a);
  if (lora) lora->reserve(a);
  GpuActivations::Sizes sz;
  sz.max_tokens = N;
  sz.max_seqs = S;
  sz.gdn_saved = ops.gdn_saved;
  sz.gdn_batch = ops.gdn_batch;
  sz.attn_batch = ops.attn_batch;
  sz.op_scratch = std::max({K::rmsnorm_scratch_bytes(N, H), K::rmsnorm_scratch_bytes(N * Hq, hd),
                            K::rmsnorm_scratch_bytes(N * Hkv, hd),
                            K::gated_rmsnorm_scratch_bytes(N * Hv, c.linear_value_head_dim),
                            K::gdn_gate_scratch_bytes(N, Hv), ops.conv_workspace, ops.gdn_workspace,
                            ops.attn_workspace});
  sz.ce_scratch = ops.ce_workspace;
  sz.recompute = plan.recompute;
  sz.kept_layers = plan.kept_layers;
  sz.mlp_layers = plan.recompute == Recompute::Full ? plan.mlp_layers : 0;
  sz.selective_layers = plan.recompute == Recompute::Mlp ? plan.selective_layers : 0;
  sz.fp8 = plan.precision == Precision::Fp8;
  sz.fp8_saved = fp8_keeps_inputs(c, sz.fp8, plan.recompute == Recompute::None, lora != nullptr);
  sz.offload = plan.offload_activations;
  sz.lora = lora != nullptr;
  acts.reserve(a, c, sz);
}

GpuMemoryPlan plan_gpu_memory(const ModelConfig& c, const GpuPlan& plan_in, const std::string& attention) {
  DS_CHECK(attention == "cudnn" || attention == "simple", "plan: attention must be cudnn or simple (got \"{}\")",
           attention);
  DS_CHECK(plan_in.max_tokens > 0 && plan_in.max_seqs > 0, "plan: the batch must hold at least one token");
  const GpuPlan plan = resolved(plan_in);
  DS_CHECK(plan.optimizer_state != OptimizerState::Auto && plan.recompute != Recompute::Auto &&
           plan.gradients != Gradients::Auto, "plan: resolve the memory modes first (resolve_memory_modes)");
  c.validate();
  const std::vector<ParamSpec> params = qwen35_params(c);  // the table only: no memory for the values
  ParamLayout layout(c, params);
  const bool lora = plan.lora.r > 0;
  GpuParamStore store(layout, params, plan.optimizer_state, ParamShard{plan.shard_rank, plan.shard_world},
                      param_units(c, params), plan.gradients, lora,
                      fp8_stored_units(c, layout, plan.precision == Precision::Fp8, lora), gpu_layer_slots(plan));
  std::optional<GpuAdamW> optimizer;
  std::optional<GpuLora> adapters;
  if (lora) adapters.emplace(c, plan.lora, plan.max_tokens);
  else optimizer.emplace(store);
  GpuActivations acts;
  GpuMemoryPlan out;
  GpuOpSizes ops;
  bool has_attention = false, has_gdn = false;
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) (c.is_full_attention(i) ? has_attention : has_gdn) = true;
  if (has_gdn) {
    const K::GdnLimits lim = gdn_limits(c, plan);
    const std::unique_ptr<K::GatedDeltaRulePlan> gdn = K::make_gated_delta_rule_plan(
        K::chunked_gated_delta_rule_supports(lim) ? "cuda-chunked" : "cuda-simple", lim);
    ops.gdn_saved = gdn->saved_bytes();
    ops.gdn_batch = gdn->batch_bytes();
    ops.gdn_workspace = gdn->workspace_bytes();
    out.gated_delta_rule = gdn->name();
  }
  if (has_attention) {
    ops::AttnDims ad = attn_dims(c, plan.max_tokens, plan.max_seqs);
    ops.attn_workspace = K::attention_scratch_bytes(ad);
    out.attention = "cuda-simple";
    if (attention == "cudnn") {
      const K::AttnLimits b = attn_limits(c, plan);
      constexpr const char* kWhat = "plan: the cuDNN attention workspace is more than 2^64 bytes";
      size_t dp = 0, entries = 0;
      for (const ops::cudnn::BucketShape& bk : ops::cudnn::attention_buckets(b)) {
        size_t bytes = 2;  // bf16 dP of bmax x Hq x S x S, for one head group's Hq / head_groups heads
        for (int64_t f : {bk.bmax, int64_t{b.Hq / b.head_groups}, int64_t{bk.S}, int64_t{bk.S}})
          bytes = checked_mul(bytes, static_cast<size_t>(f), kWhat);
        dp = std::max(dp, bytes);
        entries = checked_add(entries, static_cast<size_t>(bk.bmax), kWhat);
      }
      ops.attn_workspace = std::max(ops.attn_workspace, checked_add(dp, dp / 8, kWhat));
      ops.attn_batch = checked_mul(entries, 8 * sizeof(int32_t), kWhat);  // lengths and ragged offsets per entry
      out.attention = "cudnn (fused SDPA, workspace estimated)";
    }
  }
  ops.conv_workspace = conv_plan(c, plan).workspace_bytes();
  ops.ce_workspace = ce_plan(c, plan).workspace_bytes();
  Arena sizing;
  lay_out_gpu_memory(sizing, c, plan, store, optimizer ? &*optimizer : nullptr, adapters ? &*adapters : nullptr, acts,
                     ops);
  out.by_use = sizing.by_use;
  out.allocation = sizing.off;
  out.total = sizing.off + kCudaContextBytes;
  return out;
}

std::vector<MemoryModes> memory_candidates(OptimizerState s, Recompute r, Gradients g, bool norm_pass) {
  // Exact modes before lossy ones, cheap recompute before expensive: the fp32 state with no, selective or mlp
  // recompute (bitwise the same results; mlp reruns the gate|up GEMM, about +4 % per step, for its N x 2I bf16 per
  // layer), then the bf16 state with those, then the 8bit state (lossier: its moments carry 8-bit codes), then full
  // recompute (one more forward per step, +25 %) in the same state order. The in-backward gradients are bitwise the
  // fp32 buffer's step: right after it without a norm pass, after everything with one.
  using OS = OptimizerState;
  using RC = Recompute;
  const std::pair<OS, RC> order[] = {{OS::Fp32, RC::None},     {OS::Fp32, RC::Selective},     {OS::Fp32, RC::Mlp},
                                     {OS::Bf16, RC::None},     {OS::Bf16, RC::Selective},     {OS::Bf16, RC::Mlp},
                                     {OS::EightBit, RC::None}, {OS::EightBit, RC::Selective}, {OS::EightBit, RC::Mlp},
                                     {OS::Fp32, RC::Full},     {OS::Bf16, RC::Full},          {OS::EightBit, RC::Full}};
  std::vector<MemoryModes> out;
  auto add = [&](OS st, RC rc, Gradients gr) {
    if ((r == RC::Auto || r == rc) && (s == OS::Auto || s == st) && (g == Gradients::Auto || g == gr))
      out.push_back({st, rc, gr});
  };
  for (const auto& [st, rc] : order) {
    add(st, rc, Gradients::Fp32);
    if (!norm_pass) add(st, rc, Gradients::InBackward);
  }
  if (norm_pass)
    for (const auto& [st, rc] : order) add(st, rc, Gradients::InBackward);
  // The bf16 gradients are lossy: never chosen by auto, only the (state, recompute) pairs around them when given.
  if (g == Gradients::Bf16)
    for (const auto& [st, rc] : order) add(st, rc, Gradients::Bf16);
  return out;
}

namespace {

// The share of a decoder layer's forward GEMM FLOPs in its gate|up GEMM, over all layers: what a layer rebuilding
// only mlp's activations (GpuPlan::mlp_layers) still runs of the forward that full recompute runs again.
double gate_up_share(const ModelConfig& c) {
  const double H = static_cast<double>(c.hidden_size), I = static_cast<double>(c.intermediate_size);
  double gate_up = 0, all = 0;
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const double mixer =
        c.is_full_attention(i)
            ? H * static_cast<double>((3 * c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim)
            : H * static_cast<double>(c.conv_dim() + 2 * c.value_dim() + 2 * c.linear_num_value_heads);
    gate_up += 2 * I * H;
    all += mixer + 3 * I * H;
  }
  return gate_up / all;
}

// The most n in [0, hi] for which plan `at(n)` fits (its bytes grow with n), by bisection.
int64_t most_that_fit(int64_t hi, const std::function<bool(int64_t)>& fits_at) {
  int64_t lo = 0;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (fits_at(mid)) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

GpuPlan resolve_modes(const ModelConfig& c, GpuPlan plan, const std::function<bool(const GpuMemoryPlan&)>& fits,
                      const std::string& attention) {
  plan = resolved(plan);  // a LoRA plan: only the recompute policy is left to choose
  // --offload-activations with --recompute auto: full recompute (the kept layers still chosen), the state and the
  // gradients as auto takes them.
  const Recompute rc = plan.offload_activations && plan.recompute == Recompute::Auto ? Recompute::Full : plan.recompute;
  const auto candidates = memory_candidates(plan.optimizer_state, rc, plan.gradients, plan.norm_pass);
  const bool choose_layers = plan.recompute == Recompute::Auto && plan.kept_layers == 0;
  for (size_t k = 0; k < candidates.size(); ++k) {
    GpuPlan p = plan;
    p.optimizer_state = candidates[k].state;
    p.recompute = candidates[k].recompute;
    p.gradients = candidates[k].gradients;
    if (choose_layers && rebuilds_activations(p.recompute)) {
      const int64_t L = c.num_hidden_layers;
      if (p.recompute == Recompute::Mlp) {
        // The most layers that keep their gate|up output (selective_layers) and still fit: a layer's N x 2I gate|up
        // saves its GEMM (about 0.76 ms per 403 MB at 2B, seq 8192 x 2, fp8), more time per byte than keeping the
        // rest of what selective rebuilds (about 0.57 ms per 720 MB there), so these come before any kept layer.
        // All L fitting is the selective candidate before this one, which would have been taken; and with fewer,
        // the bytes left are fewer than one more such layer's, so fewer than a kept layer's: kept_layers stays 0.
        const int64_t sel = most_that_fit(L - 1, [&](int64_t s) {
          p.selective_layers = s;
          return fits(plan_gpu_memory(c, p, attention));
        });
        p.selective_layers = sel;
        if (sel > 0) return p;
      }
      // The most layers that keep their activations (none's speed for them) and still fit; the bytes grow with
      // kept_layers, so a bisection over 1 .. L-1 finds it.
      const int64_t kept = most_that_fit(L - 1, [&](int64_t k) {
        p.kept_layers = k;
        return fits(plan_gpu_memory(c, p, attention));
      });
      p.kept_layers = kept;
      if (p.recompute == Recompute::Full) {
        // Or the most layers rebuilding only mlp's activations (each keeps about a third of what a kept layer
        // does): a kept layer saves its forward, an mlp layer its forward but the gate|up GEMM. The plan that saves
        // more of the forward full runs again wins.
        GpuPlan q = p;
        q.kept_layers = 0;
        const int64_t m = most_that_fit(L - 1, [&](int64_t n) {
          q.mlp_layers = n;
          return fits(plan_gpu_memory(c, q, attention));
        });
        q.mlp_layers = m;
        if (static_cast<double>(m) * (1 - gate_up_share(c)) > static_cast<double>(kept)) return q;
      }
      if (kept > 0) return p;
    }
    if (k + 1 == candidates.size() || fits(plan_gpu_memory(c, p, attention))) return p;
  }
  return plan;  // unreachable: at least one candidate
}

}  // namespace

GpuPlan resolve_memory_modes(const ModelConfig& c, GpuPlan plan, const std::function<bool(const GpuMemoryPlan&)>& fits,
                             const std::string& attention) {
  auto resolve = [&](GpuPlan p) {
    const GpuPlan chosen = resolve_modes(c, p, fits, attention);
    // --recompute auto's last resort before "does not fit": full recompute with the layer inputs offloaded to the
    // host (bitwise the same steps; the copies run beside the compute), and its kept layers. When that does not
    // fit either, it is still the leanest plan, the one the caller reports.
    if (p.recompute == Recompute::Auto && !p.offload_activations && !fits(plan_gpu_memory(c, chosen, attention))) {
      p.offload_activations = true;
      return resolve_modes(c, p, fits, attention);
    }
    return chosen;
  };
  if (plan.layer_slots == 0) plan.layer_slots = layer_slots();  // DELTASTACK_LAYER_SLOTS, or 0
  if (plan.layer_slots != 0) return resolve(plan);
  // The layer slots (GpuPlan::layer_slots). In-backward, a third slot gives the side stream's update of a layer one
  // layer's backward more before the step waits for its slot, at one layer's fp32 gradients. Measured on the H200
  // (docs/gpu.md, tenth and eleventh sessions): 9B x 1 within 76 GiB, the slot alone 622.9 -> 620.4 ms and with the
  // wgrad GEMMs writing the slots 614.5 ms (its slot waits were 14 ms), although two kept layers fewer fit (6 -> 4);
  // 2B x 2 within 36 GiB, where the waits were 0.05 ms, no gain either way (358.6 -> 355.6, 349.4 -> 350.7 ms on
  // two machines). So three where it costs at most two of the layers the plan keeps more of (kept, gate|up or mlp
  // layers; those are each worth about what the slot gave at 9B) and the modes (state, gradients, recompute policy,
  // offload) stay those of two; else two.
  plan.layer_slots = 2;
  const GpuPlan two = resolve(plan);
  if (two.gradients != Gradients::InBackward) return two;
  plan.layer_slots = 3;
  const GpuPlan three = resolve(plan);
  const bool same_modes = three.gradients == two.gradients && three.optimizer_state == two.optimizer_state &&
                          three.recompute == two.recompute && three.offload_activations == two.offload_activations;
  const int64_t layers_lost = (two.kept_layers - three.kept_layers) + (two.selective_layers - three.selective_layers) +
                              (two.mlp_layers - three.mlp_layers);
  return same_modes && layers_lost <= 2 && fits(plan_gpu_memory(c, three, attention)) ? three : two;
}

}  // namespace ds

#else

namespace ds {
GpuMemoryPlan plan_gpu_memory(const ModelConfig&, const GpuPlan&, const std::string&) {
  fail("plan: this build has no CUDA support (configure with -DDELTASTACK_CUDA=ON and nvcc on PATH)");
}
std::vector<MemoryModes> memory_candidates(OptimizerState, Recompute, Gradients, bool) { return {}; }
GpuPlan resolve_memory_modes(const ModelConfig&, GpuPlan, const std::function<bool(const GpuMemoryPlan&)>&,
                             const std::string&) {
  fail("plan: this build has no CUDA support (configure with -DDELTASTACK_CUDA=ON and nvcc on PATH)");
}
}  // namespace ds

#endif

namespace ds {

int64_t offloaded_layers(const ModelConfig& c, const GpuPlan& plan) {
  return plan.offload_activations ? c.num_hidden_layers - offload_ring(c.num_hidden_layers) : 0;
}

size_t offload_host_bytes(const ModelConfig& c, const GpuPlan& plan) {
  constexpr const char* kWhat = "plan: the offloaded layer inputs' bytes";
  return checked_mul(checked_mul(static_cast<size_t>(offloaded_layers(c, plan)), static_cast<size_t>(plan.max_tokens),
                                 kWhat), static_cast<size_t>(c.hidden_size) * sizeof(uint16_t), kWhat);
}

std::string recompute_label(const GpuPlan& plan, int64_t layers) {
  const bool partial = rebuilds_activations(plan.recompute) && plan.kept_layers > 0;
  std::string offload = plan.offload_activations ? ", the layer inputs offloaded to host memory" : "";
  const int64_t sel = plan.recompute == Recompute::Mlp
                          ? std::min(plan.selective_layers, layers - std::min(plan.kept_layers, layers)) : 0;
  if (sel > 0) {  // (before offload's text: offload needs full)
    offload = fmt::format(", {} {} of {} keeping their gate|up output", partial ? "the next" : "the first", sel,
                          layers) + offload;
  }
  const int64_t m = std::min(plan.mlp_layers, layers - std::min(plan.kept_layers, layers));
  if (plan.recompute == Recompute::Full && m > 0) {
    offload = fmt::format(", {} {} of {} rebuilding only mlp's activations", plan.kept_layers > 0 ? "the next" : "the first",
                          m, layers) + offload;
  }
  if (!partial) return recompute_name(plan.recompute) + offload;
  const int64_t k = std::min(plan.kept_layers, layers);
  return (k == 1 ? fmt::format("{}, the first of {} layers keeping its activations", recompute_name(plan.recompute), layers)
                 : fmt::format("{}, the first {} of {} layers keeping their activations", recompute_name(plan.recompute),
                               k, layers)) + offload;
}

}  // namespace ds
