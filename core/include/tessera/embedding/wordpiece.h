// WordPiece tokenization as Hugging Face tokenizers runs it for BERT models (the
// tokenizer.json of all-MiniLM-L6-v2 and other sentence-transformers models): BertNormalizer
// (clean text, space around CJK ideographs, strip accents, lowercase), BertPreTokenizer
// (split on whitespace, isolate punctuation), greedy longest-match WordPiece with the "##"
// continuation prefix, and the [CLS] ... [SEP] template, truncated to a token budget.
// Added tokens ([CLS], [SEP], [MASK], ...) in the input text map to their ids, as in the
// fast tokenizer.
//
// Thread-safety: immutable after load; every const method may be called from any thread.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace tessera {

class WordPieceTokenizer {
 public:
  // Reads a tokenizer.json whose model is WordPiece; throws std::runtime_error naming the
  // file and the field on anything else.
  static std::unique_ptr<WordPieceTokenizer> from_json_file(const std::string& path);
  static std::unique_ptr<WordPieceTokenizer> from_json_text(const std::string& text, const std::string& origin);

  // [CLS] pieces [SEP], with the pieces cut so that the whole is at most max_tokens (>= 2).
  std::vector<int32_t> encode(std::string_view text, int max_tokens) const;
  // The pieces of `text` alone (no template, no truncation).
  std::vector<int32_t> encode_pieces(std::string_view text) const;
  // The normalizer's output (tests).
  std::string normalize(std::string_view text) const;

  int32_t vocab_size() const { return static_cast<int32_t>(tokens_.size()); }
  int32_t cls_id() const { return cls_id_; }
  int32_t sep_id() const { return sep_id_; }
  int32_t unk_id() const { return unk_id_; }
  const std::string& token_text(int32_t id) const { return tokens_.at(id); }

 private:
  WordPieceTokenizer() = default;
  void append_word(std::string_view word, std::vector<int32_t>& out) const;
  void append_text(std::string_view text, std::vector<int32_t>& out) const;  // no added tokens inside

  std::vector<std::string> tokens_;
  std::unordered_map<std::string, int32_t> vocab_;
  std::vector<std::pair<std::string, int32_t>> added_;  // matched in raw text, longest first
  std::string continuing_prefix_ = "##";
  size_t max_input_chars_per_word_ = 100;
  bool clean_text_ = true, handle_chinese_chars_ = true, strip_accents_ = true, lowercase_ = true;
  int32_t cls_id_ = -1, sep_id_ = -1, unk_id_ = -1;
};

}  // namespace tessera
