// Tokenizer loading and encoding. Every rule here follows llama.cpp's src/llama-vocab.cpp
// (llama_vocab::impl::load, tokenizer_st_partition, llm_tokenizer_bpe_session,
// llm_tokenizer_spm_session, token_to_piece, detokenize) because the engine must reproduce
// llama.cpp's token ids exactly; where llama.cpp has a quirk, the quirk is kept on purpose.
#include "tessera/tokenizer.h"

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <map>
#include <queue>
#include <stdexcept>

#include "tessera/gguf.h"
#include "unicode.h"

namespace tessera {

namespace {

using unicode::SplitRule;

constexpr const char* kKeyModel = "tokenizer.ggml.model";
constexpr const char* kKeyPre = "tokenizer.ggml.pre";
constexpr const char* kKeyTokens = "tokenizer.ggml.tokens";
constexpr const char* kKeyScores = "tokenizer.ggml.scores";
constexpr const char* kKeyTokenType = "tokenizer.ggml.token_type";
constexpr const char* kKeyMerges = "tokenizer.ggml.merges";
constexpr const char* kKeyAddBos = "tokenizer.ggml.add_bos_token";
constexpr const char* kKeyAddEos = "tokenizer.ggml.add_eos_token";
constexpr const char* kKeyAddSpacePrefix = "tokenizer.ggml.add_space_prefix";
constexpr const char* kKeyChatTemplate = "tokenizer.chat_template";
constexpr const char* kKeyGeneralName = "general.name";

// "▁" (U+2581): SentencePiece's visible space.
constexpr std::string_view kSpmSpace = "\xE2\x96\x81";

// GGUF token types (tokenizer.ggml.token_type).
enum TokenType : int64_t {
  kTypeUndefined = 0, kTypeNormal = 1, kTypeUnknown = 2, kTypeControl = 3,
  kTypeUserDefined = 4, kTypeUnused = 5, kTypeByte = 6,
};

SplitRule gpt2_rule() {
  SplitRule r;
  r.kind = SplitRule::Kind::kGpt2;
  return r;
}
SplitRule llama3_rule(size_t max_digits) {
  SplitRule r;
  r.kind = SplitRule::Kind::kLlama3;
  r.max_len = max_digits;
  return r;
}
SplitRule class_rule(uint16_t flags, std::string_view ascii, size_t min_len, size_t max_len) {
  SplitRule r;
  r.kind = SplitRule::Kind::kClassRun;
  r.class_flags = flags;
  r.class_ascii = ascii;
  r.min_len = min_len;
  r.max_len = max_len;
  return r;
}

bool is_one_of(std::string_view s, std::initializer_list<std::string_view> names) {
  return std::find(names.begin(), names.end(), s) != names.end();
}

void replace_all(std::string& s, std::string_view from, std::string_view to) {
  if (from.empty()) return;
  std::string out;
  out.reserve(s.size());
  size_t pos = 0;
  while (true) {
    const size_t hit = s.find(from, pos);
    if (hit == std::string::npos) break;
    out.append(s, pos, hit - pos);
    out.append(to);
    pos = hit + from.size();
  }
  out.append(s, pos, std::string::npos);
  s = std::move(out);
}

// llama.cpp's llama_decode_text: byte-level BPE text back to raw bytes.
std::string decode_bpe_text(const std::string& text) {
  std::string out;
  for (const uint32_t cp : unicode::codepoints_from_utf8(text)) {
    if (auto byte = unicode::bpe_codepoint_to_byte(cp)) {
      out.push_back(static_cast<char>(*byte));
      continue;
    }
    // Same marker llama.cpp writes for a code point outside the byte alphabet.
    std::string utf8;
    unicode::append_utf8(utf8, cp);
    out += "[UNK_BYTE_0x";
    static const char* kHex = "0123456789abcdef";
    for (const char c : utf8) {
      out.push_back(kHex[static_cast<uint8_t>(c) >> 4]);
      out.push_back(kHex[static_cast<uint8_t>(c) & 15]);
    }
    out += text + "]";
  }
  return out;
}

uint8_t byte_token_value(const std::string& text) {
  // "<0xNN>": llama.cpp parses text[3..4] as hex.
  const std::string hex = text.size() >= 5 ? text.substr(3, 2) : std::string();
  return static_cast<uint8_t>(std::strtol(hex.c_str(), nullptr, 16));
}

// Wraps a metadata read so that any failure names the key.
template <typename F>
auto read_key(const char* key, F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const std::exception& e) {
    const std::string what = e.what();
    if (what.find(key) != std::string::npos) throw std::runtime_error(what);
    throw std::runtime_error(std::string(key) + ": " + what);
  }
}

struct Symbol {
  int prev;
  int next;
  const char* text;
  size_t n;
};

struct SpmBigram {
  int left;
  int right;
  float score;
  size_t size;
};
// Highest score first; on ties the leftmost pair (llama_bigram_spm::comparator).
struct SpmBigramLess {
  bool operator()(const SpmBigram& l, const SpmBigram& r) const {
    return l.score < r.score || (l.score == r.score && l.left > r.left);
  }
};

struct BpeBigram {
  int left;
  int right;
  std::string text;
  int rank;
  size_t size;
};
// Lowest merge rank first; on ties the leftmost pair (llm_bigram_bpe::comparator).
struct BpeBigramGreater {
  bool operator()(const BpeBigram& l, const BpeBigram& r) const {
    return l.rank > r.rank || (l.rank == r.rank && l.left > r.left);
  }
};

}  // namespace

Tokenizer::Tokenizer() = default;
Tokenizer::~Tokenizer() = default;

std::unique_ptr<Tokenizer> Tokenizer::from_gguf(const gguf::GgufFile& file) {
  std::unique_ptr<Tokenizer> tok(new Tokenizer());
  tok->load(file);
  return tok;
}

void Tokenizer::load(const gguf::GgufFile& file) {
  const auto model = read_key(kKeyModel, [&] { return file.opt_string(kKeyModel); });
  if (!model) throw std::runtime_error(std::string(kKeyModel) + ": missing");
  model_ = *model;
  pre_ = read_key(kKeyPre, [&] { return file.opt_string(kKeyPre); }).value_or("");
  chat_template_ =
      read_key(kKeyChatTemplate, [&] { return file.opt_string(kKeyChatTemplate); }).value_or("");

  // Defaults per vocabulary type, before the file's own keys override them.
  if (model_ == "llama") {
    kind_ = Kind::kSpm;
    bos_id_ = 1;
    eos_id_ = 2;
    unk_id_ = 0;
    add_space_prefix_ = true;
    clean_spaces_ = false;
    add_bos_ = true;
    add_eos_ = false;
  } else if (model_ == "gpt2") {
    kind_ = Kind::kBpe;
    bos_id_ = 11;
    eos_id_ = 11;
    add_space_prefix_ = false;
    clean_spaces_ = true;

    const SplitRule digit = class_rule(unicode::kNumber, "", 1, 1);
    if (pre_.empty() || pre_ == "default") {
      split_rules_ = {class_rule(unicode::kPunctuation, "$+<=>^~|", 1, SIZE_MAX), gpt2_rule(),
                      class_rule(unicode::kNumber, "", 1, SIZE_MAX),
                      class_rule(0, "0123456789", 3, 3)};
    } else if (is_one_of(pre_, {"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1",
                                "pixtral", "midm-2.0", "lfm2", "jina-v5-nano"})) {
      split_rules_ = {llama3_rule(3)};
      ignore_merges_ = true;
      add_bos_ = true;
    } else if (is_one_of(pre_, {"dbrx", "smaug-bpe"})) {
      split_rules_ = {llama3_rule(3)};
    } else if (is_one_of(pre_, {"chatglm-bpe", "glm4"})) {
      split_rules_ = {llama3_rule(3)};
      bos_id_ = -1;
    } else if (pre_ == "falcon") {
      split_rules_ = {class_rule(unicode::kPunctuation, "$+<=>^~|`", 1, SIZE_MAX), gpt2_rule(),
                      class_rule(0, "0123456789", 3, 3)};
    } else if (is_one_of(pre_, {"gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es",
                                "jina-v2-de", "a.x-4.0", "mellum", "modern-bert", "mpt", "olmo",
                                "jais", "exaone4", "jina-v1-en", "jina-v2-code", "roberta-bpe"})) {
      split_rules_ = {gpt2_rule()};
    } else if (is_one_of(pre_, {"trillion", "granite-docling"})) {
      split_rules_ = {gpt2_rule()};
      clean_spaces_ = false;
    } else if (is_one_of(pre_, {"starcoder", "refact", "codeshell", "exaone", "minerva-7b",
                                "mellum2"})) {
      split_rules_ = {digit, gpt2_rule()};
    } else if (is_one_of(pre_, {"smollm", "command-r"})) {
      split_rules_ = {digit, gpt2_rule()};
      clean_spaces_ = false;
    } else if (is_one_of(pre_, {"qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "hunyuan",
                                "solar-open"})) {
      // Qwen2's regex is Llama-3's with single digits.
      split_rules_ = {llama3_rule(1)};
      clean_spaces_ = false;
    } else if (is_one_of(pre_, {"megrez", "stablelm2"})) {
      split_rules_ = {llama3_rule(1)};
    } else {
      throw std::runtime_error(std::string(kKeyPre) + ": unsupported pre-tokenizer '" + pre_ + "'");
    }

    const auto* merges = read_key(kKeyMerges, [&] { return file.opt_string_array(kKeyMerges); });
    if (!merges) throw std::runtime_error(std::string(kKeyMerges) + ": missing");
    bpe_ranks_.reserve(merges->size());
    for (size_t i = 0; i < merges->size(); ++i) {
      const std::string& word = (*merges)[i];
      std::string first, second;
      // Split at the first space after position 0, so a merge may start with a space.
      const size_t pos = word.find(' ', 1);
      if (pos != std::string::npos) {
        first = word.substr(0, pos);
        second = word.substr(pos + 1);
      }
      // emplace keeps the first rank of a duplicated merge, as llama.cpp's std::map does.
      bpe_ranks_.emplace(first + '\xFF' + second, static_cast<int>(i));
    }
  } else {
    throw std::runtime_error(std::string(kKeyModel) + ": unsupported tokenizer model '" + model_ + "'");
  }

  if (auto v = read_key(kKeyAddSpacePrefix, [&] { return file.opt_bool(kKeyAddSpacePrefix); })) {
    add_space_prefix_ = *v;
  }

  const auto* texts = read_key(kKeyTokens, [&] { return file.opt_string_array(kKeyTokens); });
  if (!texts) throw std::runtime_error(std::string(kKeyTokens) + ": missing");
  const size_t n_tokens = texts->size();
  if (n_tokens == 0) throw std::runtime_error(std::string(kKeyTokens) + ": empty vocabulary");
  if (n_tokens > static_cast<size_t>(INT32_MAX)) {
    throw std::runtime_error(std::string(kKeyTokens) + ": too many tokens");
  }

  const auto scores = read_key(kKeyScores, [&] { return file.opt_float_array(kKeyScores); });
  if (scores && scores->size() < n_tokens) {
    throw std::runtime_error(std::string(kKeyScores) + ": " + std::to_string(scores->size()) +
                             " scores for " + std::to_string(n_tokens) + " tokens");
  }
  const auto types = read_key(kKeyTokenType, [&] { return file.opt_int_array(kKeyTokenType); });
  if (types && types->size() < n_tokens) {
    throw std::runtime_error(std::string(kKeyTokenType) + ": " + std::to_string(types->size()) +
                             " types for " + std::to_string(n_tokens) + " tokens");
  }

  tokens_.resize(n_tokens);
  token_to_id_.reserve(n_tokens);
  for (size_t i = 0; i < n_tokens; ++i) {
    std::string word = (*texts)[i];
    if (word.empty()) word = "[EMPTY_" + std::to_string(i) + "]";
    if (!token_to_id_.emplace(word, static_cast<int32_t>(i)).second) {
      throw std::runtime_error(std::string(kKeyTokens) + ": duplicate token '" + word + "' at id " +
                               std::to_string(i));
    }
    TokenData& data = tokens_[i];
    data.text = std::move(word);
    data.score = scores ? static_cast<float>((*scores)[i]) : 0.0f;
    data.attr = kAttrNormal;
    if (types) {
      switch ((*types)[i]) {
        case kTypeUnknown: data.attr = kAttrUnknown; break;
        case kTypeUnused: data.attr = kAttrUnused; break;
        case kTypeNormal: data.attr = kAttrNormal; break;
        case kTypeControl: data.attr = kAttrControl; break;
        case kTypeUserDefined: data.attr = kAttrUserDefined; break;
        case kTypeByte: data.attr = kAttrByte; break;
        default: data.attr = kAttrUndefined; break;
      }
    }
  }

  // Special token ids: the type's default unless out of range, then the file's key if valid.
  struct SpecialKey {
    const char* key;
    int32_t* id;
  };
  const SpecialKey special_keys[] = {
      {"tokenizer.ggml.bos_token_id", &bos_id_},
      {"tokenizer.ggml.eos_token_id", &eos_id_},
      {"tokenizer.ggml.eot_token_id", &eot_id_},
      {"tokenizer.ggml.eom_token_id", &eom_id_},
      {"tokenizer.ggml.unknown_token_id", &unk_id_},
      {"tokenizer.ggml.seperator_token_id", &sep_id_},  // sic: the GGUF key is misspelled
      {"tokenizer.ggml.padding_token_id", &pad_id_},
      {"tokenizer.ggml.mask_token_id", &mask_id_},
      {"tokenizer.ggml.fim_pre_token_id", &fim_pre_id_},
      {"tokenizer.ggml.fim_suf_token_id", &fim_suf_id_},
      {"tokenizer.ggml.fim_mid_token_id", &fim_mid_id_},
      {"tokenizer.ggml.fim_pad_token_id", &fim_pad_id_},
      {"tokenizer.ggml.fim_rep_token_id", &fim_rep_id_},
      {"tokenizer.ggml.fim_sep_token_id", &fim_sep_id_},
      {"tokenizer.ggml.prefix_token_id", &fim_pre_id_},  // deprecated spellings
      {"tokenizer.ggml.suffix_token_id", &fim_suf_id_},
      {"tokenizer.ggml.middle_token_id", &fim_mid_id_},
  };
  for (const SpecialKey& sk : special_keys) {
    if (*sk.id >= 0 && static_cast<size_t>(*sk.id) >= n_tokens) *sk.id = -1;
    const auto v = read_key(sk.key, [&] { return file.opt_uint(sk.key); });
    if (!v) continue;
    // llama.cpp warns and keeps the type's default here; a file whose special token points
    // past its vocabulary is malformed, and silently using another token would change every
    // prompt's first token or where generation stops.
    if (*v >= n_tokens)
      throw std::runtime_error(std::string(sk.key) + " = " + std::to_string(*v) +
                               " is outside the vocabulary (" + std::to_string(n_tokens) +
                               " tokens, ids 0.." + std::to_string(n_tokens - 1) + ")");
    *sk.id = static_cast<int32_t>(*v);
  }

  if (auto v = read_key(kKeyAddBos, [&] { return file.opt_bool(kKeyAddBos); })) add_bos_ = *v;
  if (auto v = read_key(kKeyAddEos, [&] { return file.opt_bool(kKeyAddEos); })) add_eos_ = *v;
  if (add_bos_ && bos_id_ < 0) {
    throw std::runtime_error(std::string(kKeyAddBos) + " is true, but tokenizer.ggml.bos_token_id is not set");
  }
  if (add_eos_ && eos_id_ < 0) {
    throw std::runtime_error(std::string(kKeyAddEos) + " is true, but tokenizer.ggml.eos_token_id is not set");
  }

  finish_special_tokens();

  // Per-model attributes llama.cpp sets by name (Phi-3 strips spaces after special tokens).
  std::string general_name =
      read_key(kKeyGeneralName, [&] { return file.opt_string(kKeyGeneralName); }).value_or("");
  std::transform(general_name.begin(), general_name.end(), general_name.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  if (general_name.find("phi-3") != std::string::npos || general_name.find("phi3") != std::string::npos) {
    for (const int32_t id : special_tokens_) tokens_[id].attr |= kAttrRstrip;
    if (auto id = text_to_token("</s>"); id >= 0) tokens_[id].attr |= kAttrRstrip;
    for (const char* text : {"<unk>", "<s>", "<|endoftext|>"}) {
      if (auto id = text_to_token(text); id >= 0) tokens_[id].attr &= ~kAttrRstrip;
    }
  }
}

// Text-based detection of EOT/EOG/FIM tokens, the special-token cache and the piece cache,
// in llama.cpp's order (the attribute fixes must precede both caches).
void Tokenizer::finish_special_tokens() {
  const int32_t n = vocab_size();
  auto force_control = [&](int32_t id) { tokens_[id].attr |= kAttrControl; };

  // Ascending ids, so the choice among several candidates is deterministic.
  auto detect = [&](int32_t& slot, std::initializer_list<std::string_view> texts) {
    if (slot >= 0) return;
    for (int32_t id = 0; id < n; ++id) {
      if (is_one_of(tokens_[id].text, texts)) {
        slot = id;
        force_control(id);
        return;
      }
    }
  };
  detect(eot_id_, {"<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
                   "<|end_of_text|>", "<EOT>", "_<EOT>", "[EOT]",
                   "<\xEF\xBD\x9C" "end\xE2\x96\x81of\xE2\x96\x81sentence\xEF\xBD\x9C>",
                   "<end_of_utterance>"});
  detect(eom_id_, {"<|eom_id|>"});
  detect(fim_pre_id_, {"<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>",
                       "<\xEF\xBD\x9C" "fim\xE2\x96\x81" "begin\xEF\xBD\x9C>", "<PRE>",
                       "\xE2\x96\x81<PRE>", "<|code_prefix|>", "<|prefix|>"});
  detect(fim_suf_id_, {"<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>",
                       "<\xEF\xBD\x9C" "fim\xE2\x96\x81hole\xEF\xBD\x9C>", "<SUF>",
                       "\xE2\x96\x81<SUF>", "<|code_suffix|>", "<|suffix|>"});
  detect(fim_mid_id_, {"<|fim_middle|>", "<fim-middle>", "<fim_middle>",
                       "<\xEF\xBD\x9C" "fim\xE2\x96\x81" "end\xEF\xBD\x9C>", "<MID>",
                       "\xE2\x96\x81<MID>", "<|code_middle|>", "<|middle|>"});
  detect(fim_pad_id_, {"<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"});
  detect(fim_rep_id_, {"<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"});
  detect(fim_sep_id_, {"<|file_sep|>"});

  // Control tokens whose text says "unused" are unused.
  for (TokenData& t : tokens_) {
    if ((t.attr & kAttrControl) && t.text.find("unused") != std::string::npos) t.attr |= kAttrUnused;
  }

  eog_ids_.clear();
  for (const int32_t id : {fim_pad_id_, fim_rep_id_, fim_sep_id_}) {
    if (id >= 0) eog_ids_.insert(id);
  }
  for (int32_t id = 0; id < n; ++id) {
    if (is_one_of(tokens_[id].text,
                  {"<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>",
                   "<|calls|>", "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>",
                   "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>", "<end_of_utterance>", "<eos>",
                   "<turn|>", "<|tool_response>",
                   "<\xEF\xBD\x9C" "end\xE2\x96\x81of\xE2\x96\x81sentence\xEF\xBD\x9C>", "[e~["})) {
      eog_ids_.insert(id);
      force_control(id);
    }
  }
  // gpt-oss renders these framing tokens even when specials are hidden.
  for (const char* text : {"<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"}) {
    if (auto id = text_to_token(text); id >= 0) tokens_[id].attr = kAttrUserDefined;
  }
  for (const int32_t id : {eos_id_, eot_id_, eom_id_}) {
    if (id >= 0) eog_ids_.insert(id);
  }
  // Harmony / solar-open: "<|end|>" ends a message, not the generation.
  {
    bool has_return = false, has_call = false, has_end = false, has_flush = false;
    int32_t end_id = -1;
    for (const int32_t id : eog_ids_) {
      const std::string& text = tokens_[id].text;
      if (text == "<|return|>") has_return = true;
      else if (text == "<|call|>" || text == "<|calls|>") has_call = true;
      else if (text == "<|flush|>") has_flush = true;
      else if (text == "<|end|>") { has_end = true; end_id = id; }
    }
    if ((has_return && has_call && has_end) || (has_call && has_flush && has_end)) {
      eog_ids_.erase(end_id);
      tokens_[end_id].attr = kAttrUserDefined;
    }
  }
  // Gemma 4: "</s>" is ordinary text there.
  {
    bool has_tool_response = false;
    int32_t s_id = -1;
    for (const int32_t id : eog_ids_) {
      if (tokens_[id].text == "<|tool_response>") has_tool_response = true;
      else if (tokens_[id].text == "</s>") s_id = id;
    }
    if (has_tool_response && s_id >= 0) {
      eog_ids_.erase(s_id);
      tokens_[s_id].attr = kAttrNormal;
    }
  }

  special_tokens_.clear();
  for (int32_t id = 0; id < n; ++id) {
    if (tokens_[id].attr & (kAttrControl | kAttrUserDefined | kAttrUnknown)) special_tokens_.push_back(id);
  }
  // Same (unstable) std::sort call as llama.cpp, so equal-length ties resolve identically.
  std::sort(special_tokens_.begin(), special_tokens_.end(), [&](int32_t a, int32_t b) {
    return tokens_[a].text.size() > tokens_[b].text.size();
  });

  pieces_.resize(n);
  for (int32_t id = 0; id < n; ++id) pieces_[id] = make_piece(id);
}

std::string Tokenizer::make_piece(int32_t id) const {
  const TokenData& t = tokens_[id];
  if (t.attr & (kAttrUnknown | kAttrControl | kAttrUserDefined)) return t.text;
  if (t.attr & kAttrNormal) {
    if (kind_ == Kind::kSpm) {
      std::string s = t.text;
      replace_all(s, kSpmSpace, " ");
      return s;
    }
    return decode_bpe_text(t.text);
  }
  if (t.attr & kAttrByte) return std::string(1, static_cast<char>(byte_token_value(t.text)));
  return {};  // unused / undefined tokens render as nothing
}

int32_t Tokenizer::text_to_token(std::string_view text) const {
  auto it = token_to_id_.find(text);
  return it == token_to_id_.end() ? -1 : it->second;
}

int32_t Tokenizer::byte_to_token(uint8_t byte) const {
  if (kind_ == Kind::kSpm) {
    static const char* kHex = "0123456789ABCDEF";
    const char buf[7] = {'<', '0', 'x', kHex[byte >> 4], kHex[byte & 15], '>', 0};
    if (auto id = text_to_token(buf); id >= 0) return id;
    return text_to_token(std::string(1, static_cast<char>(byte)));
  }
  return text_to_token(unicode::byte_to_bpe_text(byte));
}

int Tokenizer::find_bpe_rank(std::string_view left, std::string_view right) const {
  thread_local std::string key;
  key.assign(left);
  key.push_back('\xFF');
  key.append(right);
  auto it = bpe_ranks_.find(std::string_view(key));
  return it == bpe_ranks_.end() ? -1 : it->second;
}

std::optional<int32_t> Tokenizer::find_token(std::string_view text) const {
  const int32_t id = text_to_token(text);
  if (id < 0) return std::nullopt;
  return id;
}

const std::string& Tokenizer::token_text(int32_t id) const {
  static const std::string kEmpty;
  if (id < 0 || id >= vocab_size()) return kEmpty;
  return tokens_[id].text;
}

uint32_t Tokenizer::token_attr(int32_t id) const {
  if (id < 0 || id >= vocab_size()) return kAttrUndefined;
  return tokens_[id].attr;
}

// tokenizer_st_partition: split the text on special-token texts, longest tokens first; each
// token splits every raw fragment left by the tokens before it.
std::vector<Tokenizer::Fragment> Tokenizer::partition_special(std::string_view text,
                                                              bool parse_special) const {
  std::vector<Fragment> fragments;
  if (text.empty()) return fragments;
  fragments.push_back({-1, 0, text.size()});

  auto is_space = [](char c) { return std::isspace(static_cast<unsigned char>(c)) != 0; };
  std::vector<Fragment> next;
  for (const int32_t special_id : special_tokens_) {
    const TokenData& data = tokens_[special_id];
    // Control and unknown tokens only match with parse_special; user-defined ones always do
    // (as the HF tokenizers pre-split added tokens).
    if (!parse_special && (data.attr & (kAttrControl | kAttrUnknown))) continue;
    const std::string& stext = data.text;

    next.clear();
    bool changed = false;
    for (const Fragment& frag : fragments) {
      if (frag.token >= 0) {
        next.push_back(frag);
        continue;
      }
      size_t base = frag.offset;
      size_t length = frag.length;
      bool split = false;
      while (true) {
        const size_t match = text.substr(0, base + length).find(stext, base);
        if (match == std::string_view::npos) break;
        split = true;
        if (match > base) {
          size_t left_len = match - base;
          if (data.attr & kAttrLstrip) {
            while (left_len > 0 && is_space(text[base + left_len - 1])) left_len--;
          }
          if (left_len > 0) next.push_back({-1, base, left_len});
        }
        next.push_back({special_id, 0, 0});
        if (match + stext.size() < base + length) {
          size_t right_off = match + stext.size();
          size_t right_len = length - ((match - base) + stext.size());
          if (data.attr & kAttrRstrip) {
            while (right_len > 0 && is_space(text[right_off])) {
              right_off++;
              right_len--;
            }
          }
          base = right_off;
          length = right_len;
          if (length == 0) break;
        } else {
          length = 0;
          break;
        }
      }
      if (!split) {
        next.push_back(frag);
      } else {
        changed = true;
        if (length > 0) next.push_back({-1, base, length});
      }
    }
    if (changed) fragments.swap(next);
  }
  return fragments;
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool add_special,
                                       bool parse_special) const {
  std::vector<int32_t> out;
  const std::vector<Fragment> fragments = partition_special(text, parse_special);

  if (kind_ == Kind::kSpm) {
    bool is_prev_special = true;  // the first text fragment gets the space prefix
    if (add_special && add_bos_) {
      out.push_back(bos_id_);
      is_prev_special = true;
    }
    for (const Fragment& frag : fragments) {
      if (frag.token >= 0) {
        out.push_back(frag.token);
        is_prev_special = true;
        continue;
      }
      std::string piece;
      if (add_space_prefix_ && is_prev_special) piece = " ";
      piece.append(text.substr(frag.offset, frag.length));
      replace_all(piece, " ", kSpmSpace);
      encode_spm(piece, out);
      is_prev_special = false;
    }
    if (add_special && add_eos_) out.push_back(eos_id_);
    return out;
  }

  if (add_special && add_bos_) out.push_back(bos_id_);
  for (const Fragment& frag : fragments) {
    if (frag.token >= 0) {
      out.push_back(frag.token);
    } else {
      encode_bpe(text.substr(frag.offset, frag.length), out);
    }
  }
  if (add_special && add_eos_) out.push_back(eos_id_);
  return out;
}

// llm_tokenizer_spm_session::tokenize: start from UTF-8 characters, repeatedly merge the
// adjacent pair that forms the highest-scoring vocabulary entry, then map each symbol to a
// token, re-splitting along the recorded merges (or to byte tokens) where it has none.
void Tokenizer::encode_spm(std::string_view text, std::vector<int32_t>& out) const {
  std::vector<Symbol> symbols;
  std::priority_queue<SpmBigram, std::vector<SpmBigram>, SpmBigramLess> queue;
  std::map<std::string, std::pair<int, int>> rev_merge;

  size_t offs = 0;
  int index = 0;
  while (offs < text.size()) {
    Symbol sym;
    sym.text = text.data() + offs;
    sym.n = std::min(unicode::utf8_len(text[offs]), text.size() - offs);
    offs += sym.n;
    sym.prev = index - 1;
    sym.next = offs == text.size() ? -1 : index + 1;
    index++;
    symbols.push_back(sym);
  }
  if (symbols.empty()) return;

  auto try_add_bigram = [&](int left, int right) {
    if (left == -1 || right == -1) return;
    std::string pair_text(symbols[left].text, symbols[left].n + symbols[right].n);
    const int32_t id = text_to_token(pair_text);
    if (id < 0) return;
    queue.push({left, right, tokens_[id].score, pair_text.size()});
    rev_merge[pair_text] = {left, right};
  };

  for (int i = 1; i < static_cast<int>(symbols.size()); ++i) try_add_bigram(i - 1, i);

  while (!queue.empty()) {
    const SpmBigram bigram = queue.top();
    queue.pop();
    Symbol& left = symbols[bigram.left];
    Symbol& right = symbols[bigram.right];
    // Stale: one side already merged into something else.
    if (left.n == 0 || right.n == 0 || left.n + right.n != bigram.size) continue;
    left.n += right.n;
    right.n = 0;
    left.next = right.next;
    if (right.next >= 0) symbols[right.next].prev = bigram.left;
    try_add_bigram(left.prev, bigram.left);
    try_add_bigram(bigram.left, left.next);
  }

  // Recursive resegmentation, as llama.cpp's resegment().
  auto resegment = [&](auto&& self, const Symbol& symbol) -> void {
    const std::string sym_text(symbol.text, symbol.n);
    const int32_t id = text_to_token(sym_text);
    if (id >= 0) {
      out.push_back(id);
      return;
    }
    const auto it = rev_merge.find(sym_text);
    if (it == rev_merge.end()) {
      for (size_t j = 0; j < symbol.n; ++j) {
        const int32_t byte_id = byte_to_token(static_cast<uint8_t>(symbol.text[j]));
        if (byte_id >= 0) out.push_back(byte_id);
      }
      return;
    }
    self(self, symbols[it->second.first]);
    self(self, symbols[it->second.second]);
  };
  for (int i = 0; i != -1; i = symbols[i].next) resegment(resegment, symbols[i]);
}

// llm_tokenizer_bpe_session::tokenize: pre-tokenize into words, then within each word merge
// the adjacent pair with the lowest merge rank until none applies.
void Tokenizer::encode_bpe(std::string_view text, std::vector<int32_t>& out) const {
  const std::vector<std::string> words = unicode::pre_tokenize(text, split_rules_, /*byte_encode=*/true);

  std::vector<Symbol> symbols;
  for (const std::string& word : words) {
    symbols.clear();
    std::priority_queue<BpeBigram, std::vector<BpeBigram>, BpeBigramGreater> queue;

    int index = 0;
    size_t offset = 0;
    if (ignore_merges_ && text_to_token(word) >= 0) {
      symbols.push_back({-1, -1, word.data(), word.size()});
      offset = word.size();
    }
    while (offset < word.size()) {
      Symbol sym;
      sym.n = std::min(word.size() - offset, unicode::utf8_len(word[offset]));
      sym.text = word.data() + offset;
      offset += sym.n;
      sym.prev = index - 1;
      sym.next = offset == word.size() ? -1 : index + 1;
      index++;
      symbols.push_back(sym);
    }

    auto add_bigram = [&](int left, int right) {
      if (left == -1 || right == -1) return;
      const std::string_view left_text(symbols[left].text, symbols[left].n);
      const std::string_view right_text(symbols[right].text, symbols[right].n);
      const int rank = find_bpe_rank(left_text, right_text);
      if (rank < 0) return;
      BpeBigram bigram;
      bigram.left = left;
      bigram.right = right;
      bigram.size = left_text.size() + right_text.size();
      bigram.text.reserve(bigram.size);
      bigram.text.append(left_text).append(right_text);
      bigram.rank = rank;
      queue.push(std::move(bigram));
    };
    for (int i = 1; i < static_cast<int>(symbols.size()); ++i) add_bigram(i - 1, i);

    while (!queue.empty()) {
      const BpeBigram bigram = queue.top();
      queue.pop();
      Symbol& left = symbols[bigram.left];
      Symbol& right = symbols[bigram.right];
      if (left.n == 0 || right.n == 0) continue;
      // Stale: the pair's text changed since it was queued.
      if (std::string_view(left.text, left.n + right.n) != bigram.text ||
          left.text + left.n != right.text) {
        continue;
      }
      left.n += right.n;
      right.n = 0;
      left.next = right.next;
      if (right.next >= 0) symbols[right.next].prev = bigram.left;
      add_bigram(left.prev, bigram.left);
      add_bigram(bigram.left, left.next);
    }

    for (const Symbol& sym : symbols) {
      if (sym.n == 0) continue;
      const std::string_view sym_text(sym.text, sym.n);
      const int32_t id = text_to_token(sym_text);
      if (id >= 0) {
        out.push_back(id);
        continue;
      }
      // No token for the merged text: fall back to one token per (encoded) byte, silently
      // dropping bytes that have none, exactly as llama.cpp.
      for (const char c : sym_text) {
        const int32_t byte_id = text_to_token(std::string_view(&c, 1));
        if (byte_id >= 0) out.push_back(byte_id);
      }
    }
  }
}

std::string Tokenizer::token_to_piece(int32_t id, bool render_special) const {
  if (id < 0 || id >= vocab_size()) return {};
  if (!render_special && (tokens_[id].attr & (kAttrUnknown | kAttrControl))) return {};
  return pieces_[id];
}

std::string Tokenizer::decode(std::span<const int32_t> ids, bool render_special) const {
  std::string text;
  bool remove_space = add_space_prefix_;  // SPM: drop the space encode() prefixed
  for (const int32_t id : ids) {
    std::string piece = token_to_piece(id, render_special);
    if (remove_space && !piece.empty() && piece[0] == ' ') piece.erase(0, 1);
    remove_space = false;
    text += piece;
  }
  if (!clean_spaces_) return text;

  // llama.cpp's three in-place clean-up passes, kept byte for byte (including that pass 2
  // overwrites the skipped space with '\0', which later comparisons then see).
  char* t = text.data();
  int32_t total = static_cast<int32_t>(text.size());

  const int32_t total1 = total;
  total = total ? 1 : 0;
  for (int32_t i = 1; i < total1; ++i) {
    const char x = t[i];
    if (t[i - 1] == ' ' && (x == '?' || x == '!' || x == '.' || x == ',')) total--;  // " ?" ...
    t[total++] = x;
  }

  const int32_t total2 = total;
  total = total ? 1 : 0;
  for (int32_t i = 1; i < total2; ++i) {
    const char x = t[i];
    if (x == '\'' && i + 1 < total2 && t[i - 1] == ' ' && t[i + 1] == ' ') {  // " ' "
      total--;
      t[++i] = '\0';
    }
    t[total++] = x;
  }

  const int32_t total3 = total;
  total = total ? 1 : 0;
  for (int32_t i = 1; i < total3; ++i) {
    const char x = t[i];
    if (t[i - 1] == ' ' && x == '\'' && i + 1 < total3) {
      const char x1 = t[i + 1];
      if (x1 == 's' || x1 == 'm') {  // " 's", " 'm"
        total--;
      } else if (i + 2 < total3) {
        const char x2 = t[i + 2];
        if ((x1 == 'r' && x2 == 'e') || (x1 == 'v' && x2 == 'e')) total--;  // " 're", " 've"
      }
    }
    t[total++] = x;
  }
  text.resize(static_cast<size_t>(total));
  return text;
}

// ---------------------------------------------------------------------------------------------

StreamingDetokenizer::StreamingDetokenizer(const Tokenizer& tokenizer, bool render_special)
    : tokenizer_(tokenizer), render_special_(render_special) {}

namespace {

// True when `bytes` (non-empty, shorter than a full character) could still become a valid
// UTF-8 character once more bytes arrive.
bool is_incomplete_utf8(std::string_view bytes) {
  const uint8_t b0 = static_cast<uint8_t>(bytes[0]);
  size_t len = 0;
  uint8_t lo = 0x80, hi = 0xBF;
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    len = 2;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    len = 3;
    if (b0 == 0xE0) lo = 0xA0;
    if (b0 == 0xED) hi = 0x9F;
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    len = 4;
    if (b0 == 0xF0) lo = 0x90;
    if (b0 == 0xF4) hi = 0x8F;
  } else {
    return false;
  }
  if (bytes.size() >= len) return false;
  for (size_t k = 1; k < bytes.size(); ++k) {
    const uint8_t b = static_cast<uint8_t>(bytes[k]);
    if (b < (k == 1 ? lo : 0x80) || b > (k == 1 ? hi : 0xBF)) return false;
  }
  return true;
}

constexpr std::string_view kReplacement = "\xEF\xBF\xBD";

}  // namespace

std::string StreamingDetokenizer::push(int32_t id) {
  pending_ += tokenizer_.token_to_piece(id, render_special_);
  std::string out;
  std::string_view rest = pending_;
  while (!rest.empty()) {
    const size_t valid = unicode::valid_utf8_prefix(rest);
    out.append(rest.substr(0, valid));
    rest.remove_prefix(valid);
    if (rest.empty()) break;
    if (is_incomplete_utf8(rest)) break;  // wait for the rest of the character
    // Can never become valid: replace the longest ill-formed prefix that was a valid start
    // (one U+FFFD per maximal subpart, as the Unicode standard recommends).
    size_t bad = 1;
    while (bad < rest.size() && is_incomplete_utf8(rest.substr(0, bad + 1))) bad++;
    out.append(kReplacement);
    rest.remove_prefix(bad);
  }
  pending_ = std::string(rest);
  return out;
}

std::string StreamingDetokenizer::flush() {
  std::string out;
  if (!pending_.empty()) out.append(kReplacement);  // a truncated character
  pending_.clear();
  return out;
}

}  // namespace tessera

namespace tessera {

// llama.cpp's regexes for the splitters (llama-vocab.cpp), which Hugging Face tokenizers'
// Split(Isolated) runs with the same meaning.
std::vector<std::string> Tokenizer::pre_tokenizer_regexes() const {
  std::vector<std::string> out;
  if (kind_ != Kind::kBpe) return out;
  for (const unicode::SplitRule& r : split_rules_) {
    switch (r.kind) {
      case unicode::SplitRule::Kind::kGpt2:
        out.push_back(R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S))");
        break;
      case unicode::SplitRule::Kind::kLlama3:
        out.push_back(R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,)" + std::to_string(r.max_len) +
                      R"(}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)");
        break;
      case unicode::SplitRule::Kind::kClassRun: {
        std::string cls;
        const std::pair<uint16_t, const char*> kClasses[] = {
            {unicode::kNumber, "\\p{N}"},      {unicode::kLetter, "\\p{L}"},      {unicode::kSeparator, "\\p{Z}"},
            {unicode::kAccentMark, "\\p{M}"},  {unicode::kPunctuation, "\\p{P}"}, {unicode::kSymbol, "\\p{S}"},
            {unicode::kControl, "\\p{C}"},     {unicode::kWhitespace, "\\s"}};
        for (const auto& [flag, name] : kClasses)
          if (r.class_flags & flag) cls += name;
        for (char c : r.class_ascii) {
          if (std::string_view("\\^$.|?*+()[]{}-").find(c) != std::string_view::npos) cls += '\\';
          cls += c;
        }
        std::string rep = r.max_len == SIZE_MAX ? (r.min_len == 1 ? "+" : "{" + std::to_string(r.min_len) + ",}")
                          : r.min_len == r.max_len ? (r.min_len == 1 ? "" : "{" + std::to_string(r.min_len) + "}")
                                                   : "{" + std::to_string(r.min_len) + "," + std::to_string(r.max_len) + "}";
        out.push_back("[" + cls + "]" + rep);
        break;
      }
    }
  }
  return out;
}

}  // namespace tessera
