// Per-code-point maps of the BERT normalizer (scripts/gen_wordpiece_tables.py): what a code
// point becomes once accents are stripped (NFD minus nonspacing marks) and once lowercased.
// Internal to core/src/tokenizer.
#pragma once

#include <cstddef>
#include <cstdint>

namespace tessera::unicode {

// Code point `codepoint` maps to pool[offset, offset + length) (length may be 0: dropped).
struct CodepointMapping {
  uint32_t codepoint;
  uint32_t offset;
  uint32_t length;
};

extern const uint32_t kStripAccentsPool[];
extern const CodepointMapping kStripAccents[];  // sorted by code point
extern const size_t kNumStripAccents;
extern const uint32_t kLowercasePool[];
extern const CodepointMapping kLowercase[];  // sorted by code point
extern const size_t kNumLowercase;

}  // namespace tessera::unicode
