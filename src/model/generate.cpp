// Generation's sampling and loop (model/generate.h).
#include "model/generate.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <numeric>

#include "core/error.h"
#include "model/engine.h"
#include "model/model.h"

namespace ds {

void check_sampling(const SamplingOptions& o) {
  DS_CHECK(std::isfinite(o.temperature) && o.temperature >= 0, "--temperature must be finite and >= 0, got {}",
           o.temperature);
  DS_CHECK(o.top_k >= 0, "--top-k must be >= 0, got {}", o.top_k);
  DS_CHECK(std::isfinite(o.top_p) && o.top_p > 0 && o.top_p <= 1, "--top-p must be in (0, 1], got {}", o.top_p);
}

int32_t sample_token(const std::vector<float>& logits, int64_t usable, const SamplingOptions& o, Rng& rng) {
  DS_CHECK(usable >= 1 && usable <= static_cast<int64_t>(logits.size()),
           "sample_token: {} usable ids of {} logits", usable, logits.size());
  if (o.temperature <= 0)
    return static_cast<int32_t>(std::max_element(logits.begin(), logits.begin() + usable) - logits.begin());
  std::vector<int32_t> order(static_cast<size_t>(usable));
  std::iota(order.begin(), order.end(), 0);
  int64_t k = o.top_k > 0 ? std::min(o.top_k, usable) : usable;
  std::partial_sort(order.begin(), order.begin() + k, order.end(),
                    [&](int32_t a, int32_t c) { return logits[a] > logits[c]; });
  double mx = logits[order[0]], total = 0;
  std::vector<double> p(static_cast<size_t>(k));
  for (int64_t i = 0; i < k; ++i) total += p[i] = std::exp((logits[order[i]] - mx) / o.temperature);
  if (o.top_p < 1) {  // the most likely ids (sorted) until their probability reaches top_p
    double kept = 0;
    int64_t n = 0;
    while (n < k && kept < o.top_p * total) kept += p[static_cast<size_t>(n++)];
    k = std::max<int64_t>(n, 1);
    total = kept > 0 ? kept : p[0];
  }
  double u = rng.uniform() * total;
  for (int64_t i = 0; i < k; ++i)
    if ((u -= p[i]) <= 0) return order[static_cast<size_t>(i)];
  return order[static_cast<size_t>(k - 1)];
}

void check_finite_logits(const std::vector<float>& logits, int64_t usable, int64_t position) {
  const int64_t n = std::min<int64_t>(usable, static_cast<int64_t>(logits.size()));
  const auto bad = std::find_if(logits.begin(), logits.begin() + n, [](float x) { return !std::isfinite(x); });
  if (bad == logits.begin() + n) return;
  const int64_t count = std::count_if(bad, logits.begin() + n, [](float x) { return !std::isfinite(x); });
  fail("generate: the model's logits after {} tokens are not finite ({} of {}, the first at id {}: {}); the "
       "checkpoint's weights overflow (eval reports the same as a non-finite loss), so nothing is sampled from them",
       position, count, n, bad - logits.begin(), *bad);
}

NextLogits decode_logits(Qwen35Model& model) {
  auto state = std::make_shared<Qwen35Model::DecodeState>();
  return [&model, state](const std::vector<int32_t>& ids) {
    DS_CHECK(static_cast<int64_t>(ids.size()) > state->length, "decode_logits: no new token after {}", state->length);
    return model.decode(*state, std::vector<int32_t>(ids.begin() + state->length, ids.end()));
  };
}

NextLogits prefix_logits(Engine& engine) {
  return [&engine](const std::vector<int32_t>& ids) {
    PackedBatch b;
    b.input_ids = ids;
    b.targets.assign(ids.size(), -100);
    b.cu_seqlens = {0, static_cast<int32_t>(ids.size())};
    b.finalize("generate");
    return engine.last_logits(b);
  };
}

std::vector<int32_t> generate_tokens(const NextLogits& next, const std::vector<int32_t>& prompt,
                                     const GenerateOptions& o,
                                     const std::function<void(const std::vector<int32_t>&)>& on_token) {
  DS_CHECK(!prompt.empty(), "generate: the prompt has no tokens");
  check_sampling(o.sampling);
  Rng rng(o.seed);
  std::vector<int32_t> ids = prompt, generated;
  for (int64_t n = 0; n < o.max_new_tokens; ++n) {
    const std::vector<float> logits = next(ids);
    check_finite_logits(logits, o.usable, static_cast<int64_t>(ids.size()));
    const int32_t id = sample_token(logits, o.usable, o.sampling, rng);
    if (std::find(o.stop_ids.begin(), o.stop_ids.end(), id) != o.stop_ids.end()) break;
    ids.push_back(id);
    generated.push_back(id);
    if (on_token) on_token(generated);
  }
  return generated;
}

}  // namespace ds
