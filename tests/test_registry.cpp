// The op registry (ops/registry.h): the CPU backend of every op is chosen among the CPU backends alone, so a CUDA
// probe that fails (here: no device, every CUDA probe is +infinity) never changes a CPU result.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "core/cuda/device.h"
#include "ops/registry.h"

namespace {

const std::vector<std::string> kOps = {"embedding", "rmsnorm",   "linear",           "conv1d",
                                       "gdn_gate",  "l2norm",    "gated_delta_rule", "gated_rmsnorm",
                                       "rope",      "attention", "swiglu",           "linear_cross_entropy",
                                       "adamw"};

TEST(Registry, FailedCudaProbesLeaveTheCpuBackends) {
  if (ds::cuda_device_count() > 0) GTEST_SKIP() << "a CUDA device is present: its probes may pass";
  if (std::getenv("DELTASTACK_GATED_DELTA_RULE")) GTEST_SKIP() << "DELTASTACK_GATED_DELTA_RULE is set";
  if (ds::cuda_compiled())
    for (const std::string& op : kOps) {
      const ds::ops::Backend& b = ds::ops::select_backend(op, "cuda");
      EXPECT_TRUE(b.reference) << op << ": without a device the CUDA probe must fail";
      EXPECT_EQ(b.device, "cuda") << op;
    }
  for (const std::string& op : kOps) {
    const ds::ops::Backend& b = ds::ops::select_backend(op, "cpu");
    EXPECT_EQ(b.device, "cpu") << op;
    // The chunked CPU gated delta rule passes its (fixed-seed, deterministic) probe; every other op has one.
    EXPECT_EQ(b.name, op == "gated_delta_rule" ? "cpu-chunked (chunk 64)" : "cpu-reference") << op;
  }
}

// DELTASTACK_<OP> takes auto, fast, reference or one of the op's backend names; anything else is an error that names
// the variable. (knob_setting only: select_backend caches its choice for the process.)
TEST(Registry, KnobNamesABackend) {
  const char* var = "DELTASTACK_GATED_DELTA_RULE";
  const char* old = std::getenv(var);
  const std::string saved = old ? old : "";
  setenv(var, "cpu-recurrent", 1);
  ds::ops::KnobSetting k = ds::ops::knob_setting("gated_delta_rule");
  EXPECT_EQ(k.mode, ds::ops::KnobMode::Named);
  EXPECT_EQ(k.backend, "cpu-recurrent");
  setenv(var, "fast", 1);
  EXPECT_EQ(ds::ops::knob_setting("gated_delta_rule").mode, ds::ops::KnobMode::Fast);
  setenv(var, "no-such-backend", 1);
  try {
    ds::ops::knob_setting("gated_delta_rule");
    ADD_FAILURE() << "an unknown backend name must be an error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("DELTASTACK_GATED_DELTA_RULE=no-such-backend"), std::string::npos) << e.what();
  }
  if (old) setenv(var, saved.c_str(), 1);
  else unsetenv(var);
  if (!std::getenv("DELTASTACK_RMSNORM")) {  // another op's backend name is not accepted
    setenv("DELTASTACK_RMSNORM", "cpu-recurrent", 1);
    EXPECT_THROW(ds::ops::knob_setting("rmsnorm"), std::exception);
    unsetenv("DELTASTACK_RMSNORM");
  }
}

}  // namespace
