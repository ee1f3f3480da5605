// The packed batch (data/batch.h) is checked against plain limits, and a model hands its own (model/model.h
// batch_limits): the data layer needs no model type for it (docs/architecture.md, tests/test_layering.cpp).
#include <gtest/gtest.h>

#include <string>

#include "data/batch.h"
#include "model/config.h"
#include "model/model.h"
#include "test_util.h"

namespace {

using ds::test::error_of;

// Two documents of two tokens each, positions set.
ds::PackedBatch two_documents() {
  ds::PackedBatch b;
  b.input_ids = {0, 1, 2, 3};
  b.targets = {1, -100, 2, -100};
  b.cu_seqlens = {0, 2, 4};
  b.finalize("test batch");
  return b;
}

TEST(BatchLimits, AModelsLimitsAreItsConfigsVocabularyAndContext) {
  ds::ModelConfig c = ds::ModelConfig::preset("tiny");
  c.vocab_size = 1234;
  c.max_position_embeddings = 77;
  const ds::BatchLimits l = ds::batch_limits(c);
  EXPECT_EQ(l.vocab_size, 1234);
  EXPECT_EQ(l.max_position_embeddings, 77);
}

TEST(BatchLimits, CheckAcceptsABatchInsideThemAndNamesThePositionOutside) {
  const ds::PackedBatch b = two_documents();
  EXPECT_EQ(b.positions, (std::vector<int32_t>{0, 1, 0, 1}));
  EXPECT_EQ(b.num_targets(), 2);
  EXPECT_EQ(error_of([&] { b.check({.vocab_size = 4, .max_position_embeddings = 2}); }), "(no error)");

  const std::string id = error_of([&] { b.check({.vocab_size = 3, .max_position_embeddings = 2}); });
  EXPECT_NE(id.find("token id 3 at position 3"), std::string::npos) << id;

  ds::PackedBatch t = two_documents();
  t.targets[0] = 9;
  const std::string target = error_of([&] { t.check({.vocab_size = 4, .max_position_embeddings = 2}); });
  EXPECT_NE(target.find("target 9 at position 0"), std::string::npos) << target;

  const std::string longer = error_of([&] { b.check({.vocab_size = 4, .max_position_embeddings = 1}); });
  EXPECT_NE(longer.find("max_position_embeddings (1)"), std::string::npos) << longer;
}

}  // namespace
