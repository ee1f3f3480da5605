// --gradients bf16 (model/engine.h Gradients::Bf16; docs/memory.md): one bf16 gradient buffer, each micro-batch's
// fp32 gradients added into it with stochastic rounding keyed by (step, micro-batch, flat index)
// (ops/adamw/bf16_state.h accumulate_grad). Here on the CPU: the rounding itself (one of the two bf16 neighbours of
// the fp32 sum, unbiased against a float64 reference, deterministic per key), the CPU engine's emulation (one
// micro-batch: the fp32 mode's AdamW step applied to SR(gradient); two micro-batches: SR(SR(g1) + g2), bitwise run to
// run), and the trainer's path (repeatable, resumed bitwise, close to the fp32 run, refused where it cannot run).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "core/bf16.h"
#include "core/error.h"
#include "core/rng.h"
#include "model/engine.h"
#include "model/model.h"
#include "ops/adamw/adamw.h"
#include "ops/adamw/bf16_state.h"
#include "train_test_util.h"

namespace {

namespace fs = std::filesystem;
namespace S = ds::ops::bf16_state;
using ds::test::metrics;
using ds::test::run;
using ds::test::tensor_values;
using ds::test::train_losses;

// The bf16 values either side of fp32 x (x itself twice when it is a bf16 value).
std::pair<float, float> bf16_neighbours(float x) {
  const uint32_t u = S::f32_bits(x);
  const float down = S::widen(static_cast<uint16_t>(u >> 16));
  if ((u & 0xffffu) == 0) return {down, down};
  return {down, S::widen(static_cast<uint16_t>((u >> 16) + 1))};
}

TEST(Bf16Gradients, AccumulationRoundsTheSumToANeighbourWithoutBias) {
  const int64_t n = 200000;
  ds::Rng rng(5);
  std::vector<uint16_t> acc(n);
  std::vector<float> g(n);
  for (int64_t i = 0; i < n; ++i) {
    acc[i] = ds::f32_to_bf16_bits(static_cast<float>(1e-2 * rng.normal()));
    g[i] = static_cast<float>(1e-3 * rng.normal());
  }
  std::vector<uint16_t> out = acc;
  const uint64_t key = S::grad_key(7, 1);
  ds::ops::accumulate_grad_bf16(out.data(), g.data(), n, key, 1000);
  double mean_err = 0;  // in bf16 steps of each element, against the float64 sum
  int64_t ups = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float x = S::widen(acc[i]) + g[i];  // the fp32 sum the rounding takes
    const auto [down, up] = bf16_neighbours(x);
    const float y = S::widen(out[i]);
    ASSERT_TRUE(y == down || y == up) << i;
    ups += y != down;
    const double exact = static_cast<double>(S::widen(acc[i])) + static_cast<double>(g[i]);
    const double spacing = std::ldexp(1.0, std::ilogb(exact) - 7);
    mean_err += (static_cast<double>(y) - exact) / spacing / static_cast<double>(n);
  }
  EXPECT_GT(ups, n / 10);  // both neighbours are taken
  EXPECT_LT(std::abs(mean_err), 5e-3);  // about 0.3 / sqrt(n) = 7e-4 from rounding noise
  // The same element and key: the same bits; the element's flat index and the key select them.
  std::vector<uint16_t> again = acc, shifted = acc, other = acc;
  ds::ops::accumulate_grad_bf16(again.data(), g.data(), n, key, 1000);
  ds::ops::accumulate_grad_bf16(shifted.data(), g.data(), n, key, 1001);
  ds::ops::accumulate_grad_bf16(other.data(), g.data(), n, S::grad_key(7, 2), 1000);
  EXPECT_EQ(again, out);
  EXPECT_NE(shifted, out);
  EXPECT_NE(other, out);
  EXPECT_NE(S::grad_key(7, 0), S::grad_key(8, 0));
  EXPECT_NE(S::grad_key(7, 0), S::step_key(S::kSeed, 7));  // not the weight update's stream

  // A gradient far below half a bf16 step of the accumulator: round-to-nearest drops it in every element, the
  // stochastic rounding keeps it in the mean (1 + 1e-3: up to 1 + 2^-7 with probability 0.128).
  std::vector<uint16_t> one(n, ds::f32_to_bf16_bits(1.0f));
  std::vector<float> small(n, 1e-3f);
  ds::ops::accumulate_grad_bf16(one.data(), small.data(), n, key, 0);
  double mean = 0;
  for (uint16_t b : one) mean += S::widen(b) / static_cast<double>(n);
  EXPECT_NEAR(mean, 1.001, 3e-5);  // standard error 2^-7 sqrt(0.128 * 0.872 / n) = 6e-6

  // The first micro-batch adds onto zero: SR(g).
  std::vector<uint16_t> zero(n, 0);
  ds::ops::accumulate_grad_bf16(zero.data(), g.data(), n, key, 0);
  for (int64_t i = 0; i < n; i += 997)
    EXPECT_EQ(zero[i], S::round_stochastic(g[i], static_cast<uint32_t>(S::element_bits(key, i)))) << i;
}

// A batch of documents of `lens` tokens (targets: the next token in the document).
ds::PackedBatch make_batch(const std::vector<int>& lens, int64_t vocab, uint64_t seed) {
  ds::Rng rng(seed);
  ds::PackedBatch b;
  b.cu_seqlens.push_back(0);
  for (int len : lens) {
    const size_t first = b.input_ids.size();
    for (int t = 0; t < len; ++t) b.input_ids.push_back(static_cast<int32_t>(rng.below(static_cast<uint64_t>(vocab))));
    for (int t = 0; t < len; ++t) b.targets.push_back(t + 1 < len ? b.input_ids[first + t + 1] : -100);
    b.cu_seqlens.push_back(static_cast<int32_t>(b.input_ids.size()));
  }
  b.finalize("test batch");
  return b;
}

struct TinyRun {
  ds::Qwen35Model host{ds::ModelConfig::preset("tiny")};
  ds::PackedBatch b1, b2;
  TinyRun() {
    host.init_weights(21);
    b1 = make_batch({40, 25}, host.config().vocab_size, 1);
    b2 = make_batch({50, 12}, host.config().vocab_size, 2);
  }
  std::unique_ptr<ds::Engine> engine(ds::Gradients g) {
    ds::GpuPlan plan = ds::GpuPlan::windows(1, 128, 2);
    plan.gradients = g;
    return ds::make_engine("cpu", host, plan);
  }
  // One micro-batch's fp32 gradients, flat (the fp32 mode's engine).
  std::vector<float> grads_of(const ds::PackedBatch& b) {
    auto e = engine(ds::Gradients::Fp32);
    e->zero_grads();
    e->forward_backward(b, 1.0 / static_cast<double>(b.num_targets()));
    return tensor_values(e->grad_tensors());
  }
};

// What the bf16 buffer holds after `gs` (micro-batches 0, 1, ... of `step`), widened.
std::vector<float> emulate(const std::vector<std::vector<float>>& gs, int64_t step) {
  std::vector<uint16_t> acc(gs[0].size(), 0);
  for (size_t a = 0; a < gs.size(); ++a)
    ds::ops::accumulate_grad_bf16(acc.data(), gs[a].data(), static_cast<int64_t>(acc.size()),
                                  S::grad_key(step, static_cast<int64_t>(a)), 0);
  std::vector<float> out(acc.size());
  for (size_t i = 0; i < acc.size(); ++i) out[i] = S::widen(acc[i]);
  return out;
}

TEST(Bf16Gradients, OneMicroBatchIsTheFp32StepOnRoundedGradients) {
  TinyRun s;
  const std::vector<float> g = s.grads_of(s.b1), want = emulate({g}, 3);
  EXPECT_NE(want, g);  // the rounding changed some of them
  auto e = s.engine(ds::Gradients::Bf16);
  EXPECT_EQ(e->gradients(), ds::Gradients::Bf16);
  const std::vector<float> w0 = tensor_values(e->weight_tensors());
  e->begin_step(3);
  e->zero_grads();
  e->forward_backward(s.b1, 1.0 / static_cast<double>(s.b1.num_targets()));
  const std::vector<float> got = tensor_values(e->grad_tensors());
  ASSERT_EQ(got.size(), want.size());
  EXPECT_TRUE(got == want);
  EXPECT_EQ(e->grad_sum_squares(), ds::ops::sum_squares(want.data(), static_cast<int64_t>(want.size())));
  // The update: the fp32 mode's AdamW (decay per ParamSpec) over the rounded gradients.
  ds::ops::AdamWParams ap;
  ap.lr = 1e-2;
  ap.weight_decay = 0.1;
  ap.step = 1;
  ap.grad_scale = 0.5;
  e->optimizer_step(ap);
  std::vector<float> w = w0, m(w0.size(), 0.0f), v(w0.size(), 0.0f);
  for (const ds::ParamSpec& p : e->params()) {
    ds::ops::AdamWParams q = ap;
    q.weight_decay = p.weight_decay ? ap.weight_decay : 0.0;
    ds::ops::adamw_update(w.data() + p.offset, want.data() + p.offset, m.data() + p.offset, v.data() + p.offset,
                          p.numel, q);
  }
  const std::vector<float> w1 = tensor_values(e->weight_tensors());
  EXPECT_NE(w1, w0);
  EXPECT_TRUE(w1 == w);
}

TEST(Bf16Gradients, TwoMicroBatchesAccumulateDeterministically) {
  TinyRun s;
  const std::vector<float> g1 = s.grads_of(s.b1), g2 = s.grads_of(s.b2);
  auto accumulate = [&](int64_t step) {
    auto e = s.engine(ds::Gradients::Bf16);
    std::vector<float> out;
    for (int rep = 0; rep < 2; ++rep) {  // twice in one engine: zero_grads restarts the micro-batch count
      e->begin_step(step);
      e->zero_grads();
      e->forward_backward(s.b1, 1.0 / static_cast<double>(s.b1.num_targets()));
      e->forward_backward(s.b2, 0.0);  // an evaluation between micro-batches counts no micro-batch
      e->forward_backward(s.b2, 1.0 / static_cast<double>(s.b2.num_targets()));
      const std::vector<float> g = tensor_values(e->grad_tensors());
      if (rep == 1) {
        EXPECT_TRUE(g == out);
      }
      out = g;
    }
    return out;
  };
  const std::vector<float> a = accumulate(5), b = accumulate(5), c = accumulate(6);
  EXPECT_TRUE(a == b);  // run to run
  EXPECT_TRUE(a == emulate({g1, g2}, 5));
  EXPECT_NE(a, c);  // another step, other random bits
  // Within a bf16 step or two of the fp32 sum.
  double err = 0, norm = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double exact = static_cast<double>(g1[i]) + g2[i];
    err += (a[i] - exact) * (a[i] - exact);
    norm += exact * exact;
  }
  EXPECT_LT(std::sqrt(err / norm), 1e-2);
  EXPECT_GT(err, 0.0);
}

// The trainer: --gradients bf16 with --grad-accum 2 repeats bitwise, resumes bitwise (the key is the step), stays
// close to the fp32 gradients' run, is saved in the checkpoint, and is refused with --shard.
TEST(Bf16Gradients, TrainerRunRepeatsAndResumesBitwise) {
  const std::string dir = ds::test::fresh_tmpdir("bf16grad");
  const std::string args = ds::test::small_setup(dir) + " --steps 4 --warmup 1 --threads 1 --grad-accum 2 "
                           "--save-interval 2";
  ASSERT_EQ(run("train " + args + " --out " + dir + "/f"), 0);
  ASSERT_EQ(run("train " + args + " --gradients bf16 --out " + dir + "/a"), 0);
  ASSERT_EQ(run("train " + args + " --gradients bf16 --out " + dir + "/b"), 0);
  const auto lf = train_losses(dir + "/f/metrics.jsonl"), la = train_losses(dir + "/a/metrics.jsonl"),
             lb = train_losses(dir + "/b/metrics.jsonl");
  ASSERT_EQ(la.size(), 4u);
  EXPECT_EQ(la, lb);
  EXPECT_EQ(la[0], lf[0]);  // the first forward is before any update
  bool differs = false;
  for (size_t i = 1; i < la.size(); ++i) {
    differs |= la[i] != lf[i];
    EXPECT_LT(std::abs(la[i] - lf[i]) / lf[i], 1e-2) << "step " << i + 1;
  }
  EXPECT_TRUE(differs);
  EXPECT_EQ(ds::read_file(dir + "/a/checkpoint-4/model.safetensors"), ds::read_file(dir + "/b/checkpoint-4/model.safetensors"));
  const nlohmann::json st = nlohmann::json::parse(ds::read_file(dir + "/a/checkpoint-2/trainer_state.json"));
  EXPECT_EQ(st["options"]["gradients"], "bf16");
  ASSERT_EQ(run("train --resume " + dir + "/a/checkpoint-2 --steps 4 --threads 1 --out " + dir + "/c"), 0);
  const auto lc = train_losses(dir + "/c/metrics.jsonl");
  ASSERT_EQ(lc.size(), 2u);
  EXPECT_EQ(lc[0], la[2]);
  EXPECT_EQ(lc[1], la[3]);
  EXPECT_EQ(ds::read_file(dir + "/a/checkpoint-4/model.safetensors"), ds::read_file(dir + "/c/checkpoint-4/model.safetensors"));
  // A resume may change the mode: the fp32 run's checkpoint continued with bf16 gradients.
  ASSERT_EQ(run("train --resume " + dir + "/f/checkpoint-2 --steps 4 --threads 1 --gradients bf16 --out " + dir + "/d"),
            0);
  EXPECT_EQ(train_losses(dir + "/d/metrics.jsonl").size(), 2u);
  std::string log;
  EXPECT_NE(run("train " + args + " --gradients bf16 --shard optimizer --out " + dir + "/e", &log), 0);
  EXPECT_NE(log.find("--gradients bf16 keeps no fp32 gradient buffer to shard"), std::string::npos) << log;
  fs::remove_all(dir);
}

}  // namespace
