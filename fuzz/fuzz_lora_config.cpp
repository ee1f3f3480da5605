// libFuzzer target for the LoRA adapter config reader (model/lora.h; see fuzz/README.md for the build command).
// Each input is an adapter_config.json text: nlohmann::json::parse (a parse error is a rejected input), then
// parse_lora_config. Rejection must be a ds::Error, never a crash, sanitizer report, another exception or a hang.
// An accepted config must be usable: r in [1, 2^20], lora_alpha finite, a finite scaling, lora_dropout in [0, 1),
// target_modules non-empty, sorted and without duplicates; and lora_config_to_json -> parse_lora_config must give
// it back exactly.
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
#include "model/lora.h"

namespace {

[[noreturn]] void bug(const char* what, const std::string& detail = "") {
  std::fprintf(stderr, "fuzz_lora_config invariant violated: %s %s\n", what, detail.c_str());
  std::abort();
}

void check_accepted(const ds::LoraConfig& c) {
  if (c.r < 1 || c.r > (int64_t{1} << 20)) bug("r", std::to_string(c.r));
  if (!std::isfinite(c.lora_alpha) || !std::isfinite(c.scaling())) bug("lora_alpha / scaling");
  if (!(c.lora_dropout >= 0 && c.lora_dropout < 1)) bug("lora_dropout");
  if (c.target_modules.empty()) bug("no target modules");
  for (size_t i = 1; i < c.target_modules.size(); ++i)
    if (!(c.target_modules[i - 1] < c.target_modules[i])) bug("target_modules not sorted and unique");
  const nlohmann::json out = ds::lora_config_to_json(c, "base");
  ds::LoraConfig c2;
  try {
    c2 = ds::parse_lora_config(nlohmann::json::parse(out.dump()), "fuzz-roundtrip");
  } catch (const ds::Error& e) {
    bug("lora_config_to_json output rejected:", e.what());
  }
  if (c2.r != c.r || c2.lora_alpha != c.lora_alpha || c2.lora_dropout != c.lora_dropout ||
      c2.use_rslora != c.use_rslora || c2.target_modules != c.target_modules)
    bug("lora_config_to_json -> parse_lora_config round trip", out.dump());
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return fuzz_json_input(data, size, "fuzz_lora_config",
                         [](const nlohmann::json& j) { check_accepted(ds::parse_lora_config(j, "fuzz")); });
}
