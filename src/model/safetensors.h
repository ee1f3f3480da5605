// Safetensors reader/writer (https://github.com/huggingface/safetensors format: 8-byte little-endian header
// length, JSON header {name: {dtype, shape, data_offsets:[begin,end]}, "__metadata__": {str: str}}, then the
// byte buffer). The reader validates everything before use: header length within the file, JSON well-formed,
// known dtypes, shape product * dtype size == end - begin, offsets inside the buffer, no overlaps; any violation
// throws ds::Error naming the file and the tensor or field.
//
// Limits and conventions of the reader: header length at most 100 MB (as the reference implementation), JSON
// nesting at most 16 deep, duplicate JSON keys at any level are errors, every shape entry and offset must be a
// non-negative JSON integer, "__metadata__" must map strings to strings. Gaps between tensors and trailing
// bytes after the last one are tolerated; zero-element tensors (begin == end) never overlap anything.
// All multi-byte values are little-endian (the host must be little-endian too).
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "core/fs_safety.h"

namespace ds {

enum class DType { F64, F32, F16, BF16, I64, I32, I16, I8, U8, BOOL };
const char* dtype_name(DType t);        // "F32", "BF16", ...
size_t dtype_size(DType t);             // bytes per element
bool is_float_dtype(DType t);           // F64, F32, F16, BF16 (the dtypes a float parameter may be stored in)

struct TensorInfo {
  std::string name;
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;  // byte offsets inside the data buffer
  int64_t numel() const;
};

class SafetensorsReader {
 public:
  // Reads and validates `path`. Throws ds::Error naming the path on any problem.
  explicit SafetensorsReader(const std::string& path);
  // Parses an in-memory safetensors image (same validation as the file constructor); `name` stands in for the
  // path in error messages and path(). Needs no file I/O (used by the fuzz target).
  static SafetensorsReader from_bytes(std::string bytes, std::string name);

  const std::string& path() const { return path_; }
  const std::vector<TensorInfo>& tensors() const { return tensors_; }  // sorted by name
  const TensorInfo* find(const std::string& name) const;  // null if absent
  bool has(const std::string& name) const { return find(name) != nullptr; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

  // Values converted to fp32 / fp64 (from F64, F32, F16 or BF16). Throws if `name` is absent or has an integer
  // dtype (a weight relabelled I32 must not be read as numbers).
  std::vector<float> read_f32(const std::string& name) const;
  std::vector<double> read_f64(const std::string& name) const;
  // Integer values (from I64, I32, I16, I8, U8, BOOL). Throws for float dtypes or if absent.
  std::vector<int64_t> read_i64(const std::string& name) const;
  // The tensor's raw little-endian payload (end - begin bytes), valid while the reader lives. Throws if absent.
  std::string_view raw_bytes(const std::string& name) const;
  // The same bytes as a copy the caller owns (nothing kept in the reader: a large tensor read once).
  std::string copy_bytes(const std::string& name) const;

 private:
  SafetensorsReader() = default;
  void parse();  // validates the header in bytes_ against file_size_ and fills the tables; errors name path_
  // The payload of t: a pointer into bytes_ (in-memory image), or read from the file into *buffer.
  const char* payload(const TensorInfo& t, std::string* buffer) const;
  std::string path_;
  bool lazy_ = false;      // a file: payloads are read on demand; else bytes_ is the whole image (from_bytes)
  uint64_t file_size_ = 0;
  std::string bytes_;      // the header (a file) or the whole image (from_bytes)
  mutable std::map<std::string, std::string> raw_;  // raw_bytes() of a file, kept while the reader lives
  std::unique_ptr<std::mutex> raw_mu_ = std::make_unique<std::mutex>();
  size_t data_start_ = 0;
  std::vector<TensorInfo> tensors_;
  std::map<std::string, size_t> index_;
  std::map<std::string, std::string> metadata_;
  const TensorInfo& get(const std::string& name) const;
  const TensorInfo& get_float(const std::string& name) const;  // get(), ds::Error for an integer dtype
};

// One tensor to write. Build with the helpers below; bytes holds the little-endian payload, or, for a view
// (make_tensor_f32_view), bytes is empty and f32_source points at numel fp32 values converted to dtype while
// the file is written (the pointer must stay valid until then).
struct SaveTensor {
  std::string name;
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;
  const float* f32_source = nullptr;
  // Or fp32 values produced on demand, in slabs, while the file is written (e.g. read from a GPU): fills
  // dst[0, count) with elements [first, first + count) of the tensor (row-major).
  std::function<void(int64_t first, int64_t count, float* dst)> f32_reader;
  // Or the raw little-endian element bytes, in slabs: fills dst with elements [first, first + count) of the
  // tensor in its dtype (count * dtype_size bytes); e.g. U8 codes read from a GPU.
  std::function<void(int64_t first, int64_t count, uint8_t* dst)> byte_reader;
};
// fp32 values stored as `as` (F32, BF16 with round-to-nearest-even, F16 not supported -> ds::Error).
SaveTensor make_tensor_f32(const std::string& name, std::vector<int64_t> shape, const float* values,
                           DType as = DType::F32);
// Elements of any dtype produced on demand by `reader` (SaveTensor::byte_reader) while the file is written.
SaveTensor make_tensor_bytes_reader(const std::string& name, DType dtype, std::vector<int64_t> shape,
                                    std::function<void(int64_t first, int64_t count, uint8_t* dst)> reader);
// The same without copying: the values are read (and converted) when the file is written.
SaveTensor make_tensor_f32_view(const std::string& name, std::vector<int64_t> shape, const float* values,
                                DType as = DType::F32);
// fp32 values fetched by `reader` in slabs of at most 1 Mi elements while the file is written.
SaveTensor make_tensor_f32_reader(const std::string& name, std::vector<int64_t> shape,
                                  std::function<void(int64_t first, int64_t count, float* dst)> reader,
                                  DType as = DType::F32);
SaveTensor make_tensor_i64(const std::string& name, std::vector<int64_t> shape, const int64_t* values);

// Writes a safetensors file atomically (temp file, fsync, rename). Tensors are laid out in the given order,
// names must be unique (ds::Error otherwise).
// The header is compact JSON ("__metadata__" first, only if non-empty; then the tensors in order with
// increasing data_offsets), padded with spaces to a multiple of 8 bytes. Each tensor's bytes.size() must equal
// numel * dtype_size, shapes must be non-negative, names non-empty, valid UTF-8 and not "__metadata__".
void write_safetensors(const std::string& path, const std::vector<SaveTensor>& tensors,
                       const std::map<std::string, std::string>& metadata = {});
// The same, for a command's output that must replace only what the command checked at its start: the final rename
// goes through ds::replace_checked (core/fs_safety.h) with `expected` (file_identity(path) then), so a file that
// appeared at `path` meanwhile, or another run's output, stays and this is a ds::Error naming `what` ("--output
// PATH") and the path.
void write_safetensors(const std::string& path, const std::vector<SaveTensor>& tensors,
                       const std::map<std::string, std::string>& metadata, const FileIdentity& expected,
                       const std::string& what);
// The same file image as a string (no I/O); `what` names the destination in error messages.
std::string serialize_safetensors(const std::vector<SaveTensor>& tensors,
                                  const std::map<std::string, std::string>& metadata = {},
                                  const std::string& what = "<memory>");
// Hugging Face sharded layout: dir/<base>.safetensors when the payload fits in max_shard_bytes, else
// <base>-0000k-of-0000n.safetensors (tensors in order, a shard closed before it would pass max_shard_bytes; a
// bigger tensor gets a shard alone) plus <base>.safetensors.index.json ({"metadata": {"total_size"},
// "weight_map"}), which CheckpointReader reads. Each file is written atomically and streamed (views are
// converted piece by piece), so memory beyond the caller's tensors stays at a few MiB. Throws ds::Error.
void write_safetensors_sharded(const std::string& dir, const std::string& base, const std::vector<SaveTensor>& tensors,
                               int64_t max_shard_bytes, const std::map<std::string, std::string>& metadata = {});

// A Hugging Face checkpoint directory: either model.safetensors, or model.safetensors.index.json
// ({"weight_map": {name: shard file}}) with its shards (both in one directory: ds::Error, as ambiguous). Also accepts a path to a
// single .safetensors file or to a *.index.json file. Shard names must be relative paths without "..";
// each shard is opened once. Only the names in the weight map are exposed (extra tensors in shards ignored).
// Missing shards, names mapped to shards that lack them, and bad index JSON are ds::Errors naming the file.
class CheckpointReader {
 public:
  explicit CheckpointReader(const std::string& path);
  const std::string& path() const { return path_; }         // as given to the constructor
  std::vector<std::string> names() const;                   // all tensor names, sorted
  bool has(const std::string& name) const;
  const TensorInfo& info(const std::string& name) const;    // throws if absent
  std::vector<float> read_f32(const std::string& name) const;    // float dtypes only (see SafetensorsReader)
  std::vector<int64_t> read_i64(const std::string& name) const;  // integer dtypes only (see SafetensorsReader)
  std::string copy_bytes(const std::string& name) const;         // the payload, copied (see SafetensorsReader)

 private:
  std::string path_;
  std::vector<std::unique_ptr<SafetensorsReader>> shards_;
  std::map<std::string, size_t> where_;  // tensor name -> shard index
};

}  // namespace ds
