// Qwen35Model's weight sources: init_weights / load against the deferred forms (defer_init / defer_load) that the
// GPU engine uploads from one parameter at a time.
#include <gtest/gtest.h>

#include <algorithm>
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

}  // namespace
