// Several ranks (src/dist, docs/distributed.md):
//   * the launch variables of mpirun and torchrun, and the errors for bad ones (no MPI needed);
//   * with Open MPI (DELTASTACK_MPI builds, mpirun on the PATH): `mpirun -np 2 deltastack train` on the CPU engine
//     against one rank with twice the --grad-accum: the same windows in the same order, so every loss, eval loss and
//     grad norm agrees to 1e-6 (only the order of the gradient sum over ranks differs), with --shard none, optimizer
//     and full; a resume 2 -> 1 -> 2 ranks continues the same run (also fully sharded); a failing rank stops every
//     rank with that rank named, never a hang.
#include <gtest/gtest.h>
#include <functional>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <map>
#include <string>
#include <thread>

#include "core/error.h"
#include "core/files.h"
#include "dist/launch.h"
#include "model/safetensors.h"
#include "train_test_util.h"

namespace fs = std::filesystem;
using ds::dist::detect_launch;
using ds::dist::LaunchInfo;

namespace {

ds::dist::GetEnv env_of(std::map<std::string, std::string> m) {
  return [m](const std::string& k) -> std::optional<std::string> {
    auto it = m.find(k);
    if (it == m.end()) return std::nullopt;
    return it->second;
  };
}

std::string error_of(const std::map<std::string, std::string>& m) {
  try {
    detect_launch(env_of(m));
  } catch (const ds::Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(DistLaunch, SingleMpirunAndTorchrun) {
  LaunchInfo l = detect_launch(env_of({}));
  EXPECT_EQ(l.launcher, "single");
  EXPECT_EQ(l.world, 1);
  EXPECT_EQ(ds::dist::describe(l), "single process");

  l = detect_launch(env_of({{"OMPI_COMM_WORLD_SIZE", "4"}, {"OMPI_COMM_WORLD_RANK", "3"},
                            {"OMPI_COMM_WORLD_LOCAL_RANK", "1"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}}));
  EXPECT_EQ(l.launcher, "mpirun");
  EXPECT_EQ(l.world, 4);
  EXPECT_EQ(l.rank, 3);
  EXPECT_EQ(l.local_rank, 1);
  EXPECT_EQ(l.local_world, 2);
  EXPECT_EQ(ds::dist::describe(l), "rank 3 of 4 (mpirun, local rank 1 of 2)");

  l = detect_launch(env_of({{"WORLD_SIZE", "8"}, {"RANK", "5"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "4"},
                            {"MASTER_ADDR", "10.0.0.1"}, {"MASTER_PORT", "29500"}}));
  EXPECT_EQ(l.launcher, "torchrun");
  EXPECT_EQ(l.world, 8);
  EXPECT_EQ(l.rank, 5);
  EXPECT_EQ(l.local_rank, 1);
  EXPECT_EQ(l.local_world, 4);
  EXPECT_EQ(l.master_addr, "10.0.0.1");
  EXPECT_EQ(l.master_port, 29500);

  // Open MPI's variables win over torchrun's (the processes are MPI's).
  l = detect_launch(env_of({{"OMPI_COMM_WORLD_SIZE", "2"}, {"OMPI_COMM_WORLD_RANK", "1"}, {"WORLD_SIZE", "8"},
                            {"RANK", "7"}}));
  EXPECT_EQ(l.launcher, "mpirun");
  EXPECT_EQ(l.rank, 1);
  EXPECT_EQ(l.world, 2);
  EXPECT_EQ(l.local_world, 2);  // unset: the whole world on one host
}

TEST(DistLaunch, BadVariablesNameTheVariable) {
  EXPECT_NE(error_of({{"OMPI_COMM_WORLD_SIZE", "two"}}).find("OMPI_COMM_WORLD_SIZE=\"two\" is not"), std::string::npos)
      << error_of({{"OMPI_COMM_WORLD_SIZE", "two"}});
  EXPECT_NE(error_of({{"OMPI_COMM_WORLD_SIZE", "2"}, {"OMPI_COMM_WORLD_RANK", "2"}})
                .find("OMPI_COMM_WORLD_RANK=2 is not below OMPI_COMM_WORLD_SIZE=2"),
            std::string::npos);
  EXPECT_NE(error_of({{"WORLD_SIZE", "2"}}).find("WORLD_SIZE is set but RANK is not"), std::string::npos);
  EXPECT_NE(error_of({{"RANK", "0"}}).find("RANK is set but WORLD_SIZE is not"), std::string::npos);
  EXPECT_NE(error_of({{"WORLD_SIZE", "0"}, {"RANK", "0"}}).find("WORLD_SIZE=0 must be at least 1"), std::string::npos);
  EXPECT_NE(error_of({{"WORLD_SIZE", "4"}, {"RANK", "1"}, {"LOCAL_RANK", "3"}, {"LOCAL_WORLD_SIZE", "2"}})
                .find("LOCAL_RANK=3 is not below LOCAL_WORLD_SIZE=2"),
            std::string::npos);
  EXPECT_NE(error_of({{"WORLD_SIZE", "-1"}, {"RANK", "0"}}).find("WORLD_SIZE=\"-1\""), std::string::npos);
}

// Every command but train refuses several ranks (one process writes its outputs).
TEST(DistLaunch, OnlyTrainRunsOnSeveralRanks) {
  const std::string dir = ds::test::fresh_tmpdir("dist_only_train");
  ::setenv("WORLD_SIZE", "2", 1);
  ::setenv("RANK", "1", 1);
  std::string out;
  const int rc = ds::test::run("probe", &out);
  const int rc_train = ds::test::run("train " + ds::test::small_setup(dir) + " --steps 1 --out " + dir + "/o", &out);
  ::unsetenv("WORLD_SIZE");
  ::unsetenv("RANK");
  EXPECT_EQ(rc, 1);
  EXPECT_EQ(rc_train, 1);
  EXPECT_NE(out.find("torchrun started 2 ranks"), std::string::npos) << out;
  EXPECT_NE(out.find("mpirun -np 2"), std::string::npos) << out;
  // A stray RANK (set by some other tool) is no launch: other commands ignore it, train names it.
  ::setenv("RANK", "3", 1);
  const int rc_probe = ds::test::run("probe", &out);
  const int rc_stray = ds::test::run("train " + ds::test::small_setup(dir) + " --steps 1 --out " + dir + "/o2", &out);
  ::unsetenv("RANK");
  EXPECT_EQ(rc_probe, 0);
  EXPECT_EQ(rc_stray, 1);
  EXPECT_NE(out.find("RANK is set but WORLD_SIZE is not"), std::string::npos) << out;
  fs::remove_all(dir);
}

#ifdef DELTASTACK_MPIEXEC

namespace {

// `mpirun -np N deltastack <args>` (shared-memory transport, no binding; as root where the tests run as root),
// output in *log; the exit code, or -1 when it had to be killed after `timeout_s` (a hang).
// `during(mpirun's pid)`, when given, runs while the job does (e.g. to signal it).
int run_mpi(int np, const std::string& args, std::string* log, int timeout_s = 120,
            const std::function<void(pid_t)>& during = nullptr) {
  const std::string path = ds::test::fresh_tmpdir("dist_mpi_log") + "/log";
  std::string mpirun = std::string(DELTASTACK_MPIEXEC) + " -np " + std::to_string(np) +
                       " --oversubscribe --bind-to none --mca btl self,vader --mca btl_vader_single_copy_mechanism none";
  if (::geteuid() == 0) mpirun += " --allow-run-as-root";
  const pid_t pid = ds::test::spawn(args, path, mpirun, /*own_group=*/true);
  int st = 0;
  const auto t0 = std::chrono::steady_clock::now();
  if (during) during(pid);
  while (::waitpid(pid, &st, WNOHANG) == 0) {
    if (std::chrono::steady_clock::now() - t0 > std::chrono::seconds(timeout_s)) {
      ::kill(-pid, SIGKILL);
      ::waitpid(pid, &st, 0);
      *log = ds::read_file(path);
      return -1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  *log = ds::read_file(path);
  return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

struct Rec {
  std::map<int64_t, double> loss, gnorm, eval;
};
Rec records(const std::string& metrics) {
  Rec r;
  for (const auto& j : ds::test::metrics(metrics)) {
    const int64_t s = j.at("step").get<int64_t>();
    if (j.contains("loss")) r.loss[s] = j["loss"].get<double>(), r.gnorm[s] = j["grad_norm"].get<double>();
    if (j.contains("eval_loss")) r.eval[s] = j["eval_loss"].get<double>();
  }
  return r;
}
void expect_close(const std::map<int64_t, double>& a, const std::map<int64_t, double>& b, const char* what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (const auto& [s, x] : a) {
    ASSERT_TRUE(b.count(s)) << what << " step " << s;
    EXPECT_LE(std::abs(x - b.at(s)), 1e-6 * std::abs(x)) << what << " step " << s << ": " << x << " vs " << b.at(s);
  }
}

}  // namespace

// 2 ranks x grad-accum 2 = 1 rank x grad-accum 4: the same windows per step, so the same run up to the order of
// the gradient sum over ranks.
TEST(DistMpi, TwoRanksEqualOneRankWithTheirGradAccum) {
  const std::string dir = ds::test::fresh_tmpdir("dist_equal");
  const std::string common = ds::test::small_setup(dir) + " --steps 6 --eval-interval 3 --eval-batches 3 --threads 1";
  std::string log1, log2;
  ASSERT_EQ(ds::test::run("train " + common + " --grad-accum 4 --out " + dir + "/one", &log1), 0) << log1;
  ASSERT_EQ(run_mpi(2, "train " + common + " --grad-accum 2 --out " + dir + "/two", &log2), 0) << log2;
  std::string log3;
  ASSERT_EQ(run_mpi(2, "train " + common + " --grad-accum 2 --shard optimizer --out " + dir + "/sharded", &log3), 0)
      << log3;
  EXPECT_NE(log3.find("2 ranks (mpirun), --shard optimizer"), std::string::npos) << log3;
  std::string log4;
  ASSERT_EQ(run_mpi(2, "train " + common + " --grad-accum 2 --shard full --out " + dir + "/full", &log4), 0) << log4;
  EXPECT_NE(log4.find("2 ranks (mpirun), --shard full"), std::string::npos) << log4;
  EXPECT_NE(log4.find("--shard full: rank 0 keeps"), std::string::npos) << log4;
  const Rec a = records(dir + "/one/metrics.jsonl"), b = records(dir + "/two/metrics.jsonl"),
            c = records(dir + "/sharded/metrics.jsonl"), f = records(dir + "/full/metrics.jsonl");
  EXPECT_EQ(a.loss.size(), 6u);
  expect_close(a.loss, b.loss, "loss");
  expect_close(a.gnorm, b.gnorm, "grad_norm");
  expect_close(a.eval, b.eval, "eval_loss");
  // The sharded optimizer state: the same run (each rank updates its share of the parameters, then gathers).
  expect_close(a.loss, c.loss, "loss, --shard optimizer");
  expect_close(a.gnorm, c.gnorm, "grad_norm, --shard optimizer");
  expect_close(a.eval, c.eval, "eval_loss, --shard optimizer");
  // Everything sharded, the weights gathered per layer: the same run again.
  expect_close(a.loss, f.loss, "loss, --shard full");
  expect_close(a.gnorm, f.gnorm, "grad_norm, --shard full");
  expect_close(a.eval, f.eval, "eval_loss, --shard full");
  // Their checkpoints hold the whole moments (and weights: gathered), so they are the same files (HF names, shapes,
  // dtypes) up to the rounding above.
  auto expect_same_file = [&](const std::string& x_path, const std::string& y_path) {
    ds::SafetensorsReader m1(x_path), m3(y_path);
    ASSERT_EQ(m1.tensors().size(), m3.tensors().size()) << y_path;
    double num = 0, den = 0;
    for (const auto& t : m1.tensors()) {
      ASSERT_TRUE(m3.has(t.name)) << y_path << ": " << t.name;
      EXPECT_EQ(m3.find(t.name)->shape, t.shape) << t.name;
      EXPECT_EQ(m3.find(t.name)->dtype, t.dtype) << t.name;
      const std::vector<float> x = m1.read_f32(t.name), y = m3.read_f32(t.name);
      ASSERT_EQ(x.size(), y.size()) << t.name;
      for (size_t i = 0; i < x.size(); ++i) num += (double(x[i]) - y[i]) * (double(x[i]) - y[i]), den += double(x[i]) * x[i];
    }
    EXPECT_LE(std::sqrt(num / den), 1e-5) << y_path;
  };
  expect_same_file(dir + "/one/checkpoint-6/optimizer.safetensors", dir + "/sharded/checkpoint-6/optimizer.safetensors");
  expect_same_file(dir + "/one/checkpoint-6/optimizer.safetensors", dir + "/full/checkpoint-6/optimizer.safetensors");
  expect_same_file(dir + "/one/checkpoint-6/model.safetensors", dir + "/full/checkpoint-6/model.safetensors");
  EXPECT_EQ(ds::read_file(dir + "/one/checkpoint-6/config.json"), ds::read_file(dir + "/full/checkpoint-6/config.json"));
  // Rank 0 alone writes: one metrics line per record, one progress line per step, no second rank's log.
  EXPECT_EQ(ds::test::metrics(dir + "/two/metrics.jsonl").size(), ds::test::metrics(dir + "/one/metrics.jsonl").size());
  EXPECT_NE(log2.find("2 ranks (mpirun)"), std::string::npos) << log2;
  size_t n = 0;
  for (size_t p = log2.find("step     6/6 | loss"); p != std::string::npos; p = log2.find("step     6/6 | loss", p + 1))
    ++n;
  EXPECT_EQ(n, 1u) << log2;
  fs::remove_all(dir);
}

namespace {

// 2 ranks with --shard `first` for 2 steps, resumed on 1 rank to step 4 (grad-accum doubled: the same micro-batches
// per step), then on 2 ranks with --shard `last` to step 6: every step's loss within 1e-6 of the uninterrupted
// 2-rank run with --shard `first`. The last leg's output in *log.
void expect_resume_two_one_two(const std::string& dir, const std::string& common, const std::string& first,
                               const std::string& last, std::string* log) {
  ASSERT_EQ(run_mpi(2, "train " + common + " --steps 6 --grad-accum 1 --save-interval 2 --shard " + first + " --out " +
                           dir + "/ref", log), 0) << *log;
  ASSERT_EQ(run_mpi(2, "train " + common + " --steps 2 --grad-accum 1 --shard " + first + " --out " + dir + "/a", log),
            0) << *log;
  ASSERT_EQ(ds::test::run("train --resume " + dir + "/a/checkpoint-2 --steps 4 --threads 1 --out " + dir + "/b", log),
            0) << *log;
  EXPECT_NE(log->find("--grad-accum 1 -> 2 per rank"), std::string::npos) << *log;
  ASSERT_EQ(run_mpi(2, "train --resume " + dir + "/b/checkpoint-4 --steps 6 --threads 1 --shard " + last + " --out " +
                           dir + "/c", log), 0) << *log;
  EXPECT_NE(log->find("--grad-accum 2 -> 1 per rank"), std::string::npos) << *log;
  const Rec ref = records(dir + "/ref/metrics.jsonl");
  Rec got = records(dir + "/a/metrics.jsonl");
  for (const char* d : {"/b/metrics.jsonl", "/c/metrics.jsonl"})
    for (const auto& [s, l] : records(dir + d).loss) got.loss[s] = l;
  EXPECT_EQ(got.loss.size(), 6u);
  expect_close(ref.loss, got.loss, "loss");
}

}  // namespace

// LoRA (docs/lora.md) with dropout: 2 ranks x grad-accum 2 = 1 rank x grad-accum 4 (the adapters' gradients summed
// over the ranks, each micro-batch's dropout masks drawn from its global index, so the same as one rank's).
TEST(DistMpi, LoraTwoRanksEqualOneRank) {
  const std::string dir = ds::test::fresh_tmpdir("dist_lora");
  const std::string common = ds::test::small_setup(dir) + " --steps 4 --eval-interval 2 --eval-batches 3 --threads 1"
                             " --lora-rank 4 --lora-dropout 0.2 --lr 0.05";
  std::string log1, log2;
  ASSERT_EQ(ds::test::run("train " + common + " --grad-accum 4 --out " + dir + "/one", &log1), 0) << log1;
  ASSERT_EQ(run_mpi(2, "train " + common + " --grad-accum 2 --out " + dir + "/two", &log2), 0) << log2;
  const Rec a = records(dir + "/one/metrics.jsonl"), b = records(dir + "/two/metrics.jsonl");
  EXPECT_EQ(a.loss.size(), 4u);
  expect_close(a.loss, b.loss, "loss");
  expect_close(a.gnorm, b.gnorm, "grad_norm");
  expect_close(a.eval, b.eval, "eval_loss");
  EXPECT_NE(a.eval.begin()->second, a.eval.rbegin()->second);
  fs::remove_all(dir);
}

// A run saved by 2 ranks resumes on 1 and its checkpoint on 2 again, this time with the optimizer state sharded.
TEST(DistMpi, ResumeTwoToOneToTwoRanks) {
  const std::string dir = ds::test::fresh_tmpdir("dist_resume");
  std::string log;
  expect_resume_two_one_two(dir, ds::test::small_setup(dir) + " --threads 1", "none", "optimizer", &log);
  // An odd world size cannot share 2 micro-batches per step: a clear error before anything runs.
  EXPECT_EQ(run_mpi(3, "train --resume " + dir + "/a/checkpoint-2 --steps 4 --threads 1 --out " + dir + "/d", &log), 1);
  EXPECT_NE(log.find("which 3 ranks cannot share evenly"), std::string::npos) << log;
  fs::remove_all(dir);
}

// The same with --shard full on both 2-rank legs, and untied embeddings (lm_head a unit of its own): a fully
// sharded run's checkpoint resumes on one rank, and one rank's with every parameter sharded.
TEST(DistMpi, ResumeTwoToOneToTwoRanksFullySharded) {
  const std::string dir = ds::test::fresh_tmpdir("dist_resume_full");
  const std::string common = ds::test::small_setup(dir) + " --threads 1";
  nlohmann::json cfg = nlohmann::json::parse(ds::read_file(dir + "/config.json"));
  cfg["tie_word_embeddings"] = false;
  ds::write_file_atomic(dir + "/config.json", cfg.dump());
  std::string log;
  expect_resume_two_one_two(dir, common, "full", "full", &log);
  EXPECT_NE(log.find("--shard full: rank 0 keeps"), std::string::npos) << log;
  EXPECT_TRUE(ds::SafetensorsReader(dir + "/c/checkpoint-6/model.safetensors").has("lm_head.weight"));
  fs::remove_all(dir);
}

// Chat data in which many windows hold only user text (no label token): a rank whose micro-batch has none adds 0
// to the step's sums (never NaN), and the run still equals one rank's.
TEST(DistMpi, RanksWithoutLabelsAddZero) {
  const std::string dir = ds::test::fresh_tmpdir("dist_nolabel");
  const std::string args = ds::test::small_setup_on(dir, dir + "/chat.jsonl");
  std::string lines;
  for (int i = 0; i < 24; ++i) {
    const std::string user(i % 3 == 0 ? 400 : 20, static_cast<char>('a' + i % 26));
    lines += "{\"messages\": [{\"role\": \"user\", \"content\": \"" + user +
             "\"}, {\"role\": \"assistant\", \"content\": \"answer " + std::to_string(i) + "\"}]}\n";
  }
  ds::write_file_atomic(dir + "/chat.jsonl", lines);
  std::string log1, log2;
  ASSERT_EQ(ds::test::run("train " + args + " --threads 1 --steps 6 --micro-batch 1 --grad-accum 2 --out " + dir +
                              "/one", &log1), 0) << log1;
  ASSERT_EQ(run_mpi(2, "train " + args + " --threads 1 --steps 6 --micro-batch 1 --out " + dir + "/two", &log2), 0)
      << log2;
  std::string log3;
  ASSERT_EQ(run_mpi(2, "train " + args + " --threads 1 --steps 6 --micro-batch 1 --shard full --out " + dir + "/full",
                    &log3), 0)
      << log3;
  const Rec a = records(dir + "/one/metrics.jsonl"), b = records(dir + "/two/metrics.jsonl"),
            f = records(dir + "/full/metrics.jsonl");
  for (const auto& [s, l] : b.loss) EXPECT_TRUE(std::isfinite(l) && l >= 0) << s << " " << l;
  expect_close(a.loss, b.loss, "loss");
  expect_close(a.gnorm, b.gnorm, "grad_norm");
  expect_close(a.loss, f.loss, "loss, --shard full");
  expect_close(a.gnorm, f.gnorm, "grad_norm, --shard full");
  fs::remove_all(dir);
}

// Ranks started with different options or data stop at once, the differing rank named (their replicas would
// drift apart silently).
TEST(DistMpi, RanksWithOtherOptionsOrDataAreRefused) {
  const std::string dir = ds::test::fresh_tmpdir("dist_differ");
  const std::string args = "train " + ds::test::small_setup(dir) + " --threads 1 --steps 2 --out " + dir + "/o";
  std::string log;
  EXPECT_EQ(run_mpi(1, args + " : -np 1 " + std::string(DELTASTACK_BIN) + " " + args + " --lr 1", &log, 60), 1) << log;
  EXPECT_NE(log.find("rank 1 has other options than rank 0 (lr is 1.0 here, 0.003 on rank 0;"), std::string::npos)
      << log;  // issue 25 item 18: the option is named
  ds::write_file_atomic(dir + "/corpus2.txt", ds::read_file(dir + "/corpus.txt").substr(0, 15000));
  const std::string other =
      "train " + ds::test::small_setup_on(dir, dir + "/corpus2.txt") + " --threads 1 --steps 2 --out " + dir + "/o";
  EXPECT_EQ(run_mpi(1, args + " : -np 1 " + std::string(DELTASTACK_BIN) + " " + other, &log, 60), 1) << log;
  EXPECT_NE(log.find("rank 1 has other options than rank 0 (data is [\"" + dir + "/corpus2.txt\"] here, [\"" + dir +
                     "/corpus.txt\"] on rank 0;"), std::string::npos) << log;  // --data is an option
  EXPECT_FALSE(fs::exists(dir + "/o/checkpoint-2"));
  fs::remove_all(dir);
}

// A rank that fails stops the whole run promptly, the error naming the rank; rank 0's checkpoint of step 2 is intact.
TEST(DistMpi, AFailingRankStopsEveryRank) {
  const std::string dir = ds::test::fresh_tmpdir("dist_fail");
  ::setenv("DELTASTACK_TEST_FAIL_RANK", "1:3", 1);
  std::string log;
  const int rc = run_mpi(2, "train " + ds::test::small_setup(dir) + " --threads 1 --steps 6 --save-interval 2 --out " +
                                dir + "/o", &log, 60);
  ::unsetenv("DELTASTACK_TEST_FAIL_RANK");
  EXPECT_NE(rc, 0) << log;
  EXPECT_NE(rc, -1) << "mpirun hung and was killed\n" << log;
  EXPECT_NE(log.find("error on rank 1 of 2: step 3: failure injected"), std::string::npos) << log;
  EXPECT_TRUE(fs::exists(dir + "/o/checkpoint-2/trainer_state.json"));
  EXPECT_FALSE(fs::exists(dir + "/o/checkpoint-4"));
  fs::remove_all(dir);
}

// Stopping a run under mpirun with a checkpoint: mpirun turns SIGINT / SIGTERM into SIGTERM to every rank and
// SIGKILL a second later (Open MPI's odls_base_sigkill_timeout), before a step and a save of any real size end, so
// the run was killed with nothing saved (its temp dir left). mpirun forwards SIGUSR1 as it is: every rank finishes
// the step, rank 0 saves (here a save longer than that second), and all exit 128 + 10.
TEST(DistMpi, SigusrToMpirunSavesACheckpoint) {
  const std::string dir = ds::test::fresh_tmpdir("dist_usr1");
  const std::string out = dir + "/o";
  ::setenv("DELTASTACK_TEST_SAVE_PAUSE_MS", "2500", 1);
  std::string log;
  const int rc = run_mpi(2, "train " + ds::test::small_setup(dir) + " --threads 1 --steps 100000 --out " + out, &log,
                         120, [&](pid_t mpirun) {
                           const auto t0 = std::chrono::steady_clock::now();
                           while (std::chrono::steady_clock::now() - t0 < std::chrono::seconds(60)) {
                             const std::string m = out + "/metrics.jsonl";
                             if (ds::file_exists(m) && ds::read_file(m).find("\"step\":3,") != std::string::npos) break;
                             std::this_thread::sleep_for(std::chrono::milliseconds(20));
                           }
                           ::kill(mpirun, SIGUSR1);
                         });
  ::unsetenv("DELTASTACK_TEST_SAVE_PAUSE_MS");
  EXPECT_EQ(rc, 138) << log;
  EXPECT_NE(log.find("stopped by SIGUSR1 after step"), std::string::npos) << log;
  int64_t saved = -1;
  for (const auto& e : fs::directory_iterator(out)) {
    const std::string n = e.path().filename().string();
    EXPECT_EQ(n.find(".tmp"), std::string::npos) << "left behind: " << n;
    if (n.rfind("checkpoint-", 0) == 0) saved = std::max<int64_t>(saved, std::stoll(n.substr(11)));
  }
  ASSERT_GE(saved, 3) << log;
  EXPECT_TRUE(fs::exists(out + "/checkpoint-" + std::to_string(saved) + "/optimizer.safetensors"));
  EXPECT_EQ(records(out + "/metrics.jsonl").loss.rbegin()->first, saved);
  fs::remove_all(dir);
}

#endif  // DELTASTACK_MPIEXEC

// ---- CPU binding (src/dist/cpu_bind.h) on hwloc synthetic topologies: two packages of four cores.
#ifdef DELTASTACK_HWLOC
#include "dist/cpu_bind.h"

namespace {
LaunchInfo ranks_on_host(int local_rank, int local_world) {
  LaunchInfo l;
  l.launcher = "mpirun";
  l.world = l.local_world = local_world;
  l.rank = l.local_rank = local_rank;
  return l;
}
constexpr const char* kTwoPackages = "pack:2 numa:1 core:4 pu:1";
}  // namespace

TEST(DistCpuBind, RanksShareTheHostByPackageAndGpusGetTheirNumaNode) {
  using ds::dist::plan_cpu_binding;
  EXPECT_EQ(plan_cpu_binding(ranks_on_host(0, 2), "", {}, kTwoPackages).cpus, (std::vector<int>{0, 1, 2, 3}));
  EXPECT_EQ(plan_cpu_binding(ranks_on_host(1, 2), "", {}, kTwoPackages).cpus, (std::vector<int>{4, 5, 6, 7}));
  EXPECT_EQ(plan_cpu_binding(ranks_on_host(3, 4), "", {}, kTwoPackages).cpus, (std::vector<int>{6, 7}));
  const ds::dist::CpuBinding b = plan_cpu_binding(ranks_on_host(1, 2), "", {}, kTwoPackages);
  EXPECT_EQ(b.why, "cores 4-7 (local rank 1's share of 2 on this host)");
  // A GPU: its NUMA node's cores, whatever the rank's place (the synthetic topology's node 1 stands in for the
  // GPU's; on a real machine it is the PCI device's nearest non-I/O ancestor).
  const ds::dist::CpuBinding g = plan_cpu_binding(ranks_on_host(0, 1), "0000:18:00.0", {}, kTwoPackages, 1);
  EXPECT_EQ(g.cpus, (std::vector<int>{4, 5, 6, 7}));
  EXPECT_NE(g.why.find("cores 4-7"), std::string::npos) << g.why;
  EXPECT_NE(g.why.find("nearest GPU 0000:18:00.0"), std::string::npos) << g.why;
  // One rank and no GPU: the machine is its own; a launcher's narrower binding is kept.
  EXPECT_TRUE(plan_cpu_binding(ranks_on_host(0, 1), "", {}, kTwoPackages).cpus.empty());
  const ds::dist::CpuBinding kept = plan_cpu_binding(ranks_on_host(0, 2), "", {2, 3}, kTwoPackages);
  EXPECT_TRUE(kept.cpus.empty());
  EXPECT_EQ(kept.why, "kept the launcher's binding: cores 2-3");
  EXPECT_EQ(ds::dist::cpu_list({0, 1, 2, 5, 7, 8}), "0-2,5,7-8");
  // More ranks than cores: no shares that overlap.
  const ds::dist::CpuBinding over = plan_cpu_binding(ranks_on_host(2, 9), "", {}, kTwoPackages);
  EXPECT_TRUE(over.cpus.empty());
  EXPECT_EQ(over.why, "not bound: 9 ranks on this host's 8 cores");
  EXPECT_EQ(plan_cpu_binding(ranks_on_host(7, 8), "", {}, kTwoPackages).cpus, (std::vector<int>{7}));
}
#endif  // DELTASTACK_HWLOC
