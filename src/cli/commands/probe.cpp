#include <fmt/format.h>

#include "cli/commands/commands.h"
#include "ops/registry.h"

namespace ds::cli {

int cmd_probe() {
  auto rows = ops::probe_all();
  fmt::print("{:<24} {:<8} {:<28} {:>12} {:>10}  {}\n", "op", "device", "backend", "error", "band", "status");
  bool ok = true;
  for (const auto& r : rows) {
    fmt::print("{:<24} {:<8} {:<28} {:>12.3e} {:>10.1e}  {}\n", r.op, r.device, r.backend, r.error, r.band, r.status);
    ok = ok && r.status != "rejected";
  }
  return ok ? 0 : 1;  // non-zero when a fast backend failed its self-probe
}

}  // namespace ds::cli
