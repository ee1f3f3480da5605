// The GPU engine's memory: one device allocation, planned up front and carved by a bump allocator. Each part of
// the engine (parameter store, optimizer, activation plan, op plans) reserves its buffers in a fixed order; the
// layout runs once with base == nullptr to size the allocation, then again with the real base. Nothing is
// allocated in the step loop.
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>

#include "core/checked.h"

namespace ds {

// What each byte of the engine's allocation is for (`deltastack plan` prints one row per category).
enum class MemoryUse {
  Parameters,   // master weights + the bf16 compute copy (model/gpu_params.h)
  Gradients,    // fp32
  Optimizer,    // the optimizer's state (AdamW: two moments, fp32 or bf16)
  Kept,         // activations kept per layer for the backward (and the batch's inputs)
  GdnSaved,     // the gated delta rule plan's saved state, per GDN layer
  Recomputed,   // activations rebuilt in the backward (one buffer each, shared by the layers) + gradient buffers
  Workspace,    // op scratch, the fused loss's scratch, op plans' batch data and workspaces
  kCount
};
inline const char* memory_use_name(MemoryUse u) {
  switch (u) {
    case MemoryUse::Parameters: return "parameters (master weights + bf16 compute copy)";
    case MemoryUse::Gradients: return "gradients (fp32; in-backward: unit slots; bf16: + slots)";
    case MemoryUse::Optimizer: return "optimizer state (AdamW exp_avg + exp_avg_sq)";
    case MemoryUse::Kept: return "activations kept for the backward";
    case MemoryUse::GdnSaved: return "gated delta rule saved state (all GDN layers)";
    case MemoryUse::Recomputed: return "recomputed activations + gradient buffers (shared)";
    case MemoryUse::Workspace: return "workspaces (op scratch, fused loss, op plans)";
    case MemoryUse::kCount: break;
  }
  return "?";
}

struct Arena {
  char* base = nullptr;  // nullptr: sizing pass (take() returns nullptr, off still advances)
  size_t off = 0;        // bytes reserved so far
  MemoryUse use = MemoryUse::Workspace;  // the category the next take() counts under
  std::array<size_t, static_cast<size_t>(MemoryUse::kCount)> by_use{};  // bytes per category (alignment included)
  // n elements of T, 256-byte aligned (every buffer starts on its own 256-byte boundary). ds::Error when the
  // plan passes 2^64 bytes (n from a negative count included), rather than a total that wrapped.
  template <typename T>
  T* take(size_t n) {
    constexpr const char* kWhat = "memory plan: more than 2^64 bytes (the model and batch shape fit no device)";
    const size_t start = off;
    off = checked_add<size_t>(off, 255, kWhat) / 256 * 256;
    T* p = reinterpret_cast<T*>(base + off);
    off = checked_add(off, checked_mul(n, sizeof(T), kWhat), kWhat);
    by_use[static_cast<size_t>(use)] += off - start;
    return base ? p : nullptr;
  }
  void* bytes(size_t n) { return take<char>(n); }
};

}  // namespace ds
