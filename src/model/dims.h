// Op dimension structs of one forward/backward call built from a model configuration, shared by the CPU model
// (model.cpp) and the GPU model (gpu_model.cpp).
#pragma once
#include <cmath>
#include <cstdint>

#include "model/config.h"
#include "ops/attention/attention.h"
#include "ops/gated_delta_rule/gated_delta_rule.h"

namespace ds {

// Gated delta rule over N packed tokens in num_seqs sequences: scale = dk^-0.5, chunks of 64 tokens.
inline ops::GdnDims gdn_dims(const ModelConfig& c, int64_t N, int64_t num_seqs) {
  ops::GdnDims d;
  d.N = N;
  d.num_seqs = num_seqs;
  d.Hk = c.linear_num_key_heads;
  d.Hv = c.linear_num_value_heads;
  d.dk = c.linear_key_head_dim;
  d.dv = c.linear_value_head_dim;
  d.scale = 1.0 / std::sqrt(static_cast<double>(d.dk));
  d.chunk_size = 64;
  return d;
}

// Softmax attention over N packed tokens in num_seqs sequences: scale = head_dim^-0.5.
inline ops::AttnDims attn_dims(const ModelConfig& c, int64_t N, int64_t num_seqs) {
  ops::AttnDims d;
  d.N = N;
  d.num_seqs = num_seqs;
  d.Hq = c.num_attention_heads;
  d.Hkv = c.num_key_value_heads;
  d.head_dim = c.head_dim;
  d.scale = 1.0 / std::sqrt(static_cast<double>(c.head_dim));
  return d;
}

}  // namespace ds
