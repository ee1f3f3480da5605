// The run directory (--out) of a training run: created and locked before the model or the data load, so a second
// run into the same directory stops at once with the holder's pid instead of deleting the first run's files.
#pragma once
#include <string>

namespace ds {

// An exclusive flock(2) on OUT/.deltastack.lock, held for the life of the object (the kernel releases it when the
// process dies, however it dies; the file itself stays, so there is never a race on its creation). The holder's pid
// is written into the file, for the message another run prints.
class RunDirectory {
 public:
  // Creates `out` if needed and takes the lock. ds::Error naming `out` when it is a file, cannot be created or
  // written, or is locked by another process (with that process's pid).
  explicit RunDirectory(const std::string& out);
  ~RunDirectory();
  RunDirectory(const RunDirectory&) = delete;
  RunDirectory& operator=(const RunDirectory&) = delete;

  const std::string& path() const { return path_; }
  // The lock file's name inside the run directory.
  static constexpr const char* kLockName = ".deltastack.lock";

  // Removes the temp dirs that an interrupted checkpoint save left (".checkpoint-N.tmp", ".checkpoint-N.old.tmp"):
  // only under the lock, so never a running save's. `keep` (the --resume source, when it is one of them) stays.
  void remove_stale_temps(const std::string& keep) const;

 private:
  std::string path_;
  int fd_ = -1;
};

}  // namespace ds
