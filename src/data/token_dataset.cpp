#include "data/token_dataset.h"

#include <fmt/format.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <filesystem>

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

DatasetWriter::DatasetWriter(std::string dir, int64_t shard_tokens) : dir_(std::move(dir)), shard_tokens_(shard_tokens) {
  DS_CHECK(shard_tokens >= 1, "--shard-tokens must be at least 1, got {}", shard_tokens);
}

DatasetWriter::~DatasetWriter() {
  if (tok_fd_ >= 0) ::close(tok_fd_);
  if (lab_fd_ >= 0) ::close(lab_fd_);
}

void DatasetWriter::open_shard() {
  const size_t i = shard_sizes_.size();
  tok_fd_ = open_new(dir_ + "/" + shard_name("tokens", i));
  lab_fd_ = open_new(dir_ + "/" + shard_name("labels", i));  // removed in finish() when nothing is masked
  shard_sizes_.push_back(0);
  in_shard_ = 0;
}

void DatasetWriter::close_shard() {
  const size_t i = shard_sizes_.size() - 1;
  sync_close(tok_fd_, dir_ + "/" + shard_name("tokens", i));
  sync_close(lab_fd_, dir_ + "/" + shard_name("labels", i));
}

void DatasetWriter::add(const TokenizedSample& doc) {
  DS_CHECK(doc.loss_mask.empty() || doc.loss_mask.size() == doc.ids.size(), "document {}: {} ids but {} loss_mask "
           "values", starts_.size(), doc.ids.size(), doc.loss_mask.size());
  starts_.push_back(num_tokens_);
  masked_.push_back(!doc.loss_mask.empty());
  std::vector<uint8_t> ones;
  size_t done = 0;
  while (done < doc.ids.size()) {
    if (tok_fd_ < 0 || in_shard_ == shard_tokens_) {
      if (tok_fd_ >= 0) close_shard();
      open_shard();
    }
    const size_t n = std::min<size_t>(doc.ids.size() - done, static_cast<size_t>(shard_tokens_ - in_shard_));
    const size_t i = shard_sizes_.size() - 1;
    write_all(tok_fd_, doc.ids.data() + done, n * sizeof(int32_t), dir_ + "/" + shard_name("tokens", i));
    const uint8_t* lab = doc.loss_mask.data() + done;
    if (doc.loss_mask.empty()) {
      ones.assign(n, 1);
      lab = ones.data();
    }
    write_all(lab_fd_, lab, n, dir_ + "/" + shard_name("labels", i));
    done += n;
    in_shard_ += static_cast<int64_t>(n);
    shard_sizes_.back() += static_cast<int64_t>(n);
    num_tokens_ += static_cast<int64_t>(n);
  }
}

void DatasetWriter::finish(json meta) {
  if (tok_fd_ >= 0) close_shard();
  const bool masked = std::find(masked_.begin(), masked_.end(), 1) != masked_.end();
  std::vector<int64_t> offsets = starts_;
  offsets.push_back(num_tokens_);
  write_synced(dir_ + "/documents.bin", offsets.data(), offsets.size() * sizeof(int64_t));
  if (masked) write_synced(dir_ + "/masked.bin", masked_.data(), masked_.size());
  json shards = json::array();
  for (size_t i = 0; i < shard_sizes_.size(); ++i) {
    json s = {{"tokens", shard_name("tokens", i)}, {"num_tokens", shard_sizes_[i]}};
    if (masked) s["labels"] = shard_name("labels", i);
    else fs::remove(dir_ + "/" + shard_name("labels", i));
    shards.push_back(s);
  }
  meta["format"] = kDatasetFormat;
  meta["version"] = kDatasetVersion;
  meta["num_tokens"] = num_tokens_;
  meta["num_documents"] = starts_.size();
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

const void* MappedTokenStore::map(const std::string& file, size_t expect_bytes, const std::string& field_name) {
  const std::string path = dir_ + "/" + file;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  DS_CHECK(fd >= 0, "{}: cannot open ({}), named by {}/index.json field \"{}\"", path, std::strerror(errno), dir_,
           field_name);
  struct stat st{};
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
  maps_.push_back({p, expect_bytes});
  return p;
}

MappedTokenStore::MappedTokenStore(const std::string& dir) : dir_(dir) {
  const std::string ix = dir + "/index.json";
  const std::string text = read_file(ix);
  try {
    index_ = json::parse(text);
  } catch (const json::exception& e) {
    fail("{}: invalid JSON ({})", ix, e.what());
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
  for (size_t i = 0; i < shards.size(); ++i) {
    const std::string where = fmt::format("shards[{}].", i);
    const int64_t n = count(shards[i], "num_tokens", ix, where);
    const int64_t want = std::min(shard_, num_tokens_ - static_cast<int64_t>(i) * shard_);
    DS_CHECK(n == want, "{}: field \"{}num_tokens\" is {}, expected {}", ix, where, n, want);
    const std::string tf = name(shards[i], "tokens", ix, where);
    token_files_.push_back(dir + "/" + tf);
    token_shards_.push_back(
        static_cast<const int32_t*>(map(tf, static_cast<size_t>(n) * sizeof(int32_t), where + "tokens")));
    if (masked)
      label_shards_.push_back(
          static_cast<const uint8_t*>(map(name(shards[i], "labels", ix, where), static_cast<size_t>(n), where + "labels")));
  }
  const std::string df = name(index_, "documents", ix);
  const auto* offs = static_cast<const int64_t*>(map(df, static_cast<size_t>(ndocs + 1) * sizeof(int64_t), "documents"));
  doc_starts_.assign(offs, offs + ndocs + 1);
  DS_CHECK(doc_starts_.front() == 0 && doc_starts_.back() == num_tokens_, "{}/{}: the offsets must start at 0 and end "
           "at num_tokens {} (they run from {} to {})", dir, df, num_tokens_, doc_starts_.front(), doc_starts_.back());
  for (int64_t d = 0; d < ndocs; ++d)
    DS_CHECK(doc_starts_[d] <= doc_starts_[d + 1], "{}/{}: offset {} ({}) is below offset {} ({}): offsets must not "
             "decrease", dir, df, d + 1, doc_starts_[d + 1], d, doc_starts_[d]);
  if (masked) {
    const std::string mf = name(index_, "masked_documents", ix);
    const auto* m = static_cast<const uint8_t*>(map(mf, static_cast<size_t>(ndocs), "masked_documents"));
    doc_masked_.assign(m, m + ndocs);
  }
}

MappedTokenStore::~MappedTokenStore() {
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
  }
}

}  // namespace ds
