// `deltastack plot` (cli/commands/plot.cpp): the SVG is parsed by a strict XML reader below (well-formedness:
// one root, balanced tags, quoted attributes without duplicates, only predefined or numeric entities), then its
// panels, one polyline per run per panel, and the points' count and positions are checked against the metrics.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "cli/commands/commands.h"
#include "core/error.h"
#include "core/files.h"

namespace {

namespace fs = std::filesystem;
using nlohmann::json;

struct Element {
  std::string name;
  std::map<std::string, std::string> attrs;
  std::vector<Element> children;
  std::string text;
  // Every descendant (and this element) named `n`, in document order.
  void find_all(const std::string& n, std::vector<const Element*>& out) const {
    if (name == n) out.push_back(this);
    for (const Element& c : children) c.find_all(n, out);
  }
};

// A strict reader of the XML subset an SVG writer needs; throws std::runtime_error at the first fault.
class XmlReader {
 public:
  explicit XmlReader(std::string s) : s_(std::move(s)) {}
  Element document() {
    if (s_.compare(0, 5, "<?xml") == 0) {
      const size_t e = s_.find("?>");
      if (e == std::string::npos) bad("unterminated declaration");
      i_ = e + 2;
    }
    space();
    Element root = element();
    space();
    if (i_ != s_.size()) bad("content after the root element");
    return root;
  }

 private:
  [[noreturn]] void bad(const std::string& what) const {
    throw std::runtime_error(what + " at byte " + std::to_string(i_));
  }
  void space() {
    while (i_ < s_.size() && std::isspace(static_cast<unsigned char>(s_[i_]))) ++i_;
  }
  std::string name() {
    const size_t b = i_;
    while (i_ < s_.size() && (std::isalnum(static_cast<unsigned char>(s_[i_])) || s_[i_] == '-' || s_[i_] == '_' ||
                              s_[i_] == ':' || s_[i_] == '.'))
      ++i_;
    if (i_ == b || std::isdigit(static_cast<unsigned char>(s_[b])) || s_[b] == '-') bad("expected a name");
    return s_.substr(b, i_ - b);
  }
  // Character data up to `stop`, entities resolved.
  std::string chars(char stop) {
    std::string out;
    while (i_ < s_.size() && s_[i_] != stop) {
      const char c = s_[i_];
      if (c == '<') bad("'<' in character data");
      if (c == '&') {
        const size_t e = s_.find(';', i_);
        if (e == std::string::npos) bad("unterminated entity");
        const std::string ent = s_.substr(i_ + 1, e - i_ - 1);
        static const std::map<std::string, std::string> known = {
            {"amp", "&"}, {"lt", "<"}, {"gt", ">"}, {"quot", "\""}, {"apos", "'"}};
        if (auto it = known.find(ent); it != known.end()) out += it->second;
        else if (ent.size() > 1 && ent[0] == '#') out += '?';
        else bad("unknown entity &" + ent + ";");
        i_ = e + 1;
        continue;
      }
      if (static_cast<unsigned char>(c) < 0x20 && c != '\n' && c != '\t' && c != '\r') bad("control character");
      out += c;
      ++i_;
    }
    return out;
  }
  Element element() {
    if (i_ >= s_.size() || s_[i_] != '<') bad("expected '<'");
    ++i_;
    Element el;
    el.name = name();
    for (;;) {
      const size_t before = i_;
      space();
      if (i_ >= s_.size()) bad("unterminated tag");
      if (s_.compare(i_, 2, "/>") == 0) {
        i_ += 2;
        return el;
      }
      if (s_[i_] == '>') {
        ++i_;
        break;
      }
      if (i_ == before) bad("no space before an attribute");
      const std::string a = name();
      if (i_ >= s_.size() || s_[i_] != '=') bad("expected '=' after " + a);
      ++i_;
      if (i_ >= s_.size() || (s_[i_] != '"' && s_[i_] != '\'')) bad("unquoted attribute " + a);
      const char q = s_[i_++];
      std::string v = chars(q);
      if (i_ >= s_.size()) bad("unterminated attribute " + a);
      ++i_;
      if (!el.attrs.emplace(a, v).second) bad("duplicate attribute " + a);
    }
    for (;;) {
      el.text += chars('<');
      if (i_ >= s_.size()) bad("unclosed <" + el.name + ">");
      if (s_.compare(i_, 2, "</") == 0) {
        i_ += 2;
        if (name() != el.name) bad("mismatched </...> for <" + el.name + ">");
        space();
        if (i_ >= s_.size() || s_[i_] != '>') bad("expected '>'");
        ++i_;
        return el;
      }
      el.children.push_back(element());
    }
  }
  std::string s_;
  size_t i_ = 0;
};

std::vector<std::pair<double, double>> points(const Element& polyline) {
  std::vector<std::pair<double, double>> out;
  std::istringstream in(polyline.attrs.at("points"));
  std::string p;
  while (in >> p) {
    const size_t c = p.find(',');
    EXPECT_NE(c, std::string::npos) << p;
    out.push_back({std::stod(p.substr(0, c)), std::stod(p.substr(c + 1))});
  }
  return out;
}

std::string tmpdir() {
  fs::path p = fs::temp_directory_path() /
               ("ds_plot_" + std::to_string(::getpid()) + "_" +
                ::testing::UnitTest::GetInstance()->current_test_info()->name());
  fs::remove_all(p);
  fs::create_directories(p);
  return p.string();
}

// A run directory with `steps` training lines (loss = scale * (steps + 1 - step)) and an eval line every 5 steps
// (none when eval is false).
void write_run(const std::string& dir, int steps, double scale, bool eval, const std::string& tail = "") {
  fs::create_directories(dir);
  std::string s;
  for (int i = 1; i <= steps; ++i) {
    s += json{{"step", i}, {"loss", scale * (steps + 1 - i)}, {"grad_norm", 0.5 + i % 2}, {"lr", 1e-3 * i},
              {"tokens", 256}, {"tokens_per_s", 1000.0 + i}, {"elapsed_s", i}, {"run_id", "r"}}
             .dump() +
         "\n";
    if (eval && i % 5 == 0) s += json{{"step", i}, {"eval_loss", scale * 2}}.dump() + "\n";
  }
  s += json{{"step", steps + 1}, {"skipped", true}, {"reason", "loss is nan"}, {"lr", nullptr}}.dump() + "\n";
  ds::write_file_atomic(dir + "/metrics.jsonl", s + tail);
}

TEST(Plot, OnePolylinePerRunPerPanel) {
  const std::string dir = tmpdir();
  write_run(dir + "/base", 20, 1.0, true);
  write_run(dir + "/a&b", 10, 2.0, false, "{\"step\": 11, \"loss\": 3");  // a torn last line is skipped
  ASSERT_EQ(ds::cli::cmd_plot({dir + "/base", dir + "/a&b"}, dir + "/ab.svg"), 0);
  const Element svg = XmlReader(ds::read_file(dir + "/ab.svg")).document();
  EXPECT_EQ(svg.name, "svg");
  EXPECT_EQ(svg.attrs.at("xmlns"), "http://www.w3.org/2000/svg");
  std::vector<const Element*> groups, panels;
  svg.find_all("g", groups);
  for (const Element* g : groups)
    if (g->attrs.count("class") && g->attrs.at("class") == "panel") panels.push_back(g);
  ASSERT_EQ(panels.size(), 5u);
  const std::vector<std::string> metrics = {"loss", "eval_loss", "lr", "grad_norm", "tokens_per_s"};
  // Points per run and metric: base has 20 steps and 4 evals, a&b 10 steps and no eval; the skipped line's null lr
  // is no point.
  const std::map<std::string, std::vector<size_t>> count = {{"base", {20, 4, 20, 20, 20}}, {"a&b", {10, 0, 10, 10, 10}}};
  for (size_t m = 0; m < panels.size(); ++m) {
    SCOPED_TRACE(metrics[m]);
    EXPECT_EQ(panels[m]->attrs.at("data-metric"), metrics[m]);
    std::vector<const Element*> lines, rects;
    panels[m]->find_all("polyline", lines);
    panels[m]->find_all("rect", rects);
    ASSERT_EQ(lines.size(), 2u);
    ASSERT_EQ(rects.size(), 1u);
    const double x0 = std::stod(rects[0]->attrs.at("x")), y0 = std::stod(rects[0]->attrs.at("y")),
                 x1 = x0 + std::stod(rects[0]->attrs.at("width")), y1 = y0 + std::stod(rects[0]->attrs.at("height"));
    for (const Element* l : lines) {
      const std::string run = l->attrs.at("data-run");
      ASSERT_TRUE(count.count(run)) << run;
      const auto pts = points(*l);
      EXPECT_EQ(pts.size(), count.at(run)[m]) << run;
      for (size_t k = 0; k < pts.size(); ++k) {
        EXPECT_GE(pts[k].first, x0 - 1e-9);
        EXPECT_LE(pts[k].first, x1 + 1e-9);
        EXPECT_GE(pts[k].second, y0 - 1e-9);
        EXPECT_LE(pts[k].second, y1 + 1e-9);
        if (k) {
          EXPECT_GT(pts[k].first, pts[k - 1].first);  // steps ascend
        }
      }
    }
    if (metrics[m] == "loss") {
      // The highest loss (a&b's first, 20) sits 5% of the padded range below the top; base's step 20 (loss 1,
      // the lowest) 5% above the bottom; step 1 at the left edge, step 20 at the right.
      const auto ab = points(*lines[1]), base = points(*lines[0]);
      const double h = y1 - y0, pad = 0.05 / 1.1;
      EXPECT_NEAR(ab[0].second, y0 + h * pad, 0.01);
      EXPECT_NEAR(base.back().second, y1 - h * pad, 0.01);
      EXPECT_NEAR(base[0].first, x0, 0.01);
      EXPECT_NEAR(base.back().first, x1, 0.01);
      EXPECT_NEAR(ab.back().first, x0 + (x1 - x0) * 9.0 / 19.0, 0.01);
    }
  }
  std::vector<const Element*> texts;
  svg.find_all("text", texts);
  bool legend = false;
  for (const Element* t : texts) legend = legend || t->text == "a&b";
  EXPECT_TRUE(legend);
  fs::remove_all(dir);
}

TEST(Plot, DefaultsAndErrors) {
  const std::string dir = tmpdir();
  write_run(dir + "/x/run", 3, 1.0, true);
  write_run(dir + "/y/run", 3, 1.0, true);
  // One run: RUN_DIR/metrics.svg; two runs of the same name are told apart by their paths.
  ASSERT_EQ(ds::cli::cmd_plot({dir + "/x/run"}, ""), 0);
  EXPECT_TRUE(fs::exists(dir + "/x/run/metrics.svg"));
  ASSERT_EQ(ds::cli::cmd_plot({dir + "/x/run", dir + "/y/run/metrics.jsonl"}, dir + "/xy.svg"), 0);
  const std::string xy = ds::read_file(dir + "/xy.svg");
  EXPECT_NE(xy.find("data-run=\"" + dir + "/x/run\""), std::string::npos);
  EXPECT_NE(xy.find("data-run=\"" + dir + "/y/run/metrics.jsonl\""), std::string::npos);
  auto error = [](const std::function<void()>& f) {
    try {
      f();
    } catch (const ds::Error& e) {
      return std::string(e.what());
    }
    return std::string("(no error)");
  };
  EXPECT_NE(error([&] { ds::cli::cmd_plot({dir + "/x/run", dir + "/y/run"}, ""); }).find("--out"), std::string::npos);
  EXPECT_NE(error([&] { ds::cli::cmd_plot({dir + "/x/run"}, ""); }).find("exists; pass --overwrite"), std::string::npos);
  EXPECT_EQ(ds::cli::cmd_plot({dir + "/x/run"}, "", true), 0);
  EXPECT_NE(error([&] { ds::cli::cmd_plot({dir + "/x/run"}, dir + "/x/run/metrics.jsonl", true); })
                .find("is the input file"),
            std::string::npos);
  EXPECT_NE(error([&] { ds::cli::cmd_plot({dir + "/none"}, dir + "/n.svg"); }).find(dir + "/none: no metrics.jsonl"),
            std::string::npos);
  fs::create_directories(dir + "/bad");
  ds::write_file_atomic(dir + "/bad/metrics.jsonl", "{\"step\": 1, \"loss\": 2}\n{\"step\": 2, \"loss\": \n{\"step\": 3}\n");
  EXPECT_NE(error([&] { ds::cli::cmd_plot({dir + "/bad"}, dir + "/b.svg"); }).find(dir + "/bad/metrics.jsonl:2: invalid JSON"),
            std::string::npos);
  ds::write_file_atomic(dir + "/bad/metrics.jsonl", "{\"step\": 1, \"loss\": 2}\n{\"loss\": 2}\n");
  EXPECT_NE(error([&] { ds::cli::cmd_plot({dir + "/bad"}, dir + "/b.svg"); }).find("metrics.jsonl:2: field \"step\""),
            std::string::npos);
  EXPECT_FALSE(fs::exists(dir + "/b.svg"));
  // Values near the top of double's range (a blown-up run) are left out of the axes instead of overflowing them.
  fs::create_directories(dir + "/huge");
  ds::write_file_atomic(dir + "/huge/metrics.jsonl", "{\"step\": 1, \"loss\": 1e308}\n{\"step\": 2, \"loss\": -1e308}\n"
                                                     "{\"step\": 3, \"loss\": 2.5}\n");
  ::testing::internal::CaptureStderr();
  ASSERT_EQ(ds::cli::cmd_plot({dir + "/huge"}, dir + "/h.svg"), 0);
  // ... and said so (issue 25: they were dropped silently).
  const std::string warned = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(warned.find(dir + "/huge/metrics.jsonl: 2 value(s) beyond ±1e300 (a diverged run?) are not plotted, the "
                        "first on line 1"),
            std::string::npos)
      << warned;
  const std::string h = ds::read_file(dir + "/h.svg");
  EXPECT_EQ(h.find("nan"), std::string::npos);
  EXPECT_EQ(h.find("inf"), std::string::npos);
  fs::remove_all(dir);
}

// The reader is strict: a writer's slip (an unescaped '&', an unclosed tag) would fail the test above.
TEST(Plot, XmlReaderRejectsMalformedXml) {
  for (const char* bad : {"<svg><g></svg>", "<svg a=\"1\" a=\"2\"/>", "<svg a=1/>", "<svg>&</svg>",
                          "<svg><text>a < b</text></svg>", "<svg/><svg/>", "<svg a=\"x\"b=\"y\"/>"})
    EXPECT_THROW(XmlReader(bad).document(), std::runtime_error) << bad;
  EXPECT_EQ(XmlReader("<?xml version=\"1.0\"?>\n<svg a=\"&amp;&lt;\"><t>x&gt;</t></svg>\n").document().attrs.at("a"), "&<");
}

}  // namespace
