// What deltastack may do to the files in a user's directories (docs/checkpoints.md, "What deltastack deletes, and
// what it refuses"): one policy, used by tokenize, export, the run directory's lock and the checkpoint saves.
//
//  - What a command creates in a user's directory is created new, without following a link planted at its name
//    (open_no_follow, make_new_dir): a symbolic link there is a ds::Error naming it, never a write through it.
//  - What a command replaces at its end is exactly what it checked at its start (FileIdentity: device and inode, as
//    lstat(2) gives them): replace_checked() swaps in one atomic rename (renameat2 RENAME_NOREPLACE when nothing was
//    there, RENAME_EXCHANGE when something was), then proves that what it swapped out is the checked entry, and that
//    the caller still owns it (`owned`), before deleting it; otherwise it swaps back and fails. Another process's
//    output, or a directory made there meanwhile, is never deleted.
//  - A command's temporary directory (TempDir) is named <dest-name><suffix><pid>, holds a marker file naming the
//    host and the pid, is removed on failure and on SIGINT / SIGTERM, and when a kill left it, by the next run of
//    the same command into the same place (remove_stale_temp_dirs: our name, our marker, this host, a dead pid).
#pragma once
#include <sys/types.h>

#include <functional>
#include <string>

namespace ds {

// Which file system entry a path names (lstat: a symbolic link is itself, not its target).
struct FileIdentity {
  bool exists = false;
  dev_t dev = 0;
  ino_t ino = 0;
  bool operator==(const FileIdentity&) const = default;
};
// The identity of `path` now; exists = false when there is nothing (ENOENT). ds::Error naming the path when it
// cannot be told (EACCES, ...).
FileIdentity file_identity(const std::string& path);

// open(2) of `path` that never follows a symbolic link at its last component (O_NOFOLLOW | O_CLOEXEC added to
// `flags`): a link there is a ds::Error "<what> <path>: is a symbolic link ...; remove it". Other failures are a
// ds::Error with strerror. Returns the descriptor.
int open_no_follow(const std::string& path, int flags, mode_t mode, const std::string& what);

// Creates the directory `path` (mode 0755), which must not exist yet (mkdir(2) never follows a link): a link or
// anything else there is a ds::Error naming it.
void make_new_dir(const std::string& path, const std::string& what);

// A name in `dir` that is not `owned` by the caller: the first entry (sorted by name) that is no regular file (a
// link, a directory, a device) or whose name `is_ours` rejects; "" when every entry is ours. ds::Error naming `dir`
// when it cannot be listed.
std::string foreign_entry(const std::string& dir, const std::function<bool(const std::string& name)>& is_ours);

// Moves `from` to `to`, where `to` must still be `expected` (taken at the command's start). Nothing there then:
// renameat2(RENAME_NOREPLACE), so anything that appeared meanwhile is kept and the move fails. Something there:
// renameat2(RENAME_EXCHANGE), then the entry swapped out (now at `from`) must have the identity `expected` and pass
// `owned` (which throws a ds::Error saying why not); else the two are swapped back and that error is thrown. On
// success the old entry is removed (a directory with its contents). `what` names the output in errors ("--output
// DIR"). File systems without renameat2's flags fall back to lstat checks around rename(2) (a short window).
// ds::Error naming `to` on any failure; `from` is left in place then.
void replace_checked(const std::string& from, const std::string& to, const FileIdentity& expected,
                     const std::string& what, const std::function<void(const std::string& old)>& owned = {});

// A command's temporary output directory `path` = <dest><suffix><pid> beside its destination, created new with a
// marker file (kTempMarker: "deltastack temp\nhost H\npid P\n"). While it lives, SIGINT / SIGTERM make the command
// stop at its next check_signal(): the directory is removed, a line says so, and the process exits 128 + signal; a
// second signal exits at once (the directory is left for remove_stale_temp_dirs). Destroyed without commit(), the
// directory is removed.
class TempDir {
 public:
  static constexpr const char* kTempMarker = ".deltastack-temp";
  // `dest`: the final path (its missing parent directories are created); `suffix`: between its name and the pid
  // (".tmp."); `hidden`: a "." before the name.
  TempDir(const std::string& dest, const std::string& suffix, bool hidden, const std::string& what);
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const std::string& path() const { return path_; }
  // If SIGINT / SIGTERM arrived: removes the directory, logs it, exits 128 + the signal. Call between pieces of work.
  void check_signal();
  // replace_checked(path(), dest, expected, what, owned), then the marker is removed from dest.
  void commit(const FileIdentity& expected, const std::function<void(const std::string& old)>& owned = {});

  // Removes the directories in dest's directory that a killed command left: named <dest-name><suffix><pid> (with
  // the "." when `hidden`), a real directory holding kTempMarker that names this host and that pid, and the pid is
  // no live process. Each removal is logged; others are left alone.
  static void remove_stale(const std::string& dest, const std::string& suffix, bool hidden);

 private:
  std::string dest_, path_, what_;
  bool committed_ = false;
};

// Test hook (DELTASTACK_TEST_REPLACE_GATE=FILE; unset in normal use): before a command's final replace, creates
// FILE.reached and waits until FILE exists, so a test can change the destination at that point without timing.
void test_replace_gate();
// The same for the gate named by the environment variable `env_var` (DELTASTACK_TEST_TEMPDIR_GATE: TempDir right
// after it created its directory). The wait also ends at a TempDir's signal.
void test_gate(const char* env_var);

}  // namespace ds
