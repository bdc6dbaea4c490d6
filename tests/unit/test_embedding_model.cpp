// The embedding model (all-MiniLM-L6-v2 run by Tessera): WordPiece on a small inline
// vocabulary, then token ids identical to sentence-transformers' and embeddings within 1e-4
// cosine of its on the committed fixtures (scripts/make-embedding-fixtures.py).
#include <doctest/doctest.h>

#include <nlohmann/json.hpp>

#include <cmath>
#include <filesystem>
#include <fstream>

#include "support/test_env.h"
#include "tessera/config.h"
#include "tessera/embedding/encoder_model.h"
#include "tessera/embedding/wordpiece.h"

using namespace tessera;
using nlohmann::json;

namespace {

std::unique_ptr<WordPieceTokenizer> tiny_tokenizer() {
  json vocab = json::object();
  const char* tokens[] = {"[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "hello", ",", "world", "!", "un",
                          "##aff", "##able", "cafe", "creme", "a", "b", "中", "."};
  for (int i = 0; i < static_cast<int>(std::size(tokens)); ++i) vocab[tokens[i]] = i;
  json j = {{"model", {{"type", "WordPiece"}, {"unk_token", "[UNK]"}, {"continuing_subword_prefix", "##"},
                       {"max_input_chars_per_word", 100}, {"vocab", vocab}}},
            {"normalizer", {{"type", "BertNormalizer"}, {"clean_text", true}, {"handle_chinese_chars", true},
                            {"strip_accents", nullptr}, {"lowercase", true}}},
            {"pre_tokenizer", {{"type", "BertPreTokenizer"}}},
            {"added_tokens", json::array({{{"id", 4}, {"content", "[MASK]"}}, {{"id", 3}, {"content", "[SEP]"}}})}};
  return WordPieceTokenizer::from_json_text(j.dump(), "inline");
}

std::filesystem::path model_dir() {
  return test::env_or("TESSERA_EMBEDDING_MODEL_PATH",
                      (std::filesystem::path(model_cache_dir()) / "all-MiniLM-L6-v2").string());
}

bool have_model() {
  if (std::filesystem::exists(model_dir() / "model.safetensors")) return true;
  if (test::env_or("TESSERA_REQUIRE_MODEL", "") == "1")
    FAIL("the embedding model is missing at " << model_dir() << " (run scripts/fetch-models.sh)");
  MESSAGE("skipped: embedding model not found at " << model_dir() << " (run scripts/fetch-models.sh)");
  return false;
}

double cosine(const std::vector<float>& a, const std::vector<double>& b) {
  double ab = 0, aa = 0, bb = 0;
  for (size_t i = 0; i < a.size(); ++i) ab += a[i] * b[i], aa += double(a[i]) * a[i], bb += b[i] * b[i];
  return ab / std::sqrt(aa * bb);
}

}  // namespace

TEST_CASE("WordPiece: BERT normalizer, punctuation split, longest-match pieces, [UNK], template") {
  auto tok = tiny_tokenizer();
  CHECK(tok->normalize("Héllo\tWORLD") == "hello world");
  CHECK(tok->normalize("a\u0007b") == "ab");            // control characters are dropped
  CHECK(tok->normalize("a中b") == "a 中 b");             // CJK ideographs stand alone
  CHECK(tok->encode_pieces("Hello, world!") == std::vector<int32_t>{5, 6, 7, 8});
  CHECK(tok->encode_pieces("unaffable") == std::vector<int32_t>{9, 10, 11});
  CHECK(tok->encode_pieces("Café crème") == std::vector<int32_t>{12, 13});
  CHECK(tok->encode_pieces("unaffablex") == std::vector<int32_t>{1});  // a rest that matches nothing: [UNK]
  CHECK(tok->encode_pieces("hello [MASK] world[SEP]") == std::vector<int32_t>{5, 4, 7, 3});
  CHECK(tok->encode("hello world", 512) == std::vector<int32_t>{2, 5, 7, 3});
  CHECK(tok->encode("a b a b a b", 4) == std::vector<int32_t>{2, 14, 15, 3});  // cut to 4 with [CLS]/[SEP]
  CHECK(tok->encode("", 8) == std::vector<int32_t>{2, 3});
  CHECK_THROWS_WITH_AS(WordPieceTokenizer::from_json_text(R"({"model": {"type": "BPE"}})", "x.json"),
                       doctest::Contains("x.json: model.type: expected \"WordPiece\""), std::runtime_error);
}

TEST_CASE("all-MiniLM-L6-v2: token ids identical and embeddings within 1e-4 cosine of sentence-transformers") {
  if (!have_model()) return;
  std::ifstream in(test::source_dir() / "tests/fixtures/embedding/all-minilm-l6-v2.json");
  REQUIRE(in);
  const json fixture = json::parse(in);
  auto model = EncoderModel::load(model_dir().string(), 2);
  CHECK(model->dimension() == 384);
  CHECK(model->max_tokens() == fixture.at("max_seq_length").get<int>());
  int checked = 0;
  double worst = 1;
  for (const json& c : fixture.at("cases")) {
    const std::string text = c.at("text").get<std::string>();
    CAPTURE(text);
    const std::vector<int32_t> ids = model->encode(text);
    CHECK(ids == c.at("ids").get<std::vector<int32_t>>());
    const std::vector<float> e = model->embed({ids})[0];
    const double cos = cosine(e, c.at("embedding").get<std::vector<double>>());
    worst = std::min(worst, cos);
    CHECK(cos >= 1 - 1e-4);
    double norm = 0;
    for (float x : e) norm += double(x) * x;
    CHECK(std::fabs(norm - 1) < 1e-5);
    ++checked;
  }
  MESSAGE(checked << " fixture sentences; lowest cosine to sentence-transformers " << worst);
  CHECK(checked >= 20);
}

TEST_CASE("EncoderModel refuses inputs it cannot embed, naming the input") {
  if (!have_model()) return;
  auto model = EncoderModel::load(model_dir().string(), 1);
  CHECK_THROWS_WITH_AS(model->embed({{101, 102}, {}}), doctest::Contains("input 1 has 0 tokens"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(model->embed({{101, 999999}}), doctest::Contains("token id 999999 is outside"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(EncoderModel::load("/nonexistent-model-dir", 1), doctest::Contains("not a directory"),
                       std::runtime_error);
}
