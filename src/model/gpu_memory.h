// The GPU engine's memory: one device allocation, planned up front and carved by a bump allocator. Each part of
// the engine (parameter store, optimizer, activation plan, op plans) reserves its buffers in a fixed order; the
// layout runs once with base == nullptr to size the allocation, then again with the real base. Nothing is
// allocated in the step loop.
#pragma once
#include <cstddef>
#include <cstdint>

namespace ds {

struct Arena {
  char* base = nullptr;  // nullptr: sizing pass (take() returns nullptr, off still advances)
  size_t off = 0;        // bytes reserved so far
  // n elements of T, 256-byte aligned (every buffer starts on its own 256-byte boundary).
  template <typename T>
  T* take(size_t n) {
    off = (off + 255) / 256 * 256;
    T* p = reinterpret_cast<T*>(base + off);
    off += n * sizeof(T);
    return base ? p : nullptr;
  }
  void* bytes(size_t n) { return take<char>(n); }
};

}  // namespace ds
