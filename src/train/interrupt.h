// SIGINT / SIGTERM / SIGUSR1 during training (docs/checkpoints.md, "Signals"): the first signal asks the loop to stop after
// the step in progress (the trainer then saves a checkpoint and says how to resume); a second one stops the process
// at once, naming the last complete checkpoint. SIGPIPE is ignored by the CLI (src/cli/main.cpp), so a closed
// stdout never kills a run.
#pragma once
#include <string>

namespace ds {

// Installs the handlers for its lifetime (one at a time per process); the previous ones come back on destruction.
class InterruptGuard {
 public:
  InterruptGuard();
  ~InterruptGuard();
  InterruptGuard(const InterruptGuard&) = delete;
  InterruptGuard& operator=(const InterruptGuard&) = delete;

  // 0, or the first signal received (SIGINT, SIGTERM, or SIGUSR1: what Open MPI's mpirun forwards to the ranks
  // without killing them a second later, as it does after the SIGTERM it sends for a SIGINT / SIGTERM).
  int signal() const;
  // The checkpoint a second signal names (the newest complete one); empty: none yet.
  void set_last_checkpoint(const std::string& path);
};

// "SIGINT" / "SIGTERM" / "SIGUSR1" / "signal N".
std::string signal_name(int sig);

}  // namespace ds
