// Embedding lookup (HF nn.Embedding, no scaling). CPU reference, templated on float/double.
#pragma once
#include <cstdint>

namespace ds::ops {

// out[n, :] = table[ids[n], :].  ids: [n] int32; table: [vocab, dim]; out: [n, dim].
// Throws ds::Error if an id is outside [0, vocab).
template <typename T>
void embedding_forward(const int32_t* ids, int64_t n, const T* table, int64_t vocab, int64_t dim, T* out);

// dtable[ids[n], :] += dout[n, :]  (accumulates; deterministic: tokens are summed in index order).
template <typename T>
void embedding_backward(const int32_t* ids, int64_t n, const T* dout, int64_t vocab, int64_t dim, T* dtable);

}  // namespace ds::ops
