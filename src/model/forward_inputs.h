// `deltastack forward`'s inputs file (a safetensors file in the transformers convention) read into a packed batch.
// One reader for the command and its fuzz target (fuzz/fuzz_forward_inputs.cpp), so what is fuzzed is what runs.
#pragma once
#include <cstdint>

#include "model/model.h"
#include "model/safetensors.h"

namespace ds {

struct ForwardInputs {
  int64_t B = 0, T = 0;     // input_ids is [B, T] ([T] reads as B = 1)
  bool has_labels = false;  // labels given: batch.targets holds the shifted labels
  PackedBatch batch;        // B * T tokens, finalized (positions set)
};

// Reads `in`'s tensors, all integer dtypes (I64, I32, I16, I8, U8):
//   input_ids     [B, T] or [T], ids in [0, vocab_size);
//   labels        optional, input_ids' shape, ids in [0, vocab_size) or -100 (HF causal-LM labels: position t of a
//                 sequence predicts labels[t + 1] of the same sequence; nothing crosses a sequence);
//   cu_seqlens    optional, [S + 1], needs B = 1: S sequences packed along T (checked by check_cu_seqlens before
//                 any entry is used);
//   position_ids  optional, input_ids' shape (HF packing: each sequence counts 0, 1, 2, ...): must be the positions
//                 the sequences imply; without cu_seqlens, each 0 inside a row starts a new sequence (as
//                 transformers' flash-attention path reads packed position_ids);
//   attention_mask optional, input_ids' shape, all ones (padding is not supported: pack the sequences instead).
// Without cu_seqlens and position_ids, each row is one sequence. Any other tensor is an error (it would be
// ignored). B * T must be below 2^31. Throws ds::Error naming in.path() and the tensor, index and value at fault.
ForwardInputs read_forward_inputs(const SafetensorsReader& in, int64_t vocab_size);

}  // namespace ds
