// The step profile's aggregation and table (core/profile.h).
#include "core/profile.h"

#include <fmt/format.h>

#include <algorithm>

namespace ds {

const std::vector<std::string>& profile_families() {
  static const std::vector<std::string> f{"gemm", "gdn",  "attention", "conv",      "norm",
                                          "elementwise", "loss", "embedding", "optimizer", "copy"};
  return f;
}

Roofline roofline(double ms, double flops, double bytes, double gemm_rate, double copy_bw) {
  Roofline r;
  if (ms <= 0) return r;
  const double s = ms * 1e-3;
  if (flops > 0) {
    r.rate = fmt::format("{:.1f} TFLOP/s", flops / s / 1e12);
    r.fraction = flops / s / gemm_rate;
  } else if (bytes > 0) {
    r.rate = fmt::format("{:.2f} TB/s", bytes / s / 1e12);
    r.fraction = bytes / s / copy_bw;
  }
  return r;
}

void ProfileTable::add(const std::string& family, const std::string& role, double ms, double flops, double bytes) {
  auto it = std::find_if(acc_.begin(), acc_.end(), [&](const Acc& a) { return a.family == family && a.role == role; });
  if (it == acc_.end()) {
    acc_.push_back(Acc{family, role});
    it = acc_.end() - 1;
  }
  it->ms += ms;
  it->flops += flops;
  it->bytes += bytes;
  it->calls += 1;
}

void ProfileTable::end_step(double wall_ms) {
  ++steps_;
  wall_ms_sum_ += wall_ms;
}

std::vector<ProfileTable::Row> ProfileTable::rows() const {
  const double n = static_cast<double>(std::max<int64_t>(steps_, 1));
  const std::vector<std::string>& fams = profile_families();
  auto rank = [&](const std::string& f) {
    return static_cast<size_t>(std::find(fams.begin(), fams.end(), f) - fams.begin());  // unknown: fams.size()
  };
  std::vector<size_t> order(acc_.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  // Unknown families keep their first appearance among themselves: group by the first index of their family.
  auto first_of = [&](const std::string& f) {
    for (size_t i = 0; i < acc_.size(); ++i)
      if (acc_[i].family == f) return i;
    return acc_.size();
  };
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    const size_t ra = rank(acc_[a].family), rb = rank(acc_[b].family);
    if (ra != rb) return ra < rb;
    return first_of(acc_[a].family) < first_of(acc_[b].family);
  });
  std::vector<Row> out;
  for (size_t i : order) {
    const Acc& a = acc_[i];
    out.push_back(Row{a.family, a.role, a.ms / n, a.flops / n, a.bytes / n, static_cast<double>(a.calls) / n});
  }
  return out;
}

double ProfileTable::scope_ms() const {
  double s = 0;
  for (const Acc& a : acc_) s += a.ms;
  return s / static_cast<double>(std::max<int64_t>(steps_, 1));
}

double ProfileTable::wall_ms() const { return steps_ > 0 ? wall_ms_sum_ / static_cast<double>(steps_) : 0.0; }

std::string ProfileTable::format(double gemm_rate, double copy_bw, double median_wall_ms) const {
  const double wall = wall_ms();
  auto pct = [&](double ms) { return wall > 0 ? fmt::format("{:.1f}%", 100 * ms / wall) : std::string("-"); };
  auto line = [&](const std::string& name, double ms, double calls, double flops, double bytes) {
    const Roofline r = roofline(ms, flops, bytes, gemm_rate, copy_bw);
    const std::string frac = r.fraction < 0 ? "-" : fmt::format("{:.1f}%", 100 * r.fraction);
    return fmt::format("  {:<40} {:>10.3f} {:>7} {:>8.0f} {:>16} {:>9}\n", name, ms, pct(ms), calls, r.rate, frac);
  };
  std::string out = fmt::format("  {:<40} {:>10} {:>7} {:>8} {:>16} {:>9}\n", "family / role", "ms/step", "% step",
                                "scopes", "rate", "roofline");
  const std::vector<Row> rs = rows();
  for (size_t i = 0; i < rs.size();) {
    size_t j = i;
    Row total{rs[i].family, "", 0, 0, 0, 0};
    bool flops_known = true;  // a family total shows FLOP/s only when every role's FLOPs are known
    for (; j < rs.size() && rs[j].family == rs[i].family; ++j) {
      total.ms += rs[j].ms, total.flops += rs[j].flops, total.bytes += rs[j].bytes, total.calls += rs[j].calls;
      flops_known = flops_known && rs[j].flops > 0;
    }
    if (j - i == 1) {
      out += line(rs[i].family + ": " + rs[i].role, rs[i].ms, rs[i].calls, rs[i].flops, rs[i].bytes);
    } else {
      bool bytes_known = true;
      for (size_t k = i; k < j; ++k) bytes_known = bytes_known && rs[k].bytes > 0;
      out += line(total.family, total.ms, total.calls, flops_known ? total.flops : 0,
                  !flops_known && bytes_known ? total.bytes : 0);
      for (size_t k = i; k < j; ++k) out += line("  " + rs[k].role, rs[k].ms, rs[k].calls, rs[k].flops, rs[k].bytes);
    }
    i = j;
  }
  out += fmt::format("  {:<40} {:>10.3f} {:>7}\n", "gaps (wall - sum of scopes)", gaps_ms(), pct(gaps_ms()));
  out += fmt::format("  sum of scopes {:.3f} ms of wall {:.3f} ms per step (mean of {} steps", scope_ms(), wall,
                     steps_);
  if (median_wall_ms > 0) out += fmt::format("; median {:.3f} ms", median_wall_ms);
  out += fmt::format("); gaps {:.3f} ms ({})\n", gaps_ms(), pct(gaps_ms()));
  return out;
}

}  // namespace ds
