// Qwen35Model's weight sources: init_weights / load against the deferred forms (defer_init / defer_load) that the
// GPU engine uploads from one parameter at a time; a UnitSource (the CPU engine's --shard full) against weights().
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

// A UnitSource that hands out copies of each unit (other addresses than weights(): the rebased views are tested)
// and sums the gradients handed back; it records the order of the acquires and the most units held at once.
struct CopyingSource final : ds::UnitSource {
  const std::vector<float>& w;
  const std::vector<ds::ParamUnit>& units;
  std::vector<float> sum;  // the gradients handed back, summed (flat)
  std::vector<std::vector<float>> held;  // per unit: its copy while acquired
  std::vector<int64_t> order;
  int open = 0, most = 0, grads_open = -1;
  std::vector<float> gbuf;
  CopyingSource(const std::vector<float>& weights, const std::vector<ds::ParamUnit>& u)
      : w(weights), units(u), sum(weights.size(), 0.0f), held(u.size()) {}
  float* acquire(int64_t u) override {
    const ds::ParamUnit& pu = units[static_cast<size_t>(u)];
    EXPECT_TRUE(held[static_cast<size_t>(u)].empty()) << "unit " << u << " acquired twice";
    held[static_cast<size_t>(u)].assign(w.begin() + pu.lo, w.begin() + pu.hi);
    order.push_back(u);
    most = std::max(most, ++open);
    return held[static_cast<size_t>(u)].data();
  }
  void release(int64_t u) override {
    EXPECT_FALSE(held[static_cast<size_t>(u)].empty()) << "unit " << u << " released but not held";
    held[static_cast<size_t>(u)].clear();
    --open;
  }
  float* grads(int64_t u) override {
    EXPECT_EQ(grads_open, -1) << "two units' gradients at once";
    grads_open = static_cast<int>(u);
    gbuf.assign(static_cast<size_t>(units[static_cast<size_t>(u)].size()), 0.0f);
    return gbuf.data();
  }
  void grads_done(int64_t u) override {
    EXPECT_EQ(grads_open, u);
    grads_open = -1;
    for (size_t i = 0; i < gbuf.size(); ++i) sum[static_cast<size_t>(units[static_cast<size_t>(u)].lo) + i] += gbuf[i];
  }
};

// The model reading its weights unit by unit from a source (model.h: UnitSource) computes the same loss and
// gradients, bitwise, as from weights(), with tied and untied embeddings; it acquires the units in unit_order()
// and holds at most two at once (the head and the tied embedding).
TEST(UnitSource, SameLossAndGradientsAsTheFlatWeights) {
  for (bool tie : {true, false}) {
    ds::ModelConfig c = ds::ModelConfig::preset("tiny");
    c.vocab_size = 512;
    c.tie_word_embeddings = tie;
    ds::Qwen35Model m(c);
    m.init_weights(5);
    const std::vector<ds::ParamUnit>& units = m.units();
    ASSERT_EQ(units.size(), static_cast<size_t>(c.num_hidden_layers + 2));
    EXPECT_EQ(units.front().lo, 0);
    EXPECT_EQ(units.back().hi, m.num_parameters());
    for (size_t u = 1; u < units.size(); ++u) EXPECT_EQ(units[u].lo, units[u - 1].hi);
    EXPECT_EQ(units[1].lo, m.spec("model.layers.0.input_layernorm.weight").offset);
    EXPECT_EQ(units.back().lo, m.spec("model.norm.weight").offset);
    ds::PackedBatch b;
    for (int t = 0; t < 40; ++t) b.input_ids.push_back((t * 37 + 11) % 512), b.targets.push_back(t % 7 ? (t * 13) % 512 : -100);
    b.cu_seqlens = {0, 17, 40};
    b.finalize("test");
    m.zero_grads();
    const ds::LossResult ref = m.forward_backward(b, 0.25, 1e-4);
    const std::vector<float> ref_grads = m.grads();
    const std::vector<float> w = m.weights();
    CopyingSource src(w, units);
    m.set_unit_source(&src);
    const ds::LossResult got = m.forward_backward(b, 0.25, 1e-4);
    EXPECT_EQ(got.loss_sum, ref.loss_sum) << "tie " << tie;
    EXPECT_EQ(got.num_valid, ref.num_valid);
    EXPECT_TRUE(src.sum == ref_grads) << "tie " << tie;
    EXPECT_EQ(src.order, m.unit_order(true)) << "tie " << tie;
    EXPECT_EQ(src.most, tie ? 2 : 1);
    EXPECT_EQ(src.open, 0);
    src.order.clear();
    EXPECT_EQ(m.forward_backward(b, 0.0).loss_sum, m.forward_backward(b, 0.0).loss_sum);
    EXPECT_EQ(src.order.size(), 2 * m.unit_order(false).size());
    EXPECT_TRUE(std::equal(src.order.begin(), src.order.begin() + static_cast<long>(m.unit_order(false).size()),
                           m.unit_order(false).begin()));
    EXPECT_THROW(m.last_logits(b), ds::Error);  // generation reads weights() only
    m.set_unit_source(nullptr);
  }
}

}  // namespace
