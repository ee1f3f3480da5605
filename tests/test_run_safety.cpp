// Issue 13, "nothing lost, ever", through the `deltastack` binary: the run-directory lock, graceful signals, guarded
// outputs, metrics.jsonl kept whole, and a resume that needs only the checkpoint.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <string>
#include <thread>

#include "core/files.h"
#include "train/run_dir.h"
#include "train_test_util.h"

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

using ds::test::run;
using ds::test::small_setup;
using ds::test::spawn;

std::string tmpdir(const std::string& name) { return ds::test::fresh_tmpdir("safety_" + name); }

// Polls `done` every 5 ms for at most `seconds`; returns whether it became true.
bool wait_for(const std::function<bool()>& done, double seconds = 30) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (std::chrono::steady_clock::now() < end) {
    if (done()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return done();
}

// The exit code of a spawned child (waits for it); -signal when a signal killed it.
int wait_exit(pid_t pid) {
  int st = 0;
  ::waitpid(pid, &st, 0);
  return WIFEXITED(st) ? WEXITSTATUS(st) : -WTERMSIG(st);
}

std::string read_or_empty(const std::string& path) { return ds::file_exists(path) ? ds::read_file(path) : ""; }

bool contains(const std::string& hay, const std::string& needle) { return hay.find(needle) != std::string::npos; }

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
  // The case: run 1 saves every step (each save pauses 300 ms), run 2 starts into the same --out meanwhile.
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
