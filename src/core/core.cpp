#include <fcntl.h>
#include <omp.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "core/error.h"
#include "core/files.h"
#include "core/log.h"
#include "core/parallel.h"

extern "C" void openblas_set_num_threads(int);

namespace ds {

std::string printable(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  const auto* p = reinterpret_cast<const unsigned char*>(text.data());
  for (size_t i = 0, n = text.size(); i < n;) {
    const unsigned char c = p[i];
    // The length of a valid UTF-8 sequence starting at i (RFC 3629: no overlong forms, no surrogates, <= U+10FFFF).
    size_t len = 0;
    if (c >= 0x20 && c < 0x7f) len = 1;
    else if (c == '\n' || c == '\t') len = 1;
    else if (c >= 0xc2 && c <= 0xdf) len = 2;
    else if (c >= 0xe0 && c <= 0xef) len = 3;
    else if (c >= 0xf0 && c <= 0xf4) len = 4;
    bool ok = len > 0 && i + len <= n;
    for (size_t k = 1; ok && k < len; ++k) ok = (p[i + k] & 0xc0) == 0x80;
    if (ok && len >= 3) {
      const unsigned char c1 = p[i + 1];
      ok = !(c == 0xe0 && c1 < 0xa0) && !(c == 0xed && c1 >= 0xa0) && !(c == 0xf0 && c1 < 0x90) &&
           !(c == 0xf4 && c1 >= 0x90);
    }
    if (ok) {
      out.append(text.substr(i, len));
      i += len;
    } else {
      static const char* hex = "0123456789abcdef";
      out += "\\x";
      out += hex[c >> 4];
      out += hex[c & 15];
      ++i;
    }
  }
  return out;
}

static LogLevel parse_log_level() {
  const char* v = std::getenv("DELTASTACK_LOG");
  if (!v) return LogLevel::Info;
  std::string s(v);
  if (s == "quiet") return LogLevel::Quiet;
  if (s == "debug") return LogLevel::Debug;
  return LogLevel::Info;
}
static LogLevel g_level = parse_log_level();
LogLevel log_level() { return g_level; }
void set_log_level(LogLevel level) { g_level = level; }
static bool g_muted = false;
bool log_muted() { return g_muted; }
void set_log_muted(bool muted) { g_muted = muted; }

static int g_threads = 0;
// OpenBLAS never threads itself (it would change results with the thread count): pinned at load, before any op
// runs, whether or not the program calls set_num_threads. Ops split GEMMs over fixed partitions instead.
[[maybe_unused]] static const bool g_blas_pinned = (openblas_set_num_threads(1), true);
void set_num_threads(int n) {
  if (n <= 0) n = omp_get_num_procs();
  g_threads = n;
  omp_set_num_threads(n);
  openblas_set_num_threads(1);  // stays single-threaded (see g_blas_pinned)
}
int num_threads() { return g_threads > 0 ? g_threads : omp_get_max_threads(); }

std::string read_file(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) fail("{}: is a directory, expected a file", path);
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("{}: cannot open ({})", path, std::strerror(errno));
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) fail("{}: read error", path);
  return ss.str();
}

void write_stderr_in_signal_handler(const char* s) {
  size_t n = std::strlen(s);
  while (n > 0) {
    const ssize_t w = ::write(2, s, n);
    if (w <= 0) return;
    s += w;
    n -= static_cast<size_t>(w);
  }
}

bool file_exists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0;
}

void fsync_dir(const std::string& dir) {
  int fd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (fd < 0) return;
  ::fsync(fd);
  ::close(fd);
}

AtomicFileWriter::AtomicFileWriter(std::string path) : path_(std::move(path)) {
  tmp_ = path_ + ".tmp." + std::to_string(::getpid());
  ::unlink(tmp_.c_str());  // a stale one of a killed process with this pid, or a link planted there
  fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
  if (fd_ < 0) fail("{}: cannot write ({}; temporary file {})", path_, std::strerror(errno), tmp_);
}

AtomicFileWriter::~AtomicFileWriter() {
  if (fd_ >= 0) {  // not committed
    ::close(fd_);
    ::unlink(tmp_.c_str());
  }
}

void AtomicFileWriter::write(const void* data, size_t size) {
  DS_CHECK(fd_ >= 0, "{}: write after commit", path_);
  const char* p = static_cast<const char*>(data);
  while (size > 0) {
    ssize_t w = ::write(fd_, p, size);
    if (w < 0) {
      if (errno == EINTR) continue;
      fail("{}: write failed ({}; temporary file {})", path_, std::strerror(errno), tmp_);
    }
    p += w;
    size -= static_cast<size_t>(w);
  }
}

void AtomicFileWriter::commit() {
  DS_CHECK(fd_ >= 0, "{}: committed twice", path_);
  const int fd = fd_;
  fd_ = -1;
  if (::fsync(fd) != 0 || ::close(fd) != 0) {
    int e = errno;
    ::unlink(tmp_.c_str());
    fail("{}: fsync/close failed ({}; temporary file {})", path_, std::strerror(e), tmp_);
  }
  if (checked_) {
    try {
      replace_checked(tmp_, path_, expected_, what_.empty() ? path_ : what_);
    } catch (...) {
      ::unlink(tmp_.c_str());
      throw;
    }
  } else if (::rename(tmp_.c_str(), path_.c_str()) != 0) {
    int e = errno;
    ::unlink(tmp_.c_str());
    fail("{}: rename failed ({})", path_, std::strerror(e));
  }
  fsync_dir(std::filesystem::path(path_).parent_path().string());
}

void write_file_atomic(const std::string& path, const void* data, size_t size) {
  AtomicFileWriter w(path);
  w.write(data, size);
  w.commit();
}

}  // namespace ds

namespace ds::cuda {
[[noreturn]] void throw_error(const std::string& msg) { throw ds::Error(msg); }
}  // namespace ds::cuda
