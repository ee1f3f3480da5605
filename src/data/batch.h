// The packed batch every engine takes: documents flattened to N tokens with cu_seqlens (data/dataset.h packs them;
// the engines in model/ consume them). Data-layer type: it knows no model, only the limits a model checks it against.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace ds {

// What a batch is checked against (PackedBatch::check): the model's vocabulary and context length, as in
// ModelConfig's fields of the same names (model/config.h).
struct BatchLimits {
  int64_t vocab_size = 0;               // token ids and targets in [0, vocab_size)
  int64_t max_position_embeddings = 0;  // no document longer than this
};

// One packed batch of documents, flattened to N tokens (batch rows are documents too).
struct PackedBatch {
  std::vector<int32_t> input_ids;   // [N]
  std::vector<int32_t> targets;     // [N]: the token position t must predict, or -100 (already shifted)
  std::vector<int32_t> cu_seqlens;  // [num_seqs + 1], 0 .. N
  std::vector<int32_t> positions;   // [N]: position inside its document (RoPE), derived by finalize()
  int64_t size() const { return static_cast<int64_t>(input_ids.size()); }
  // Fills positions from cu_seqlens and checks the shapes; throws ds::Error with `what` in the message.
  void finalize(const std::string& what = "batch");
  int64_t num_targets() const;  // targets != -100
  // Checks the batch against a model: token ids and targets inside the vocabulary, documents no longer than
  // max_position_embeddings, positions set. Throws ds::Error naming the position. Both engines call it.
  void check(const BatchLimits& c) const;
};

}  // namespace ds
