// The trainer through the `deltastack` binary under abuse ("make the CPU engine unbreakable"):
//   * SIGKILL at random moments and in the middle of checkpoint saves: every checkpoint-N present is complete and
//     loadable, the previous ones are untouched, and resuming from the newest one again and again ends bitwise where
//     an uninterrupted run ends (weights, optimizer state and every logged loss);
//   * a NaN in the middle of a run under --nan-policy stop: non-zero exit, earlier checkpoints byte-identical;
//   * thread-count determinism of the final checkpoint bytes (docs/determinism.md);
//   * a data file that is not UTF-8: the error names the file.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <thread>

#include "core/error.h"
#include "core/files.h"
#include "core/rng.h"
#include "data/dataset.h"
#include "model/config.h"
#include "model/model.h"
#include "model/safetensors.h"
#include "test_util.h"
#include "train_test_util.h"

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

using ds::test::run;
using ds::test::small_setup;
using ds::test::spawn;
using ds::test::train_losses;

std::string tmpdir(const std::string& name) { return ds::test::fresh_tmpdir("crash_" + name); }

// The output dir's entries: complete checkpoints by step, and interrupted-save temp dirs.
struct OutDir {
  std::map<int, std::string> checkpoints;  // step -> path
  std::vector<std::string> temps, other;
};

OutDir scan(const std::string& out) {
  // Besides checkpoints and temps: the metrics, the lock, another run's files moved aside (--move-aside) and an
  // abandoned history's later checkpoints (a resume from an earlier step).
  static const std::regex ck("checkpoint-([0-9]+)"), tmp("\\.checkpoint-[0-9]+\\.tmp"),
      bookkeeping("metrics\\.jsonl(\\.tmp\\.[0-9]+)?|metrics-abandoned\\.jsonl|\\.deltastack\\.lock|previous-[0-9]+|"
                  "abandoned-[0-9]+");
  OutDir d;
  if (!fs::exists(out)) return d;
  for (const auto& e : fs::directory_iterator(out)) {
    const std::string n = e.path().filename().string();
    std::smatch m;
    if (std::regex_match(n, m, ck) && e.is_directory()) d.checkpoints[std::stoi(m[1])] = e.path().string();
    else if (std::regex_match(n, tmp)) d.temps.push_back(n);
    else if (!std::regex_match(n, bookkeeping)) d.other.push_back(n);
  }
  return d;
}

// A checkpoint directory is complete: every file present and parseable, the model loads (all tensors, right shapes,
// finite), the optimizer state has both moments of every parameter, trainer_state.json names its step.
void expect_complete(const std::string& ck, int step, const std::string& tokenizer_bytes) {
  SCOPED_TRACE(ck);
  ds::ModelConfig cfg = ds::ModelConfig::from_file(ck);
  ds::Qwen35Model m(cfg);
  ASSERT_NO_THROW(m.load(ck));
  ds::SafetensorsReader model_st(ck + "/model.safetensors");
  EXPECT_EQ(model_st.tensors().size(), m.params().size());
  ds::SafetensorsReader opt(ck + "/optimizer.safetensors");
  EXPECT_EQ(opt.tensors().size(), 2 * m.params().size());
  for (const ds::ParamSpec& p : m.params()) {
    for (const char* k : {"exp_avg.", "exp_avg_sq."}) {
      ASSERT_TRUE(opt.has(k + p.name)) << k << p.name;
      std::vector<float> v = opt.read_f32(k + p.name);
      ASSERT_EQ(static_cast<int64_t>(v.size()), p.numel) << k << p.name;
    }
  }
  json st = json::parse(ds::read_file(ck + "/trainer_state.json"));
  EXPECT_EQ(st.at("step").get<int>(), step);
  EXPECT_TRUE(st.contains("options"));
  EXPECT_EQ(ds::read_file(ck + "/tokenizer.json"), tokenizer_bytes);
}

std::string file_bytes_of_dir(const std::string& dir) {
  std::string all;
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  for (const auto& n : names) all += n + "\n" + ds::read_file(dir + "/" + n);
  return all;
}

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

// 2a. SIGKILL during training with a checkpoint every step. Odd rounds kill at a random moment, even rounds as soon
// as a save's temp dir appears (plus 0-20 ms), i.e. in the middle of writing its 40 MB. After every kill: each
// checkpoint-N is complete, checkpoints seen before are untouched (size and mtime of every file), no other names
// appear. Each round resumes from the newest checkpoint; the last one runs to the end, which must equal an
// uninterrupted run bitwise.
TEST(CrashSafety, KillDuringCheckpointSaveKeepsCheckpointsIntact) {
  const std::string dir = tmpdir("kill");
  // Every save pauses 150 ms between the weights and the optimizer state (trainer's test hook), so the kills
  // aimed at a save in progress land inside one even on a loaded machine (the writes alone take a few ms).
  ::setenv("DELTASTACK_TEST_SAVE_PAUSE_MS", "150", 1);
  struct Unset {
    ~Unset() { ::unsetenv("DELTASTACK_TEST_SAVE_PAUSE_MS"); }
  } unset;
  const std::string args = small_setup(dir);
  const std::string tok = ds::read_file(std::string(DELTASTACK_SOURCE_DIR) + "/data/qwen3_tokenizer/tokenizer.json");
  const int S = 14;
  const std::string common = " --steps " + std::to_string(S) + " --threads 1";
  ASSERT_EQ(run("train " + args + common + " --warmup 2 --save-interval 0 --out " + dir + "/ref"), 0);

  const std::string out = dir + "/run";
  ds::Rng rng(2024);
  std::map<int, std::pair<uintmax_t, fs::file_time_type>> seen;  // step -> (model bytes, mtime) when first verified
  int rounds = 0, mid_save_kills = 0, finished_early = 0;
  for (int round = 0; round < 6; ++round) {
    OutDir before = scan(out);
    const int newest = before.checkpoints.empty() ? 0 : before.checkpoints.rbegin()->first;
    if (newest == S) break;
    // A fresh start after a kill before the first checkpoint moves the killed run's metrics aside.
    const std::string fresh = "train " + args + common + " --warmup 2 --save-interval 1 --move-aside --out " + out;
    const std::string cmd = newest == 0 ? fresh
                                        : "train --resume " + before.checkpoints.rbegin()->second + common + " --out " + out;
    const std::string log = dir + "/log_" + std::to_string(round);
    const pid_t pid = spawn(cmd, log);
    const double t0 = now_s();
    int st = 0;
    bool exited = false;
    if (round % 2 == 1) {  // a random moment: start-up, a step or a save
      const double delay = 0.3 + 1.7 * rng.uniform();
      while (!exited && now_s() - t0 < delay) {
        exited = ::waitpid(pid, &st, WNOHANG) == pid;
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
      }
    } else {  // the moment a checkpoint save (of a step beyond `newest`) has started writing
      const std::string want = ".checkpoint-" + std::to_string(newest + 1) + ".tmp";
      while (!exited && !fs::exists(out + "/" + want) && now_s() - t0 < 20) {
        exited = ::waitpid(pid, &st, WNOHANG) == pid;
        std::this_thread::sleep_for(std::chrono::microseconds(500));
      }
      // Round 0 kills at once (the save has just created its directory), later ones a little into the save.
      std::this_thread::sleep_for(std::chrono::milliseconds(round == 0 ? 0 : rng.below(round == 2 ? 5 : 20)));
    }
    if (!exited) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &st, 0);
      EXPECT_TRUE(WIFSIGNALED(st)) << "round " << round;
    } else {
      ++finished_early;
      EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0) << ds::read_file(log);
    }
    ++rounds;
    OutDir after = scan(out);
    EXPECT_TRUE(after.other.empty()) << "unexpected entry " << (after.other.empty() ? "" : after.other[0]);
    for (const auto& [step, path] : after.checkpoints) {
      const fs::path mp = fs::path(path) / "model.safetensors";
      if (seen.count(step)) {  // verified in an earlier round: must not have been touched since
        ASSERT_TRUE(fs::exists(mp)) << path;
        EXPECT_EQ(fs::file_size(mp), seen[step].first) << path;
        EXPECT_TRUE(fs::last_write_time(mp) == seen[step].second) << path << " was rewritten";
      } else {
        expect_complete(path, step, tok);
        seen[step] = {fs::file_size(mp), fs::last_write_time(mp)};
      }
    }
    for (const auto& [step, path] : before.checkpoints) EXPECT_TRUE(after.checkpoints.count(step)) << path << " vanished";
    const std::string partial = ".checkpoint-" + std::to_string(newest + 1) + ".tmp";
    if (std::find(after.temps.begin(), after.temps.end(), partial) != after.temps.end() &&
        !after.checkpoints.count(newest + 1))
      ++mid_save_kills;
    std::printf("[ measured ] round %d: newest before %d, after %d, temp dirs %zu, %s\n", round, newest,
                after.checkpoints.empty() ? 0 : after.checkpoints.rbegin()->first, after.temps.size(),
                exited ? "finished before the kill" : "killed");
  }
  EXPECT_GE(mid_save_kills, 1) << "no kill landed inside a checkpoint save";
  std::printf("[ measured ] %d rounds, %d killed inside a save, %d finished early\n", rounds, mid_save_kills,
              finished_early);

  // Resume from the newest to the end; the result is the uninterrupted run's, bit for bit.
  OutDir d = scan(out);
  if (d.checkpoints.empty() || d.checkpoints.rbegin()->first < S) {
    const std::string cmd = d.checkpoints.empty()
                                ? "train " + args + common + " --warmup 2 --save-interval 1 --move-aside --out " + out
                                : "train --resume " + d.checkpoints.rbegin()->second + common + " --out " + out;
    std::string log;
    ASSERT_EQ(run(cmd, &log), 0) << log;
  }
  d = scan(out);
  ASSERT_TRUE(d.checkpoints.count(S));
  EXPECT_TRUE(d.temps.empty()) << "stale temp dir " << (d.temps.empty() ? "" : d.temps[0]) << " not cleaned up";
  expect_complete(d.checkpoints[S], S, tok);
  for (int s = 1; s <= S; ++s) EXPECT_TRUE(d.checkpoints.count(s)) << "checkpoint-" << s;
  EXPECT_EQ(ds::read_file(out + "/checkpoint-" + std::to_string(S) + "/model.safetensors"),
            ds::read_file(dir + "/ref/checkpoint-" + std::to_string(S) + "/model.safetensors"));
  EXPECT_EQ(ds::read_file(out + "/checkpoint-" + std::to_string(S) + "/optimizer.safetensors"),
            ds::read_file(dir + "/ref/checkpoint-" + std::to_string(S) + "/optimizer.safetensors"));
  auto lr = train_losses(dir + "/ref/metrics.jsonl"), lo = train_losses(out + "/metrics.jsonl");
  ASSERT_EQ(lr.size(), static_cast<size_t>(S));
  EXPECT_EQ(lo, lr) << "metrics.jsonl after kills and resumes differs from the uninterrupted run";
  fs::remove_all(dir);
}

// 2b. A NaN in the middle of a run under --nan-policy stop. Three good steps with a checkpoint each; then a resume
// from a copy of checkpoint-3 whose saved options say --lr 1e30 --clip 0 (the options a resume reuses): step 4's
// update makes the weights ~1e30 (finite, saved as checkpoint-4), step 5's loss is not finite. The run must exit
// non-zero naming step 5, leave checkpoints 1-3 byte-identical and checkpoint-4 complete, and write nothing for step
// 5. A resume from the good checkpoint-3 then replaces checkpoint-4 in place.
TEST(CrashSafety, NanMidRunStopsAndKeepsCheckpoints) {
  const std::string dir = tmpdir("nan");
  const std::string args = small_setup(dir);
  const std::string tok = ds::read_file(std::string(DELTASTACK_SOURCE_DIR) + "/data/qwen3_tokenizer/tokenizer.json");
  const std::string out = dir + "/out";
  ASSERT_EQ(run("train " + args + " --steps 3 --warmup 0 --threads 1 --save-interval 1 --out " + out), 0);
  std::map<int, std::string> snap;
  for (int s = 1; s <= 3; ++s) snap[s] = file_bytes_of_dir(out + "/checkpoint-" + std::to_string(s));

  const std::string poison = dir + "/poison";
  fs::copy(out + "/checkpoint-3", poison);
  json st = json::parse(ds::read_file(poison + "/trainer_state.json"));
  st["options"]["lr"] = 1e30;
  st["options"]["clip"] = 0.0;
  st["options"]["schedule"] = "constant";
  st["options"]["nan_policy"] = "stop";
  ds::write_file_atomic(poison + "/trainer_state.json", st.dump(2));

  std::string log;
  const int rc = run("train --resume " + poison + " --steps 10 --threads 1 --out " + out, &log);
  EXPECT_NE(rc, 0) << log;
  EXPECT_NE(log.find("step 5:"), std::string::npos) << log;
  EXPECT_NE(log.find("--nan-policy stop"), std::string::npos) << log;
  OutDir d = scan(out);
  EXPECT_TRUE(d.other.empty());
  EXPECT_TRUE(d.temps.empty());
  ASSERT_EQ(d.checkpoints.size(), 4u);
  for (int s = 1; s <= 3; ++s)
    EXPECT_EQ(file_bytes_of_dir(out + "/checkpoint-" + std::to_string(s)), snap[s]) << "checkpoint-" << s << " changed";
  expect_complete(out + "/checkpoint-4", 4, tok);  // weights ~1e30 but finite: load() rejects non-finite values
  {
    ds::Qwen35Model m(ds::ModelConfig::from_file(out + "/checkpoint-4"));
    m.load(out + "/checkpoint-4");
    float mx = 0;
    for (float w : m.weights()) mx = std::max(mx, std::fabs(w));
    EXPECT_GT(mx, 1e20f);  // the poisoned update happened
  }
  // Nothing was logged for step 5 (metrics stop at 4). A resume from the good checkpoint-3 moves the poisoned
  // checkpoint-4 (the abandoned history's) whole into abandoned-1/ and writes its own step 4.
  auto losses = train_losses(out + "/metrics.jsonl");
  EXPECT_EQ(losses.size(), 4u);
  ASSERT_EQ(run("train --resume " + out + "/checkpoint-3 --steps 4 --threads 1 --out " + out, &log), 0) << log;
  d = scan(out);
  EXPECT_TRUE(d.other.empty()) << d.other.size();
  EXPECT_TRUE(d.temps.empty());
  expect_complete(out + "/checkpoint-4", 4, tok);
  expect_complete(out + "/abandoned-1/checkpoint-4", 4, tok);  // the poisoned one, kept as it was
  {
    ds::Qwen35Model m(ds::ModelConfig::from_file(out + "/checkpoint-4"));
    m.load(out + "/checkpoint-4");
    float mx = 0;
    for (float w : m.weights()) mx = std::max(mx, std::fabs(w));
    EXPECT_LT(mx, 10.0f);  // the good run's step 4
  }
  fs::remove_all(dir);
}

// 3. Thread-count determinism of the whole training state: 3 steps with --threads 1 and --threads 2 give
// byte-identical model.safetensors and optimizer.safetensors (and losses). 1024 tokens per step, so the GEMMs are
// above the size where OpenBLAS's own threading used to change the bits (docs/determinism.md).
TEST(Determinism, ThreadCountGivesIdenticalCheckpointBytes) {
  const std::string dir = tmpdir("threads");
  const std::string args = small_setup(dir);
  for (int t : {1, 2})
    ASSERT_EQ(run("train " + args + " --steps 3 --warmup 2 --seq-len 256 --micro-batch 4 --threads " +
                  std::to_string(t) + " --out " + dir + "/t" + std::to_string(t)),
              0);
  for (const char* f : {"model.safetensors", "optimizer.safetensors"})
    EXPECT_EQ(ds::read_file(dir + "/t1/checkpoint-3/" + f), ds::read_file(dir + "/t2/checkpoint-3/" + f)) << f;
  EXPECT_EQ(train_losses(dir + "/t1/metrics.jsonl"), train_losses(dir + "/t2/metrics.jsonl"));
  fs::remove_all(dir);
}

// 4. A data file that is not valid UTF-8 fails before tokenizing, naming the file, its line and the byte offset
// (it used to say only "document N"), through the library and through `deltastack train`.
TEST(DataErrors, InvalidUtf8NamesTheFile) {
  const std::string dir = tmpdir("utf8");
  const std::string args = small_setup(dir);
  const std::string bad_txt = dir + "/latin1_corpus.txt", bad_jsonl = dir + "/broken_rows.jsonl";
  ds::write_file_atomic(bad_txt, "First paragraph.\n\nSecond line\nCaf\xe9 au lait\n");  // Latin-1 e-acute
  ds::write_file_atomic(bad_jsonl, "{\"text\": \"fine\"}\n{\"text\": \"surrogate \xed\xa0\x80 here\"}\n");
  ds::write_file_atomic(dir + "/good.txt", "Caf\xc3\xa9 au lait, na\xc3\xafve \xf0\x9f\x98\x80.\n");
  EXPECT_NO_THROW(ds::read_documents({dir + "/good.txt"}, ds::TxtSplit::Paragraph));
  struct Want {
    std::string file, where;
  };
  for (const Want& w : {Want{bad_txt, ":4: invalid UTF-8 at byte offset 33"}, Want{bad_jsonl, ":2: invalid UTF-8 at byte offset 37"}}) {
    try {
      ds::read_documents({dir + "/good.txt", w.file}, ds::TxtSplit::Paragraph);
      ADD_FAILURE() << "no error for " << w.file;
    } catch (const ds::Error& e) {
      EXPECT_NE(std::string(e.what()).find(w.file + w.where), std::string::npos) << e.what();
    }
    std::string log;
    EXPECT_NE(run("train " + args + " --steps 1 --threads 1 --data " + w.file + " --out " + dir + "/o", &log), 0);
    EXPECT_NE(log.find(w.file), std::string::npos) << log;
    EXPECT_NE(log.find("invalid UTF-8"), std::string::npos) << log;
    EXPECT_FALSE(fs::exists(dir + "/o/checkpoint-1"));
  }
  fs::remove_all(dir);
}
