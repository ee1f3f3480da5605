#include "core/fs_safety.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>  // renameat2, RENAME_NOREPLACE, RENAME_EXCHANGE (glibc >= 2.28)
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <thread>
#include <vector>

#include "core/error.h"
#include "core/files.h"
#include "core/log.h"

namespace fs = std::filesystem;

namespace ds {

FileIdentity file_identity(const std::string& path) {
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0) {
    DS_CHECK(errno == ENOENT, "{}: cannot inspect ({})", path, std::strerror(errno));
    return {};
  }
  return {true, st.st_dev, st.st_ino};
}

int open_no_follow(const std::string& path, int flags, mode_t mode, const std::string& what) {
  const int fd = ::open(path.c_str(), flags | O_NOFOLLOW | O_CLOEXEC, mode);
  if (fd >= 0) return fd;
  const int err = errno;
  struct stat st;
  DS_CHECK(!(err == ELOOP || (::lstat(path.c_str(), &st) == 0 && S_ISLNK(st.st_mode))),
           "{} {}: is a symbolic link; deltastack writes this file itself and never follows a link there (it would "
           "write into what the link points at). Remove it", what, path);
  fail("{} {}: cannot open ({})", what, path, std::strerror(err));
}

void make_new_dir(const std::string& path, const std::string& what) {
  if (::mkdir(path.c_str(), 0755) == 0) return;
  const int err = errno;
  struct stat st;
  const bool link = ::lstat(path.c_str(), &st) == 0 && S_ISLNK(st.st_mode);
  DS_CHECK(err != EEXIST, "{} {}: {} is already there; deltastack creates this directory itself and never writes "
           "into one it did not create. Move it away", what, path, link ? "a symbolic link" : "something");
  fail("{} {}: cannot create the directory ({})", what, path, std::strerror(err));
}

std::string foreign_entry(const std::string& dir, const std::function<bool(const std::string&)>& is_ours) {
  std::vector<std::string> foreign;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    std::error_code e2;
    if (!it->is_regular_file(e2) || it->is_symlink(e2) || !is_ours(name)) foreign.push_back(name);
  }
  DS_CHECK(!ec, "{}: cannot list the directory ({})", dir, ec.message());
  return foreign.empty() ? std::string() : *std::min_element(foreign.begin(), foreign.end());
}

namespace {

// renameat2 with `flags`; false with errno = EINVAL / ENOSYS when the file system (or kernel) lacks the flag.
bool rename2(const std::string& from, const std::string& to, unsigned flags) {
  return ::renameat2(AT_FDCWD, from.c_str(), AT_FDCWD, to.c_str(), flags) == 0;
}

bool unsupported(int err) { return err == EINVAL || err == ENOSYS || err == ENOTSUP; }

void remove_entry(const std::string& path) {
  std::error_code ec;
  fs::remove_all(path, ec);
  if (ec) log_warn("could not remove {} ({}); remove it by hand", path, ec.message());
}

}  // namespace

void replace_checked(const std::string& from, const std::string& to, const FileIdentity& expected,
                     const std::string& what, const std::function<void(const std::string&)>& owned) {
  if (!expected.exists) {
    if (rename2(from, to, RENAME_NOREPLACE)) return;
    const int err = errno;
    DS_CHECK(err != EEXIST, "{}: {} appeared while this command ran (another deltastack run writing the same "
             "output?); not replacing what it did not check. Run it again, or give another output", what, to);
    DS_CHECK(unsupported(err), "{}: cannot rename {} to {} ({})", what, from, to, std::strerror(err));
    DS_CHECK(!file_identity(to).exists, "{}: {} appeared while this command ran (another deltastack run writing "
             "the same output?); not replacing what it did not check. Run it again, or give another output", what, to);
    DS_CHECK(::rename(from.c_str(), to.c_str()) == 0, "{}: cannot rename {} to {} ({})", what, from, to,
             std::strerror(errno));
    return;
  }
  // The entry swapped out must be the one checked at the start, and still the caller's.
  auto check_old = [&](const std::string& old) {
    DS_CHECK(file_identity(old) == expected, "{}: {} was replaced by something else while this command ran "
             "(another deltastack run writing the same output?); not replacing what it did not check. Run it again, "
             "or give another output", what, to);
    if (owned) owned(old);
  };
  if (rename2(from, to, RENAME_EXCHANGE)) {
    try {
      check_old(from);
    } catch (const Error&) {
      if (!rename2(from, to, RENAME_EXCHANGE)) {
        const int err = errno;
        // The caller removes `from` after a failure: what came out of `to` must not stay there.
        const std::string kept = to + ".kept." + std::to_string(::getpid());
        const bool moved = rename2(from, kept, RENAME_NOREPLACE);
        fail("{}: {} changed while this command ran, and could not be swapped back ({}); what was there is now at "
             "{}", what, to, std::strerror(err), moved ? kept : from);
      }
      throw;
    }
    remove_entry(from);
    return;
  }
  const int err = errno;
  DS_CHECK(err != ENOENT, "{}: {} was removed while this command ran; not writing there. Run it again", what, to);
  DS_CHECK(unsupported(err), "{}: cannot rename {} to {} ({})", what, from, to, std::strerror(err));
  // No RENAME_EXCHANGE here: the old entry moves aside first (a short window with none at `to`).
  const std::string aside = to + ".old." + std::to_string(::getpid());
  DS_CHECK(!file_identity(aside).exists, "{}: {} is in the way; move it away", what, aside);
  DS_CHECK(::rename(to.c_str(), aside.c_str()) == 0, "{}: cannot rename {} aside ({})", what, to, std::strerror(errno));
  try {
    check_old(aside);
  } catch (const Error&) {
    if (::rename(aside.c_str(), to.c_str()) != 0)
      log_warn("{}: could not move {} back ({}); it is at {}", what, to, std::strerror(errno), aside);
    throw;
  }
  DS_CHECK(::rename(from.c_str(), to.c_str()) == 0, "{}: cannot rename {} to {} ({}; the previous one is at {})", what,
           from, to, std::strerror(errno), aside);
  remove_entry(aside);
}

// ---- TempDir

namespace {

volatile sig_atomic_t g_signal = 0;
constexpr size_t kMessageBytes = 4096;
char g_first_message[kMessageBytes], g_second_message[kMessageBytes];
struct sigaction g_old_int, g_old_term;

// Async-signal-safe: write(2), _exit(2) and the flag.
void on_signal(int sig) {
  if (g_signal == 0) {
    g_signal = sig;
    write_stderr_in_signal_handler(g_first_message);
    return;
  }
  write_stderr_in_signal_handler(g_second_message);
  ::_exit(128 + sig);
}

void copy_message(char* dst, const std::string& m) {
  std::strncpy(dst, m.c_str(), kMessageBytes - 1);
  dst[kMessageBytes - 1] = '\0';
}

std::string host_name() {
  char h[256] = {};
  if (::gethostname(h, sizeof(h) - 1) != 0) return "?";
  return h;
}

std::string marker_text(pid_t pid) {
  return "deltastack temp\nhost " + host_name() + "\npid " + std::to_string(pid) + "\n";
}

// <dir>/[.]<name><suffix>
std::string temp_prefix(const std::string& dest, const std::string& suffix, bool hidden) {
  const fs::path d(dest);
  std::string name = hidden ? "." : "";
  name += d.filename().string();
  name += suffix;
  return (d.parent_path() / name).string();
}

}  // namespace

TempDir::TempDir(const std::string& dest, const std::string& suffix, bool hidden, const std::string& what)
    : dest_(dest), path_(temp_prefix(dest, suffix, hidden) + std::to_string(::getpid())), what_(what) {
  // The handlers first: a signal from the moment the directory exists is seen, and check_signal() removes it.
  g_signal = 0;
  copy_message(g_first_message, "\n[deltastack] signal received: stopping; removing the partial output " + path_ +
                                    " (a second signal stops at once and leaves it for the next run to remove)\n");
  copy_message(g_second_message, "[deltastack] second signal: stopping now; " + path_ +
                                     " is left behind (the next run into " + dest_ + " removes it)\n");
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  ::sigaction(SIGINT, &sa, &g_old_int);
  ::sigaction(SIGTERM, &sa, &g_old_term);
  bool made = false;
  try {
    // One of our own pid (a process before this one, killed, with the same pid) is stale too.
    if (file_identity(path_ + "/" + kTempMarker).exists &&
        read_file(path_ + "/" + kTempMarker) == marker_text(::getpid()))
      remove_entry(path_);
    // The destination's missing parents, as `mkdir -p` (train --out does the same): `export CKPT out/adapter`
    // into a fresh `out/`.
    std::error_code ec;
    const fs::path parent = fs::path(path_).parent_path();
    if (!parent.empty()) fs::create_directories(parent, ec);
    DS_CHECK(!ec, "{}: cannot create its parent directory {} ({})", what_, parent.string(), ec.message());
    make_new_dir(path_, what_ + " (its temporary directory)");
    made = true;
    test_gate("DELTASTACK_TEST_TEMPDIR_GATE");
    write_file_atomic(path_ + "/" + kTempMarker, marker_text(::getpid()));
  } catch (...) {
    ::sigaction(SIGINT, &g_old_int, nullptr);
    ::sigaction(SIGTERM, &g_old_term, nullptr);
    if (made) remove_entry(path_);
    throw;
  }
}

TempDir::~TempDir() {
  ::sigaction(SIGINT, &g_old_int, nullptr);
  ::sigaction(SIGTERM, &g_old_term, nullptr);
  if (!committed_) remove_entry(path_);
}

void TempDir::check_signal() {
  const int sig = g_signal;
  if (sig == 0) return;
  remove_entry(path_);
  log_warn("{}: stopped by {}; removed the partial output {}", what_,
           sig == SIGINT ? "SIGINT" : sig == SIGTERM ? "SIGTERM" : "a signal", path_);
  std::exit(128 + sig);
}

void TempDir::commit(const FileIdentity& expected, const std::function<void(const std::string&)>& owned) {
  test_replace_gate();
  check_signal();
  replace_checked(path_, dest_, expected, what_, owned);
  committed_ = true;
  ::unlink((dest_ + "/" + kTempMarker).c_str());
  fsync_dir(fs::path(dest_).parent_path().string());
}

void TempDir::remove_stale(const std::string& dest, const std::string& suffix, bool hidden) {
  const fs::path prefix(temp_prefix(dest, suffix, hidden));
  const std::string dir = prefix.parent_path().string(), start = prefix.filename().string();
  std::error_code ec;
  for (fs::directory_iterator it(dir.empty() ? "." : dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.size() <= start.size() || name.compare(0, start.size(), start) != 0) continue;
    const std::string digits = name.substr(start.size());
    if (digits.size() > 9 || digits.find_first_not_of("0123456789") != std::string::npos) continue;
    const pid_t pid = static_cast<pid_t>(std::stol(digits));
    std::error_code e2;
    if (pid <= 0 || pid == ::getpid() || it->is_symlink(e2) || !it->is_directory(e2)) continue;
    const std::string marker = (it->path() / kTempMarker).string();
    std::string text;
    try {
      if (!fs::is_regular_file(fs::symlink_status(marker, e2))) continue;
      text = read_file(marker);
    } catch (const Error&) {
      continue;
    }
    if (text != marker_text(pid) || ::kill(pid, 0) == 0 || errno != ESRCH) continue;  // not ours, or alive
    log_info("removing {} (left by deltastack process {}, which was killed)", it->path().string(), pid);
    remove_entry(it->path().string());
  }
}

void test_gate(const char* env_var) {
  const char* gate = std::getenv(env_var);
  if (!gate || !*gate) return;
  write_file_atomic(std::string(gate) + ".reached", "");
  while (!file_identity(gate).exists && g_signal == 0) std::this_thread::sleep_for(std::chrono::milliseconds(5));
}

void test_replace_gate() { test_gate("DELTASTACK_TEST_REPLACE_GATE"); }

}  // namespace ds
