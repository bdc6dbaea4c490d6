// GGUF reader/writer and GGML type traits: round trips with exact values and bytes, and
// corruptions of writer output that must each become a GgufError naming the file and problem.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "support/test_env.h"
#include "tessera/ggml_types.h"
#include "tessera/gguf.h"

using namespace tessera;
using namespace tessera::gguf;
namespace fs = std::filesystem;

namespace {

std::string write_file(const fs::path& dir, const std::string& name,
                       const std::vector<uint8_t>& bytes) {
  const fs::path p = dir / name;
  std::ofstream f(p, std::ios::binary);
  f.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  REQUIRE(f.good());
  return p.string();
}

// Opens `bytes` as a file and returns the GgufError message ("" if it opened fine).
std::string open_error(const fs::path& dir, const std::vector<uint8_t>& bytes,
                       const std::string& name = "bad.gguf") {
  const std::string path = write_file(dir, name, bytes);
  try {
    GgufFile::open(path);
  } catch (const GgufError& e) {
    return e.what();
  }
  return "";
}

// Asserts that `bytes` is rejected with a message naming the file and containing `needle`.
void expect_rejected(const fs::path& dir, const std::vector<uint8_t>& bytes,
                     const std::string& needle) {
  const std::string msg = open_error(dir, bytes);
  INFO("message: " << msg);
  CHECK_FALSE(msg.empty());
  CHECK(msg.find((dir / "bad.gguf").string()) != std::string::npos);
  CHECK(msg.find(needle) != std::string::npos);
}

size_t find_bytes(const std::vector<uint8_t>& hay, const std::string& needle) {
  auto it = std::search(hay.begin(), hay.end(), needle.begin(), needle.end());
  REQUIRE(it != hay.end());
  return static_cast<size_t>(it - hay.begin());
}

template <typename T>
void poke(std::vector<uint8_t>& bytes, size_t at, T v) {
  REQUIRE(at + sizeof(T) <= bytes.size());
  std::memcpy(bytes.data() + at, &v, sizeof(T));
}

template <typename T>
T peek(const std::vector<uint8_t>& bytes, size_t at) {
  T v;
  std::memcpy(&v, bytes.data() + at, sizeof(T));
  return v;
}

// Byte positions of one tensor info's fields in writer output, found via the tensor's name.
struct InfoPos {
  size_t n_dims, dims, type, offset;
};
InfoPos tensor_info_pos(const std::vector<uint8_t>& bytes, const std::string& name,
                        uint32_t n_dims) {
  // Search for the length prefix + name so a metadata string with the same text cannot match.
  std::string needle(8, '\0');
  const uint64_t len = name.size();
  std::memcpy(needle.data(), &len, 8);
  needle += name;
  const size_t at = find_bytes(bytes, needle) + needle.size();
  return {at, at + 4, at + 4 + 8 * n_dims, at + 4 + 8 * n_dims + 4};
}

std::vector<uint8_t> f32_bytes(const std::vector<float>& v) {
  std::vector<uint8_t> out(v.size() * 4);
  std::memcpy(out.data(), v.data(), out.size());
  return out;
}

std::vector<uint8_t> pattern_bytes(size_t n, uint32_t seed) {
  std::vector<uint8_t> out(n);
  for (size_t i = 0; i < n; ++i) out[i] = static_cast<uint8_t>((i * 7 + seed * 13 + 1) & 0xFF);
  return out;
}

// A small file with tensors only at its end, so that every proper prefix is invalid: the
// last tensor is 32 bytes, exactly one alignment unit, leaving no trailing padding.
std::vector<uint8_t> small_file_bytes() {
  GgufWriter w;
  w.add_string("general.architecture", "tiny");
  w.add_uint32("tiny.block_count", 2);
  w.add_string_array("tokenizer.ggml.tokens", {"a", "bc", ""});
  w.add_float32_array("tiny.scores", {0.5f, -1.0f});
  w.add_tensor("q8", {32, 2}, GgmlType::Q8_0, pattern_bytes(68, 1));
  w.add_tensor("w", {8}, GgmlType::F32, f32_bytes({1, 2, 3, 4, 5, 6, 7, 8}));
  return w.to_bytes();
}

}  // namespace

// ------------------------------------------------------------------------------------------
TEST_CASE("ggml type traits match ggml's block layouts") {
  struct Row {
    GgmlType type;
    const char* name;
    int64_t block;
    size_t size;
  };
  const Row rows[] = {
      {GgmlType::F32, "f32", 1, 4},       {GgmlType::F16, "f16", 1, 2},
      {GgmlType::BF16, "bf16", 1, 2},     {GgmlType::Q4_0, "q4_0", 32, 18},
      {GgmlType::Q4_1, "q4_1", 32, 20},   {GgmlType::Q5_0, "q5_0", 32, 22},
      {GgmlType::Q5_1, "q5_1", 32, 24},   {GgmlType::Q8_0, "q8_0", 32, 34},
      {GgmlType::Q8_1, "q8_1", 32, 36},   {GgmlType::Q2_K, "q2_K", 256, 84},
      {GgmlType::Q3_K, "q3_K", 256, 110}, {GgmlType::Q4_K, "q4_K", 256, 144},
      {GgmlType::Q5_K, "q5_K", 256, 176}, {GgmlType::Q6_K, "q6_K", 256, 210},
      {GgmlType::Q8_K, "q8_K", 256, 292},
  };
  for (const Row& r : rows) {
    const GgmlTypeTraits t = ggml_type_traits(r.type);
    CAPTURE(r.name);
    CHECK(std::string(t.name) == r.name);
    CHECK(std::string(ggml_type_name(r.type)) == r.name);
    CHECK(t.block_size == r.block);
    CHECK(t.type_size == r.size);
    CHECK(t.is_known);
    CHECK(ggml_type_is_known(static_cast<uint32_t>(r.type)));
    CHECK(ggml_row_size(r.type, r.block * 3) == r.size * 3);
  }
  // Ids ggml retired (4, 5) or never had are unknown.
  for (uint32_t id : {4u, 5u, 16u, 29u, 31u, 1000u, 0xFFFFFFFFu}) {
    CAPTURE(id);
    CHECK_FALSE(ggml_type_is_known(id));
    const GgmlTypeTraits t = ggml_type_traits(static_cast<GgmlType>(id));
    CHECK(std::string(t.name) == "unknown");
    CHECK(t.block_size == 0);
    CHECK(t.type_size == 0);
    CHECK_FALSE(t.is_known);
  }
  CHECK(ggml_row_size(GgmlType::Q4_K, 4096) == 16 * 144);
}

TEST_CASE("fp16 conversions round to nearest even and handle specials") {
  CHECK(fp32_to_fp16(0.0f) == 0x0000);
  CHECK(fp32_to_fp16(-0.0f) == 0x8000);
  CHECK(fp32_to_fp16(1.0f) == 0x3C00);
  CHECK(fp32_to_fp16(-2.0f) == 0xC000);
  CHECK(fp32_to_fp16(0.5f) == 0x3800);
  CHECK(fp32_to_fp16(65504.0f) == 0x7BFF);   // largest finite half
  CHECK(fp32_to_fp16(65519.0f) == 0x7BFF);   // rounds down, below the halfway point
  CHECK(fp32_to_fp16(65520.0f) == 0x7C00);   // halfway to 65536 rounds to even = inf
  CHECK(fp32_to_fp16(1e10f) == 0x7C00);
  CHECK(fp32_to_fp16(std::numeric_limits<float>::infinity()) == 0x7C00);
  CHECK(fp32_to_fp16(-std::numeric_limits<float>::infinity()) == 0xFC00);
  CHECK(fp32_to_fp16(std::numeric_limits<float>::quiet_NaN()) == 0x7E00);
  CHECK(fp32_to_fp16(-std::numeric_limits<float>::quiet_NaN()) == 0xFE00);
  // Ties between adjacent halves go to the even mantissa.
  CHECK(fp32_to_fp16(1.0f + std::ldexp(1.0f, -11)) == 0x3C00);
  CHECK(fp32_to_fp16(1.0f + 3 * std::ldexp(1.0f, -11)) == 0x3C02);
  CHECK(fp32_to_fp16(1.0f + std::ldexp(1.0f, -11) + std::ldexp(1.0f, -20)) == 0x3C01);
  // Subnormals: 2^-24 is the smallest half; 2^-25 is a tie that rounds to zero (even).
  CHECK(fp32_to_fp16(std::ldexp(1.0f, -24)) == 0x0001);
  CHECK(fp32_to_fp16(std::ldexp(1.0f, -25)) == 0x0000);
  CHECK(fp32_to_fp16(std::ldexp(1.0f, -25) * 1.0001f) == 0x0001);
  CHECK(fp32_to_fp16(3 * std::ldexp(1.0f, -25)) == 0x0002);
  CHECK(fp32_to_fp16(std::ldexp(1.0f, -14)) == 0x0400);  // smallest normal
  CHECK(fp32_to_fp16(std::ldexp(1023.0f, -24)) == 0x03FF);
  CHECK(fp32_to_fp16(1e-10f) == 0x0000);

  CHECK(fp16_to_fp32(0x3C00) == 1.0f);
  CHECK(fp16_to_fp32(0xC000) == -2.0f);
  CHECK(fp16_to_fp32(0x7BFF) == 65504.0f);
  CHECK(fp16_to_fp32(0x0001) == std::ldexp(1.0f, -24));
  CHECK(fp16_to_fp32(0x03FF) == std::ldexp(1023.0f, -24));
  CHECK(fp16_to_fp32(0x7C00) == std::numeric_limits<float>::infinity());
  CHECK(fp16_to_fp32(0xFC00) == -std::numeric_limits<float>::infinity());
  CHECK(std::isnan(fp16_to_fp32(0x7E00)));
  CHECK(std::signbit(fp16_to_fp32(0x8000)));

  // Every half survives a round trip through float; every nan stays a nan.
  int mismatches = 0;
  for (uint32_t h = 0; h <= 0xFFFF; ++h) {
    const float f = fp16_to_fp32(static_cast<uint16_t>(h));
    const uint16_t back = fp32_to_fp16(f);
    const bool is_nan = (h & 0x7C00) == 0x7C00 && (h & 0x03FF) != 0;
    if (is_nan) {
      mismatches += !(std::isnan(f) && back == ((h & 0x8000) | 0x7E00));
    } else {
      mismatches += back != h;
    }
  }
  CHECK(mismatches == 0);
}

// ------------------------------------------------------------------------------------------
TEST_CASE("gguf writer output reads back with every value and tensor byte") {
  const fs::path dir = test::scratch_dir("gguf");
  const std::vector<float> w_vals = {1.5f, -2.25f, 0.0f, 3.0e7f, -1e-3f, 42.0f,
                                     0.1f, 7.0f,   8.0f, 9.0f,   10.0f, -11.0f};
  std::vector<uint8_t> f16_data;
  for (float x : {0.5f, -1.0f, 2.0f, 65504.0f, 0.0f, -0.0f, 1e-5f, 3.14159f}) {
    const uint16_t h = fp32_to_fp16(x);
    f16_data.push_back(static_cast<uint8_t>(h & 0xFF));
    f16_data.push_back(static_cast<uint8_t>(h >> 8));
  }
  const std::vector<uint8_t> q8_data = pattern_bytes(34 * 2 * 3, 5);

  GgufWriter w;
  w.add_string("general.architecture", "llama");
  w.add_string("general.name", "tiny \xC3\xA9 model");  // UTF-8 passes through untouched
  w.add_uint32("llama.block_count", 4);
  w.add_int32("test.negative", -123456);
  w.add_uint64("test.big", 0xFEDCBA9876543210ull);
  w.add_float32("llama.rope.freq_base", 10000.5f);
  w.add_bool("test.yes", true);
  w.add_bool("test.no", false);
  w.add_string_array("tokenizer.ggml.tokens", {"<s>", "</s>", "", "hello world", "\xE2\x96\x81x"});
  w.add_float32_array("tokenizer.ggml.scores", {0.0f, -1.5f, 2.25f});
  w.add_int32_array("tokenizer.ggml.token_type", {1, 3, -7, 2147483647});
  w.add_string_array("test.empty_array", {});
  w.add_tensor("weight.f32", {3, 4}, GgmlType::F32, f32_bytes(w_vals));
  w.add_tensor("weight.f16", {8}, GgmlType::F16, f16_data);
  w.add_tensor("weight.q8_0", {64, 3}, GgmlType::Q8_0, q8_data);
  const std::string path = (dir / "model.gguf").string();
  w.write(path);
  const std::vector<uint8_t> bytes = w.to_bytes();
  CHECK(fs::file_size(path) == bytes.size());
  CHECK(bytes.size() % 32 == 0);
  // Default alignment: no general.alignment key is written.
  CHECK(std::search(bytes.begin(), bytes.end(), std::string("general.alignment").begin(),
                    std::string("general.alignment").end()) == bytes.end());

  auto f = GgufFile::open(path);
  CHECK(f->path() == path);
  CHECK(f->version() == 3);
  CHECK(f->alignment() == 32);
  CHECK(f->file_size() == bytes.size());
  CHECK(f->metadata().size() == 12);

  CHECK(f->get_string("general.architecture") == "llama");
  CHECK(f->get_string("general.name") == "tiny \xC3\xA9 model");
  CHECK(f->get_uint("llama.block_count") == 4);
  CHECK(f->find("llama.block_count")->type == ValueType::kUint32);
  CHECK(f->opt_int("test.negative") == -123456);
  CHECK(f->find("test.negative")->type == ValueType::kInt32);
  CHECK(f->get_uint("test.big") == 0xFEDCBA9876543210ull);
  CHECK(f->get_float("llama.rope.freq_base") == 10000.5);
  CHECK(f->find("llama.rope.freq_base")->type == ValueType::kFloat32);
  CHECK(f->opt_bool("test.yes") == true);
  CHECK(f->opt_bool("test.no") == false);
  const auto* tokens = f->opt_string_array("tokenizer.ggml.tokens");
  REQUIRE(tokens != nullptr);
  CHECK(*tokens == std::vector<std::string>{"<s>", "</s>", "", "hello world", "\xE2\x96\x81x"});
  CHECK(f->opt_float_array("tokenizer.ggml.scores") == std::vector<double>{0.0, -1.5, 2.25});
  CHECK(f->opt_int_array("tokenizer.ggml.token_type") ==
        std::vector<int64_t>{1, 3, -7, 2147483647});
  CHECK(f->find("tokenizer.ggml.token_type")->array_type == ValueType::kInt32);
  REQUIRE(f->opt_string_array("test.empty_array") != nullptr);
  CHECK(f->opt_string_array("test.empty_array")->empty());

  // Getter semantics: integers widen to float, missing/mismatched keys name the key.
  CHECK(f->get_float("llama.block_count") == 4.0);
  CHECK_THROWS_AS(f->opt_int("test.big"), GgufError);  // does not fit in int64
  CHECK_THROWS_WITH_AS(f->get_uint("test.negative"), doctest::Contains("test.negative"),
                       GgufError);
  CHECK_THROWS_WITH_AS(f->get_string("llama.block_count"), doctest::Contains("llama.block_count"),
                       GgufError);
  CHECK_THROWS_WITH_AS(f->get_string("no.such.key"), doctest::Contains("no.such.key"), GgufError);
  CHECK_THROWS_WITH_AS(f->get_uint("no.such.key"), doctest::Contains(path.c_str()), GgufError);
  CHECK_THROWS_AS(f->opt_bool("llama.block_count"), GgufError);
  CHECK_THROWS_AS(f->opt_string_array("tokenizer.ggml.scores"), GgufError);
  CHECK_THROWS_AS(f->opt_float_array("general.name"), GgufError);
  CHECK_THROWS_AS(f->opt_int_array("tokenizer.ggml.tokens"), GgufError);
  CHECK(f->opt_string("no.such.key") == std::nullopt);
  CHECK(f->opt_uint("no.such.key") == std::nullopt);
  CHECK(f->opt_float("no.such.key") == std::nullopt);
  CHECK(f->opt_bool("no.such.key") == std::nullopt);
  CHECK(f->opt_string_array("no.such.key") == nullptr);
  CHECK(f->opt_float_array("no.such.key") == std::nullopt);
  CHECK(f->opt_int_array("no.such.key") == std::nullopt);
  CHECK(f->find("no.such.key") == nullptr);

  REQUIRE(f->tensors().size() == 3);
  CHECK(f->tensors()[0].name == "weight.f32");  // file order is kept
  CHECK(f->tensors()[2].name == "weight.q8_0");

  const TensorInfo& t32 = f->tensor("weight.f32");
  CHECK(t32.dims == std::vector<int64_t>{3, 4});
  CHECK(t32.type == GgmlType::F32);
  CHECK(t32.num_elements() == 12);
  CHECK(t32.num_rows() == 4);
  CHECK(t32.num_bytes == 48);
  CHECK(t32.offset == 0);
  REQUIRE(t32.data != nullptr);
  CHECK(std::memcmp(t32.data, w_vals.data(), 48) == 0);

  const TensorInfo& t16 = f->tensor("weight.f16");
  CHECK(t16.dims == std::vector<int64_t>{8});
  CHECK(t16.type == GgmlType::F16);
  CHECK(t16.num_rows() == 1);
  CHECK(t16.num_bytes == 16);
  CHECK(t16.offset == 64);  // 48 bytes padded to 64
  CHECK(std::memcmp(t16.data, f16_data.data(), 16) == 0);
  uint16_t h3;
  std::memcpy(&h3, t16.data + 6, 2);
  CHECK(fp16_to_fp32(h3) == 65504.0f);

  const TensorInfo& tq = f->tensor("weight.q8_0");
  CHECK(tq.dims == std::vector<int64_t>{64, 3});
  CHECK(tq.type == GgmlType::Q8_0);
  CHECK(tq.num_elements() == 192);
  CHECK(tq.num_bytes == 204);
  CHECK(tq.offset == 96);
  CHECK(std::memcmp(tq.data, q8_data.data(), 204) == 0);

  // Data pointers are the file bytes at data-section start + offset, and that start is
  // aligned: the section holds 48->64, 16->32 and 204->224 padded bytes.
  const size_t data_start = bytes.size() - (64 + 32 + 224);
  CHECK(data_start % 32 == 0);
  for (const TensorInfo& t : f->tensors()) {
    CAPTURE(t.name);
    CHECK(t.offset % 32 == 0);
    CHECK(t.data - t32.data == static_cast<ptrdiff_t>(t.offset));
    CHECK(std::memcmp(bytes.data() + data_start + t.offset, t.data, t.num_bytes) == 0);
  }

  CHECK(f->find_tensor("nope") == nullptr);
  CHECK_THROWS_WITH_AS(f->tensor("nope"), doctest::Contains("'nope'"), GgufError);
}

TEST_CASE("gguf writer honours a non-default alignment and the reader uses it") {
  const fs::path dir = test::scratch_dir("gguf");
  GgufWriter w;
  w.set_alignment(64);
  w.add_uint32("a", 1);
  w.add_tensor("t0", {1}, GgmlType::F32, f32_bytes({5.0f}));
  w.add_tensor("t1", {2}, GgmlType::F16, {0x00, 0x3C, 0x00, 0xC0});
  const std::vector<uint8_t> bytes = w.to_bytes();
  CHECK(bytes.size() % 64 == 0);
  const std::string path = write_file(dir, "aligned.gguf", bytes);
  auto f = GgufFile::open(path);
  CHECK(f->alignment() == 64);
  CHECK(f->get_uint("general.alignment") == 64);
  CHECK(f->find("general.alignment")->type == ValueType::kUint32);
  CHECK(f->tensor("t0").offset == 0);
  CHECK(f->tensor("t1").offset == 64);
  const auto* base = f->tensor("t0").data;
  CHECK(f->tensor("t1").data - base == 64);
  // The data section starts at a multiple of 64 from the start of the file.
  const size_t data_start = bytes.size() - 128;
  CHECK(data_start % 64 == 0);
  CHECK(std::memcmp(bytes.data() + data_start, base, 4) == 0);
  float v;
  std::memcpy(&v, base, 4);
  CHECK(v == 5.0f);
  CHECK(fp16_to_fp32(static_cast<uint16_t>(f->tensor("t1").data[2] | f->tensor("t1").data[3] << 8)) ==
        -2.0f);

  CHECK_THROWS_AS(w.set_alignment(0), GgufError);
  CHECK_THROWS_AS(w.set_alignment(48), GgufError);
}

TEST_CASE("gguf writer checks tensor shapes and sizes") {
  GgufWriter w;
  CHECK_THROWS_WITH_AS(w.add_tensor("x", {4}, GgmlType::F32, std::vector<uint8_t>(15)),
                       doctest::Contains("'x'"), GgufError);
  CHECK_THROWS_AS(w.add_tensor("x", {16}, GgmlType::Q8_0, std::vector<uint8_t>(17)), GgufError);
  CHECK_THROWS_AS(w.add_tensor("x", {}, GgmlType::F32, {}), GgufError);
  CHECK_THROWS_AS(w.add_tensor("x", {1, 1, 1, 1, 1}, GgmlType::F32, std::vector<uint8_t>(4)),
                  GgufError);
  CHECK_THROWS_AS(w.add_tensor("x", {0}, GgmlType::F32, {}), GgufError);
  CHECK_THROWS_WITH_AS(
      w.add_tensor("x", {4}, static_cast<GgmlType>(4), std::vector<uint8_t>(16)),
      doctest::Contains("unknown ggml type id 4"), GgufError);
  CHECK_THROWS_AS(w.add_tensor_f32("x", {4}, GgmlType::F32, {1, 2, 3}), GgufError);
  CHECK_THROWS_AS(w.write("/nonexistent-dir/x.gguf"), GgufError);
}

TEST_CASE("gguf writer add_tensor_f32 quantizes through quantize_row") {
  const fs::path dir = test::scratch_dir("gguf");
  std::vector<float> vals(64);
  for (size_t i = 0; i < vals.size(); ++i) vals[i] = std::sin(0.37f * static_cast<float>(i)) * 3.0f;
  GgufWriter w;
  w.add_tensor_f32("f32", {32, 2}, GgmlType::F32, vals);
  w.add_tensor_f32("f16", {32, 2}, GgmlType::F16, vals);
  w.add_tensor_f32("q8", {32, 2}, GgmlType::Q8_0, vals);
  auto f = GgufFile::open(write_file(dir, "f32.gguf", w.to_bytes()));
  CHECK(std::memcmp(f->tensor("f32").data, vals.data(), 256) == 0);
  const TensorInfo& h = f->tensor("f16");
  REQUIRE(h.num_bytes == 128);
  for (size_t i = 0; i < vals.size(); ++i) {
    uint16_t x;
    std::memcpy(&x, h.data + 2 * i, 2);
    CHECK(x == fp32_to_fp16(vals[i]));
  }
  const TensorInfo& q = f->tensor("q8");
  REQUIRE(q.num_bytes == 68);
  std::vector<float> back(64);
  for (int r = 0; r < 2; ++r) {
    REQUIRE(dequantize_row(GgmlType::Q8_0, q.data + 34 * r, back.data() + 32 * r, 32));
  }
  for (size_t i = 0; i < vals.size(); ++i) CHECK(back[i] == doctest::Approx(vals[i]).epsilon(0.02).scale(3.0));
}

// ------------------------------------------------------------------------------------------
TEST_CASE("gguf reader rejects missing, empty, short and non-regular files") {
  const fs::path dir = test::scratch_dir("gguf");
  const std::string missing = (dir / "missing.gguf").string();
  CHECK_THROWS_WITH_AS(GgufFile::open(missing),
                       ("cannot open " + missing + ": No such file or directory").c_str(),
                       GgufError);
  expect_rejected(dir, {}, "empty");
  expect_rejected(dir, {'G', 'G', 'U'}, "too short");
  expect_rejected(dir, {'G', 'G', 'U', 'F', 3, 0, 0, 0}, "truncated");
  const std::string msg = [&] {
    try {
      GgufFile::open(dir.string());
    } catch (const GgufError& e) {
      return std::string(e.what());
    }
    return std::string();
  }();
  CHECK(msg.find("not a regular file") != std::string::npos);
}

TEST_CASE("gguf reader rejects a bad magic and unsupported versions") {
  const fs::path dir = test::scratch_dir("gguf");
  std::vector<uint8_t> bytes = small_file_bytes();
  REQUIRE(open_error(dir, bytes).empty());

  auto bad = bytes;
  bad[0] = 'X';
  expect_rejected(dir, bad, "bad magic");
  expect_rejected(dir, {'G', 'G', 'M', 'L', 0, 0, 0, 0}, "bad magic");

  for (uint32_t version : {0u, 1u, 4u, 99u}) {
    CAPTURE(version);
    bad = bytes;
    poke<uint32_t>(bad, 4, version);
    expect_rejected(dir, bad, "unsupported GGUF version " + std::to_string(version));
  }
  bad = bytes;
  poke<uint32_t>(bad, 4, 0x03000000u);
  expect_rejected(dir, bad, "big-endian");

  // Version 2 has the same layout as 3 for everything this reader handles.
  bad = bytes;
  poke<uint32_t>(bad, 4, 2);
  const std::string path = write_file(dir, "v2.gguf", bad);
  CHECK(GgufFile::open(path)->version() == 2);
}

TEST_CASE("gguf reader rejects every truncation of a small file") {
  const fs::path dir = test::scratch_dir("gguf");
  const std::vector<uint8_t> bytes = small_file_bytes();
  REQUIRE(open_error(dir, bytes).empty());
  int accepted = 0;
  int unnamed = 0;
  for (size_t len = 0; len < bytes.size(); ++len) {
    const std::vector<uint8_t> prefix(bytes.begin(), bytes.begin() + static_cast<long>(len));
    const std::string msg = open_error(dir, prefix);
    if (msg.empty()) {
      ++accepted;
      MESSAGE("prefix of length " << len << " was accepted");
    } else if (msg.find((dir / "bad.gguf").string()) == std::string::npos) {
      ++unnamed;
    }
  }
  CHECK(accepted == 0);
  CHECK(unnamed == 0);
}

TEST_CASE("gguf reader rejects bad tensor infos") {
  const fs::path dir = test::scratch_dir("gguf");
  const std::vector<uint8_t> bytes = small_file_bytes();
  const InfoPos q8 = tensor_info_pos(bytes, "q8", 2);
  const InfoPos w = tensor_info_pos(bytes, "w", 1);
  REQUIRE(peek<uint32_t>(bytes, q8.n_dims) == 2);
  REQUIRE(peek<int64_t>(bytes, q8.dims) == 32);
  REQUIRE(peek<uint32_t>(bytes, q8.type) == 8);
  REQUIRE(peek<uint64_t>(bytes, q8.offset) == 0);
  REQUIRE(peek<uint64_t>(bytes, w.offset) == 96);  // 68 bytes padded to 96
  REQUIRE(bytes.size() == (w.offset + 8 + 31) / 32 * 32 + 96 + 32);

  SUBCASE("offset past the end of the file") {
    auto bad = bytes;
    poke<uint64_t>(bad, w.offset, 1024);
    expect_rejected(dir, bad, "past the end of the file");
    expect_rejected(dir, bad, "'w'");
    poke<uint64_t>(bad, w.offset, 128);  // just one alignment unit too far
    expect_rejected(dir, bad, "past the end of the file");
    poke<uint64_t>(bad, w.offset, 0xFFFFFFFFFFFFFFE0ull);  // offset + size wraps around
    expect_rejected(dir, bad, "past the end of the file");
  }
  SUBCASE("misaligned offset") {
    auto bad = bytes;
    poke<uint64_t>(bad, w.offset, 97);
    expect_rejected(dir, bad, "not a multiple of the alignment 32");
    expect_rejected(dir, bad, "byte offset " + std::to_string(w.offset));
  }
  SUBCASE("overlapping tensors") {
    auto bad = bytes;
    poke<uint64_t>(bad, w.offset, 64);  // q8 occupies [0, 68)
    expect_rejected(dir, bad, "overlaps tensor 'q8'");
  }
  SUBCASE("a type relabelled to a smaller valid one") {
    // q8 as Q4_0 is 36 bytes where 68 (padded to 96) are stored: the bytes are Q8_0 blocks
    // and must not be read as Q4_0 ones.
    auto bad = bytes;
    poke<uint32_t>(bad, q8.type, 2);
    expect_rejected(dir, bad, "tensor 'q8': its type q4_0 and shape give 36 bytes, but 96 bytes "
                              "lie before the next tensor ('w'); the type or shape is wrong");
    // A shrunken shape leaves the same kind of gap. (A change smaller than the 32-byte
    // alignment hides in the padding and cannot be told from it.)
    bad = bytes;
    poke<int64_t>(bad, q8.dims + 8, 1);
    expect_rejected(dir, bad, "tensor 'q8': its type q8_0 and shape give 34 bytes");
  }
  SUBCASE("unknown ggml type id") {
    for (uint32_t id : {4u, 17u, 1000u}) {
      auto bad = bytes;
      poke<uint32_t>(bad, w.type, id);
      expect_rejected(dir, bad, "unknown ggml type id " + std::to_string(id));
      expect_rejected(dir, bad, "'w'");
    }
  }
  SUBCASE("dimension count 0 or 5") {
    for (uint32_t n : {0u, 5u, 0xFFFFFFFFu}) {
      auto bad = bytes;
      poke<uint32_t>(bad, q8.n_dims, n);
      expect_rejected(dir, bad, "dimension count " + std::to_string(n));
      expect_rejected(dir, bad, "byte offset " + std::to_string(q8.n_dims));
    }
  }
  SUBCASE("row length not a multiple of the block size") {
    auto bad = bytes;
    poke<int64_t>(bad, q8.dims, 48);
    expect_rejected(dir, bad, "not a multiple of the q8_0 block size 32");
    expect_rejected(dir, bad, "'q8'");
  }
  SUBCASE("non-positive dimension") {
    auto bad = bytes;
    poke<int64_t>(bad, q8.dims + 8, 0);
    expect_rejected(dir, bad, "must be positive");
    poke<int64_t>(bad, q8.dims + 8, -2);
    expect_rejected(dir, bad, "must be positive");
  }
  SUBCASE("element count overflow") {
    auto bad = bytes;
    poke<int64_t>(bad, q8.dims, int64_t{1} << 40);
    poke<int64_t>(bad, q8.dims + 8, int64_t{1} << 40);
    expect_rejected(dir, bad, "element count overflows");
    // Just below int64 overflow: the byte size (34 per 32 elements) still fits in 64 bits,
    // so it is the end-of-file check that must catch it without wrapping.
    bad = bytes;
    poke<int64_t>(bad, q8.dims, std::numeric_limits<int64_t>::max() / 64 * 32);
    poke<int64_t>(bad, q8.dims + 8, 2);
    expect_rejected(dir, bad, "past the end of the file");
    // Huge but non-overflowing sizes still cannot lie inside the file.
    bad = bytes;
    poke<int64_t>(bad, w.dims, int64_t{1} << 40);
    expect_rejected(dir, bad, "past the end of the file");
  }
  SUBCASE("absurd tensor count") {
    auto bad = bytes;
    poke<uint64_t>(bad, 8, uint64_t{1} << 60);
    expect_rejected(dir, bad, "tensor count");
    poke<uint64_t>(bad, 8, 3);  // one more than there is
    expect_rejected(dir, bad, "");
  }
  SUBCASE("duplicate tensor name") {
    GgufWriter wr;
    wr.add_tensor("same", {1}, GgmlType::F32, f32_bytes({1}));
    wr.add_tensor("same", {1}, GgmlType::F32, f32_bytes({2}));
    expect_rejected(dir, wr.to_bytes(), "duplicate tensor name 'same'");
  }
  SUBCASE("absurd tensor name length") {
    auto bad = bytes;
    poke<uint64_t>(bad, q8.n_dims - 2 - 8, uint64_t{1} << 50);
    expect_rejected(dir, bad, "exceeds");
  }
}

TEST_CASE("gguf reader rejects bad metadata") {
  const fs::path dir = test::scratch_dir("gguf");
  const std::vector<uint8_t> bytes = small_file_bytes();
  const size_t arch_key = find_bytes(bytes, "general.architecture");  // first key, at byte 32
  REQUIRE(arch_key == 32);
  const size_t tokens_key = find_bytes(bytes, "tokenizer.ggml.tokens");
  const size_t tokens_type = tokens_key + std::strlen("tokenizer.ggml.tokens");
  const size_t tokens_elem_type = tokens_type + 4;
  const size_t tokens_count = tokens_elem_type + 4;
  REQUIRE(peek<uint32_t>(bytes, tokens_type) == 9);
  REQUIRE(peek<uint32_t>(bytes, tokens_elem_type) == 8);
  REQUIRE(peek<uint64_t>(bytes, tokens_count) == 3);
  const size_t scores_count = find_bytes(bytes, "tiny.scores") + std::strlen("tiny.scores") + 8;
  REQUIRE(peek<uint64_t>(bytes, scores_count) == 2);

  SUBCASE("absurd kv count") {
    auto bad = bytes;
    poke<uint64_t>(bad, 16, 0xFFFFFFFFFFFFFFFFull);
    expect_rejected(dir, bad, "metadata key/value count");
    poke<uint64_t>(bad, 16, 5);  // one more than there is: the tensor infos get misread
    CHECK_FALSE(open_error(dir, bad).empty());
  }
  SUBCASE("absurd key length") {
    auto bad = bytes;
    poke<uint64_t>(bad, arch_key - 8, 0xFFFFFFFFFFFFull);
    expect_rejected(dir, bad, "exceeds");
    expect_rejected(dir, bad, "byte offset 24");
  }
  SUBCASE("absurd string value length") {
    auto bad = bytes;
    const size_t value_len = arch_key + std::strlen("general.architecture") + 4;
    REQUIRE(peek<uint64_t>(bad, value_len) == 4);
    poke<uint64_t>(bad, value_len, uint64_t{1} << 62);
    expect_rejected(dir, bad, "general.architecture");
    expect_rejected(dir, bad, "exceeds");
  }
  SUBCASE("absurd string element length") {
    auto bad = bytes;
    poke<uint64_t>(bad, tokens_count + 8, 0xFFFFFFFFFFFFFFF0ull);
    expect_rejected(dir, bad, "element 0 of key 'tokenizer.ggml.tokens'");
  }
  SUBCASE("absurd array count") {
    auto bad = bytes;
    poke<uint64_t>(bad, tokens_count, uint64_t{1} << 61);
    expect_rejected(dir, bad, "array length");
    expect_rejected(dir, bad, "tokenizer.ggml.tokens");
    bad = bytes;
    poke<uint64_t>(bad, scores_count, 0xFFFFFFFFFFFFFFFFull);
    expect_rejected(dir, bad, "array length");
    expect_rejected(dir, bad, "tiny.scores");
  }
  SUBCASE("unknown value types and nested arrays") {
    auto bad = bytes;
    poke<uint32_t>(bad, tokens_type, 13);
    expect_rejected(dir, bad, "unknown value type 13");
    bad = bytes;
    poke<uint32_t>(bad, tokens_elem_type, 77);
    expect_rejected(dir, bad, "unknown array element type 77");
    bad = bytes;
    poke<uint32_t>(bad, tokens_elem_type, 9);
    expect_rejected(dir, bad, "nested arrays");
  }
  SUBCASE("duplicate key") {
    GgufWriter w;
    w.add_uint32("dup.key", 1);
    w.add_string("other", "x");
    w.add_uint32("dup.key", 2);
    expect_rejected(dir, w.to_bytes(), "duplicate metadata key 'dup.key'");
  }
  SUBCASE("bad bool") {
    GgufWriter w;
    w.add_bool("flag", true);
    auto bad = w.to_bytes();
    const size_t at = find_bytes(bad, "flag") + 4 + 4;
    REQUIRE(bad[at] == 1);
    bad[at] = 2;
    expect_rejected(dir, bad, "flag");
  }
  SUBCASE("bad general.alignment") {
    for (uint32_t a : {0u, 3u, 48u, 0x80000000u}) {
      CAPTURE(a);
      GgufWriter w;
      w.add_uint32("general.alignment", a);
      expect_rejected(dir, w.to_bytes(), "general.alignment");
    }
    GgufWriter w;
    w.add_string("general.alignment", "32");
    expect_rejected(dir, w.to_bytes(), "general.alignment");
  }
}

TEST_CASE("gguf reader survives random corruption") {
  // Flipped bytes anywhere must give either a valid file or a GgufError, never a crash.
  const fs::path dir = test::scratch_dir("gguf");
  const std::vector<uint8_t> bytes = small_file_bytes();
  std::mt19937 rng(1234);
  int errors = 0;
  for (int iter = 0; iter < 400; ++iter) {
    auto bad = bytes;
    const int flips = 1 + static_cast<int>(rng() % 3);
    for (int k = 0; k < flips; ++k) {
      // Bias towards the header and infos, where the structure lives.
      const size_t limit = rng() % 4 == 0 ? bad.size() : std::min<size_t>(bad.size(), 200);
      bad[rng() % limit] = static_cast<uint8_t>(rng());
    }
    try {
      const std::string path = write_file(dir, "fuzz.gguf", bad);
      auto f = GgufFile::open(path);
      for (const TensorInfo& t : f->tensors()) {
        // Touch every byte the reader vouched for.
        volatile uint8_t sink = 0;
        for (size_t i = 0; i < t.num_bytes; ++i) sink = sink ^ t.data[i];
        (void)sink;
      }
    } catch (const GgufError&) {
      ++errors;
    }
  }
  CHECK(errors > 0);
}

TEST_CASE("gguf reader opens the shared gpt-2 vocab file") {
  const fs::path path = test::shared_dir() / "testdata/tokenizer/ggml-vocab-gpt-2.gguf";
  if (!fs::exists(path)) {
    MESSAGE("skipping: " << path.string() << " does not exist");
    return;
  }
  auto f = GgufFile::open(path.string());
  CHECK((f->version() == 2 || f->version() == 3));
  CHECK(f->get_string("tokenizer.ggml.model") == "gpt2");
  const auto* tokens = f->opt_string_array("tokenizer.ggml.tokens");
  REQUIRE(tokens != nullptr);
  CHECK_FALSE(tokens->empty());
  MESSAGE("gpt-2 vocab: " << tokens->size() << " tokens, " << f->metadata().size() << " keys, "
                          << f->tensors().size() << " tensors");
}
