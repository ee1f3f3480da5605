// OpenBLAS's kernel set chosen by the CPU's features. Debian 12's OpenBLAS 0.3.21 (built DYNAMIC_ARCH) picks its
// kernels by CPU model when it loads and falls back to older ones on CPUs newer than it knows: SSE3 "Prescott"
// kernels on current Xeons, AVX2 "Haswell" ones on AVX-512 Zen 5 (docs/cpu_engine.md has the measurements). The
// environment variable OPENBLAS_CORETYPE overrides that choice, but only when the library loads, so the
// `deltastack` binary re-executes itself once with it set (src/cli/main.cpp). A user's own OPENBLAS_CORETYPE wins.
#pragma once
#include <string>
#include <vector>

namespace ds {

// The best OpenBLAS kernel set this CPU's features allow (CPUID, as the compiler's __builtin_cpu_supports sees
// it): "SkylakeX" with AVX-512 F, BW, DQ and VL; "Haswell" with AVX2 and FMA; "Sandybridge" with AVX; "" otherwise.
std::string blas_coretype_for_cpu();
// The kernel set the loaded OpenBLAS uses (openblas_get_corename), e.g. "Haswell", "Prescott", "Zen".
std::string blas_corename();
// Whether OpenBLAS core `current` is an older kernel set than `wanted` (a fixed rank of OpenBLAS's x86-64 core
// names; a name not in it counts as not older, so nothing is overridden that is not understood).
bool blas_core_older(const std::string& current, const std::string& wanted);
// The OPENBLAS_CORETYPE to re-execute with, or "" for none: `wanted` when the user set no OPENBLAS_CORETYPE
// (user_coretype null), did not ask to keep the library's choice (keep), and `current` is older than it.
std::string blas_override(const char* user_coretype, bool keep, const std::string& current, const std::string& wanted);

// The command line this process was started with (/proc/self/cmdline), which /proc/self/exe runs again: main's
// argv, or, for a program started through the dynamic loader (`/lib64/ld-linux-x86-64.so.2 [its options] PROGRAM
// args`), the loader's arguments and then the program's. Empty when it cannot be read or does not end with
// argv[1..] (`argv`: main's, null-terminated).
std::vector<std::string> start_command_line(char** argv);

// Re-executes this program (/proc/self/exe with start_command_line, so also through an explicit loader;
// OPENBLAS_CORETYPE set) when blas_override says so, once (DELTASTACK_BLAS_REEXEC marks the second run); returns
// when there is nothing to do or the exec fails (the library's own choice stays; a command line it cannot read is
// one warning). DELTASTACK_BLAS_CORETYPE=keep turns it off. Call first thing in main: the deltastack binary and the
// test binary do, so both run the same kernels.
void reexec_with_cpu_blas_kernels(char** argv);

}  // namespace ds
