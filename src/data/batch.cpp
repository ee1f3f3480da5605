#include "data/batch.h"

#include <algorithm>

#include "core/error.h"

namespace ds {

void PackedBatch::finalize(const std::string& what) {
  const int64_t N = size();
  DS_CHECK(static_cast<int64_t>(targets.size()) == N, "{}: {} targets for {} tokens", what, targets.size(), N);
  DS_CHECK(cu_seqlens.size() >= 2 && cu_seqlens.front() == 0 && cu_seqlens.back() == N,
           "{}: cu_seqlens must start at 0 and end at the token count {}", what, N);
  positions.assign(static_cast<size_t>(N), 0);
  for (size_t s = 0; s + 1 < cu_seqlens.size(); ++s) {
    DS_CHECK(cu_seqlens[s + 1] >= cu_seqlens[s], "{}: cu_seqlens must be non-decreasing (entry {})", what, s + 1);
    for (int32_t t = cu_seqlens[s]; t < cu_seqlens[s + 1]; ++t) positions[static_cast<size_t>(t)] = t - cu_seqlens[s];
  }
}

void PackedBatch::check(const BatchLimits& c) const {
  const int64_t N = size();
  DS_CHECK(cu_seqlens.size() >= 2, "batch: cu_seqlens needs at least two entries");
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
