// WordPiece as Hugging Face tokenizers' BertNormalizer + BertPreTokenizer + WordPiece model
// (tokenizers/src/normalizers/bert.rs, pre_tokenizers/bert.rs, models/wordpiece/mod.rs).
#include "tessera/embedding/wordpiece.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <fstream>
#include <sstream>
#include <stdexcept>

#include "unicode.h"
#include "wordpiece_tables.h"

namespace tessera {
namespace {

using nlohmann::json;

[[noreturn]] void fail(const std::string& origin, const std::string& what) {
  throw std::runtime_error(origin + ": " + what);
}

// A code point's image under one of the generated maps; false when it maps to itself.
bool lookup(const unicode::CodepointMapping* table, size_t n, const uint32_t* pool, uint32_t cp,
            std::vector<uint32_t>& out) {
  const auto* end = table + n;
  const auto* it = std::lower_bound(table, end, cp, [](const unicode::CodepointMapping& m, uint32_t c) {
    return m.codepoint < c;
  });
  if (it == end || it->codepoint != cp) return false;
  out.insert(out.end(), pool + it->offset, pool + it->offset + it->length);
  return true;
}

// NFD of a precomposed Hangul syllable (Unicode 3.12): leading, vowel and optional trailing jamo.
bool decompose_hangul(uint32_t cp, std::vector<uint32_t>& out) {
  constexpr uint32_t kBase = 0xAC00, kCount = 11172, kVowels = 21, kTrails = 28;
  if (cp < kBase || cp >= kBase + kCount) return false;
  const uint32_t s = cp - kBase;
  out.push_back(0x1100 + s / (kVowels * kTrails));
  out.push_back(0x1161 + (s % (kVowels * kTrails)) / kTrails);
  if (s % kTrails) out.push_back(0x11A7 + s % kTrails);
  return true;
}

bool is_bert_whitespace(uint32_t cp) {
  return cp == '\t' || cp == '\n' || cp == '\r' || (unicode::codepoint_flags(cp) & unicode::kWhitespace);
}

// Rust's char::is_other (Cc, Cf, Cs, Co, Cn) minus tab, newline and carriage return.
bool is_bert_control(uint32_t cp) {
  if (cp == '\t' || cp == '\n' || cp == '\r') return false;
  return unicode::codepoint_flags(cp) & (unicode::kControl | unicode::kUndefined);
}

bool is_bert_punctuation(uint32_t cp) {
  if (cp < 0x80) return (cp >= 33 && cp <= 47) || (cp >= 58 && cp <= 64) || (cp >= 91 && cp <= 96) ||
                        (cp >= 123 && cp <= 126);
  return unicode::codepoint_flags(cp) & unicode::kPunctuation;
}

// The CJK ideograph blocks BERT puts spaces around (bert.rs is_chinese_char).
bool is_chinese_char(uint32_t cp) {
  return (cp >= 0x4E00 && cp <= 0x9FFF) || (cp >= 0x3400 && cp <= 0x4DBF) || (cp >= 0x20000 && cp <= 0x2A6DF) ||
         (cp >= 0x2A700 && cp <= 0x2B73F) || (cp >= 0x2B740 && cp <= 0x2B81F) || (cp >= 0x2B920 && cp <= 0x2CEAF) ||
         (cp >= 0xF900 && cp <= 0xFAFF) || (cp >= 0x2F800 && cp <= 0x2FA1F);
}

bool get_bool(const json& j, const char* key, bool fallback) {
  auto it = j.find(key);
  return it == j.end() || it->is_null() ? fallback : it->get<bool>();
}

}  // namespace

std::unique_ptr<WordPieceTokenizer> WordPieceTokenizer::from_json_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error(path + ": cannot open the tokenizer");
  std::stringstream text;
  text << in.rdbuf();
  return from_json_text(text.str(), path);
}

std::unique_ptr<WordPieceTokenizer> WordPieceTokenizer::from_json_text(const std::string& text,
                                                                       const std::string& origin) {
  json j;
  try {
    j = json::parse(text);
  } catch (const std::exception& e) {
    fail(origin, std::string("not JSON: ") + e.what());
  }
  auto tok = std::unique_ptr<WordPieceTokenizer>(new WordPieceTokenizer());
  const json& model = j.value("model", json::object());
  if (model.value("type", "") != "WordPiece")
    fail(origin, "model.type: expected \"WordPiece\", got " + model.value("type", json("none")).dump());
  const json& vocab = model.value("vocab", json::object());
  if (!vocab.is_object() || vocab.empty()) fail(origin, "model.vocab: expected a non-empty object");
  tok->tokens_.resize(vocab.size());
  for (auto it = vocab.begin(); it != vocab.end(); ++it) {
    const int64_t id = it.value().get<int64_t>();
    if (id < 0 || id >= static_cast<int64_t>(vocab.size()))
      fail(origin, "model.vocab: id " + std::to_string(id) + " of '" + it.key() + "' is out of range");
    tok->tokens_[id] = it.key();
    tok->vocab_.emplace(it.key(), static_cast<int32_t>(id));
  }
  tok->continuing_prefix_ = model.value("continuing_subword_prefix", "##");
  tok->max_input_chars_per_word_ = model.value("max_input_chars_per_word", 100);
  const auto find = [&](const std::string& t) {
    auto it = tok->vocab_.find(t);
    return it == tok->vocab_.end() ? -1 : it->second;
  };
  tok->unk_id_ = find(model.value("unk_token", "[UNK]"));
  if (tok->unk_id_ < 0) fail(origin, "model.unk_token: not in the vocabulary");

  const json& norm = j.value("normalizer", json());
  if (!norm.is_null()) {
    if (norm.value("type", "") != "BertNormalizer")
      fail(origin, "normalizer.type: only BertNormalizer is implemented, got " + norm.value("type", json()).dump());
    tok->clean_text_ = get_bool(norm, "clean_text", true);
    tok->handle_chinese_chars_ = get_bool(norm, "handle_chinese_chars", true);
    tok->lowercase_ = get_bool(norm, "lowercase", true);
    // null: follow lowercase, as BertNormalizer does.
    tok->strip_accents_ = get_bool(norm, "strip_accents", tok->lowercase_);
  } else {
    tok->clean_text_ = tok->handle_chinese_chars_ = tok->strip_accents_ = tok->lowercase_ = false;
  }
  const json& pre = j.value("pre_tokenizer", json());
  if (!pre.is_null() && pre.value("type", "") != "BertPreTokenizer")
    fail(origin, "pre_tokenizer.type: only BertPreTokenizer is implemented, got " + pre.value("type", json()).dump());

  // The template's [CLS]/[SEP]: TemplateProcessing's special_tokens or BertProcessing's pairs.
  tok->cls_id_ = find("[CLS]");
  tok->sep_id_ = find("[SEP]");
  const json& post = j.value("post_processor", json());
  if (post.is_object() && post.value("type", "") == "BertProcessing") {
    tok->cls_id_ = post.at("cls").at(1).get<int32_t>();
    tok->sep_id_ = post.at("sep").at(1).get<int32_t>();
  }
  if (tok->cls_id_ < 0 || tok->sep_id_ < 0) fail(origin, "post_processor: no [CLS] and [SEP] tokens");

  for (const json& a : j.value("added_tokens", json::array())) {
    const std::string content = a.value("content", "");
    if (!content.empty()) tok->added_.emplace_back(content, a.value("id", -1));
  }
  std::sort(tok->added_.begin(), tok->added_.end(),
            [](const auto& a, const auto& b) { return a.first.size() > b.first.size(); });
  return tok;
}

std::string WordPieceTokenizer::normalize(std::string_view text) const {
  std::vector<uint32_t> cps = unicode::codepoints_from_utf8(text);
  std::vector<uint32_t> a;
  a.reserve(cps.size() + 8);
  for (uint32_t cp : cps) {
    if (clean_text_) {
      if (cp == 0 || cp == 0xFFFD || is_bert_control(cp)) continue;
      if (is_bert_whitespace(cp)) cp = ' ';
    }
    if (handle_chinese_chars_ && is_chinese_char(cp)) {
      a.push_back(' ');
      a.push_back(cp);
      a.push_back(' ');
    } else {
      a.push_back(cp);
    }
  }
  if (strip_accents_) {
    std::vector<uint32_t> b;
    b.reserve(a.size());
    for (uint32_t cp : a)
      if (!decompose_hangul(cp, b) &&
          !lookup(unicode::kStripAccents, unicode::kNumStripAccents, unicode::kStripAccentsPool, cp, b))
        b.push_back(cp);
    a.swap(b);
  }
  std::string out;
  out.reserve(a.size());
  std::vector<uint32_t> lower;
  for (uint32_t cp : a) {
    lower.clear();
    if (lowercase_ && lookup(unicode::kLowercase, unicode::kNumLowercase, unicode::kLowercasePool, cp, lower)) {
      for (uint32_t c : lower) unicode::append_utf8(out, c);
    } else {
      unicode::append_utf8(out, cp);
    }
  }
  return out;
}

// models/wordpiece: greedy longest match from the left, "##" on every piece but the first;
// a word with any unmatched rest, or longer than max_input_chars_per_word, is [UNK].
void WordPieceTokenizer::append_word(std::string_view word, std::vector<int32_t>& out) const {
  size_t num_chars = 0;
  for (size_t i = 0; i < word.size(); i += unicode::utf8_len(word[i])) ++num_chars;
  if (num_chars > max_input_chars_per_word_) {
    out.push_back(unk_id_);
    return;
  }
  const size_t mark = out.size();
  std::string piece;
  size_t start = 0;
  while (start < word.size()) {
    size_t end = word.size();
    int32_t found = -1;
    while (start < end) {
      piece.assign(start > 0 ? continuing_prefix_ : std::string());
      piece.append(word.substr(start, end - start));
      if (auto it = vocab_.find(piece); it != vocab_.end()) {
        found = it->second;
        break;
      }
      do --end;  // back to the previous character boundary
      while (end > start && (static_cast<uint8_t>(word[end]) & 0xC0) == 0x80);
    }
    if (found < 0) {
      out.resize(mark);
      out.push_back(unk_id_);
      return;
    }
    out.push_back(found);
    start = end;
  }
}

void WordPieceTokenizer::append_text(std::string_view text, std::vector<int32_t>& out) const {
  const std::string normalized = normalize(text);
  // BertPreTokenizer: whitespace separates words and is dropped; punctuation is a word alone.
  std::string word;
  const auto flush = [&] {
    if (!word.empty()) append_word(word, out);
    word.clear();
  };
  for (uint32_t cp : unicode::codepoints_from_utf8(normalized)) {
    if (cp == ' ' || (unicode::codepoint_flags(cp) & unicode::kWhitespace)) {
      flush();
    } else if (is_bert_punctuation(cp)) {
      flush();
      unicode::append_utf8(word, cp);
      flush();
    } else {
      unicode::append_utf8(word, cp);
    }
  }
  flush();
}

std::vector<int32_t> WordPieceTokenizer::encode_pieces(std::string_view text) const {
  std::vector<int32_t> out;
  // Added tokens are found in the raw text first (they are not normalized); the text between
  // them goes through the normal path.
  size_t pos = 0, plain = 0;
  while (pos < text.size()) {
    const std::pair<std::string, int32_t>* hit = nullptr;
    for (const auto& a : added_)
      if (text.compare(pos, a.first.size(), a.first) == 0) {
        hit = &a;
        break;
      }
    if (!hit) {
      ++pos;
      continue;
    }
    append_text(text.substr(plain, pos - plain), out);
    out.push_back(hit->second);
    pos += hit->first.size();
    plain = pos;
  }
  append_text(text.substr(plain), out);
  return out;
}

std::vector<int32_t> WordPieceTokenizer::encode(std::string_view text, int max_tokens) const {
  std::vector<int32_t> pieces = encode_pieces(text);
  const size_t room = static_cast<size_t>(std::max(max_tokens, 2) - 2);
  if (pieces.size() > room) pieces.resize(room);
  std::vector<int32_t> out;
  out.reserve(pieces.size() + 2);
  out.push_back(cls_id_);
  out.insert(out.end(), pieces.begin(), pieces.end());
  out.push_back(sep_id_);
  return out;
}

}  // namespace tessera
