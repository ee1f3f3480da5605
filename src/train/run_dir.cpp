#include "train/run_dir.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <vector>

#include "core/error.h"
#include "core/files.h"
#include "core/log.h"

namespace fs = std::filesystem;

namespace ds {

RunDirectory::RunDirectory(const std::string& out) : path_(out) {
  std::error_code ec;
  DS_CHECK(!fs::exists(out, ec) || fs::is_directory(out, ec), "--out {}: exists and is not a directory", out);
  fs::create_directories(out, ec);
  DS_CHECK(!ec, "--out {}: cannot create the directory ({})", out, ec.message());
  DS_CHECK(::access(out.c_str(), W_OK | X_OK) == 0, "--out {}: cannot write there ({})", out, std::strerror(errno));
  const std::string lock = (fs::path(out) / kLockName).string();
  fd_ = ::open(lock.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  DS_CHECK(fd_ >= 0, "--out {}: cannot create the lock file {} ({})", out, lock, std::strerror(errno));
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    ::close(fd_);
    fd_ = -1;
    DS_CHECK(err == EWOULDBLOCK, "--out {}: cannot lock {} ({})", out, lock, std::strerror(err));
    std::string holder;
    try {
      holder = read_file(lock);
    } catch (const Error&) {
    }
    while (!holder.empty() && (holder.back() == '\n' || holder.back() == ' ')) holder.pop_back();
    fail("--out {}: another deltastack run ({}) is using this run directory; wait for it to end, stop it (Ctrl-C "
         "saves a checkpoint first), or give another --out", out,
         holder.empty() ? std::string("pid not yet written") : "pid " + holder);
  }
  // Ours: the pid for the message above (the file is not replaced, only rewritten, so the lock stays on it).
  const std::string pid = std::to_string(::getpid()) + "\n";
  if (::ftruncate(fd_, 0) != 0 || ::pwrite(fd_, pid.data(), pid.size(), 0) != static_cast<ssize_t>(pid.size()))
    log_warn("{}: could not record the pid ({})", lock, std::strerror(errno));
}

RunDirectory::~RunDirectory() {
  if (fd_ >= 0) ::close(fd_);  // releases the lock
}

void RunDirectory::remove_stale_temps(const std::string& keep) const {
  std::vector<fs::path> stale;
  for (const auto& e : fs::directory_iterator(path_)) {
    const std::string n = e.path().filename().string();
    if (n.rfind(".checkpoint-", 0) == 0 && n.size() > 16 && n.compare(n.size() - 4, 4, ".tmp") == 0)
      stale.push_back(e.path());
  }
  std::error_code ec;
  if (!keep.empty()) {
    const fs::path src = fs::canonical(keep, ec);
    std::erase_if(stale, [&](const fs::path& p) { return fs::canonical(p, ec) == src; });
  }
  for (const fs::path& p : stale) {
    log_info("removing {} (left by an interrupted checkpoint save)", p.string());
    fs::remove_all(p, ec);
    if (ec) log_warn("could not remove {}: {}", p.string(), ec.message());
  }
}

}  // namespace ds
