#include "core/cpu_blas.h"

#include <unistd.h>

#include <cstdlib>
#include <map>
#include <vector>

#include "core/files.h"
#include "core/log.h"

extern "C" char* openblas_get_corename(void);

namespace ds {

std::string blas_coretype_for_cpu() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("avx512vl"))
    return "SkylakeX";
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return "Haswell";
  if (__builtin_cpu_supports("avx")) return "Sandybridge";
#endif
  return "";
}

std::string blas_corename() {
  const char* n = openblas_get_corename();
  return n ? n : "";
}

bool blas_core_older(const std::string& current, const std::string& wanted) {
  // OpenBLAS's x86-64 kernel generations (its corename strings; case as the library prints them).
  static const std::map<std::string, int> rank = {
      {"Prescott", 1},    {"Core2", 2},       {"Penryn", 2},     {"Dunnington", 2}, {"Nehalem", 2},
      {"Atom", 2},        {"Opteron", 2},     {"Barcelona", 2},  {"Bobcat", 2},     {"Sandybridge", 3},
      {"Bulldozer", 3},   {"Piledriver", 3},  {"Steamroller", 3}, {"Excavator", 3}, {"Haswell", 4},
      {"Zen", 4},         {"SkylakeX", 5},    {"Cooperlake", 5}, {"SapphireRapids", 5}};
  auto c = rank.find(current), w = rank.find(wanted);
  return c != rank.end() && w != rank.end() && c->second < w->second;
}

std::string blas_override(const char* user_coretype, bool keep, const std::string& current, const std::string& wanted) {
  if (user_coretype || keep || wanted.empty() || !blas_core_older(current, wanted)) return "";
  return wanted;
}

std::vector<std::string> start_command_line(char** argv) {
  std::string text;
  try {
    text = read_file("/proc/self/cmdline");
  } catch (const std::exception&) {
    return {};
  }
  std::vector<std::string> cmd;
  for (size_t i = 0; i < text.size();) {  // NUL-terminated arguments (an empty one is "\0")
    const size_t end = text.find('\0', i);
    cmd.push_back(text.substr(i, end == std::string::npos ? std::string::npos : end - i));
    if (end == std::string::npos) break;
    i = end + 1;
  }
  size_t argc = 0;
  while (argv[argc]) ++argc;
  if (argc == 0 || cmd.size() < argc) return {};
  for (size_t i = 1; i < argc; ++i)
    if (cmd[cmd.size() - argc + i] != argv[i]) return {};
  return cmd;
}

void reexec_with_cpu_blas_kernels(char** argv) {
  if (std::getenv("DELTASTACK_BLAS_REEXEC")) return;
  const char* keep = std::getenv("DELTASTACK_BLAS_CORETYPE");
  // Test hook: the library's pick as this decision sees it (so that the re-exec runs on any CPU). Unset in normal use.
  const char* fake = std::getenv("DELTASTACK_TEST_BLAS_CORENAME");
  const std::string current = fake ? fake : blas_corename();
  const std::string want = blas_override(std::getenv("OPENBLAS_CORETYPE"), keep && std::string(keep) == "keep",
                                         current, blas_coretype_for_cpu());
  if (want.empty()) return;
  // /proc/self/exe is the file the kernel started: this program, or the dynamic loader when the program was started
  // through it (`/lib64/ld-linux-x86-64.so.2 ./deltastack train`). Exec'ing it with main's argv would run the
  // loader on the program's own arguments (`--version` printed ld.so's version, `train` failed to load "train"), so
  // it gets the command line the process was started with, the loader's arguments included.
  std::vector<std::string> cmd = start_command_line(argv);
  if (cmd.empty()) {
    log_warn("OpenBLAS uses its {} kernels: could not read this process's command line (/proc/self/cmdline) to "
             "re-execute with OPENBLAS_CORETYPE={}; set OPENBLAS_CORETYPE={} before starting to use them", current,
             want, want);
    return;
  }
  std::vector<char*> args;
  for (std::string& a : cmd) args.push_back(a.data());
  args.push_back(nullptr);
  setenv("OPENBLAS_CORETYPE", want.c_str(), 1);
  setenv("DELTASTACK_BLAS_REEXEC", "1", 1);  // once
  execv("/proc/self/exe", args.data());
  unsetenv("OPENBLAS_CORETYPE");  // exec failed: the library's choice stays, and the environment says so
}

}  // namespace ds
