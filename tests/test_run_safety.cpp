// Issue 13, "nothing lost, ever", through the `deltastack` binary: the run-directory lock, graceful signals, guarded
// outputs, metrics.jsonl kept whole, and a resume that needs only the checkpoint.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <fcntl.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <initializer_list>
#include <numeric>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "core/cpu_blas.h"
#include "core/cuda/device.h"
#include "core/files.h"
#include "train/checkpoint.h"
#include "train/run_dir.h"
#include "train_test_util.h"

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

using ds::test::last_train_step;
using ds::test::run;
using ds::test::small_setup;
using ds::test::spawn;
using ds::test::wait_exit;
using ds::test::wait_for;

std::string tmpdir(const std::string& name) { return ds::test::fresh_tmpdir("safety_" + name); }

std::string read_or_empty(const std::string& path) { return ds::file_exists(path) ? ds::read_file(path) : ""; }

bool contains(const std::string& hay, const std::string& needle) { return hay.find(needle) != std::string::npos; }

// Sets (a value) or unsets (nullptr) environment variables for the life of the object, for the children it
// spawns; restores them after.
class ScopedEnv {
 public:
  ScopedEnv(std::initializer_list<std::pair<const char*, const char*>> vars) {
    for (const auto& [k, v] : vars) {
      const char* old = std::getenv(k);
      saved_.emplace_back(k, old ? std::optional<std::string>(old) : std::nullopt);
      if (v) ::setenv(k, v, 1);
      else ::unsetenv(k);
    }
  }
  ~ScopedEnv() {
    for (const auto& [k, v] : saved_) {
      if (v) ::setenv(k.c_str(), v->c_str(), 1);
      else ::unsetenv(k.c_str());
    }
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  std::vector<std::pair<std::string, std::optional<std::string>>> saved_;
};

}  // namespace

// 1. Two runs into one --out: the second stops at once naming the first's pid and leaves its files alone (also a
// temp dir of a save in progress); the first finishes with every checkpoint. An --out that is a file is an error
// before the model loads.
TEST(RunSafety, LockRefusesASecondRunIntoTheSameOut) {
  const std::string dir = tmpdir("lock");
  const std::string args = small_setup(dir), out = dir + "/o";
  {  // held by this process (the child does not inherit the descriptor: O_CLOEXEC)
    const ds::RunDirectory held(out);
    fs::create_directories(out + "/.checkpoint-5.tmp");
    std::string log;
    EXPECT_EQ(run("train " + args + " --steps 1 --out " + out, &log), 1) << log;
    EXPECT_TRUE(contains(log, "another deltastack run (pid " + std::to_string(::getpid()) + ")")) << log;
    EXPECT_FALSE(contains(log, "model:")) << "the lock is taken before the model loads\n" << log;
    EXPECT_TRUE(fs::exists(out + "/.checkpoint-5.tmp"));
    EXPECT_FALSE(fs::exists(out + "/metrics.jsonl"));
  }
  // The issue's case: run 1 saves every step (each save pauses 300 ms), run 2 starts into the same --out meanwhile.
  ::setenv("DELTASTACK_TEST_SAVE_PAUSE_MS", "300", 1);
  const pid_t first = spawn("train " + args + " --steps 3 --save-interval 1 --threads 1 --out " + out, dir + "/log1");
  ::unsetenv("DELTASTACK_TEST_SAVE_PAUSE_MS");
  ASSERT_TRUE(wait_for([&] { return fs::exists(out + "/.checkpoint-1.tmp"); })) << read_or_empty(dir + "/log1");
  EXPECT_EQ(read_or_empty(out + "/" + ds::RunDirectory::kLockName), std::to_string(first) + "\n");
  std::string log;
  EXPECT_EQ(run("train " + args + " --steps 2 --seed 2 --out " + out, &log), 1) << log;
  EXPECT_TRUE(contains(log, "(pid " + std::to_string(first) + ")")) << log;
  EXPECT_EQ(wait_exit(first), 0) << read_or_empty(dir + "/log1");
  for (int s = 1; s <= 3; ++s)
    EXPECT_TRUE(fs::exists(out + "/checkpoint-" + std::to_string(s) + "/trainer_state.json")) << s;
  EXPECT_FALSE(fs::exists(out + "/.checkpoint-5.tmp")) << "the stale temp dir is removed under the lock";
  // --out naming a file: a clear error before the model or data load, the file untouched.
  ds::write_file_atomic(dir + "/file", "x");
  EXPECT_EQ(run("train " + args + " --steps 1 --out " + dir + "/file", &log), 1) << log;
  EXPECT_TRUE(contains(log, "--out " + dir + "/file: exists and is not a directory")) << log;
  EXPECT_FALSE(contains(log, "model:")) << log;
  EXPECT_EQ(ds::read_file(dir + "/file"), "x");
  fs::remove_all(dir);
}

namespace {

int64_t checkpoint_step(const std::string& ck) {
  return json::parse(ds::read_file(ck + "/trainer_state.json"))["step"].get<int64_t>();
}

}  // namespace

// 2. SIGINT mid-run, without --save-interval: the step in progress finishes, a checkpoint of it is saved, the exit code
// is 130 and the message says how to resume; the resume then continues bitwise like a run that was never stopped.
TEST(RunSafety, SigintSavesACheckpointAndResumesBitwise) {
  const std::string dir = tmpdir("sigint");
  // A constant lr (no warmup), so the schedule does not depend on --steps and a run of N steps is a prefix.
  const std::string args = small_setup(dir) + " --schedule constant --warmup 0 --threads 1", out = dir + "/o";
  const pid_t pid = spawn("train " + args + " --steps 100000 --out " + out, dir + "/log");
  ASSERT_TRUE(wait_for([&] { return last_train_step(out + "/metrics.jsonl") >= 3; })) << read_or_empty(dir + "/log");
  ::kill(pid, SIGINT);
  EXPECT_EQ(wait_exit(pid), 130) << read_or_empty(dir + "/log");
  const int64_t n = last_train_step(out + "/metrics.jsonl");
  const std::string ck = out + "/checkpoint-" + std::to_string(n), log = read_or_empty(dir + "/log");
  ASSERT_TRUE(fs::exists(ck + "/trainer_state.json")) << log;
  EXPECT_EQ(checkpoint_step(ck), n);
  EXPECT_TRUE(contains(log, "stopped by SIGINT after step " + std::to_string(n) + " of 100000")) << log;
  EXPECT_TRUE(contains(log, "resume with: deltastack train --resume " + ck)) << log;
  std::string rlog;
  ASSERT_EQ(run("train --resume " + ck + " --steps " + std::to_string(n + 2) + " --threads 1", &rlog), 0) << rlog;
  ASSERT_EQ(run("train " + args + " --steps " + std::to_string(n + 2) + " --out " + dir + "/ref"), 0);
  EXPECT_EQ(ds::test::train_losses(out + "/metrics.jsonl"), ds::test::train_losses(dir + "/ref/metrics.jsonl"));
  EXPECT_EQ(ds::read_file(out + "/checkpoint-" + std::to_string(n + 2) + "/model.safetensors"),
            ds::read_file(dir + "/ref/checkpoint-" + std::to_string(n + 2) + "/model.safetensors"));
  fs::remove_all(dir);
}

// 2. SIGTERM during a save: the save completes, no second one is made, exit 143. Then two signals during a save
// of a resumed run: the second stops at once (exit 130), naming the last complete checkpoint, which stays intact.
TEST(RunSafety, SigtermFinishesTheSaveAndASecondSignalStopsAtOnce) {
  const std::string dir = tmpdir("sigterm");
  const std::string args = small_setup(dir) + " --threads 1 --save-interval 2", out = dir + "/o";
  ::setenv("DELTASTACK_TEST_SAVE_PAUSE_MS", "500", 1);
  pid_t pid = spawn("train " + args + " --steps 100000 --out " + out, dir + "/log1");
  ASSERT_TRUE(wait_for([&] { return fs::exists(out + "/.checkpoint-2.tmp"); })) << read_or_empty(dir + "/log1");
  ::kill(pid, SIGTERM);
  EXPECT_EQ(wait_exit(pid), 143) << read_or_empty(dir + "/log1");
  std::string log = read_or_empty(dir + "/log1");
  EXPECT_EQ(checkpoint_step(out + "/checkpoint-2"), 2) << log;
  EXPECT_FALSE(fs::exists(out + "/checkpoint-3")) << log;
  EXPECT_TRUE(contains(log, "stopped by SIGTERM after step 2 of 100000: the last checkpoint is " + out +
                                "/checkpoint-2")) << log;
  const std::string kept = ds::read_file(out + "/checkpoint-2/model.safetensors");

  ::setenv("DELTASTACK_TEST_SAVE_PAUSE_MS", "3000", 1);
  pid = spawn("train --resume " + out + "/checkpoint-2", dir + "/log2");
  ::unsetenv("DELTASTACK_TEST_SAVE_PAUSE_MS");
  ASSERT_TRUE(wait_for([&] { return fs::exists(out + "/.checkpoint-4.tmp"); })) << read_or_empty(dir + "/log2");
  const auto t0 = std::chrono::steady_clock::now();
  ::kill(pid, SIGINT);
  std::this_thread::sleep_for(std::chrono::milliseconds(100));  // two pending SIGINTs would merge into one
  ::kill(pid, SIGINT);
  EXPECT_EQ(wait_exit(pid), 130);
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 2.5)
      << "the second signal must not wait for the save";
  log = read_or_empty(dir + "/log2");
  EXPECT_TRUE(contains(log, "second signal: stopping now; the last complete checkpoint is " + out +
                                "/checkpoint-2")) << log;
  EXPECT_FALSE(fs::exists(out + "/checkpoint-4"));
  EXPECT_EQ(ds::read_file(out + "/checkpoint-2/model.safetensors"), kept);
  fs::remove_all(dir);
}

// A second signal while --keep-last removes an older checkpoint names the checkpoint just saved, not the one being
// removed (which was gone when the message named it).
TEST(RunSafety, ASecondSignalDuringKeepLastNamesTheNewCheckpoint) {
  const std::string dir = tmpdir("prune_signal");
  const std::string args = small_setup(dir) + " --threads 1 --save-interval 1 --keep-last 1", out = dir + "/o";
  ::setenv("DELTASTACK_TEST_PRUNE_PAUSE_MS", "3000", 1);
  const pid_t pid = spawn("train " + args + " --steps 100000 --out " + out, dir + "/log");
  ::unsetenv("DELTASTACK_TEST_PRUNE_PAUSE_MS");
  ASSERT_TRUE(wait_for([&] { return fs::exists(out + "/.checkpoint-1.old.tmp"); })) << read_or_empty(dir + "/log");
  ::kill(pid, SIGINT);
  std::this_thread::sleep_for(std::chrono::milliseconds(100));  // two pending SIGINTs would merge into one
  ::kill(pid, SIGINT);
  EXPECT_EQ(wait_exit(pid), 130);
  const std::string log = read_or_empty(dir + "/log");
  EXPECT_TRUE(contains(log, "second signal: stopping now; the last complete checkpoint is " + out +
                                "/checkpoint-2 ")) << log;
  EXPECT_TRUE(fs::exists(out + "/checkpoint-2/trainer_state.json"));
  fs::remove_all(dir);
}

// 2. A closed stdout (`train | head -1`): SIGPIPE is ignored and failed writes are too; the run ends normally with its
// checkpoint.
TEST(RunSafety, ClosedStdoutDoesNotStopTraining) {
  const std::string dir = tmpdir("sigpipe");
  const std::string args = small_setup(dir) + " --threads 1 --steps 40 --out " + dir + "/o";
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::dup2(fds[1], 1);
    const int null = ::open("/dev/null", O_WRONLY);
    ::dup2(null, 2);
    ::close(fds[0]);
    ::close(fds[1]);
    ds::test::exec_deltastack("train " + args);
  }
  ::close(fds[0]);  // nobody reads: every write to stdout fails with EPIPE
  ::close(fds[1]);
  EXPECT_EQ(wait_exit(pid), 0);
  EXPECT_EQ(checkpoint_step(dir + "/o/checkpoint-40"), 40);
  EXPECT_EQ(last_train_step(dir + "/o/metrics.jsonl"), 40);
  fs::remove_all(dir);
}

// 3. metrics.jsonl is never deleted or spliced: a fresh run into a directory with another run's files refuses and
// changes nothing, so does a resume into another run's directory; a resume from an earlier checkpoint moves the later
// lines to metrics-abandoned.jsonl (byte for byte) and every line names the run; --move-aside keeps the old run whole.
TEST(RunSafety, MetricsAreNeverDeletedOrSpliced) {
  const std::string dir = tmpdir("metrics");
  const std::string args = small_setup(dir) + " --threads 1 --warmup 1", a = dir + "/a", b = dir + "/b";
  ASSERT_EQ(run("train " + args + " --steps 4 --save-interval 2 --out " + a), 0);
  ASSERT_EQ(run("train " + args + " --steps 2 --seed 7 --out " + b), 0);
  const std::string a_metrics = ds::read_file(a + "/metrics.jsonl"), b_metrics = ds::read_file(b + "/metrics.jsonl");
  std::string log;
  EXPECT_EQ(run("train " + args + " --steps 2 --seed 2 --out " + a, &log), 1);
  EXPECT_TRUE(contains(log, "--out " + a + " holds another run's files (checkpoint-2, checkpoint-4, metrics.jsonl)"))
      << log;
  EXPECT_TRUE(contains(log, "--move-aside")) << log;
  EXPECT_EQ(run("train --resume " + a + "/checkpoint-2 --out " + b, &log), 1);
  EXPECT_TRUE(contains(log, "holds another run's files (checkpoint-2, metrics.jsonl)")) << log;
  EXPECT_EQ(ds::read_file(a + "/metrics.jsonl"), a_metrics);
  EXPECT_EQ(ds::read_file(b + "/metrics.jsonl"), b_metrics);

  // Resume of a from step 2 in its own directory: the old lines of steps 3-4 move, the new ones follow step 2, and
  // the abandoned history's checkpoint-4 moves whole into a/abandoned-1/ (the new run's save of step 4 would
  // otherwise replace it).
  const std::string old4 = ds::read_file(a + "/checkpoint-4/trainer_state.json");
  ASSERT_EQ(run("train --resume " + a + "/checkpoint-2 --threads 1", &log), 0) << log;
  EXPECT_EQ(ds::read_file(a + "/abandoned-1/checkpoint-4/trainer_state.json"), old4);
  EXPECT_TRUE(fs::exists(a + "/abandoned-1/checkpoint-4/model.safetensors"));
  EXPECT_FALSE(fs::exists(a + "/abandoned-1/checkpoint-2"));  // the resumed step itself stays where it is
  EXPECT_NE(ds::read_file(a + "/checkpoint-4/trainer_state.json"), old4);  // this run's own step 4 (new session)
  const std::string run_id =
      json::parse(ds::read_file(a + "/checkpoint-4/trainer_state.json"))["run_id"].get<std::string>();
  std::string old_later;
  for (const json& j : ds::test::metrics(a + "/metrics-abandoned.jsonl")) {
    EXPECT_GT(j["step"].get<int64_t>(), 2) << j;
    old_later += j.dump() + "\n";
  }
  EXPECT_TRUE(contains(a_metrics, old_later) && !old_later.empty()) << old_later;
  std::vector<int64_t> steps;
  for (const json& j : ds::test::metrics(a + "/metrics.jsonl")) {
    EXPECT_EQ(j["run_id"], run_id) << j;
    if (j.contains("loss")) steps.push_back(j["step"].get<int64_t>());
  }
  EXPECT_EQ(steps, (std::vector<int64_t>{1, 2, 3, 4}));
  const std::vector<double> redone = ds::test::train_losses(a + "/metrics.jsonl");
  ASSERT_EQ(redone.size(), 4u);
  EXPECT_EQ(ds::test::train_losses(a + "/metrics-abandoned.jsonl"), std::vector<double>(redone.begin() + 2, redone.end()))
      << "the same steps again (bitwise resume)";

  // --move-aside: b's run goes whole into b/previous-1/, the new run starts clean (a branch of a's run: its own id).
  ASSERT_EQ(run("train --resume " + a + "/checkpoint-2 --out " + b + " --move-aside --threads 1", &log), 0) << log;
  EXPECT_EQ(ds::read_file(b + "/previous-1/metrics.jsonl"), b_metrics);
  EXPECT_TRUE(fs::exists(b + "/previous-1/checkpoint-2/model.safetensors"));
  const json b_state = json::parse(ds::read_file(b + "/checkpoint-4/trainer_state.json"));
  EXPECT_NE(b_state["run_id"], run_id);
  EXPECT_EQ(b_state["resumed_from"]["run_id"], run_id);
  steps.clear();
  for (const json& j : ds::test::metrics(b + "/metrics.jsonl")) {
    EXPECT_EQ(j["run_id"], b_state["run_id"]) << j;
    if (j.contains("loss")) steps.push_back(j["step"].get<int64_t>());
  }
  EXPECT_EQ(steps, (std::vector<int64_t>{3, 4}));
  fs::remove_all(dir);
}

// A metrics.jsonl whose last line was cut short (a run killed or a disk filled while writing it): the resume does
// not append its first line onto the torn one (which lost that line and left invalid JSON mid-file); the torn line
// goes to metrics-abandoned.jsonl and every line of metrics.jsonl parses.
TEST(RunSafety, ATornLastMetricsLineIsNotSplicedOnResume) {
  const std::string dir = tmpdir("torn");
  const std::string args = small_setup(dir) + " --threads 1 --warmup 1 --eval-interval 0", a = dir + "/a";
  ASSERT_EQ(run("train " + args + " --steps 2 --save-interval 1 --out " + a), 0);
  const std::string full = ds::read_file(a + "/metrics.jsonl");
  ASSERT_GT(full.size(), 20u);
  const std::string torn = full.substr(0, full.size() - 20);  // the last line without its end
  ds::write_file_atomic(a + "/metrics.jsonl", torn);
  std::string log;
  ASSERT_EQ(run("train --resume " + a + "/checkpoint-2 --steps 3 --threads 1", &log), 0) << log;
  std::vector<int64_t> steps;
  std::istringstream in(ds::read_file(a + "/metrics.jsonl"));
  std::string line;
  while (std::getline(in, line)) {
    json j;
    ASSERT_NO_THROW(j = json::parse(line)) << line;
    if (j.contains("loss")) steps.push_back(j["step"].get<int64_t>());
  }
  EXPECT_EQ(steps, (std::vector<int64_t>{1, 2, 3}));
  const std::string last_torn = torn.substr(torn.rfind('\n') + 1);
  EXPECT_TRUE(contains(read_or_empty(a + "/metrics-abandoned.jsonl"), last_torn)) << "the torn line is kept";
  fs::remove_all(dir);
}

// A resume into another directory starts a branch: its own run_id, and "resumed_from" (the run, step and checkpoint
// it continues) in its checkpoints and its first metrics line, so two continuations of one checkpoint never share an
// id and neither directory takes the other's lines (steps 5-6 of b after a's own 3-4 in a's metrics.jsonl, or a's
// step 5 after b's 3-4 in b's). The same resume again (a retry after a kill) continues the same branch; a resume in
// the branch's own directory, also after the directory moved, keeps its id and origin, and so does a resume of a copy
// of one of the directory's own checkpoints into it.
TEST(RunSafety, AResumeIntoAnotherDirectoryStartsABranch) {
  const std::string dir = tmpdir("branch");
  const std::string args = small_setup(dir) + " --threads 1 --warmup 1", a = dir + "/a", b = dir + "/b";
  ASSERT_EQ(run("train " + args + " --steps 4 --save-interval 2 --out " + a), 0);
  const std::string a_metrics = ds::read_file(a + "/metrics.jsonl");
  auto state = [](const std::string& ck) { return json::parse(ds::read_file(ck + "/trainer_state.json")); };
  const std::string r = state(a + "/checkpoint-4")["run_id"];
  EXPECT_FALSE(state(a + "/checkpoint-4").contains("resumed_from"));  // a fresh run
  std::string log;
  ASSERT_EQ(run("train --resume " + a + "/checkpoint-2 --steps 6 --threads 1 --out " + b, &log), 0) << log;
  const json st = state(b + "/checkpoint-6");
  const std::string rb = st["run_id"];
  EXPECT_NE(rb, r);
  EXPECT_EQ(st["resumed_from"],
            (json{{"run_id", r}, {"step", 2}, {"path", fs::canonical(a + "/checkpoint-2").string()}}));
  EXPECT_EQ(state(b + "/checkpoint-4")["resumed_from"], st["resumed_from"]);
  const std::vector<json> mb = ds::test::metrics(b + "/metrics.jsonl");
  ASSERT_FALSE(mb.empty());
  EXPECT_EQ(mb[0]["resumed_from"], st["resumed_from"]) << mb[0];
  std::vector<int64_t> steps;
  for (size_t i = 0; i < mb.size(); ++i) {
    EXPECT_EQ(mb[i]["run_id"], rb) << mb[i];
    EXPECT_EQ(mb[i].contains("resumed_from"), i == 0) << mb[i];
    if (mb[i].contains("loss")) steps.push_back(mb[i]["step"].get<int64_t>());
  }
  EXPECT_EQ(steps, (std::vector<int64_t>{3, 4, 5, 6}));
  const std::string b_metrics = ds::read_file(b + "/metrics.jsonl");

  // b's continuation into a, a's step 4 into b: refused, nothing changed.
  EXPECT_EQ(run("train --resume " + b + "/checkpoint-6 --steps 8 --threads 1 --out " + a, &log), 1) << log;
  EXPECT_TRUE(contains(log, "--out " + a + " holds another run's files")) << log;
  EXPECT_EQ(run("train --resume " + a + "/checkpoint-4 --steps 8 --threads 1 --out " + b, &log), 1) << log;
  EXPECT_TRUE(contains(log, "--out " + b + " holds another run's files")) << log;
  EXPECT_EQ(ds::read_file(a + "/metrics.jsonl"), a_metrics);
  EXPECT_EQ(ds::read_file(b + "/metrics.jsonl"), b_metrics);
  EXPECT_FALSE(fs::exists(a + "/checkpoint-8"));
  EXPECT_FALSE(fs::exists(b + "/checkpoint-8"));

  // The same resume again: the same branch; the earlier attempt's lines and later checkpoints are moved aside whole,
  // and the steps come out the same (bitwise resume).
  ASSERT_EQ(run("train --resume " + a + "/checkpoint-2 --steps 6 --threads 1 --out " + b, &log), 0) << log;
  EXPECT_EQ(state(b + "/checkpoint-6")["run_id"], rb);
  EXPECT_EQ(read_or_empty(b + "/metrics-abandoned.jsonl"), b_metrics);
  EXPECT_TRUE(fs::exists(b + "/abandoned-1/checkpoint-4/model.safetensors"));
  EXPECT_TRUE(fs::exists(b + "/abandoned-1/checkpoint-6/model.safetensors"));
  EXPECT_EQ(ds::test::train_losses(b + "/metrics.jsonl"), ds::test::train_losses(b + "/metrics-abandoned.jsonl"));
  EXPECT_EQ(ds::test::metrics(b + "/metrics.jsonl")[0]["resumed_from"], st["resumed_from"]);

  // b moved: a resume in its own directory (the default --out) keeps the branch's id and origin.
  const std::string c = dir + "/c";
  fs::rename(b, c);
  ASSERT_EQ(run("train --resume " + c + "/checkpoint-4 --steps 6 --threads 1", &log), 0) << log;
  EXPECT_EQ(state(c + "/checkpoint-6")["run_id"], rb);
  EXPECT_EQ(state(c + "/checkpoint-6")["resumed_from"], st["resumed_from"]);
  steps.clear();
  const std::vector<json> mc = ds::test::metrics(c + "/metrics.jsonl");
  for (size_t i = 0; i < mc.size(); ++i) {
    EXPECT_EQ(mc[i]["run_id"], rb) << mc[i];
    EXPECT_EQ(mc[i].contains("resumed_from"), i == 0) << mc[i];
    if (mc[i].contains("loss")) steps.push_back(mc[i]["step"].get<int64_t>());
  }
  EXPECT_EQ(steps, (std::vector<int64_t>{3, 4, 5, 6}));

  // A copy of one of a's own checkpoints (same step, run and writing process) resumed into a continues a's run.
  fs::copy(a + "/checkpoint-2", dir + "/copy-2", fs::copy_options::recursive);
  ASSERT_EQ(run("train --resume " + dir + "/copy-2 --threads 1 --out " + a, &log), 0) << log;
  EXPECT_EQ(state(a + "/checkpoint-4")["run_id"], r);
  EXPECT_FALSE(state(a + "/checkpoint-4").contains("resumed_from"));
  for (const json& j : ds::test::metrics(a + "/metrics.jsonl")) EXPECT_EQ(j["run_id"], r) << j;
  fs::remove_all(dir);
}

// OpenBLAS's kernels through an explicit dynamic loader (`/lib64/ld-linux-x86-64.so.2 deltastack ...`, as a sysroot
// or a launcher starts it): /proc/self/exe is then the loader, and the re-exec with main's argv ran the loader on the
// program's arguments (`--version` printed ld.so's version, `train` exited 127: "train: cannot open shared object
// file"). It re-executes the whole command line, loader included, and --version names the kernels in use
// (docs/cpu_engine.md): the CPU's best set when the library picked an older one (forced here by the test hook), the
// user's OPENBLAS_CORETYPE when set, the library's own with DELTASTACK_BLAS_CORETYPE=keep.
TEST(CpuBlas, ReexecWorksThroughAnExplicitLoader) {
  const std::string loader = "/lib64/ld-linux-x86-64.so.2";  // the binary's PT_INTERP (x86-64 glibc)
  if (!fs::exists(loader)) GTEST_SKIP() << "no " << loader;
  const std::string want = ds::blas_coretype_for_cpu();
  if (want.empty()) GTEST_SKIP() << "no AVX: there is no kernel set to re-execute for";
  const std::string dir = tmpdir("loader");
  const std::string args = small_setup(dir) + " --threads 1 --steps 1";
  std::string log;
  {
    ScopedEnv env({{"OPENBLAS_CORETYPE", nullptr}, {"DELTASTACK_BLAS_CORETYPE", nullptr},
                   {"DELTASTACK_BLAS_REEXEC", nullptr}, {"DELTASTACK_TEST_BLAS_CORENAME", "Prescott"}});
    for (const std::string& launcher : {std::string(), loader}) {
      ASSERT_EQ(run("--version", &log, launcher), 0) << launcher << ": " << log;
      EXPECT_EQ(log.rfind(std::string(DELTASTACK_VERSION) + "\n", 0), 0u) << launcher << ": " << log;
      EXPECT_TRUE(contains(log, "OpenBLAS kernels: " + want + " (OPENBLAS_CORETYPE " + want + ", set by deltastack)"))
          << launcher << ": " << log;
      const std::string out = dir + "/out" + std::to_string(launcher.size());
      ASSERT_EQ(run("train " + args + " --out " + out, &log, launcher), 0) << launcher << ": " << log;
      EXPECT_EQ(ds::test::train_losses(out + "/metrics.jsonl").size(), 1u) << launcher;
    }
  }
  {  // the user's choice wins: no re-exec
    ScopedEnv env({{"OPENBLAS_CORETYPE", "Haswell"}, {"DELTASTACK_BLAS_CORETYPE", nullptr},
                   {"DELTASTACK_BLAS_REEXEC", nullptr}, {"DELTASTACK_TEST_BLAS_CORENAME", "Prescott"}});
    ASSERT_EQ(run("--version", &log, loader), 0) << log;
    EXPECT_TRUE(contains(log, "OpenBLAS kernels: Haswell (OPENBLAS_CORETYPE Haswell)\n")) << log;
  }
  {  // DELTASTACK_BLAS_CORETYPE=keep: the library's own pick, no re-exec
    ScopedEnv env({{"OPENBLAS_CORETYPE", nullptr}, {"DELTASTACK_BLAS_CORETYPE", "keep"},
                   {"DELTASTACK_BLAS_REEXEC", nullptr}, {"DELTASTACK_TEST_BLAS_CORENAME", "Prescott"}});
    ASSERT_EQ(run("--version", &log, loader), 0) << log;
    EXPECT_TRUE(contains(log, "(OPENBLAS_CORETYPE unset)\n")) << log;
  }
  fs::remove_all(dir);
}

// --out that is a checkpoint directory (or lies inside one) is refused before anything is written there: the run's
// files would be deleted with the checkpoint by its own run's --keep-last.
TEST(RunSafety, OutIsNeverACheckpointDirectory) {
  const std::string dir = tmpdir("out_in_ckpt");
  const std::string args = small_setup(dir) + " --threads 1 --warmup 1", a = dir + "/a";
  ASSERT_EQ(run("train " + args + " --steps 2 --save-interval 1 --out " + a), 0);
  const std::string ck = a + "/checkpoint-1";
  std::vector<std::string> before;
  for (const auto& e : fs::directory_iterator(ck)) before.push_back(e.path().filename().string());
  std::string log;
  for (const std::string& out : {ck, ck + "/sub"}) {
    EXPECT_EQ(run("train --resume " + ck + " --out " + out, &log), 1) << log;
    EXPECT_TRUE(contains(log, "is a checkpoint directory")) << log;
    EXPECT_EQ(run("train " + args + " --steps 1 --out " + out, &log), 1) << log;
  }
  std::vector<std::string> after;
  for (const auto& e : fs::directory_iterator(ck)) after.push_back(e.path().filename().string());
  std::sort(before.begin(), before.end());
  std::sort(after.begin(), after.end());
  EXPECT_EQ(after, before);
  fs::remove_all(dir);
}

// A training run's metrics (a directory with the run lock) are never an output of plot or tokenize, even with
// --overwrite: `plot RUN --out RUN/metrics-abandoned.jsonl --overwrite` replaced the abandoned lines with an SVG.
TEST(RunSafety, OutputsNeverReplaceARunsMetrics) {
  const std::string dir = tmpdir("run_metrics"), r = dir + "/r";
  fs::create_directories(r);
  const std::string line = "{\"step\":1,\"loss\":2.5,\"run_id\":\"x\"}\n";
  for (const char* f : {"metrics.jsonl", "metrics-abandoned.jsonl", ".deltastack.lock"})
    ds::write_file_atomic(r + "/" + f, line);
  ds::write_file_atomic(dir + "/in.jsonl", "{\"text\":\"hello\"}\n");
  std::string log;
  for (const char* f : {"metrics.jsonl", "metrics-abandoned.jsonl", ".deltastack.lock"}) {
    EXPECT_EQ(run("plot " + r + " --out " + r + "/" + f + " --overwrite", &log), 1) << f << "\n" << log;
    EXPECT_EQ(run("tokenize --tokenizer " + ds::test::data_path("qwen3_tokenizer/tokenizer.json") + " --input " +
                  dir + "/in.jsonl --output " + r + "/" + f + " --overwrite", &log), 1) << f << "\n" << log;
    EXPECT_TRUE(contains(log, "would replace the training run's")) << log;
    EXPECT_EQ(ds::read_file(r + "/" + f), line) << f;
  }
  EXPECT_EQ(run("plot " + r + " --out " + r + "/metrics.svg"), 0);  // a new file beside them is fine
  fs::remove_all(dir);
}

// 4. forward and tokenize never write over their inputs (also through a symlink), each other, or a checkpoint's
// files; an existing output only with --overwrite. Every refusal is exit 1 with the flag named and the file intact.
TEST(RunSafety, OutputsNeverReplaceInputs) {
  const std::string dir = tmpdir("outputs"), ck = dir + "/ck";
  fs::create_directories(ck);
  for (const char* f : {"config.json", "model.safetensors", "inputs.safetensors"})
    fs::copy_file(ds::test::fixture(std::string("hf_qwen35_tiny_a/") + f), ck + "/" + f);
  fs::copy_file(ck + "/inputs.safetensors", dir + "/in.safetensors");
  fs::create_symlink(dir + "/in.safetensors", dir + "/link.safetensors");
  const std::string model = ds::read_file(ck + "/model.safetensors"), in = ds::read_file(dir + "/in.safetensors");
  const std::string fwd = "forward --threads 1 --model " + ck + " --inputs " + dir + "/in.safetensors ";
  auto refused = [&](const std::string& args, const std::string& needle) {
    std::string log;
    EXPECT_EQ(run(args, &log), 1) << args << "\n" << log;
    EXPECT_TRUE(contains(log, needle)) << args << "\n" << log;
  };
  refused(fwd + "--output " + ck + "/model.safetensors --overwrite",
          "--output " + ck + "/model.safetensors: would replace a file of the input directory " + ck);
  refused(fwd + "--output " + dir + "/in.safetensors --overwrite", "is the input file " + dir + "/in.safetensors");
  refused(fwd + "--output " + dir + "/link.safetensors --overwrite", "is the input file");
  refused(fwd + "--output " + dir + "/o.safetensors --grads " + dir + "/o.safetensors", "--grads " + dir +
          "/o.safetensors: is also --output");
  EXPECT_EQ(ds::read_file(ck + "/model.safetensors"), model);
  EXPECT_EQ(ds::read_file(dir + "/in.safetensors"), in);
  EXPECT_FALSE(fs::exists(dir + "/o.safetensors"));
  // A new file beside the checkpoint's is fine; writing it again needs --overwrite.
  ASSERT_EQ(run(fwd + "--output " + ck + "/out.safetensors"), 0);
  ASSERT_EQ(run(fwd + "--output " + dir + "/o.safetensors"), 0);
  ds::write_file_atomic(dir + "/o.safetensors", "old");
  refused(fwd + "--output " + dir + "/o.safetensors", "--output " + dir + "/o.safetensors: exists; pass --overwrite");
  EXPECT_EQ(ds::read_file(dir + "/o.safetensors"), "old");
  ASSERT_EQ(run(fwd + "--output " + dir + "/o.safetensors --overwrite"), 0);
  EXPECT_EQ(ds::read_file(dir + "/o.safetensors"), ds::read_file(ck + "/out.safetensors"));
  refused(fwd + "--output " + ck + "/out.safetensors --overwrite", "would replace a file of the input directory");

  // tokenize: not over the input or the tokenizer; an existing output only with --overwrite.
  const std::string tok = dir + "/tokenizer.json";
  fs::copy_file(std::string(DELTASTACK_SOURCE_DIR) + "/data/qwen3_tokenizer/tokenizer.json", tok);
  ds::write_file_atomic(dir + "/t.jsonl", "{\"text\": \"hello\"}\n");
  const std::string tk = "tokenize --tokenizer " + tok + " --input " + dir + "/t.jsonl ";
  refused(tk + "--output " + dir + "/t.jsonl --overwrite", "--output " + dir + "/t.jsonl: is the input file");
  refused(tk + "--output " + tok + " --overwrite", "is the input file " + tok);
  ASSERT_EQ(run(tk + "--output " + dir + "/ids.jsonl"), 0);
  const std::string ids = ds::read_file(dir + "/ids.jsonl");
  EXPECT_EQ(ids, "{\"ids\":[14990]}\n");
  refused(tk + "--output " + dir + "/ids.jsonl", "exists; pass --overwrite");
  ASSERT_EQ(run(tk + "--output " + dir + "/ids.jsonl --overwrite"), 0);
  EXPECT_EQ(ds::read_file(dir + "/ids.jsonl"), ids);
  EXPECT_EQ(ds::read_file(dir + "/t.jsonl"), "{\"text\": \"hello\"}\n");
  fs::remove_all(dir);
}

// 5. A resume needs only the checkpoint: with the config, the tokenizer and the corpus gone from their paths it
// reads the checkpoint's config.json and tokenizer.json and takes --data at the corpus's new place, bitwise like the
// original run. Edited data is a warning naming the fingerprints, or with --data-changed error an error.
TEST(RunSafety, ResumeNeedsOnlyTheCheckpoint) {
  const std::string dir = tmpdir("relocate");
  std::string args = small_setup(dir) + " --threads 1 --warmup 1 --tokenizer " + dir + "/tok.json";
  fs::copy_file(std::string(DELTASTACK_SOURCE_DIR) + "/data/qwen3_tokenizer/tokenizer.json", dir + "/tok.json");
  ASSERT_EQ(run("train " + args + " --steps 4 --save-interval 2 --out " + dir + "/a"), 0);
  fs::create_directories(dir + "/moved");
  fs::rename(dir + "/corpus.txt", dir + "/moved/corpus.txt");
  fs::remove(dir + "/tok.json");
  fs::remove(dir + "/config.json");
  const std::string ck = dir + "/a/checkpoint-2";
  std::string log;
  EXPECT_EQ(run("train --resume " + ck + " --out " + dir + "/x", &log), 1);
  EXPECT_TRUE(contains(log, dir + "/corpus.txt: cannot open")) << log;
  ASSERT_EQ(run("train --resume " + ck + " --data " + dir + "/moved/corpus.txt --out " + dir + "/b", &log), 0) << log;
  EXPECT_FALSE(contains(log, "differs")) << log;
  const std::vector<double> la = ds::test::train_losses(dir + "/a/metrics.jsonl");
  ASSERT_EQ(la.size(), 4u);
  EXPECT_EQ(ds::test::train_losses(dir + "/b/metrics.jsonl"), std::vector<double>(la.begin() + 2, la.end()));
  EXPECT_EQ(ds::read_file(dir + "/b/checkpoint-4/tokenizer.json"), ds::read_file(ck + "/tokenizer.json"));
  const json st = json::parse(ds::read_file(dir + "/b/checkpoint-4/trainer_state.json"));
  EXPECT_EQ(st["options"]["data"], json::array({dir + "/moved/corpus.txt"}));
  EXPECT_EQ(st["data"], json::parse(ds::read_file(ck + "/trainer_state.json"))["data"]);
  EXPECT_EQ(st["data"]["train_fingerprint"].get<std::string>().size(), 16u);

  // An edited corpus: a warning naming both fingerprints, or an error before any step.
  std::string text = ds::read_file(dir + "/moved/corpus.txt");
  text.replace(text.find("Citizen"), 7, "Soldier");
  ds::write_file_atomic(dir + "/edited.txt", text);
  const std::string saved = json::parse(ds::read_file(ck + "/trainer_state.json"))["data"]["train_fingerprint"];
  ASSERT_EQ(run("train --resume " + ck + " --data " + dir + "/edited.txt --out " + dir + "/c", &log), 0) << log;
  EXPECT_TRUE(contains(log, "warning: --resume " + ck + ": the data differs from the checkpoint's (training "
                            "documents:")) << log;
  EXPECT_TRUE(contains(log, "the checkpoint's 135 (" + saved + ")")) << log;
  EXPECT_EQ(run("train --resume " + ck + " --data " + dir + "/edited.txt --data-changed error --out " + dir + "/d",
                &log), 1);
  EXPECT_TRUE(contains(log, "(--data-changed error)")) << log;
  EXPECT_FALSE(fs::exists(dir + "/d/checkpoint-4"));
  fs::remove_all(dir);
}

// Issue 25 item 10: a resume trains with the checkpoint's tokenizer.json only. With that file gone it is an error
// naming it and the run's original --tokenizer (which is not read: here it was edited since), before --out is
// touched; with the file put back the resume runs.
TEST(RunSafety, AResumeNeedsTheCheckpointsTokenizer) {
  const std::string dir = tmpdir("resume_tok");
  const std::string bundled = std::string(DELTASTACK_SOURCE_DIR) + "/data/qwen3_tokenizer/tokenizer.json";
  fs::copy_file(bundled, dir + "/tok.json");
  ASSERT_EQ(run("train " + small_setup(dir) + " --threads 1 --steps 1 --tokenizer " + dir + "/tok.json --out " + dir +
                "/a"), 0);
  const std::string ck = dir + "/a/checkpoint-1";
  fs::rename(ck + "/tokenizer.json", dir + "/saved.json");
  json edited = json::parse(ds::read_file(dir + "/tok.json"));
  edited["added_tokens"][0]["content"] = "<|end|>";  // another tokenizer at the original path
  ds::write_file_atomic(dir + "/tok.json", edited.dump());
  for (const std::string& out : {std::string(), " --out " + dir + "/b"}) {
    std::string log;
    EXPECT_EQ(run("train --threads 1 --resume " + ck + " --steps 2" + out, &log), 1) << log;
    EXPECT_TRUE(contains(log, "error: --resume " + ck + ": " + ck + "/tokenizer.json is missing")) << log;
    EXPECT_TRUE(contains(log, "(options.tokenizer in trainer_state.json: " + dir + "/tok.json)")) << log;
    EXPECT_FALSE(contains(log, "the data differs")) << log;
  }
  EXPECT_FALSE(fs::exists(dir + "/b"));
  EXPECT_FALSE(fs::exists(dir + "/a/checkpoint-2"));
  fs::rename(dir + "/saved.json", ck + "/tokenizer.json");
  std::string log;
  EXPECT_EQ(run("train --threads 1 --resume " + ck + " --steps 2", &log), 0) << log;
  EXPECT_EQ(ds::read_file(dir + "/a/checkpoint-2/tokenizer.json"), ds::read_file(bundled));
  fs::remove_all(dir);
}

// Issue 25 item 11: the shards of a mapped dataset truncated in place while the run trains: no SIGBUS (rc 135), but
// an error naming a shard and exit 1, after the weights of the last complete step were saved as its checkpoint.
TEST(RunSafety, AShardTruncatedWhileTrainingIsNamedAndTheLastStepSaved) {
  const std::string dir = tmpdir("truncated_shard");
  const std::string args = ds::test::small_setup_on(dir, dir + "/set");
  ASSERT_EQ(run("tokenize --format dataset --shard-tokens 1024 --tokenizer " +
                ds::test::data_path("qwen3_tokenizer/tokenizer.json") + " --input " + dir + "/corpus.txt --output " +
                dir + "/set"), 0);
  const pid_t pid = spawn("train " + args + " --threads 1 --steps 1000000 --out " + dir + "/run", dir + "/log");
  ASSERT_TRUE(wait_for([&] {
    try {
      return ds::file_exists(dir + "/run/metrics.jsonl") && ds::test::train_losses(dir + "/run/metrics.jsonl").size() >= 2;
    } catch (const std::exception&) {  // a line being written
      return false;
    }
  }, 120)) << read_or_empty(dir + "/log");
  for (const auto& e : fs::directory_iterator(dir + "/set"))
    if (e.path().filename().string().rfind("tokens-", 0) == 0) fs::resize_file(e.path(), 0);
  EXPECT_EQ(wait_exit(pid), 1);
  const std::string log = read_or_empty(dir + "/log");
  EXPECT_TRUE(contains(log, "error: " + dir + "/set/tokens-")) << log;
  EXPECT_TRUE(contains(log, ": the file changed while the run read it (truncated or replaced in place")) << log;
  const int64_t last = ds::test::metrics(dir + "/run/metrics.jsonl").back()["step"].get<int64_t>();
  EXPECT_TRUE(contains(log, fmt::format("Step {} was not taken; the last checkpoint is {}/run/checkpoint-{} (step {})",
                                        last + 1, dir, last, last))) << log;
  EXPECT_TRUE(fs::exists(fmt::format("{}/run/checkpoint-{}/model.safetensors", dir, last)));
  fs::remove_all(dir);
}

// Issue 25 item 18: errors name the file, field, flag or option at fault, and quote no raw binary.
TEST(RunSafety, ErrorsNameWhatIsAtFault) {
  const std::string dir = tmpdir("messages");
  const std::string args = small_setup(dir) + " --threads 1";
  ASSERT_EQ(run("train " + args + " --steps 1 --out " + dir + "/a"), 0);
  const std::string ck = dir + "/a/checkpoint-1";
  std::string log;
  // trainer_state.json's options: a value of the wrong type, and one out of range, name the field (not a flag).
  const std::string state = ds::read_file(ck + "/trainer_state.json");
  for (const auto& [key, value, want] : std::vector<std::tuple<std::string, json, std::string>>{
           {"lr", "fast", "field \"options.lr\" must be a number, got \"fast\""},
           {"seq_len", 0, "field \"options.seq_len\" is invalid: --seq-len must be >= 2, got 0"},
           {"data", 7, "field \"options.data\" must be an array of strings, got 7"}}) {
    json st = json::parse(state);
    st["options"][key] = value;
    ds::write_file_atomic(ck + "/trainer_state.json", st.dump());
    EXPECT_EQ(run("train --threads 1 --resume " + ck + " --out " + dir + "/r", &log), 1) << log;
    EXPECT_TRUE(contains(log, "error: " + ck + "/trainer_state.json: " + want)) << log;
  }
  ds::write_file_atomic(ck + "/trainer_state.json", state);
  // A safetensors file as --model; a .txt as `tokenize --format jsonl`'s input; a plain directory as --data.
  EXPECT_EQ(run("eval --threads 1 --device cpu --model " + ck + "/model.safetensors --data " + dir + "/corpus.txt",
                &log), 1);
  EXPECT_TRUE(contains(log, ck + "/model.safetensors: a safetensors weights file, not a model config")) << log;
  EXPECT_EQ(run("tokenize --tokenizer " + ck + "/tokenizer.json --input " + dir + "/corpus.txt --output " + dir +
                "/x.jsonl", &log), 1);
  EXPECT_TRUE(contains(log, "--input " + dir + "/corpus.txt: --format jsonl reads one .jsonl file")) << log;
  fs::create_directories(dir + "/plain");
  EXPECT_EQ(run("train " + ds::test::small_setup_on(dir, dir + "/plain") + " --steps 1 --out " + dir + "/p", &log), 1);
  EXPECT_TRUE(contains(log, "error: " + dir + "/plain: a directory, not a data file")) << log;
  // A dangling symlink as --out.
  fs::create_symlink(dir + "/nowhere", dir + "/dangling");
  EXPECT_EQ(run("train " + args + " --steps 1 --out " + dir + "/dangling", &log), 1);
  EXPECT_TRUE(contains(log, "--out " + dir + "/dangling: a symbolic link to " + dir + "/nowhere, which does not exist"))
      << log;
  // eval on chat data without an assistant turn.
  ds::write_file_atomic(dir + "/users.jsonl", "{\"messages\": [{\"role\": \"user\", \"content\": \"hello there\"}]}\n");
  EXPECT_EQ(run("eval --threads 1 --device cpu --seq-len 32 --model " + ck + " --data " + dir + "/users.jsonl", &log), 1);
  EXPECT_TRUE(contains(log, "data: none of the 1 documents of --data has a labelled token")) << log;
  // Invalid UTF-8 in --prompt: the flag named, the byte escaped.
  EXPECT_EQ(run("generate --threads 1 --device cpu --max-new-tokens 1 --model " + ck + " --prompt ab\xff", &log), 1);
  EXPECT_TRUE(contains(log, "error: --prompt: tokenizer: invalid UTF-8 at byte offset 2 (byte 0xFF)")) << log;
  EXPECT_FALSE(contains(log, "\xff")) << log;
  // A tokenizer with more ids than the model's vocabulary (the HF fixture's 256).
  const std::string fx = ds::test::fixture("hf_qwen35_tiny_a");
  const std::string tok = ds::test::data_path("qwen3_tokenizer/tokenizer.json");
  for (const std::string& cmd : {"eval --seq-len 32 --data " + dir + "/corpus.txt", std::string("generate --prompt hi")}) {
    EXPECT_EQ(run(cmd + " --threads 1 --device cpu --model " + fx + " --tokenizer " + tok, &log), 1) << cmd;
    EXPECT_TRUE(contains(log, tok + " has 151669 token ids, but the model's vocab_size is 256 (" + fx +
                         "/config.json)")) << log;
  }
  // A JSON parse error quotes the bytes it read escaped, never raw.
  ds::write_file_atomic(dir + "/bin.json", "{\"hidden_size\": \"\xfe\xff\"}");
  EXPECT_EQ(run("train " + args + " --steps 1 --model " + dir + "/bin.json --out " + dir + "/j", &log), 1);
  EXPECT_TRUE(contains(log, dir + "/bin.json: not a model config (a config.json): invalid JSON")) << log;
  EXPECT_TRUE(contains(log, "\\xfe")) << log;
  EXPECT_FALSE(contains(log, "\xfe")) << log;
  EXPECT_FALSE(contains(log, "\xff")) << log;
  fs::remove_all(dir);
}

// 6. eval on a checkpoint whose weights blow up (finite, ~1e30 after one step at --lr 1e30) prints valid JSON with
// null for the loss and the reason, and exits 1.
TEST(RunSafety, EvalOfANonFiniteLossIsValidJson) {
  const std::string dir = tmpdir("evalnan");
  const std::string args = small_setup(dir);
  ASSERT_EQ(run("train " + args + " --threads 1 --steps 1 --lr 1e30 --clip 0 --warmup 0 --out " + dir + "/a"), 0);
  std::string out;
  EXPECT_EQ(run("eval --threads 1 --device cpu --seq-len 32 --model " + dir + "/a/checkpoint-1 --data " + dir +
                "/corpus.txt", &out), 1) << out;
  const std::string line = out.substr(out.find("{\"eval_loss\""), out.find('\n', out.find("{\"eval_loss\"")) -
                                                                    out.find("{\"eval_loss\""));
  const json j = json::parse(line);  // throws (and fails the test) on `nan`
  EXPECT_TRUE(j["eval_loss"].is_null()) << line;
  EXPECT_TRUE(j["perplexity"].is_null()) << line;
  EXPECT_GT(j["tokens"].get<int64_t>(), 0) << line;
  EXPECT_TRUE(contains(j["error"].get<std::string>(), "non-finite")) << line;
  // Issue 25 item 7: generate on the same weights refuses to print tokens sampled from those logits (exit 1).
  for (const char* temperature : {"0", "1"}) {
    EXPECT_EQ(run(std::string("generate --threads 1 --device cpu --max-new-tokens 5 --temperature ") + temperature +
                  " --prompt ROMEO: --model " + dir + "/a/checkpoint-1", &out), 1) << out;
    EXPECT_TRUE(contains(out, "error: generate: the model's logits after ")) << out;
    EXPECT_TRUE(contains(out, "are not finite")) << out;
  }
  fs::remove_all(dir);
}

// 6. generate streams: the prompt and the first tokens are on stdout while it is still generating (4000 tokens, the
// most the tiny preset's 4096 positions leave after the prompt; stopped by the test once it has seen them).
TEST(RunSafety, GenerateStreamsTokens) {
  const std::string dir = tmpdir("stream");
  ASSERT_EQ(run("train " + small_setup(dir) + " --threads 1 --steps 0 --out " + dir + "/a"), 0);
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::dup2(fds[1], 1);
    ::close(fds[0]);
    ::close(fds[1]);
    ds::test::exec_deltastack("generate --threads 1 --max-new-tokens 4000 --temperature 1 --top-k 0 --prompt ROMEO: "
                              "--model " + dir + "/a/checkpoint-0");
  }
  ::close(fds[1]);
  ::fcntl(fds[0], F_SETFL, O_NONBLOCK);
  std::string got;
  const bool seen = wait_for([&] {
    char buf[4096];
    for (ssize_t n; (n = ::read(fds[0], buf, sizeof buf)) > 0;) got.append(buf, static_cast<size_t>(n));
    return got.size() > 20;
  });
  int st = 0;
  const bool running = ::waitpid(pid, &st, WNOHANG) == 0;
  ::kill(pid, SIGKILL);
  ::waitpid(pid, &st, 0);
  ::close(fds[0]);
  EXPECT_TRUE(seen) << got;
  EXPECT_TRUE(running) << "generate ended before the test saw its output";
  EXPECT_EQ(got.rfind("ROMEO:", 0), 0u) << got;
  fs::remove_all(dir);
}

// generate's sampling flags: a vanishing --top-p keeps only the most likely id (the greedy text), a bad one is an
// error naming it; --chat renders the prompt as a user turn (the reply is different text from the plain prompt's).
// --device cpu is the carried-state decode; auto gives the same text here (no GPU, or a GPU engine that does not
// take head_dim 8: the CPU, with a warning); a bad --device, or the prompt + --max-new-tokens past the model's
// 4096 positions, is an error naming the flag before anything is generated.
TEST(RunSafety, GenerateTopPAndChat) {
  const std::string dir = tmpdir("topp");
  ASSERT_EQ(run("train " + small_setup(dir) + " --threads 1 --steps 2 --out " + dir + "/a"), 0);
  const std::string g = "generate --threads 1 --max-new-tokens 12 --prompt ROMEO: --model " + dir + "/a/checkpoint-2";
  std::string greedy, nucleus, sampled, chat, automatic, log;
  ASSERT_EQ(run(g + " --device cpu --temperature 0", &greedy), 0) << greedy;
  ASSERT_EQ(run(g + " --device cpu --temperature 1 --top-k 0 --top-p 1e-9 --seed 5", &nucleus), 0) << nucleus;
  EXPECT_EQ(nucleus, greedy);
  EXPECT_GT(greedy.size(), std::string("ROMEO:\n").size()) << greedy;
  ASSERT_EQ(run(g + " --device cpu --temperature 1 --top-k 0 --seed 5", &sampled), 0);
  EXPECT_NE(sampled, greedy);  // without the nucleus, 12 draws from 151k ids of a 2-step model differ
  ASSERT_EQ(run(g + " --device cpu --temperature 0 --chat", &chat), 0) << chat;
  EXPECT_EQ(chat.rfind("ROMEO:", 0), 0u) << chat;
  EXPECT_NE(chat, greedy);
  ASSERT_EQ(run(g + " --temperature 0", &automatic), 0) << automatic;
  EXPECT_EQ(automatic.substr(automatic.find("ROMEO:")), greedy);
  EXPECT_EQ(run(g + " --top-p 0", &log), 1);
  EXPECT_NE(log.find("--top-p must be in (0, 1]"), std::string::npos) << log;
  EXPECT_EQ(run(g + " --device gpu", &log), 1);
  EXPECT_NE(log.find("--device must be auto, cpu or cuda, got \"gpu\""), std::string::npos) << log;
  EXPECT_EQ(run(g + " --device cpu --max-new-tokens 4094", &log), 1);
  EXPECT_NE(log.find("--max-new-tokens 4094: the prompt's 3 tokens + 4094 new ones exceed the model's "
                     "max_position_embeddings = 4096"), std::string::npos) << log;
  EXPECT_EQ(log.find("ROMEO"), std::string::npos) << "nothing generated: " << log;
  ASSERT_EQ(run(g + " --device cpu --temperature 0 --max-new-tokens 4093", &log), 0) << "3 + 4093 = 4096 fits";
  fs::remove_all(dir);
}

// generate --device cuda on a machine without a GPU: an error saying so (exit 1), before the checkpoint is read.
TEST(RunSafety, GenerateOnCudaWithoutAGpuIsAnError) {
  if (ds::cuda_device_count() > 0) GTEST_SKIP() << "a GPU is present (CudaGenerate.* runs generate on it)";
  std::string log;
  EXPECT_EQ(run("generate --threads 1 --device cuda --prompt N5 --model " + ds::test::fixture("hf_qwen35_tiny_a") +
                " --tokenizer " + ds::test::data_path("qwen3_tokenizer/tokenizer.json"), &log), 1);
  EXPECT_NE(log.find("error: --device cuda: no CUDA device is available"), std::string::npos) << log;
  EXPECT_EQ(log.find("N5"), std::string::npos) << "no output: " << log;
}

// 7. The NaN guard: --nan-policy stop names the last checkpoint, or says there is none; --nan-policy skip that
// skipped every step exits 1 (the weights never changed) after saving.
TEST(RunSafety, NanGuardMessagesAndAllSkipped) {
  const std::string dir = tmpdir("nanmsg");
  const std::string args = small_setup(dir) + " --threads 1 --lr 1e30 --clip 0 --warmup 0 --schedule constant";
  std::string log;
  EXPECT_EQ(run("train " + args + " --steps 4 --out " + dir + "/a", &log), 1);
  EXPECT_TRUE(contains(log, "error: step 2: loss is")) << log;
  EXPECT_TRUE(contains(log, "stopping (--nan-policy stop). No checkpoint was saved by this run")) << log;
  EXPECT_FALSE(contains(log, "intact")) << log;
  EXPECT_EQ(run("train " + args + " --steps 4 --save-interval 1 --out " + dir + "/b", &log), 1);
  EXPECT_TRUE(contains(log, "The last checkpoint, " + dir + "/b/checkpoint-1 (step 1), is intact")) << log;
  // Resumed from the blown-up checkpoint-1: steps 2-3 are all skipped.
  EXPECT_EQ(run("train --resume " + dir + "/b/checkpoint-1 --steps 3 --nan-policy skip --out " + dir + "/c", &log), 1);
  EXPECT_TRUE(contains(log, "every step (2 to 3) had a non-finite loss or grad norm and was skipped")) << log;
  EXPECT_TRUE(fs::exists(dir + "/c/checkpoint-3/trainer_state.json")) << "saved all the same";
  fs::remove_all(dir);
}

// 7. Bad flags are errors before anything is touched: --seed -1 (not 2^64 - 1), `--data --steps 1` (a flag taken for
// a file), a blank line inside a .jsonl (as `tokenize` refuses it); train --help says what a resume may change,
// --threads and the DELTASTACK_* variables.
TEST(RunSafety, BadFlagsAndHelp) {
  const std::string dir = tmpdir("flags");
  const std::string args = small_setup(dir) + " --threads 1 --steps 1 --out " + dir + "/o";
  std::string log;
  EXPECT_NE(run("train " + args + " --seed -1", &log), 0);
  EXPECT_TRUE(contains(log, "--seed: must be >= 0, got -1")) << log;
  EXPECT_EQ(run("train --data --steps 1 --out " + dir + "/o", &log), 1);
  EXPECT_TRUE(contains(log, "--data got the flag \"--steps\" as a file name")) << log;
  EXPECT_FALSE(fs::exists(dir + "/o")) << "nothing is created for bad flags";
  ds::write_file_atomic(dir + "/d.jsonl", "{\"text\": \"a b c d e f g h\"}\n\n{\"text\": \"i j k l\"}\n");
  EXPECT_EQ(run("train " + args + " --data " + dir + "/d.jsonl", &log), 1);
  EXPECT_TRUE(contains(log, dir + "/d.jsonl:2: empty line")) << log;
  EXPECT_EQ(run("train --help", &log), 0);
  for (const char* s : {"--threads N", "only --data, --steps", "--move-aside", "DELTASTACK_<OP>", "DELTASTACK_LOG",
                        "130 / 143"})
    EXPECT_TRUE(contains(log, s)) << s << "\n" << log;
  fs::remove_all(dir);
}

// 7. A save that fails before its checkpoint is complete (here: a directory where the optimizer file's temp file
// goes) exits 1 and removes its temp dir at once; the earlier checkpoint stays.
TEST(RunSafety, FailedSaveRemovesItsTempDir) {
  const std::string dir = tmpdir("failsave");
  const std::string out = dir + "/o";
  ::setenv("DELTASTACK_TEST_SAVE_PAUSE_MS", "400", 1);
  const pid_t pid = spawn("train " + small_setup(dir) + " --threads 1 --steps 2 --save-interval 1 --out " + out,
                          dir + "/log");
  ::unsetenv("DELTASTACK_TEST_SAVE_PAUSE_MS");
  const std::string tmp = out + "/.checkpoint-2.tmp";
  ASSERT_TRUE(wait_for([&] { return fs::exists(tmp + "/model.safetensors"); })) << read_or_empty(dir + "/log");
  fs::create_directories(tmp + "/optimizer.safetensors.tmp." + std::to_string(pid));
  EXPECT_EQ(wait_exit(pid), 1) << read_or_empty(dir + "/log");
  EXPECT_TRUE(contains(read_or_empty(dir + "/log"), "optimizer.safetensors: cannot write")) << read_or_empty(dir + "/log");
  EXPECT_FALSE(fs::exists(tmp));
  EXPECT_FALSE(fs::exists(out + "/checkpoint-2"));
  EXPECT_TRUE(fs::exists(out + "/checkpoint-1/trainer_state.json"));
  fs::remove_all(dir);
}

// 8. A checkpoint that does not fit on the disk (the free space the check sees set by a test hook) stops the run
// before it trains (issue 25 item 6: with the default end-only save, a long run trained to its end and then exited 1
// with no checkpoint): exit 1, an error with both sizes, no temp dir, no step trained.
TEST(RunSafety, SaveRefusedWhenTheDiskIsTooSmall) {
  const std::string dir = tmpdir("diskfull");
  const std::string out = dir + "/o";
  std::string log;
  int rc;
  {
    const ScopedEnv env({{"DELTASTACK_TEST_DISK_FREE_BYTES", "1000000"}});
    rc = run("train " + small_setup(dir) + " --threads 1 --steps 2 --out " + out, &log);
  }
  EXPECT_EQ(rc, 1) << log;
  EXPECT_TRUE(contains(log, "not training: checkpoint-2 (due at step 2) needs")) << log;
  EXPECT_TRUE(contains(log, "GiB but only 0.00 GiB is free")) << log;
  // One byte short: the two sizes would print as the same GiB, so they are given in bytes.
  const int64_t need = ds::checkpoint_bytes_estimate(ds::ModelConfig::from_file(dir + "/config.json"), "fp32");
  {
    const std::string short_by_one = std::to_string(need - 1);
    const ScopedEnv env({{"DELTASTACK_TEST_DISK_FREE_BYTES", short_by_one.c_str()}});
    EXPECT_EQ(run("train " + small_setup(dir) + " --threads 1 --steps 2 --out " + out, &log), 1) << log;
  }
  EXPECT_TRUE(contains(log, fmt::format("needs {} bytes but only {} bytes is free", need, need - 1))) << log;
  EXPECT_FALSE(fs::exists(out + "/.checkpoint-2.tmp"));
  EXPECT_FALSE(fs::exists(out + "/checkpoint-2"));
  EXPECT_FALSE(contains(read_or_empty(out + "/metrics.jsonl"), "\"loss\"")) << "a step was trained";
  {  // --steps 0 writes checkpoint-0 (the initial weights): checked the same way, before it is written
    const ScopedEnv env({{"DELTASTACK_TEST_DISK_FREE_BYTES", "1000000"}});
    EXPECT_EQ(run("train " + small_setup(dir) + " --threads 1 --steps 0 --out " + dir + "/zero", &log), 1) << log;
  }
  EXPECT_TRUE(contains(log, "not training: checkpoint-0 (due at step 0) needs")) << log;
  EXPECT_FALSE(fs::exists(dir + "/zero/checkpoint-0"));
  EXPECT_FALSE(fs::exists(dir + "/zero/.checkpoint-0.tmp"));
  fs::remove_all(dir);
}

// 9. A metrics line that cannot be written (the disk fills while the run trains; here a file-size limit, EFBIG,
// reached by metrics.jsonl alone) stops the run with an error naming the file and the checkpoint to resume: it
// neither trains on without its metrics (an ofstream in a failed state silently dropped every later line, and the
// run ended "done" with exit 0) nor leaves a torn line. A resume once there is room writes every step's line again.
TEST(RunSafety, AMetricsLineThatCannotBeWrittenStopsTheRun) {
  const std::string dir = tmpdir("metricsfull");
  const std::string out = dir + "/o";
  const std::string args = small_setup(dir) + " --threads 1";
  std::string log;
  ASSERT_EQ(run("train " + args + " --steps 2 --out " + out, &log), 0) << log;
  const std::string run_id =
      json::parse(ds::read_file(out + "/checkpoint-2/trainer_state.json"))["run_id"].get<std::string>();
  // A large line of the run's own (kept by a resume in its directory) puts metrics.jsonl far above every checkpoint
  // file, so that a size limit just above it fails only the metrics appends.
  {
    const json pad{{"step", 2}, {"run_id", run_id}, {"pad", std::string(25000000, 'x')}};
    std::FILE* f = std::fopen((out + "/metrics.jsonl").c_str(), "a");
    ASSERT_NE(f, nullptr);
    const std::string line = pad.dump() + "\n";
    std::fwrite(line.data(), 1, line.size(), f);
    std::fclose(f);
  }
  const auto size = static_cast<rlim_t>(fs::file_size(out + "/metrics.jsonl"));
  const pid_t pid = ::fork();
  if (pid == 0) {
    FILE* f = std::fopen((dir + "/log").c_str(), "a");
    if (f) {
      ::dup2(::fileno(f), 1);
      ::dup2(::fileno(f), 2);
    }
    ::signal(SIGXFSZ, SIG_IGN);  // writes past the limit fail with EFBIG instead of killing the process
    const struct rlimit lim{size + 300, size + 300};
    ::setrlimit(RLIMIT_FSIZE, &lim);
    ds::test::exec_deltastack("train --resume " + out + "/checkpoint-2 --steps 12 --threads 1");
  }
  EXPECT_EQ(wait_exit(pid), 1) << read_or_empty(dir + "/log");
  log = read_or_empty(dir + "/log");
  EXPECT_TRUE(contains(log, "metrics.jsonl: cannot append the metrics line of step")) << log;
  EXPECT_TRUE(contains(log, "resume with: deltastack train --resume " + out + "/checkpoint-2")) << log;
  EXPECT_FALSE(contains(log, "done: 12 steps")) << log;
  const std::string text = ds::read_file(out + "/metrics.jsonl");
  ASSERT_FALSE(text.empty());
  EXPECT_EQ(text.back(), '\n') << "a torn last line";
  EXPECT_LE(fs::file_size(out + "/metrics.jsonl"), size + 300);
  std::vector<json> lines;
  ASSERT_NO_THROW(lines = ds::test::metrics(out + "/metrics.jsonl"));
  // With room again the same resume continues: every step 1..12 has its line, in order, none twice.
  ASSERT_EQ(run("train --resume " + out + "/checkpoint-2 --steps 12 --threads 1", &log), 0) << log;
  std::vector<int64_t> steps;
  for (const json& j : ds::test::metrics(out + "/metrics.jsonl"))
    if (j.contains("loss")) steps.push_back(j["step"].get<int64_t>());
  std::vector<int64_t> want(12);
  std::iota(want.begin(), want.end(), int64_t{1});
  EXPECT_EQ(steps, want);
  fs::remove_all(dir);
}

// 10. A run directory renamed while its run trains (`mv runs/a runs/b`): the lock and metrics.jsonl are open files
// and go with it, so the later checkpoints must too. Before, each save recreated the old path and wrote the
// checkpoints there, apart from the metrics and with no lock held (a second run could take that directory).
TEST(RunSafety, ARunDirectoryMovedWhileTrainingKeepsItsCheckpointsWithItsMetrics) {
  const std::string dir = tmpdir("movedout");
  const std::string out = dir + "/o", moved = dir + "/moved";
  const pid_t pid = spawn("train " + small_setup(dir) + " --threads 1 --steps 60 --save-interval 30 --out " + out,
                          dir + "/log");
  ASSERT_TRUE(wait_for([&] { return contains(read_or_empty(out + "/metrics.jsonl"), "\"step\":3,"); }))
      << read_or_empty(dir + "/log");
  fs::rename(out, moved);
  EXPECT_EQ(wait_exit(pid), 0) << read_or_empty(dir + "/log");
  EXPECT_FALSE(fs::exists(out)) << "the old path was recreated";
  EXPECT_TRUE(fs::exists(moved + "/checkpoint-30/trainer_state.json"));
  EXPECT_TRUE(fs::exists(moved + "/checkpoint-60/trainer_state.json"));
  EXPECT_EQ(last_train_step(moved + "/metrics.jsonl"), 60);
  EXPECT_TRUE(contains(read_or_empty(dir + "/log"), "was moved to " + moved)) << read_or_empty(dir + "/log");
  // It resumes in its new place as its own run.
  std::string log;
  EXPECT_EQ(run("train --resume " + moved + "/checkpoint-60 --steps 62 --threads 1", &log), 0) << log;
  EXPECT_EQ(last_train_step(moved + "/metrics.jsonl"), 62);
  fs::remove_all(dir);
}

// 11. A metrics.jsonl in --out that is a link (here to the run's own corpus) is refused: the run appended its JSON
// lines to whatever it pointed at (lines that do not parse counted as no other run's), changing an input.
TEST(RunSafety, AMetricsFileThatIsALinkIsRefused) {
  const std::string dir = tmpdir("metricslink");
  const std::string out = dir + "/o";
  const std::string args = small_setup(dir) + " --threads 1 --steps 2 --out " + out;
  ds::write_file_atomic(dir + "/corpus.txt", ds::read_file(dir + "/corpus.txt") + "\n");
  const std::string before = ds::read_file(dir + "/corpus.txt");
  fs::create_directories(out);
  fs::create_symlink(dir + "/corpus.txt", out + "/metrics.jsonl");
  std::string log;
  EXPECT_EQ(run("train " + args, &log), 1) << log;
  EXPECT_TRUE(contains(log, "metrics.jsonl is a symbolic link, not a regular file")) << log;
  EXPECT_EQ(ds::read_file(dir + "/corpus.txt"), before) << "the input was written to";
  fs::remove_all(dir);
}

// 9. A hard-linked copy of a run directory (`cp -al`, `rsync --link-dest` snapshots) shares metrics.jsonl with the
// original: a resume in the copy is refused instead of appending its lines into both.
TEST(RunSafety, AHardLinkedMetricsFileIsRefused) {
  const std::string dir = tmpdir("hardlink");
  const std::string args = small_setup(dir) + " --threads 1";
  std::string log;
  ASSERT_EQ(run("train " + args + " --steps 2 --save-interval 1 --out " + dir + "/a", &log), 0) << log;
  ASSERT_EQ(std::system(("cp -al " + dir + "/a " + dir + "/snap").c_str()), 0);
  const std::string before = ds::read_file(dir + "/a/metrics.jsonl");
  EXPECT_EQ(run("train --resume " + dir + "/snap/checkpoint-2 --steps 3 --threads 1", &log), 1) << log;
  EXPECT_TRUE(contains(log, "hard links")) << log;
  EXPECT_EQ(ds::read_file(dir + "/a/metrics.jsonl"), before);
  EXPECT_FALSE(fs::exists(dir + "/snap/checkpoint-3"));
  fs::remove_all(dir);
}

// 10. A resume that fails its checks (here --steps below the checkpoint's) leaves the run directory as it was: the
// later checkpoints are not set aside into abandoned-K/ before every check has passed.
TEST(RunSafety, AFailedResumeMovesNoCheckpoint) {
  const std::string dir = tmpdir("failedresume");
  std::string log;
  ASSERT_EQ(run("train " + small_setup(dir) + " --threads 1 --steps 4 --save-interval 1 --out " + dir + "/l", &log), 0)
      << log;
  const std::string metrics = ds::read_file(dir + "/l/metrics.jsonl");
  EXPECT_EQ(run("train --resume " + dir + "/l/checkpoint-2 --steps 1 --threads 1", &log), 1) << log;
  EXPECT_TRUE(contains(log, "below the checkpoint's step 2")) << log;
  EXPECT_EQ(run("train --resume " + dir + "/l/checkpoint-2 --data " + dir + "/missing.txt --threads 1", &log), 1)
      << log;
  // A file named like a checkpoint this run would save: refused by the checks on --out, still before any move.
  ds::write_file_atomic(dir + "/l/checkpoint-3x", "");
  fs::rename(dir + "/l/checkpoint-3x", dir + "/l/checkpoint-5");
  EXPECT_EQ(run("train --resume " + dir + "/l/checkpoint-2 --steps 6 --save-interval 1 --threads 1", &log), 1) << log;
  EXPECT_TRUE(contains(log, "exists and is not a directory")) << log;
  EXPECT_TRUE(fs::exists(dir + "/l/checkpoint-3/trainer_state.json"));
  EXPECT_TRUE(fs::exists(dir + "/l/checkpoint-4/trainer_state.json"));
  EXPECT_FALSE(fs::exists(dir + "/l/abandoned-1"));
  EXPECT_EQ(ds::read_file(dir + "/l/metrics.jsonl"), metrics);
  fs::remove_all(dir);
}

// ---- Issue 25, data loss: one policy for what deltastack writes into a user's directories (core/fs_safety.h).

namespace {

// `deltastack <args>` started with DELTASTACK_TEST_REPLACE_GATE=<gate>: it stops before its final replace (the
// rename of its output into place) until release_gate(gate), so a test changes the destination at that point.
pid_t spawn_gated(const std::string& args, const std::string& log, const std::string& gate) {
  const ScopedEnv env({{"DELTASTACK_TEST_REPLACE_GATE", gate.c_str()}});
  return spawn(args, log);
}
bool gate_reached(const std::string& gate) { return wait_for([&] { return fs::exists(gate + ".reached"); }); }
void release_gate(const std::string& gate) { ds::write_file_atomic(gate, ""); }

// `tokenize` of a small corpus written into `dir` (add --output and --format).
std::string tokenize_args(const std::string& dir) {
  ds::write_file_atomic(dir + "/corpus.txt", "One paragraph.\n\nAnother one, a little longer.\n");
  return "tokenize --tokenizer " + ds::test::data_path("qwen3_tokenizer/tokenizer.json") + " --input " + dir +
         "/corpus.txt";
}

}  // namespace

// Item 2: `tokenize --overwrite` replaces only a dataset it wrote: a directory with an index.json of its own (the
// issue's `--output .`), or a dataset with anything beside its files, is refused and left whole.
TEST(Issue25, TokenizeOverwriteReplacesOnlyADatasetItWrote) {
  const std::string dir = tmpdir("i25_overwrite");
  const std::string tok = tokenize_args(dir);
  const std::string work = dir + "/work", ds_dir = dir + "/ds";
  fs::create_directories(work);
  ds::write_file_atomic(work + "/index.json", "{\"pages\": [\"home\"]}");
  ds::write_file_atomic(work + "/notes.txt", "mine");
  std::string log;
  EXPECT_EQ(run(tok + " --output " + work + " --format dataset --overwrite", &log), 1) << log;
  EXPECT_TRUE(contains(log, "is not a dataset")) << log;
  EXPECT_EQ(read_or_empty(work + "/notes.txt"), "mine");
  EXPECT_EQ(read_or_empty(work + "/index.json"), "{\"pages\": [\"home\"]}");
  // A real dataset with a file of the user's put beside its files: refused, both kept.
  ASSERT_EQ(run(tok + " --output " + ds_dir + " --format dataset", &log), 0) << log;
  const std::string index = ds::read_file(ds_dir + "/index.json");
  ds::write_file_atomic(ds_dir + "/notes.txt", "mine");
  EXPECT_EQ(run(tok + " --output " + ds_dir + " --format dataset --overwrite", &log), 1) << log;
  EXPECT_TRUE(contains(log, "also holds notes.txt")) << log;
  EXPECT_EQ(read_or_empty(ds_dir + "/notes.txt"), "mine");
  EXPECT_EQ(read_or_empty(ds_dir + "/index.json"), index);
  // A link among its files (to an input here) is no file of the dataset either.
  fs::remove(ds_dir + "/notes.txt");
  fs::create_symlink(dir + "/corpus.txt", ds_dir + "/tokens-00007.bin");
  EXPECT_EQ(run(tok + " --output " + ds_dir + " --format dataset --overwrite", &log), 1) << log;
  EXPECT_TRUE(contains(log, "also holds tokens-00007.bin")) << log;
  // Only its own files: replaced.
  fs::remove(ds_dir + "/tokens-00007.bin");
  EXPECT_EQ(run(tok + " --output " + ds_dir + " --format dataset --overwrite", &log), 0) << log;
  EXPECT_EQ(read_or_empty(ds_dir + "/index.json"), index);
  fs::remove_all(dir);
}

// Item 3: a symbolic link planted at OUT/.deltastack.lock is refused with a clear error: before, the run truncated
// the link's target and wrote its pid there, then saved its checkpoints into the target's directory.
TEST(Issue25, APlantedLockLinkIsRefused) {
  const std::string dir = tmpdir("i25_locklink");
  const std::string out = dir + "/o", victim = dir + "/victim";
  fs::create_directories(out);
  fs::create_directories(victim);
  ds::write_file_atomic(victim + "/precious.txt", "precious");
  fs::create_symlink(victim + "/precious.txt", out + "/" + ds::RunDirectory::kLockName);
  std::string log;
  EXPECT_EQ(run("train " + small_setup(dir) + " --threads 1 --steps 1 --out " + out, &log), 1) << log;
  EXPECT_TRUE(contains(log, ".deltastack.lock: is a symbolic link")) << log;
  EXPECT_EQ(read_or_empty(victim + "/precious.txt"), "precious");
  EXPECT_FALSE(fs::exists(victim + "/checkpoint-1"));
  EXPECT_FALSE(fs::exists(out + "/checkpoint-1"));
  fs::remove_all(dir);
}

// Item 4: tokenize replaces at its end only what it checked at its start. Two tokenizes into one dataset: the one
// that finishes second fails and the first one's output stays (before, both exited 0 and one output was lost); a
// file written at a jsonl output meanwhile stays too, also with --overwrite.
TEST(Issue25, TokenizeReplacesOnlyWhatItChecked) {
  const std::string dir = tmpdir("i25_tokrace");
  const std::string tok = tokenize_args(dir);
  const std::string ds_dir = dir + "/ds", gate = dir + "/gate";
  const pid_t first = spawn_gated(tok + " --output " + ds_dir + " --format dataset", dir + "/log1", gate);
  ASSERT_TRUE(gate_reached(gate)) << read_or_empty(dir + "/log1");
  std::string log;
  ASSERT_EQ(run(tok + " --output " + ds_dir + " --format dataset --shard-tokens 5", &log), 0) << log;
  const std::string second = ds::read_file(ds_dir + "/index.json");
  release_gate(gate);
  EXPECT_EQ(wait_exit(first), 1) << read_or_empty(dir + "/log1");
  EXPECT_TRUE(contains(read_or_empty(dir + "/log1"), "appeared while this command ran")) << read_or_empty(dir + "/log1");
  EXPECT_EQ(read_or_empty(ds_dir + "/index.json"), second);
  EXPECT_FALSE(fs::exists(ds_dir + ".tmp." + std::to_string(first)));

  // --format jsonl: a file written at the output while it runs (nothing was there at its start) stays.
  ds::write_file_atomic(dir + "/in.jsonl", "{\"text\": \"hello\"}\n");
  const std::string jtok = "tokenize --tokenizer " + ds::test::data_path("qwen3_tokenizer/tokenizer.json") +
                           " --input " + dir + "/in.jsonl --output " + dir + "/ids.jsonl";
  fs::remove(gate);
  fs::remove(gate + ".reached");
  const pid_t j1 = spawn_gated(jtok, dir + "/log2", gate);
  ASSERT_TRUE(gate_reached(gate)) << read_or_empty(dir + "/log2");
  ds::write_file_atomic(dir + "/ids.jsonl", "mine\n");
  release_gate(gate);
  EXPECT_EQ(wait_exit(j1), 1) << read_or_empty(dir + "/log2");
  EXPECT_EQ(read_or_empty(dir + "/ids.jsonl"), "mine\n");
  // With --overwrite it replaces the file it checked, not another one put there meanwhile.
  fs::remove(gate);
  fs::remove(gate + ".reached");
  const pid_t j2 = spawn_gated(jtok + " --overwrite", dir + "/log3", gate);
  ASSERT_TRUE(gate_reached(gate)) << read_or_empty(dir + "/log3");
  ds::write_file_atomic(dir + "/ids.jsonl", "mine, again\n");  // a new file (another inode) at the name
  release_gate(gate);
  EXPECT_EQ(wait_exit(j2), 1) << read_or_empty(dir + "/log3");
  EXPECT_TRUE(contains(read_or_empty(dir + "/log3"), "was replaced by something else")) << read_or_empty(dir + "/log3");
  EXPECT_EQ(read_or_empty(dir + "/ids.jsonl"), "mine, again\n");
  EXPECT_FALSE(fs::exists(dir + "/ids.jsonl.tmp." + std::to_string(j2)));
  // Untouched, it is replaced.
  EXPECT_EQ(run(jtok + " --overwrite", &log), 0) << log;
  EXPECT_TRUE(contains(read_or_empty(dir + "/ids.jsonl"), "\"ids\"")) << read_or_empty(dir + "/ids.jsonl");
  fs::remove_all(dir);
}

// Item 5: a directory that appears at OUT/checkpoint-N while the run trains is kept: the save fails naming it
// (before, it was swapped out and deleted; at the start, claim() refuses an empty one; one holding only a user's
// files is left alone there, and refused here when the save of its step comes).
TEST(Issue25, ACheckpointDirectoryMadeDuringTheRunIsKept) {
  const std::string dir = tmpdir("i25_ckptrace");
  const std::string out = dir + "/o", gate = dir + "/gate";
  const pid_t pid = spawn_gated("train " + small_setup(dir) + " --threads 1 --steps 2 --out " + out, dir + "/log", gate);
  ASSERT_TRUE(gate_reached(gate)) << read_or_empty(dir + "/log");
  fs::create_directories(out + "/checkpoint-2");
  ds::write_file_atomic(out + "/checkpoint-2/mine.txt", "mine");
  release_gate(gate);
  EXPECT_EQ(wait_exit(pid), 1) << read_or_empty(dir + "/log");
  const std::string log = read_or_empty(dir + "/log");
  EXPECT_TRUE(contains(log, "cannot save " + out + "/checkpoint-2")) << log;
  EXPECT_TRUE(contains(log, "appeared while this command ran")) << log;
  EXPECT_EQ(read_or_empty(out + "/checkpoint-2/mine.txt"), "mine");
  EXPECT_TRUE(fs::exists(out + "/.checkpoint-2.tmp/trainer_state.json")) << "the new checkpoint is kept, named";
  fs::remove_all(dir);
}

// Item 6: the free space is re-checked after each save: a disk that fills while the run trains stops it at once,
// with its last checkpoint complete and the resume command, instead of training to the next save and failing there.
TEST(Issue25, TheFreeSpaceIsCheckedBeforeEachSaveInterval) {
  const std::string dir = tmpdir("i25_diskinterval");
  const std::string out = dir + "/o", gate = dir + "/gate", free_file = dir + "/free";
  ds::write_file_atomic(free_file, "100000000000");
  const std::string hook = "@" + free_file;
  pid_t pid;
  {
    const ScopedEnv env({{"DELTASTACK_TEST_DISK_FREE_BYTES", hook.c_str()}});
    pid = spawn_gated("train " + small_setup(dir) + " --threads 1 --steps 6 --save-interval 2 --out " + out,
                      dir + "/log", gate);
  }
  ASSERT_TRUE(gate_reached(gate)) << read_or_empty(dir + "/log");  // checkpoint-2 is being put in place
  ds::write_file_atomic(free_file, "1000000");
  release_gate(gate);
  EXPECT_EQ(wait_exit(pid), 1) << read_or_empty(dir + "/log");
  const std::string log = read_or_empty(dir + "/log");
  EXPECT_TRUE(contains(log, "stopping after step 2: checkpoint-4 (due at step 4) needs")) << log;
  EXPECT_TRUE(contains(log, "deltastack train --resume " + out + "/checkpoint-2")) << log;
  EXPECT_TRUE(fs::exists(out + "/checkpoint-2/trainer_state.json"));
  EXPECT_EQ(last_train_step(out + "/metrics.jsonl"), 2);
  fs::remove_all(dir);
}

// Item 12: two exports to one destination: each builds in a temporary directory of its own, and the one that
// finishes second fails instead of leaving the destination without config.json (they shared a fixed temp name).
TEST(Issue25, TwoExportsToOneDestination) {
  const std::string dir = tmpdir("i25_export");
  const std::string src = ds::test::fixture("hf_qwen35_tiny_a"), dst = dir + "/exp", gate = dir + "/gate";
  const pid_t first = spawn_gated("export " + src + " " + dst, dir + "/log", gate);
  ASSERT_TRUE(gate_reached(gate)) << read_or_empty(dir + "/log");
  std::string log;
  ASSERT_EQ(run("export " + src + " " + dst, &log), 0) << log;
  const std::string config = ds::read_file(dst + "/config.json");
  release_gate(gate);
  EXPECT_EQ(wait_exit(first), 1) << read_or_empty(dir + "/log");
  EXPECT_TRUE(contains(read_or_empty(dir + "/log"), "appeared while this command ran")) << read_or_empty(dir + "/log");
  EXPECT_EQ(read_or_empty(dst + "/config.json"), config);
  EXPECT_TRUE(fs::exists(dst + "/model.safetensors"));
  EXPECT_FALSE(fs::exists(dst + "/" + ds::TempDir::kTempMarker));
  for (const auto& e : fs::directory_iterator(dir))
    EXPECT_EQ(e.path().filename().string().find(".export.tmp"), std::string::npos) << e.path();
  fs::remove_all(dir);
}

// Item 16: SIGINT during tokenize removes its temporary directory and says so (exit 130); one that SIGKILL left is
// removed by the next tokenize into the same output, but only when provably ours: our name, our marker, this host,
// a dead pid.
TEST(Issue25, AnInterruptedTokenizeLeavesNoTemporaryDirectory) {
  const std::string dir = tmpdir("i25_toksignal");
  const std::string tok = tokenize_args(dir) + " --format dataset --output " + dir + "/ds";
  const std::string gate = dir + "/gate";
  const pid_t a = spawn_gated(tok, dir + "/log1", gate);
  ASSERT_TRUE(gate_reached(gate)) << read_or_empty(dir + "/log1");
  const std::string tmp_a = dir + "/ds.tmp." + std::to_string(a);
  ASSERT_TRUE(fs::exists(tmp_a + "/index.json"));
  ::kill(a, SIGINT);
  EXPECT_EQ(wait_exit(a), 130) << read_or_empty(dir + "/log1");
  EXPECT_TRUE(contains(read_or_empty(dir + "/log1"), "stopped by SIGINT; removed the partial output " + tmp_a))
      << read_or_empty(dir + "/log1");
  EXPECT_FALSE(fs::exists(tmp_a));
  EXPECT_FALSE(fs::exists(dir + "/ds"));

  const std::string gate2 = dir + "/gate2";
  const pid_t b = spawn_gated(tok, dir + "/log2", gate2);
  ASSERT_TRUE(gate_reached(gate2)) << read_or_empty(dir + "/log2");
  ::kill(b, SIGKILL);
  EXPECT_EQ(wait_exit(b), -SIGKILL);
  const std::string tmp_b = dir + "/ds.tmp." + std::to_string(b);
  ASSERT_TRUE(fs::exists(tmp_b + "/" + ds::TempDir::kTempMarker));
  // Not ours to remove: the same name without the marker, and one whose marker names a live process (this one).
  const std::string plain = dir + "/ds.tmp.123456789", alive = dir + "/ds.tmp." + std::to_string(::getpid());
  fs::create_directories(plain);
  fs::create_directories(alive);
  std::string marker = ds::read_file(tmp_b + "/" + ds::TempDir::kTempMarker);
  marker.replace(marker.find("pid " + std::to_string(b)), 4 + std::to_string(b).size(),
                 "pid " + std::to_string(::getpid()));
  ds::write_file_atomic(alive + "/" + ds::TempDir::kTempMarker, marker);
  std::string log;
  EXPECT_EQ(run(tok, &log), 0) << log;
  EXPECT_TRUE(contains(log, "removing " + tmp_b)) << log;
  EXPECT_FALSE(fs::exists(tmp_b));
  EXPECT_TRUE(fs::exists(plain));
  EXPECT_TRUE(fs::exists(alive + "/" + ds::TempDir::kTempMarker));
  EXPECT_TRUE(fs::exists(dir + "/ds/index.json"));
  EXPECT_FALSE(fs::exists(dir + "/ds/" + ds::TempDir::kTempMarker));
  fs::remove_all(dir);
}

// The atomic writer's temporary file is created new: a link planted at "<path>.tmp.<pid>" is not followed (its
// target was truncated and written).
TEST(Issue25, TheAtomicWritersTemporaryFileFollowsNoLink) {
  const std::string dir = tmpdir("i25_tmplink");
  ds::write_file_atomic(dir + "/victim.txt", "precious");
  fs::create_symlink(dir + "/victim.txt", dir + "/out.txt.tmp." + std::to_string(::getpid()));
  ds::write_file_atomic(dir + "/out.txt", "new");
  EXPECT_EQ(ds::read_file(dir + "/victim.txt"), "precious");
  EXPECT_EQ(ds::read_file(dir + "/out.txt"), "new");
  EXPECT_FALSE(fs::is_symlink(dir + "/out.txt"));
  fs::remove_all(dir);
}

// ---- Issue 25, the hostile tester's second pass.

// D1: --keep-last deletes only what a checkpoint save wrote. A user's NOTES.md and analysis/ inside an older
// checkpoint stay, and the directory with them (its checkpoint files go, with a warning naming it); an older
// checkpoint holding only its own files is removed whole. Before, the whole directory was deleted.
TEST(Issue25, KeepLastKeepsAUsersFilesInACheckpoint) {
  const std::string dir = tmpdir("i25_keeplast_user");
  const std::string out = dir + "/k/r", ck1 = out + "/checkpoint-1";
  const std::string args = small_setup(dir) + " --threads 1";
  std::string log;
  ASSERT_EQ(run("train " + args + " --steps 2 --save-interval 1 --out " + out, &log), 0) << log;
  ds::write_file_atomic(ck1 + "/NOTES.md", "my notes");
  fs::create_directories(ck1 + "/analysis");
  ds::write_file_atomic(ck1 + "/analysis/loss.csv", "1,2");
  ASSERT_EQ(run("train --resume " + out + "/checkpoint-2 --steps 3 --keep-last 1 --threads 1", &log), 0) << log;
  EXPECT_EQ(read_or_empty(ck1 + "/NOTES.md"), "my notes");
  EXPECT_EQ(read_or_empty(ck1 + "/analysis/loss.csv"), "1,2");
  EXPECT_FALSE(fs::exists(ck1 + "/trainer_state.json"));
  EXPECT_FALSE(fs::exists(ck1 + "/model.safetensors"));
  EXPECT_TRUE(contains(log, "removed the checkpoint files of " + ck1 + " but kept the directory: it also holds "
                            "NOTES.md")) << log;
  EXPECT_FALSE(fs::exists(out + "/checkpoint-2"));
  EXPECT_TRUE(fs::exists(out + "/checkpoint-3/trainer_state.json"));
  for (const auto& e : fs::directory_iterator(out))
    EXPECT_EQ(e.path().filename().string().find(".old.tmp"), std::string::npos) << e.path();
  // What is left holds no checkpoint of any run: the run resumes beside it, and it stays.
  ASSERT_EQ(run("train --resume " + out + "/checkpoint-3 --steps 4 --keep-last 1 --threads 1", &log), 0) << log;
  EXPECT_EQ(read_or_empty(ck1 + "/NOTES.md"), "my notes");
  EXPECT_FALSE(fs::exists(out + "/checkpoint-3"));
  EXPECT_TRUE(fs::exists(out + "/checkpoint-4/trainer_state.json"));
  fs::remove_all(dir);
}

// A second breaker round: a user's directory in --out named like a save's temporary one (".checkpoint-7.tmp",
// ".checkpoint-my-backup.tmp") was deleted with everything in it by any train into that --out, even one that then
// refused to start. Only ".checkpoint-<digits>[.old].tmp" count, and of those only the files a save writes go.
TEST(Issue25, AUsersDirectoryNamedLikeASaveTempIsKept) {
  const std::string dir = tmpdir("i25_ckpt_tmp_user");
  const std::string out = dir + "/o";
  const std::string args = small_setup(dir) + " --threads 1 --steps 1";
  fs::create_directories(out + "/.checkpoint-7.tmp/sub");
  ds::write_file_atomic(out + "/.checkpoint-7.tmp/sub/data.csv", "precious");
  ds::write_file_atomic(out + "/.checkpoint-7.tmp/readme", "mine");
  ds::write_file_atomic(out + "/.checkpoint-7.tmp/config.json", "{}");  // a name a save writes: removed
  ds::write_file_atomic(out + "/.checkpoint-7.tmp/model.safetensors.tmp.4242", "x");  // a killed save's: removed
  fs::create_directories(out + "/.checkpoint-my-backup.tmp");
  ds::write_file_atomic(out + "/.checkpoint-my-backup.tmp/f", "backup");
  std::string log;
  ASSERT_EQ(run("train " + args + " --out " + out, &log), 0) << log;
  EXPECT_EQ(read_or_empty(out + "/.checkpoint-7.tmp/sub/data.csv"), "precious");
  EXPECT_EQ(read_or_empty(out + "/.checkpoint-7.tmp/readme"), "mine");
  EXPECT_FALSE(fs::exists(out + "/.checkpoint-7.tmp/config.json"));
  EXPECT_FALSE(fs::exists(out + "/.checkpoint-7.tmp/model.safetensors.tmp.4242"));
  EXPECT_EQ(read_or_empty(out + "/.checkpoint-my-backup.tmp/f"), "backup");
  EXPECT_TRUE(contains(log, "but kept the directory")) << log;
  // A run that then refuses to start (another run's files in --out) keeps them too.
  ASSERT_NE(run("train " + args + " --seed 7 --out " + out, &log), 0) << log;
  EXPECT_EQ(read_or_empty(out + "/.checkpoint-7.tmp/readme"), "mine");
  EXPECT_TRUE(ds::checkpoint_temp_name(".checkpoint-12.tmp"));
  EXPECT_TRUE(ds::checkpoint_temp_name(".checkpoint-3.old.tmp"));
  EXPECT_FALSE(ds::checkpoint_temp_name(".checkpoint-abc.tmp"));
  EXPECT_FALSE(ds::checkpoint_temp_name(".checkpoint-.tmp"));
  EXPECT_FALSE(ds::checkpoint_temp_name(".checkpoint-2.tmp.bak"));
  fs::remove_all(dir);
}

// D2: forward replaces at its end only what it checked at its start, like tokenize and export. A file written at
// --output while forward runs stays (the run fails naming it); of two forwards to one new output the one that
// finishes second fails and the first one's output stays. Before, each replaced what was there and exited 0.
TEST(Issue25, ForwardReplacesOnlyWhatItChecked) {
  const std::string dir = tmpdir("i25_fwdrace");
  const std::string model = ds::test::fixture("hf_qwen35_tiny_a");
  const std::string fwd = "forward --threads 1 --device cpu --model " + model + " --inputs " + model +
                          "/inputs.safetensors ";
  // `fwd + args` stopped at its gate `name` while `meanwhile` runs: it must fail with `needle` in its log.
  auto fails_after = [&](const std::string& args, const std::string& name, const std::function<void()>& meanwhile,
                         const std::string& needle) {
    const std::string gate = dir + "/" + name, log = dir + "/" + name + ".log";
    const pid_t pid = spawn_gated(fwd + args, log, gate);
    ASSERT_TRUE(gate_reached(gate)) << read_or_empty(log);
    meanwhile();
    release_gate(gate);
    EXPECT_EQ(wait_exit(pid), 1) << read_or_empty(log);
    EXPECT_TRUE(contains(read_or_empty(log), needle)) << read_or_empty(log);
  };
  const std::string o = dir + "/o.safetensors", g = dir + "/g.safetensors", o3 = dir + "/o3.safetensors";
  fails_after("--output " + o + " --grads " + g, "gate1", [&] { ds::write_file_atomic(o, "the user's"); },
              "--output " + o + ": " + o + " appeared while this command ran");
  EXPECT_EQ(read_or_empty(o), "the user's");
  // --grads too, with --overwrite: a file that replaced the checked one meanwhile stays.
  ds::write_file_atomic(g, "old");
  fails_after("--output " + dir + "/o2.safetensors --grads " + g + " --overwrite", "gate2",
              [&] { ds::write_file_atomic(g, "the user's new one"); },
              "--grads " + g + ": " + g + " was replaced by something else");
  EXPECT_EQ(read_or_empty(g), "the user's new one");
  // Two forwards to one new output: the second to finish fails, the first one's output stays.
  std::string first;
  fails_after("--output " + o3, "gate3", [&] {
    std::string log;
    ASSERT_EQ(run(fwd + "--output " + o3, &log), 0) << log;
    first = ds::read_file(o3);
  }, "appeared while this command ran");
  EXPECT_EQ(read_or_empty(o3), first);
  EXPECT_FALSE(first.empty());
  for (const auto& e : fs::directory_iterator(dir))
    EXPECT_EQ(e.path().filename().string().find(".tmp."), std::string::npos) << e.path();
  fs::remove_all(dir);
}

// D3: a --grad-accum no run can mean is refused naming the flag (it was accepted and ran silent for days), and a
// signal stops a step between its micro-batches: the step is not taken and nothing partial is saved (before, the
// signal was seen only between steps, so a long step ignored SIGTERM).
TEST(Issue25, AHugeGradAccumIsRefusedAndASignalStopsALongStep) {
  const std::string dir = tmpdir("i25_gradaccum");
  const std::string args = small_setup(dir) + " --threads 1", out = dir + "/o";
  std::string log;
  EXPECT_EQ(run("train " + args + " --grad-accum 1000000000 --out " + out, &log), 1) << log;
  EXPECT_TRUE(contains(log, "--grad-accum must be in [1, 1000000], got 1000000000")) << log;
  const pid_t pid = spawn("train " + args + " --grad-accum 1000000 --steps 2 --out " + out, dir + "/log");
  ASSERT_TRUE(wait_for([&] { return contains(read_or_empty(dir + "/log"), "step 0 | eval_loss"); }))
      << read_or_empty(dir + "/log");
  ::kill(pid, SIGTERM);
  EXPECT_EQ(wait_exit(pid), 128 + SIGTERM) << read_or_empty(dir + "/log");
  log = read_or_empty(dir + "/log");
  EXPECT_TRUE(contains(log, "stopped by SIGTERM after step 0 of 2: no step was taken")) << log;
  EXPECT_FALSE(fs::exists(out + "/checkpoint-1"));
  EXPECT_FALSE(fs::exists(out + "/checkpoint-0"));
  fs::remove_all(dir);
}

// D4: a save refused because checkpoint-N appeared meanwhile names the temporary directory that holds the complete
// new checkpoint, and the next run into that --out keeps it (as checkpoint-N.recovered) instead of deleting it as
// "left by an interrupted checkpoint save"; an incomplete one is still removed.
TEST(Issue25, ARefusedSaveKeepsItsCompleteCheckpoint) {
  const std::string dir = tmpdir("i25_recovered");
  const std::string out = dir + "/o", gate = dir + "/gate", args = small_setup(dir) + " --threads 1";
  const pid_t pid = spawn_gated("train " + args + " --steps 2 --out " + out, dir + "/log", gate);
  ASSERT_TRUE(gate_reached(gate)) << read_or_empty(dir + "/log");
  fs::create_directories(out + "/checkpoint-2");
  ds::write_file_atomic(out + "/checkpoint-2/mine.txt", "mine");
  release_gate(gate);
  EXPECT_EQ(wait_exit(pid), 1) << read_or_empty(dir + "/log");
  std::string log = read_or_empty(dir + "/log");
  EXPECT_TRUE(contains(log, "The complete new checkpoint is kept in " + out + "/.checkpoint-2.tmp")) << log;
  const std::string state = read_or_empty(out + "/.checkpoint-2.tmp/trainer_state.json");
  ASSERT_FALSE(state.empty());
  fs::rename(out + "/checkpoint-2", dir + "/mine");
  fs::create_directories(out + "/.checkpoint-3.tmp");  // an incomplete save's
  ds::write_file_atomic(out + "/.checkpoint-3.tmp/config.json", "{}");
  ASSERT_EQ(run("train " + args + " --steps 1 --move-aside --out " + out, &log), 0) << log;
  EXPECT_TRUE(contains(log, "kept as " + out + "/checkpoint-2.recovered")) << log;
  EXPECT_EQ(read_or_empty(out + "/checkpoint-2.recovered/trainer_state.json"), state);
  EXPECT_TRUE(fs::exists(out + "/checkpoint-2.recovered/model.safetensors"));
  EXPECT_FALSE(fs::exists(out + "/.checkpoint-2.tmp"));
  EXPECT_FALSE(fs::exists(out + "/.checkpoint-3.tmp"));
  EXPECT_EQ(read_or_empty(dir + "/mine/mine.txt"), "mine");
  fs::remove_all(dir);
}

// D6: `tokenize --overwrite` removes only what the dataset's index.json lists: a hand-made index.json that names the
// format, beside a user's file named like a shard that the index does not list, is refused and both are kept
// (before, tokens-00007.bin was deleted: the check went by file names only).
TEST(Issue25, TokenizeOverwriteRemovesOnlyWhatTheIndexLists) {
  const std::string dir = tmpdir("i25_unlisted");
  const std::string tok = tokenize_args(dir), ds_dir = dir + "/ds";
  fs::create_directories(ds_dir);
  const std::string index = "{\"format\":\"deltastack-dataset\",\"version\":1}";
  ds::write_file_atomic(ds_dir + "/index.json", index);
  ds::write_file_atomic(ds_dir + "/tokens-00007.bin", "mine");
  std::string log;
  EXPECT_EQ(run(tok + " --output " + ds_dir + " --format dataset --overwrite", &log), 1) << log;
  EXPECT_TRUE(contains(log, "also holds tokens-00007.bin, which its index.json does not list")) << log;
  EXPECT_EQ(read_or_empty(ds_dir + "/tokens-00007.bin"), "mine");
  EXPECT_EQ(read_or_empty(ds_dir + "/index.json"), index);
  // A dataset tokenize wrote is still replaced, shards and all.
  fs::remove_all(ds_dir);
  ASSERT_EQ(run(tok + " --output " + ds_dir + " --format dataset --shard-tokens 5", &log), 0) << log;
  ASSERT_TRUE(fs::exists(ds_dir + "/tokens-00001.bin"));
  EXPECT_EQ(run(tok + " --output " + ds_dir + " --format dataset --overwrite", &log), 0) << log;
  EXPECT_FALSE(fs::exists(ds_dir + "/tokens-00001.bin"));
  EXPECT_TRUE(fs::exists(ds_dir + "/tokens-00000.bin"));
  fs::remove_all(dir);
}

// D7: a signal right after tokenize created its temporary directory removes it and says so (before, the handler
// was installed after the mkdir: the process died at once and left the directory with no message).
TEST(Issue25, ASignalRightAfterTheTempDirIsMadeRemovesIt) {
  const std::string dir = tmpdir("i25_tempgate");
  const std::string tok = tokenize_args(dir) + " --format dataset --output " + dir + "/ds", gate = dir + "/gate";
  pid_t pid;
  {
    const ScopedEnv env({{"DELTASTACK_TEST_TEMPDIR_GATE", gate.c_str()}});
    pid = spawn(tok, dir + "/log");
  }
  ASSERT_TRUE(gate_reached(gate)) << read_or_empty(dir + "/log");
  const std::string tmp = dir + "/ds.tmp." + std::to_string(pid);
  ASSERT_TRUE(fs::is_directory(tmp));
  ::kill(pid, SIGTERM);
  EXPECT_EQ(wait_exit(pid), 128 + SIGTERM) << read_or_empty(dir + "/log");
  EXPECT_TRUE(contains(read_or_empty(dir + "/log"), "stopped by SIGTERM; removed the partial output " + tmp))
      << read_or_empty(dir + "/log");
  EXPECT_FALSE(fs::exists(tmp));
  EXPECT_FALSE(fs::exists(dir + "/ds"));
  fs::remove_all(dir);
}

// --offload-activations moves the layer inputs of full recompute to host memory: with another --recompute, or on the
// CPU engine (whose activations are in host memory already), it is refused naming the flags, before --out exists.
TEST(RunSafety, OffloadActivationsRefusedWhereItCannotRun) {
  const std::string dir = tmpdir("offload");
  const std::string args = small_setup(dir) + " --threads 1 --steps 1 --offload-activations";
  std::string log;
  EXPECT_EQ(run("train " + args + " --recompute selective --out " + dir + "/a", &log), 1) << log;
  EXPECT_TRUE(contains(log, "--offload-activations and --recompute selective contradict each other")) << log;
  EXPECT_EQ(run("train " + args + " --device cpu --out " + dir + "/b", &log), 1) << log;
  EXPECT_TRUE(contains(log, "--offload-activations is a mode of the GPU engine")) << log;
  EXPECT_FALSE(fs::exists(dir + "/a"));
  EXPECT_FALSE(fs::exists(dir + "/b"));
}

// --no-save (a benchmark, a throwaway run, a resume check of a model whose second checkpoint would not fit, as the
// 27B run on the H200's /dev/shm): no checkpoint at all, not at the end and not on a signal, and no free-space check
// (the disk the test hook reports could not hold one); --save-interval or --keep-last with it are refused naming
// both flags. A resume may add it: the resumed steps are bitwise those of a run never stopped, none saved.
TEST(RunSafety, NoSaveWritesNoCheckpointAnywhere) {
  const std::string dir = tmpdir("nosave");
  const std::string args = small_setup(dir) + " --schedule constant --warmup 0 --threads 1";
  auto checkpoints_in = [](const std::string& out) {
    std::vector<std::string> names;
    for (const auto& e : fs::directory_iterator(out))
      if (e.path().filename().string().find("checkpoint") != std::string::npos)
        names.push_back(e.path().filename().string());
    return names;
  };
  std::string log;
  {
    const ScopedEnv env({{"DELTASTACK_TEST_DISK_FREE_BYTES", "1000"}});
    ASSERT_EQ(run("train " + args + " --steps 4 --no-save --out " + dir + "/ref", &log), 0) << log;
  }
  EXPECT_EQ(checkpoints_in(dir + "/ref"), std::vector<std::string>{}) << log;
  const std::vector<double> ref = ds::test::train_losses(dir + "/ref/metrics.jsonl");
  ASSERT_EQ(ref.size(), 4u);
  for (const char* f : {"--save-interval 2", "--keep-last 1"}) {
    EXPECT_EQ(run("train " + args + " --steps 2 --no-save " + f + " --out " + dir + "/bad", &log), 1) << f;
    EXPECT_TRUE(contains(log, std::string("--no-save and ") + std::string(f).substr(0, std::string(f).find(' ')) +
                                  " contradict each other")) << log;
  }
  // Saved at step 2, resumed with --no-save to step 4: the same losses, checkpoint-2 the only one.
  ASSERT_EQ(run("train " + args + " --steps 2 --out " + dir + "/a", &log), 0) << log;
  ASSERT_EQ(run("train --resume " + dir + "/a/checkpoint-2 --steps 4 --no-save --threads 1", &log), 0) << log;
  EXPECT_EQ(ds::test::train_losses(dir + "/a/metrics.jsonl"), ref);
  EXPECT_EQ(checkpoints_in(dir + "/a"), std::vector<std::string>{"checkpoint-2"}) << log;
  // A signal stops it without a save, and says so.
  const pid_t pid = spawn("train " + args + " --steps 100000 --no-save --out " + dir + "/sig", dir + "/log");
  ASSERT_TRUE(wait_for([&] { return last_train_step(dir + "/sig/metrics.jsonl") >= 2; })) << read_or_empty(dir + "/log");
  ::kill(pid, SIGTERM);
  EXPECT_EQ(wait_exit(pid), 143) << read_or_empty(dir + "/log");
  log = read_or_empty(dir + "/log");
  EXPECT_TRUE(contains(log, "--no-save, so no checkpoint was written")) << log;
  EXPECT_EQ(checkpoints_in(dir + "/sig"), std::vector<std::string>{}) << log;
  fs::remove_all(dir);
}

// The free-space check counts the state this process writes: one process (no launcher, so no device communicator)
// with --shard optimizer shards nothing and saves the 8bit moments as codes (about 4 bytes a parameter), not the
// sharded state's F32 moments (10). Here the disk the test hook reports holds exactly the unsharded checkpoint's
// estimate; the check counted the sharded one and refused to train. (On the GPU: the 8bit state is the GPU engine's.)
TEST(RunSafety, OneProcessWithShardOptimizerIsCheckedForTheCheckpointItWrites) {
  if (ds::cuda_device_count() == 0) GTEST_SKIP() << "the 8bit state is the GPU engine's";
  const std::string dir = tmpdir("shard1");
  const ds::ModelConfig tiny = ds::ModelConfig::preset("tiny");
  const int64_t codes = ds::checkpoint_bytes_estimate(tiny, "8bit");
  const int64_t f32 = ds::checkpoint_bytes_estimate(tiny, "8bit", "optimizer");
  ASSERT_LT(codes, f32);
  std::string log;
  {
    const std::string free_bytes = std::to_string(codes);
    const ScopedEnv env({{"DELTASTACK_TEST_DISK_FREE_BYTES", free_bytes.c_str()}});
    ASSERT_EQ(run("train --device cuda --model tiny --optimizer-state 8bit --shard optimizer --steps 1 --seq-len 64 "
                  "--micro-batch 1 --eval-batches 0 --val-fraction 0 --threads 1 --out " + dir + "/o", &log), 0) << log;
  }
  EXPECT_FALSE(contains(log, "not training")) << log;
  EXPECT_TRUE(fs::is_directory(dir + "/o/checkpoint-1")) << log;
  fs::remove_all(dir);
}

// A --no-save resume in the run's own directory (the default --out of a resume) from a checkpoint with later ones
// after it: the resume would set those aside as the abandoned history and save nothing in their place, so the
// directory's newest checkpoint would be gone from where the user left it. Refused before anything in --out
// changes, naming them and the way out; into another --out it runs, the run directory untouched.
TEST(RunSafety, ANoSaveResumeLeavesTheLaterCheckpointsInPlace) {
  const std::string dir = tmpdir("nosave_later");
  const std::string args = small_setup(dir) + " --schedule constant --warmup 0 --threads 1";
  std::string log;
  ASSERT_EQ(run("train " + args + " --steps 4 --save-interval 2 --out " + dir + "/r", &log), 0) << log;
  const std::string metrics = read_or_empty(dir + "/r/metrics.jsonl");
  EXPECT_EQ(run("train --resume " + dir + "/r/checkpoint-2 --no-save --threads 1", &log), 1) << log;
  EXPECT_TRUE(contains(log, "--no-save: resuming " + dir + "/r/checkpoint-2 in " + dir + "/r would set aside this "
                            "run's later checkpoint-4")) << log;
  EXPECT_TRUE(contains(log, "give --out another directory")) << log;
  EXPECT_TRUE(fs::is_directory(dir + "/r/checkpoint-4"));
  EXPECT_FALSE(fs::exists(dir + "/r/abandoned-1"));
  EXPECT_EQ(read_or_empty(dir + "/r/metrics.jsonl"), metrics);
  ASSERT_EQ(run("train --resume " + dir + "/r/checkpoint-2 --no-save --threads 1 --out " + dir + "/other", &log), 0)
      << log;
  EXPECT_TRUE(fs::is_directory(dir + "/r/checkpoint-4"));
  EXPECT_EQ(read_or_empty(dir + "/r/metrics.jsonl"), metrics);
  const std::vector<double> all = ds::test::train_losses(dir + "/r/metrics.jsonl");
  ASSERT_EQ(all.size(), 4u);
  EXPECT_EQ(ds::test::train_losses(dir + "/other/metrics.jsonl"), std::vector<double>(all.begin() + 2, all.end()));
  fs::remove_all(dir);
}
