// Helpers for the tests that drive the trainer through the `deltastack` binary (test_train.cpp,
// test_crash_safety.cpp): a fresh temp dir, a small model + corpus, running the CLI, reading metrics.jsonl.
#pragma once
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <thread>
#include <filesystem>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "core/files.h"
#include "model/config.h"
#include "model/safetensors.h"
#include "test_util.h"

namespace ds::test {

// An empty directory <tmp>/deltastack_<tag>_<pid> (removed first if it exists).
inline std::string fresh_tmpdir(const std::string& tag) {
  namespace fs = std::filesystem;
  fs::path p = fs::temp_directory_path() / ("deltastack_" + tag + "_" + std::to_string(::getpid()));
  fs::remove_all(p);
  fs::create_directories(p);
  return p.string();
}

// A small model over the real tokenizer's id range (vocab 151680, hidden 16) and 20 kB of text in `dir`, so a
// step takes milliseconds. Returns the train arguments that use them.
inline std::string small_setup(const std::string& dir) {
  nlohmann::json c = ds::ModelConfig::preset("tiny").to_json();
  c["vocab_size"] = 151680;
  c["hidden_size"] = 16;
  c["intermediate_size"] = 32;
  c["num_attention_heads"] = 2;
  c["num_key_value_heads"] = 1;
  c["head_dim"] = 8;
  c["linear_key_head_dim"] = 8;
  c["linear_value_head_dim"] = 8;
  ds::write_file_atomic(dir + "/config.json", c.dump());
  std::string text = ds::read_file(data_path("tiny_shakespeare.txt")).substr(0, 20000);
  ds::write_file_atomic(dir + "/corpus.txt", text);
  // --device cpu: these tests pin the CPU reference engine (bitwise resume, thread counts), also on a GPU machine.
  return "--device cpu --model " + dir + "/config.json --data " + dir +
         "/corpus.txt --seq-len 32 --micro-batch 2 --eval-batches 1 --val-fraction 0.1 --eval-interval 0";
}

// small_setup's arguments with `data` (a path) as --data instead of its corpus.txt.
inline std::string small_setup_on(const std::string& dir, const std::string& data) {
  std::string args = small_setup(dir);
  args.replace(args.find(dir + "/corpus.txt"), dir.size() + 11, data);
  return args;
}

// Whitespace-separated words (CLI arguments; no quoting).
inline std::vector<std::string> split_args(const std::string& s) {
  std::istringstream in(s);
  std::vector<std::string> v;
  std::string w;
  while (in >> w) v.push_back(w);
  return v;
}

// In a forked child: replaces the process with `deltastack <args>`, or with `<launcher words> deltastack <args>` when
// a launcher is given (the dynamic loader; mpirun and its options) (exit 127 if that fails).
[[noreturn]] inline void exec_deltastack(const std::string& args, const std::string& launcher = "") {
  std::vector<std::string> a = split_args(launcher);
  a.push_back(DELTASTACK_BIN);
  for (auto& w : split_args(args)) a.push_back(w);
  std::vector<char*> argv;
  for (auto& s : a) argv.push_back(s.data());
  argv.push_back(nullptr);
  ::execv(argv[0], argv.data());
  ::_exit(127);
}

// Starts `deltastack <args>` (through `launcher` when given) with stdout/stderr appended to `log`; returns the
// child's pid. own_group: the child leads a process group of its own (so kill(-pid) reaches what it starts).
inline pid_t spawn(const std::string& args, const std::string& log, const std::string& launcher = "",
                   bool own_group = false) {
  pid_t pid = ::fork();
  if (pid == 0) {
    if (own_group) ::setpgid(0, 0);
    FILE* f = std::fopen(log.c_str(), "a");
    if (f) {
      ::dup2(::fileno(f), 1);
      ::dup2(::fileno(f), 2);
    }
    exec_deltastack(args, launcher);
  }
  return pid;
}

// Runs `deltastack <args>` (through `launcher` when given) to completion; returns the exit code (-1 if killed) and,
// when output is given, the combined stdout/stderr.
inline int run(const std::string& args, std::string* output = nullptr, const std::string& launcher = "") {
  namespace fs = std::filesystem;
  static int n = 0;
  std::string log =
      (fs::temp_directory_path() / ("deltastack_run_log_" + std::to_string(::getpid()) + "_" + std::to_string(n++)))
          .string();
  pid_t pid = spawn(args, log, launcher);
  int st = 0;
  ::waitpid(pid, &st, 0);
  if (output) *output = ds::file_exists(log) ? ds::read_file(log) : "";
  fs::remove(log);
  return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

// The records of a metrics.jsonl file, in order.
inline std::vector<nlohmann::json> metrics(const std::string& path) {
  std::vector<nlohmann::json> out;
  std::istringstream in(ds::read_file(path));
  std::string line;
  while (std::getline(in, line)) out.push_back(nlohmann::json::parse(line));
  return out;
}

// The "loss" of every record of a metrics.jsonl file that has one, in order.
// The fp32 values of checkpoint tensors (an engine's weight_tensors, grad_tensors, ...: a view or a streamed
// reader each), flat in their order.
// The values of streamed checkpoint tensors, concatenated: fp32 ones as they are; one given only as raw bytes
// (byte_reader: the 8bit state's U8 codes and F32 block scales) as its bytes, one float each, to compare bitwise.
inline std::vector<float> tensor_values(const std::vector<ds::SaveTensor>& ts) {
  std::vector<float> out;
  for (const ds::SaveTensor& t : ts) {
    int64_t n = 1;
    for (int64_t d : t.shape) n *= d;
    std::vector<float> x(static_cast<size_t>(n));
    if (t.f32_source) {
      std::copy(t.f32_source, t.f32_source + n, x.begin());
    } else if (t.f32_reader) {
      t.f32_reader(0, n, x.data());
    } else if (t.byte_reader) {
      std::vector<uint8_t> bytes(static_cast<size_t>(n) * ds::dtype_size(t.dtype));
      t.byte_reader(0, n, bytes.data());
      x.assign(bytes.begin(), bytes.end());
    } else {
      ADD_FAILURE() << t.name << ": a tensor with no values";
    }
    out.insert(out.end(), x.begin(), x.end());
  }
  return out;
}

inline std::vector<double> train_losses(const std::string& path) {
  std::vector<double> l;
  for (auto& j : metrics(path))
    if (j.contains("loss")) l.push_back(j["loss"].get<double>());
  return l;
}

// Polls `done` every 5 ms for at most `seconds`; returns whether it became true.
inline bool wait_for(const std::function<bool()>& done, double seconds = 30) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (std::chrono::steady_clock::now() < end) {
    if (done()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return done();
}

// The exit code of a spawned child (waits for it); -signal when a signal killed it.
inline int wait_exit(pid_t pid) {
  int st = 0;
  ::waitpid(pid, &st, 0);
  return WIFEXITED(st) ? WEXITSTATUS(st) : -WTERMSIG(st);
}

// The step of the last training line of a metrics.jsonl (0 if none).
inline int64_t last_train_step(const std::string& metrics_path) {
  int64_t s = 0;
  if (!ds::file_exists(metrics_path)) return 0;
  for (const nlohmann::json& j : metrics(metrics_path))
    if (j.contains("loss")) s = j["step"].get<int64_t>();
  return s;
}

}  // namespace ds::test
