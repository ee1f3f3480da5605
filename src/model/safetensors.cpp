// Safetensors reader/writer and Hugging Face checkpoint directories. See safetensors.h for the format and the
// validation rules. Every check happens in SafetensorsReader::parse() before any tensor byte is touched, so
// the read_* accessors only ever index inside the validated [begin, end) ranges.
#include "model/safetensors.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <mutex>
#include <nlohmann/json.hpp>
#include <set>
#include <string_view>
#include <utility>

#include "core/bf16.h"
#include "core/error.h"
#include "core/files.h"
#include "model/config.h"

static_assert(std::endian::native == std::endian::little, "safetensors I/O assumes a little-endian host");

namespace ds {

namespace {

using json = nlohmann::json;

constexpr uint64_t kMaxHeaderBytes = 100'000'000;  // same limit as the reference implementation
constexpr int kMaxJsonDepth = 16;                  // a valid header nests 3 deep (object, entry, shape)
constexpr const char* kMetadataKey = "__metadata__";

struct DTypeName {
  DType type;
  const char* name;
  size_t size;
};
constexpr DTypeName kDTypes[] = {
    {DType::F64, "F64", 8}, {DType::F32, "F32", 4}, {DType::F16, "F16", 2}, {DType::BF16, "BF16", 2},
    {DType::I64, "I64", 8}, {DType::I32, "I32", 4}, {DType::I16, "I16", 2}, {DType::I8, "I8", 1},
    {DType::U8, "U8", 1},   {DType::BOOL, "BOOL", 1},
};

bool parse_dtype(const std::string& s, DType* out) {
  for (const auto& d : kDTypes) {
    if (s == d.name) {
      *out = d.type;
      return true;
    }
  }
  return false;
}

bool is_integer_dtype(DType t) {
  return t == DType::I64 || t == DType::I32 || t == DType::I16 || t == DType::I8 || t == DType::U8 ||
         t == DType::BOOL;
}

// Product of non-negative dims; false on overflow of int64. Any zero dim gives 0 (no overflow possible).
bool checked_numel(const std::vector<int64_t>& shape, int64_t* out) {
  for (int64_t d : shape) {
    if (d == 0) {
      *out = 0;
      return true;
    }
  }
  int64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0 || __builtin_mul_overflow(n, d, &n)) return false;
  }
  *out = n;
  return true;
}

std::string shape_str(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

// JSON parse that also rejects duplicate keys (at any level) and nesting deeper than kMaxJsonDepth. `what`
// names the file and the part being parsed in error messages.
json parse_json_strict(std::string_view text, const std::string& what) {
  std::vector<std::set<std::string>> keys;  // one set per open object
  int depth = 0;
  json::parser_callback_t cb = [&](int, json::parse_event_t ev, json& parsed) -> bool {
    switch (ev) {
      case json::parse_event_t::object_start:
      case json::parse_event_t::array_start:
        if (++depth > kMaxJsonDepth) fail("{}: JSON nested deeper than {} levels", what, kMaxJsonDepth);
        if (ev == json::parse_event_t::object_start) keys.emplace_back();
        break;
      case json::parse_event_t::object_end:
        --depth;
        if (!keys.empty()) keys.pop_back();
        break;
      case json::parse_event_t::array_end:
        --depth;
        break;
      case json::parse_event_t::key:
        if (!keys.empty() && parsed.is_string() && !keys.back().insert(parsed.get<std::string>()).second)
          fail("{}: duplicate JSON key '{}'", what, parsed.get<std::string>());
        break;
      default:
        break;
    }
    return true;
  };
  try {
    return json::parse(text.begin(), text.end(), cb);
  } catch (const json::exception& e) {
    fail("{}: not valid JSON ({})", what, e.what());
  }
}

// A JSON value as a non-negative integer (int64 range when `max_int64`). False for floats, negatives, etc.
bool json_nonneg_int(const json& v, uint64_t* out, bool max_int64) {
  if (v.is_number_unsigned()) {
    *out = v.get<uint64_t>();
  } else if (v.is_number_integer()) {
    int64_t s = v.get<int64_t>();
    if (s < 0) return false;
    *out = static_cast<uint64_t>(s);
  } else {
    return false;
  }
  return !max_int64 || *out <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
}

std::string json_quote(const std::string& s, const std::string& what) {
  try {
    return json(s).dump(-1, ' ', false, json::error_handler_t::strict);
  } catch (const json::exception& e) {
    fail("{}: cannot encode '{}' as JSON ({})", what, s, e.what());
  }
}

template <class T>
T load(const char* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

// Element i of src (dtype t) as Out.
template <class Out>
Out element(DType t, const char* src, int64_t i) {
  switch (t) {
    case DType::F64: return static_cast<Out>(load<double>(src + 8 * i));
    case DType::F32: return static_cast<Out>(load<float>(src + 4 * i));
    case DType::F16: return static_cast<Out>(f16_bits_to_f32(load<uint16_t>(src + 2 * i)));
    case DType::BF16: return static_cast<Out>(bf16_bits_to_f32(load<uint16_t>(src + 2 * i)));
    case DType::I64: return static_cast<Out>(load<int64_t>(src + 8 * i));
    case DType::I32: return static_cast<Out>(load<int32_t>(src + 4 * i));
    case DType::I16: return static_cast<Out>(load<int16_t>(src + 2 * i));
    case DType::I8: return static_cast<Out>(load<int8_t>(src + i));
    case DType::U8: return static_cast<Out>(load<uint8_t>(src + i));
    case DType::BOOL: return static_cast<Out>(load<uint8_t>(src + i) != 0 ? 1 : 0);
  }
  return Out{};
}

template <class Out, DType T>
void convert_as(const char* src, int64_t n, Out* dst) {
  // Each element on its own: the same values for any thread count (a 27B checkpoint's tensors run to 1.3G elements).
#pragma omp parallel for schedule(static) if (n >= (int64_t{1} << 20))
  for (int64_t i = 0; i < n; ++i) dst[i] = element<Out>(T, src, i);
}

// Converts the n elements at src (dtype t) to Out. Caller guarantees src holds n * dtype_size(t) bytes.
template <class Out>
void convert(DType t, const char* src, size_t count, Out* dst) {
  const int64_t n = static_cast<int64_t>(count);
  switch (t) {
    case DType::F64: return convert_as<Out, DType::F64>(src, n, dst);
    case DType::F32: return convert_as<Out, DType::F32>(src, n, dst);
    case DType::F16: return convert_as<Out, DType::F16>(src, n, dst);
    case DType::BF16: return convert_as<Out, DType::BF16>(src, n, dst);
    case DType::I64: return convert_as<Out, DType::I64>(src, n, dst);
    case DType::I32: return convert_as<Out, DType::I32>(src, n, dst);
    case DType::I16: return convert_as<Out, DType::I16>(src, n, dst);
    case DType::I8: return convert_as<Out, DType::I8>(src, n, dst);
    case DType::U8: return convert_as<Out, DType::U8>(src, n, dst);
    case DType::BOOL: return convert_as<Out, DType::BOOL>(src, n, dst);
  }
}

}  // namespace

bool is_float_dtype(DType t) { return t == DType::F64 || t == DType::F32 || t == DType::F16 || t == DType::BF16; }

const char* dtype_name(DType t) {
  for (const auto& d : kDTypes)
    if (d.type == t) return d.name;
  return "?";
}

size_t dtype_size(DType t) {
  for (const auto& d : kDTypes)
    if (d.type == t) return d.size;
  fail("invalid DType value {}", static_cast<int>(t));
}

int64_t TensorInfo::numel() const {
  int64_t n = 0;
  if (!checked_numel(shape, &n)) fail("tensor '{}': shape {} is negative or overflows", name, shape_str(shape));
  return n;
}

// ---------------------------------------------------------------------------------------------------------
// Reader

// The file's header is read now; tensor payloads are read from the file when asked for (read_f32 / raw_bytes),
// so opening a checkpoint costs its headers, not its size.
SafetensorsReader::SafetensorsReader(const std::string& path) : path_(path), lazy_(true) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) fail("{}: is a directory, expected a file", path);
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("{}: cannot open ({})", path, std::strerror(errno));
  in.seekg(0, std::ios::end);
  const std::streamoff end = in.tellg();
  if (end < 0) fail("{}: cannot determine the file size", path);
  file_size_ = static_cast<uint64_t>(end);
  in.seekg(0);
  bytes_.resize(static_cast<size_t>(std::min<uint64_t>(file_size_, 8)));
  in.read(bytes_.data(), static_cast<std::streamsize>(bytes_.size()));
  if (!in) fail("{}: read error", path);
  if (file_size_ >= 8) {
    uint64_t n = 0;
    for (int i = 0; i < 8; ++i) n |= static_cast<uint64_t>(static_cast<uint8_t>(bytes_[i])) << (8 * i);
    if (n <= kMaxHeaderBytes && n <= file_size_ - 8) {  // else parse() names the problem
      bytes_.resize(static_cast<size_t>(8 + n));
      in.read(bytes_.data() + 8, static_cast<std::streamsize>(n));
      if (!in) fail("{}: read error", path);
    }
  }
  parse();
}

SafetensorsReader SafetensorsReader::from_bytes(std::string bytes, std::string name) {
  SafetensorsReader r;
  r.path_ = std::move(name);
  r.bytes_ = std::move(bytes);
  r.file_size_ = r.bytes_.size();
  r.parse();
  return r;
}

const char* SafetensorsReader::payload(const TensorInfo& t, std::string* buffer) const {
  if (!lazy_) return bytes_.data() + data_start_ + t.begin;
  std::ifstream in(path_, std::ios::binary);
  if (!in) fail("{}: cannot open ({})", path_, std::strerror(errno));
  buffer->resize(static_cast<size_t>(t.end - t.begin));
  in.seekg(static_cast<std::streamoff>(data_start_ + t.begin));
  in.read(buffer->data(), static_cast<std::streamsize>(buffer->size()));
  if (!in) fail("{}: tensor '{}': read error (the file changed or is truncated?)", path_, t.name);
  return buffer->data();
}

void SafetensorsReader::parse() {
  const std::string& p = path_;
  const uint64_t size = file_size_;
  if (size < 8) fail("{}: file is {} bytes, too short for the 8-byte header length", p, size);
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= static_cast<uint64_t>(static_cast<uint8_t>(bytes_[i])) << (8 * i);
  if (n > kMaxHeaderBytes) fail("{}: header length {} exceeds the limit of {} bytes", p, n, kMaxHeaderBytes);
  if (n > size - 8)
    fail("{}: header length {} is larger than the {} bytes that follow it (truncated file?)", p, n, size - 8);
  data_start_ = static_cast<size_t>(8 + n);
  const uint64_t data_size = size - data_start_;

  const json h = parse_json_strict(std::string_view(bytes_.data() + 8, n), p + ": header");
  if (!h.is_object()) fail("{}: header is not a JSON object", p);

  tensors_.clear();
  index_.clear();
  metadata_.clear();
  for (const auto& [key, val] : h.items()) {
    if (key == kMetadataKey) {
      if (!val.is_object()) fail("{}: \"__metadata__\" is not a JSON object", p);
      for (const auto& [mk, mv] : val.items()) {
        if (!mv.is_string()) fail("{}: \"__metadata__\" field '{}' is not a string", p, mk);
        metadata_[mk] = mv.get<std::string>();
      }
      continue;
    }
    TensorInfo t;
    t.name = key;
    if (!val.is_object()) fail("{}: tensor '{}': entry is not a JSON object", p, key);

    auto it = val.find("dtype");
    if (it == val.end()) fail("{}: tensor '{}': missing \"dtype\"", p, key);
    if (!it->is_string()) fail("{}: tensor '{}': \"dtype\" is not a string", p, key);
    if (!parse_dtype(it->get<std::string>(), &t.dtype))
      fail("{}: tensor '{}': unknown dtype '{}'", p, key, it->get<std::string>());

    it = val.find("shape");
    if (it == val.end()) fail("{}: tensor '{}': missing \"shape\"", p, key);
    if (!it->is_array()) fail("{}: tensor '{}': \"shape\" is not an array", p, key);
    for (const auto& d : *it) {
      uint64_t v = 0;
      if (!json_nonneg_int(d, &v, true))
        fail("{}: tensor '{}': shape entry {} is not a non-negative integer", p, key, d.dump());
      t.shape.push_back(static_cast<int64_t>(v));
    }
    int64_t numel = 0;
    if (!checked_numel(t.shape, &numel))
      fail("{}: tensor '{}': shape {} has too many elements", p, key, shape_str(t.shape));

    it = val.find("data_offsets");
    if (it == val.end()) fail("{}: tensor '{}': missing \"data_offsets\"", p, key);
    if (!it->is_array() || it->size() != 2)
      fail("{}: tensor '{}': \"data_offsets\" is not an array of two integers", p, key);
    if (!json_nonneg_int((*it)[0], &t.begin, false) || !json_nonneg_int((*it)[1], &t.end, false))
      fail("{}: tensor '{}': \"data_offsets\" {} are not non-negative integers", p, key, it->dump());
    if (t.end < t.begin) fail("{}: tensor '{}': data_offsets end {} < begin {}", p, key, t.end, t.begin);
    if (t.end > data_size)
      fail("{}: tensor '{}': data_offsets [{}, {}] out of range (data buffer is {} bytes)", p, key, t.begin, t.end,
           data_size);
    uint64_t nbytes = 0;
    if (__builtin_mul_overflow(static_cast<uint64_t>(numel), static_cast<uint64_t>(dtype_size(t.dtype)), &nbytes) ||
        nbytes != t.end - t.begin)
      fail("{}: tensor '{}': {} bytes at data_offsets [{}, {}], but shape {} x {} needs {} x {} bytes", p, key,
           t.end - t.begin, t.begin, t.end, shape_str(t.shape), dtype_name(t.dtype), numel, dtype_size(t.dtype));
    index_[key] = tensors_.size();  // keys are unique: parse_json_strict rejects duplicates
    tensors_.push_back(std::move(t));
  }

  // Overlaps: sort non-empty ranges by begin; each must start at or after the furthest end seen so far.
  std::vector<const TensorInfo*> order;
  for (const auto& t : tensors_)
    if (t.end > t.begin) order.push_back(&t);
  std::sort(order.begin(), order.end(), [](const TensorInfo* a, const TensorInfo* b) {
    return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
  });
  const TensorInfo* prev = nullptr;
  for (const TensorInfo* t : order) {
    if (prev && t->begin < prev->end)
      fail("{}: tensors '{}' [{}, {}] and '{}' [{}, {}] overlap", p, prev->name, prev->begin, prev->end, t->name,
           t->begin, t->end);
    // The format's rule (the safetensors library's own check): the tensors tile the data buffer, no byte unclaimed.
    const uint64_t expect = prev ? prev->end : 0;
    if (t->begin != expect)
      fail("{}: tensor '{}' starts at byte {} of the data buffer, but the bytes before it end at {}: a gap no tensor "
           "claims (a damaged or hand-made file)", p, t->name, t->begin, expect);
    if (!prev || t->end > prev->end) prev = t;
  }
  const uint64_t used = prev ? prev->end : 0;
  if (used != data_size)
    fail("{}: the tensors claim {} bytes of the {}-byte data buffer: {} trailing bytes no tensor claims (a damaged "
         "or concatenated file)", p, used, data_size, data_size - used);
}

const TensorInfo* SafetensorsReader::find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

const TensorInfo& SafetensorsReader::get(const std::string& name) const {
  const TensorInfo* t = find(name);
  if (!t) fail("{}: no tensor named '{}'", path_, name);
  return *t;
}

std::string SafetensorsReader::copy_bytes(const std::string& name) const {
  const TensorInfo& t = get(name);
  std::string buf;
  const char* p = payload(t, &buf);
  if (p != buf.data()) buf.assign(p, t.end - t.begin);  // an in-memory image: copy the bytes out
  return buf;
}

std::string_view SafetensorsReader::raw_bytes(const std::string& name) const {
  const TensorInfo& t = get(name);
  if (!lazy_) return std::string_view(bytes_.data() + data_start_ + t.begin, t.end - t.begin);
  std::lock_guard<std::mutex> lk(*raw_mu_);
  auto it = raw_.find(name);
  if (it == raw_.end()) {
    std::string buf;
    payload(t, &buf);
    it = raw_.emplace(name, std::move(buf)).first;
  }
  return it->second;
}

const TensorInfo& SafetensorsReader::get_float(const std::string& name) const {
  const TensorInfo& t = get(name);
  if (!is_float_dtype(t.dtype))
    fail("{}: tensor '{}' has dtype {}, expected a float dtype (F64, F32, F16 or BF16)", path_, name,
         dtype_name(t.dtype));
  return t;
}

std::vector<float> SafetensorsReader::read_f32(const std::string& name) const {
  const TensorInfo& t = get_float(name);
  const size_t n = (t.end - t.begin) / dtype_size(t.dtype);
  std::vector<float> out(n);
  std::string buf;
  convert(t.dtype, payload(t, &buf), n, out.data());
  return out;
}

std::vector<double> SafetensorsReader::read_f64(const std::string& name) const {
  const TensorInfo& t = get_float(name);
  const size_t n = (t.end - t.begin) / dtype_size(t.dtype);
  std::vector<double> out(n);
  std::string buf;
  convert(t.dtype, payload(t, &buf), n, out.data());
  return out;
}

std::vector<int64_t> SafetensorsReader::read_i64(const std::string& name) const {
  const TensorInfo& t = get(name);
  if (!is_integer_dtype(t.dtype))
    fail("{}: tensor '{}' has dtype {}, expected an integer dtype", path_, name, dtype_name(t.dtype));
  const size_t n = (t.end - t.begin) / dtype_size(t.dtype);
  std::vector<int64_t> out(n);
  std::string buf;
  convert(t.dtype, payload(t, &buf), n, out.data());
  return out;
}

// ---------------------------------------------------------------------------------------------------------
// Writer

static void check_shape_for_write(const std::string& name, const std::vector<int64_t>& shape, int64_t* numel) {
  for (int64_t d : shape)
    if (d < 0) fail("tensor '{}': negative dimension in shape {}", name, shape_str(shape));
  if (!checked_numel(shape, numel)) fail("tensor '{}': shape {} has too many elements", name, shape_str(shape));
}

SaveTensor make_tensor_f32(const std::string& name, std::vector<int64_t> shape, const float* values, DType as) {
  int64_t n = 0;
  check_shape_for_write(name, shape, &n);
  if (n > 0 && !values) fail("tensor '{}': null values for {} elements", name, n);
  SaveTensor t;
  t.name = name;
  t.dtype = as;
  t.shape = std::move(shape);
  if (as == DType::F32) {
    t.bytes.resize(static_cast<size_t>(n) * 4);
    if (n > 0) std::memcpy(t.bytes.data(), values, t.bytes.size());
  } else if (as == DType::BF16) {
    t.bytes.resize(static_cast<size_t>(n) * 2);
    for (int64_t i = 0; i < n; ++i) {
      uint16_t b = f32_to_bf16_bits(values[i]);
      std::memcpy(t.bytes.data() + 2 * i, &b, 2);
    }
  } else {
    fail("tensor '{}': cannot store fp32 values as {} (only F32 and BF16)", name, dtype_name(as));
  }
  return t;
}

namespace {
// A tensor entry whose values come later (a view or a reader); `has_source`: the caller has them.
SaveTensor later_entry(const std::string& name, std::vector<int64_t> shape, bool has_source, DType as, int64_t* numel) {
  check_shape_for_write(name, shape, numel);
  if (*numel > 0 && !has_source) fail("tensor '{}': no values for {} elements", name, *numel);
  SaveTensor t;
  t.name = name;
  t.dtype = as;
  t.shape = std::move(shape);
  return t;
}
// The same for fp32 values, stored F32 or BF16.
SaveTensor f32_entry(const std::string& name, std::vector<int64_t> shape, bool has_source, DType as, int64_t* numel) {
  if (as != DType::F32 && as != DType::BF16)
    fail("tensor '{}': cannot store fp32 values as {} (only F32 and BF16)", name, dtype_name(as));
  return later_entry(name, std::move(shape), has_source, as, numel);
}
}  // namespace

SaveTensor make_tensor_f32_view(const std::string& name, std::vector<int64_t> shape, const float* values, DType as) {
  int64_t n = 0;
  SaveTensor t = f32_entry(name, std::move(shape), values != nullptr, as, &n);
  t.f32_source = n > 0 ? values : nullptr;
  return t;
}

SaveTensor make_tensor_f32_reader(const std::string& name, std::vector<int64_t> shape,
                                  std::function<void(int64_t, int64_t, float*)> reader, DType as) {
  int64_t n = 0;
  SaveTensor t = f32_entry(name, std::move(shape), static_cast<bool>(reader), as, &n);
  if (n > 0) t.f32_reader = std::move(reader);
  return t;
}

SaveTensor make_tensor_bytes_reader(const std::string& name, DType dtype, std::vector<int64_t> shape,
                                    std::function<void(int64_t, int64_t, uint8_t*)> reader) {
  int64_t n = 0;
  SaveTensor t = later_entry(name, std::move(shape), static_cast<bool>(reader), dtype, &n);
  if (n > 0) t.byte_reader = std::move(reader);
  return t;
}

SaveTensor make_tensor_i64(const std::string& name, std::vector<int64_t> shape, const int64_t* values) {
  int64_t n = 0;
  check_shape_for_write(name, shape, &n);
  if (n > 0 && !values) fail("tensor '{}': null values for {} elements", name, n);
  SaveTensor t;
  t.name = name;
  t.dtype = DType::I64;
  t.shape = std::move(shape);
  t.bytes.resize(static_cast<size_t>(n) * 8);
  if (n > 0) std::memcpy(t.bytes.data(), values, t.bytes.size());
  return t;
}

namespace {

// Payload bytes of a tensor: its bytes, or numel * dtype size for a view.
uint64_t payload_bytes(const SaveTensor& t, const std::string& what) {
  int64_t n = 0;
  for (int64_t d : t.shape)
    if (d < 0) fail("{}: tensor '{}': negative dimension in shape {}", what, t.name, shape_str(t.shape));
  if (!checked_numel(t.shape, &n))
    fail("{}: tensor '{}': shape {} has too many elements", what, t.name, shape_str(t.shape));
  const size_t dsize = dtype_size(t.dtype);
  uint64_t need = 0;
  if (__builtin_mul_overflow(static_cast<uint64_t>(n), dsize, &need))
    fail("{}: tensor '{}': shape {} has too many bytes", what, t.name, shape_str(t.shape));
  if (t.byte_reader) {
    if (!t.bytes.empty() || t.f32_source || t.f32_reader)
      fail("{}: tensor '{}': more than one source of values", what, t.name);
    return need;
  }
  if (t.f32_source || t.f32_reader) {
    if (!t.bytes.empty() || (t.f32_source && t.f32_reader))
      fail("{}: tensor '{}': more than one source of values", what, t.name);
    if (t.dtype != DType::F32 && t.dtype != DType::BF16)
      fail("{}: tensor '{}': cannot store fp32 values as {}", what, t.name, dtype_name(t.dtype));
    return need;
  }
  if (need != t.bytes.size())
    fail("{}: tensor '{}': {} payload bytes, but shape {} x {} needs {} x {}", what, t.name, t.bytes.size(),
         shape_str(t.shape), dtype_name(t.dtype), n, dsize);
  return need;
}

// Streams the payload of t (bytes, or its fp32 source / reader converted in pieces of 1 Mi elements) into sink.
template <typename Sink>
void emit_payload(const SaveTensor& t, uint64_t bytes, Sink&& sink) {
  constexpr uint64_t kPiece = uint64_t{1} << 20;
  if (t.byte_reader) {
    const uint64_t size = dtype_size(t.dtype), n = bytes / size;
    std::vector<uint8_t> b(static_cast<size_t>(std::min(n, kPiece) * size));
    for (uint64_t i = 0; i < n; i += kPiece) {
      const uint64_t m = std::min(kPiece, n - i);
      t.byte_reader(static_cast<int64_t>(i), static_cast<int64_t>(m), b.data());
      sink(b.data(), m * size);
    }
    return;
  }
  if (t.f32_reader) {
    const uint64_t n = bytes / (t.dtype == DType::F32 ? 4 : 2);
    std::vector<float> f(static_cast<size_t>(std::min(n, kPiece)));
    std::vector<uint16_t> h(t.dtype == DType::F32 ? 0 : f.size());
    for (uint64_t i = 0; i < n; i += kPiece) {
      const uint64_t m = std::min(kPiece, n - i);
      t.f32_reader(static_cast<int64_t>(i), static_cast<int64_t>(m), f.data());
      if (t.dtype == DType::F32) {
        sink(f.data(), m * 4);
      } else {
        to_bf16_bits(f.data(), static_cast<int64_t>(m), h.data());
        sink(h.data(), m * 2);
      }
    }
    return;
  }
  if (!t.f32_source) {
    if (!t.bytes.empty()) sink(t.bytes.data(), t.bytes.size());
    return;
  }
  if (t.dtype == DType::F32) {
    sink(t.f32_source, bytes);
    return;
  }
  const uint64_t n = bytes / 2;  // BF16
  std::vector<uint16_t> buf(static_cast<size_t>(std::min(n, kPiece)));
  for (uint64_t i = 0; i < n; i += kPiece) {
    const uint64_t m = std::min(kPiece, n - i);
    to_bf16_bits(t.f32_source + i, static_cast<int64_t>(m), buf.data());
    sink(buf.data(), m * 2);
  }
}

// The 8-byte length and the padded JSON header of a file holding `tensors`.
std::string safetensors_header(const std::vector<SaveTensor>& tensors, const std::map<std::string, std::string>& metadata,
                               const std::string& what, std::vector<uint64_t>* sizes) {
  std::set<std::string> seen;
  std::string header = "{";
  bool first = true;
  if (!metadata.empty()) {
    header += json_quote(kMetadataKey, what) + ":{";
    bool mfirst = true;
    for (const auto& [k, v] : metadata) {
      if (!mfirst) header += ',';
      mfirst = false;
      header += json_quote(k, what) + ":" + json_quote(v, what);
    }
    header += '}';
    first = false;
  }
  uint64_t offset = 0;
  for (const auto& t : tensors) {
    if (t.name.empty()) fail("{}: empty tensor name", what);
    if (t.name == kMetadataKey) fail("{}: a tensor cannot be named \"__metadata__\"", what);
    if (!seen.insert(t.name).second) fail("{}: duplicate tensor name '{}'", what, t.name);
    const uint64_t need = payload_bytes(t, what);
    sizes->push_back(need);
    if (!first) header += ',';
    first = false;
    header += json_quote(t.name, what);
    header += fmt::format(":{{\"dtype\":\"{}\",\"shape\":[", dtype_name(t.dtype));
    for (size_t i = 0; i < t.shape.size(); ++i) header += (i ? "," : "") + std::to_string(t.shape[i]);
    header += fmt::format("],\"data_offsets\":[{},{}]}}", offset, offset + need);
    offset += need;
  }
  header += '}';
  header.append((8 - header.size() % 8) % 8, ' ');
  std::string out;
  const uint64_t hlen = header.size();
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((hlen >> (8 * i)) & 0xff));
  return out + header;
}

}  // namespace

std::string serialize_safetensors(const std::vector<SaveTensor>& tensors,
                                  const std::map<std::string, std::string>& metadata, const std::string& what) {
  std::vector<uint64_t> sizes;
  std::string out = safetensors_header(tensors, metadata, what, &sizes);
  for (size_t i = 0; i < tensors.size(); ++i)
    emit_payload(tensors[i], sizes[i], [&](const void* p, uint64_t n) { out.append(static_cast<const char*>(p), n); });
  return out;
}

namespace {

// write_safetensors, its final rename checked against `expected` when given.
void write_safetensors_file(const std::string& path, const std::vector<SaveTensor>& tensors,
                            const std::map<std::string, std::string>& metadata, const FileIdentity* expected,
                            const std::string& what) {
  std::vector<uint64_t> sizes;
  const std::string header = safetensors_header(tensors, metadata, path, &sizes);
  AtomicFileWriter w(path);
  if (expected) w.replace_only(*expected, what);
  w.write(header.data(), header.size());
  for (size_t i = 0; i < tensors.size(); ++i)
    emit_payload(tensors[i], sizes[i], [&](const void* p, uint64_t n) { w.write(p, n); });
  w.commit();
}

}  // namespace

void write_safetensors(const std::string& path, const std::vector<SaveTensor>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  write_safetensors_file(path, tensors, metadata, nullptr, "");
}

void write_safetensors(const std::string& path, const std::vector<SaveTensor>& tensors,
                       const std::map<std::string, std::string>& metadata, const FileIdentity& expected,
                       const std::string& what) {
  write_safetensors_file(path, tensors, metadata, &expected, what);
}

void write_safetensors_sharded(const std::string& dir, const std::string& base, const std::vector<SaveTensor>& tensors,
                               int64_t max_shard_bytes, const std::map<std::string, std::string>& metadata) {
  namespace fs = std::filesystem;
  DS_CHECK(max_shard_bytes > 0, "{}: max_shard_bytes must be positive", (fs::path(dir) / base).string());
  std::vector<std::vector<size_t>> shards(1);
  uint64_t cur = 0, total = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const uint64_t bytes = payload_bytes(tensors[i], (fs::path(dir) / base).string());
    if (!shards.back().empty() && cur + bytes > static_cast<uint64_t>(max_shard_bytes)) {
      shards.emplace_back();
      cur = 0;
    }
    shards.back().push_back(i);
    cur += bytes;
    total += bytes;
  }
  // Views stay views; an owned payload is copied once, for its shard's write.
  auto pick = [&](const std::vector<size_t>& idx) {
    std::vector<SaveTensor> t;
    t.reserve(idx.size());
    for (size_t i : idx) t.push_back(tensors[i]);
    return t;
  };
  if (shards.size() == 1) {
    write_safetensors((fs::path(dir) / (base + ".safetensors")).string(), tensors, metadata);
    return;
  }
  json weight_map = json::object();
  for (size_t k = 0; k < shards.size(); ++k) {
    const std::string file = fmt::format("{}-{:05d}-of-{:05d}.safetensors", base, k + 1, shards.size());
    write_safetensors((fs::path(dir) / file).string(), pick(shards[k]), metadata);
    for (size_t i : shards[k]) weight_map[tensors[i].name] = file;
  }
  json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
  write_file_atomic((fs::path(dir) / (base + ".safetensors.index.json")).string(), index.dump(2) + "\n");
}

// ---------------------------------------------------------------------------------------------------------
// Checkpoint directories

CheckpointReader::CheckpointReader(const std::string& path) : path_(path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  if (ec || !fs::exists(st)) fail("{}: checkpoint path does not exist", path);

  std::string index_path, single_path;
  if (fs::is_directory(st)) {
    const fs::path idx = fs::path(path) / "model.safetensors.index.json";
    const fs::path one = fs::path(path) / "model.safetensors";
    const bool has_idx = fs::is_regular_file(idx, ec), has_one = fs::is_regular_file(one, ec);
    // Both: which one holds the weights is a guess (transformers loads model.safetensors first), and guessing wrong
    // loads another model's weights without a word.
    if (has_idx && has_one)
      fail("{}: holds both model.safetensors and model.safetensors.index.json, so which one is the checkpoint is "
           "ambiguous; move the stale one out of the directory", path);
    if (has_idx) {
      index_path = idx.string();
    } else if (has_one) {
      single_path = one.string();
    } else {
      check_not_adapter_dir(path);
      fail("{}: checkpoint directory has neither model.safetensors nor model.safetensors.index.json", path);
    }
  } else {
    const std::string suffix = ".index.json";
    if (path.size() >= suffix.size() && path.compare(path.size() - suffix.size(), suffix.size(), suffix) == 0)
      index_path = path;
    else
      single_path = path;
  }

  if (!single_path.empty()) {
    shards_.push_back(std::make_unique<SafetensorsReader>(single_path));
    for (const auto& t : shards_[0]->tensors()) where_[t.name] = 0;
    return;
  }

  const json idx = parse_json_strict(read_file(index_path), index_path);
  if (!idx.is_object()) fail("{}: index is not a JSON object", index_path);
  auto wm = idx.find("weight_map");
  if (wm == idx.end()) fail("{}: missing \"weight_map\"", index_path);
  if (!wm->is_object()) fail("{}: \"weight_map\" is not a JSON object", index_path);
  if (wm->empty()) fail("{}: \"weight_map\" is empty", index_path);

  const fs::path dir = fs::path(index_path).parent_path();
  std::map<std::string, size_t> shard_ids;  // shard file name -> index in shards_
  for (const auto& [name, file] : wm->items()) {
    if (!file.is_string()) fail("{}: weight_map entry for '{}' is not a string", index_path, name);
    const std::string shard = file.get<std::string>();
    auto sit = shard_ids.find(shard);
    if (sit == shard_ids.end()) {
      const fs::path rel(shard);
      bool bad = shard.empty() || rel.is_absolute();
      for (const auto& part : rel) bad = bad || part == "..";
      if (bad) fail("{}: tensor '{}' maps to invalid shard name '{}' (must be relative, no '..')", index_path, name,
                    shard);
      const std::string shard_path = (dir / rel).string();
      if (!fs::is_regular_file(shard_path, ec))
        fail("{}: shard '{}' (holding tensor '{}') not found at {}", index_path, shard, name, shard_path);
      shards_.push_back(std::make_unique<SafetensorsReader>(shard_path));
      sit = shard_ids.emplace(shard, shards_.size() - 1).first;
    }
    const SafetensorsReader& r = *shards_[sit->second];
    if (!r.has(name))
      fail("{}: tensor '{}' is mapped to shard {}, which does not contain it", index_path, name, r.path());
    where_[name] = sit->second;
  }
}

std::vector<std::string> CheckpointReader::names() const {
  std::vector<std::string> out;
  out.reserve(where_.size());
  for (const auto& [name, shard] : where_) out.push_back(name);
  return out;  // std::map iteration order: sorted
}

bool CheckpointReader::has(const std::string& name) const { return where_.count(name) != 0; }

const TensorInfo& CheckpointReader::info(const std::string& name) const {
  auto it = where_.find(name);
  if (it == where_.end()) fail("{}: checkpoint has no tensor named '{}'", path_, name);
  return *shards_[it->second]->find(name);
}

std::vector<float> CheckpointReader::read_f32(const std::string& name) const {
  auto it = where_.find(name);
  if (it == where_.end()) fail("{}: checkpoint has no tensor named '{}'", path_, name);
  return shards_[it->second]->read_f32(name);
}

std::vector<int64_t> CheckpointReader::read_i64(const std::string& name) const {
  auto it = where_.find(name);
  if (it == where_.end()) fail("{}: checkpoint has no tensor named '{}'", path_, name);
  return shards_[it->second]->read_i64(name);
}

std::string CheckpointReader::copy_bytes(const std::string& name) const {
  auto it = where_.find(name);
  if (it == where_.end()) fail("{}: checkpoint has no tensor named '{}'", path_, name);
  return shards_[it->second]->copy_bytes(name);
}

}  // namespace ds
