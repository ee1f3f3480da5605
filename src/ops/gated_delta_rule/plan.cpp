// make_gated_delta_rule_plan: the registry's choice of CUDA backend for the gated delta rule, as a plan (plan.h).
#include "ops/gated_delta_rule/plan.h"

#ifdef DELTASTACK_CUDA
#include "core/error.h"
#include "ops/registry.h"

namespace ds::ops::cuda {

// Defined beside each kernel (plan_simple.cu, ...).
std::unique_ptr<GatedDeltaRulePlan> make_simple_gated_delta_rule_plan(const GdnLimits& limits);

std::unique_ptr<GatedDeltaRulePlan> make_gated_delta_rule_plan(const std::string& backend, const GdnLimits& limits) {
  if (backend == "cuda-simple" || backend == "cuda") return make_simple_gated_delta_rule_plan(limits);
  fail("gated_delta_rule: no CUDA plan for backend \"{}\"", backend);
}

std::unique_ptr<GatedDeltaRulePlan> make_gated_delta_rule_plan(const GdnLimits& limits) {
  const Backend& b = select_backend("gated_delta_rule", "cuda");
  DS_CHECK(!b.reference, "gated_delta_rule: no usable CUDA backend (DELTASTACK_GATED_DELTA_RULE or a failed probe)");
  return make_gated_delta_rule_plan(b.name, limits);
}

}  // namespace ds::ops::cuda
#endif
