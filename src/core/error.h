// Errors: every user-facing failure is a ds::Error whose message names the file or field at fault.
// The CLI catches it, prints "error: <message>" and exits non-zero.
#pragma once
#include <fmt/format.h>

#include <stdexcept>
#include <string>
#include <utility>

namespace ds {

struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

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
