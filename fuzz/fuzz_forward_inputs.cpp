// libFuzzer target for `deltastack forward --inputs` (see fuzz/README.md for the build command).
// Each input is a safetensors image, parsed in memory (SafetensorsReader::from_bytes) and read by
// ds::read_forward_inputs, the command's own reader (input_ids, labels, cu_seqlens, position_ids, attention_mask),
// against the tiny test model's vocabulary (tests/fixtures/hf_qwen35_tiny_a, or $DS_FUZZ_MODEL). Rejection must be
// a ds::Error, never a crash, sanitizer report or other exception. An accepted batch must be self-consistent
// (B * T tokens, ids and targets in range, cu_seqlens 0 .. N non-decreasing, positions counting from 0 inside each
// sequence, no target crossing a sequence) and, up to 512 tokens, must run through the CPU model's forward and
// backward with a finite loss and finite logits.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

#include "core/error.h"
#include "model/forward_inputs.h"
#include "model/model.h"
#include "model/safetensors.h"

namespace {

[[noreturn]] void bug(const char* what) {
  std::fprintf(stderr, "fuzz_forward_inputs invariant violated: %s\n", what);
  std::abort();
}

ds::Qwen35Model& model() {
  static std::unique_ptr<ds::Qwen35Model> m = [] {
    const char* env = std::getenv("DS_FUZZ_MODEL");
    const std::string dir = env ? env : "tests/fixtures/hf_qwen35_tiny_a";
    auto p = std::make_unique<ds::Qwen35Model>(ds::ModelConfig::from_file(dir));
    p->load(dir);
    return p;
  }();
  return *m;
}

void check_accepted(const ds::ForwardInputs& fi) {
  const ds::PackedBatch& b = fi.batch;
  const int64_t V = model().config().vocab_size, N = b.size();
  if (fi.B < 1 || fi.T < 1 || N != fi.B * fi.T) bug("token count");
  if (static_cast<int64_t>(b.targets.size()) != N || static_cast<int64_t>(b.positions.size()) != N) bug("sizes");
  if (b.cu_seqlens.size() < 2 || b.cu_seqlens.front() != 0 || b.cu_seqlens.back() != N) bug("cu_seqlens ends");
  for (size_t s = 0; s + 1 < b.cu_seqlens.size(); ++s) {
    const int32_t lo = b.cu_seqlens[s], hi = b.cu_seqlens[s + 1];
    if (hi < lo || hi > N) bug("cu_seqlens order");
    for (int32_t t = lo; t < hi; ++t) {
      if (b.positions[static_cast<size_t>(t)] != t - lo) bug("positions");
      if (t + 1 == hi && b.targets[static_cast<size_t>(t)] != -100) bug("a target crosses a sequence");
    }
  }
  for (int64_t t = 0; t < N; ++t) {
    const int32_t id = b.input_ids[static_cast<size_t>(t)], y = b.targets[static_cast<size_t>(t)];
    if (id < 0 || id >= V) bug("input id out of range");
    if (y != -100 && (y < 0 || y >= V)) bug("target out of range");
    if (!fi.has_labels && y != -100) bug("a target without labels");
  }
  if (N > 512) return;
  ds::ForwardCapture cap;
  cap.logits = true;
  model().zero_grads();
  const int64_t valid = b.num_targets();
  const ds::LossResult r = model().forward_backward(b, valid > 0 ? 1.0 / static_cast<double>(valid) : 0.0, 0.0, &cap);
  if (r.num_valid != valid || !std::isfinite(r.loss_sum)) bug("loss");
  if (static_cast<int64_t>(cap.logits_values.size()) != N * V) bug("logits size");
  for (float x : cap.logits_values)
    if (!std::isfinite(x)) bug("non-finite logit");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const int64_t vocab = model().config().vocab_size;
  std::string bytes(reinterpret_cast<const char*>(data), size);
  ds::ForwardInputs fi;
  try {
    const ds::SafetensorsReader in = ds::SafetensorsReader::from_bytes(std::move(bytes), "fuzz-input");
    fi = ds::read_forward_inputs(in, vocab);
  } catch (const ds::Error&) {
    return 0;  // rejected: expected
  }
  check_accepted(fi);  // an accepted batch must never throw
  return 0;
}
