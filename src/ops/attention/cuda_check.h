// Numeric check of causal GQA attention over packed documents on the GPU, through the simple flash kernel
// (ops/attention/cuda.h) or cuDNN's fused SDPA (ops/attention/cudnn.h), against the fp32 CPU reference
// (ops/attention/attention.h); shared by the registry's two start-up probes and tests/test_cuda_gemm_attn_ce.cpp,
// tests/test_cuda_real_shapes.cpp; contract in ops/check/check.h.
#pragma once
#include <cstdint>
#include <vector>

#include "ops/check/check.h"

namespace ds::ops {

// q, dout: [N, Hq, head_dim]; k, v: [N, Hkv, head_dim]; bf16 normal; scale head_dim^-1/2; documents packed in the
// order of `lens` (a length may be 0). Values: o, lse (forward band); dq, dk, dv (gradient band; the CPU backward
// reads the GPU's bf16 o and the reference lse, as the GPU backward does); with twice, forward and backward run
// twice bitwise equal. With cudnn, cuDNN's graphs are built for the bounds below (more documents than the batch
// holds leave unused entries in the buckets) and its workspace is poisoned before every run.
struct AttentionCase {
  std::vector<int> lens = {1, 70, 0, 130};
  int64_t Hq = 4, Hkv = 2, head_dim = 64;
  bool cudnn = false;
  int64_t max_seqs = 0, max_seqlen = 0, max_tokens = 0;  // cuDNN bounds; 0: the batch's own
  int64_t head_groups = 1;                                 // cuDNN's backward by head groups (AttnBounds)
  // cuDNN: 1 = every bucket in use is full, so the calls zero none of the (NaN-poisoned) workspace, checked
  // (Attention::zeroed_bytes); 0 = some is not, so they zero some; -1 = not checked.
  int full_buckets = -1;
  uint64_t seed = 1;
  bool twice = true;
};
check::Result check_attention(const AttentionCase& c);
// The start-up probe of the simple kernel: packed {1, 70, 0, 130}, GQA 2: head_dim 64 (Hq 4), 256 (Hq 2).
std::vector<AttentionCase> attention_probe_cases();
// The start-up probe of cuDNN: packed {1, 70, 0, 130, 5} (three length buckets whose documents interleave, unused
// entries in two of them, an empty document), head_dim 128 (Hq 4, Hkv 2) and 256 (Hq 4, Hkv 1); run twice, the
// results must agree bitwise; with DELTASTACK_ATTENTION_SPLIT=1 also head_dim 256 with Hq 6, Hkv 2 in two head
// groups (one backward call per group; three query heads each, so the stats pointers are 4-byte aligned only).
std::vector<AttentionCase> cudnn_attention_probe_cases();
// The registry's probes: check::probe("attention", <cases>, check_attention).
double probe_cuda_attention();
double probe_cudnn_attention();

}  // namespace ds::ops
