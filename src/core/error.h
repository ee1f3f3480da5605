// Errors: every user-facing failure is a ds::Error whose message names the file or field at fault.
// The CLI catches it, prints "error: <message>" and exits non-zero.
#pragma once
#include <fmt/format.h>

#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>

namespace ds {

struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// `text` with every byte that is not printable shown as \xNN: controls (but newline and tab) and bytes outside a
// valid UTF-8 sequence; valid UTF-8 passes unchanged. For messages that quote bytes of a user's file or argument
// (a JSON parser's "last read", invalid UTF-8), so that an error line never writes raw binary to the terminal.
std::string printable(std::string_view text);

template <class... Args>
[[noreturn]] void fail(fmt::format_string<Args...> f, Args&&... args) {
  throw Error(fmt::format(f, std::forward<Args>(args)...));
}

}  // namespace ds

// DS_CHECK(cond, "fmt", args...): throw ds::Error with the formatted message when cond is false.
#define DS_CHECK(cond, ...)   \
  do {                        \
    if (!(cond)) {            \
      ::ds::fail(__VA_ARGS__); \
    }                         \
  } while (0)
