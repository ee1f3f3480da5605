// Qwen35Model's weight sources: init_weights / load against the deferred forms (defer_init / defer_load) that the
// GPU engine uploads from one parameter at a time.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "core/error.h"
#include "model/config.h"
#include "model/model.h"
#include "test_util.h"

namespace {

// A deferred model (Qwen35Model::Deferred) produces exactly init_weights' / load's values, per parameter, also
// after a move (the GPU engine takes them while uploading; the CPU engine materializes them).
TEST(DeferredWeights, SameValuesAsInitAndLoad) {
  ds::ModelConfig c = ds::ModelConfig::preset("tiny");
  c.vocab_size = 1024;
  ds::Qwen35Model eager(c);
  eager.init_weights(77);
  ds::Qwen35Model lazy(c, ds::Qwen35Model::Deferred{});
  lazy.defer_init(77);
  EXPECT_TRUE(lazy.deferred());
  EXPECT_TRUE(lazy.weights().empty());  // nothing on the host yet
  ds::Qwen35Model moved = std::move(lazy);
  for (size_t k : {size_t{0}, size_t{3}, moved.params().size() - 1}) {
    const ds::ParamSpec& p = moved.params()[k];
    std::vector<float> v(static_cast<size_t>(p.numel));
    moved.fill_param(k, v.data());
    EXPECT_TRUE(std::equal(v.begin(), v.end(), eager.weights().begin() + p.offset)) << p.name;
  }
  moved.materialize();
  EXPECT_FALSE(moved.deferred());
  EXPECT_TRUE(moved.weights() == eager.weights());

  const std::string fx = ds::test::fixture("hf_qwen35_tiny_a");
  ds::Qwen35Model loaded(ds::ModelConfig::from_file(fx));
  loaded.load(fx);
  ds::Qwen35Model later(ds::ModelConfig::from_file(fx), ds::Qwen35Model::Deferred{});
  later.defer_load(fx);
  later.materialize();
  EXPECT_TRUE(later.weights() == loaded.weights());
  ds::Qwen35Model missing(c, ds::Qwen35Model::Deferred{});
  EXPECT_THROW(missing.defer_load(fx + "/nowhere"), ds::Error);  // checked when opened, not when read
}

// Generation's carried state (Qwen35Model::decode) against the whole sequence recomputed (last_logits): the same
// logits after the prompt and after every appended token, on a model with both mixers, GQA and a partial rotary
// dimension (the HF fixture's config) and on the tiny preset.
void expect_decode_matches(ds::Qwen35Model& m, std::vector<int32_t> ids, int steps) {
  ds::Qwen35Model::DecodeState st;
  std::vector<int32_t> feed = ids;
  for (int n = 0; n <= steps; ++n) {
    const std::vector<float> fast = m.decode(st, feed);
    ds::PackedBatch b;
    b.input_ids = ids;
    b.targets.assign(ids.size(), -100);
    b.cu_seqlens = {0, static_cast<int32_t>(ids.size())};
    b.finalize("test");
    const std::vector<float> full = m.last_logits(b);
    double num = 0, den = 0;
    for (size_t v = 0; v < full.size(); ++v) {
      num += (fast[v] - full[v]) * static_cast<double>(fast[v] - full[v]);
      den += static_cast<double>(full[v]) * full[v];
    }
    ASSERT_LE(std::sqrt(num / den), 2e-6) << "after " << ids.size() << " tokens";
    EXPECT_EQ(st.length, static_cast<int64_t>(ids.size()));
    const int32_t next = static_cast<int32_t>(std::max_element(full.begin(), full.end()) - full.begin());
    ids.push_back(next);
    feed = {next};
  }
}

TEST(Decode, CarriedStateMatchesTheWholeSequence) {
  const std::string fx = ds::test::fixture("hf_qwen35_tiny_a");
  ds::Qwen35Model hf(ds::ModelConfig::from_file(fx));
  hf.load(fx);
  expect_decode_matches(hf, {5, 17, 3, 99, 42, 7, 1, 250, 64}, 12);  // a 9-token prompt, then 12 tokens
  ds::ModelConfig c = ds::ModelConfig::preset("tiny");
  c.vocab_size = 2048;
  ds::Qwen35Model tiny(c);
  tiny.init_weights(3);
  expect_decode_matches(tiny, {11}, 66);  // past the GDN chunk size (64) one token at a time
  ds::Qwen35Model::DecodeState st;
  EXPECT_THROW(tiny.decode(st, {}), ds::Error);
  EXPECT_THROW(tiny.decode(st, {static_cast<int32_t>(c.vocab_size)}), ds::Error);
}

}  // namespace
