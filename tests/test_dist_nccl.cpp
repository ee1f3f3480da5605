// The GPU engine's NCCL communicator (src/dist/nccl.cpp, docs/distributed.md):
//   * everywhere: a launch of the GPU engine whose NCCL library cannot be opened stops with the library named and
//     exit 1, before --out is made;
//   * on a GPU (skipped without one): the communicator at world size 1 under torchrun's variables: host values
//     staged through the GPU come back exactly (sizes past the staging buffer too), device collectives are the
//     identity (all-reduce in place, reduce-scatter and all-gather into other buffers), and a one-rank `torchrun`
//     training run over NCCL gives the plain run's losses bitwise.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <numeric>
#include <string>
#include <vector>

#include "core/cuda/device.h"
#include "dist/communicator.h"
#include "core/rng.h"
#include "model/gpu_model.h"
#include "model/model.h"
#include "model/safetensors.h"
#include "train_test_util.h"

#ifdef DELTASTACK_CUDA
#include <cuda_runtime.h>

#include "cuda_large_util.h"
#endif

namespace fs = std::filesystem;

namespace {

// torchrun's variables for one rank (MASTER_* as torchrun sets them; unused at world size 1).
struct OneRankTorchrun {
  OneRankTorchrun() {
    for (const auto& [k, v] : vars) ::setenv(k, v, 1);
  }
  ~OneRankTorchrun() {
    for (const auto& [k, v] : vars) ::unsetenv(k);
  }
  static constexpr std::pair<const char*, const char*> vars[] = {
      {"RANK", "0"}, {"WORLD_SIZE", "1"}, {"LOCAL_RANK", "0"}, {"LOCAL_WORLD_SIZE", "1"},
      {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "29533"}};
};

}  // namespace

TEST(DistNccl, AMissingNcclLibraryIsNamed) {
  if (!ds::dist::have_nccl()) GTEST_SKIP() << "built without nccl.h";
  const std::string dir = ds::test::fresh_tmpdir("nccl_missing");
  std::string args = ds::test::small_setup(dir);
  args.replace(args.find("--device cpu"), 12, "--device cuda");
  std::string out;
  int rc = 0;
  {
    OneRankTorchrun env;
    ::setenv("DELTASTACK_NCCL_LIBRARY", "/nonexistent/libnccl.so.2", 1);
    rc = ds::test::run("train " + args + " --steps 1 --out " + dir + "/o", &out);
    ::unsetenv("DELTASTACK_NCCL_LIBRARY");
  }
  EXPECT_EQ(rc, 1);
  EXPECT_NE(out.find("cannot open NCCL (/nonexistent/libnccl.so.2)"), std::string::npos) << out;
  EXPECT_FALSE(fs::exists(dir + "/o")) << "--out made before the communicator failed";
  fs::remove_all(dir);
}

#ifdef DELTASTACK_CUDA

TEST(DistNccl, OneRankCollectivesAreExact) {
  if (ds::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  if (!ds::dist::have_nccl()) GTEST_SKIP() << "built without nccl.h";
  ds::dist::LaunchInfo l;
  l.launcher = "torchrun";
  l.master_addr = "127.0.0.1";
  l.master_port = 29533;
  std::unique_ptr<ds::dist::Communicator> c = ds::dist::open_communicator(l, "cuda");
  ASSERT_TRUE(c->on_device());
  EXPECT_EQ(c->backend().rfind("nccl ", 0), 0u) << c->backend();
  // Host values, more than the 1 MiB staging buffer holds: every element comes back with its own bits.
  std::vector<double> d(300000);
  for (size_t i = 0; i < d.size(); ++i) d[i] = 1.0 / static_cast<double>(i + 3) - 1e300 * (i % 7 == 0);
  const std::vector<double> d0 = d;
  c->all_reduce_sum(d.data(), static_cast<int64_t>(d.size()));
  EXPECT_EQ(d, d0);
  std::vector<int64_t> k = {-5, 1LL << 60, 7};
  c->all_reduce_max(k.data(), 3);
  EXPECT_EQ(k, (std::vector<int64_t>{-5, 1LL << 60, 7}));
  std::string s(3 << 20, 'x');
  for (size_t i = 0; i < s.size(); ++i) s[i] = static_cast<char>(i * 131 % 251);
  const std::string s0 = s;
  c->broadcast(s.data(), static_cast<int64_t>(s.size()), 0);
  EXPECT_EQ(s, s0);
  c->barrier();
  // Device buffers on a stream of ours.
  const int64_t n = 1000003;
  std::vector<float> h(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) h[static_cast<size_t>(i)] = std::ldexp(static_cast<float>(i % 977) - 488.f, -(i % 40));
  float *x = nullptr, *y = nullptr;
  cudaStream_t st = nullptr;
  ASSERT_EQ(cudaStreamCreate(&st), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&x, n * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&y, n * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(x, h.data(), n * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
  std::vector<float> back(static_cast<size_t>(n));
  auto download = [&](const float* p) {
    EXPECT_EQ(cudaStreamSynchronize(st), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(back.data(), p, n * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
    return back;
  };
  c->device_all_reduce_sum(x, n, st);
  EXPECT_EQ(download(x), h);
  ASSERT_EQ(cudaMemset(y, 0, n * sizeof(float)), cudaSuccess);
  c->device_reduce_scatter_sum(x, y, n, st);
  EXPECT_EQ(download(y), h);
  ASSERT_EQ(cudaMemset(y, 0, n * sizeof(float)), cudaSuccess);
  c->device_all_gather(x, y, n * static_cast<int64_t>(sizeof(float)), st);
  EXPECT_EQ(download(y), h);
  cudaFree(x);
  cudaFree(y);
  cudaStreamDestroy(st);
}

// Every tensor of two safetensors files, byte for byte (names, dtypes, shapes, payloads).
void expect_same_tensors(const std::string& a, const std::string& b) {
  const ds::SafetensorsReader x(a), y(b);
  ASSERT_EQ(x.tensors().size(), y.tensors().size()) << a << " vs " << b;
  for (const ds::TensorInfo& t : x.tensors()) {
    const ds::TensorInfo* u = y.find(t.name);
    ASSERT_NE(u, nullptr) << t.name;
    EXPECT_EQ(t.dtype, u->dtype) << t.name;
    EXPECT_EQ(t.shape, u->shape) << t.name;
    EXPECT_TRUE(x.raw_bytes(t.name) == y.raw_bytes(t.name)) << t.name << " differs: " << a << " vs " << b;
  }
}

// The whole data-parallel path (communicator from the launch, gradients reduced on the step's stream) at world
// size 1 against the plain run, in both optimizer-state layouts: --shard none (all-reduce) and --shard optimizer
// (the plan built for one share, the in-place reduce-scatter, the share's AdamW, the in-place all-gathers, the
// state gathered for the save) give the plain run's losses, grad norms and checkpoint tensors bit for bit, and
// the sharded run's checkpoint resumes as a plain run bitwise.
TEST(DistNccl, OneRankTorchrunTrainsThePlainRunsLosses) {
  if (ds::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  if (!ds::dist::have_nccl()) GTEST_SKIP() << "built without nccl.h";
  const std::string dir = ds::test::fresh_tmpdir("nccl_train");
  std::string base = ds::test::small_setup(dir);
  base.replace(base.find("--device cpu"), 12, "--device cuda");
  // Head dims the GPU kernels take (small_setup's 8 are the CPU engine's).
  nlohmann::json c = nlohmann::json::parse(ds::read_file(dir + "/config.json"));
  c["head_dim"] = 32;
  c["linear_key_head_dim"] = c["linear_value_head_dim"] = 16;
  ds::write_file_atomic(dir + "/config.json", c.dump());
  base += " --steps 6 --grad-accum 2 --save-interval 3 --clip 0.05";
  for (const std::string state : {"fp32", "bf16"}) {
    const std::string args = base + " --optimizer-state " + state, d = dir + "/" + state;
    std::string out;
    ASSERT_EQ(ds::test::run("train " + args + " --out " + d + "/plain", &out), 0) << out;
    for (const std::string shard : {"none", "optimizer"}) {
      {
        OneRankTorchrun env;
        ASSERT_EQ(ds::test::run("train " + args + " --shard " + shard + " --out " + d + "/" + shard, &out), 0) << out;
      }
      EXPECT_NE(out.find("nccl"), std::string::npos) << out;
      const std::vector<nlohmann::json> a = ds::test::metrics(d + "/plain/metrics.jsonl");
      const std::vector<nlohmann::json> b = ds::test::metrics(d + "/" + shard + "/metrics.jsonl");
      ASSERT_EQ(a.size(), b.size());
      for (size_t i = 0; i < a.size(); ++i)
        for (const char* k : {"step", "loss", "grad_norm", "eval_loss"})
          EXPECT_EQ(a[i].value(k, -1.0), b[i].value(k, -1.0)) << state << " --shard " << shard << " line " << i << " " << k;
      for (const char* f : {"model.safetensors", "optimizer.safetensors"})
        expect_same_tensors(d + "/plain/checkpoint-6/" + f, d + "/" + shard + "/checkpoint-6/" + f);
    }
    // The sharded run's step-3 checkpoint, resumed as one plain process: steps 4..6 of the plain run.
    ASSERT_EQ(ds::test::run("train --resume " + d + "/optimizer/checkpoint-3 --out " + d + "/resumed", &out), 0) << out;
    const std::vector<double> a = ds::test::train_losses(d + "/plain/metrics.jsonl");
    const std::vector<double> c = ds::test::train_losses(d + "/resumed/metrics.jsonl");
    ASSERT_EQ(c.size(), 3u) << state;
    EXPECT_EQ(std::vector<double>(a.begin() + 3, a.end()), c) << state;
  }
  fs::remove_all(dir);
}

// The overlap of the data-parallel sum with the last backward (GpuModel::reduce_grads_during_next_backward): each
// unit's gradients are handed over once, complete, on a side stream ordered after their last write. The "sum over
// ranks" here is x *= 2 on that stream (two identical ranks): after two micro-batches, the second one's backward
// overlapped, the gradients must be exactly twice the plain run's, every element; a unit handed over before its
// last write, twice, or never would differ. Tied and untied embeddings (the tied lm_head writes the embedding unit
// first, its lookup last), the chunked GDN kernel.
TEST(DistNccl, OverlappedReduceSeesEachUnitsFinalGradients) {
  if (ds::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  for (const bool tied : {false, true}) {
    ds::ModelConfig c = ds::ModelConfig::preset("tiny");
    c.vocab_size = 4096;
    c.tie_word_embeddings = tied;
    c.linear_key_head_dim = c.linear_value_head_dim = 128;
    ds::Qwen35Model host(c);
    host.init_weights(7);
    auto batch = [&](uint64_t seed) {
      ds::PackedBatch b;
      ds::Rng rng(seed);
      b.cu_seqlens = {0, 150, 257};
      for (int t = 0; t < 257; ++t) b.input_ids.push_back(static_cast<int32_t>(rng.below(4096)));
      for (int t = 0; t < 257; ++t) b.targets.push_back(t + 1 < 257 && t != 149 ? b.input_ids[t + 1] : -100);
      b.finalize("overlap test batch");
      return b;
    };
    const ds::PackedBatch b1 = batch(1), b2 = batch(2);
    ds::GpuPlan plan;
    plan.max_tokens = 257;
    plan.max_seqs = 2;
    std::vector<float> plain, overlapped;
    {
      ds::GpuModel gpu(host, plan);
      gpu.zero_grads();
      gpu.forward_backward(b1, 1e-2);
      gpu.forward_backward(b2, 1e-2);
      EXPECT_FALSE(gpu.join_reduce());
      gpu.download_grads(plain);
    }
    std::vector<std::pair<int64_t, int64_t>> handed;
    {
      ds::GpuModel gpu(host, plan);
      gpu.zero_grads();
      gpu.forward_backward(b1, 1e-2);
      const float* base = gpu.device_grads().data;
      gpu.reduce_grads_during_next_backward([&](float* x, int64_t n, void* stream) {
        handed.emplace_back(x - base, n);
        ds::test::cuda::scale(x, n, 2.0f, static_cast<cudaStream_t>(stream));
      });
      gpu.forward_backward(b2, 1e-2);
      EXPECT_TRUE(gpu.join_reduce());
      gpu.download_grads(overlapped);
    }
    // The head first, the layers from the last, the embedding last; together they tile the buffer once.
    const std::vector<ds::ParamUnit> units = ds::param_units(c, ds::qwen35_params(c));
    ASSERT_EQ(handed.size(), units.size());
    EXPECT_EQ(handed.front().first, units.back().lo);
    EXPECT_EQ(handed.back().first, 0);
    std::sort(handed.begin(), handed.end());
    int64_t next = 0;
    for (const auto& [lo, n] : handed) {
      EXPECT_EQ(lo, next);
      next = lo + n;
    }
    EXPECT_EQ(next, static_cast<int64_t>(plain.size()));
    ASSERT_EQ(plain.size(), overlapped.size());
    size_t wrong = 0;
    for (size_t i = 0; i < plain.size(); ++i) wrong += overlapped[i] != 2.0f * plain[i];
    EXPECT_EQ(wrong, 0u) << (tied ? "tied" : "untied") << " embeddings";
  }
}

#endif  // DELTASTACK_CUDA
