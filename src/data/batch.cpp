#include "data/batch.h"

#include <algorithm>

#include "core/cu_seqlens.h"
#include "core/error.h"

namespace ds {

void PackedBatch::finalize(const std::string& what) {
  const int64_t N = size();
  DS_CHECK(static_cast<int64_t>(targets.size()) == N, "{}: {} targets for {} tokens", what, targets.size(), N);
  check_cu_seqlens(cu_seqlens.data(), cu_seqlens.size(), N, what);
  positions.assign(static_cast<size_t>(N), 0);
  for (size_t s = 0; s + 1 < cu_seqlens.size(); ++s)
    for (int32_t t = cu_seqlens[s]; t < cu_seqlens[s + 1]; ++t) positions[static_cast<size_t>(t)] = t - cu_seqlens[s];
}

void PackedBatch::check(const BatchLimits& c) const {
  const int64_t N = size();
  check_cu_seqlens(cu_seqlens.data(), cu_seqlens.size(), N, "batch");
  DS_CHECK(static_cast<int64_t>(positions.size()) == N && static_cast<int64_t>(targets.size()) == N,
           "batch: positions or targets not set (call finalize())");
  for (int64_t t = 0; t < N; ++t) {
    const int32_t id = input_ids[static_cast<size_t>(t)], y = targets[static_cast<size_t>(t)];
    DS_CHECK(id >= 0 && id < c.vocab_size, "batch: token id {} at position {} is outside the vocabulary [0, {})", id,
             t, c.vocab_size);
    DS_CHECK(y == -100 || (y >= 0 && y < c.vocab_size), "batch: target {} at position {} is outside the vocabulary "
             "[0, {})", y, t, c.vocab_size);
    DS_CHECK(positions[static_cast<size_t>(t)] < c.max_position_embeddings,
             "batch: a document is longer than max_position_embeddings ({})", c.max_position_embeddings);
  }
}

int64_t PackedBatch::num_targets() const {
  return std::count_if(targets.begin(), targets.end(), [](int32_t t) { return t != -100; });
}

}  // namespace ds
