// Safetensors reader/writer (https://github.com/huggingface/safetensors format: 8-byte little-endian header
// length, JSON header {name: {dtype, shape, data_offsets:[begin,end]}, "__metadata__": {str: str}}, then the
// byte buffer). The reader validates everything before use: header length within the file, JSON well-formed,
// known dtypes, shape product * dtype size == end - begin, offsets inside the buffer, no overlaps; any violation
// throws ds::Error naming the file and the tensor or field.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace ds {

enum class DType { F64, F32, F16, BF16, I64, I32, I16, I8, U8, BOOL };
const char* dtype_name(DType t);        // "F32", "BF16", ...
size_t dtype_size(DType t);             // bytes per element

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

  const std::string& path() const { return path_; }
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  const TensorInfo* find(const std::string& name) const;  // null if absent
  bool has(const std::string& name) const { return find(name) != nullptr; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

  // Values converted to fp32 / fp64 (from F64, F32, F16, BF16, or integer types). Throws if `name` is absent.
  std::vector<float> read_f32(const std::string& name) const;
  std::vector<double> read_f64(const std::string& name) const;
  // Integer values (from I64, I32, I16, I8, U8, BOOL). Throws for float dtypes or if absent.
  std::vector<int64_t> read_i64(const std::string& name) const;

 private:
  std::string path_;
  std::string bytes_;  // whole file
  size_t data_start_ = 0;
  std::vector<TensorInfo> tensors_;
  std::map<std::string, size_t> index_;
  std::map<std::string, std::string> metadata_;
  const TensorInfo& get(const std::string& name) const;
};

// One tensor to write. Build with the helpers below; bytes holds the little-endian payload.
struct SaveTensor {
  std::string name;
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;
};
// fp32 values stored as `as` (F32, BF16 with round-to-nearest-even, F16 not supported -> ds::Error).
SaveTensor make_tensor_f32(const std::string& name, std::vector<int64_t> shape, const float* values,
                           DType as = DType::F32);
SaveTensor make_tensor_i64(const std::string& name, std::vector<int64_t> shape, const int64_t* values);

// Writes a safetensors file atomically (temp file, fsync, rename). Tensors are laid out in the given order,
// names must be unique (ds::Error otherwise).
void write_safetensors(const std::string& path, const std::vector<SaveTensor>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

// A Hugging Face checkpoint directory: either model.safetensors, or model.safetensors.index.json
// ({"weight_map": {name: shard file}}) with its shards. Also accepts a path to a single .safetensors file.
// Missing shards, names mapped to shards that lack them, and bad index JSON are ds::Errors naming the file.
class CheckpointReader {
 public:
  explicit CheckpointReader(const std::string& path);
  std::vector<std::string> names() const;                   // all tensor names, sorted
  bool has(const std::string& name) const;
  const TensorInfo& info(const std::string& name) const;    // throws if absent
  std::vector<float> read_f32(const std::string& name) const;

 private:
  std::vector<std::unique_ptr<SafetensorsReader>> shards_;
  std::map<std::string, size_t> where_;  // tensor name -> shard index
};

}  // namespace ds
