// Safetensors reader/writer and checkpoint directories: round trips, the HF fixtures (fp32 state dict, int64
// inputs, the sharded bf16/fp32 release layout), and corrupt/hostile files that must raise ds::Error naming
// the file.
#include <gtest/gtest.h>
#include <unistd.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/bf16.h"
#include "core/error.h"
#include "core/files.h"
#include "model/safetensors.h"
#include "test_util.h"

namespace fs = std::filesystem;
using ds::test::fixture;

namespace {

// A fresh scratch directory per test, removed afterwards.
class SafetensorsTmp : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::temp_directory_path() /
           ("deltastack_st_" + std::to_string(::getpid()) + "_" + info->test_suite_name() + "_" + info->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }
  // Writes raw bytes to dir/name and returns the path.
  std::string put(const std::string& name, const std::string& bytes) const {
    std::string p = path(name);
    std::ofstream(p, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    return p;
  }
  fs::path dir_;
};

std::string le64(uint64_t v) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>((v >> (8 * i)) & 0xff);
  return s;
}
// A safetensors image: length prefix + header text + `data_bytes` zero bytes.
std::string image(const std::string& header, size_t data_bytes) {
  return le64(header.size()) + header + std::string(data_bytes, '\0');
}

// Runs f, expects a ds::Error whose message contains every string in `needles`.
void expect_error(const std::function<void()>& f, const std::vector<std::string>& needles) {
  try {
    f();
    ADD_FAILURE() << "expected ds::Error mentioning " << needles.at(0);
  } catch (const ds::Error& e) {
    const std::string msg = e.what();
    for (const auto& n : needles) EXPECT_NE(msg.find(n), std::string::npos) << "message: " << msg << "\nlacks: " << n;
  }
}

// Opens `path` as safetensors and expects failure mentioning the path and `what`.
void expect_bad_file(const std::string& path, const std::string& what) {
  expect_error([&] { ds::SafetensorsReader r(path); }, {path, what});
}

uint32_t bits(float f) { return std::bit_cast<uint32_t>(f); }

}  // namespace

// ---------------------------------------------------------------------------------------------------------
// Round trips

TEST_F(SafetensorsTmp, RoundTripF32Bf16I64Metadata) {
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<float> f32 = {0.f, -0.f, 1.5f, -3.25e-3f, 1e-40f /* subnormal */, inf, -inf, 123456.789f};
  std::vector<float> bf = {1.00390625f, 1.01171875f, 1.0f, -2.5f, 3.0e38f, 1e-3f};
  std::vector<int64_t> i64 = {0, -1, 42, std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::max(),
                              7};
  std::vector<ds::SaveTensor> ts;
  ts.push_back(ds::make_tensor_f32("a.f32", {2, 4}, f32.data()));
  ts.push_back(ds::make_tensor_f32("b.bf16", {6}, bf.data(), ds::DType::BF16));
  ts.push_back(ds::make_tensor_i64("c.i64", {3, 2}, i64.data()));
  float scalar = 7.f;
  ts.push_back(ds::make_tensor_f32("d.scalar", {}, &scalar));
  ts.push_back(ds::make_tensor_f32("e.empty", {0, 3}, nullptr));
  std::map<std::string, std::string> meta = {{"format", "pt"}, {"step", "12"}, {"note", "ünïcødé \"q\""}};
  const std::string p = path("rt.safetensors");
  ds::write_safetensors(p, ts, meta);

  ds::SafetensorsReader r(p);
  EXPECT_EQ(r.path(), p);
  EXPECT_EQ(r.metadata(), meta);
  ASSERT_EQ(r.tensors().size(), 5u);

  const ds::TensorInfo* a = r.find("a.f32");
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->dtype, ds::DType::F32);
  EXPECT_EQ(a->shape, (std::vector<int64_t>{2, 4}));
  EXPECT_EQ(a->numel(), 8);
  auto fa = r.read_f32("a.f32");
  ASSERT_EQ(fa.size(), f32.size());
  for (size_t i = 0; i < f32.size(); ++i) EXPECT_EQ(bits(fa[i]), bits(f32[i])) << i;  // bit-exact, incl. -0
  auto da = r.read_f64("a.f32");
  for (size_t i = 0; i < f32.size(); ++i) EXPECT_EQ(da[i], static_cast<double>(f32[i]));

  const ds::TensorInfo* b = r.find("b.bf16");
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(b->dtype, ds::DType::BF16);
  EXPECT_EQ(b->end - b->begin, 12u);
  auto fb = r.read_f32("b.bf16");
  ASSERT_EQ(fb.size(), 6u);
  EXPECT_EQ(fb[0], 1.0f);       // 1 + 2^-8: tie between 1.0 (even) and 1.0078125 -> 1.0
  EXPECT_EQ(fb[1], 1.015625f);  // 1 + 3*2^-8: tie between 1.0078125 (odd) and 1.015625 (even) -> 1.015625
  EXPECT_EQ(fb[2], 1.0f);
  EXPECT_EQ(fb[3], -2.5f);
  for (size_t i = 0; i < bf.size(); ++i) EXPECT_EQ(fb[i], ds::round_bf16(bf[i])) << i;

  EXPECT_EQ(r.read_i64("c.i64"), i64);
  EXPECT_EQ(r.find("c.i64")->dtype, ds::DType::I64);
  // Integers are not float values (issue 25: a weight relabelled I32 was read as numbers).
  expect_error([&] { r.read_f32("c.i64"); }, {p, "c.i64", "I64", "expected a float dtype"});
  expect_error([&] { r.read_f64("c.i64"); }, {p, "c.i64", "I64", "expected a float dtype"});

  EXPECT_TRUE(r.find("d.scalar")->shape.empty());
  EXPECT_EQ(r.read_f32("d.scalar"), std::vector<float>{7.f});
  EXPECT_EQ(r.find("e.empty")->numel(), 0);
  EXPECT_TRUE(r.read_f32("e.empty").empty());

  // Layout: data_offsets follow the given order, contiguous from 0.
  uint64_t off = 0;
  for (const auto& t : ts) {
    const ds::TensorInfo* info = r.find(t.name);
    ASSERT_NE(info, nullptr);
    EXPECT_EQ(info->begin, off) << t.name;
    off += t.bytes.size();
    EXPECT_EQ(info->end, off) << t.name;
  }
  // Header padded with spaces to a multiple of 8; the buffer follows immediately.
  const std::string raw = ds::read_file(p);
  uint64_t hlen = 0;
  std::memcpy(&hlen, raw.data(), 8);
  EXPECT_EQ(hlen % 8, 0u);
  EXPECT_EQ(raw.size(), 8 + hlen + off);
  EXPECT_EQ(raw.substr(8, 16), "{\"__metadata__\":");

  // Absent names and float->int reads are errors naming the file.
  EXPECT_FALSE(r.has("zzz"));
  expect_error([&] { r.read_f32("zzz"); }, {p, "zzz"});
  expect_error([&] { r.read_i64("a.f32"); }, {p, "a.f32"});

  // The in-memory parser sees the same thing.
  auto m = ds::SafetensorsReader::from_bytes(raw, "mem");
  EXPECT_EQ(m.path(), "mem");
  EXPECT_EQ(m.read_i64("c.i64"), i64);
  EXPECT_EQ(m.metadata(), meta);
  EXPECT_EQ(std::string(m.raw_bytes("b.bf16")), std::string(r.raw_bytes("b.bf16")));
}

// Views (make_tensor_f32_view) write exactly the bytes of copies (make_tensor_f32), F32 and BF16, including a
// BF16 tensor longer than the writer's 1 Mi-element conversion piece; a view cannot be F16.
TEST_F(SafetensorsTmp, ViewsWriteTheSameBytesAsCopies) {
  std::vector<float> big((size_t{1} << 20) + 3);
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<float>(std::sin(0.001 * static_cast<double>(i)) * 1e3);
  std::vector<float> small = {1.00390625f, -2.5f, 3.0e38f};
  std::vector<ds::SaveTensor> copies, views;
  for (auto as : {ds::DType::F32, ds::DType::BF16}) {
    const std::string tag = as == ds::DType::F32 ? "f32" : "bf16";
    copies.push_back(ds::make_tensor_f32("big." + tag, {static_cast<int64_t>(big.size())}, big.data(), as));
    views.push_back(ds::make_tensor_f32_view("big." + tag, {static_cast<int64_t>(big.size())}, big.data(), as));
    copies.push_back(ds::make_tensor_f32("small." + tag, {3}, small.data(), as));
    views.push_back(ds::make_tensor_f32_view("small." + tag, {3}, small.data(), as));
  }
  copies.push_back(ds::make_tensor_f32("empty", {0}, nullptr));
  views.push_back(ds::make_tensor_f32_view("empty", {0}, nullptr));
  EXPECT_EQ(ds::serialize_safetensors(copies, {{"k", "v"}}), ds::serialize_safetensors(views, {{"k", "v"}}));
  ds::write_safetensors(path("copies.safetensors"), copies);
  ds::write_safetensors(path("views.safetensors"), views);
  EXPECT_EQ(ds::read_file(path("copies.safetensors")), ds::read_file(path("views.safetensors")));
  expect_error([&] { ds::make_tensor_f32_view("h", {3}, small.data(), ds::DType::F16); }, {"h", "F16"});
}

// write_safetensors_sharded: one file when the payload fits, else HF-style shards + index that CheckpointReader
// reads back exactly; a tensor bigger than the limit gets a shard alone; no temporary files are left.
TEST_F(SafetensorsTmp, ShardedWriterRoundTrip) {
  std::vector<std::vector<float>> vals;
  for (int i = 0; i < 5; ++i) {
    vals.emplace_back(static_cast<size_t>(i == 2 ? 1000 : 100));
    for (size_t j = 0; j < vals.back().size(); ++j) vals.back()[j] = static_cast<float>(i * 10000 + j) * 0.5f;
  }
  std::vector<ds::SaveTensor> ts;
  for (int i = 0; i < 5; ++i)
    ts.push_back(ds::make_tensor_f32_view("t" + std::to_string(i), {static_cast<int64_t>(vals[i].size())},
                                          vals[i].data()));
  ds::write_safetensors_sharded(dir_.string(), "one", ts, 1000000);
  EXPECT_TRUE(std::filesystem::exists(path("one.safetensors")));
  EXPECT_FALSE(std::filesystem::exists(path("one.safetensors.index.json")));
  ds::write_safetensors_sharded(dir_.string(), "opt", ts, 1000);  // 400-byte tensors two per shard, the 4000-byte one alone
  for (const char* f : {"opt-00001-of-00003.safetensors", "opt-00002-of-00003.safetensors",
                        "opt-00003-of-00003.safetensors", "opt.safetensors.index.json"})
    EXPECT_TRUE(std::filesystem::exists(path(f))) << f;
  const auto index = nlohmann::json::parse(ds::read_file(path("opt.safetensors.index.json")));
  EXPECT_EQ(index["metadata"]["total_size"].get<int64_t>(), 4 * 400 + 4000);
  EXPECT_EQ(index["weight_map"]["t2"].get<std::string>(), "opt-00002-of-00003.safetensors");
  EXPECT_EQ(index["weight_map"]["t4"].get<std::string>(), "opt-00003-of-00003.safetensors");
  ds::CheckpointReader r(path("opt.safetensors.index.json"));
  ds::CheckpointReader one(path("one.safetensors"));
  for (int i = 0; i < 5; ++i) {
    EXPECT_EQ(r.read_f32("t" + std::to_string(i)), vals[i]);
    EXPECT_EQ(one.read_f32("t" + std::to_string(i)), vals[i]);
  }
  for (const auto& e : std::filesystem::directory_iterator(dir_))
    EXPECT_EQ(e.path().string().find(".tmp."), std::string::npos) << e.path();
}

TEST_F(SafetensorsTmp, NoMetadataKeyWhenEmpty) {
  float v[2] = {1.f, 2.f};
  const std::string p = path("nometa.safetensors");
  ds::write_safetensors(p, {ds::make_tensor_f32("x", {2}, v)});
  const std::string raw = ds::read_file(p);
  EXPECT_EQ(raw.find("__metadata__"), std::string::npos);
  uint64_t hlen = 0;
  std::memcpy(&hlen, raw.data(), 8);
  EXPECT_EQ(hlen % 8, 0u);
  EXPECT_EQ(raw.substr(8, hlen).find_last_not_of(' ') + 1,
            std::string("{\"x\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}").size());
  ds::SafetensorsReader r(p);
  EXPECT_TRUE(r.metadata().empty());
  EXPECT_EQ(r.read_f32("x"), (std::vector<float>{1.f, 2.f}));
}

TEST_F(SafetensorsTmp, ReadsOtherDtypes) {
  auto raw = [](const std::string& name, ds::DType dt, std::vector<int64_t> shape, const void* p, size_t n) {
    ds::SaveTensor t;
    t.name = name;
    t.dtype = dt;
    t.shape = std::move(shape);
    t.bytes.assign(static_cast<const uint8_t*>(p), static_cast<const uint8_t*>(p) + n);
    return t;
  };
  const uint16_t f16[5] = {0x3c00, 0xc000, 0x0001, 0x7c00, 0x3555};
  const double f64[2] = {0.1, -1e300};
  const int32_t i32[3] = {-7, 0, 2147483647};
  const int16_t i16[2] = {-32768, 5};
  const int8_t i8[2] = {-128, 127};
  const uint8_t u8[2] = {0, 255};
  const uint8_t bl[3] = {0, 1, 2};
  const std::string p = path("dtypes.safetensors");
  ds::write_safetensors(p, {raw("f16", ds::DType::F16, {5}, f16, 10), raw("f64", ds::DType::F64, {2}, f64, 16),
                            raw("i32", ds::DType::I32, {3}, i32, 12), raw("i16", ds::DType::I16, {2}, i16, 4),
                            raw("i8", ds::DType::I8, {2}, i8, 2), raw("u8", ds::DType::U8, {2}, u8, 2),
                            raw("b", ds::DType::BOOL, {3}, bl, 3)});
  ds::SafetensorsReader r(p);
  auto h = r.read_f32("f16");
  EXPECT_EQ(h[0], 1.f);
  EXPECT_EQ(h[1], -2.f);
  EXPECT_EQ(h[2], std::ldexp(1.f, -24));
  EXPECT_TRUE(std::isinf(h[3]));
  EXPECT_NEAR(h[4], 1.f / 3.f, 1e-3);
  EXPECT_EQ(r.read_f64("f64"), (std::vector<double>{0.1, -1e300}));
  EXPECT_EQ(r.read_f32("f64")[0], 0.1f);
  EXPECT_EQ(r.read_i64("i32"), (std::vector<int64_t>{-7, 0, 2147483647}));
  EXPECT_EQ(r.read_i64("i16"), (std::vector<int64_t>{-32768, 5}));
  EXPECT_EQ(r.read_i64("i8"), (std::vector<int64_t>{-128, 127}));
  EXPECT_EQ(r.read_i64("u8"), (std::vector<int64_t>{0, 255}));
  EXPECT_EQ(r.read_i64("b"), (std::vector<int64_t>{0, 1, 1}));
  for (const char* n : {"i32", "i16", "i8", "u8", "b"}) expect_error([&] { r.read_f32(n); }, {p, n, "float dtype"});
  expect_error([&] { r.read_i64("f16"); }, {p, "f16"});
  EXPECT_STREQ(ds::dtype_name(ds::DType::BF16), "BF16");
  EXPECT_EQ(ds::dtype_size(ds::DType::F64), 8u);
  EXPECT_EQ(ds::dtype_size(ds::DType::BOOL), 1u);
}

TEST_F(SafetensorsTmp, WriterRejectsBadInput) {
  float v[4] = {1, 2, 3, 4};
  const std::string p = path("w.safetensors");
  expect_error([&] { ds::make_tensor_f32("h", {4}, v, ds::DType::F16); }, {"h", "F16"});
  expect_error([&] { ds::make_tensor_f32("neg", {-1, 4}, v); }, {"neg"});
  expect_error([&] { ds::write_safetensors(p, {ds::make_tensor_f32("x", {4}, v), ds::make_tensor_f32("x", {2}, v)}); },
               {p, "duplicate", "x"});
  auto bad = ds::make_tensor_f32("y", {4}, v);
  bad.shape = {5};
  expect_error([&] { ds::write_safetensors(p, {bad}); }, {p, "y"});
  expect_error([&] { ds::write_safetensors(p, {ds::make_tensor_f32("__metadata__", {4}, v)}); }, {p});
  EXPECT_FALSE(fs::exists(p));  // nothing written on failure
}

// ---------------------------------------------------------------------------------------------------------
// HF fixtures

TEST(Safetensors, ReadsHfModelFixture) {
  const std::string p = fixture("hf_qwen35_tiny_a/model.safetensors");
  ds::SafetensorsReader r(p);
  const ds::TensorInfo* e = r.find("model.embed_tokens.weight");
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(e->dtype, ds::DType::F32);
  EXPECT_EQ(e->shape, (std::vector<int64_t>{256, 64}));
  EXPECT_EQ(r.read_f32("model.embed_tokens.weight").size(), 256u * 64u);
  const ds::TensorInfo* a = r.find("model.layers.0.linear_attn.A_log");
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->shape, (std::vector<int64_t>{4}));
  EXPECT_TRUE(r.has("lm_head.weight"));
  for (const auto& t : r.tensors()) {
    EXPECT_EQ(t.dtype, ds::DType::F32) << t.name;
    auto v = r.read_f32(t.name);
    EXPECT_EQ(static_cast<int64_t>(v.size()), t.numel()) << t.name;
    for (float x : v) ASSERT_TRUE(std::isfinite(x)) << t.name;
  }
}

TEST(Safetensors, ReadsHfInputsFixture) {
  ds::SafetensorsReader r(fixture("hf_qwen35_tiny_a/inputs.safetensors"));
  const ds::TensorInfo* t = r.find("input_ids");
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->dtype, ds::DType::I64);
  EXPECT_EQ(t->shape, (std::vector<int64_t>{2, 100}));
  auto ids = r.read_i64("input_ids");
  ASSERT_EQ(ids.size(), 200u);
  for (int64_t id : ids) {
    EXPECT_GE(id, 0);
    EXPECT_LT(id, 256);
  }
  auto labels = r.read_i64("labels");
  ASSERT_EQ(labels.size(), 200u);
  EXPECT_EQ(labels[0], -100);
  EXPECT_EQ(labels[2], -100);
  EXPECT_EQ(labels[3], ids[3]);
  EXPECT_EQ(labels[100], ids[100]);
}

TEST(Checkpoint, ReleaseLayoutMatchesFp32FixtureRoundedToBf16) {
  const std::string dir = fixture("hf_qwen35_tiny_a_release_layout");
  ds::CheckpointReader ck(dir);
  ds::SafetensorsReader ref(fixture("hf_qwen35_tiny_a/model.safetensors"));

  // Every name of the index is readable.
  const std::string index_text = ds::read_file(dir + "/model.safetensors.index.json");
  auto names = ck.names();
  EXPECT_TRUE(std::is_sorted(names.begin(), names.end()));
  size_t mentioned = 0;
  for (const auto& n : names) {
    EXPECT_NE(index_text.find("\"" + n + "\""), std::string::npos) << n;
    ++mentioned;
    auto v = ck.read_f32(n);
    EXPECT_EQ(static_cast<int64_t>(v.size()), ck.info(n).numel()) << n;
  }
  EXPECT_GT(mentioned, 50u);
  EXPECT_TRUE(ck.has("mtp.fc.weight"));
  EXPECT_TRUE(ck.has("model.visual.patch_embed.proj.weight"));

  // Text tensors: bf16(fp32 fixture) exactly, except A_log / linear_attn.norm.weight kept fp32.
  const std::string text_prefix = "model.language_model.";
  size_t compared = 0, kept_f32 = 0;
  for (const auto& n : names) {
    std::string ref_name;
    if (n == "lm_head.weight") {
      ref_name = n;
    } else if (n.rfind(text_prefix, 0) == 0) {
      ref_name = "model." + n.substr(text_prefix.size());
    } else {
      continue;
    }
    ASSERT_TRUE(ref.has(ref_name)) << ref_name;
    const ds::TensorInfo& info = ck.info(n);
    EXPECT_EQ(info.shape, ref.find(ref_name)->shape) << n;
    const bool f32_kept = n.ends_with("linear_attn.A_log") || n.ends_with("linear_attn.norm.weight");
    EXPECT_EQ(info.dtype, f32_kept ? ds::DType::F32 : ds::DType::BF16) << n;
    auto got = ck.read_f32(n);
    auto want = ref.read_f32(ref_name);
    ASSERT_EQ(got.size(), want.size()) << n;
    size_t bad = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      const float w = f32_kept ? want[i] : ds::round_bf16(want[i]);
      if (bits(got[i]) != bits(w)) ++bad;
    }
    EXPECT_EQ(bad, 0u) << n;
    ++compared;
    kept_f32 += f32_kept;
  }
  EXPECT_EQ(compared, ref.tensors().size());  // every fp32 tensor has its release counterpart
  EXPECT_EQ(kept_f32, 6u);                    // 3 linear-attention layers x {A_log, norm.weight}

  // The index file itself is also accepted as the path.
  ds::CheckpointReader by_index(dir + "/model.safetensors.index.json");
  EXPECT_EQ(by_index.names(), names);
  expect_error([&] { ck.info("nope"); }, {dir, "nope"});
}

TEST(Checkpoint, SingleFileAndDirectory) {
  const std::string file = fixture("hf_qwen35_tiny_a/model.safetensors");
  ds::CheckpointReader by_file(file);
  ds::CheckpointReader by_dir(fixture("hf_qwen35_tiny_a"));
  EXPECT_EQ(by_file.names(), by_dir.names());
  EXPECT_EQ(by_dir.info("model.embed_tokens.weight").shape, (std::vector<int64_t>{256, 64}));
  EXPECT_EQ(by_file.read_f32("lm_head.weight"), by_dir.read_f32("lm_head.weight"));
  ds::CheckpointReader inputs(fixture("hf_qwen35_tiny_a/inputs.safetensors"));
  EXPECT_EQ(inputs.read_i64("input_ids").size(), 200u);
}

// ---------------------------------------------------------------------------------------------------------
// Corrupt / hostile files

TEST_F(SafetensorsTmp, CorruptFilesRaiseErrorsNamingTheFile) {
  const std::string ok_entry = R"("t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})";
  expect_bad_file(put("empty.safetensors", ""), "too short");
  expect_bad_file(put("four.safetensors", "abcd"), "too short");
  expect_bad_file(put("hlen_big.safetensors", le64(1000) + "{}"), "header length");
  expect_bad_file(put("hlen_absurd.safetensors", le64(uint64_t(1) << 62) + "{}"), "header length");
  expect_bad_file(put("hlen_absurd2.safetensors", le64(~uint64_t(0)) + "{}"), "header length");
  expect_bad_file(put("badjson.safetensors", image("{\"t\": {\"dtype\": \"F32\",", 0)), "JSON");
  expect_bad_file(put("zerolen.safetensors", image("", 0)), "JSON");
  expect_bad_file(put("notobj.safetensors", image("[1, 2, 3]", 0)), "not a JSON object");
  expect_bad_file(put("entry_notobj.safetensors", image(R"({"t": 5})", 0)), "t");
  expect_bad_file(put("dtype.safetensors", image(R"({"t":{"dtype":"Q7","shape":[2],"data_offsets":[0,8]}})", 8)),
                  "unknown dtype");
  expect_bad_file(put("dtype_type.safetensors", image(R"({"t":{"dtype":4,"shape":[2],"data_offsets":[0,8]}})", 8)),
                  "dtype");
  expect_bad_file(put("no_dtype.safetensors", image(R"({"t":{"shape":[2],"data_offsets":[0,8]}})", 8)), "dtype");
  expect_bad_file(put("no_shape.safetensors", image(R"({"t":{"dtype":"F32","data_offsets":[0,8]}})", 8)), "shape");
  expect_bad_file(put("no_offsets.safetensors", image(R"({"t":{"dtype":"F32","shape":[2]}})", 8)), "data_offsets");
  expect_bad_file(put("shape_str.safetensors", image(R"({"t":{"dtype":"F32","shape":"2","data_offsets":[0,8]}})", 8)),
                  "shape");
  expect_bad_file(put("shape_float.safetensors",
                      image(R"({"t":{"dtype":"F32","shape":[2.0],"data_offsets":[0,8]}})", 8)),
                  "shape");
  expect_bad_file(put("range.safetensors", image("{" + ok_entry + "}", 4)), "out of range");
  expect_bad_file(put("range_huge.safetensors",
                      image(R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[18446744073709551608,18446744073709551615]}})",
                            8)),
                  "out of range");
  expect_bad_file(put("endlt.safetensors", image(R"({"t":{"dtype":"F32","shape":[0],"data_offsets":[8,0]}})", 8)),
                  "end");
  expect_bad_file(put("offsets3.safetensors", image(R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8,9]}})", 8)),
                  "data_offsets");
  expect_bad_file(put("offsets_neg.safetensors",
                      image(R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[-8,0]}})", 8)),
                  "data_offsets");
  expect_bad_file(put("count.safetensors", image(R"({"t":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 12)),
                  "needs");
  expect_bad_file(put("count_bf16.safetensors",
                      image(R"({"t":{"dtype":"BF16","shape":[2],"data_offsets":[0,8]}})", 8)),
                  "needs");
  expect_bad_file(
      put("overlap.safetensors",
          image(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                12)),
      "overlap");
  expect_bad_file(
      put("same_range.safetensors",
          image(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"I32","shape":[2],"data_offsets":[0,8]}})",
                8)),
      "overlap");
  expect_bad_file(
      put("nested.safetensors",
          image(R"({"a":{"dtype":"U8","shape":[16],"data_offsets":[0,16]},"b":{"dtype":"U8","shape":[2],"data_offsets":[4,6]}})",
                16)),
      "overlap");
  expect_bad_file(put("negdim.safetensors", image(R"({"t":{"dtype":"F32","shape":[-2,-1],"data_offsets":[0,8]}})", 8)),
                  "shape");
  expect_bad_file(put("overflow.safetensors",
                      image(R"({"t":{"dtype":"F64","shape":[4294967296,4294967296,4],"data_offsets":[0,8]}})", 8)),
                  "shape");
  expect_bad_file(put("overflow_bytes.safetensors",
                      image(R"({"t":{"dtype":"F64","shape":[2305843009213693952,2],"data_offsets":[0,0]}})", 0)),
                  "needs");
  expect_bad_file(put("dim_u64.safetensors",
                      image(R"({"t":{"dtype":"U8","shape":[18446744073709551615],"data_offsets":[0,8]}})", 8)),
                  "shape");
  expect_bad_file(put("dup.safetensors", image("{" + ok_entry + "," + ok_entry + "}", 8)), "duplicate");
  expect_bad_file(put("meta_int.safetensors", image(R"({"__metadata__":{"step":3}})", 0)), "__metadata__");
  expect_bad_file(put("meta_arr.safetensors", image(R"({"__metadata__":["a"]})", 0)), "__metadata__");
  expect_bad_file(put("deep.safetensors", image(std::string(100, '[') + std::string(100, ']'), 0)), "nested");
  expect_bad_file(put("badutf8.safetensors", image("{\"\xff\":{}}", 0)), "JSON");
  expect_bad_file(path("does_not_exist.safetensors"), "cannot open");

  // Refused as the safetensors library refuses them: a gap before a tensor, bytes after the last one.
  expect_bad_file(put("gap.safetensors", image(R"({"b":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}})", 6)),
                  "a gap no tensor claims");
  expect_bad_file(put("trailing.safetensors", image(R"({"b":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}})", 10)),
                  "6 trailing bytes");
  // Tolerated: header padding, zero-size tensors sharing an offset (anywhere), empty header object.
  ds::SafetensorsReader ok1(put("ok1.safetensors",
                                image(R"({"a":{"dtype":"U8","shape":[0],"data_offsets":[4,4]},"b":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}})" +
                                          std::string(5, ' '),
                                      4)));
  EXPECT_EQ(ok1.read_i64("b").size(), 4u);
  ds::SafetensorsReader ok2(put("ok2.safetensors", image("{}", 0)));
  EXPECT_TRUE(ok2.tensors().empty());
}

TEST_F(SafetensorsTmp, FromBytesErrorsUseTheGivenName) {
  expect_error([] { ds::SafetensorsReader::from_bytes("", "buf-name"); }, {"buf-name", "too short"});
  expect_error([] { ds::SafetensorsReader::from_bytes(le64(3) + "{x}", "buf-name"); }, {"buf-name", "JSON"});
}

TEST_F(SafetensorsTmp, CheckpointIndexErrors) {
  float v[2] = {1.f, 2.f};
  ds::write_safetensors(path("s1.safetensors"), {ds::make_tensor_f32("a", {2}, v), ds::make_tensor_f32("b", {2}, v)});
  const std::string idx = path("model.safetensors.index.json");
  auto write_index = [&](const std::string& text) { put("model.safetensors.index.json", text); };

  write_index(R"({"weight_map": {"a": "s1.safetensors", "b": "s1.safetensors"}})");
  {
    ds::CheckpointReader ck(dir_.string());
    EXPECT_EQ(ck.names(), (std::vector<std::string>{"a", "b"}));
    EXPECT_EQ(ck.read_f32("b"), (std::vector<float>{1.f, 2.f}));
  }
  write_index(R"({"weight_map": {"a": "s1.safetensors", "b": "missing.safetensors"}})");
  expect_error([&] { ds::CheckpointReader ck(dir_.string()); }, {idx, "missing.safetensors", "b"});
  write_index(R"({"weight_map": {"a": "s1.safetensors", "zz": "s1.safetensors"}})");
  expect_error([&] { ds::CheckpointReader ck(dir_.string()); }, {idx, "zz", "s1.safetensors"});
  write_index(R"({"weight_map": {"a": "s1.safetensors", )");
  expect_error([&] { ds::CheckpointReader ck(dir_.string()); }, {idx, "JSON"});
  write_index(R"({"metadata": {}})");
  expect_error([&] { ds::CheckpointReader ck(dir_.string()); }, {idx, "weight_map"});
  write_index(R"({"weight_map": {"a": 3}})");
  expect_error([&] { ds::CheckpointReader ck(dir_.string()); }, {idx, "a"});
  write_index(R"({"weight_map": {"a": "../s1.safetensors"}})");
  expect_error([&] { ds::CheckpointReader ck(dir_.string()); }, {idx, "../s1.safetensors"});
  write_index(R"({"weight_map": {"a": "/etc/passwd"}})");
  expect_error([&] { ds::CheckpointReader ck(dir_.string()); }, {idx, "/etc/passwd"});
  write_index(R"({"weight_map": {"a": "s1.safetensors", "a": "s1.safetensors"}})");
  expect_error([&] { ds::CheckpointReader ck(dir_.string()); }, {idx, "duplicate"});

  // A corrupt shard: the error names the shard file.
  const std::string bad = put("s2.safetensors", "abcd");
  write_index(R"({"weight_map": {"a": "s1.safetensors", "b": "s2.safetensors"}})");
  expect_error([&] { ds::CheckpointReader ck(dir_.string()); }, {bad});

  // Directories without a checkpoint, and missing paths.
  fs::create_directories(dir_ / "emptydir");
  expect_error([&] { ds::CheckpointReader ck((dir_ / "emptydir").string()); }, {(dir_ / "emptydir").string()});
  expect_error([&] { ds::CheckpointReader ck(path("nowhere")); }, {path("nowhere")});
}
