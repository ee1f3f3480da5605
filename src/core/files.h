// File helpers. Writes are atomic: the data goes to "<path>.tmp.<pid>", is fsync'ed, then renamed over
// <path>, and the parent directory is fsync'ed; a crash leaves either the old file or the new one.
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "core/fs_safety.h"

namespace ds {

// Reads a whole file. Throws ds::Error naming the path if it is missing or unreadable.
std::string read_file(const std::string& path);
// Atomically replaces `path` with `data` (see above). Throws ds::Error naming the path on failure.
void write_file_atomic(const std::string& path, const void* data, size_t size);
inline void write_file_atomic(const std::string& path, const std::string& data) {
  write_file_atomic(path, data.data(), data.size());
}
// The same for a file written piece by piece (no copy of the whole image in memory): bytes go to
// "<path>.tmp.<pid>" (created new: a link planted at that name is removed, never followed); commit() fsyncs, renames over <path> and fsyncs the directory. Destroyed without commit()
// (an exception on the way), the temporary file is removed and <path> is untouched. Throws ds::Error naming the
// path on any failure.
class AtomicFileWriter {
 public:
  explicit AtomicFileWriter(std::string path);
  ~AtomicFileWriter();
  AtomicFileWriter(const AtomicFileWriter&) = delete;
  AtomicFileWriter& operator=(const AtomicFileWriter&) = delete;
  // commit() then replaces <path> only if it is still `expected` (taken when the command checked its output:
  // absent, or that very file), through ds::replace_checked (fs_safety.h); else a ds::Error naming `what` (the
  // path when empty) and <path> untouched.
  void replace_only(const FileIdentity& expected, std::string what = "") {
    expected_ = expected, checked_ = true, what_ = std::move(what);
  }
  void write(const void* data, size_t size);
  void commit();

 private:
  std::string path_, tmp_, what_;
  int fd_ = -1;
  FileIdentity expected_;
  bool checked_ = false;
};

// fsync a directory (after renames inside it).
void fsync_dir(const std::string& dir);
bool file_exists(const std::string& path);

}  // namespace ds
