// The GPU engine's NCCL communicator (src/dist/nccl.cpp, docs/distributed.md):
//   * everywhere: a launch of the GPU engine whose NCCL library cannot be opened stops with the library named and
//     exit 1, before --out is made;
//   * on a GPU (skipped without one): the communicator at world size 1 under torchrun's variables: host values
//     staged through the GPU come back exactly (sizes past the staging buffer too), device collectives are the
//     identity (all-reduce in place, reduce-scatter and all-gather into other buffers), and a one-rank `torchrun`
//     training run over NCCL gives the plain run's losses bitwise.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <numeric>
#include <string>
#include <vector>

#include "core/cuda/device.h"
#include "dist/communicator.h"
#include "train_test_util.h"

#ifdef DELTASTACK_CUDA
#include <cuda_runtime.h>
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

// The whole data-parallel path (communicator from the launch, the gradients all-reduced on the step's stream)
// at world size 1 against the plain run: the same bits.
TEST(DistNccl, OneRankTorchrunTrainsThePlainRunsLosses) {
  if (ds::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  if (!ds::dist::have_nccl()) GTEST_SKIP() << "built without nccl.h";
  const std::string dir = ds::test::fresh_tmpdir("nccl_train");
  std::string args = ds::test::small_setup(dir);
  args.replace(args.find("--device cpu"), 12, "--device cuda");
  args += " --steps 6 --grad-accum 2";
  std::string out;
  ASSERT_EQ(ds::test::run("train " + args + " --out " + dir + "/plain", &out), 0) << out;
  {
    OneRankTorchrun env;
    ASSERT_EQ(ds::test::run("train " + args + " --out " + dir + "/nccl", &out), 0) << out;
  }
  EXPECT_NE(out.find("nccl"), std::string::npos) << out;
  const std::vector<double> a = ds::test::train_losses(dir + "/plain/metrics.jsonl");
  const std::vector<double> b = ds::test::train_losses(dir + "/nccl/metrics.jsonl");
  ASSERT_EQ(a.size(), 6u);
  EXPECT_EQ(a, b);
  fs::remove_all(dir);
}

#endif  // DELTASTACK_CUDA
