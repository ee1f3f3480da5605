// The layering of docs/architecture.md ("Layers and build targets"), checked on the sources: a file includes only
// headers of its own layer or of the layers below it (core < ops < data < dist < model < train < cli), so no import
// runs back up (data/ once included model/ for the batch type: data/batch.h). python/csrc builds against
// deltastack_kernels alone, so it sits with ops.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <regex>
#include <string>
#include <vector>

namespace {

namespace fs = std::filesystem;

const std::vector<std::string> kLayers = {"core", "ops", "data", "dist", "model", "train", "cli"};  // bottom to top

int rank_of(const std::string& layer) {
  auto it = std::find(kLayers.begin(), kLayers.end(), layer);
  return it == kLayers.end() ? -1 : static_cast<int>(it - kLayers.begin());
}

// Every include in the C++/CUDA files under root/src and root/python/csrc that names a layer above the including
// file's own, as "path:line: <layer> includes <header>", and every folder of src/ that is no layer of the table
// (a new folder must be placed in it), in path order.
std::vector<std::string> upward_includes(const fs::path& root) {
  static const std::regex include_re(R"(^\s*#\s*include\s*["<]([a-z_]+)/([^">]+)[">])");
  std::vector<std::pair<fs::path, int>> files;  // (file, rank of its layer)
  std::vector<std::string> out;
  for (const auto& e : fs::recursive_directory_iterator(root / "src")) {
    const std::string ext = e.path().extension().string();
    if (!e.is_regular_file() || (ext != ".h" && ext != ".cpp" && ext != ".cu" && ext != ".cuh")) continue;
    const fs::path rel = fs::relative(e.path(), root / "src");
    const int rank = rank_of(rel.begin()->string());
    if (rank < 0) out.push_back("src/" + rel.generic_string() + ": src/" + rel.begin()->string() +
                                " is no layer of docs/architecture.md");
    else files.emplace_back(e.path(), rank);
  }
  if (fs::is_directory(root / "python" / "csrc"))
    for (const auto& e : fs::recursive_directory_iterator(root / "python" / "csrc"))
      if (e.is_regular_file()) files.emplace_back(e.path(), rank_of("ops"));
  for (const auto& [path, rank] : files) {
    std::ifstream in(path);
    std::string line;
    for (int n = 1; std::getline(in, line); ++n) {
      std::smatch m;
      if (!std::regex_search(line, m, include_re)) continue;
      const int inc = rank_of(m[1].str());
      if (inc > rank)
        out.push_back(fs::relative(path, root).generic_string() + ":" + std::to_string(n) + ": " + kLayers[rank] +
                      " includes " + m[1].str() + "/" + m[2].str());
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

TEST(Layering, SourceIncludesRunDownward) {
  const std::vector<std::string> none;
  EXPECT_EQ(upward_includes(DELTASTACK_SOURCE_DIR), none);
}

// The check itself: a tree with one include of each kind finds exactly the upward ones.
TEST(Layering, FindsUpwardIncludesAndUnknownFolders) {
  const fs::path root = fs::path(testing::TempDir()) / "layering_tree";
  fs::remove_all(root);
  auto write = [&](const std::string& rel, const std::string& text) {
    fs::create_directories((root / rel).parent_path());
    std::ofstream(root / rel) << text;
  };
  write("src/data/dataset.h", "#include <vector>\n#include \"core/error.h\"\n#include \"data/chat.h\"\n"
                              "// #include \"model/model.h\" in a comment is no include\n#include \"model/model.h\"\n");
  write("src/ops/linear/cuda.cu", "#include \"ops/linear/linear.h\"\n  #  include <train/trainer.h>\n");
  write("src/model/engine.cpp", "#include \"dist/communicator.h\"\n#include \"data/batch.h\"\n#include \"cli/x.h\"\n");
  write("src/cli/main.cpp", "#include \"train/trainer.h\"\n#include \"model/model.h\"\n");
  write("src/extra/thing.cpp", "#include \"core/error.h\"\n");
  write("src/data/notes.txt", "#include \"cli/x.h\"\n");  // not a source file
  write("python/csrc/ext.cpp", "#include \"ops/rmsnorm/rmsnorm.h\"\n#include \"model/model.h\"\n");
  const std::vector<std::string> want = {
      "python/csrc/ext.cpp:2: ops includes model/model.h",
      "src/data/dataset.h:5: data includes model/model.h",
      "src/extra/thing.cpp: src/extra is no layer of docs/architecture.md",
      "src/model/engine.cpp:3: model includes cli/x.h",
      "src/ops/linear/cuda.cu:2: ops includes train/trainer.h",
  };
  EXPECT_EQ(upward_includes(root), want);
  fs::remove_all(root);
}

}  // namespace
