#include "train/run_dir.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <sstream>
#include <vector>

#include "core/error.h"
#include "core/files.h"
#include "core/fs_safety.h"
#include "core/log.h"

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace ds {

RunDirectory::RunDirectory(const std::string& out) : path_(out) {
  std::error_code ec;
  DS_CHECK(!fs::exists(out, ec) || fs::is_directory(out, ec), "--out {}: exists and is not a directory", out);
  fs::create_directories(out, ec);
  DS_CHECK(!ec, "--out {}: cannot create the directory ({})", out, ec.message());
  DS_CHECK(::access(out.c_str(), W_OK | X_OK) == 0, "--out {}: cannot write there ({})", out, std::strerror(errno));
  const std::string lock = (fs::path(out) / kLockName).string();
  // Never through a link planted at the lock's name (the pid would overwrite what it points at, and the
  // checkpoints would follow the lock into the link target's directory), nor into a file shared with another name.
  fd_ = open_no_follow(lock, O_RDWR | O_CREAT, 0644, "--out " + out + ": the lock file");
  struct stat st {};
  if (::fstat(fd_, &st) != 0 || !S_ISREG(st.st_mode) || st.st_nlink != 1) {
    const bool regular = S_ISREG(st.st_mode);
    ::close(fd_);
    fd_ = -1;
    DS_CHECK(!regular, "--out {}: its lock file {} has {} hard links (a hard-linked copy of a run directory, `cp "
             "-al`?): the lock would be shared with the other name, and the pid written into it. Remove this name "
             "of it (the run creates a lock file of its own)", out, lock, st.st_nlink);
    fail("--out {}: the lock file {} is not a regular file. Remove it", out, lock);
  }
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

std::string RunDirectory::current_path() const {
  char buf[4096];
  const std::string link = "/proc/self/fd/" + std::to_string(fd_);
  const ssize_t n = ::readlink(link.c_str(), buf, sizeof(buf) - 1);
  if (n <= 0) return "";
  const std::string p(buf, static_cast<size_t>(n));
  if (p.size() >= 10 && p.compare(p.size() - 10, 10, " (deleted)") == 0) return "";
  return fs::path(p).parent_path().string();
}

// ".checkpoint-N.tmp" or ".checkpoint-N.old.tmp" with N all digits: the only names a save or a --keep-last gives its
// temporary directories.
bool checkpoint_temp_name(const std::string& n) {
  const std::string head = ".checkpoint-";
  if (!n.starts_with(head)) return false;
  std::string rest = n.substr(head.size());
  if (rest.ends_with(".old.tmp")) rest.resize(rest.size() - 8);
  else if (rest.ends_with(".tmp")) rest.resize(rest.size() - 4);
  else return false;
  return !rest.empty() && rest.size() <= 18 && std::all_of(rest.begin(), rest.end(), [](char c) { return c >= '0' && c <= '9'; });
}

void RunDirectory::remove_stale_temps(const std::string& keep) const {
  std::vector<fs::path> stale;
  for (const auto& e : fs::directory_iterator(path_)) {
    const std::string n = e.path().filename().string();
    if (checkpoint_temp_name(n)) stale.push_back(e.path());
  }
  std::error_code ec;
  if (!keep.empty()) {
    const fs::path src = fs::canonical(keep, ec);
    std::erase_if(stale, [&](const fs::path& p) { return fs::canonical(p, ec) == src; });
  }
  for (const fs::path& p : stale) {
    const std::string n = p.filename().string();
    if (fs::is_symlink(fs::symlink_status(p, ec)) || !fs::is_directory(fs::symlink_status(p, ec))) {
      log_warn("leaving {} alone: not a directory, so no temporary directory of a checkpoint save", p.string());
      continue;
    }
    const bool prune_temp = n.size() > 8 && n.compare(n.size() - 8, 8, ".old.tmp") == 0;
    if (!prune_temp && complete_checkpoint(p)) {
      // A save whose rename was refused (checkpoint-N appeared meanwhile) left a complete checkpoint here: kept.
      const std::string base = n.substr(1, n.size() - 5) + ".recovered";  // checkpoint-N.recovered
      fs::path dst = fs::path(path_) / base;
      for (int k = 2; fs::exists(fs::symlink_status(dst, ec)); ++k) dst = fs::path(path_) / fmt::format("{}-{}", base, k);
      fs::rename(p, dst, ec);
      if (ec) log_warn("{} holds a complete checkpoint but could not be renamed to {} ({}); left in place",
                       p.string(), dst.string(), ec.message());
      else log_warn("{} holds a complete checkpoint that an earlier run could not put in place; kept as {} (resume "
                    "from it with --resume {}, or remove it)", p.string(), dst.string(), dst.string());
      continue;
    }
    try {
      // Only the files a save writes; what a user put there (or a save's own partial file of another name) stays,
      // and so does the directory then.
      const std::string other = remove_checkpoint_files(p);
      if (other.empty()) log_info("removed {} (left by an interrupted checkpoint save)", p.string());
      else log_warn("removed the checkpoint files of {} (left by an interrupted {}) but kept the directory: it also "
                    "holds {}", p.string(), prune_temp ? "--keep-last" : "checkpoint save", other);
    } catch (const std::exception& e) {
      log_warn("could not remove {}: {}", p.string(), e.what());
    }
  }
}

namespace {

// Whether `dir` holds any file a checkpoint save writes.
bool holds_checkpoint_file(const fs::path& dir) {
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec))
    if (is_checkpoint_file(it->path().filename().string())) return true;
  return false;
}

}  // namespace

bool complete_checkpoint(const fs::path& dir) {
  std::error_code ec;
  auto file = [&](const char* n) { return fs::is_regular_file(fs::symlink_status(dir / n, ec)); };
  return file("trainer_state.json") && file("config.json") && file("tokenizer.json") &&
         (file("model.safetensors") || file("model.safetensors.index.json") ||
          (file("adapter_config.json") && file("adapter_model.safetensors"))) &&  // a LoRA run's: the adapter
         (file("optimizer.safetensors") || file("optimizer.safetensors.index.json"));
}

bool is_checkpoint_file(const std::string& n) {
  // The atomic writer's temporary name of one of them (core/files.h: "<name>.tmp.<pid>"), left by a killed save.
  if (const size_t t = n.rfind(".tmp."); t != std::string::npos && t + 5 < n.size() &&
      std::all_of(n.begin() + static_cast<std::ptrdiff_t>(t + 5), n.end(), [](char c) { return c >= '0' && c <= '9'; }))
    return is_checkpoint_file(n.substr(0, t));
  return n == "config.json" || n == "tokenizer.json" || n == "trainer_state.json" || n == "generation_config.json" ||
         n == "adapter_config.json" || n == "adapter_model.safetensors" ||  // a LoRA run's (train/lora_train.h)
         ((n.starts_with("model") || n.starts_with("optimizer")) &&
          (n.ends_with(".safetensors") || n.ends_with(".safetensors.index.json")));
}

std::string remove_checkpoint_files(const fs::path& dir) {
  struct stat st;
  if (::lstat(dir.c_str(), &st) != 0 && errno == ENOENT) return "";
  DS_CHECK(S_ISDIR(st.st_mode), "{}: not a directory; not removing it", dir.string());
  std::vector<std::string> ours;
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string n = e.path().filename().string();
    if (is_checkpoint_file(n) && !e.is_symlink() && e.is_regular_file()) ours.push_back(n);
  }
  // trainer_state.json first: what a kill leaves midway is no longer read as a checkpoint.
  std::stable_partition(ours.begin(), ours.end(), [](const std::string& n) { return n == "trainer_state.json"; });
  for (const std::string& n : ours)
    DS_CHECK(::unlink((dir / n).c_str()) == 0 || errno == ENOENT, "{}: cannot remove ({})", (dir / n).string(),
             std::strerror(errno));
  const std::string other = foreign_entry(dir.string(), [](const std::string&) { return false; });
  if (!other.empty()) return other;
  DS_CHECK(::rmdir(dir.c_str()) == 0 || errno == ENOENT || errno == ENOTEMPTY, "{}: cannot remove ({})",
           dir.string(), std::strerror(errno));
  return file_identity(dir.string()).exists ? foreign_entry(dir.string(), [](const std::string&) { return false; })
                                            : "";
}

int64_t checkpoint_step(const std::string& name) {
  if (name.rfind("checkpoint-", 0) != 0) return -1;
  const std::string digits = name.substr(11);
  if (digits.empty() || digits.size() > 18 || digits.find_first_not_of("0123456789") != std::string::npos ||
      (digits.size() > 1 && digits[0] == '0'))
    return -1;
  return std::stoll(digits);
}

CheckpointOwner checkpoint_owner(const fs::path& dir) {
  CheckpointOwner o;
  try {
    const json st = json::parse(read_file((dir / "trainer_state.json").string()));
    if (st.contains("run_id") && st["run_id"].is_string()) o.run_id = st["run_id"].get<std::string>();
    if (st.contains("session_id") && st["session_id"].is_string()) o.session_id = st["session_id"].get<std::string>();
  } catch (const std::exception&) {
  }
  return o;
}

namespace {

// Whether a metrics file holds a line of a run other than `run_id` (lines without "run_id": legacy_ours decides;
// lines that do not parse say nothing).
bool metrics_of_another_run(const std::string& path, const std::string& run_id, bool legacy_ours) {
  std::istringstream in(read_file(path));
  std::string line;
  while (std::getline(in, line)) {
    json j;
    try {
      j = json::parse(line);
    } catch (const json::exception&) {
      continue;
    }
    if (!j.is_object()) continue;
    if (j.contains("run_id") ? j["run_id"] != run_id : !legacy_ours) return true;
  }
  return false;
}

}  // namespace

namespace {

// Renames the entries `names` of `dir` into a new dir/<prefix>-K/ (K the first free number), durably (both
// directories fsync'ed); returns its path. Nothing is copied or deleted.
std::string move_into_new_subdir(const std::string& dir, const char* prefix, const std::vector<std::string>& names) {
  int k = 1;
  while (fs::exists(fs::path(dir) / fmt::format("{}-{}", prefix, k))) ++k;
  const fs::path aside = fs::path(dir) / fmt::format("{}-{}", prefix, k);
  fs::create_directory(aside);
  for (const std::string& n : names) fs::rename(fs::path(dir) / n, aside / n);
  fsync_dir(aside.string());
  fsync_dir(dir);
  return aside.string();
}

}  // namespace

void RunDirectory::claim(const std::string& run_id, bool legacy_lines_are_ours, bool move_aside) const {
  std::vector<std::string> foreign;
  for (const auto& e : fs::directory_iterator(path_)) {
    const std::string n = e.path().filename().string();
    if (n == kMetricsName || n == kAbandonedMetricsName) {
      // The run appends to these: a link (to the corpus, another run's file) or a device would receive its lines.
      DS_CHECK(e.is_regular_file() && !e.is_symlink(), "--out {}: {} is {}, not a regular file; the run appends its "
               "metrics there and would write into what it points at. Move it away", path_, e.path().string(),
               e.is_symlink() ? "a symbolic link" : "no regular file");
      // A hard link (a `cp -al` / `rsync --link-dest` snapshot of the run directory) is the same file in another
      // directory: appending here would write this run's lines into the snapshot too.
      std::error_code ec;
      const uintmax_t links = fs::hard_link_count(e.path(), ec);
      DS_CHECK(ec || links <= 1, "--out {}: {} has {} hard links (a hard-linked copy of a run directory?); the run "
               "appends its metrics there and would write into every copy. Replace it with a copy of its own "
               "(cp --remove-destination, or cp F F.new && mv F.new F)", path_, e.path().string(), links);
      if (metrics_of_another_run(e.path().string(), run_id, legacy_lines_are_ours))
        foreign.push_back(n);
    } else if (checkpoint_step(n) >= 0 && e.is_directory() && !e.is_symlink() &&
               foreign_entry(e.path().string(), is_checkpoint_file) != "" && !holds_checkpoint_file(e.path())) {
      // No checkpoint's: only what a user keeps there (what --keep-last left of a checkpoint holding NOTES.md).
      // Nothing of another run to protect; a save of that step refuses to replace it (rename_into_place).
      continue;
    } else if (checkpoint_step(n) >= 0 && e.is_directory() && checkpoint_owner(e.path()).run_id != run_id) {
      foreign.push_back(n);
    }
  }
  if (foreign.empty()) return;
  std::sort(foreign.begin(), foreign.end());
  const std::string list = foreign.size() <= 4 ? fmt::format("{}", fmt::join(foreign, ", "))
                                               : fmt::format("{}, ... ({} in all)", fmt::join(foreign.begin(),
                                                             foreign.begin() + 3, ", "), foreign.size());
  DS_CHECK(move_aside, "--out {} holds another run's files ({}): this run would mix its metrics and checkpoints with "
           "them. Give another --out, or --move-aside to move them into {}/previous-N/", path_, list, path_);
  const std::string aside = move_into_new_subdir(path_, "previous", foreign);
  log_warn("--move-aside: moved another run's files ({}) into {}", list, aside);
}

std::vector<std::string> RunDirectory::later_checkpoints(const std::string& run_id, int64_t start_step) const {
  std::vector<std::string> later;
  for (const auto& e : fs::directory_iterator(path_)) {
    const std::string n = e.path().filename().string();
    if (checkpoint_step(n) > start_step && e.is_directory() && checkpoint_owner(e.path()).run_id == run_id)
      later.push_back(n);
  }
  std::sort(later.begin(), later.end());
  return later;
}

std::string RunDirectory::set_aside_later_checkpoints(const std::string& run_id, int64_t start_step) const {
  const std::vector<std::string> later = later_checkpoints(run_id, start_step);
  if (later.empty()) return "";
  const std::string aside = move_into_new_subdir(path_, "abandoned", later);
  log_warn("resuming from step {}: the later checkpoints of the abandoned history ({}) moved into {}", start_step,
           fmt::join(later, ", "), aside);
  return aside;
}

}  // namespace ds
