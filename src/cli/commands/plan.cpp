// deltastack plan: the CUDA engine's memory plan for a model and batch shape, computed on the host (no GPU needed)
// by the same layout function the engine allocates with (model/gpu_plan.h).
#include <fmt/format.h>

#include <cmath>
#include <filesystem>
#include <string>
#include <vector>

#include "cli/commands/commands.h"
#include "cli/commands/outputs.h"
#include "core/error.h"
#include "core/files.h"
#include "model/config.h"
#include "model/gpu_fp8.h"
#include "model/gpu_plan.h"

namespace ds::cli {

LoraConfig memory_flags_lora(const MemoryFlags& m) {
  DS_CHECK(m.lora_rank >= 0, "--lora-rank must be >= 0, got {}", m.lora_rank);
  LoraConfig c;
  if (m.lora_rank == 0) return c;
  c.r = m.lora_rank;
  c.lora_alpha = 8;
  c.target_modules = parse_lora_targets({"all-linear"}, "--lora-rank");
  return c;
}

int cmd_plan_hf_config(const std::string& model, const std::string& out, bool overwrite) {
  const ModelConfig cfg = ModelConfig::resolve(model);
  std::vector<std::string> inputs;
  if (std::filesystem::exists(model)) inputs.push_back(model);  // a config.json or model dir: never written over
  check_outputs({{"--hf-config", out}}, inputs, overwrite);
  write_file_atomic(out, cfg.to_json().dump(2) + "\n");
  fmt::print("plan: {}'s HF config ({} layers, hidden {}, {} parameters) written to {}\n", model,
             cfg.num_hidden_layers, cfg.hidden_size, cfg.num_parameters(), out);
  return 0;
}

int cmd_plan(const std::string& model, int64_t seq_len, int64_t micro_batch, int64_t docs_per_window,
             double device_memory_gib, const std::string& attention, const MemoryFlags& memory) {
  DS_CHECK(seq_len >= 1 && micro_batch >= 1 && docs_per_window >= 1,
           "plan: --seq-len, --micro-batch and --docs-per-window must be at least 1");
  DS_CHECK(std::isfinite(device_memory_gib) && device_memory_gib > 0 && device_memory_gib <= 1e6,
           "plan: --device-memory must be a positive number of GiB (at most 1e6), got {}", device_memory_gib);
  // A document holds at least one token.
  DS_CHECK(docs_per_window <= seq_len, "plan: --docs-per-window {} is more than --seq-len {}: a window of {} tokens "
           "holds at most {} documents", docs_per_window, seq_len, seq_len, seq_len);
  // One micro-batch holds fewer than 2^31 tokens and documents (int32 indices in the kernels).
  constexpr int64_t kMax = (int64_t{1} << 31) - 1;
  DS_CHECK(seq_len <= kMax / micro_batch, "plan: --seq-len {} x --micro-batch {} is more than {} tokens per micro-batch",
           seq_len, micro_batch, kMax);
  DS_CHECK(docs_per_window <= kMax / micro_batch,
           "plan: --docs-per-window {} x --micro-batch {} is more than {} documents per micro-batch", docs_per_window,
           micro_batch, kMax);
  const ModelConfig cfg = ModelConfig::resolve(model);
  DS_CHECK(seq_len <= cfg.max_position_embeddings, "plan: --seq-len {} is above the model's max_position_embeddings {}",
           seq_len, cfg.max_position_embeddings);
  constexpr double GiB = 1073741824.0;
  GpuPlan plan = GpuPlan::windows(micro_batch, seq_len, docs_per_window);
  apply_memory_flags(plan, memory.memory, memory.optimizer_state, memory.recompute, memory.gradients,
                     memory.offload_activations);
  plan.precision = parse_precision(memory.precision);
  plan.fp8_lm_head = memory.fp8_lm_head;
  check_fp8_lm_head(plan.fp8_lm_head, plan.precision);
  DS_CHECK(memory.clip >= 0 && std::isfinite(memory.clip), "plan: --clip must be >= 0, got {}", memory.clip);
  plan.norm_pass = memory.clip > 0;
  plan.lora = memory_flags_lora(memory);
  const bool chosen_state = plan.optimizer_state == OptimizerState::Auto, chosen_rc = plan.recompute == Recompute::Auto,
             chosen_grads = plan.gradients == Gradients::Auto;
  plan = resolve_memory_modes(cfg, plan, [&](const GpuMemoryPlan& q) { return q.total / GiB <= device_memory_gib; },
                              attention);
  const GpuMemoryPlan p = plan_gpu_memory(cfg, plan, attention);
  fmt::print("plan: {} ({:.2f}B parameters), seq {} x micro-batch {} = {} tokens, up to {} documents per window\n",
             model, cfg.num_parameters() / 1e9, seq_len, micro_batch, plan.max_tokens, docs_per_window);
  const bool lora = plan.lora.r > 0;  // the base frozen in bf16: its state and gradient modes do not apply
  const bool fp8_base = fp8_stored_base(plan.precision == Precision::Fp8, lora);
  const char* state_what = lora ? fp8_base ? "the frozen base in bf16, its GEMM weights as FP8 casts only; the "
                                             "adapters' fp32 masters and AdamW moments"
                                           : "the frozen base in bf16 only; the adapters' fp32 masters and AdamW moments"
                           : plan.optimizer_state == OptimizerState::Fp32 ? "fp32 master weights + bf16 copy, fp32 AdamW moments"
                           : plan.optimizer_state == OptimizerState::Bf16
                               ? "bf16 GEMM weights and moments, stochastic rounding"
                               : "bf16 GEMM weights with stochastic rounding, 8-bit blockwise moments";
  const char* rc_what = plan.recompute == Recompute::None        ? "every activation kept"
                        : plan.recompute == Recompute::Selective ? "norm, SwiGLU, conv, l2norm, gated-norm and "
                                                                   "output-gate activations rebuilt"
                        : plan.recompute == Recompute::Mlp ? "selective's, and the gate|up output with its GEMM again"
                        : plan.mlp_layers > 0 ? "the mlp layers keep mlp's activations, the others only their inputs, "
                                                "their forward rerun"
                                              : "only layer inputs kept, each layer's forward rerun";
  fmt::print("  modes: precision {}{}, optimizer state {} ({}{}), recompute {} ({}{}); gated delta rule {}; attention {}\n",
             precision_name(plan.precision),
             plan.precision != Precision::Fp8 ? ""
             : plan.fp8_lm_head ? " (FP8 casts of the GEMM operands in the workspace; the lm head's gradient GEMMs in "
                                  "FP8 too, their casts in the loss scratch)"
                                : " (FP8 casts of the GEMM operands in the workspace)",
             lora ? "lora" : optimizer_state_name(plan.optimizer_state), state_what,
             chosen_state && !lora ? "; chosen by --memory auto" : "",
             recompute_label(plan, cfg.num_hidden_layers), rc_what, chosen_rc ? "; chosen by --memory auto" : "",
             p.gated_delta_rule.empty() ? "-" : p.gated_delta_rule, p.attention.empty() ? "-" : p.attention);
  if (fp8_keeps_inputs(cfg, plan.precision == Precision::Fp8, plan.recompute == Recompute::None, lora)) {
    const double kept = static_cast<double>(fp8_kept_bytes(cfg, plan.max_tokens)) / GiB;
    fmt::print("  fp8: the inputs only FP8 GEMMs read (out_proj / o_proj, gate|up, down) kept for the backward as their "
               "transposed FP8 casts: {:.2f} GiB, {:.2f} GiB less than in bf16\n", kept, kept);
  }
  if (plan.offload_activations)
    fmt::print("  offload: {} of the {} layer inputs in {:.2f} GiB of pinned host memory (host RAM, not counted below), "
               "a ring of {} on the device\n", offloaded_layers(cfg, plan), cfg.num_hidden_layers,
               offload_host_bytes(cfg, plan) / GiB, offload_ring(cfg.num_hidden_layers));
  if (lora)
    fmt::print("  LoRA rank {} (all-linear): the base frozen in bf16{} (no gradient, no optimizer state), the "
               "adapters' fp32 masters, gradients and AdamW moments beside it\n", plan.lora.r,
               fp8_base ? ", its FP8 GEMM weights stored as their E4M3 casts only (1 byte each; "
                          "DELTASTACK_FP8_FROZEN_BASE=0: bf16)" : "");
  const bool ib = plan.gradients == Gradients::InBackward;
  const char* const counts[] = {"two", "three", "four"};  // gpu_layer_slots(): 2, 3 or 4
  const std::string slots = fmt::format("fp32 slots of the embedding, head and {} layers", counts[gpu_layer_slots(plan) - 2]);
  fmt::print("  gradients: {}{}{}\n",
             ib ? "in-backward (each unit updated in the backward; " + slots
             : plan.gradients == Gradients::Bf16
                 ? "bf16 (one buffer of every parameter, 2 bytes each, each micro-batch added with stochastic rounding "
                   "from " + slots + "; lossy)"
             : lora ? std::string("fp32, the adapters' only (a scratch of one layer's small parameters for the base's ops)")
                    : std::string("fp32 (one buffer of every parameter)"),
             !ib ? "" : plan.norm_pass ? "; with --clip a norm-only pass first, about 1.85x the step)" : ")",
             chosen_grads && !lora ? "; chosen by --memory auto" : "");
  // Bytes per parameter beside each part: the figure the optimizer-state and gradient modes trade in.
  const double per = static_cast<double>(cfg.num_parameters());
  for (size_t u = 0; u < p.by_use.size(); ++u)
    fmt::print("  {:<58} {:>9.2f} GiB {:>6.2f} B/param\n", memory_use_name(static_cast<MemoryUse>(u)), p.by_use[u] / GiB,
               static_cast<double>(p.by_use[u]) / per);
  fmt::print("  {:<58} {:>9.2f} GiB\n", "CUDA context, cuBLASLt and cuDNN (measured)", kCudaContextBytes / GiB);
  fmt::print("  {:<58} {:>9.2f} GiB {:>6.2f} B/param\n", "all of it", p.total / GiB, static_cast<double>(p.total) / per);
  fmt::print("total {:.2f} GiB of {:.2f} GiB: {}\n", p.total / GiB, device_memory_gib,
             p.total / GiB <= device_memory_gib ? "fits" : "does not fit");
  return 0;
}

}  // namespace ds::cli
