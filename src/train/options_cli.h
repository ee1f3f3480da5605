// The train options as CLI11 flags, registered from the table of options.h (header-only: CLI11 is linked into
// the deltastack binary, src/cli/main.cpp, not into the library).
#pragma once
#include <CLI/CLI.hpp>

#include <type_traits>
#include <variant>

#include "train/options.h"

namespace ds {

// Registers every train option as --<flag> writing into `o` (the defaults are o's): the global ones (--threads)
// on `app`, the others on its `train` subcommand.
inline void add_train_flags(CLI::App& app, CLI::App& train, TrainOptions& o) {
  for (const TrainOption& e : train_options()) {
    CLI::App& where = e.has(kGlobal) ? app : train;
    std::visit(
        [&](auto m) {
          CLI::Option* flag = nullptr;
          if constexpr (std::is_same_v<decltype(m), TrainMember<bool>>)
            flag = where.add_flag("--" + e.flag, o.*m, e.help);
          else
            flag = where.add_option("--" + e.flag, o.*m, e.help);
          if (e.shows_default) flag->capture_default_str();
          if constexpr (std::is_same_v<decltype(m), TrainMember<uint64_t>>)  // CLI11 would wrap -1 to 2^64 - 1
            flag->check(CLI::Validator(
                [](std::string& v) { return v.rfind('-', 0) == 0 ? "must be >= 0, got " + v : std::string(); },
                "UINT"));
        },
        e.member);
  }
}

// `train --help`'s footer: what a resume may change, the global --threads, the environment.
inline std::string train_help_footer() {
  return "--resume CKPT continues with the checkpoint's options; only " + resumable_flags() +
         " may be given with it (any other flag is an error).\n--threads N (a flag of every subcommand, also before "
         "it): CPU threads, 0 = all cores.\nSIGINT / SIGTERM: the current step finishes, a checkpoint is saved (none "
         "with --no-save) and the run exits 130 / 143 (a second signal stops at once).\nEnvironment: "
         "DELTASTACK_<OP>=auto|fast|reference|<backend> picks an op's backend (`deltastack probe` lists them), "
         "DELTASTACK_LOG=quiet|info|debug; with --precision fp8 (docs/fp8.md) DELTASTACK_FP8_GRAD=e5m2|e4m3 (the "
         "output gradients' format), DELTASTACK_FP8_FAST_ACCUM=forward|all|none, DELTASTACK_FP8_AMAX=fused|separate.\n";
}

// After parsing: the train options given on the command line, into o.given.
inline void record_given_flags(const CLI::App& app, const CLI::App& train, TrainOptions& o) {
  for (const TrainOption& e : train_options())
    if ((e.has(kGlobal) ? app : train).get_option("--" + e.flag)->count() > 0) o.given.push_back(e.flag);
}

}  // namespace ds
