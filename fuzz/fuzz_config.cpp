// libFuzzer target for the model config reader (see fuzz/README.md for the build command).
// Each input is a config.json text: nlohmann::json::parse (a parse error is a rejected input), then
// ModelConfig::from_json. Rejection must be a ds::Error, never a crash, sanitizer report (UBSan catches signed
// overflow in the derived quantities), another exception, a hang or an absurd allocation. An accepted config
// must be self-consistent: one layer type per layer, positive derived sizes and parameter count (computed
// without overflow), rotary_dim even and within head_dim, and to_json -> from_json must reproduce it exactly.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "json_input.h"
#include "model/config.h"

namespace {

[[noreturn]] void bug(const char* what, const std::string& detail = "") {
  std::fprintf(stderr, "fuzz_config invariant violated: %s %s\n", what, detail.c_str());
  std::abort();
}

void check_accepted(const ds::ModelConfig& c) {
  if (static_cast<int64_t>(c.layer_types.size()) != c.num_hidden_layers) bug("layer_types size");
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const std::string& t = c.layer_types[static_cast<size_t>(i)];
    if (t != "full_attention" && t != "linear_attention") bug("layer type", t);
    if (c.is_full_attention(i) != (t == "full_attention")) bug("is_full_attention");
  }
  if (c.key_dim() <= 0 || c.value_dim() <= 0 || c.conv_dim() <= 0) bug("derived linear-attention sizes");
  if (c.rotary_dim() < 2 || c.rotary_dim() % 2 != 0 || c.rotary_dim() > c.head_dim) bug("rotary_dim");
  if (c.num_parameters() <= 0) bug("num_parameters");
  if (!std::isfinite(c.rms_norm_eps) || !std::isfinite(c.rope_theta) || !std::isfinite(c.partial_rotary_factor) ||
      !std::isfinite(c.initializer_range))
    bug("non-finite float field");
  // Round trip through the writer.
  const nlohmann::json out = c.to_json();
  ds::ModelConfig c2;
  try {
    c2 = ds::ModelConfig::from_json(nlohmann::json::parse(out.dump()), "fuzz-roundtrip");
  } catch (const ds::Error& e) {
    bug("to_json output rejected:", e.what());
  }
  if (c2.to_json() != out) bug("to_json -> from_json round trip", out.dump());
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return fuzz_json_input(data, size, "fuzz_config",
                         [](const nlohmann::json& j) { check_accepted(ds::ModelConfig::from_json(j, "fuzz")); });
}
