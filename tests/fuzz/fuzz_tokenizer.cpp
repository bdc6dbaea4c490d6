// Fuzz target: arbitrary bytes through every pre-tokenizer family, BPE and SentencePiece,
// with and without special-token parsing, then back through decode and the streaming
// detokenizer. Byte 0 of the input picks the vocabulary, byte 1 the flags, the rest is text.
//
// Checked beyond "no crash": every id is inside the vocabulary, and the streaming
// detokenizer releases only valid UTF-8.
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "fuzz_support.h"
#include "tessera/gguf.h"
#include "tessera/tokenizer.h"

namespace {

using tessera::Tokenizer;

// A byte-level BPE vocabulary in GPT-2's byte alphabet with a few merges, control and
// user-defined tokens, for pre-tokenizer `pre`.
std::unique_ptr<Tokenizer> tiny_bpe(const std::string& pre) {
  tessera::gguf::GgufWriter w;
  w.add_string("tokenizer.ggml.model", "gpt2");
  w.add_string("tokenizer.ggml.pre", pre);
  std::vector<std::string> tokens;
  std::vector<int32_t> types;
  int n = 0;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
    const uint32_t cp = printable ? b : 256 + n++;
    std::string s;
    if (cp < 0x80) {
      s.push_back(static_cast<char>(cp));
    } else {
      s.push_back(static_cast<char>(0xC0 | (cp >> 6)));
      s.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    }
    tokens.push_back(s);
    types.push_back(1);
  }
  for (const char* t : {"ab", "Ġt", "he", "Ġthe", "12"}) {
    tokens.push_back(t);
    types.push_back(1);
  }
  for (auto [t, type] : {std::pair{"<|im_start|>", 3}, {"<|im_end|>", 3}, {"<tool>", 4}}) {
    tokens.push_back(t);
    types.push_back(type);
  }
  w.add_string_array("tokenizer.ggml.tokens", tokens);
  w.add_int32_array("tokenizer.ggml.token_type", types);
  w.add_string_array("tokenizer.ggml.merges", {"a b", "Ġ t", "h e", "Ġt he", "1 2"});
  w.add_uint32("tokenizer.ggml.bos_token_id", 261);
  w.add_uint32("tokenizer.ggml.eos_token_id", 262);
  const std::string path = (tessera::fuzz::scratch_dir() / ("vocab-" + pre + ".gguf")).string();
  w.write(path);
  return Tokenizer::from_gguf(*tessera::gguf::GgufFile::open(path));
}

std::vector<std::unique_ptr<Tokenizer>> make_tokenizers() {
  std::vector<std::unique_ptr<Tokenizer>> out;
  // One pre-tokenizer of each rule family the tokenizer implements.
  for (const char* pre : {"default", "llama-bpe", "dbrx", "chatglm-bpe", "falcon", "gpt-2",
                          "trillion", "starcoder", "smollm", "qwen2", "megrez"})
    out.push_back(tiny_bpe(pre));
  // The real vocabularies llama.cpp's tests use: GPT-2 BPE and SentencePiece.
  for (const char* file : {"ggml-vocab-gpt-2.gguf", "ggml-vocab-llama-spm.gguf"}) {
    const auto path = tessera::fuzz::shared_testdata() / "tokenizer" / file;
    if (std::filesystem::exists(path))
      out.push_back(Tokenizer::from_gguf(*tessera::gguf::GgufFile::open(path.string())));
  }
  return out;
}

bool valid_utf8(const std::string& s) {
  size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<unsigned char>(s[i]);
    const size_t len = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
    if (len == 0 || i + len > s.size()) return false;
    for (size_t k = 1; k < len; ++k)
      if ((static_cast<unsigned char>(s[i + k]) >> 6) != 2) return false;
    i += len;
  }
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const auto tokenizers = make_tokenizers();
  if (size < 2) return 0;
  const Tokenizer& tok = *tokenizers[data[0] % tokenizers.size()];
  const bool add_special = data[1] & 1, parse_special = data[1] & 2, render_special = data[1] & 4;
  const std::string_view text(reinterpret_cast<const char*>(data + 2), size - 2);
  const auto ids = tok.encode(text, add_special, parse_special);
  for (int32_t id : ids)
    FUZZ_CHECK(id >= 0 && id < tok.vocab_size());
  (void)tok.decode(ids, render_special);
  tessera::StreamingDetokenizer stream(tok, render_special);
  std::string streamed;
  for (int32_t id : ids) streamed += stream.push(id);
  streamed += stream.flush();
  FUZZ_CHECK(valid_utf8(streamed));
  return 0;
}
