// Generation (model/generate.h) on the CPU: the sampling rule, and the shared loop over its two logits sources (the
// CPU model's carried decode state and an engine's prefix recompute, Engine::last_logits) giving the same ids. The
// GPU engine's side is tests/test_cuda_generate.cpp.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/rng.h"
#include "model/engine.h"
#include "model/generate.h"
#include "model/model.h"
#include "test_util.h"

namespace {

using ds::test::error_of;

TEST(Generate, SampleTokenFollowsTheFlags) {
  //                              0     1     2     3     4    5
  const std::vector<float> l = {0.5f, 2.0f, -1.0f, 2.0f, 1.0f, 9.0f};
  ds::Rng rng(3);
  ds::SamplingOptions greedy{0.0, 50, 1.0};
  EXPECT_EQ(ds::sample_token(l, 6, greedy, rng), 5);
  EXPECT_EQ(ds::sample_token(l, 5, greedy, rng), 1) << "id 5 is outside the usable ids; ties: the lowest id";
  EXPECT_EQ(rng.counter(), 0u) << "greedy draws nothing";
  // top-k 1, or a vanishing top-p, keep only the most likely usable id at any temperature.
  for (int i = 0; i < 20; ++i) {
    EXPECT_EQ(ds::sample_token(l, 5, {5.0, 1, 1.0}, rng), 1);
    EXPECT_EQ(ds::sample_token(l, 6, {5.0, 0, 1e-9}, rng), 5);
  }
  // top-k 2 of the usable five: ids 1 and 3 (tied logits), equally likely; the others never.
  int n1 = 0, n3 = 0, other = 0;
  for (int i = 0; i < 4000; ++i) {
    const int32_t id = ds::sample_token(l, 5, {1.0, 2, 1.0}, rng);
    (id == 1 ? n1 : id == 3 ? n3 : other)++;
  }
  EXPECT_EQ(other, 0);
  EXPECT_NEAR(n1 / 4000.0, 0.5, 0.03);
  // Softmax at temperature T: logits {0, ln 3} give p1 = 3^(1/T) / (1 + 3^(1/T)): 0.75 at T = 1, 0.634 at T = 2.
  const std::vector<float> two = {0.0f, static_cast<float>(std::log(3.0))};
  for (double t : {1.0, 2.0}) {
    int ones = 0;
    for (int i = 0; i < 8000; ++i) ones += ds::sample_token(two, 2, {t, 0, 1.0}, rng) == 1;
    const double want = std::pow(3.0, 1 / t) / (1 + std::pow(3.0, 1 / t));
    EXPECT_NEAR(ones / 8000.0, want, 0.02) << "temperature " << t;
  }
  // top-p 0.7 of {0.75, 0.25}: only the first id's mass is needed.
  for (int i = 0; i < 50; ++i) EXPECT_EQ(ds::sample_token(two, 2, {1.0, 0, 0.7}, rng), 1);
  // The same seed draws the same ids.
  ds::Rng a(9), b(9);
  for (int i = 0; i < 50; ++i) EXPECT_EQ(ds::sample_token(l, 6, {3.0, 0, 0.9}, a), ds::sample_token(l, 6, {3.0, 0, 0.9}, b));
  // Bad values name their flag.
  EXPECT_NE(error_of([] { ds::check_sampling({-1.0, 0, 1.0}); }).find("--temperature must be finite and >= 0"),
            std::string::npos);
  EXPECT_NE(error_of([] { ds::check_sampling({NAN, 0, 1.0}); }).find("--temperature"), std::string::npos);
  EXPECT_NE(error_of([] { ds::check_sampling({1.0, -2, 1.0}); }).find("--top-k must be >= 0, got -2"), std::string::npos);
  EXPECT_NE(error_of([] { ds::check_sampling({1.0, 0, 0.0}); }).find("--top-p must be in (0, 1], got 0"),
            std::string::npos);
  EXPECT_NE(error_of([] { ds::check_sampling({1.0, 0, 1.5}); }).find("--top-p"), std::string::npos);
  EXPECT_NE(error_of([&] { ds::sample_token(l, 7, greedy, rng); }).find("7 usable ids of 6 logits"), std::string::npos);
}

// The HF fixture (both mixers, GQA, partial rotary) from a 10-token prompt: the CPU model's carried state and the CPU
// engine's prefix recompute give the same ids, greedy and sampled with one seed; the stop ids end the reply.
TEST(Generate, DecodeStateAndPrefixRecomputeGiveTheSameIds) {
  const std::string fx = ds::test::fixture("hf_qwen35_tiny_a");
  ds::Qwen35Model model(ds::ModelConfig::from_file(fx));
  model.load(fx);
  ds::Qwen35Model again(ds::ModelConfig::from_file(fx));
  again.load(fx);
  std::unique_ptr<ds::Engine> engine = ds::make_engine("cpu", std::move(again), ds::GpuPlan::forward_windows(1, 18, 1));
  const std::vector<int32_t> prompt = {45, 20, 43, 16, 50, 16, 41, 22, 41, 24};  // "N5L1S1J7J9", bundled tokenizer
  ds::GenerateOptions o;
  o.max_new_tokens = 8;
  o.usable = 256;
  for (const ds::SamplingOptions s : {ds::SamplingOptions{0.0, 0, 1.0}, ds::SamplingOptions{1.0, 20, 0.9}}) {
    o.sampling = s;
    o.seed = 77;
    std::vector<std::vector<int32_t>> seen;
    const std::vector<int32_t> fast = ds::generate_tokens(ds::decode_logits(model), prompt, o,
                                                          [&](const std::vector<int32_t>& g) { seen.push_back(g); });
    const std::vector<int32_t> full = ds::generate_tokens(ds::prefix_logits(*engine), prompt, o);
    ASSERT_EQ(fast.size(), 8u);
    EXPECT_EQ(fast, full) << "temperature " << s.temperature;
    ASSERT_EQ(seen.size(), 8u);
    for (size_t i = 0; i < seen.size(); ++i) EXPECT_EQ(seen[i], std::vector<int32_t>(fast.begin(), fast.begin() + i + 1));
    // A stop id: the ids before its first appearance come back, the stop id does not.
    size_t at = 1;
    while (at < fast.size() && std::find(fast.begin(), fast.begin() + at, fast[at]) != fast.begin() + at) ++at;
    ASSERT_LT(at, fast.size()) << "a reply of one id repeated";
    ds::GenerateOptions stop = o;
    stop.stop_ids = {-1, fast[at]};
    EXPECT_EQ(ds::generate_tokens(ds::prefix_logits(*engine), prompt, stop),
              std::vector<int32_t>(fast.begin(), fast.begin() + static_cast<std::ptrdiff_t>(at)));
  }
  o.max_new_tokens = 0;
  EXPECT_TRUE(ds::generate_tokens(ds::decode_logits(model), prompt, o).empty());
  EXPECT_NE(error_of([&] { ds::generate_tokens(ds::prefix_logits(*engine), {}, o); }).find("the prompt has no tokens"),
            std::string::npos);
  ds::PackedBatch empty;  // no token (finalize refuses it too)
  EXPECT_NE(error_of([&] { engine->last_logits(empty); }).find("an empty batch"), std::string::npos);
}

// Issue 25 item 7: logits that are not finite (weights that overflow) stop the loop with an error naming the step,
// after the ids of the finite steps were streamed; no id is sampled from them (greedy would pick the first NaN).
TEST(Generate, NonFiniteLogitsAreAnError) {
  for (const float bad : {NAN, INFINITY, -INFINITY}) {
    int calls = 0;
    const ds::NextLogits next = [&](const std::vector<int32_t>&) {
      std::vector<float> l = {0.0f, 1.0f, 5.0f, 2.0f};
      if (++calls == 3) l[1] = bad;
      return l;
    };
    ds::GenerateOptions o;
    o.sampling = {0.0, 0, 1.0};
    o.max_new_tokens = 5;
    o.usable = 4;
    std::vector<std::vector<int32_t>> seen;
    const std::string err = error_of([&] {
      ds::generate_tokens(next, {7, 8}, o, [&](const std::vector<int32_t>& g) { seen.push_back(g); });
    });
    EXPECT_NE(err.find("the model's logits after 4 tokens are not finite (1 of 4, the first at id 1: "),
              std::string::npos) << err;
    EXPECT_EQ(seen, (std::vector<std::vector<int32_t>>{{2}, {2, 2}})) << "the two finite steps were streamed";
    EXPECT_EQ(calls, 3);
  }
  // Only the sampled ids count: a NaN past `usable` (ids the tokenizer lacks) is never drawn.
  ds::GenerateOptions o;
  o.sampling = {1.0, 0, 1.0};
  o.max_new_tokens = 3;
  o.usable = 2;
  const ds::NextLogits tail_nan = [](const std::vector<int32_t>&) { return std::vector<float>{0.0f, 1.0f, NAN}; };
  EXPECT_EQ(ds::generate_tokens(tail_nan, {1}, o).size(), 3u);
}

}  // namespace
