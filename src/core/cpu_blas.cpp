#include "core/cpu_blas.h"

#include <unistd.h>

#include <cstdlib>
#include <map>

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

void reexec_with_cpu_blas_kernels(char** argv) {
  if (std::getenv("DELTASTACK_BLAS_REEXEC")) return;
  const char* keep = std::getenv("DELTASTACK_BLAS_CORETYPE");
  const std::string want = blas_override(std::getenv("OPENBLAS_CORETYPE"), keep && std::string(keep) == "keep",
                                         blas_corename(), blas_coretype_for_cpu());
  if (want.empty()) return;
  setenv("OPENBLAS_CORETYPE", want.c_str(), 1);
  setenv("DELTASTACK_BLAS_REEXEC", "1", 1);  // once
  execv("/proc/self/exe", argv);
  unsetenv("OPENBLAS_CORETYPE");  // exec failed: the library's choice stays, and the environment says so
}

}  // namespace ds
