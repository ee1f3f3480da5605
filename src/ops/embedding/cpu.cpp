#include "ops/embedding/embedding.h"

#include "core/error.h"

namespace ds::ops {

template <typename T>
void embedding_forward(const int32_t* ids, int64_t n, const T* table, int64_t vocab, int64_t dim, T* out) {
  for (int64_t i = 0; i < n; ++i)
    DS_CHECK(ids[i] >= 0 && ids[i] < vocab, "embedding: token id {} at position {} is outside the vocabulary [0, {})",
             ids[i], i, vocab);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const T* src = table + static_cast<int64_t>(ids[i]) * dim;
    T* dst = out + i * dim;
    for (int64_t j = 0; j < dim; ++j) dst[j] = src[j];
  }
}

template <typename T>
void embedding_backward(const int32_t* ids, int64_t n, const T* dout, int64_t vocab, int64_t dim, T* dtable) {
  // Parallel over columns: each column sums its tokens in index order, so the result is thread-count independent.
#pragma omp parallel for schedule(static)
  for (int64_t j = 0; j < dim; ++j)
    for (int64_t i = 0; i < n; ++i) dtable[static_cast<int64_t>(ids[i]) * dim + j] += dout[i * dim + j];
}

template void embedding_forward<float>(const int32_t*, int64_t, const float*, int64_t, int64_t, float*);
template void embedding_forward<double>(const int32_t*, int64_t, const double*, int64_t, int64_t, double*);
template void embedding_backward<float>(const int32_t*, int64_t, const float*, int64_t, int64_t, float*);
template void embedding_backward<double>(const int32_t*, int64_t, const double*, int64_t, int64_t, double*);

}  // namespace ds::ops
