#include "ops/registry.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <iterator>
#include <map>
#include <mutex>
#include <set>

#include "core/cuda/device.h"
#include "core/error.h"
#include "core/log.h"
#include "ops/gated_delta_rule/dispatch.h"
#ifdef DELTASTACK_CUDA
#include "ops/adamw/cuda_check.h"
#include "ops/attention/cuda_check.h"
#include "ops/attention/cudnn.h"
#include "ops/conv1d/cuda_check.h"
#include "ops/elementwise/cuda_check.h"
#include "ops/embedding/cuda_check.h"
#include "ops/gated_delta_rule/cuda_check.h"
#include "ops/gated_rmsnorm/cuda_check.h"
#include "ops/gdn_gate/cuda_check.h"
#include "ops/l2norm/cuda_check.h"
#include "ops/linear/cuda_check.h"
#include "ops/linear/fp8_check.h"
#include "ops/linear_cross_entropy/cuda_check.h"
#include "ops/rmsnorm/cuda_check.h"
#include "ops/rope/cuda_check.h"
#include "ops/swiglu/cuda_check.h"
#endif

namespace ds::ops {

namespace {

struct OpEntry {
  std::string name;
  std::vector<Backend> backends;  // fast first, reference last
};

#ifdef DELTASTACK_CUDA
// Device "cuda": the CUDA backend first, then a reference entry last that only marks "no usable CUDA backend":
// the GPU engine has no per-op CPU fallback, so selecting it makes require_cuda_backends() stop with a clear
// error. Each probe is probe_cuda_<op>() of src/ops/<op>/cuda_check.h: the op's check function (the same one
// tests/test_cuda_*.cpp run) over its fixed probe cases, the worst relative L2 error against the fp32 CPU
// reference. Bands (ops/check/check.h): 1e-2 for ops with gradients (2e-2 where dg/dbeta are outputs), 5e-3 for
// the optimizer (forward only).
void add_cuda_backends(std::vector<OpEntry>& t) {
  struct CudaProbe {
    const char* op;
    double (*probe)();
    double band;
  };
  const CudaProbe probes[] = {
      {"embedding", &probe_cuda_embedding, 1e-2},
      {"rmsnorm", &probe_cuda_rmsnorm, 1e-2},
      {"linear", &probe_cuda_linear, 1e-2},
      {"linear_fp8", &probe_cuda_linear_fp8, 1e-2},
      {"conv1d", &probe_cuda_conv1d, 1e-2},
      {"gdn_gate", &probe_cuda_gdn_gate, 2e-2},
      {"l2norm", &probe_cuda_l2norm, 1e-2},
      {"gated_delta_rule", &probe_cuda_gated_delta_rule, 2e-2},
      {"gated_rmsnorm", &probe_cuda_gated_rmsnorm, 1e-2},
      {"rope", &probe_cuda_rope, 1e-2},
      {"attention", &probe_cuda_attention, 1e-2},
      {"output_gate", &probe_cuda_output_gate, 1e-2},
      {"swiglu", &probe_cuda_swiglu, 1e-2},
      {"linear_cross_entropy", &probe_cuda_linear_cross_entropy, 1e-2},
      {"adamw", &probe_cuda_adamw, 5e-3},
  };
  // The attention output gate has its own row with the CUDA backends (its CPU math lives in attention.h).
  auto has = [&](const char* name) {
    return std::any_of(t.begin(), t.end(), [&](const OpEntry& e) { return e.name == name; });
  };
  if (!has("output_gate")) {
    auto at = std::find_if(t.begin(), t.end(), [](const OpEntry& e) { return e.name == "attention"; });
    if (at != t.end()) ++at;
    t.insert(at, OpEntry{"output_gate", {Backend{"cpu-reference", "cpu", true, {}, 0.0, {}}}});
  }
  for (const CudaProbe& p : probes) {
    auto e = std::find_if(t.begin(), t.end(), [&](const OpEntry& x) { return x.name == p.op; });
    if (e == t.end()) {
      t.push_back(OpEntry{p.op, {}});
      e = std::prev(t.end());
    }
    e->backends.insert(e->backends.begin(), Backend{"cuda", "cuda", false, p.probe, p.band, {}});
    e->backends.push_back(Backend{"cpu-reference (no device fallback)", "cuda", true, {}, 0.0, {}});
  }
  // Gated delta rule: the chunked tensor-core kernel first (head dim 128; ops/gated_delta_rule/plan.h passes over
  // it for other shapes), then the simple recurrent kernel.
  auto gd = std::find_if(t.begin(), t.end(), [](const OpEntry& x) { return x.name == "gated_delta_rule"; });
  for (Backend& b : gd->backends)
    if (b.device == "cuda" && b.name == "cuda") b.name = "cuda-simple";
  gd->backends.insert(gd->backends.begin(), Backend{"cuda-chunked", "cuda", false,
                                                    &probe_cuda_gated_delta_rule_chunked, 2e-2, {}});
  // Attention: cuDNN's fused SDPA first (where libcudnn loads), then the simple flash kernel above.
  auto at = std::find_if(t.begin(), t.end(), [](const OpEntry& x) { return x.name == "attention"; });
  for (Backend& b : at->backends)
    if (b.device == "cuda" && b.name == "cuda") b.name = "cuda-simple";
  at->backends.insert(at->backends.begin(), Backend{"cudnn (fused SDPA)", "cuda", false, &probe_cudnn_attention, 1e-2,
                                                    &cudnn::attention_unavailable});
}
#endif

std::vector<OpEntry> build_table() {
  std::vector<OpEntry> t;
  auto ref_only = [&](const char* name) {
    t.push_back({name, {Backend{"cpu-reference", "cpu", true, {}, 0.0, {}}}});
  };
  ref_only("embedding");
  ref_only("rmsnorm");
  ref_only("linear");
  // `--precision fp8`'s GEMMs: the CPU engine emulates the casts (core/fp8.h) around its fp32 GEMMs.
  t.push_back({"linear_fp8", {Backend{"cpu-emulation", "cpu", true, {}, 0.0, {}}}});
  ref_only("conv1d");
  ref_only("gdn_gate");
  ref_only("l2norm");
  t.push_back({"gated_delta_rule",
               {Backend{"cpu-chunked (chunk 64)", "cpu", false, &probe_chunked_gated_delta_rule, 1e-5, {}},
                Backend{"cpu-recurrent", "cpu", true, {}, 0.0, {}}}});
  ref_only("gated_rmsnorm");
  ref_only("rope");
  ref_only("attention");
  ref_only("swiglu");
  ref_only("linear_cross_entropy");
  ref_only("adamw");
#ifdef DELTASTACK_CUDA
  if (cuda_compiled()) add_cuda_backends(t);
#endif
  return t;
}

std::mutex g_mu;
std::vector<OpEntry>& table() {
  static std::vector<OpEntry> t = build_table();
  return t;
}
std::map<std::string, double> g_probe_error;  // key op/device/backend
std::map<std::string, const Backend*> g_selected;  // key op/device

std::string probe_key(const std::string& op, const Backend& b) { return op + "/" + b.device + "/" + b.name; }

double run_probe(const std::string& op, const Backend& b) {
  std::string key = probe_key(op, b);
  auto it = g_probe_error.find(key);
  if (it != g_probe_error.end()) return it->second;
  double e = b.probe ? b.probe() : 0.0;
  if (!std::isfinite(e)) e = INFINITY;
  g_probe_error[key] = e;
  return e;
}

std::string knob_var(const std::string& op) {
  std::string var = "DELTASTACK_";
  for (char ch : op) var += static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
  return var;
}

}  // namespace

namespace {
// Every backend name of `op` (any device).
bool has_backend_named(const std::string& op, const std::string& name) {
  for (const OpEntry& e : table())
    if (e.name == op)
      for (const Backend& b : e.backends)
        if (b.name == name) return true;
  return false;
}
}  // namespace

KnobSetting knob_setting(const std::string& op) {
  const std::string var = knob_var(op);
  const char* v = std::getenv(var.c_str());
  if (!v || std::string(v).empty() || std::string(v) == "auto") return {KnobMode::Auto, {}};
  static std::set<std::string> logged;
  std::string s(v);
  KnobSetting k;
  if (s == "fast") k.mode = KnobMode::Fast;
  else if (s == "reference") k.mode = KnobMode::Reference;
  else {
    std::lock_guard<std::mutex> lk(g_mu);
    DS_CHECK(has_backend_named(op, s), "{}={}: expected auto, fast, reference or the name of one of {}'s backends "
             "in this build (deltastack probe lists them)", var, s, op);
    k.mode = KnobMode::Named;
    k.backend = s;
  }
  {
    std::lock_guard<std::mutex> lk(g_mu);
    if (logged.insert(var).second) log_info("{}={} in effect", var, s);
  }
  return k;
}

void check_knobs() {
  std::vector<std::string> ops;
  {
    std::lock_guard<std::mutex> lk(g_mu);
    for (const OpEntry& e : table()) ops.push_back(e.name);
  }
  for (const std::string& op : ops) knob_setting(op);
}

const Backend& select_backend(const std::string& op, const std::string& device) {
  return select_backend(op, device, std::vector<std::string>{});
}

const Backend& select_backend(const std::string& op, const std::string& device, const std::vector<std::string>& skip) {
  std::string key = op + "/" + device;
  for (const std::string& n : skip) key += "/-" + n;
  {  // the choice is made once per process: later calls (every op call on the CPU) only look it up
    std::lock_guard<std::mutex> lk(g_mu);
    auto it = g_selected.find(key);
    if (it != g_selected.end()) return *it->second;
  }
  const KnobSetting knob = knob_setting(op);
  KnobMode mode = knob.mode;
  std::lock_guard<std::mutex> lk(g_mu);
  if (auto it = g_selected.find(key); it != g_selected.end()) return *it->second;
  auto& t = table();
  auto e = std::find_if(t.begin(), t.end(), [&](const OpEntry& x) { return x.name == op; });
  DS_CHECK(e != t.end(), "op registry: unknown op \"{}\"", op);
  const Backend* chosen = nullptr;
  // A backend named by the knob applies on its own device; elsewhere the op runs as with auto.
  const bool named = mode == KnobMode::Named &&
                     std::any_of(e->backends.begin(), e->backends.end(),
                                 [&](const Backend& b) { return b.device == device && b.name == knob.backend; });
  if (mode == KnobMode::Named && !named) mode = KnobMode::Auto;
  for (const Backend& b : e->backends) {
    if (b.device != device) continue;
    if (named && b.name != knob.backend) continue;
    if (std::find(skip.begin(), skip.end(), b.name) != skip.end()) continue;
    if (b.reference) {
      if (!chosen) chosen = &b;
      break;
    }
    if (mode == KnobMode::Reference) continue;
    if (b.unavailable) {
      const std::string why = b.unavailable();
      if (!why.empty()) {
        log_info("{}: backend {} unavailable: {}; using the next one", op, b.name, why);
        continue;
      }
    }
    double err = run_probe(op, b);
    if (err <= b.band) {
      chosen = &b;
      break;
    }
    log_warn("{}: backend {} rejected by its self-probe (error {:.3e} > band {:.1e}); using the next one", op, b.name,
             err, b.band);
  }
  DS_CHECK(chosen, "op registry: no backend for \"{}\" on {}{}", op, device,
           named ? fmt::format(" ({}={} is unavailable or failed its self-probe)", knob_var(op), knob.backend) : "");
  DS_CHECK(mode != KnobMode::Fast || !chosen->reference,
           "{}: {}=fast but no fast backend on {} is available and passes its self-probe", op, knob_var(op), device);
  g_selected[key] = chosen;
  return *chosen;
}

std::vector<ProbeRow> probe_all() {
  std::vector<ProbeRow> rows;
  std::vector<std::pair<std::string, std::string>> ops;
  for (const OpEntry& e : table()) ops.emplace_back(e.name, "cpu");
  // CUDA rows only where a device can run the probes.
  if (cuda_device_count() > 0)
    for (const OpEntry& e : table())
      if (std::any_of(e.backends.begin(), e.backends.end(), [](const Backend& b) { return b.device == "cuda"; }))
        ops.emplace_back(e.name, "cuda");
  for (auto& [op, dev] : ops) {
    const Backend& sel = select_backend(op, dev);
    std::lock_guard<std::mutex> lk(g_mu);
    for (const OpEntry& e : table()) {
      if (e.name != op) continue;
      for (const Backend& b : e.backends) {
        if (b.device != dev) continue;
        ProbeRow r{op, b.device, b.name, "", 0, b.band};
        if (b.reference) {
          r.status = &b == &sel ? "selected (reference)" : "reference";
        } else if (std::string why = b.unavailable ? b.unavailable() : std::string(); !why.empty()) {
          r.error = NAN;
          r.status = "unavailable (" + why + ")";
        } else {
          auto it = g_probe_error.find(probe_key(op, b));
          r.error = it != g_probe_error.end() ? it->second : run_probe(op, b);
          r.status = &b == &sel ? "selected" : (r.error > b.band ? "rejected" : "passed, not selected");
        }
        rows.push_back(r);
      }
    }
  }
  return rows;
}

bool fp8_gemm_usable() { return cuda_compiled() && cuda_device_count() > 0 && !select_backend(kOptionalCudaOp, "cuda").reference; }

void require_cuda_backends() {
  DS_CHECK(cuda_compiled(),
           "--device cuda: this build has no CUDA support (configure with -DDELTASTACK_CUDA=ON and nvcc on PATH)");
  DS_CHECK(cuda_device_count() > 0, "--device cuda: no CUDA device is available");
  std::vector<std::string> ops;
  {
    std::lock_guard<std::mutex> lk(g_mu);
    for (const OpEntry& e : table())
      if (e.name != kOptionalCudaOp &&
          std::any_of(e.backends.begin(), e.backends.end(), [](const Backend& b) { return b.device == "cuda"; }))
        ops.push_back(e.name);
  }
  // Every op is selected (and probed) before failing, so each rejection gets its log line.
  std::vector<std::string> failed;
  for (const std::string& op : ops)
    if (select_backend(op, "cuda").reference) failed.push_back(op);
  if (failed.empty()) return;
  const std::string& op = failed.front();
  std::string also;
  for (size_t i = 1; i < failed.size(); ++i) also += (i == 1 ? " (also without a CUDA backend: " : ", ") + failed[i];
  if (!also.empty()) also += ")";
  const KnobSetting knob = knob_setting(op);
  if (knob.mode == KnobMode::Reference || (knob.mode == KnobMode::Named && select_backend(op, "cuda").name == knob.backend))
    fail("{}: {}={} selects the CPU reference, but the GPU engine has no per-op CPU fallback — unset it or "
         "run with --device cpu{}",
         op, knob_var(op), knob.mode == KnobMode::Reference ? "reference" : knob.backend, also);
  double err = INFINITY, band = 0;
  {
    std::lock_guard<std::mutex> lk(g_mu);
    for (const OpEntry& e : table()) {
      if (e.name != op) continue;
      for (const Backend& b : e.backends) {
        if (b.device != "cuda" || b.reference) continue;
        band = b.band;
        auto it = g_probe_error.find(probe_key(op, b));
        if (it != g_probe_error.end()) err = it->second;
        break;
      }
    }
  }
  fail("{}: the CUDA backend failed its self-probe (error {:.3e} > band {:.1e}); the GPU engine has no per-op CPU "
       "fallback — run with --device cpu{}",
       op, err, band, also);
}

}  // namespace ds::ops
