// `deltastack plot`: training curves of one or more runs as one SVG (commands.h).
//
// Input: each run's metrics.jsonl (train/trainer.cpp writes it: training lines with step, loss, grad_norm, lr,
// tokens_per_s; evaluation lines with step and eval_loss; skipped steps without a loss). A value that is missing,
// null (a non-finite number) or not a number is no point; one beyond ±1e300 is no point either, with a warning
// that counts them. Output: five panels (loss, eval loss, learning rate, grad
// norm, tokens/s against the step), one <polyline data-run="NAME"> per run in every panel (empty when the run has
// no such value), a legend, written atomically.
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <filesystem>
#include <limits>
#include <set>
#include <string>
#include <vector>

#include "cli/commands/commands.h"
#include "cli/commands/outputs.h"
#include "core/error.h"
#include "core/files.h"
#include "core/log.h"

namespace ds::cli {

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

struct Metric {
  const char* key;
  const char* title;
};
constexpr std::array<Metric, 5> kMetrics{{{"loss", "loss"},
                                          {"eval_loss", "eval loss"},
                                          {"lr", "learning rate"},
                                          {"grad_norm", "grad norm"},
                                          {"tokens_per_s", "tokens/s"}}};

struct Run {
  std::string name, file;
  std::array<std::vector<std::pair<double, double>>, kMetrics.size()> series;  // (step, value) per metric
};

// The run's metrics.jsonl (RUN may be the file itself). ds::Error naming file:line for a line that is not a JSON
// object with a numeric "step"; a last line cut short (no newline: a run killed mid-write) is skipped with a warning.
Run read_run(const std::string& arg) {
  Run r;
  r.file = fs::is_directory(arg) ? (fs::path(arg) / "metrics.jsonl").string() : arg;
  DS_CHECK(file_exists(r.file), "{}: no metrics.jsonl (not a run directory of `deltastack train`?)", arg);
  const fs::path p = fs::path(arg).lexically_normal();
  r.name = fs::is_directory(arg) ? (p.filename().empty() ? p.parent_path().filename() : p.filename()).string()
                                 : p.parent_path().filename().string();
  if (r.name.empty() || r.name == ".") r.name = fs::absolute(p).lexically_normal().filename().string();
  const std::string text = read_file(r.file);
  size_t pos = 0, line_no = 0;
  int64_t off_axis = 0;  // numbers beyond ±1e300, left out of the plot
  size_t first_off_axis = 0;
  while (pos < text.size()) {
    const size_t nl = text.find('\n', pos);
    const std::string line = text.substr(pos, nl == std::string::npos ? std::string::npos : nl - pos);
    pos = nl == std::string::npos ? text.size() : nl + 1;
    ++line_no;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    json j;
    try {
      j = json::parse(line);
    } catch (const json::exception& e) {
      if (nl == std::string::npos) {
        log_warn("{}:{}: an incomplete last line (a run stopped while writing it); skipped", r.file, line_no);
        break;
      }
      fail("{}:{}: invalid JSON ({})", r.file, line_no, printable(e.what()));
    }
    DS_CHECK(j.is_object(), "{}:{}: expected a JSON object, got {}", r.file, line_no, j.type_name());
    auto step = j.find("step");
    DS_CHECK(step != j.end() && step->is_number(), "{}:{}: field \"step\" is missing or not a number", r.file, line_no);
    for (size_t m = 0; m < kMetrics.size(); ++m) {
      auto v = j.find(kMetrics[m].key);
      if (v == j.end() || !v->is_number()) continue;
      const double x = step->get<double>(), y = v->get<double>();
      // finite and within ±1e300 (the axis ranges of larger values overflow double)
      if (std::isfinite(x) && std::isfinite(y) && std::fabs(x) < 1e300 && std::fabs(y) < 1e300) {
        r.series[m].push_back({x, y});
      } else if (off_axis++ == 0) {
        first_off_axis = line_no;
      }
    }
  }
  if (off_axis > 0)
    log_warn("{}: {} value(s) beyond ±1e300 (a diverged run?) are not plotted, the first on line {}", r.file,
             off_axis, first_off_axis);
  return r;
}

std::string xml_escape(const std::string& s) {
  std::string o;
  for (char c : s) {
    switch (c) {
      case '&': o += "&amp;"; break;
      case '<': o += "&lt;"; break;
      case '>': o += "&gt;"; break;
      case '"': o += "&quot;"; break;
      case '\'': o += "&apos;"; break;
      default:
        // XML 1.0 has no place for other control characters: a name with one shows '?'.
        o += (static_cast<unsigned char>(c) < 0x20 && c != '\t') ? '?' : c;
    }
  }
  return o;
}

// A short label for an axis value.
std::string tick_label(double v) {
  if (v == 0) return "0";
  const double a = std::fabs(v);
  if (a >= 1e5 || a < 1e-3) return fmt::format("{:.2e}", v);
  return fmt::format("{:.4g}", v);
}

constexpr const char* kColors[] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd",
                                   "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"};
constexpr double kPanelW = 470, kPanelH = 260, kLeft = 70, kRight = 15, kTop = 30, kBottom = 35;

}  // namespace

int cmd_plot(const std::vector<std::string>& runs_in, const std::string& out_arg, bool overwrite) {
  DS_CHECK(!runs_in.empty(), "plot: no run directories given");
  std::vector<Run> runs;
  for (const std::string& a : runs_in) runs.push_back(read_run(a));
  std::set<std::string> names;  // the same name twice (a/run, b/run): the paths as given tell them apart
  for (const Run& r : runs) names.insert(r.name);
  if (names.size() != runs.size())
    for (size_t q = 0; q < runs.size(); ++q) runs[q].name = runs_in[q];
  std::string out = out_arg;
  if (out.empty()) {
    DS_CHECK(runs_in.size() == 1, "plot: --out FILE.svg is needed for several runs");
    out = (fs::path(runs[0].file).parent_path() / "metrics.svg").string();
  }
  std::vector<std::string> inputs;
  for (const Run& r : runs) inputs.push_back(r.file);
  check_outputs({{"--out", out}}, inputs, overwrite);

  const int cols = 2, rows = static_cast<int>((kMetrics.size() + 1 + cols - 1) / cols);  // + the legend's cell
  const double W = cols * kPanelW, H = rows * kPanelH + 10;
  std::string s = fmt::format(
      "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{0}\" height=\"{1}\" viewBox=\"0 0 {0} {1}\" "
      "font-family=\"sans-serif\" font-size=\"11\">\n<rect width=\"{0}\" height=\"{1}\" fill=\"white\"/>\n",
      W, H);
  const double pw = kPanelW - kLeft - kRight, ph = kPanelH - kTop - kBottom;
  for (size_t m = 0; m < kMetrics.size(); ++m) {
    double x0 = std::numeric_limits<double>::infinity(), x1 = -x0, y0 = x0, y1 = -x0;
    for (const Run& r : runs)
      for (auto [x, y] : r.series[m]) {
        x0 = std::min(x0, x), x1 = std::max(x1, x), y0 = std::min(y0, y), y1 = std::max(y1, y);
      }
    const bool any = std::isfinite(x0);
    if (!any) x0 = 0, x1 = 1, y0 = 0, y1 = 1;
    if (x1 == x0) x0 -= 1, x1 += 1;
    if (y1 == y0) {
      const double d = std::fabs(y0) > 0 ? std::fabs(y0) * 0.05 : 1;
      y0 -= d, y1 += d;
    }
    const double pad = (y1 - y0) * 0.05;
    y0 -= pad, y1 += pad;
    const double ox = static_cast<double>(m % cols) * kPanelW, oy = static_cast<double>(m / cols) * kPanelH;
    s += fmt::format("<g class=\"panel\" data-metric=\"{}\" transform=\"translate({},{})\">\n", kMetrics[m].key, ox, oy);
    s += fmt::format("<text x=\"{}\" y=\"18\" font-size=\"13\" font-weight=\"bold\">{}</text>\n", kLeft,
                     kMetrics[m].title);
    s += fmt::format("<rect class=\"plot-area\" x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"none\" "
                     "stroke=\"#888\"/>\n", kLeft, kTop, pw, ph);
    for (int t = 0; t <= 4; ++t) {  // 5 ticks per axis, grid lines across
      const double fy = kTop + ph - ph * t / 4.0, fx = kLeft + pw * t / 4.0;
      s += fmt::format("<line x1=\"{}\" y1=\"{:.2f}\" x2=\"{}\" y2=\"{:.2f}\" stroke=\"#eee\"/>\n", kLeft, fy,
                       kLeft + pw, fy);
      s += fmt::format("<text x=\"{}\" y=\"{:.2f}\" text-anchor=\"end\">{}</text>\n", kLeft - 4, fy + 4,
                       xml_escape(tick_label(y0 + (y1 - y0) * t / 4.0)));
      s += fmt::format("<text x=\"{:.2f}\" y=\"{}\" text-anchor=\"middle\">{}</text>\n", fx, kTop + ph + 15,
                       xml_escape(tick_label(x0 + (x1 - x0) * t / 4.0)));
    }
    s += fmt::format("<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">step</text>\n", kLeft + pw / 2, kTop + ph + 30);
    if (!any)
      s += fmt::format("<text x=\"{}\" y=\"{}\" text-anchor=\"middle\" fill=\"#888\">no data</text>\n", kLeft + pw / 2,
                       kTop + ph / 2);
    for (size_t i = 0; i < runs.size(); ++i) {
      s += fmt::format("<polyline data-run=\"{}\" fill=\"none\" stroke=\"{}\" stroke-width=\"1.5\" points=\"",
                       xml_escape(runs[i].name), kColors[i % std::size(kColors)]);
      bool first = true;
      for (auto [x, y] : runs[i].series[m]) {
        s += fmt::format("{}{:.2f},{:.2f}", first ? "" : " ", kLeft + (x - x0) / (x1 - x0) * pw,
                         kTop + ph - (y - y0) / (y1 - y0) * ph);
        first = false;
      }
      s += "\"/>\n";
    }
    s += "</g>\n";
  }
  // The legend in the cell after the last panel.
  const double lx = static_cast<double>(kMetrics.size() % cols) * kPanelW + kLeft,
               ly = static_cast<double>(kMetrics.size() / cols) * kPanelH + kTop;
  s += fmt::format("<g class=\"legend\" transform=\"translate({},{})\">\n", lx, ly);
  for (size_t i = 0; i < runs.size(); ++i) {
    const double y = 16.0 * static_cast<double>(i);
    s += fmt::format("<line x1=\"0\" y1=\"{0}\" x2=\"24\" y2=\"{0}\" stroke=\"{1}\" stroke-width=\"3\"/>"
                     "<text x=\"30\" y=\"{2}\">{3}</text>\n", y, kColors[i % std::size(kColors)], y + 4,
                     xml_escape(runs[i].name));
  }
  s += "</g>\n</svg>\n";
  write_file_atomic(out, s);
  log_info("plot: {} run{} -> {}", runs.size(), runs.size() == 1 ? "" : "s", out);
  return 0;
}

}  // namespace ds::cli
