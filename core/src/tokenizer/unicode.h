// Unicode helpers for the tokenizer: UTF-8 decoding with llama.cpp's error handling, code
// point categories (generated table), the GPT-2 byte<->unicode mapping, and the pre-tokenizer
// splitters that stand in for llama.cpp's unicode_regex_split.
//
// Internal to core/src/tokenizer; not part of the public headers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace tessera::unicode {

// Same bit layout as llama.cpp's unicode_cpt_flags so the splitters can be compared line by line.
enum Flag : uint16_t {
  kUndefined = 0x0001,
  kNumber = 0x0002,       // \p{N}
  kLetter = 0x0004,       // \p{L}
  kSeparator = 0x0008,    // \p{Z}
  kAccentMark = 0x0010,   // \p{M}
  kPunctuation = 0x0020,  // \p{P}
  kSymbol = 0x0040,       // \p{S}
  kControl = 0x0080,      // \p{C}
  kWhitespace = 0x0100,   // \s (White_Space property)
};

struct CodepointRange {
  uint32_t first;
  uint16_t flags;
};
extern const CodepointRange kCodepointRanges[];
extern const size_t kNumCodepointRanges;

constexpr uint32_t kMaxCodepoint = 0x10FFFF;
constexpr uint32_t kReplacementChar = 0xFFFD;

// Flags of one code point; code points past U+10FFFF are kUndefined (never 0).
uint16_t codepoint_flags(uint32_t cp);

// Byte length of a UTF-8 sequence from its lead byte (1 for continuation bytes), as
// llama.cpp's unicode_len_utf8: only the high nibble is looked at.
size_t utf8_len(char lead);

// Decodes like llama.cpp's unicode_cpts_from_utf8: an invalid sequence yields U+FFFD and
// skips one byte. Overlong forms and surrogates are not rejected (llama.cpp does not either).
std::vector<uint32_t> codepoints_from_utf8(std::string_view text);
void append_utf8(std::string& out, uint32_t cp);

// Length of the longest prefix of `bytes` that is complete, well-formed UTF-8 (RFC 3629:
// no overlongs, surrogates or code points past U+10FFFF).
size_t valid_utf8_prefix(std::string_view bytes);

// GPT-2 byte-level BPE alphabet: each byte maps to one printable code point.
const std::string& byte_to_bpe_text(uint8_t byte);
std::optional<uint8_t> bpe_codepoint_to_byte(uint32_t cp);

// One step of a pre-tokenizer. A step refines the current list of pieces; like a regex in
// llama.cpp's unicode_regex_split, text between matches stays a piece of its own.
struct SplitRule {
  enum class Kind {
    kGpt2,        // 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)
    kLlama3,      // (?i:'s|...)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,max}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
    kClassRun,    // [class]{min,max}: runs of code points whose flags or ASCII set match
  };
  Kind kind = Kind::kGpt2;
  uint16_t class_flags = 0;     // kClassRun: any of these flags matches
  std::string_view class_ascii; // kClassRun: or any of these ASCII characters
  size_t min_len = 1;
  size_t max_len = SIZE_MAX;    // kClassRun run cap, kLlama3 digit-group size
};

// Splits `text` into pre-tokenized words. With `byte_encode` every byte of a word is mapped
// through the GPT-2 byte alphabet (the form BPE merges are written in).
std::vector<std::string> pre_tokenize(std::string_view text, std::span<const SplitRule> rules,
                                      bool byte_encode);

}  // namespace tessera::unicode
