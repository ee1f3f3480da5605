// Overflow-checked integer arithmetic for sizes (bytes, element counts): the exact result, or a ds::Error saying
// what overflowed, never a value that wrapped around (a memory plan of 2^64 + 1 GiB bytes must not read as 1 GiB).
#pragma once
#include <string_view>
#include <type_traits>

#include "core/error.h"

namespace ds {

namespace detail {
template <class T>
T checked_result(bool overflowed, T r, T a, const char* op, T b, std::string_view what) {
  static_assert(std::is_integral_v<T>);
  DS_CHECK(!overflowed, "{}: {} {} {} overflows", what, a, op, b);
  return r;
}
}  // namespace detail

// a + b and a * b in T (any integer type); ds::Error "<what>: <a> + <b> overflows" when the result does not fit.
template <class T>
T checked_add(T a, T b, std::string_view what) {
  T r;
  const bool overflowed = __builtin_add_overflow(a, b, &r);  // before r is read (argument order is unspecified)
  return detail::checked_result(overflowed, r, a, "+", b, what);
}
template <class T>
T checked_mul(T a, T b, std::string_view what) {
  T r;
  const bool overflowed = __builtin_mul_overflow(a, b, &r);
  return detail::checked_result(overflowed, r, a, "x", b, what);
}

}  // namespace ds
