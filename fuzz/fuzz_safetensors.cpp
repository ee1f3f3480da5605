// libFuzzer target for the safetensors reader (see fuzz/README.md for the build command).
// Each input is parsed in memory with SafetensorsReader::from_bytes. Rejection must be a ds::Error, never a
// crash, sanitizer report or other exception. Accepted inputs must be self-consistent: every tensor readable
// through the accessors of its kind (integer or float) with numel() values, refused by the others, and serialize -> parse must reproduce names, dtypes, shapes,
// payload bytes and metadata exactly.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "core/error.h"
#include "model/safetensors.h"

namespace {

[[noreturn]] void bug(const char* what) {
  std::fprintf(stderr, "fuzz_safetensors invariant violated: %s\n", what);
  std::abort();
}

bool is_int(ds::DType t) {
  return t == ds::DType::I64 || t == ds::DType::I32 || t == ds::DType::I16 || t == ds::DType::I8 ||
         t == ds::DType::U8 || t == ds::DType::BOOL;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string bytes(reinterpret_cast<const char*>(data), size);
  try {
    auto r = ds::SafetensorsReader::from_bytes(std::move(bytes), "fuzz-input");
    std::vector<ds::SaveTensor> again;
    bool serializable = true;
    for (const auto& t : r.tensors()) {
      if (r.find(t.name) != &t) bug("find() does not return the listed tensor");
      const auto n = static_cast<size_t>(t.numel());
      const std::string_view raw = r.raw_bytes(t.name);
      if (raw.size() != t.end - t.begin || raw.size() != n * ds::dtype_size(t.dtype)) bug("raw size");
      // Each dtype is readable through its own accessors only: ints through read_i64, floats through read_f32
      // and read_f64; the others must refuse with a ds::Error.
      const bool i = is_int(t.dtype);
      if ((i ? r.read_i64(t.name).size() : r.read_f32(t.name).size()) != n) bug("read size");
      if (!i && r.read_f64(t.name).size() != n) bug("read_f64 size");
      const auto refuses = [&](auto read) {
        try {
          read();
          return false;
        } catch (const ds::Error&) {
          return true;
        }
      };
      if (i && (!refuses([&] { r.read_f32(t.name); }) || !refuses([&] { r.read_f64(t.name); })))
        bug("read_f32 / read_f64 accepted an integer dtype");
      if (!i && !refuses([&] { r.read_i64(t.name); })) bug("read_i64 accepted a float dtype");
      if (t.name.empty()) serializable = false;  // the writer rejects empty names; the reader tolerates them
      ds::SaveTensor s;
      s.name = t.name;
      s.dtype = t.dtype;
      s.shape = t.shape;
      s.bytes.assign(raw.begin(), raw.end());
      again.push_back(std::move(s));
    }
    if (serializable) {
      const std::string image = ds::serialize_safetensors(again, r.metadata(), "fuzz-output");
      auto r2 = ds::SafetensorsReader::from_bytes(image, "fuzz-output");
      if (r2.metadata() != r.metadata()) bug("metadata round trip");
      if (r2.tensors().size() != r.tensors().size()) bug("tensor count round trip");
      for (const auto& t : r.tensors()) {
        const ds::TensorInfo* u = r2.find(t.name);
        if (!u || u->dtype != t.dtype || u->shape != t.shape) bug("tensor info round trip");
        if (r2.raw_bytes(t.name) != r.raw_bytes(t.name)) bug("payload round trip");
      }
    }
  } catch (const ds::Error&) {
    // Rejected input: expected.
  }
  return 0;
}
