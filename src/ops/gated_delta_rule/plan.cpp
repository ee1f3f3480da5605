// make_gated_delta_rule_plan: the registry's choice of CUDA backend for the gated delta rule, as a plan (plan.h).
#include "ops/gated_delta_rule/plan.h"

#ifdef DELTASTACK_CUDA
#include "core/error.h"
#include "ops/registry.h"

namespace ds::ops::cuda {

// Defined beside each kernel (plan_simple.cu, ...).
std::unique_ptr<GatedDeltaRulePlan> make_simple_gated_delta_rule_plan(const GdnLimits& limits);
std::unique_ptr<GatedDeltaRulePlan> make_chunked_gated_delta_rule_plan(const GdnLimits& limits);

std::unique_ptr<GatedDeltaRulePlan> make_gated_delta_rule_plan(const std::string& backend, const GdnLimits& limits) {
  if (backend == "cuda-simple") return make_simple_gated_delta_rule_plan(limits);
  if (backend == "cuda-chunked") {
    DS_CHECK(chunked_gated_delta_rule_supports(limits),
             "gated_delta_rule: cuda-chunked needs dk = dv = 128, Hv a multiple of Hk and fewer than 2^31 tokens and "
             "2^28 documents per micro-batch (got dk {}, dv {}, Hk {}, Hv {}, {} tokens, {} documents)", limits.dk,
             limits.dv, limits.Hk, limits.Hv, limits.max_tokens, limits.max_seqs);
    return make_chunked_gated_delta_rule_plan(limits);
  }
  fail("gated_delta_rule: no CUDA plan for backend \"{}\"", backend);
}

std::unique_ptr<GatedDeltaRulePlan> make_gated_delta_rule_plan(const GdnLimits& limits) {
  // The chunked kernel is instantiated for head dim 128 (every Qwen3.5 size); other shapes (the tiny preset) pass
  // over it to the next backend, which the registry probes in turn.
  std::vector<std::string> skip;
  if (!chunked_gated_delta_rule_supports(limits)) {
    const KnobSetting knob = knob_setting("gated_delta_rule");
    // Named explicitly: say why it cannot run here (the named factory's message) rather than pass over it.
    if (knob.mode == KnobMode::Named && knob.backend == "cuda-chunked") return make_gated_delta_rule_plan(knob.backend, limits);
    skip.push_back("cuda-chunked");
  }
  const Backend& b = select_backend("gated_delta_rule", "cuda", skip);
  DS_CHECK(!b.reference, "gated_delta_rule: no usable CUDA backend (DELTASTACK_GATED_DELTA_RULE or a failed probe)");
  return make_gated_delta_rule_plan(b.name, limits);
}

}  // namespace ds::ops::cuda
#endif
