// GPU engine (GpuModel) against the fp32 CPU engine (Qwen35Model) on the same weights and packed batches: the
// loss within the bf16 band and the whole gradient within 5e-2 relative L2 (the HF fixture's GPU gradients are
// 7e-3 .. 4e-2, docs/gpu.md). Two batches exercise both attention paths of the engine: a few documents (cuDNN's
// fused SDPA where it loads) and 64 four-token documents (more than cuDNN's first length bucket holds, so the
// engine runs the simple kernel for that batch). A third uses GDN head dim 128, so the GDN layers run the chunked
// kernel's plan. A second forward_backward of the same batch is bitwise equal. The step profiler's scopes
// (`bench step --profile`) change no result.
#ifdef DELTASTACK_CUDA

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include <cuda_runtime.h>

#include "core/bf16.h"
#include "core/cuda/cuda_utils.h"
#include "core/cuda/profile.h"
#include "core/error.h"
#include "core/profile.h"
#include "core/rng.h"
#include "cuda_test_util.h"
#include "model/config.h"
#include "model/gpu_model.h"
#include "model/model.h"
#include "ops/adamw/adamw.h"
#include "ops/adamw/bf16_state.h"
#include "ops/adamw/q8_state.h"
#include "test_util.h"
#include "train/checkpoint.h"
#include "train_test_util.h"

namespace {

using ds::test::rel_l2;

ds::PackedBatch make_batch(const std::vector<int>& lens, int64_t vocab, uint64_t seed) {
  ds::PackedBatch b;
  ds::Rng rng(seed);
  b.cu_seqlens.push_back(0);
  for (int len : lens) {
    for (int t = 0; t < len; ++t) b.input_ids.push_back(static_cast<int32_t>(rng.below(static_cast<uint64_t>(vocab))));
    for (int t = 0; t < len; ++t)
      b.targets.push_back(t + 1 < len ? b.input_ids[b.input_ids.size() - static_cast<size_t>(len - t - 1)] : -100);
    b.cu_seqlens.push_back(b.cu_seqlens.back() + len);
  }
  b.finalize("test batch");
  return b;
}

// The tiny preset with a 4096-token vocabulary and GDN head dim 128 (the chunked kernel), initialised with `seed`.
ds::Qwen35Model tiny_chunked_host(uint64_t seed) {
  ds::ModelConfig c = ds::ModelConfig::preset("tiny");
  c.vocab_size = 4096;
  c.linear_key_head_dim = c.linear_value_head_dim = 128;
  ds::Qwen35Model host(c);
  host.init_weights(seed);
  return host;
}

// gdn_head_dim 128 makes the engine's GDN layers run the chunked tensor-core kernel (cuda-chunked takes head dim
// 128 only); the tiny preset's 16 runs the simple kernel.
void check_engine(const std::vector<int>& lens, int64_t gdn_head_dim = 0, int64_t plan_slack = 0) {
  ds::ModelConfig c = ds::ModelConfig::preset("tiny");
  c.vocab_size = 4096;  // the CPU reference's LM head stays cheap
  if (gdn_head_dim) c.linear_key_head_dim = c.linear_value_head_dim = gdn_head_dim;
  ds::Qwen35Model cpu(c);
  cpu.init_weights(11);
  const uint64_t seed = 20 + lens.size();  // fixed: the same batch on every run
  SCOPED_TRACE("seed " + std::to_string(seed));
  const ds::PackedBatch b = make_batch(lens, c.vocab_size, seed);
  const double scale = 1.0 / static_cast<double>(b.num_targets());

  cpu.zero_grads();
  const ds::LossResult ref = cpu.forward_backward(b, scale);
  const std::vector<float> g_ref = cpu.grads();

  ds::GpuPlan plan;
  plan.max_tokens = b.size() + plan_slack;  // the trainer's plan is sized for its largest micro-batch
  plan.max_seqs = static_cast<int64_t>(lens.size()) + plan_slack / 100;
  ds::GpuModel gpu(cpu, plan);
  const ds::LossResult r1 = gpu.forward_backward(b, scale);
  std::vector<float> g1, g2;
  gpu.download_grads(g1);
  gpu.zero_grads();
  const ds::LossResult r2 = gpu.forward_backward(b, scale);
  gpu.download_grads(g2);

  EXPECT_LE(std::abs(r1.loss_sum - ref.loss_sum) / ref.loss_sum, 1e-2);
  EXPECT_EQ(r1.num_valid, ref.num_valid);
  EXPECT_LE(rel_l2(g1, g_ref), 5e-2);
  EXPECT_EQ(r1.loss_sum, r2.loss_sum);
  EXPECT_TRUE(g1 == g2);
}

TEST(CudaEngine, FewDocumentsMatchesCpu) {
  DS_SKIP_WITHOUT_GPU();
  check_engine({100, 1, 155});
}
TEST(CudaEngine, ManyShortDocumentsMatchesCpu) {
  DS_SKIP_WITHOUT_GPU();
  check_engine(std::vector<int>(64, 4));
}
TEST(CudaEngine, ChunkedGatedDeltaRuleMatchesCpu) {
  DS_SKIP_WITHOUT_GPU();
  check_engine({100, 1, 155, 39}, 128);
  check_engine({100, 1, 155, 39}, 128, 300);  // a plan larger than the batch
}

// --offload-activations (GpuPlan::offload_activations): with full recompute the layer inputs go to pinned host memory
// during the forward and come back before each layer's backward, through a ring of three device buffers. Eight
// layers, so that five of them are fetched back (the ring still holds the last three): bitwise the losses and
// gradients of full recompute without it, with no kept layer and with two, over two steps of different lengths (the
// second shorter than the plan's tokens) and an evaluation of a third batch between them on one engine (the ring
// and the host copies reused, a forward-only pass in between); its device plan is five layer inputs smaller.
TEST(CudaEngine, OffloadedLayerInputsAreBitwiseFullRecompute) {
  DS_SKIP_WITHOUT_GPU();
  ds::ModelConfig c = ds::ModelConfig::preset("tiny");
  c.vocab_size = 4096;
  c.linear_key_head_dim = c.linear_value_head_dim = 128;
  c.num_hidden_layers = 8;
  c.layer_types.clear();
  for (int64_t i = 0; i < c.num_hidden_layers; ++i)
    c.layer_types.push_back(i % 4 == 3 ? "full_attention" : "linear_attention");
  ds::Qwen35Model host(c);
  host.init_weights(13);
  const ds::PackedBatch b1 = make_batch({100, 1, 155, 39}, c.vocab_size, 31),
                        b2 = make_batch({7, 200}, c.vocab_size, 32), b3 = make_batch({50, 120, 3}, c.vocab_size, 33);
  const int64_t N = b1.size();
  ASSERT_LT(b2.size(), N);
  struct Run {
    std::vector<double> losses;
    std::vector<float> grads1, grads2;
    size_t bytes;
  };
  auto run = [&](bool offload, int64_t kept, int64_t mlp_layers = 0) {
    ds::GpuPlan plan;
    plan.max_tokens = N;
    plan.max_seqs = 4;
    plan.recompute = ds::Recompute::Full;
    plan.kept_layers = kept;
    plan.mlp_layers = mlp_layers;
    plan.offload_activations = offload;
    ds::GpuModel gpu(host, plan);
    Run r;
    r.bytes = gpu.planned_bytes();
    r.losses.push_back(gpu.forward_backward(b1, 1.0 / static_cast<double>(b1.num_targets())).loss_sum);
    gpu.download_grads(r.grads1);
    r.losses.push_back(gpu.forward_backward(b3, 0.0).loss_sum);  // a forward only, between the backwards
    gpu.zero_grads();
    r.losses.push_back(gpu.forward_backward(b2, 1.0 / static_cast<double>(b2.num_targets())).loss_sum);
    gpu.download_grads(r.grads2);
    return r;
  };
  for (const int64_t kept : {int64_t{0}, int64_t{2}}) {
    SCOPED_TRACE("kept layers " + std::to_string(kept));
    const Run ref = run(false, kept), off = run(true, kept);
    EXPECT_EQ(ref.losses, off.losses);
    EXPECT_TRUE(ref.grads1 == off.grads1);
    EXPECT_TRUE(ref.grads2 == off.grads2);
    EXPECT_GT(ref.losses[0], 0.0);
    // 9 residual-stream buffers against 4 (a ring of three and the last output), each N x hidden bf16, up to the
    // arena's alignment
    const double saved = 5.0 * static_cast<double>(N * c.hidden_size) * 2;
    EXPECT_NEAR(static_cast<double>(ref.bytes - off.bytes), saved, 5 * 256.0);
  }
  // With layers rebuilding only mlp's activations (GpuPlan::mlp_layers: one kept, three mlp, four full) the offloaded
  // inputs are bitwise full recompute's too.
  const Run full = run(false, 0), mixed = run(true, 1, 3);
  EXPECT_EQ(mixed.losses, full.losses);
  EXPECT_TRUE(mixed.grads1 == full.grads1);
  EXPECT_TRUE(mixed.grads2 == full.grads2);
}

// The recompute policies (model/engine.h Recompute) rebuild the forward's own values: bitwise the same loss and
// gradients, with less memory the more they rebuild.
TEST(CudaEngine, RecomputePoliciesAreBitwiseEqual) {
  DS_SKIP_WITHOUT_GPU();
  ds::ModelConfig c = ds::ModelConfig::preset("tiny");
  c.vocab_size = 4096;
  c.linear_key_head_dim = c.linear_value_head_dim = 128;  // the chunked GDN plan (its saved state per layer)
  ds::Qwen35Model host(c);
  host.init_weights(11);
  const ds::PackedBatch b = make_batch({100, 1, 155, 39}, c.vocab_size, 31);
  const double scale = 1.0 / static_cast<double>(b.num_targets());
  struct Run {
    double loss;
    std::vector<float> grads;
    size_t bytes;
  };
  auto run = [&](ds::Recompute rc, int64_t kept_layers = 0, int64_t mlp_layers = 0, int64_t selective_layers = 0) {
    ds::GpuPlan plan;
    plan.max_tokens = b.size();
    plan.max_seqs = 4;
    plan.recompute = rc;
    plan.kept_layers = kept_layers;
    plan.mlp_layers = mlp_layers;
    plan.selective_layers = selective_layers;
    ds::GpuModel gpu(host, plan);
    EXPECT_EQ(gpu.recompute(), rc);
    Run r{gpu.forward_backward(b, scale).loss_sum, {}, gpu.planned_bytes()};
    gpu.download_grads(r.grads);
    return r;
  };
  const Run sel = run(ds::Recompute::Selective), none = run(ds::Recompute::None), full = run(ds::Recompute::Full),
            mlp = run(ds::Recompute::Mlp);
  EXPECT_EQ(none.loss, sel.loss);
  EXPECT_EQ(full.loss, sel.loss);
  EXPECT_EQ(mlp.loss, sel.loss);
  EXPECT_TRUE(none.grads == sel.grads);
  EXPECT_TRUE(full.grads == sel.grads);
  EXPECT_TRUE(mlp.grads == sel.grads);
  EXPECT_LT(full.bytes, mlp.bytes);
  EXPECT_LT(mlp.bytes, sel.bytes);
  EXPECT_LT(sel.bytes, none.bytes);
  // Recompute by layer (GpuPlan::kept_layers): the first layer keeps, the others rebuild; bitwise the same too.
  // Full: the kept layers keep everything and their forward does not run again; with all but the last kept, the
  // last (the other mixer kind's only rebuilding layer) has no set to share. Memory grows with the kept layers; with
  // all but one kept, full holds the kept layers' activations, the last layer's input and its rebuild set (one
  // layer's activations) at once (the last layer's backward runs first, while every kept layer still holds its
  // activations), which can be more than none (41.6 against 40.4 MB here on the H200); --recompute auto tries none
  // first, so it never picks such a plan over none.
  ASSERT_GE(c.num_hidden_layers, 3);
  const int64_t L = c.num_hidden_layers;
  size_t full_kept_1 = 0;
  for (auto [rc, kept] : {std::pair{ds::Recompute::Selective, int64_t{1}}, std::pair{ds::Recompute::Mlp, int64_t{1}},
                          std::pair{ds::Recompute::Full, int64_t{1}}, std::pair{ds::Recompute::Full, L - 1}}) {
    const Run part = run(rc, kept);
    const std::string what = ds::recompute_name(rc) + std::string(" kept ") + std::to_string(kept);
    EXPECT_EQ(part.loss, sel.loss) << what;
    EXPECT_TRUE(part.grads == sel.grads) << what;
    if (kept == 1) EXPECT_LT(part.bytes, none.bytes) << what;
    else EXPECT_GT(part.bytes, full_kept_1) << what;
    if (rc == ds::Recompute::Full && kept == 1) full_kept_1 = part.bytes;
    EXPECT_GT(part.bytes, rc == ds::Recompute::Mlp ? mlp.bytes : rc == ds::Recompute::Full ? full.bytes : sel.bytes)
        << what;
  }
  // Mlp with layers keeping their gate|up output (GpuPlan::selective_layers, selective's policy) after the kept ones:
  // two such layers; one kept and one; all but the last. Bitwise, and the bytes between mlp's and selective's (two
  // selective layers: one gate|up buffer more than mlp's shared one; all but the last: as many as selective's, whose
  // last layer keeps its own where mlp's shares one).
  for (auto [kept, sl] : {std::pair{int64_t{0}, int64_t{2}}, std::pair{int64_t{1}, int64_t{1}}, std::pair{int64_t{0}, L - 1}}) {
    const Run part = run(ds::Recompute::Mlp, kept, 0, sl);
    const std::string what = "mlp kept " + std::to_string(kept) + " selective " + std::to_string(sl);
    EXPECT_EQ(part.loss, sel.loss) << what;
    EXPECT_TRUE(part.grads == sel.grads) << what;
    EXPECT_GT(part.bytes, mlp.bytes) << what;
    if (kept == 0) {
      EXPECT_LE(part.bytes, sel.bytes) << what;
    }
  }
  // Full with layers rebuilding only mlp's activations (GpuPlan::mlp_layers) after the kept ones: one kept and one
  // mlp (both mixer kinds' full layers after them), two mlp, all but the last mlp (the last layer runs full and
  // does not run its forward again). Bitwise, and more bytes than full. (Not fewer than mlp's here: in a 4-layer
  // model the full layers' per-kind sets outweigh what two mlp layers save; 34.0 against 33.8 MB on the H200.)
  for (auto [kept, m] : {std::pair{int64_t{1}, int64_t{1}}, std::pair{int64_t{0}, int64_t{2}}, std::pair{int64_t{0}, L - 1}}) {
    const Run part = run(ds::Recompute::Full, kept, m);
    const std::string what = "full kept " + std::to_string(kept) + " mlp " + std::to_string(m);
    EXPECT_EQ(part.loss, sel.loss) << what;
    EXPECT_TRUE(part.grads == sel.grads) << what;
    EXPECT_GT(part.bytes, full.bytes) << what;
  }
}

// The bf16 optimizer state (ops/adamw/bf16_state.h): the same first forward as the fp32 state (both run the
// round-to-nearest bf16 of the host weights), then a close loss curve; and its checkpoint tensors (fp32, widened
// exactly) restore the run bitwise in a new engine.
namespace {
// What the optimizer-state tests train: the tiny model (vocab 4096) on one batch of three documents, AdamW with lr
// 3e-3 and weight decay 0.1; plan_for(s) plans that batch in state s, steps() runs steps first..last and returns
// their losses (mean per target).
struct StateRun {
  ds::ModelConfig c = [] {
    ds::ModelConfig x = ds::ModelConfig::preset("tiny");
    x.vocab_size = 4096;
    return x;
  }();
  ds::Qwen35Model host{c};
  ds::PackedBatch b = make_batch({60, 100, 33}, c.vocab_size, 32);
  double scale = 1.0 / static_cast<double>(b.num_targets());
  ds::ops::AdamWParams ap{3e-3, 0.9, 0.95, 1e-8, 0.1, 1, 1.0};
  StateRun() { host.init_weights(12); }
  ds::GpuPlan plan_for(ds::OptimizerState s) const {
    ds::GpuPlan plan;
    plan.max_tokens = b.size();
    plan.max_seqs = 3;
    plan.optimizer_state = s;
    return plan;
  }
  std::vector<double> steps(ds::GpuModel& gpu, int64_t first, int64_t last) {
    std::vector<double> losses;
    for (int64_t t = first; t <= last; ++t) {
      gpu.zero_grads();
      losses.push_back(gpu.forward_backward(b, scale).loss_sum * scale);
      ap.step = t;
      gpu.adamw_step(ap, ap.weight_decay);
    }
    return losses;
  }
  std::vector<float> weights(const ds::GpuModel& g) const {  // flat, fp32
    std::vector<float> w(static_cast<size_t>(host.num_parameters()));
    for (const ds::ParamSpec& p : host.params()) g.read(ds::GpuModel::Buffer::Weights, p.offset, p.numel, w.data() + p.offset);
    return w;
  }
  void read_moments(ds::GpuModel& g, std::vector<float>& m, std::vector<float>& v) const {  // flat, fp32
    m.assign(static_cast<size_t>(host.num_parameters()), 0.0f);
    v.assign(m.size(), 0.0f);
    for (const ds::ParamSpec& p : host.params()) {
      g.read_optimizer_state(0, p.offset, p.numel, m.data() + p.offset);
      g.read_optimizer_state(1, p.offset, p.numel, v.data() + p.offset);
    }
  }
  void write_moments(ds::GpuModel& g, const std::vector<float>& m, const std::vector<float>& v) const {
    for (const ds::ParamSpec& p : host.params()) {
      g.write_optimizer_state(0, p.offset, p.numel, m.data() + p.offset);
      g.write_optimizer_state(1, p.offset, p.numel, v.data() + p.offset);
    }
  }
  // A checkpoint's round trip: `trained`'s weights into `again` and its moments (fp32) into a new engine of state s
  // built from `again`, which reads them back unchanged; three more steps (21..23) in both give bitwise the same
  // losses and weights. m, v: the moments.
  void expect_resumes_bitwise(ds::GpuModel& trained, ds::OptimizerState s, ds::Qwen35Model& again,
                              std::vector<float>& m, std::vector<float>& v) {
    const std::vector<float> w = weights(trained);
    std::copy(w.begin(), w.end(), again.weights().begin());
    read_moments(trained, m, v);
    ds::GpuModel resumed(again, plan_for(s));
    write_moments(resumed, m, v);
    std::vector<float> m2, v2;
    read_moments(resumed, m2, v2);
    EXPECT_TRUE(m2 == m);
    EXPECT_TRUE(v2 == v);
    const std::vector<double> la = steps(trained, 21, 23), lr = steps(resumed, 21, 23);
    EXPECT_EQ(la, lr);
    EXPECT_TRUE(weights(trained) == weights(resumed));
  }
};
}  // namespace

TEST(CudaEngine, Bf16StateTracksFp32AndRestoresBitwise) {
  DS_SKIP_WITHOUT_GPU();
  StateRun run;
  ds::GpuModel f32(run.host, run.plan_for(ds::OptimizerState::Fp32));
  ds::GpuModel b16(run.host, run.plan_for(ds::OptimizerState::Bf16));
  EXPECT_EQ(b16.optimizer_state(), ds::OptimizerState::Bf16);
  const std::vector<double> lf = run.steps(f32, 1, 20), lb = run.steps(b16, 1, 20);
  EXPECT_EQ(lf[0], lb[0]);
  EXPECT_LT(lb.back(), 0.8 * lb.front());  // it learns this batch
  for (size_t i = 0; i < lf.size(); ++i) EXPECT_NEAR(lb[i], lf[i], 2e-2 * lf[i]) << "step " << i + 1;

  // Checkpoint round trip: weights and both moments out as fp32, into a new bf16 engine, 3 more steps each.
  ds::Qwen35Model again(run.c);
  again.init_weights(99);  // overwritten
  std::vector<float> m, v;
  run.expect_resumes_bitwise(b16, ds::OptimizerState::Bf16, again, m, v);
  std::vector<float> wa = run.weights(b16);
  // A bf16-only weight read back is a bf16 value; a range across two parameters is refused.
  const ds::ParamSpec& emb = again.params().front();
  EXPECT_EQ(wa[5], ds::round_bf16(wa[5]));
  EXPECT_THROW(b16.read(ds::GpuModel::Buffer::Weights, emb.numel - 1, 2, wa.data()), ds::Error);
}

// The 8bit optimizer state (ops/adamw/q8_state.h): the same first forward as the fp32 state, a close loss curve
// (its own: not the bf16 state's), and its checkpoint tensors (the moments dequantized to fp32) restore the run
// bitwise in a new engine. Across states: an 8bit state loads into the fp32 state exactly (its fp32 values), and
// the fp32 state's moments load into the 8bit state as their quantization (ops::quantize_moment_8bit, blocks of
// the flat offsets), the small parameters' exactly.
TEST(CudaEngine, EightBitStateTracksFp32AndRestoresBitwise) {
  DS_SKIP_WITHOUT_GPU();
  StateRun run;
  ds::GpuModel f32(run.host, run.plan_for(ds::OptimizerState::Fp32));
  ds::GpuModel b16(run.host, run.plan_for(ds::OptimizerState::Bf16));
  ds::GpuModel q8(run.host, run.plan_for(ds::OptimizerState::EightBit));
  EXPECT_EQ(q8.optimizer_state(), ds::OptimizerState::EightBit);
  const std::vector<double> lf = run.steps(f32, 1, 20), lb = run.steps(b16, 1, 20), lq = run.steps(q8, 1, 20);
  EXPECT_EQ(lf[0], lq[0]);
  EXPECT_EQ(lb[1], lq[1]);  // step 1's update from zero moments is the bf16 state's
  EXPECT_NE(lb, lq);
  EXPECT_LT(lq.back(), 0.8 * lq.front());  // it learns this batch
  for (size_t i = 0; i < lf.size(); ++i) EXPECT_NEAR(lq[i], lf[i], 5e-2 * lf[i]) << "step " << i + 1;

  // 8bit -> 8bit: bitwise the same next steps and weights (the weights of `again` are those before them).
  ds::Qwen35Model again(run.c);
  again.init_weights(99);  // overwritten
  std::vector<float> m, v, m2, v2;
  run.expect_resumes_bitwise(q8, ds::OptimizerState::EightBit, again, m, v);
  const double after = run.steps(q8, 24, 24).front();
  // 8bit -> fp32: the fp32 values exactly; it trains on close to the 8bit state.
  ds::GpuModel to_f32(again, run.plan_for(ds::OptimizerState::Fp32));
  run.write_moments(to_f32, m, v);
  run.read_moments(to_f32, m2, v2);
  EXPECT_TRUE(m2 == m);
  EXPECT_TRUE(v2 == v);
  EXPECT_NEAR(run.steps(to_f32, 21, 24).back(), after, 5e-2 * after);
  // fp32 -> 8bit: each GEMM weight's moments quantized in the flat-offset blocks; a half-block write is refused.
  std::vector<float> mf, vf;
  run.read_moments(f32, mf, vf);
  ds::GpuModel from_f32(again, run.plan_for(ds::OptimizerState::EightBit));
  run.write_moments(from_f32, mf, vf);
  run.read_moments(from_f32, m2, v2);
  for (const ds::ParamSpec& p : run.host.params()) {
    std::vector<float> want_m(mf.begin() + p.offset, mf.begin() + p.offset + p.numel);
    std::vector<float> want_v(vf.begin() + p.offset, vf.begin() + p.offset + p.numel);
    if (ds::is_matrix(p)) {
      const int64_t nb = ds::ops::q8_state::num_blocks(p.offset, p.numel);
      std::vector<uint8_t> code(static_cast<size_t>(p.numel));
      std::vector<float> absmax(static_cast<size_t>(nb));
      for (std::vector<float>* w : {&want_m, &want_v}) {
        const int which = w == &want_m ? 0 : 1;
        ds::ops::quantize_moment_8bit(which, w->data(), p.numel, p.offset, code.data(), absmax.data());
        ds::ops::dequantize_moment_8bit(which, code.data(), absmax.data(), p.numel, p.offset, w->data());
      }
    }
    EXPECT_TRUE(std::equal(want_m.begin(), want_m.end(), m2.begin() + p.offset)) << p.name;
    EXPECT_TRUE(std::equal(want_v.begin(), want_v.end(), v2.begin() + p.offset)) << p.name;
  }
  const ds::ParamSpec& emb = run.host.params().front();
  ASSERT_TRUE(ds::is_matrix(emb));
  EXPECT_THROW(from_f32.write_optimizer_state(0, emb.offset + 100, 300, mf.data() + emb.offset + 100), ds::Error);
}

// The optimizer step overlapped with the next step (GpuModel::set_async_optimizer): the update on a side stream unit
// by unit, the next forward waiting per unit, the gradients zeroed on the side stream. Against the in-line update,
// in both optimizer-state layouts and with the full recompute (the backward's second forward): every loss, the
// gradient norm, a forward-only evaluation between steps, and the weights, gradients and moments read mid-run and
// at the end are bitwise equal.
TEST(CudaEngine, AsyncOptimizerStepIsTheSameRun) {
  DS_SKIP_WITHOUT_GPU();
  ds::Qwen35Model host = tiny_chunked_host(13);
  const ds::ModelConfig& c = host.config();
  const ds::PackedBatch b = make_batch({60, 100, 33}, c.vocab_size, 33), e = make_batch({90, 90}, c.vocab_size, 34);
  const double scale = 1.0 / static_cast<double>(b.num_targets());
  const int64_t P = host.num_parameters();
  for (const ds::OptimizerState st : {ds::OptimizerState::Fp32, ds::OptimizerState::Bf16, ds::OptimizerState::EightBit})
    for (const ds::Recompute rc : {ds::Recompute::Selective, ds::Recompute::Full}) {
      SCOPED_TRACE(std::string(ds::optimizer_state_name(st)) + " / " + ds::recompute_name(rc));
      struct Run {
        std::vector<double> values;
        std::vector<float> weights, grads, m;
      };
      auto run = [&](bool async) {
        ds::GpuPlan plan;
        plan.max_tokens = b.size();
        plan.max_seqs = 3;
        plan.optimizer_state = st;
        plan.recompute = rc;
        ds::GpuModel gpu(host, plan);
        gpu.set_async_optimizer(async);
        ds::ops::AdamWParams ap;
        ap.lr = 3e-3;
        ap.weight_decay = 0.1;
        Run r;
        for (int64_t t = 1; t <= 6; ++t) {
          gpu.zero_grads();
          r.values.push_back(gpu.forward_backward(b, scale).loss_sum);
          r.values.push_back(gpu.grad_sum_squares());
          ap.step = t;
          ap.grad_scale = t == 3 ? 0.5 : 1.0;  // a clipped step
          gpu.adamw_step(ap, ap.weight_decay);
          if (t == 2) r.values.push_back(gpu.forward_backward(e, 0.0).loss_sum);  // evaluation right after a step
          if (t == 4) {                                                          // a checkpoint read mid-run
            std::vector<float> w(static_cast<size_t>(P));
            gpu.read(ds::GpuModel::Buffer::Weights, 0, c.vocab_size * c.hidden_size, w.data());
            r.values.push_back(w[7]);
          }
        }
        r.weights.resize(static_cast<size_t>(P));
        r.m.resize(static_cast<size_t>(P));
        for (const ds::ParamSpec& p : host.params()) {
          gpu.read(ds::GpuModel::Buffer::Weights, p.offset, p.numel, r.weights.data() + p.offset);
          gpu.read_optimizer_state(0, p.offset, p.numel, r.m.data() + p.offset);
        }
        gpu.download_grads(r.grads);  // zeroed after the last update, either way
        return r;
      };
      const Run sync = run(false), async = run(true);
      EXPECT_EQ(sync.values, async.values);
      EXPECT_TRUE(sync.weights == async.weights);
      EXPECT_TRUE(sync.m == async.m);
      EXPECT_EQ(std::count(async.grads.begin(), async.grads.end(), 0.0f), static_cast<std::ptrdiff_t>(P));
      EXPECT_LT(sync.values[12], sync.values[0]);  // it trains (step 6's loss, values[12], below step 1's)
    }
}

// --gradients in-backward (model/engine.h Gradients, model/gpu_params.h slots): each unit's update runs on the side
// stream as soon as its gradients are final, the slots reused while later units still update. Against the fp32
// mode's step (a flat gradient buffer, the norm after the backward, the update after that), with the norm pass
// first (in_backward_step, clipping active at step 3) and without it: every loss, the gradient norm, an evaluation
// between steps, and the weights and moments at the end are bitwise equal. In the fp32 and 8bit states, with
// selective and full recompute, with a tied and an untied lm_head (the head's slot shared with the embedding's, or
// its own), and with full recompute also with the layer inputs offloaded (--offload-activations). Step 4 runs
// without a backward (grad_scale 0, as for a batch without targets): the update over zero gradients runs in both
// modes.
TEST(CudaEngine, InBackwardUpdateIsTheFp32Step) {
  DS_SKIP_WITHOUT_GPU();
  for (const bool tied : {true, false}) {
    ds::ModelConfig cfg = ds::ModelConfig::preset("tiny");
    cfg.vocab_size = 4096;
    cfg.linear_key_head_dim = cfg.linear_value_head_dim = 128;
    cfg.tie_word_embeddings = tied;
    ds::Qwen35Model host(cfg);
    host.init_weights(17);
    const ds::ModelConfig& c = host.config();
    const ds::PackedBatch b = make_batch({60, 100, 33}, c.vocab_size, 35), e = make_batch({90, 90}, c.vocab_size, 36);
    const int64_t P = host.num_parameters();
    for (const ds::OptimizerState st : {ds::OptimizerState::Fp32, ds::OptimizerState::EightBit})
      for (const ds::Recompute rc : {ds::Recompute::Selective, ds::Recompute::Full}) {
        SCOPED_TRACE(std::string(tied ? "tied / " : "untied / ") + ds::optimizer_state_name(st) + " / " +
                     ds::recompute_name(rc));
        struct Run {
          std::vector<double> values;
          std::vector<float> weights, m;
        };
        // clip: the step's clip norm (0: none); in-backward with the norm pass first when clip > 0 or norm_first;
        // offload: --offload-activations (full recompute only).
        auto run = [&](ds::Gradients g, double clip, bool norm_first, bool offload = false) {
          ds::GpuPlan plan = ds::GpuPlan::windows(1, b.size(), 3);
          plan.optimizer_state = st;
          plan.recompute = rc;
          plan.gradients = g;
          plan.offload_activations = offload;
          std::unique_ptr<ds::Engine> gpu = ds::make_engine("cuda", host, plan);
          const double scale = 1.0 / static_cast<double>(b.num_targets());
          ds::ops::AdamWParams ap;
          ap.lr = 3e-3;
          ap.weight_decay = 0.1;
          Run r;
          for (int64_t t = 1; t <= 5; ++t) {
            ap.step = t;
            const double step_clip = t == 3 ? clip : 0.0;
            const double step_scale = t == 4 ? 0.0 : scale;  // a batch without targets: an update over zero gradients
            if (g == ds::Gradients::InBackward) {
              const ds::InBackwardStep s = ds::in_backward_step(*gpu, b, step_scale, 0.0, ap, step_clip, norm_first);
              EXPECT_TRUE(s.updated);
              r.values.push_back(s.result.loss_sum);
              r.values.push_back(s.grad_sum_squares);
            } else {
              gpu->zero_grads();
              r.values.push_back(gpu->forward_backward(b, step_scale).loss_sum);
              const double ss = gpu->grad_sum_squares(), norm = std::sqrt(ss);
              r.values.push_back(ss);
              ds::ops::AdamWParams q = ap;
              q.grad_scale = step_clip > 0 && norm > step_clip ? step_clip / (norm + 1e-6) : 1.0;
              gpu->optimizer_step(q);
            }
            if (t == 2) r.values.push_back(gpu->forward_backward(e, 0.0).loss_sum);  // evaluation after a step
          }
          r.weights = ds::test::tensor_values(gpu->weight_tensors(ds::DType::F32));
          r.m = ds::test::tensor_values(gpu->optimizer_tensors());  // the 8bit state's: its codes' and scales' bytes
          EXPECT_EQ(static_cast<int64_t>(r.weights.size()), P);
          return r;
        };
        const Run ref = run(ds::Gradients::Fp32, 0.5, false);
        ASSERT_GT(std::sqrt(ref.values[6]), 0.5) << "step 3 should clip";  // values: l1 s1 l2 s2 eval l3 s3 ...
        ASSERT_EQ(ref.values[8], 0.0) << "step 4 has no gradient";
        const Run one = run(ds::Gradients::InBackward, 0.5, false), two = run(ds::Gradients::InBackward, 0.5, true);
        // With full recompute, also the layer inputs offloaded to the host (four layers: the first fetched back)
        // through the norm-only pass and the updating pass of each in-backward step.
        const Run off = rc == ds::Recompute::Full ? run(ds::Gradients::InBackward, 0.5, false, true) : one;
        // DELTASTACK_WGRAD_OVERWRITE=0: every gradient zeroed, then added to, where by default the matrices' wgrad
        // GEMMs write their gradients in the first backward after zero_grads and in every in-backward one: bitwise
        // the same steps. DELTASTACK_LAYER_SLOTS=2 and 3: the in-backward layers in two and three gradient slots.
        Run wf, wi, s3;
        {
          ds::test::EnvSet added("DELTASTACK_WGRAD_OVERWRITE", "0");
          wf = run(ds::Gradients::Fp32, 0.5, false);
          wi = run(ds::Gradients::InBackward, 0.5, false);
        }
        {
          ds::test::EnvSet three("DELTASTACK_LAYER_SLOTS", "3");
          s3 = run(ds::Gradients::InBackward, 0.5, false);
        }
        ds::test::EnvSet two_slots("DELTASTACK_LAYER_SLOTS", "2");
        const Run s2 = run(ds::Gradients::InBackward, 0.5, false);
        for (const Run* x : std::initializer_list<const Run*>{&one, &two, &off, &wf, &wi, &s3, &s2}) {
          EXPECT_EQ(ref.values, x->values);
          EXPECT_TRUE(ref.weights == x->weights);
          EXPECT_TRUE(ref.m == x->m);
        }
        EXPECT_LT(ref.values[ref.values.size() - 2], ref.values[0]);  // it trains (step 5's loss below step 1's)
      }
  }
}

// The 8bit state's checkpoint entries (model/engine.h moment_scale_name): the GEMM weights' moments as U8 codes with
// F32 block scales, the small parameters' as F32; written by optimizer_tensors, read back by the trainer's loader
// (train/checkpoint.cpp load_optimizer_state) into a fresh engine, which then takes the same next steps bitwise; and
// into a fp32-state engine, whose moments are the codes' dequantized values.
TEST(CudaEngine, EightBitCheckpointStoresCodesAndResumesBitwise) {
  DS_SKIP_WITHOUT_GPU();
  ds::Qwen35Model host = tiny_chunked_host(23);
  const ds::ModelConfig& c = host.config();
  const ds::PackedBatch b = make_batch({60, 100, 33}, c.vocab_size, 37);
  const double scale = 1.0 / static_cast<double>(b.num_targets());
  ds::GpuPlan plan = ds::GpuPlan::windows(1, b.size(), 3);
  plan.optimizer_state = ds::OptimizerState::EightBit;
  plan.recompute = ds::Recompute::Selective;
  plan.gradients = ds::Gradients::Fp32;
  ds::ops::AdamWParams ap;
  ap.lr = 3e-3;
  ap.weight_decay = 0.1;
  auto step = [&](ds::Engine& e, int64_t t) {
    e.zero_grads();
    const double loss = e.forward_backward(b, scale).loss_sum;
    ap.step = t;
    e.optimizer_step(ap);
    return loss;
  };
  std::unique_ptr<ds::Engine> a = ds::make_engine("cuda", host, plan);
  for (int64_t t = 1; t <= 3; ++t) step(*a, t);
  const std::string dir = ds::test::fresh_tmpdir("cuda_codes");
  const std::vector<ds::SaveTensor> opt = a->optimizer_tensors();
  int u8 = 0;
  for (const ds::SaveTensor& t : opt) u8 += t.dtype == ds::DType::U8;
  EXPECT_GT(u8, 0);
  // The trainer's free-space check before training (train/checkpoint.h checkpoint_bytes_estimate) is these bytes.
  EXPECT_EQ(ds::stored_bytes(opt) + ds::stored_bytes(a->checkpoint_weight_tensors()) + ds::kCheckpointSlackBytes,
            ds::checkpoint_bytes_estimate(c, "8bit"));
  ds::write_safetensors(dir + "/optimizer.safetensors", opt);
  ds::write_safetensors(dir + "/model.safetensors", a->checkpoint_weight_tensors());
  ds::Qwen35Model from(c, ds::Qwen35Model::Deferred{});
  from.defer_load(dir + "/model.safetensors");
  std::unique_ptr<ds::Engine> r = ds::make_engine("cuda", from, plan);
  ds::load_optimizer_state(*r, dir);
  {  // The loader hands the stored codes to the engine as they are (CodeSource, model/engine.h): the device's codes
     // and block scales are the file's bytes.
    const ds::CheckpointReader ck(dir + "/optimizer.safetensors");
    int checked = 0;
    for (const ds::SaveTensor& t : r->optimizer_tensors()) {
      if (t.dtype != ds::DType::U8) continue;
      const std::string want = ck.copy_bytes(t.name);
      std::string got(want.size(), '\0');
      t.byte_reader(0, static_cast<int64_t>(got.size()), reinterpret_cast<uint8_t*>(got.data()));
      EXPECT_TRUE(got == want) << t.name;
      ++checked;
    }
    EXPECT_EQ(checked, u8);
  }
  for (int64_t t = 4; t <= 5; ++t) EXPECT_EQ(step(*a, t), step(*r, t)) << "step " << t;
  // Into the fp32 state: the moments are the codes' values.
  ds::GpuPlan p32 = plan;
  p32.optimizer_state = ds::OptimizerState::Fp32;
  std::unique_ptr<ds::Engine> f = ds::make_engine("cuda", from, p32);
  ds::load_optimizer_state(*f, dir);
  const ds::CheckpointReader ck(dir + "/optimizer.safetensors");
  for (const ds::ParamSpec& p : f->params()) {
    if (!ds::is_matrix(p)) continue;
    const std::string name = "exp_avg." + p.name;
    ASSERT_EQ(ck.info(name).dtype, ds::DType::U8) << name;
    const std::string codes = ck.copy_bytes(name);
    const std::vector<float> sc = ck.read_f32(ds::moment_scale_name(name));
    std::vector<float> want(static_cast<size_t>(p.numel)), got(want.size());
    ds::ops::dequantize_moment_8bit(0, reinterpret_cast<const uint8_t*>(codes.data()), sc.data(), p.numel, p.offset,
                                    want.data());
    for (const ds::SaveTensor& t : f->optimizer_tensors())
      if (t.name == name) t.f32_reader(0, p.numel, got.data());
    EXPECT_TRUE(want == got) << name;
    break;  // one tensor is enough: the loader is the same for all
  }
  std::filesystem::remove_all(dir);
}

// --shard optimizer's offsets at ranks other than 0 (model/gpu_params.h ParamShard, GpuAdamW's share-local
// moments), which a one-GPU NCCL run (world size 1: share 0 only) never reaches. Three GpuModels planned as ranks
// 0..2 of 3 (the last share padded, shares cutting through tensors and, in the bf16 layout, through the compacted
// fp32 master) stand in for three GPU ranks in one process: each takes the step on its own gradients (the same
// weights and batch, so the same bits as the summed gradients of one rank), and the engine's all-gathers are
// played by copying each rank's slice of its shard buffers (the bf16 weights; the fp32 master flat, or the bf16
// layout's master_ranges[r]) into the others. After every step all weights are bitwise the unsharded model's, and
// so is each rank's share [lo, hi) of the moments; reads outside the share are errors; gather_optimizer_state (its
// broadcast played by three threads) makes the unsharded moments whole on rank 0.
TEST(CudaEngine, ThreeShardsTakeThePlainSteps) {
  DS_SKIP_WITHOUT_GPU();
  ds::Qwen35Model host = tiny_chunked_host(21);
  const ds::ModelConfig& c = host.config();
  const ds::PackedBatch b = make_batch({60, 100, 33}, c.vocab_size, 35);
  const double scale = 1.0 / static_cast<double>(b.num_targets());
  const int64_t P = host.num_parameters();
  constexpr int W = 3;
  for (const ds::OptimizerState st : {ds::OptimizerState::Fp32, ds::OptimizerState::Bf16, ds::OptimizerState::EightBit}) {
    SCOPED_TRACE(ds::optimizer_state_name(st));
    auto plan_for = [&](int rank, int world) {
      ds::GpuPlan plan;
      plan.max_tokens = b.size();
      plan.max_seqs = 3;
      plan.optimizer_state = st;
      plan.recompute = ds::Recompute::Selective;
      plan.shard_rank = rank;
      plan.shard_world = world;
      return plan;
    };
    ds::GpuModel ref(host, plan_for(0, 0));
    std::vector<std::unique_ptr<ds::GpuModel>> ranks;
    for (int r = 0; r < W; ++r) ranks.push_back(std::make_unique<ds::GpuModel>(host, plan_for(r, W)));
    auto weights = [&](ds::GpuModel& m) {
      std::vector<float> w(static_cast<size_t>(P));
      for (const ds::ParamSpec& p : host.params())
        m.read(ds::GpuModel::Buffer::Weights, p.offset, p.numel, w.data() + p.offset);
      return w;
    };
    ds::ops::AdamWParams ap;
    ap.lr = 3e-3;
    ap.weight_decay = 0.1;
    for (int64_t t = 1; t <= 3; ++t) {
      ap.step = t;
      ap.grad_scale = t == 2 ? 0.5 : 1.0;  // a clipped step
      ref.zero_grads();
      ref.forward_backward(b, scale);
      // Each rank's norm share (no reduce-scatter here: every rank holds the whole gradients) covers its flat range,
      // parameters cut by a share boundary included: the three add up to the plain norm (other partitions, so not
      // bitwise).
      const double whole = ref.grad_sum_squares();
      double shares = 0;
      ref.adamw_step(ap, ap.weight_decay);
      for (auto& m : ranks) {
        m->zero_grads();
        m->forward_backward(b, scale);
        shares += m->share_grad_sum_squares();
        m->adamw_step(ap, ap.weight_decay);
      }
      EXPECT_GT(whole, 0.0);
      EXPECT_NEAR(shares, whole, 1e-12 * whole) << "step " << t;
      std::vector<ds::GpuModel::ShardBuffers> sb;
      for (auto& m : ranks) sb.push_back(m->shard_buffers());
      for (int r = 0; r < W; ++r) {
        const ds::GpuModel::ShardBuffers& x = sb[static_cast<size_t>(r)];
        ASSERT_EQ(x.world, W);
        ASSERT_EQ(x.share * W, x.padded);
        ASSERT_EQ(x.lo, std::min(P, r * x.share));
        ASSERT_EQ(x.hi, std::min(P, x.lo + x.share));
        for (int o = 0; o < W; ++o) {
          if (o == r) continue;
          const ds::GpuModel::ShardBuffers& y = sb[static_cast<size_t>(o)];
          const int64_t at = r * x.share * 2;  // bytes of bf16
          ASSERT_EQ(cudaMemcpy(static_cast<char*>(y.compute) + at, static_cast<const char*>(x.compute) + at,
                               static_cast<size_t>(x.share * 2), cudaMemcpyDeviceToDevice), cudaSuccess);
          const auto [m0, m1] = x.master_flat ? std::pair<int64_t, int64_t>{r * x.share, (r + 1) * x.share}
                                              : x.master_ranges[static_cast<size_t>(r)];
          if (m1 > m0) {
            ASSERT_EQ(cudaMemcpy(y.master + m0, x.master + m0, static_cast<size_t>(m1 - m0) * sizeof(float),
                                 cudaMemcpyDeviceToDevice), cudaSuccess);
          }
        }
      }
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      const std::vector<float> want = weights(ref);
      for (int r = 0; r < W; ++r)
        EXPECT_TRUE(weights(*ranks[static_cast<size_t>(r)]) == want) << "rank " << r << ", step " << t;
    }
    // Each rank's moments: its share of the unsharded ones; nothing outside it.
    for (int which = 0; which < ref.optimizer_state_count(); ++which)
      for (int r = 0; r < W; ++r) {
        const ds::GpuModel::ShardBuffers x = ranks[static_cast<size_t>(r)]->shard_buffers();
        for (const ds::ParamSpec& p : host.params()) {
          const int64_t a = std::max(p.offset, x.lo), e = std::min(p.offset + p.numel, x.hi);
          if (a >= e) {
            float dummy = 0;
            EXPECT_THROW(ranks[static_cast<size_t>(r)]->read_optimizer_state(which, p.offset, 1, &dummy), ds::Error)
                << p.name << " on rank " << r;
            continue;
          }
          std::vector<float> got(static_cast<size_t>(e - a)), exp(static_cast<size_t>(e - a));
          ranks[static_cast<size_t>(r)]->read_optimizer_state(which, a, e - a, got.data());
          ref.read_optimizer_state(which, a, e - a, exp.data());
          EXPECT_TRUE(got == exp) << "state " << which << " of " << p.name << " on rank " << r;
        }
      }
    // The save's gather: every rank calls it, each with a broadcast that copies the root's device bytes to its own.
    std::barrier sync(W);
    void* root_ptr = nullptr;
    std::vector<std::vector<float>> whole;
    std::vector<std::thread> threads;
    std::atomic<int> failures{0};
    for (int r = 0; r < W; ++r)
      threads.emplace_back([&, r] {
        try {
          std::vector<std::vector<float>> none;
          ranks[static_cast<size_t>(r)]->gather_optimizer_state([&, r](void* p, int64_t bytes, int root) {
            DS_CUDA_CHECK(cudaDeviceSynchronize());  // the root's copy into p
            if (r == root) root_ptr = p;
            sync.arrive_and_wait();
            if (r != root) {
              DS_CUDA_CHECK(cudaMemcpy(p, root_ptr, static_cast<size_t>(bytes), cudaMemcpyDeviceToDevice));
              DS_CUDA_CHECK(cudaDeviceSynchronize());
            }
            sync.arrive_and_wait();
          }, r, r == 0 ? &whole : &none);
          if (r != 0 && !none.empty()) ++failures;
        } catch (...) {
          ++failures;
          sync.arrive_and_drop();
        }
      });
    for (std::thread& th : threads) th.join();
    ASSERT_EQ(failures.load(), 0);
    ASSERT_EQ(static_cast<int>(whole.size()), ref.optimizer_state_count());
    for (int which = 0; which < ref.optimizer_state_count(); ++which)
      for (const ds::ParamSpec& p : host.params()) {
        std::vector<float> exp(static_cast<size_t>(p.numel));
        ref.read_optimizer_state(which, p.offset, p.numel, exp.data());
        EXPECT_TRUE(std::equal(exp.begin(), exp.end(), whole[static_cast<size_t>(which)].begin() + p.offset))
            << "gathered state " << which << " of " << p.name;
      }
  }
}

// `bench step --profile` (core/cuda/profile.h): the timed scopes change no result (two training steps bitwise equal
// with and without them, in the selective and the full recompute), every family of the model shows up, the
// backward's rebuilds are labelled, the same scopes run every step (the event pool is reused), and their sum is
// within the step's wall time; the gaps between them are one per scope but the first, each named after the scope
// it precedes.
TEST(CudaEngine, ProfilerChangesNoResult) {
  DS_SKIP_WITHOUT_GPU();
  ds::ModelConfig c = ds::ModelConfig::preset("tiny");
  c.vocab_size = 4096;
  ds::Qwen35Model host(c);
  host.init_weights(11);
  const ds::PackedBatch b = make_batch({100, 1, 155, 39}, c.vocab_size, 41);
  const double scale = 1.0 / static_cast<double>(b.num_targets());
  for (ds::Recompute rc : {ds::Recompute::Selective, ds::Recompute::Full}) {
    SCOPED_TRACE(ds::recompute_name(rc));
    ds::ProfileTable gaps;
    auto run = [&](bool profile, ds::ProfileTable& table) {
      ds::GpuPlan plan;
      plan.max_tokens = b.size();
      plan.max_seqs = 4;
      plan.recompute = rc;
      ds::GpuModel gpu(host, plan);
      ds::cuda::StepProfiler prof;
      if (profile) gpu.set_profiler(&prof);
      ds::ops::AdamWParams ap;
      ap.lr = 3e-3;
      ap.weight_decay = 0.1;
      std::vector<double> out;
      for (int64_t t = 1; t <= 2; ++t) {
        const auto t0 = std::chrono::steady_clock::now();
        gpu.zero_grads();
        out.push_back(gpu.forward_backward(b, scale).loss_sum);
        out.push_back(gpu.grad_sum_squares());
        ap.step = t;
        gpu.adamw_step(ap, ap.weight_decay);
        const double wall = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
        if (profile) {
          prof.collect(table, &gaps);
          table.end_step(wall);
          gaps.end_step(wall);
        }
      }
      std::vector<float> g;
      gpu.download_grads(g);
      gpu.set_profiler(nullptr);
      return std::pair{out, g};
    };
    ds::ProfileTable off_table, table;
    const auto off = run(false, off_table), on = run(true, table);
    EXPECT_TRUE(off.first == on.first);
    EXPECT_TRUE(off.second == on.second);
    EXPECT_TRUE(off_table.rows().empty());
    EXPECT_EQ(table.steps(), 2);
    std::vector<std::string> families;
    bool rebuilt = false;
    for (const ds::ProfileTable::Row& r : table.rows()) {
      if (families.empty() || families.back() != r.family) families.push_back(r.family);
      rebuilt = rebuilt || r.role.find("(rebuild)") != std::string::npos;
      EXPECT_GE(r.ms, 0) << r.family << " / " << r.role;
      EXPECT_EQ(r.calls, std::round(r.calls)) << r.family << " / " << r.role;  // the same scopes in both steps
    }
    EXPECT_TRUE(families == ds::profile_families());
    EXPECT_TRUE(rebuilt);
    EXPECT_GT(table.scope_ms(), 0);
    EXPECT_LE(table.scope_ms(), table.wall_ms());
    double scopes = 0, gap_scopes = 0;
    for (const ds::ProfileTable::Row& r : table.rows()) scopes += r.calls;
    for (const ds::ProfileTable::Row& r : gaps.rows()) {
      gap_scopes += r.calls;
      EXPECT_EQ(r.family, "gap before");
      EXPECT_NE(r.role.find(" / "), std::string::npos) << r.role;
    }
    EXPECT_EQ(gap_scopes, scopes - 1);  // per step
    std::printf("[ measured ] %s recompute:\n%s", ds::recompute_name(rc), table.format(699e12, 4.23e12).c_str());
  }
}

// The embedding's in-backward 8-bit update in two parts (model/gpu_model.cpp split_embed): the chunks that hold no
// row of the batch's ids right after the loss, the rest at the embedding's end. Against DELTASTACK_EMBED_SPLIT=0
// (one update at the end), bitwise: losses, gradient norms, weights and the 8-bit state, over three steps (the
// second with clipping: a norm-only pass first), with tied embeddings (the early chunks read lm_head's gradients)
// and untied ones (the early chunks' gradients are zero, not read), and the split counted as run. A vocabulary of
// 65536 rows of 64: 512 chunks of 128 rows, of which the batch's ~290 distinct ids touch about 40 %. (Rows that span
// two chunks: AdamW8bitState.RowChunkMaskMarksEveryChunkOfARow on the CPU.)
TEST(CudaEngine, EmbeddingUpdateSplitIsBitwise) {
  DS_SKIP_WITHOUT_GPU();
  for (bool tied : {true, false}) {
    SCOPED_TRACE(tied ? "tied" : "untied");
    ds::ModelConfig c = ds::ModelConfig::preset("tiny");
    c.vocab_size = 65536;
    c.tie_word_embeddings = tied;
    ds::Qwen35Model host(c);
    host.init_weights(13);
    const ds::PackedBatch b = make_batch({100, 1, 155, 39}, c.vocab_size, 47);
    const double scale = 1.0 / static_cast<double>(b.num_targets());
    auto run = [&](const char* split) {
      ds::test::EnvSet env("DELTASTACK_EMBED_SPLIT", split);
      ds::GpuPlan plan = ds::GpuPlan::windows(1, b.size(), 4);
      plan.optimizer_state = ds::OptimizerState::EightBit;
      plan.gradients = ds::Gradients::InBackward;
      std::unique_ptr<ds::Engine> gpu = ds::make_engine("cuda", host, plan);
      ds::ops::AdamWParams ap;
      ap.lr = 3e-3;
      ap.weight_decay = 0.1;
      std::vector<double> values;
      for (int64_t t = 1; t <= 3; ++t) {
        ap.step = t;
        const ds::InBackwardStep st = ds::in_backward_step(*gpu, b, scale, 0.0, ap, t == 2 ? 0.5 : 0.0, false);
        EXPECT_TRUE(st.updated);
        values.push_back(st.result.loss_sum);
        values.push_back(st.grad_sum_squares);
      }
      return std::tuple{values, ds::test::tensor_values(gpu->weight_tensors(ds::DType::F32)),
                        ds::test::tensor_values(gpu->optimizer_tensors())};
    };
    const int64_t before = ds::embedding_update_splits();
    const auto one = run("0");
    EXPECT_EQ(ds::embedding_update_splits(), before);
    const auto two = run("1");
    EXPECT_EQ(ds::embedding_update_splits(), before + 3);  // the split ran in each of the three updating passes
    EXPECT_TRUE(std::get<0>(one) == std::get<0>(two));
    EXPECT_TRUE(std::get<1>(one) == std::get<1>(two));
    EXPECT_TRUE(std::get<2>(one) == std::get<2>(two));
    EXPECT_GT(std::sqrt(std::get<0>(one)[3]), 0.5) << "step 2 should clip";
  }
}

// --gradients bf16 (model/engine.h Gradients::Bf16): each micro-batch's gradients, made in the unit slots, are added
// into the bf16 buffer with the counter-based stochastic rounding. The slots hold the fp32 mode's gradients bitwise
// and the kernel is the host function's (ops::accumulate_grad_bf16), so two micro-batches give exactly the host's
// SR(SR(g1) + g2) of the fp32 mode's g1, g2; in every optimizer state the run (grad-accum 2, clipping on one step)
// repeats bitwise; and it follows the CPU engine's emulation within the GPU bands (loss 1e-2 a step, the first
// step's gradients 5e-2 relative L2).
TEST(CudaEngine, Bf16GradientsAreTheCpuEmulation) {
  DS_SKIP_WITHOUT_GPU();
  namespace S = ds::ops::bf16_state;
  ds::Qwen35Model host = tiny_chunked_host(31);
  const ds::ModelConfig& c = host.config();
  const ds::PackedBatch b1 = make_batch({60, 100, 33}, c.vocab_size, 41), b2 = make_batch({90, 90}, c.vocab_size, 42);
  using ds::test::tensor_values;
  auto engine = [&](const std::string& device, ds::OptimizerState st, ds::Gradients g) {
    ds::GpuPlan plan = ds::GpuPlan::windows(1, std::max(b1.size(), b2.size()), 3);
    plan.optimizer_state = st;
    plan.gradients = g;
    return ds::make_engine(device, host, plan);
  };
  // Each micro-batch's loss scaled by half its own targets (the step's mean over the two).
  auto scale = [](const ds::PackedBatch& b) { return 0.5 / static_cast<double>(b.num_targets()); };
  auto grads_of = [&](const ds::PackedBatch& b) {  // the fp32 mode's gradients of one micro-batch
    auto e = engine("cuda", ds::OptimizerState::Fp32, ds::Gradients::Fp32);
    e->zero_grads();
    e->forward_backward(b, scale(b));
    return tensor_values(e->grad_tensors());
  };
  const std::vector<float> g1 = grads_of(b1), g2 = grads_of(b2);
  std::vector<uint16_t> acc(g1.size(), 0);
  ds::ops::accumulate_grad_bf16(acc.data(), g1.data(), static_cast<int64_t>(acc.size()), S::grad_key(1, 0), 0);
  ds::ops::accumulate_grad_bf16(acc.data(), g2.data(), static_cast<int64_t>(acc.size()), S::grad_key(1, 1), 0);
  std::vector<float> want(acc.size());
  for (size_t i = 0; i < acc.size(); ++i) want[i] = S::widen(acc[i]);

  struct Run {
    std::vector<double> losses, sumsq;
    std::vector<float> first_grads, weights;
  };
  auto train = [&](const std::string& device, ds::OptimizerState st) {
    auto e = engine(device, st, ds::Gradients::Bf16);
    EXPECT_EQ(e->gradients(), ds::Gradients::Bf16);
    Run r;
    ds::ops::AdamWParams ap;
    ap.lr = 3e-3;
    ap.weight_decay = 0.1;
    for (int64_t t = 1; t <= 4; ++t) {
      e->begin_step(t);
      e->zero_grads();
      double loss = e->forward_backward(b1, scale(b1)).loss_sum;
      loss += e->forward_backward(b2, scale(b2)).loss_sum;
      r.losses.push_back(loss);
      r.sumsq.push_back(e->grad_sum_squares());
      if (t == 1) r.first_grads = tensor_values(e->grad_tensors());
      ap.step = t;
      ap.grad_scale = ds::clip_factor(std::sqrt(r.sumsq.back()), t == 3 ? 0.05 : 0.0);
      e->optimizer_step(ap);
    }
    r.weights = tensor_values(e->weight_tensors(ds::DType::F32));
    return r;
  };
  const Run cpu = train("cpu", ds::OptimizerState::Fp32);
  for (const ds::OptimizerState st : {ds::OptimizerState::Fp32, ds::OptimizerState::Bf16, ds::OptimizerState::EightBit}) {
    SCOPED_TRACE(ds::optimizer_state_name(st));
    const Run a = train("cuda", st), b = train("cuda", st);
    EXPECT_EQ(a.losses, b.losses);
    EXPECT_EQ(a.sumsq, b.sumsq);
    EXPECT_TRUE(a.weights == b.weights);
    EXPECT_TRUE(a.first_grads == want);
    EXPECT_NEAR(a.sumsq[0], ds::ops::sum_squares(want.data(), static_cast<int64_t>(want.size())), 1e-9 * a.sumsq[0]);
    EXPECT_GT(std::sqrt(a.sumsq[2]), 0.05) << "step 3 should clip";
    EXPECT_LE(rel_l2(a.first_grads, cpu.first_grads), 5e-2);
    for (size_t t = 0; t < a.losses.size(); ++t)
      EXPECT_NEAR(a.losses[t], cpu.losses[t], 1e-2 * cpu.losses[t]) << "step " << t + 1;
    EXPECT_LT(a.losses.back(), a.losses.front());  // it trains
  }
}

}  // namespace

#endif  // DELTASTACK_CUDA
