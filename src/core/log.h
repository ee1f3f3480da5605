// Logging to stderr with a level prefix. DELTASTACK_LOG=quiet|info|debug (default info). A failed write (a closed
// pipe) is ignored: a log line never stops the program.
#pragma once
#include <fmt/format.h>

#include <cstdio>
#include <string>
#include <utility>

namespace ds {

namespace detail {
inline void log_line(const std::string& s) { std::fwrite(s.data(), 1, s.size(), stderr); }
}  // namespace detail

enum class LogLevel { Quiet = 0, Info = 1, Debug = 2 };
LogLevel log_level();
void set_log_level(LogLevel level);

template <class... Args>
void log_info(fmt::format_string<Args...> f, Args&&... args) {
  if (log_level() >= LogLevel::Info)
    detail::log_line(fmt::format("[deltastack] {}\n", fmt::format(f, std::forward<Args>(args)...)));
}
template <class... Args>
void log_debug(fmt::format_string<Args...> f, Args&&... args) {
  if (log_level() >= LogLevel::Debug)
    detail::log_line(fmt::format("[deltastack:debug] {}\n", fmt::format(f, std::forward<Args>(args)...)));
}
template <class... Args>
void log_warn(fmt::format_string<Args...> f, Args&&... args) {
  detail::log_line(fmt::format("[deltastack] warning: {}\n", fmt::format(f, std::forward<Args>(args)...)));
}

}  // namespace ds
