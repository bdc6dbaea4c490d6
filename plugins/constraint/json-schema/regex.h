// A compact regex engine for constraints: a pattern is parsed to a tree, built into a
// Thompson NFA over bytes (characters as their UTF-8 byte sequences, so classes and `.` only
// ever accept well-formed UTF-8), and determinized once at compile time into a ByteDfa whose
// states all still lead to a match. The matcher (matcher.h) keeps one DFA state per regex
// frame, so a regex costs one table lookup per byte and its states cache masks well.
//
// Syntax (the ECMAScript subset JSON Schema `pattern` and vLLM's guided_regex use): literals,
// `.`, classes `[a-z\d]` and `[^...]`, escapes \d \D \w \W \s \S \n \r \t \f \v \0 \xHH
// \uHHHH and escaped punctuation, groups `(...)` `(?:...)`, alternation `|`, quantifiers
// `? * + {m} {m,} {m,n}` (a trailing `?`, lazy, is accepted: it does not change which strings
// match). `^` and `$` only at the ends of a top-level alternative. Refused with the position:
// backreferences, lookaround, \b, named groups.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "tessera/sdk/status.h"

namespace tessera::json_constraint {

// Determinized regex. State 0 is the start; -1 is dead. Immutable after construction.
class ByteDfa {
 public:
  int32_t next(int32_t state, uint8_t byte) const { return next_[static_cast<size_t>(state) * 256 + byte]; }
  bool accepting(int32_t state) const { return accepting_[static_cast<size_t>(state)] != 0; }
  // Some byte leads on from `state` (false: a match that must end here).
  bool has_next(int32_t state) const { return has_next_[static_cast<size_t>(state)] != 0; }
  int32_t num_states() const { return static_cast<int32_t>(accepting_.size()); }
  // The fewest characters (UTF-8 lead or ASCII bytes) from `state` to a match: a string with
  // a maxLength stops taking characters that would leave no room to finish the match.
  int32_t min_chars_to_accept(int32_t state) const { return min_chars_[static_cast<size_t>(state)]; }
  // Runs the whole string from the start; true if it ends in an accepting state.
  bool matches(std::string_view bytes) const;

 private:
  friend class DfaBuilder;
  std::vector<int32_t> next_;  // num_states * 256
  std::vector<uint8_t> accepting_;
  std::vector<uint8_t> has_next_;
  std::vector<int32_t> min_chars_;
};

enum class RegexMode {
  kFullMatch,  // the whole string matches (guided_regex); ^ and $ at the ends are no-ops
  kSearch,     // some substring matches (JSON Schema `pattern`): unanchored ends match anything
};

struct RegexLimits {
  int32_t max_states = 4096;       // DFA states (each 1 KiB)
  int32_t max_nfa_states = 200000;  // after expanding {m,n}
  int32_t max_repeat = 1000;        // m and n of {m,n}
};

// Compiles a pattern. Errors are kInvalidArgument "position N: <problem>" (N counts bytes from
// 0) or a size limit.
Status compile_regex(std::string_view pattern, RegexMode mode, const RegexLimits& limits, ByteDfa* out);

// One character from a set of code point ranges (inclusive; surrogates never match), or any
// character but those when `negated`. GBNF character classes and `.` compile to this.
Status compile_char_class(std::vector<std::pair<uint32_t, uint32_t>> ranges, bool negated, ByteDfa* out);

// A regex (full match) for the canonical JSON integers in [lo, hi]: no leading zeros, no "-0".
std::string integer_range_regex(int64_t lo, int64_t hi);
// A regex for JSON numbers in [lo, hi] (integer bounds, either side open when the flag is
// false): an optional fraction of at most `max_frac_digits` digits, no exponent.
std::string number_range_regex(bool has_lo, int64_t lo, bool has_hi, int64_t hi, int64_t max_abs,
                               int32_t max_frac_digits);

// The UTF-8 bytes of a code point.
std::string utf8_encode(uint32_t cp);

}  // namespace tessera::json_constraint
