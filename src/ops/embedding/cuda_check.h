// Numeric check of the CUDA embedding (ops/embedding/cuda.h) against the fp32 CPU reference
// (ops/embedding/embedding.h), shared by the registry's start-up probe and tests/test_cuda_ops.cpp,
// tests/test_cuda_real_shapes.cpp; contract in ops/check/check.h.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

#include "ops/check/check.h"

namespace ds::ops {

// N token ids: every fifth token the id 7 % V (a frequent id), the last token V - 1 (the last table row), the
// others uniform over the first `distinct` ids (0: the whole vocabulary); table: [V, H] bf16; dout: [N, H] bf16.
// The backward takes the host grouping the GPU model builds (positions sorted by id, unique ids, offsets).
// Values: out (forward band); dtable (gradient band, fp32, accumulated onto a random start); with twice, two runs
// bitwise equal.
struct EmbeddingCase {
  int64_t N = 96, V = 512, H = 256, distinct = 0;
  size_t offset = 0;  // table / out / dout / dtable pointer shift in elements (1: unaligned, the scalar path)
  uint64_t seed = 1;
  bool twice = true;
};
check::Result check_embedding(const EmbeddingCase& c);
// The start-up probe: V 512, H 256, N 96 (repeated ids).
std::vector<EmbeddingCase> embedding_probe_cases();
// The registry's probe: check::probe("embedding", embedding_probe_cases(), check_embedding).
double probe_cuda_embedding();

}  // namespace ds::ops
