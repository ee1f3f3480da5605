#include "data/token_dataset.h"

#include <fmt/format.h>

#include <fcntl.h>
#include <setjmp.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>

#include "core/error.h"
#include "core/files.h"

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace ds {

static_assert(std::endian::native == std::endian::little, "dataset shards are little-endian");

std::string tokenizer_fingerprint(const std::string& tokenizer_json) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : tokenizer_json) {
    h ^= c;
    h *= 0x100000001b3ull;
  }
  return fmt::format("{:016x}", h);
}

bool is_dataset_dir(const std::string& path) {
  std::error_code ec;
  return fs::is_directory(path, ec) && fs::exists(fs::path(path) / "index.json", ec);
}

namespace {

constexpr size_t kBuffer = size_t{4} << 20;

std::string shard_name(const char* kind, size_t i) { return fmt::format("{}-{:05d}.bin", kind, i); }

int open_new(const std::string& path) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  DS_CHECK(fd >= 0, "{}: cannot create ({})", path, std::strerror(errno));
  return fd;
}

void write_all(int fd, const void* data, size_t n, const std::string& path) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w = ::write(fd, p, n);
    if (w < 0 && errno == EINTR) continue;
    DS_CHECK(w > 0, "{}: write failed ({})", path, std::strerror(errno));
    p += w;
    n -= static_cast<size_t>(w);
  }
}

void sync_close(int& fd, const std::string& path) {
  if (fd < 0) return;
  const bool ok = ::fsync(fd) == 0;
  const int err = errno;
  ::close(fd);
  fd = -1;
  DS_CHECK(ok, "{}: fsync failed ({})", path, std::strerror(err));
}

void write_synced(const std::string& path, const void* data, size_t n) {
  int fd = open_new(path);
  try {
    write_all(fd, data, n, path);
  } catch (...) {
    ::close(fd);
    throw;
  }
  sync_close(fd, path);
}

}  // namespace

void DatasetWriter::Out::open(std::string p) {
  path = std::move(p);
  fd = open_new(path);
  buf.reserve(kBuffer);
}

void DatasetWriter::Out::write(const void* data, size_t n) {
  if (buf.size() + n > kBuffer) flush();
  if (n >= kBuffer) {
    write_all(fd, data, n, path);
    return;
  }
  const char* p = static_cast<const char*>(data);
  buf.insert(buf.end(), p, p + n);
}

void DatasetWriter::Out::flush() {
  if (!buf.empty()) write_all(fd, buf.data(), buf.size(), path);
  buf.clear();
}

void DatasetWriter::Out::sync_close() {
  if (fd < 0) return;
  flush();
  ds::sync_close(fd, path);
}

DatasetWriter::Out::~Out() {
  if (fd >= 0) ::close(fd);
}

DatasetWriter::DatasetWriter(std::string dir, int64_t shard_tokens) : dir_(std::move(dir)), shard_tokens_(shard_tokens) {
  DS_CHECK(shard_tokens >= 1, "--shard-tokens must be at least 1, got {}", shard_tokens);
  docs_.open(dir_ + "/documents.bin");
  masked_.open(dir_ + "/masked.bin");  // removed in finish() when nothing is masked
}

DatasetWriter::~DatasetWriter() = default;

void DatasetWriter::open_shard() {
  const size_t i = shard_sizes_.size();
  tok_.open(dir_ + "/" + shard_name("tokens", i));
  if (any_masked_) lab_.open(dir_ + "/" + shard_name("labels", i));  // else written once a masked document comes
  shard_sizes_.push_back(0);
  in_shard_ = 0;
}

void DatasetWriter::close_shard() {
  tok_.sync_close();
  lab_.sync_close();
}

void DatasetWriter::add(const TokenizedSample& doc) {
  DS_CHECK(doc.loss_mask.empty() || doc.loss_mask.size() == doc.ids.size(), "document {}: {} ids but {} loss_mask "
           "values", num_docs_, doc.ids.size(), doc.loss_mask.size());
  docs_.write(&num_tokens_, sizeof(int64_t));
  const uint8_t m = doc.loss_mask.empty() ? 0 : 1;
  masked_.write(&m, 1);
  ++num_docs_;
  static const std::vector<uint8_t> ones(4096, 1);
  if (m && !any_masked_) {  // the first masked document: every token so far is labelled
    any_masked_ = true;
    for (size_t i = 0; i < shard_sizes_.size(); ++i) {
      const bool open = i + 1 == shard_sizes_.size() && tok_.fd >= 0;
      Out lab;
      Out& o = open ? lab_ : lab;
      o.open(dir_ + "/" + shard_name("labels", i));
      for (int64_t k = 0; k < shard_sizes_[i]; k += static_cast<int64_t>(ones.size()))
        o.write(ones.data(), std::min<size_t>(ones.size(), static_cast<size_t>(shard_sizes_[i] - k)));
      if (!open) o.sync_close();
    }
  }
  size_t done = 0;
  while (done < doc.ids.size()) {
    if (tok_.fd < 0 || in_shard_ == shard_tokens_) {
      if (tok_.fd >= 0) close_shard();
      open_shard();
    }
    const size_t n = std::min<size_t>(doc.ids.size() - done, static_cast<size_t>(shard_tokens_ - in_shard_));
    tok_.write(doc.ids.data() + done, n * sizeof(int32_t));
    if (any_masked_ && doc.loss_mask.empty()) {
      for (size_t k = 0; k < n; k += ones.size()) lab_.write(ones.data(), std::min(ones.size(), n - k));
    } else if (any_masked_) {
      lab_.write(doc.loss_mask.data() + done, n);
    }
    done += n;
    in_shard_ += static_cast<int64_t>(n);
    shard_sizes_.back() += static_cast<int64_t>(n);
    num_tokens_ += static_cast<int64_t>(n);
  }
}

void DatasetWriter::finish(json meta) {
  if (tok_.fd >= 0) close_shard();
  const bool masked = any_masked_;
  docs_.write(&num_tokens_, sizeof(int64_t));
  docs_.sync_close();
  masked_.sync_close();
  if (!masked) fs::remove(dir_ + "/masked.bin");
  json shards = json::array();
  for (size_t i = 0; i < shard_sizes_.size(); ++i) {
    json s = {{"tokens", shard_name("tokens", i)}, {"num_tokens", shard_sizes_[i]}};
    if (masked) s["labels"] = shard_name("labels", i);
    shards.push_back(s);
  }
  meta["format"] = kDatasetFormat;
  meta["version"] = kDatasetVersion;
  meta["num_tokens"] = num_tokens_;
  meta["num_documents"] = num_docs_;
  meta["shard_tokens"] = shard_tokens_;
  meta["masked"] = masked;
  meta["documents"] = "documents.bin";
  if (masked) meta["masked_documents"] = "masked.bin";
  meta["shards"] = shards;
  const std::string text = meta.dump(1) + "\n";
  write_synced(dir_ + "/index.json", text.data(), text.size());
  fsync_dir(dir_);
}

// ---- reading

namespace {

const json& field(const json& j, const char* key, json::value_t type, const std::string& file, const std::string& where) {
  DS_CHECK(j.is_object() && j.contains(key), "{}: missing field \"{}{}\"", file, where, key);
  const json& v = j[key];
  const bool ok = type == json::value_t::number_unsigned ? v.is_number_unsigned()
                  : type == json::value_t::string          ? v.is_string()
                  : type == json::value_t::boolean         ? v.is_boolean()
                  : type == json::value_t::array           ? v.is_array()
                                                           : false;
  DS_CHECK(ok, "{}: field \"{}{}\" has the wrong type ({})", file, where, key, v.dump());
  return v;
}

int64_t count(const json& j, const char* key, const std::string& file, const std::string& where = "") {
  return field(j, key, json::value_t::number_unsigned, file, where).get<int64_t>();
}

std::string name(const json& j, const char* key, const std::string& file, const std::string& where = "") {
  std::string s = field(j, key, json::value_t::string, file, where).get<std::string>();
  DS_CHECK(!s.empty() && s.find('/') == std::string::npos && s != "." && s != "..",
           "{}: field \"{}{}\": \"{}\" is not a file name inside the dataset directory", file, where, key, s);
  return s;
}

}  // namespace

// ---- bus errors on the mappings (MappedTokenStore::read_guarded)

namespace {

// The live stores' mappings, for the SIGBUS handler: a fixed table (no allocation in the handler), each slot a
// store's list of mappings or null. A store registers before its first mapping (its constructor's checks read them)
// and unregisters before it unmaps them. A bus error inside read_guarded jumps back there (t_guard of the faulting
// thread: SIGBUS from a fault goes to the thread that faulted); anywhere else it ends the process with the file's name.
// Why not pread copies of every batch instead: the scans at start (fingerprints, check_ids, the window index) read
// the whole mapping too, and a truncation during them would still kill the process; the handler covers every read.
constexpr int kStoreSlots = 64;
std::atomic<const std::vector<MappedTokenStore::Map>*> g_stores[kStoreSlots];

struct ReadGuard {
  sigjmp_buf env;
  const MappedTokenStore::Map* hit = nullptr;
  uintptr_t offset = 0;
};
thread_local ReadGuard* t_guard = nullptr;
struct sigaction g_previous{};

void write_stderr(const char* s) {
  for (size_t n = std::strlen(s); n > 0;) {
    const ssize_t w = ::write(2, s, n);
    if (w <= 0) return;
    s += w;
    n -= static_cast<size_t>(w);
  }
}

void on_sigbus(int sig, siginfo_t* info, void* context) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(info->si_addr);
  for (auto& slot : g_stores) {
    const std::vector<MappedTokenStore::Map>* maps = slot.load(std::memory_order_acquire);
    if (!maps) continue;
    for (const MappedTokenStore::Map& m : *maps) {
      const uintptr_t p = reinterpret_cast<uintptr_t>(m.p);
      if (a < p || a - p >= m.n) continue;
      if (t_guard) {
        t_guard->hit = &m;
        t_guard->offset = a - p;
        siglongjmp(t_guard->env, 1);
      }
      write_stderr("error: ");
      write_stderr(m.file.c_str());
      write_stderr(": the file changed while deltastack read it (truncated or replaced in place under its memory "
                   "mapping: a bus error); nothing was trained yet. Restore the dataset (or tokenize it again) and "
                   "start again\n");
      ::_exit(1);
    }
  }
  // Not a mapping of ours: the previous handler, or the default action (the faulting read runs again and kills).
  if (g_previous.sa_flags & SA_SIGINFO) {
    if (g_previous.sa_sigaction) return g_previous.sa_sigaction(sig, info, context);
  } else if (g_previous.sa_handler != SIG_DFL && g_previous.sa_handler != SIG_IGN && g_previous.sa_handler) {
    return g_previous.sa_handler(sig);
  }
  ::signal(SIGBUS, SIG_DFL);
}

void register_store(const std::vector<MappedTokenStore::Map>* maps) {
  static std::once_flag installed;
  std::call_once(installed, [] {
    struct sigaction sa{};
    sa.sa_sigaction = on_sigbus;
    sa.sa_flags = SA_SIGINFO;
    sigemptyset(&sa.sa_mask);
    ::sigaction(SIGBUS, &sa, &g_previous);
  });
  for (auto& slot : g_stores) {
    const std::vector<MappedTokenStore::Map>* none = nullptr;
    if (slot.compare_exchange_strong(none, maps)) return;
  }
  fail("data: more than {} dataset directories open at once", kStoreSlots);
}

void unregister_store(const std::vector<MappedTokenStore::Map>* maps) {
  for (auto& slot : g_stores) {
    const std::vector<MappedTokenStore::Map>* mine = maps;
    if (slot.compare_exchange_strong(mine, nullptr)) return;
  }
}

}  // namespace

MappedTokenStore::Registration::Registration(const std::vector<Map>* maps) : maps_(maps) { register_store(maps); }
void MappedTokenStore::Registration::reset() {
  if (maps_) unregister_store(maps_);
  maps_ = nullptr;
}

void MappedTokenStore::read_guarded(const std::function<void()>& reads) const {
  ReadGuard guard;
  ReadGuard* const outer = t_guard;
  if (sigsetjmp(guard.env, 1) == 0) {  // 1: the signal mask (SIGBUS blocked in the handler) comes back on the jump
    t_guard = &guard;
    reads();
    t_guard = outer;
    return;
  }
  t_guard = outer;
  throw DataChangedError(fmt::format(
      "{}: the file changed while the run read it (truncated or replaced in place: a bus error at byte {} of its {} "
      "mapped bytes); the dataset in {} must not change while a run reads it (tokenize into a new directory instead)",
      guard.hit->file, guard.offset, guard.hit->n, dir_));
}

const void* MappedTokenStore::map(const std::string& file, size_t expect_bytes, const std::string& field_name) {
  const std::string path = dir_ + "/" + file;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);  // a FIFO: refused below, not waited on
  DS_CHECK(fd >= 0, "{}: cannot open ({}), named by {}/index.json field \"{}\"", path, std::strerror(errno), dir_,
           field_name);
  struct stat st{};
  if (::fstat(fd, &st) == 0 && !S_ISREG(st.st_mode)) {
    ::close(fd);
    fail("{}: not a regular file ({}), named by {}/index.json field \"{}\"", path,
         S_ISDIR(st.st_mode) ? "a directory" : "a device, pipe or socket", dir_, field_name);
  }
  if (::fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) != expect_bytes) {
    ::close(fd);
    fail("{}: {} bytes, but {}/index.json field \"{}\" says {} (a truncated or foreign file)", path,
         static_cast<long long>(st.st_size), dir_, field_name, expect_bytes);
  }
  if (expect_bytes == 0) {
    ::close(fd);
    return nullptr;
  }
  void* p = ::mmap(nullptr, expect_bytes, PROT_READ, MAP_SHARED, fd, 0);
  const int err = errno;
  ::close(fd);
  DS_CHECK(p != MAP_FAILED, "{}: mmap failed ({})", path, std::strerror(err));
  maps_.push_back({p, expect_bytes, path});
  return p;
}

MappedTokenStore::MappedTokenStore(const std::string& dir) : dir_(dir) {
  const std::string ix = dir + "/index.json";
  const std::string text = read_file(ix);
  try {
    index_ = json::parse(text);
  } catch (const json::exception& e) {
    fail("{}: invalid JSON ({})", ix, printable(e.what()));
  }
  DS_CHECK(index_.is_object(), "{}: not a JSON object", ix);
  DS_CHECK(field(index_, "format", json::value_t::string, ix, "").get<std::string>() == kDatasetFormat,
           "{}: field \"format\" is {}, expected \"{}\"", ix, index_["format"].dump(), kDatasetFormat);
  DS_CHECK(count(index_, "version", ix) == kDatasetVersion, "{}: field \"version\" is {}; this build reads version {}",
           ix, index_["version"].dump(), kDatasetVersion);
  num_tokens_ = count(index_, "num_tokens", ix);
  const int64_t ndocs = count(index_, "num_documents", ix);
  shard_ = count(index_, "shard_tokens", ix);
  DS_CHECK(shard_ >= 1, "{}: field \"shard_tokens\" must be at least 1", ix);
  const bool masked = field(index_, "masked", json::value_t::boolean, ix, "").get<bool>();
  const json& shards = field(index_, "shards", json::value_t::array, ix, "");
  const int64_t want_shards = (num_tokens_ + shard_ - 1) / shard_;
  DS_CHECK(static_cast<int64_t>(shards.size()) == want_shards, "{}: field \"shards\" lists {} shards, but "
           "num_tokens {} in shards of {} needs {}", ix, shards.size(), num_tokens_, shard_, want_shards);
  // Every file is named by one field only: a shard listed twice would read another shard's tokens (or a token
  // file as labels) in place of the corpus written.
  std::map<std::string, std::string> named_by;  // file -> the field naming it
  const auto file = [&](const json& j, const char* key, const std::string& where) {
    std::string f = name(j, key, ix, where);
    const auto [it, fresh] = named_by.emplace(f, where + key);
    DS_CHECK(fresh, "{}: field \"{}{}\" names \"{}\", which field \"{}\" names too: each file of the dataset is "
             "listed once", ix, where, key, f, it->second);
    return f;
  };
  // Without "masked", every token is a target: label files left next to it mean the flag was edited, and training
  // would learn the prompt tokens the labels exclude.
  if (!masked) {
    for (size_t i = 0; i < shards.size(); ++i)
      DS_CHECK(!(shards[i].is_object() && shards[i].contains("labels")), "{}: field \"masked\" is false, but field "
               "\"shards[{}].labels\" names a label file (set \"masked\" to true, or remove the labels)", ix, i);
    DS_CHECK(!index_.contains("masked_documents"), "{}: field \"masked\" is false, but field \"masked_documents\" is "
             "present (set \"masked\" to true, or remove it)", ix);
    for (const std::string& f : {std::string("masked.bin"), shard_name("labels", 0)}) {
      std::error_code ec;
      DS_CHECK(!fs::exists(dir + "/" + f, ec), "{}: field \"masked\" is false, but {}/{} exists: the dataset was "
               "written with loss masks (set \"masked\" to true, or delete the label files)", ix, dir, f);
    }
  }
  for (size_t i = 0; i < shards.size(); ++i) {
    const std::string where = fmt::format("shards[{}].", i);
    const int64_t n = count(shards[i], "num_tokens", ix, where);
    const int64_t want = std::min(shard_, num_tokens_ - static_cast<int64_t>(i) * shard_);
    DS_CHECK(n == want, "{}: field \"{}num_tokens\" is {}, expected {}", ix, where, n, want);
    const std::string tf = file(shards[i], "tokens", where);
    token_files_.push_back(dir + "/" + tf);
    token_shards_.push_back(
        static_cast<const int32_t*>(map(tf, static_cast<size_t>(n) * sizeof(int32_t), where + "tokens")));
    if (masked)
      label_shards_.push_back(
          static_cast<const uint8_t*>(map(file(shards[i], "labels", where), static_cast<size_t>(n), where + "labels")));
  }
  const std::string df = file(index_, "documents", "");
  const auto* offs = static_cast<const int64_t*>(map(df, static_cast<size_t>(ndocs + 1) * sizeof(int64_t), "documents"));
  num_docs_ = ndocs;
  doc_starts_ = offs;  // read in place: no copy of a corpus' worth of offsets
  DS_CHECK(doc_starts_[0] == 0 && doc_starts_[ndocs] == num_tokens_, "{}/{}: the offsets must start at 0 and end "
           "at num_tokens {} (they run from {} to {})", dir, df, num_tokens_, doc_starts_[0], doc_starts_[ndocs]);
  for (int64_t d = 0; d < ndocs; ++d) {
    DS_CHECK(doc_starts_[d] <= doc_starts_[d + 1], "{}/{}: offset {} ({}) is below offset {} ({}): offsets must not "
             "decrease", dir, df, d + 1, doc_starts_[d + 1], d, doc_starts_[d]);
    if (d % (int64_t{1} << 23) == 0) release_pages();  // 64 MB of offsets
  }
  if (masked) {
    const std::string mf = file(index_, "masked_documents", "");
    doc_masked_ = static_cast<const uint8_t*>(map(mf, static_cast<size_t>(ndocs), "masked_documents"));
  }
  release_pages();
}

void MappedTokenStore::windows_read(int64_t windows) const {
  if (windows_read_.fetch_add(windows) + windows < 16) return;
  windows_read_ = 0;
  release_pages();
}

void MappedTokenStore::release_pages() const {
  // MADV_DONTNEED on a read-only shared file mapping only unmaps the pages from this process (the next read faults
  // them in again from the page cache): the bytes never change.
  for (const Map& m : maps_) ::madvise(m.p, m.n, MADV_DONTNEED);
}

MappedTokenStore::~MappedTokenStore() {
  registration_.reset();  // before the mappings go
  for (const Map& m : maps_) ::munmap(m.p, m.n);
}

void MappedTokenStore::check_ids(int64_t vocab_size) const {
  for (size_t s = 0; s < token_shards_.size(); ++s) {
    const int64_t n = std::min(shard_, num_tokens_ - static_cast<int64_t>(s) * shard_);
    const int32_t* p = token_shards_[s];
    int64_t bad = -1;
    for (int64_t i = 0; i < n && bad < 0; ++i)
      if (p[i] < 0 || p[i] >= vocab_size) bad = i;
    DS_CHECK(bad < 0, "{}: token {} is id {}, outside the model's vocabulary [0, {})", token_files_[s], bad, p[bad],
             vocab_size);
    release_pages();
  }
}

}  // namespace ds
