// Tokenizer read from GGUF metadata (tokenizer.ggml.*), matching llama.cpp's llama-vocab.cpp
// token for token: byte-level BPE ("gpt2" models, with the pre-tokenizer named by
// tokenizer.ggml.pre) and SentencePiece BPE ("llama" models, with byte fallback).
//
// Thread-safety: a Tokenizer is immutable after from_gguf(); every const method may be called
// from any number of threads at once. A StreamingDetokenizer is per-stream state: one thread.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace tessera {

namespace gguf {
class GgufFile;
}

namespace unicode {
struct SplitRule;
}

class Tokenizer {
 public:
  enum class Kind { kBpe, kSpm };

  // Token attributes, as llama.cpp's llama_token_attr bits.
  enum Attr : uint32_t {
    kAttrUndefined = 0,
    kAttrUnknown = 1u << 0,
    kAttrUnused = 1u << 1,
    kAttrNormal = 1u << 2,
    kAttrControl = 1u << 3,
    kAttrUserDefined = 1u << 4,
    kAttrByte = 1u << 5,
    kAttrLstrip = 1u << 7,
    kAttrRstrip = 1u << 8,
  };

  // Reads tokenizer.ggml.* metadata; throws std::runtime_error naming the key on bad or
  // missing data (and on a pre-tokenizer this implementation does not know).
  static std::unique_ptr<Tokenizer> from_gguf(const gguf::GgufFile& file);
  ~Tokenizer();
  Tokenizer(const Tokenizer&) = delete;
  Tokenizer& operator=(const Tokenizer&) = delete;

  // Like llama_tokenize: add_special adds BOS/EOS per the model's add_bos/add_eos flags;
  // parse_special makes control/unknown token text (e.g. "<|im_start|>") map to its token,
  // otherwise it is tokenized as plain text. User-defined tokens always match, as in llama.cpp.
  std::vector<int32_t> encode(std::string_view text, bool add_special, bool parse_special) const;

  // Raw bytes of one token: byte-level BPE bytes un-mapped, SPM "▁" -> space, <0xNN> byte
  // tokens -> that byte. Control and unknown tokens render as their text only when
  // render_special (user-defined tokens always do). Out-of-range ids give "".
  std::string token_to_piece(int32_t id, bool render_special) const;

  // As llama.cpp's llama_detokenize(remove_special=false, unparse_special=render_special):
  // concatenated pieces, minus the space SPM prefixed to the first token, then the
  // vocabulary's clean-up of " ." / " 's" style spaces where the model asks for it.
  std::string decode(std::span<const int32_t> ids, bool render_special) const;

  int32_t vocab_size() const { return static_cast<int32_t>(tokens_.size()); }
  int32_t bos_id() const { return bos_id_; }  // -1 if none
  int32_t eos_id() const { return eos_id_; }  // -1 if none
  int32_t eot_id() const { return eot_id_; }  // -1 if none
  int32_t unk_id() const { return unk_id_; }  // -1 if none
  // eos, eot, <|im_end|>, <|endoftext|>, ... : llama.cpp's end-of-generation set.
  bool is_end_of_generation(int32_t id) const { return eog_ids_.count(id) > 0; }
  const std::unordered_set<int32_t>& end_of_generation_ids() const { return eog_ids_; }
  std::optional<int32_t> find_token(std::string_view text) const;
  const std::string& token_text(int32_t id) const;  // the vocabulary entry as stored
  uint32_t token_attr(int32_t id) const;
  bool add_bos() const { return add_bos_; }
  bool add_eos() const { return add_eos_; }
  bool add_space_prefix() const { return add_space_prefix_; }
  bool clean_spaces() const { return clean_spaces_; }
  Kind kind() const { return kind_; }
  const std::string& model_name() const { return model_; }        // "gpt2" / "llama"
  const std::string& pre_tokenizer() const { return pre_; }       // e.g. "smollm"
  const std::string& chat_template() const { return chat_template_; }  // "" if none
  bool ignore_merges() const { return ignore_merges_; }            // whole-word vocabulary hits first
  int32_t pad_id() const { return pad_id_; }  // -1 if none
  // The byte-level BPE pre-tokenizer as regular expressions in the order they apply (each
  // isolates its matches; text between matches stays a piece), in the syntax of Hugging Face
  // tokenizers' Split step (Oniguruma). Empty for SPM vocabularies.
  std::vector<std::string> pre_tokenizer_regexes() const;

 private:
  Tokenizer();
  struct TokenData {
    std::string text;
    float score = 0.0f;
    uint32_t attr = kAttrNormal;
  };
  struct Fragment {
    int32_t token = -1;  // >= 0: a special token; otherwise raw text [offset, offset+length)
    size_t offset = 0;
    size_t length = 0;
  };

  void load(const gguf::GgufFile& file);
  void finish_special_tokens();
  std::vector<Fragment> partition_special(std::string_view text, bool parse_special) const;
  void encode_bpe(std::string_view text, std::vector<int32_t>& out) const;
  void encode_spm(std::string_view text, std::vector<int32_t>& out) const;
  int32_t text_to_token(std::string_view text) const;  // -1 when absent
  int32_t byte_to_token(uint8_t byte) const;            // -1 when absent
  int find_bpe_rank(std::string_view left, std::string_view right) const;
  std::string make_piece(int32_t id) const;

  Kind kind_ = Kind::kBpe;
  std::string model_;
  std::string pre_;
  std::string chat_template_;
  std::vector<TokenData> tokens_;
  // Transparent lookup so string_view keys do not allocate.
  struct StringHash {
    using is_transparent = void;
    size_t operator()(std::string_view s) const noexcept { return std::hash<std::string_view>{}(s); }
  };
  std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>> token_to_id_;
  // Merge ranks keyed by left + '\xFF' + right: 0xFF never occurs in UTF-8, so the key is
  // unambiguous and lookups need no pair of strings.
  std::unordered_map<std::string, int, StringHash, std::equal_to<>> bpe_ranks_;
  std::vector<unicode::SplitRule> split_rules_;
  std::vector<int32_t> special_tokens_;  // control/user-defined/unknown, longest text first
  std::vector<std::string> pieces_;      // token_to_piece(id, render_special=true)
  std::unordered_set<int32_t> eog_ids_;

  int32_t bos_id_ = -1, eos_id_ = -1, eot_id_ = -1, eom_id_ = -1, unk_id_ = -1, sep_id_ = -1,
          pad_id_ = -1, mask_id_ = -1;
  int32_t fim_pre_id_ = -1, fim_suf_id_ = -1, fim_mid_id_ = -1, fim_pad_id_ = -1,
          fim_rep_id_ = -1, fim_sep_id_ = -1;
  bool add_bos_ = false;
  bool add_eos_ = false;
  bool add_space_prefix_ = false;
  bool clean_spaces_ = true;
  bool ignore_merges_ = false;
};

// Feeds tokens, returns only complete UTF-8: bytes of a character split across tokens are
// held back until the character is complete, and bytes that can never become valid UTF-8 are
// replaced with U+FFFD right away, so every returned string is valid UTF-8. flush() returns
// what is left, incomplete bytes replaced with U+FFFD. The output is the concatenation of
// token_to_piece() (no SPM leading-space removal or space clean-up: a stream continues text).
class StreamingDetokenizer {
 public:
  // `tokenizer` must outlive this object.
  explicit StreamingDetokenizer(const Tokenizer& tokenizer, bool render_special = false);
  std::string push(int32_t id);
  std::string flush();

 private:
  const Tokenizer& tokenizer_;
  bool render_special_;
  std::string pending_;  // bytes of an incomplete trailing character
};

}  // namespace tessera
