// Tokenizer conformance with llama.cpp: the ggml-vocab-*.gguf.inp/.out pairs from llama.cpp's
// test-tokenizer-0, detokenization, streaming UTF-8 safety, special-token partitioning and
// the SmolLM2 vocabulary (ids captured from llama.cpp via llama-cpp-python).
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "support/test_env.h"
#include "tessera/chat_template.h"
#include "tessera/gguf.h"
#include "tessera/tokenizer.h"

namespace fs = std::filesystem;
using tessera::StreamingDetokenizer;
using tessera::Tokenizer;

namespace {

std::string read_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  REQUIRE_MESSAGE(in.good(), "cannot open " << path.string());
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

struct VocabCase {
  std::string text;
  std::vector<int32_t> ids;
};

// Parses the .inp/.out pair exactly as llama.cpp's tests/test-tokenizer-0.cpp read_tests():
// inputs are separated by "\n__ggml_vocab_test__\n", the .out has one line of ids per input.
std::vector<VocabCase> read_vocab_cases(const fs::path& vocab) {
  const std::string raw = read_file(vocab.string() + ".inp");
  const std::string out = read_file(vocab.string() + ".out");
  const std::string sep = "\n__ggml_vocab_test__\n";

  std::vector<std::string> inputs;
  size_t pos = 0;
  while (pos < raw.size()) {
    const size_t next = raw.find(sep, pos);
    if (next == std::string::npos) {
      inputs.push_back(raw.substr(pos));
      break;
    }
    inputs.push_back(raw.substr(pos, next - pos));
    pos = next + sep.size();
  }

  std::vector<std::string> lines;
  std::istringstream out_stream(out);
  for (std::string line; std::getline(out_stream, line);) lines.push_back(line);
  REQUIRE(inputs.size() == lines.size());

  std::vector<VocabCase> cases;
  for (size_t i = 0; i < inputs.size(); ++i) {
    VocabCase c{inputs[i], {}};
    std::istringstream ids(lines[i]);
    for (int32_t id; ids >> id;) c.ids.push_back(id);
    cases.push_back(std::move(c));
  }
  return cases;
}

std::unique_ptr<Tokenizer> load_tokenizer(const fs::path& path) {
  auto file = tessera::gguf::GgufFile::open(path.string());
  return Tokenizer::from_gguf(*file);
}

fs::path vocab_path(const std::string& name) {
  return tessera::test::shared_dir() / "testdata" / "tokenizer" / name;
}

std::string ids_to_string(const std::vector<int32_t>& ids) {
  std::string s;
  for (const int32_t id : ids) s += std::to_string(id) + " ";
  return s;
}

bool is_valid_utf8(const std::string& s) {
  size_t i = 0;
  while (i < s.size()) {
    const auto b0 = static_cast<uint8_t>(s[i]);
    size_t len;
    uint32_t cp;
    if (b0 < 0x80) { len = 1; cp = b0; }
    else if ((b0 & 0xE0) == 0xC0) { len = 2; cp = b0 & 0x1F; }
    else if ((b0 & 0xF0) == 0xE0) { len = 3; cp = b0 & 0x0F; }
    else if ((b0 & 0xF8) == 0xF0) { len = 4; cp = b0 & 0x07; }
    else return false;
    if (i + len > s.size()) return false;
    for (size_t k = 1; k < len; ++k) {
      const auto b = static_cast<uint8_t>(s[i + k]);
      if ((b & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (b & 0x3F);
    }
    static const uint32_t kMin[] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < kMin[len] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
    i += len;
  }
  return true;
}

// Runs one vocabulary's llama.cpp test cases; returns {passed, total}.
std::pair<size_t, size_t> run_vocab_cases(const std::string& name) {
  const fs::path path = vocab_path(name);
  auto tok = load_tokenizer(path);
  const auto cases = read_vocab_cases(path);
  size_t passed = 0;
  for (const auto& c : cases) {
    // test-tokenizer-0 tokenizes with add_special=false, parse_special=false.
    const auto ids = tok->encode(c.text, false, false);
    if (ids == c.ids) {
      passed++;
    } else {
      FAIL_CHECK(name << ": '" << c.text << "'\n  expected " << ids_to_string(c.ids)
                      << "\n  got      " << ids_to_string(ids));
    }
  }
  MESSAGE(name << ": " << passed << "/" << cases.size() << " llama.cpp tokenizer cases identical");
  return {passed, cases.size()};
}

// Inputs whose text llama.cpp's detokenizer changes on purpose (clean_spaces removes the space
// in " ?", " !", " .", " ,", " 's", " 'm", " 're", " 've" and around " ' ").
bool survives_space_cleanup(const std::string& s) {
  for (const char* pattern : {" ?", " !", " .", " ,", " '"}) {
    if (s.find(pattern) != std::string::npos) return false;
  }
  return true;
}

std::string model_path() {
  const char* env = std::getenv("TESSERA_MODEL_PATH");
  if (env && *env) return env;
  const char* home = std::getenv("HOME");
  return std::string(home ? home : "") + "/.cache/tessera/models/SmolLM2-135M-Instruct.Q4_1.gguf";
}

}  // namespace

TEST_CASE("llama.cpp vocab test: gpt-2 (byte-level BPE)") {
  const auto [passed, total] = run_vocab_cases("ggml-vocab-gpt-2.gguf");
  CHECK(total > 0);
  CHECK(passed == total);
}

TEST_CASE("llama.cpp vocab test: llama-spm (SentencePiece BPE)") {
  const auto [passed, total] = run_vocab_cases("ggml-vocab-llama-spm.gguf");
  CHECK(total > 0);
  CHECK(passed == total);
}

TEST_CASE("vocab metadata") {
  auto gpt2 = load_tokenizer(vocab_path("ggml-vocab-gpt-2.gguf"));
  CHECK(gpt2->model_name() == "gpt2");
  CHECK(gpt2->pre_tokenizer() == "gpt-2");
  CHECK(gpt2->kind() == Tokenizer::Kind::kBpe);
  CHECK(gpt2->vocab_size() == 50257);
  CHECK(gpt2->bos_id() == 50256);
  CHECK(gpt2->eos_id() == 50256);
  CHECK(gpt2->is_end_of_generation(50256));  // <|endoftext|>
  CHECK_FALSE(gpt2->is_end_of_generation(0));
  CHECK_FALSE(gpt2->add_bos());
  CHECK(gpt2->find_token("Hello") == 15496);
  CHECK_FALSE(gpt2->find_token("no such token").has_value());

  auto spm = load_tokenizer(vocab_path("ggml-vocab-llama-spm.gguf"));
  CHECK(spm->model_name() == "llama");
  CHECK(spm->kind() == Tokenizer::Kind::kSpm);
  CHECK(spm->vocab_size() == 32000);
  CHECK(spm->bos_id() == 1);
  CHECK(spm->eos_id() == 2);
  CHECK(spm->add_bos());
  CHECK(spm->is_end_of_generation(2));  // </s>
  // add_special prepends BOS for SPM; the text gets SentencePiece's space prefix.
  const auto ids = spm->encode("Hello", true, false);
  REQUIRE(ids.size() >= 2);
  CHECK(ids[0] == 1);
  CHECK(spm->token_to_piece(ids[1], false) == " Hello");
  // Control tokens render only on request.
  CHECK(spm->token_to_piece(1, false).empty());
  CHECK(spm->token_to_piece(1, true) == "<s>");
  // "<s>" is plain text unless parse_special.
  CHECK(spm->encode("<s>", false, true) == std::vector<int32_t>{1});
  CHECK(spm->encode("<s>", false, false) != std::vector<int32_t>{1});
  // Byte-fallback tokens are raw bytes.
  CHECK(spm->token_to_piece(*spm->find_token("<0x0A>"), false) == "\n");
}

TEST_CASE("detokenization round-trips") {
  for (const std::string name : {"ggml-vocab-gpt-2.gguf", "ggml-vocab-llama-spm.gguf"}) {
    auto tok = load_tokenizer(vocab_path(name));
    size_t checked = 0;
    for (const auto& c : read_vocab_cases(vocab_path(name))) {
      if (tok->clean_spaces() && !survives_space_cleanup(c.text)) continue;
      CHECK_MESSAGE(tok->decode(tok->encode(c.text, false, false), false) == c.text,
                    name << ": '" << c.text << "'");
      // Decoding the reference ids gives the same text as decoding ours.
      CHECK(tok->decode(c.ids, false) == c.text);
      checked++;
    }
    MESSAGE(name << ": " << checked << " inputs round-trip through decode(encode(s))");
    CHECK(checked > 30);
  }
}

TEST_CASE("decode applies llama.cpp's space clean-up for GPT-2") {
  auto tok = load_tokenizer(vocab_path("ggml-vocab-gpt-2.gguf"));
  CHECK(tok->decode(tok->encode("Hello , world !", false, false), false) == "Hello, world!");
  CHECK(tok->decode(tok->encode("it 's", false, false), false) == "it's");
  CHECK(tok->decode(tok->encode("it 'd", false, false), false) == "it 'd");
}

TEST_CASE("streaming detokenizer never emits partial UTF-8") {
  const std::string text = "Emoji 🦙🚀😶‍🌫️ and CJK 我想在apple工作 · 한국어 नमस्ते ∑x²";
  for (const std::string name : {"ggml-vocab-gpt-2.gguf", "ggml-vocab-llama-spm.gguf"}) {
    auto tok = load_tokenizer(vocab_path(name));
    const auto ids = tok->encode(text, false, false);
    StreamingDetokenizer stream(*tok);
    std::string streamed, pieces;
    size_t held_back = 0;
    for (const int32_t id : ids) {
      const std::string piece = tok->token_to_piece(id, false);
      pieces += piece;
      const std::string out = stream.push(id);
      CHECK_MESSAGE(is_valid_utf8(out), name << ": push emitted invalid UTF-8");
      if (!is_valid_utf8(piece)) held_back++;
      streamed += out;
    }
    streamed += stream.flush();
    CHECK(streamed == pieces);
    // Both vocabularies split some of these characters into byte tokens.
    CHECK_MESSAGE(held_back > 0, name << ": no token split a character; the test is vacuous");
  }
}

TEST_CASE("streaming detokenizer replaces invalid bytes") {
  auto tok = load_tokenizer(vocab_path("ggml-vocab-gpt-2.gguf"));
  // Byte-level BPE: the token for byte 0xE2 is "â" (U+00E2), byte 0x82 is "Ĥ"... use lookups.
  const auto lead = tok->encode("\xE2\x82\xAC", false, false);  // "€" as byte tokens
  REQUIRE(!lead.empty());
  const int32_t a = *tok->find_token("a");
  const int32_t e2 = *tok->find_token("\xC3\xA2");  // "â": GPT-2's symbol for byte 0xE2
  {
    StreamingDetokenizer stream(*tok);
    CHECK(stream.push(e2).empty());                       // held: could start a character
    CHECK(stream.push(a) == "\xEF\xBF\xBD" "a");          // never completed: U+FFFD
    CHECK(stream.flush().empty());
  }
  {
    StreamingDetokenizer stream(*tok);
    CHECK(stream.push(e2).empty());
    CHECK(stream.flush() == "\xEF\xBF\xBD");              // truncated at the end
  }
}

TEST_CASE("special tokens: parse_special and user-defined tokens") {
  const fs::path dir = tessera::test::scratch_dir("tokenizer_special");
  // A tiny byte-level BPE vocabulary: the 256 byte symbols, one merge, a control token and a
  // user-defined token.
  tessera::gguf::GgufWriter w;
  w.add_string("tokenizer.ggml.model", "gpt2");
  w.add_string("tokenizer.ggml.pre", "gpt-2");
  std::vector<std::string> tokens;
  std::vector<int32_t> types;
  auto add = [&](const std::string& t, int32_t type) {
    tokens.push_back(t);
    types.push_back(type);
  };
  // GPT-2 byte alphabet: printable Latin-1 bytes are themselves, others 256+n.
  int n = 0;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
    const uint32_t cp = printable ? b : 256 + n++;
    std::string s;
    if (cp < 0x80) s.push_back(static_cast<char>(cp));
    else { s.push_back(static_cast<char>(0xC0 | (cp >> 6))); s.push_back(static_cast<char>(0x80 | (cp & 0x3F))); }
    add(s, 1);
  }
  add("ab", 1);                 // 256
  add("<|im_start|>", 3);       // 257 control
  add("<tool>", 4);             // 258 user-defined
  add("<|im_end|>", 3);         // 259 control, EOG by text
  w.add_string_array("tokenizer.ggml.tokens", tokens);
  w.add_int32_array("tokenizer.ggml.token_type", types);
  w.add_string_array("tokenizer.ggml.merges", {"a b"});
  w.add_uint32("tokenizer.ggml.bos_token_id", 257);
  w.add_uint32("tokenizer.ggml.eos_token_id", 259);
  const std::string path = (dir / "special.gguf").string();
  w.write(path);

  auto tok = load_tokenizer(path);
  const int32_t a = 'a', b = 'b';  // token id == byte value in this vocabulary
  CHECK(tok->encode("ab", false, false) == std::vector<int32_t>{256});
  // User-defined tokens are split out even without parse_special.
  CHECK(tok->encode("a<tool>b", false, false) == std::vector<int32_t>{a, 258, b});
  // Control tokens only with parse_special.
  CHECK(tok->encode("<|im_start|>ab", false, true) == std::vector<int32_t>{257, 256});
  const auto plain = tok->encode("<|im_start|>", false, false);
  CHECK(plain.size() > 1);
  CHECK(std::find(plain.begin(), plain.end(), 257) == plain.end());
  CHECK(tok->is_end_of_generation(259));
  CHECK(tok->token_to_piece(257, false).empty());
  CHECK(tok->token_to_piece(258, false) == "<tool>");  // user-defined always renders
  CHECK(tok->decode(std::vector<int32_t>{257, 256, 259}, true) == "<|im_start|>ab<|im_end|>");
  CHECK(tok->decode(std::vector<int32_t>{257, 256, 259}, false) == "ab");
}

TEST_CASE("bad tokenizer metadata names the key") {
  const fs::path dir = tessera::test::scratch_dir("tokenizer_bad");
  auto expect_error = [&](const tessera::gguf::GgufWriter& w, const std::string& key) {
    const std::string path = (dir / "bad.gguf").string();
    w.write(path);
    auto file = tessera::gguf::GgufFile::open(path);
    try {
      Tokenizer::from_gguf(*file);
      FAIL("expected an error naming " << key);
    } catch (const std::runtime_error& e) {
      CHECK_MESSAGE(std::string(e.what()).find(key) != std::string::npos, e.what());
    }
  };
  {
    tessera::gguf::GgufWriter w;
    w.add_string_array("tokenizer.ggml.tokens", {"a", "b"});
    expect_error(w, "tokenizer.ggml.model");
  }
  {
    tessera::gguf::GgufWriter w;
    w.add_string("tokenizer.ggml.model", "gpt2");
    w.add_string("tokenizer.ggml.pre", "gpt-2");
    w.add_string_array("tokenizer.ggml.tokens", {"a", "b"});
    expect_error(w, "tokenizer.ggml.merges");
  }
  {
    tessera::gguf::GgufWriter w;
    w.add_string("tokenizer.ggml.model", "llama");
    expect_error(w, "tokenizer.ggml.tokens");
  }
  {
    tessera::gguf::GgufWriter w;
    w.add_string("tokenizer.ggml.model", "llama");
    w.add_string_array("tokenizer.ggml.tokens", {"<unk>", "<s>", "</s>"});
    w.add_float32_array("tokenizer.ggml.scores", {0.0f});
    expect_error(w, "tokenizer.ggml.scores");
  }
  {
    tessera::gguf::GgufWriter w;
    w.add_string("tokenizer.ggml.model", "gpt2");
    w.add_string("tokenizer.ggml.pre", "no-such-pre-tokenizer");
    w.add_string_array("tokenizer.ggml.tokens", {"a", "b"});
    w.add_string_array("tokenizer.ggml.merges", {"a b"});
    expect_error(w, "tokenizer.ggml.pre");
  }
  {
    tessera::gguf::GgufWriter w;
    w.add_string("tokenizer.ggml.model", "llama");
    w.add_uint32("tokenizer.ggml.tokens", 3);  // wrong type
    expect_error(w, "tokenizer.ggml.tokens");
  }
  {
    // A special token id past the vocabulary used to be replaced silently by the default.
    tessera::gguf::GgufWriter w;
    w.add_string("tokenizer.ggml.model", "llama");
    w.add_string_array("tokenizer.ggml.tokens", {"<unk>", "<s>", "</s>"});
    w.add_uint32("tokenizer.ggml.bos_token_id", 99999);
    expect_error(w, "tokenizer.ggml.bos_token_id = 99999 is outside the vocabulary (3 tokens, "
                    "ids 0..2)");
  }
}

// Reference ids from llama.cpp (llama-cpp-python 0.3.36, vocab_only=True,
// tokenize(text, add_bos=False, special=False)) for SmolLM2-135M-Instruct.
TEST_CASE("SmolLM2 vocabulary matches llama.cpp") {
  const std::string path = model_path();
  if (!fs::exists(path)) {
    MESSAGE("skipping: model not found at " << path << " (set TESSERA_MODEL_PATH)");
    return;
  }
  auto tok = load_tokenizer(path);
  CHECK(tok->model_name() == "gpt2");
  CHECK(tok->pre_tokenizer() == "smollm");
  CHECK(tok->vocab_size() == 49152);
  CHECK_FALSE(tok->add_bos());
  CHECK(tok->bos_id() == 1);
  CHECK(tok->eos_id() == 2);
  CHECK(tok->is_end_of_generation(2));  // <|im_end|>
  CHECK(tok->is_end_of_generation(0));  // <|endoftext|>
  CHECK_FALSE(tok->is_end_of_generation(1));

  struct Case {
    const char* text;
    std::vector<int32_t> ids;
  };
  // SMOLLM_FIXTURES_BEGIN
  // Generated by scripts/gen_tokenizer_fixtures.py.
  const std::vector<Case> cases = {
      {"Hello world",
       {19556, 905}},
      {" Hello, world! It's a test: don't, we'll, I'm, you've, they're, she'd. IT'S DON'T",
       {38699, 28, 905, 17, 657, 506, 253, 1028, 42, 1326, 982, 28, 392, 3060, 28, 339, 5248, 28, 346, 3543, 28, 502, 2316, 28, 1041, 6737, 30, 9627, 23, 67, 422, 2154, 23, 68}},
      {"Numbers: 3.14159, 1234567890, 2024-01-01, 1/2 = 0.5, ½ ² ٣ ①",
       {39006, 42, 216, 35, 30, 33, 36, 33, 37, 41, 28, 216, 33, 34, 35, 36, 37, 38, 39, 40, 41, 32, 28, 216, 34, 32, 34, 36, 29, 32, 33, 29, 32, 33, 28, 216, 33, 31, 34, 446, 216, 32, 30, 37, 28, 216, 16738, 216, 19133, 216, 164, 113, 216, 173, 235, 250}},
      {"def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n-1) + fibonacci(n-2)\n",
       {1604, 3987, 46477, 24, 94, 727, 472, 585, 304, 2067, 216, 34, 42, 448, 1003, 304, 472, 1003, 3987, 46477, 24, 94, 29, 33, 25, 1232, 3987, 46477, 24, 94, 29, 34, 25, 198}},
      {"int main() { std::vector<int> v{1, 2, 3}; return v[0] != 0 ? -1 : 0; } // C++",
       {591, 1085, 1000, 1662, 17226, 9533, 16714, 44, 591, 46, 386, 107, 33, 28, 216, 34, 28, 216, 35, 48781, 1003, 386, 75, 32, 77, 6541, 216, 32, 9148, 731, 33, 1577, 216, 32, 43, 4029, 13241, 340, 11444}},
      {"Whitespace   runs\t\ttabs\n\n\nnewlines   \n  trailing   ",
       {2703, 2171, 6525, 256, 7313, 197, 197, 100, 7366, 1116, 198, 2241, 5110, 333, 3805, 35079, 333}},
      {"Unicode: naïve café, Führer, Ελληνικά, русский, 日本語のテキスト, 한국어, नमस\xE0\xA5\x8D" "त\xE0\xA5\x87" "",
       {3706, 15817, 42, 15486, 46494, 37366, 28, 426, 46991, 16863, 28, 5664, 239, 17162, 17162, 25723, 11517, 12001, 21118, 26112, 28, 216, 9175, 14714, 9382, 39511, 7872, 24958, 28, 17097, 241, 115, 40993, 179, 120, 248, 26453, 11100, 224, 10391, 251, 10391, 134, 11100, 226, 28, 216, 33085, 246, 181, 130, 251, 183, 240, 129, 28, 12335, 118, 35090, 38770, 16525, 26293, 30581}},
      {"Emoji 🦙🚀😶\xE2\x80\x8D" "🌫\xEF\xB8\x8F" "✅👍🏽 and symbols ∑∫√∞ ©®™ €£¥",
       {10809, 33777, 15107, 116, 243, 10813, 244, 218, 10813, 242, 131, 321, 231, 10813, 230, 121, 31752, 38083, 223, 10813, 235, 231, 10813, 233, 138, 284, 7349, 19995, 235, 22052, 121, 22052, 244, 22052, 248, 11435, 10532, 14824, 24927, 37564, 141, 115}},
      {"<|im_start|>user\nnot special without parse_special<|im_end|>",
       {44, 108, 306, 79, 3738, 108, 46, 4093, 198, 1766, 1767, 1355, 12865, 79, 19159, 44, 108, 306, 79, 486, 108, 46}},
      {"CAPS'S and 'quotes' \"double\" `back` ''' ...",
       {33467, 67, 23, 67, 284, 637, 385, 2346, 23, 476, 21414, 18, 2179, 2676, 80, 7855, 4563}},
      {"\xC2\xA0" "non-breaking\xE3\x80\x80" "ideographic\xE2\x80\x83" "em space",
       {15442, 9033, 29, 11194, 12109, 218, 489, 4551, 321, 221, 391, 1898}},
      {"    ",
       {289}},
      {"\n",
       {198}},
  };
  // SMOLLM_FIXTURES_END
  for (const auto& c : cases) {
    CHECK_MESSAGE(tok->encode(c.text, false, false) == c.ids, "'" << c.text << "' got "
                  << ids_to_string(tok->encode(c.text, false, false)));
  }

  // Special-token parsing and the chat template round trip.
  const auto im = tok->encode("<|im_start|>user\nHi<|im_end|>", false, true);
  REQUIRE(im.size() >= 3);
  CHECK(im.front() == 1);
  CHECK(im.back() == 2);
  const std::string prompt = tessera::apply_chat_template(
      tok->chat_template(), {{"user", "What is 2+2?"}}, true);
  CHECK(prompt ==
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n");
  const auto prompt_ids = tok->encode(prompt, false, true);
  CHECK(tok->decode(prompt_ids, true) == prompt);
}
