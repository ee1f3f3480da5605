// Generation on the GPU engine (model/generate.h's prefix_logits over Engine::last_logits) against the CPU model on
// the HF fixture (tests/fixtures/hf_qwen35_tiny_a): the last position's logits within the 1e-2 logits band
// (docs/cuda_backend.md), greedy ids equal to the CPU's carried-state decode, no gradient written, the plan's
// limit an error; and `deltastack generate --device cuda` printing the CPU's greedy text.
#ifdef DELTASTACK_CUDA

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/error.h"
#include "cuda_test_util.h"
#include "model/config.h"
#include "model/engine.h"
#include "model/generate.h"
#include "model/model.h"
#include "test_util.h"
#include "train_test_util.h"

namespace {

using ds::test::error_of;
using ds::test::fixture;
using ds::test::rel_l2;

// "N5L1S1J7J9" in the bundled tokenizer: ids inside the fixture's 256-id vocabulary, chosen (among random
// letter-digit prompts) for the CPU's large top-1 margins over the next 8 greedy tokens (>= 0.37 x the logits' RMS).
const std::vector<int32_t> kPrompt = {45, 20, 43, 16, 50, 16, 41, 22, 41, 24};
constexpr int64_t kNew = 8;

ds::PackedBatch one_document(const std::vector<int32_t>& ids) {
  ds::PackedBatch b;
  b.input_ids = ids;
  b.targets.assign(ids.size(), -100);
  b.cu_seqlens = {0, static_cast<int32_t>(ids.size())};
  b.finalize("test");
  return b;
}

TEST(CudaGenerate, LastLogitsAndGreedyIdsMatchCpu) {
  DS_SKIP_WITHOUT_GPU();
  const std::string fx = fixture("hf_qwen35_tiny_a");
  ds::Qwen35Model cpu(ds::ModelConfig::from_file(fx));
  cpu.load(fx);
  ds::Qwen35Model host(ds::ModelConfig::from_file(fx), ds::Qwen35Model::Deferred{});
  host.defer_load(fx);
  const int64_t total = static_cast<int64_t>(kPrompt.size()) + kNew;
  std::unique_ptr<ds::Engine> gpu = ds::make_engine("cuda", std::move(host), ds::GpuPlan::forward_windows(1, total, 1));
  ASSERT_EQ(gpu->device(), "cuda");

  ds::GenerateOptions o;
  o.sampling = {0.0, 0, 1.0};
  o.max_new_tokens = kNew;
  o.usable = cpu.config().vocab_size;
  const std::vector<int32_t> want = ds::generate_tokens(ds::decode_logits(cpu), kPrompt, o);
  ASSERT_EQ(static_cast<int64_t>(want.size()), kNew);

  // Per step, on the CPU's sequence so far: the GPU's logits within the band of the CPU's. With rel. L2 <= 1e-2 no
  // two logits can move by more than sqrt(2) x 1e-2 x ||logits||, so where the CPU's top-1 margin exceeds that
  // (checked here: the premise that makes the ids below a test that cannot flake) the GPU's argmax is the CPU's.
  gpu->zero_grads();
  std::vector<int32_t> ids = kPrompt;
  for (int64_t step = 0; step <= kNew; ++step) {
    SCOPED_TRACE("after " + std::to_string(ids.size()) + " tokens");
    const ds::PackedBatch b = one_document(ids);
    const std::vector<float> ref = cpu.last_logits(b), got = gpu->last_logits(b);
    ASSERT_EQ(got.size(), ref.size());
    EXPECT_LE(rel_l2(got, ref), 1e-2);
    EXPECT_EQ(gpu->last_logits(b), got) << "the same forward twice is bitwise the same";
    if (step == kNew) break;
    std::vector<float> sorted = ref;
    std::partial_sort(sorted.begin(), sorted.begin() + 2, sorted.end(), std::greater<float>());
    double norm = 0;
    for (float x : ref) norm += static_cast<double>(x) * x;
    ASSERT_GT(sorted[0] - sorted[1], std::sqrt(2.0) * 1e-2 * std::sqrt(norm)) << "the fixture's margin premise";
    const int32_t top = static_cast<int32_t>(std::max_element(ref.begin(), ref.end()) - ref.begin());
    ASSERT_EQ(top, want[static_cast<size_t>(step)]) << "the CPU's decode state and its whole-prefix forward agree";
    ids.push_back(top);
  }
  EXPECT_EQ(ds::generate_tokens(ds::prefix_logits(*gpu), kPrompt, o), want);
  EXPECT_EQ(gpu->grad_sum_squares(), 0.0) << "last_logits writes no gradient";

  // One token past the plan (sized for the prompt + kNew): an error naming the plan, not a write past it.
  ids.push_back(0);
  EXPECT_NE(error_of([&] { gpu->last_logits(one_document(ids)); }).find("exceeds the plan"), std::string::npos);
}

// The command line on the GPU: --device cuda prints the same greedy text as --device cpu (the margins above), and
// so does --device auto (the GPU engine when present). The output is compared from the prompt on (the GPU engine's
// log lines on stderr come before it).
// The fixture's vocab_size is 256, and a tokenizer with more ids than the model is refused (data/dataset.cpp), so
// the command takes the Qwen3 tokenizer cut to its 256 single-byte tokens (ids 0..255, no merges: every merge of
// the full vocab makes an id past 255, no added tokens): the prompt's ids are those the full tokenizer gives it.
std::string byte_tokenizer(const std::string& dir) {
  nlohmann::json t = nlohmann::json::parse(ds::read_file(ds::test::data_path("qwen3_tokenizer/tokenizer.json")));
  nlohmann::json vocab = nlohmann::json::object();
  for (const auto& [piece, id] : t["model"]["vocab"].items())
    if (id.get<int64_t>() < 256) vocab[piece] = id;
  t["model"]["vocab"] = vocab;
  t["model"]["merges"] = nlohmann::json::array();
  t["added_tokens"] = nlohmann::json::array();
  const std::string path = dir + "/tokenizer.json";
  ds::write_file_atomic(path, t.dump());
  return path;
}

TEST(CudaGenerate, CommandLineMatchesCpu) {
  DS_SKIP_WITHOUT_GPU();
  const std::string dir = ds::test::fresh_tmpdir("cuda_generate_cli");
  const std::string g = "generate --threads 1 --temperature 0 --max-new-tokens 8 --prompt N5L1S1J7J9 --model " +
                        fixture("hf_qwen35_tiny_a") + " --tokenizer " + byte_tokenizer(dir);
  auto reply = [](const std::string& out) {
    const size_t at = out.find("N5L1S1J7J9");
    return at == std::string::npos ? "(no prompt in) " + out : out.substr(at);
  };
  std::string cpu, cuda, autod;
  ASSERT_EQ(ds::test::run(g + " --device cpu", &cpu), 0) << cpu;
  ASSERT_EQ(ds::test::run(g + " --device cuda", &cuda), 0) << cuda;
  ASSERT_EQ(ds::test::run(g, &autod), 0) << autod;
  EXPECT_GT(reply(cpu).size(), std::string("N5L1S1J7J9\n").size()) << cpu;
  EXPECT_EQ(reply(cuda), reply(cpu)) << cuda;
  EXPECT_EQ(reply(autod), reply(cpu)) << autod;
  EXPECT_NE(cuda.find("gpu: "), std::string::npos) << "the GPU engine's line: " << cuda;
  EXPECT_NE(autod.find("gpu: "), std::string::npos) << "auto picks the GPU: " << autod;
  std::filesystem::remove_all(dir);
}

}  // namespace

#endif  // DELTASTACK_CUDA
