// Logging to stderr with a level prefix. DELTASTACK_LOG=quiet|info|debug (default info). A failed write (a closed
// pipe) is ignored: a log line never stops the program. set_log_muted(true) silences info, debug and warnings (the
// ranks other than 0 of a multi-rank run: rank 0 speaks for the run; errors are printed by the caller).
#pragma once
#include <fmt/format.h>

#include <cstdio>
#include <string>
#include <utility>

namespace ds {

namespace detail {
inline void log_line(const std::string& s) { std::fwrite(s.data(), 1, s.size(), stderr); }
}  // namespace detail

// Writes the NUL-terminated `s` to stderr with write(2) alone: async-signal-safe, for signal handlers.
void write_stderr_in_signal_handler(const char* s);

enum class LogLevel { Quiet = 0, Info = 1, Debug = 2 };
LogLevel log_level();
void set_log_level(LogLevel level);
bool log_muted();
void set_log_muted(bool muted);

template <class... Args>
void log_info(fmt::format_string<Args...> f, Args&&... args) {
  if (log_level() >= LogLevel::Info && !log_muted())
    detail::log_line(fmt::format("[deltastack] {}\n", fmt::format(f, std::forward<Args>(args)...)));
}
template <class... Args>
void log_debug(fmt::format_string<Args...> f, Args&&... args) {
  if (log_level() >= LogLevel::Debug && !log_muted())
    detail::log_line(fmt::format("[deltastack:debug] {}\n", fmt::format(f, std::forward<Args>(args)...)));
}
template <class... Args>
void log_warn(fmt::format_string<Args...> f, Args&&... args) {
  if (!log_muted()) detail::log_line(fmt::format("[deltastack] warning: {}\n", fmt::format(f, std::forward<Args>(args)...)));
}

}  // namespace ds
