// File helpers. Writes are atomic: the data goes to "<path>.tmp.<pid>", is fsync'ed, then renamed over
// <path>, and the parent directory is fsync'ed; a crash leaves either the old file or the new one.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace ds {

// Reads a whole file. Throws ds::Error naming the path if it is missing or unreadable.
std::string read_file(const std::string& path);
// Atomically replaces `path` with `data` (see above). Throws ds::Error naming the path on failure.
void write_file_atomic(const std::string& path, const void* data, size_t size);
inline void write_file_atomic(const std::string& path, const std::string& data) {
  write_file_atomic(path, data.data(), data.size());
}
// fsync a directory (after renames inside it).
void fsync_dir(const std::string& dir);
bool file_exists(const std::string& path);

}  // namespace ds
