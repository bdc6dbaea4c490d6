// tessera quantize's library (tessera/quantize.h) and the weight quantizers under it:
//  - bit-identity with llama.cpp's llama-quantize on the real model, through SHA-256 fixtures
//    the peer wrote (tests/fixtures/quantize/llama_quantize_sha256.json);
//  - round-trip error bounds per type, and importance weighting lowering the weighted error;
//  - llama-quantize's tensor rules on a synthetic model;
//  - the atomic write: a failed write (file size limit standing in for a full disk, a
//    destination in no directory, an exception mid-write) leaves no file, and says why;
//  - the imatrix file round trip and bad input.
#include <doctest/doctest.h>
#include <nlohmann/json.hpp>
#include <openssl/evp.h>
#include <sys/resource.h>

#include <algorithm>
#include <cctype>
#include <csignal>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "support/real_model.h"
#include "support/test_env.h"
#include "tessera/ggml_types.h"
#include "tessera/gguf.h"
#include "tessera/quantize.h"

using namespace tessera;
namespace fs = std::filesystem;

namespace {

std::string sha256_hex(const std::vector<uint8_t>& bytes) {
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int n = 0;
  REQUIRE(EVP_Digest(bytes.data(), bytes.size(), md, &n, EVP_sha256(), nullptr) == 1);
  static const char* hex = "0123456789abcdef";
  std::string s;
  for (unsigned int i = 0; i < n; ++i) {
    s += hex[md[i] >> 4];
    s += hex[md[i] & 15];
  }
  return s;
}

// GGML type names as llama-quantize's fixtures and --type spell them ("Q4_K", not ggml's "q4_K").
std::string upper_name(GgmlType t) {
  std::string s = ggml_type_name(t);
  for (char& c : s) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return s;
}

std::vector<float> gaussian(size_t n, uint32_t seed, float sigma = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, sigma);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

// Sum over elements of w[c] * (x - dequantize(quantize(x)))^2, and of w[c] * x^2.
std::pair<double, double> weighted_error(GgmlType type, const std::vector<float>& x, int64_t cols,
                                         const float* importance, const std::vector<float>& w) {
  const int64_t rows = static_cast<int64_t>(x.size()) / cols;
  std::vector<uint8_t> q(ggml_row_size(type, cols));
  std::vector<float> y(static_cast<size_t>(cols));
  double err = 0, ref = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x.data() + r * cols;
    REQUIRE(quantize_weight_row(type, xr, q.data(), cols, importance));
    REQUIRE(dequantize_row(type, q.data(), y.data(), cols));
    for (int64_t c = 0; c < cols; ++c) {
      err += w[c] * double(xr[c] - y[c]) * (xr[c] - y[c]);
      ref += w[c] * double(xr[c]) * xr[c];
    }
  }
  return {err, ref};
}

const GgmlType kWeightTypes[] = {GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q5_0, GgmlType::Q5_1,
                                 GgmlType::Q8_0, GgmlType::Q4_K, GgmlType::Q5_K,
                                 GgmlType::Q6_K};

}  // namespace

TEST_CASE("every weight type round-trips gaussian rows within its error bound") {
  // Relative RMS error bounds for N(0, 1) rows, 1.25x what these seeds give (0.0856, 0.0778,
  // 0.0421, 0.0376, 0.00536, 0.0709, 0.0177): each format's step, with no slack for a
  // regression that loses a bit.
  const std::pair<GgmlType, double> bounds[] = {
      {GgmlType::Q4_0, 0.107}, {GgmlType::Q4_1, 0.097}, {GgmlType::Q5_0, 0.053},
      {GgmlType::Q5_1, 0.047}, {GgmlType::Q8_0, 0.0067}, {GgmlType::Q4_K, 0.089},
      {GgmlType::Q5_K, 0.046}, {GgmlType::Q6_K, 0.022}};
  const int64_t cols = 512;
  const std::vector<float> x = gaussian(cols * 16, 7);
  const std::vector<float> ones(cols, 1.0f);
  for (const auto& [type, bound] : bounds) {
    CAPTURE(upper_name(type));
    const auto [err, ref] = weighted_error(type, x, cols, nullptr, ones);
    const double rel = std::sqrt(err / ref);
    MESSAGE(upper_name(type) << " relative RMS error " << rel);
    CHECK(rel > 0.0);
    CHECK(rel < bound);
  }
}

TEST_CASE("quantize_row writes the K-quants too, the same bytes as quantize_weight_row without importance") {
  const std::vector<float> x = gaussian(1024, 3);
  for (GgmlType type : {GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::Q6_K}) {
    std::vector<uint8_t> a(ggml_row_size(type, 1024)), b(a.size());
    REQUIRE(quantize_row(type, x.data(), a.data(), 1024));
    REQUIRE(quantize_weight_row(type, x.data(), b.data(), 1024, nullptr));
    CHECK(a == b);
  }
  // An all-zero row stays all zero (the degenerate branches of the scale searches).
  std::vector<float> zero(256, 0.0f), back(256, 1.0f);
  for (GgmlType type : kWeightTypes) {
    std::vector<float> imp(256, 1.0f);
    std::vector<uint8_t> q(ggml_row_size(type, 256));
    REQUIRE(quantize_weight_row(type, zero.data(), q.data(), 256, imp.data()));
    REQUIRE(dequantize_row(type, q.data(), back.data(), 256));
    for (float v : back) CHECK(v == 0.0f);
  }
}

TEST_CASE("importance weighting lowers the importance-weighted error of every searched type") {
  // Columns of very different importance, as activations have (a few outlier channels).
  const int64_t cols = 512;
  const std::vector<float> x = gaussian(cols * 32, 11);
  std::vector<float> imp(cols);
  std::mt19937 rng(5);
  std::lognormal_distribution<float> spread(0.0f, 1.5f);
  for (auto& v : imp) v = spread(rng);
  for (GgmlType type : kWeightTypes) {
    CAPTURE(upper_name(type));
    const auto [plain, ref] = weighted_error(type, x, cols, nullptr, imp);
    const auto [weighted, ref2] = weighted_error(type, x, cols, imp.data(), imp);
    MESSAGE(upper_name(type) << " weighted error: rtn " << plain / ref << ", importance " << weighted / ref);
    if (type == GgmlType::Q8_0) {
      CHECK(weighted == plain);  // ggml's Q8_0 ignores the importance
    } else {
      CHECK(weighted < 0.95 * plain);
    }
  }
}

TEST_CASE("bit-identical to llama-quantize on the real model (SHA-256 fixtures from the peer)") {
  // Labels are "TYPE [--pure] [--imatrix]": llama-quantize --allow-requantize [--pure]
  // [--imatrix synthetic.imatrix] of the default model (Q4_K / Q5_K: ftype Q4_K_S / Q5_K_S
  // with --pure).
  // synthetic.imatrix holds lognormal importances for the blk.0 and blk.29 weights only.
  if (!test::have_real_model()) return;
  const fs::path dir = test::source_dir() / "tests/fixtures/quantize";
  std::ifstream in(dir / "llama_quantize_sha256.json");
  REQUIRE(in.good());
  const auto fixture = nlohmann::json::parse(in);
  const auto imatrix = quant::ImportanceMatrix::read((dir / "synthetic.imatrix").string());
  auto file = gguf::GgufFile::open(test::real_model_path());
  int checked = 0, weighted = 0;
  for (const auto& [label, tensors] : fixture.at("types").items()) {
    const bool pure = label.find("--pure") != std::string::npos;
    const bool with_imatrix = label.find("--imatrix") != std::string::npos;
    GgmlType target;
    REQUIRE(quant::parse_target_type(label.substr(0, label.find(' ')), &target));
    const auto plan = quant::plan_tensors(*file, target, pure, with_imatrix);
    for (const auto& [name, want] : tensors.items()) {
      CAPTURE(label);
      CAPTURE(name);
      const gguf::TensorInfo& t = file->tensor(name);
      const auto p = std::find_if(plan.begin(), plan.end(), [&](const auto& e) { return e.name == name; });
      REQUIRE(p != plan.end());
      CHECK(upper_name(p->to) == want.at("type").get<std::string>());
      const std::vector<float> importance = with_imatrix ? imatrix.mean(name) : std::vector<float>{};
      weighted += !importance.empty() && p->to != p->from;
      const std::vector<uint8_t> bytes =
          p->to == p->from ? std::vector<uint8_t>(t.data, t.data + t.num_bytes)
                           : quant::convert_tensor(t, p->to, importance.empty() ? nullptr : importance.data(), 2);
      CHECK(sha256_hex(bytes) == want.at("sha256").get<std::string>());
      ++checked;
    }
  }
  CHECK(checked == 15 * 13);
  CHECK(weighted >= 5 * 8);  // the importance path is exercised, not only the copies
}

TEST_CASE("plan_tensors follows llama-quantize's rules") {
  const fs::path dir = test::scratch_dir("quantize_plan");
  gguf::GgufWriter w;
  w.add_string("general.architecture", "llama");
  w.add_tensor_f32("token_embd.weight", {512, 4}, GgmlType::F32, gaussian(2048, 1));
  w.add_tensor_f32("output.weight", {512, 4}, GgmlType::F32, gaussian(2048, 2));
  w.add_tensor_f32("blk.0.attn_norm.weight", {512}, GgmlType::F32, gaussian(512, 3));
  w.add_tensor_f32("blk.0.attn_q.weight", {576, 2}, GgmlType::F32, gaussian(1152, 4));
  w.add_tensor_f32("blk.0.ffn_down.weight", {512, 2}, GgmlType::F32, gaussian(1024, 5));
  w.add_tensor_f32("blk.0.attn_q.bias", {4, 2}, GgmlType::F32, gaussian(8, 7));
  const std::string path = (dir / "tiny.gguf").string();
  w.write(path);
  auto file = gguf::GgufFile::open(path);
  auto types = [&](GgmlType target, bool pure) {
    std::map<std::string, std::string> m;
    for (const auto& p : quant::plan_tensors(*file, target, pure)) m[p.name] = upper_name(p.to);
    return m;
  };
  auto q4k = types(GgmlType::Q4_K, false);
  CHECK(q4k["token_embd.weight"] == "Q4_K");       // untied: an ordinary weight
  CHECK(q4k["output.weight"] == "Q6_K");           // the output rule
  CHECK(q4k["blk.0.attn_norm.weight"] == "F32");   // 1-D: kept
  CHECK(q4k["blk.0.attn_q.weight"] == "Q5_0");     // 576 % 256 != 0: Q4_K -> Q5_0
  CHECK(q4k["blk.0.ffn_down.weight"] == "Q4_K");
  CHECK(q4k["blk.0.attn_q.bias"] == "F32");        // not a weight
  auto q80 = types(GgmlType::Q8_0, false);
  CHECK(q80["output.weight"] == "Q8_0");
  auto pure = types(GgmlType::Q4_0, true);
  CHECK(pure["output.weight"] == "Q4_0");
  auto f16 = types(GgmlType::F16, false);
  CHECK(f16["output.weight"] == "F16");
  // A row that not even a 32-element block divides: one error naming the tensor (llama.cpp
  // would write it as F16), for a quantized target; float targets take any length.
  gguf::GgufWriter odd;
  odd.add_tensor_f32("blk.0.odd.weight", {48, 2}, GgmlType::F32, gaussian(96, 6));
  const std::string odd_path = (dir / "odd.gguf").string();
  odd.write(odd_path);
  auto odd_file = gguf::GgufFile::open(odd_path);
  CHECK_THROWS_WITH(quant::plan_tensors(*odd_file, GgmlType::Q4_K, false),
                    "tensor 'blk.0.odd.weight': row length 48 is not a multiple of the q4_K block size 256 "
                    "nor of its fallback q5_0's 32");
  CHECK_THROWS_WITH(quant::plan_tensors(*odd_file, GgmlType::Q8_0, false),
                    "tensor 'blk.0.odd.weight': row length 48 is not a multiple of the q8_0 block size 32");
  CHECK(quant::plan_tensors(*odd_file, GgmlType::BF16, false)[0].to == GgmlType::BF16);
}

TEST_CASE("quantize_model writes a loadable file with llama.cpp's metadata and converted tensors") {
  const fs::path dir = test::scratch_dir("quantize_model");
  gguf::GgufWriter w;
  w.add_string("general.architecture", "llama");
  w.add_uint32("general.file_type", 0);
  w.add_int32_array("tokenizer.ggml.token_type", {1, 2, 3});
  w.add_tensor_f32("blk.0.ffn_down.weight", {512, 3}, GgmlType::F32, gaussian(1536, 9));
  w.add_tensor_f32("blk.0.ffn_norm.weight", {512}, GgmlType::F32, gaussian(512, 10));
  const std::string in = (dir / "in.gguf").string();
  w.write(in);
  quant::QuantizeOptions o;
  o.input = in;
  o.output = (dir / "out.gguf").string();
  o.target = GgmlType::Q4_K;
  o.threads = 2;
  const auto r = quant::quantize_model(o);
  CHECK(r.output_bytes == fs::file_size(o.output));
  auto out = gguf::GgufFile::open(o.output);
  CHECK(out->get_uint("general.file_type") == 14);
  CHECK(out->get_uint("general.quantization_version") == 2);
  CHECK(out->get_string("general.architecture") == "llama");
  CHECK(out->opt_int_array("tokenizer.ggml.token_type") == std::vector<int64_t>{1, 2, 3});
  CHECK(out->tensor("blk.0.ffn_down.weight").type == GgmlType::Q4_K);
  CHECK(out->tensor("blk.0.ffn_norm.weight").type == GgmlType::F32);
  // The quantized tensor holds quantize_row's bytes of the input rows.
  auto src = gguf::GgufFile::open(in);
  const auto& t = src->tensor("blk.0.ffn_down.weight");
  std::vector<uint8_t> want(ggml_row_size(GgmlType::Q4_K, 512) * 3);
  for (int r = 0; r < 3; ++r)
    REQUIRE(quantize_row(GgmlType::Q4_K, reinterpret_cast<const float*>(t.data) + r * 512,
                         want.data() + r * ggml_row_size(GgmlType::Q4_K, 512), 512));
  const auto& q = out->tensor("blk.0.ffn_down.weight");
  CHECK(std::vector<uint8_t>(q.data, q.data + q.num_bytes) == want);
  // Nothing but the output is left in the directory (no temporary file).
  int files = 0;
  for ([[maybe_unused]] const auto& e : fs::directory_iterator(dir)) ++files;
  CHECK(files == 2);

  SUBCASE("a source type it cannot read is one error naming the tensor, and no file") {
    gguf::GgufWriter bad;
    bad.add_tensor("blk.0.attn_q.weight", {256, 1}, GgmlType::Q3_K, std::vector<uint8_t>(110, 0));
    const std::string bad_in = (dir / "q3k.gguf").string();
    bad.write(bad_in);
    o.input = bad_in;
    o.output = (dir / "never.gguf").string();
    CHECK_THROWS_WITH(quant::quantize_model(o),
                      doctest::Contains("tensor 'blk.0.attn_q.weight' is of type q3_K"));
    CHECK_FALSE(fs::exists(o.output));
  }
  SUBCASE("the output may not be the input") {
    o.output = in;
    CHECK_THROWS_WITH(quant::quantize_model(o), doctest::Contains("is the input file"));
  }
}

TEST_CASE("a failed write leaves no file and names the path and the reason") {
  const fs::path dir = test::scratch_dir("quantize_atomic");
  const std::vector<uint8_t> big(1 << 20, 0xAB);
  auto count_files = [&] {
    int n = 0;
    for ([[maybe_unused]] const auto& e : fs::directory_iterator(dir)) ++n;
    return n;
  };
  SUBCASE("the disk fills up (a file size limit makes write() fail with EFBIG)") {
    const std::string path = (dir / "full.gguf").string();
    rlimit old{};
    REQUIRE(getrlimit(RLIMIT_FSIZE, &old) == 0);
    auto* old_handler = std::signal(SIGXFSZ, SIG_IGN);
    rlimit small = old;
    small.rlim_cur = 64 * 1024;
    REQUIRE(setrlimit(RLIMIT_FSIZE, &small) == 0);
    std::string error;
    try {
      gguf::write_file_atomic(path, [&](const gguf::WriteFn& put) { put(big.data(), big.size()); });
    } catch (const gguf::GgufError& e) {
      error = e.what();
    }
    setrlimit(RLIMIT_FSIZE, &old);
    std::signal(SIGXFSZ, old_handler);
    CHECK(error.find("cannot write " + path) != std::string::npos);
    CHECK(error.find("too large") != std::string::npos);  // strerror(EFBIG)
    CHECK(count_files() == 0);
  }
  SUBCASE("the destination's directory does not exist or is a file") {
    for (const std::string path : {(dir / "missing" / "x.gguf").string(), std::string("/etc/hostname/x.gguf")}) {
      CAPTURE(path);
      const std::string want = "cannot write " + path;
      CHECK_THROWS_WITH(gguf::write_file_atomic(path, [&](const gguf::WriteFn& put) { put(big.data(), 10); }),
                        doctest::Contains(want.c_str()));
      CHECK_FALSE(fs::exists(path));
    }
    CHECK(count_files() == 0);
  }
  SUBCASE("an error while producing the bytes keeps the old file and removes the temporary") {
    const std::string path = (dir / "keep.gguf").string();
    gguf::write_file_atomic(path, [&](const gguf::WriteFn& put) { put("old", 3); });
    CHECK_THROWS_WITH(gguf::write_file_atomic(path, [&](const gguf::WriteFn& put) {
                        put(big.data(), big.size());
                        throw std::runtime_error("tensor 7 failed");
                      }),
                      "tensor 7 failed");
    CHECK(fs::file_size(path) == 3);
    CHECK(count_files() == 1);
  }
}

TEST_CASE("an importance matrix survives its file (llama-imatrix's GGUF layout)") {
  const fs::path dir = test::scratch_dir("quantize_imatrix");
  quant::ImportanceMatrix m;
  m.datasets = {"/usr/share/common-licenses/GFDL-1.3"};
  m.chunk_count = 3;
  m.chunk_size = 512;
  m.entries["blk.0.attn_q.weight"] = {{1.0, 4.0, 9.0, 0.5}, 2};
  const std::string path = (dir / "imatrix.gguf").string();
  m.write(path);
  const auto r = quant::ImportanceMatrix::read(path);
  CHECK(r.datasets == m.datasets);
  CHECK(r.chunk_count == 3);
  CHECK(r.chunk_size == 512);
  CHECK(r.mean("blk.0.attn_q.weight") == std::vector<float>{0.5f, 2.0f, 4.5f, 0.25f});
  CHECK(r.mean("blk.1.attn_q.weight").empty());
  auto file = gguf::GgufFile::open(path);
  CHECK(file->get_string("general.type") == "imatrix");
  CHECK(file->tensor("blk.0.attn_q.weight.in_sum2").dims == std::vector<int64_t>{4, 1});
  // A GGUF without entries is no imatrix.
  gguf::GgufWriter w;
  w.add_string("general.type", "model");
  const std::string not_imatrix = (dir / "model.gguf").string();
  w.write(not_imatrix);
  CHECK_THROWS_WITH(quant::ImportanceMatrix::read(not_imatrix), doctest::Contains("no imatrix entries"));
}

TEST_CASE("target type names") {
  GgmlType t;
  CHECK(quant::parse_target_type("q4_k", &t));
  CHECK(t == GgmlType::Q4_K);
  CHECK_FALSE(quant::parse_target_type("Q3_K", &t));
  CHECK(quant::target_type_names().find("Q6_K") != std::string::npos);
  CHECK(quant::llama_file_type(GgmlType::Q8_0) == 7);
  CHECK(quant::llama_file_type(GgmlType::Q5_1) == 9);
}
