#include "ops/registry.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <map>
#include <mutex>
#include <set>

#include "core/error.h"
#include "core/log.h"
#include "ops/gated_delta_rule/dispatch.h"

namespace ds::ops {

namespace {

struct OpEntry {
  std::string name;
  std::vector<Backend> backends;  // fast first, reference last
};

std::vector<OpEntry> build_table() {
  std::vector<OpEntry> t;
  auto ref_only = [&](const char* name) {
    t.push_back({name, {Backend{"cpu-reference", "cpu", true, {}, 0.0}}});
  };
  ref_only("embedding");
  ref_only("rmsnorm");
  ref_only("linear");
  ref_only("conv1d");
  ref_only("gdn_gate");
  ref_only("l2norm");
  t.push_back({"gated_delta_rule",
               {Backend{"cpu-chunked (chunk 64)", "cpu", false, &probe_chunked_gated_delta_rule, 1e-5},
                Backend{"cpu-recurrent", "cpu", true, {}, 0.0}}});
  ref_only("gated_rmsnorm");
  ref_only("rope");
  ref_only("attention");
  ref_only("swiglu");
  ref_only("linear_cross_entropy");
  ref_only("adamw");
  return t;
}

std::mutex g_mu;
std::vector<OpEntry>& table() {
  static std::vector<OpEntry> t = build_table();
  return t;
}
std::map<std::string, double> g_probe_error;  // key op/backend
std::map<std::string, const Backend*> g_selected;  // key op/device

double run_probe(const std::string& op, const Backend& b) {
  std::string key = op + "/" + b.name;
  auto it = g_probe_error.find(key);
  if (it != g_probe_error.end()) return it->second;
  double e = b.probe ? b.probe() : 0.0;
  if (!std::isfinite(e)) e = INFINITY;
  g_probe_error[key] = e;
  return e;
}

}  // namespace

KnobMode knob_mode(const std::string& op) {
  std::string var = "DELTASTACK_";
  for (char ch : op) var += static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
  const char* v = std::getenv(var.c_str());
  if (!v || std::string(v).empty() || std::string(v) == "auto") return KnobMode::Auto;
  static std::set<std::string> logged;
  std::string s(v);
  DS_CHECK(s == "fast" || s == "reference", "{}={}: expected auto, fast or reference", var, s);
  {
    std::lock_guard<std::mutex> lk(g_mu);
    if (logged.insert(var).second) log_info("{}={} in effect", var, s);
  }
  return s == "fast" ? KnobMode::Fast : KnobMode::Reference;
}

const Backend& select_backend(const std::string& op, const std::string& device) {
  KnobMode mode = knob_mode(op);
  std::lock_guard<std::mutex> lk(g_mu);
  std::string key = op + "/" + device;
  auto it = g_selected.find(key);
  if (it != g_selected.end()) return *it->second;
  auto& t = table();
  auto e = std::find_if(t.begin(), t.end(), [&](const OpEntry& x) { return x.name == op; });
  DS_CHECK(e != t.end(), "op registry: unknown op \"{}\"", op);
  const Backend* chosen = nullptr;
  for (const Backend& b : e->backends) {
    if (b.device != device) continue;
    if (b.reference) {
      if (!chosen) chosen = &b;
      break;
    }
    if (mode == KnobMode::Reference) continue;
    double err = run_probe(op, b);
    if (err <= b.band) {
      chosen = &b;
      break;
    }
    log_warn("{}: backend {} rejected by its self-probe (error {:.3e} > band {:.1e}); using the next one", op, b.name,
             err, b.band);
    DS_CHECK(mode != KnobMode::Fast, "{}: DELTASTACK_{}=fast but the fast backend failed its self-probe", op, op);
  }
  DS_CHECK(chosen, "op registry: no backend for \"{}\" on {}", op, device);
  DS_CHECK(mode != KnobMode::Fast || !chosen->reference, "{}: knob asks for a fast backend but {} has none on {}", op,
           op, device);
  g_selected[key] = chosen;
  return *chosen;
}

std::vector<ProbeRow> probe_all() {
  std::vector<ProbeRow> rows;
  std::vector<std::pair<std::string, std::string>> ops;
  for (const OpEntry& e : table()) ops.emplace_back(e.name, "cpu");
  for (auto& [op, dev] : ops) {
    const Backend& sel = select_backend(op, dev);
    std::lock_guard<std::mutex> lk(g_mu);
    for (const OpEntry& e : table()) {
      if (e.name != op) continue;
      for (const Backend& b : e.backends) {
        ProbeRow r{op, b.device, b.name, "", 0, b.band};
        if (b.reference) {
          r.status = &b == &sel ? "selected (reference)" : "reference";
        } else {
          auto it = g_probe_error.find(op + "/" + b.name);
          r.error = it != g_probe_error.end() ? it->second : run_probe(op, b);
          r.status = &b == &sel ? "selected" : (r.error > b.band ? "rejected" : "off (knob)");
        }
        rows.push_back(r);
      }
    }
  }
  return rows;
}

}  // namespace ds::ops
