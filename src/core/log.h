// Logging to stderr with a level prefix. DELTASTACK_LOG=quiet|info|debug (default info).
#pragma once
#include <fmt/format.h>

#include <cstdio>
#include <utility>

namespace ds {

enum class LogLevel { Quiet = 0, Info = 1, Debug = 2 };
LogLevel log_level();
void set_log_level(LogLevel level);

template <class... Args>
void log_info(fmt::format_string<Args...> f, Args&&... args) {
  if (log_level() >= LogLevel::Info) fmt::print(stderr, "[deltastack] {}\n", fmt::format(f, std::forward<Args>(args)...));
}
template <class... Args>
void log_debug(fmt::format_string<Args...> f, Args&&... args) {
  if (log_level() >= LogLevel::Debug) fmt::print(stderr, "[deltastack:debug] {}\n", fmt::format(f, std::forward<Args>(args)...));
}
template <class... Args>
void log_warn(fmt::format_string<Args...> f, Args&&... args) {
  fmt::print(stderr, "[deltastack] warning: {}\n", fmt::format(f, std::forward<Args>(args)...));
}

}  // namespace ds
