// SwiGLU (HF Qwen3_5MLP): h = silu(gate) * up, elementwise.
#pragma once
#include <cstdint>

namespace ds::ops {

// gate, up, h: [n] (any shape flattened).
template <typename T>
void swiglu_forward(const T* gate, const T* up, T* h, int64_t n);

// dgate = dh * up * sigmoid(gate) * (1 + gate * (1 - sigmoid(gate))); dup = dh * silu(gate). Overwritten.
template <typename T>
void swiglu_backward(const T* gate, const T* up, const T* dh, T* dgate, T* dup, int64_t n);

}  // namespace ds::ops
