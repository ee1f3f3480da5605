#include "model/forward_inputs.h"

#include <climits>
#include <string>
#include <vector>

#include "core/cu_seqlens.h"
#include "core/error.h"

namespace ds {

ForwardInputs read_forward_inputs(const SafetensorsReader& in, int64_t vocab_size) {
  const std::string& path = in.path();
  for (const TensorInfo& t : in.tensors())
    DS_CHECK(t.name == "input_ids" || t.name == "labels" || t.name == "cu_seqlens" || t.name == "position_ids" ||
                 t.name == "attention_mask",
             "{}: unknown tensor \"{}\" (forward reads input_ids, labels, cu_seqlens, position_ids and attention_mask)",
             path, t.name);
  const TensorInfo* ids_info = in.find("input_ids");
  DS_CHECK(ids_info, "{}: missing tensor \"input_ids\"", path);
  const std::vector<int64_t>& shape = ids_info->shape;
  DS_CHECK(shape.size() == 2 || shape.size() == 1, "{}: input_ids must be [B, T] or [T], got {} dims", path,
           shape.size());
  ForwardInputs r;
  r.B = shape.size() == 2 ? shape[0] : 1;
  r.T = shape.back();
  const int64_t B = r.B, T = r.T;
  DS_CHECK(B >= 1 && T >= 1, "{}: input_ids is empty", path);
  DS_CHECK(T <= INT32_MAX / B, "{}: input_ids holds {} x {} tokens, more than a batch's {} (int32 positions)", path,
           B, T, INT32_MAX);
  const size_t N = static_cast<size_t>(B * T);
  // An optional tensor of input_ids' shape, read as integers.
  auto same_shape = [&](const char* name) {
    std::vector<int64_t> v;
    if (const TensorInfo* t = in.find(name)) {
      DS_CHECK(t->shape == shape, "{}: {} must have input_ids' shape", path, name);
      v = in.read_i64(name);
    }
    return v;
  };
  const std::vector<int64_t> ids = in.read_i64("input_ids"), labels = same_shape("labels"),
                             pos = same_shape("position_ids"), mask = same_shape("attention_mask");
  for (size_t i = 0; i < mask.size(); ++i)
    DS_CHECK(mask[i] == 1, "{}: attention_mask[{}] = {}: padding is not supported (pack the sequences with "
             "cu_seqlens or position_ids instead)", path, i, mask[i]);

  // Sequence boundaries: cu_seqlens as given, else each row start and each position_ids 0, else the rows.
  std::vector<int64_t> cu;
  if (const TensorInfo* t = in.find("cu_seqlens")) {
    DS_CHECK(B == 1, "{}: cu_seqlens needs a single row (B = 1), got B = {}", path, B);
    DS_CHECK(t->shape.size() == 1, "{}: cu_seqlens must be 1-D [num_seqs + 1]", path);
    cu = in.read_i64("cu_seqlens");
    check_cu_seqlens(cu.data(), cu.size(), T, path);  // before any entry is used as an index
  } else {
    for (size_t t = 0; t < N; ++t)
      if (t % static_cast<size_t>(T) == 0 || (!pos.empty() && pos[t] == 0)) cu.push_back(static_cast<int64_t>(t));
    cu.push_back(static_cast<int64_t>(N));
  }
  // position_ids must count 0, 1, 2, ... inside each sequence (RoPE uses these positions: others would be ignored).
  for (size_t s = 0; s + 1 < cu.size() && !pos.empty(); ++s)
    for (int64_t t = cu[s]; t < cu[s + 1]; ++t)
      DS_CHECK(pos[static_cast<size_t>(t)] == t - cu[s], "{}: position_ids[{}] = {}, but token {} is position {} of "
               "its sequence (position_ids must restart at 0 at each sequence and count up by 1)", path, t,
               pos[static_cast<size_t>(t)], t, t - cu[s]);

  PackedBatch& b = r.batch;
  b.input_ids.reserve(N);
  for (size_t i = 0; i < N; ++i) {
    DS_CHECK(ids[i] >= 0 && ids[i] < vocab_size, "{}: input_ids[{}] = {} is outside the vocabulary [0, {})", path, i,
             ids[i], vocab_size);
    b.input_ids.push_back(static_cast<int32_t>(ids[i]));
  }
  b.targets.assign(N, -100);
  for (int64_t x : cu) b.cu_seqlens.push_back(static_cast<int32_t>(x));
  r.has_labels = !labels.empty();
  // HF shift inside each sequence: position t predicts labels[t + 1].
  for (size_t s = 0; s + 1 < cu.size() && r.has_labels; ++s)
    for (int64_t t = cu[s]; t + 1 < cu[s + 1]; ++t) {
      const int64_t y = labels[static_cast<size_t>(t + 1)];
      DS_CHECK(y == -100 || (y >= 0 && y < vocab_size), "{}: labels[{}] = {} is outside the vocabulary [0, {}) (and "
               "not -100)", path, t + 1, y, vocab_size);
      b.targets[static_cast<size_t>(t)] = static_cast<int32_t>(y);
    }
  b.finalize(path);
  return r;
}

}  // namespace ds
