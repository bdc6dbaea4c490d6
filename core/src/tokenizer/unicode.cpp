// UTF-8, code point categories and pre-tokenizer splitters.
//
// The splitters reproduce llama.cpp's unicode_regex_split (src/unicode.cpp) result for the
// pre-tokenizer regexes we support: the GPT-2 and Llama-3 patterns follow the hand-written
// matchers llama.cpp uses for them, and single character-class patterns (\p{N}, [0-9]{3}, ...)
// follow std::regex search semantics, including that text between matches stays one piece.
#include "unicode.h"

#include <algorithm>
#include <array>

namespace tessera::unicode {

namespace {

constexpr uint32_t kOutOfRange = 0xFFFFFFFF;

struct AsciiFlags {
  std::array<uint16_t, 128> flags{};
  AsciiFlags() {
    for (uint32_t cp = 0; cp < 128; ++cp) flags[cp] = lookup(cp);
  }
  static uint16_t lookup(uint32_t cp) {
    // Last range whose first code point is <= cp.
    const CodepointRange* begin = kCodepointRanges;
    const CodepointRange* end = kCodepointRanges + kNumCodepointRanges;
    auto it = std::upper_bound(begin, end, cp,
                               [](uint32_t v, const CodepointRange& r) { return v < r.first; });
    return (it - 1)->flags;
  }
};

const AsciiFlags& ascii_flags() {
  static const AsciiFlags table;
  return table;
}

struct ByteAlphabet {
  std::array<std::string, 256> byte_to_text;
  std::array<int16_t, 512> cp_to_byte{};  // every mapped code point is < 0x144
  ByteAlphabet() {
    cp_to_byte.fill(-1);
    // Printable Latin-1 bytes map to themselves; the rest are shifted to 256 + n in byte
    // order, exactly as GPT-2's bytes_to_unicode().
    std::array<bool, 256> printable{};
    for (int b = 0x21; b <= 0x7E; ++b) printable[b] = true;
    for (int b = 0xA1; b <= 0xAC; ++b) printable[b] = true;
    for (int b = 0xAE; b <= 0xFF; ++b) printable[b] = true;
    int n = 0;
    for (int b = 0; b < 256; ++b) {
      const uint32_t cp = printable[b] ? static_cast<uint32_t>(b) : static_cast<uint32_t>(256 + n++);
      append_utf8(byte_to_text[b], cp);
      cp_to_byte[cp] = static_cast<int16_t>(b);
    }
  }
};

const ByteAlphabet& byte_alphabet() {
  static const ByteAlphabet alphabet;
  return alphabet;
}

// Context shared by the splitters: the code points of the whole text and their flags.
struct SplitInput {
  const std::vector<uint32_t>& cpts;
  const std::vector<uint16_t>& flags;
};

// Iterates one segment [ini, end) of the current pieces, with llama.cpp's accessors: reads
// outside the segment see kOutOfRange / no flags, so patterns never cross piece boundaries.
class Segment {
 public:
  Segment(const SplitInput& in, size_t ini, size_t end, std::vector<size_t>& out)
      : in_(in), ini_(ini), end_(end), prev_end_(ini), out_(out) {}
  uint32_t cpt(size_t pos) const { return pos >= ini_ && pos < end_ ? in_.cpts[pos] : kOutOfRange; }
  uint16_t flags(size_t pos) const { return pos >= ini_ && pos < end_ ? in_.flags[pos] : 0; }
  size_t end() const { return end_; }
  // Closes the piece that ends at `end`; returns its length.
  size_t add_token(size_t end) {
    const size_t len = end - prev_end_;
    if (len > 0) out_.push_back(len);
    prev_end_ = end;
    return len;
  }

 private:
  const SplitInput& in_;
  size_t ini_, end_, prev_end_;
  std::vector<size_t>& out_;
};

bool is_letter(uint16_t f) { return f & kLetter; }
bool is_number(uint16_t f) { return f & kNumber; }
bool is_space(uint16_t f) { return f & kWhitespace; }
// [^\s\p{L}\p{N}] for a code point inside the segment (flags 0 means "outside").
bool is_other(uint16_t f) { return !(f & (kWhitespace | kLetter | kNumber)) && f != 0; }

uint32_t ascii_lower(uint32_t cp) { return cp >= 'A' && cp <= 'Z' ? cp + 32 : cp; }

// The tail both fast paths share: \s+(?!\S) leaves the last space of a run to prefix the
// next word (unless the run ends the text), then \s+, else one code point on its own.
void split_whitespace_tail(Segment& s, size_t& pos, size_t num_whitespaces) {
  if (num_whitespaces > 1 && s.cpt(pos + num_whitespaces) != kOutOfRange) {
    pos += num_whitespaces - 1;
  } else if (num_whitespaces > 0) {
    pos += num_whitespaces;
  } else {
    ++pos;
  }
  s.add_token(pos);
}

void split_gpt2(Segment& s, size_t ini) {
  for (size_t pos = ini; pos < s.end();) {
    const uint32_t cpt = s.cpt(pos);
    const uint16_t flags = s.flags(pos);

    // 's|'t|'re|'ve|'m|'ll|'d
    if (cpt == '\'' && pos + 1 < s.end()) {
      const uint32_t next = s.cpt(pos + 1);
      if (next == 's' || next == 't' || next == 'm' || next == 'd') {
        pos += s.add_token(pos + 2);
        continue;
      }
      if (pos + 2 < s.end()) {
        const uint32_t next2 = s.cpt(pos + 2);
        if ((next == 'r' && next2 == 'e') || (next == 'v' && next2 == 'e') ||
            (next == 'l' && next2 == 'l')) {
          pos += s.add_token(pos + 3);
          continue;
        }
      }
    }

    uint16_t flags2 = cpt == ' ' ? s.flags(pos + 1) : flags;
    // <space>?\p{L}+
    if (is_letter(flags2)) {
      pos += (cpt == ' ');
      while (is_letter(flags2)) flags2 = s.flags(++pos);
      s.add_token(pos);
      continue;
    }
    // <space>?\p{N}+
    if (is_number(flags2)) {
      pos += (cpt == ' ');
      while (is_number(flags2)) flags2 = s.flags(++pos);
      s.add_token(pos);
      continue;
    }
    // <space>?[^\s\p{L}\p{N}]+
    if (is_other(flags2)) {
      pos += (cpt == ' ');
      while (is_other(flags2)) flags2 = s.flags(++pos);
      s.add_token(pos);
      continue;
    }

    size_t num_whitespaces = 0;
    while (is_space(s.flags(pos + num_whitespaces))) num_whitespaces++;
    split_whitespace_tail(s, pos, num_whitespaces);
  }
}

void split_llama3(Segment& s, size_t ini, size_t max_digits) {
  for (size_t pos = ini; pos < s.end();) {
    const uint32_t cpt = s.cpt(pos);
    const uint16_t flags = s.flags(pos);

    // (?i:'s|'t|'re|'ve|'m|'ll|'d)
    if (cpt == '\'' && pos + 1 < s.end()) {
      const uint32_t next = ascii_lower(s.cpt(pos + 1));
      if (next == 's' || next == 't' || next == 'm' || next == 'd') {
        pos += s.add_token(pos + 2);
        continue;
      }
      if (pos + 2 < s.end()) {
        const uint32_t next2 = ascii_lower(s.cpt(pos + 2));
        if ((next == 'r' && next2 == 'e') || (next == 'v' && next2 == 'e') ||
            (next == 'l' && next2 == 'l')) {
          pos += s.add_token(pos + 3);
          continue;
        }
      }
    }

    // [^\r\n\p{L}\p{N}]?\p{L}+
    if (!(cpt == '\r' || cpt == '\n' || is_number(flags))) {
      if (is_letter(flags) || is_letter(s.flags(pos + 1))) {
        pos++;
        while (is_letter(s.flags(pos))) pos++;
        s.add_token(pos);
        continue;
      }
    }

    // \p{N}{1,max_digits}
    if (is_number(flags)) {
      size_t ini_digits = pos;
      while (is_number(s.flags(pos))) {
        if (++pos - ini_digits >= max_digits) {
          s.add_token(pos);
          ini_digits = pos;
        }
      }
      s.add_token(pos);
      continue;
    }

    // <space>?[^\s\p{L}\p{N}]+[\r\n]*  (llama.cpp tests the unshifted flags for "defined")
    uint16_t flags2 = cpt == ' ' ? s.flags(pos + 1) : flags;
    if (!(flags2 & (kWhitespace | kLetter | kNumber)) && flags != 0) {
      pos += (cpt == ' ');
      while (is_other(flags2)) flags2 = s.flags(++pos);
      uint32_t cpt2 = s.cpt(pos);
      while (cpt2 == '\r' || cpt2 == '\n') cpt2 = s.cpt(++pos);
      s.add_token(pos);
      continue;
    }

    size_t num_whitespaces = 0;
    size_t last_end_r_or_n = 0;
    while (is_space(s.flags(pos + num_whitespaces))) {
      const uint32_t cpt2 = s.cpt(pos + num_whitespaces);
      if (cpt2 == '\r' || cpt2 == '\n') last_end_r_or_n = pos + num_whitespaces + 1;
      num_whitespaces++;
    }
    // \s*[\r\n]+
    if (last_end_r_or_n > 0) {
      pos = last_end_r_or_n;
      s.add_token(pos);
      continue;
    }
    split_whitespace_tail(s, pos, num_whitespaces);
  }
}

bool class_matches(const SplitRule& rule, uint32_t cp, uint16_t flags) {
  if (flags & rule.class_flags) return true;
  return cp < 128 && rule.class_ascii.find(static_cast<char>(cp)) != std::string_view::npos;
}

// A single character-class regex with std::regex search semantics: at each position match
// the longest run (capped at max_len); a run shorter than min_len is no match there.
void split_class_run(const SplitInput& in, const SplitRule& rule, size_t ini, size_t end,
                     std::vector<size_t>& out) {
  size_t prev = ini;
  size_t pos = ini;
  while (pos < end) {
    size_t run = 0;
    while (pos + run < end && run < rule.max_len &&
           class_matches(rule, in.cpts[pos + run], in.flags[pos + run])) {
      run++;
    }
    if (run > 0 && run >= rule.min_len) {
      if (pos > prev) out.push_back(pos - prev);
      out.push_back(run);
      pos += run;
      prev = pos;
    } else {
      pos++;
    }
  }
  if (end > prev) out.push_back(end - prev);
}

}  // namespace

uint16_t codepoint_flags(uint32_t cp) {
  if (cp < 128) return ascii_flags().flags[cp];
  if (cp > kMaxCodepoint) return kUndefined;
  return AsciiFlags::lookup(cp);
}

size_t utf8_len(char lead) {
  static constexpr size_t kLookup[] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4};
  return kLookup[static_cast<uint8_t>(lead) >> 4];
}

std::vector<uint32_t> codepoints_from_utf8(std::string_view text) {
  std::vector<uint32_t> out;
  out.reserve(text.size());
  const size_t n = text.size();
  auto byte = [&](size_t i) { return static_cast<uint8_t>(text[i]); };
  auto cont = [&](size_t i) { return i < n && (byte(i) & 0xC0) == 0x80; };
  size_t i = 0;
  while (i < n) {
    const uint8_t b0 = byte(i);
    if (!(b0 & 0x80)) {
      out.push_back(b0);
      i += 1;
    } else if (!(b0 & 0x40)) {
      out.push_back(kReplacementChar);  // stray continuation byte
      i += 1;
    } else if (!(b0 & 0x20)) {
      if (!cont(i + 1)) { out.push_back(kReplacementChar); i += 1; continue; }
      out.push_back(((b0 & 0x1Fu) << 6) | (byte(i + 1) & 0x3Fu));
      i += 2;
    } else if (!(b0 & 0x10)) {
      if (!cont(i + 1) || !cont(i + 2)) { out.push_back(kReplacementChar); i += 1; continue; }
      out.push_back(((b0 & 0x0Fu) << 12) | ((byte(i + 1) & 0x3Fu) << 6) | (byte(i + 2) & 0x3Fu));
      i += 3;
    } else if (!(b0 & 0x08)) {
      if (!cont(i + 1) || !cont(i + 2) || !cont(i + 3)) {
        out.push_back(kReplacementChar);
        i += 1;
        continue;
      }
      const uint32_t cp = ((b0 & 0x07u) << 18) | ((byte(i + 1) & 0x3Fu) << 12) |
                          ((byte(i + 2) & 0x3Fu) << 6) | (byte(i + 3) & 0x3Fu);
      // llama.cpp would throw later when re-encoding a code point past U+10FFFF; we degrade
      // to the replacement character instead of failing the whole request.
      out.push_back(cp > kMaxCodepoint ? kReplacementChar : cp);
      i += 4;
    } else {
      out.push_back(kReplacementChar);
      i += 1;
    }
  }
  return out;
}

void append_utf8(std::string& out, uint32_t cp) {
  if (cp <= 0x7F) {
    out.push_back(static_cast<char>(cp));
  } else if (cp <= 0x7FF) {
    out.push_back(static_cast<char>(0xC0 | ((cp >> 6) & 0x1F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp <= 0xFFFF) {
    out.push_back(static_cast<char>(0xE0 | ((cp >> 12) & 0x0F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp <= kMaxCodepoint) {
    out.push_back(static_cast<char>(0xF0 | ((cp >> 18) & 0x07)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    append_utf8(out, kReplacementChar);
  }
}

size_t valid_utf8_prefix(std::string_view bytes) {
  size_t i = 0;
  const size_t n = bytes.size();
  while (i < n) {
    const uint8_t b0 = static_cast<uint8_t>(bytes[i]);
    size_t len = 0;
    uint8_t lo = 0x80, hi = 0xBF;  // allowed range of the second byte
    if (b0 < 0x80) {
      len = 1;
    } else if (b0 >= 0xC2 && b0 <= 0xDF) {
      len = 2;
    } else if (b0 >= 0xE0 && b0 <= 0xEF) {
      len = 3;
      if (b0 == 0xE0) lo = 0xA0;  // no overlongs
      if (b0 == 0xED) hi = 0x9F;  // no surrogates
    } else if (b0 >= 0xF0 && b0 <= 0xF4) {
      len = 4;
      if (b0 == 0xF0) lo = 0x90;
      if (b0 == 0xF4) hi = 0x8F;  // nothing past U+10FFFF
    } else {
      return i;
    }
    if (i + len > n) return i;
    for (size_t k = 1; k < len; ++k) {
      const uint8_t b = static_cast<uint8_t>(bytes[i + k]);
      const uint8_t min = k == 1 ? lo : 0x80;
      const uint8_t max = k == 1 ? hi : 0xBF;
      if (b < min || b > max) return i;
    }
    i += len;
  }
  return i;
}

const std::string& byte_to_bpe_text(uint8_t byte) { return byte_alphabet().byte_to_text[byte]; }

std::optional<uint8_t> bpe_codepoint_to_byte(uint32_t cp) {
  const auto& alphabet = byte_alphabet();
  if (cp >= alphabet.cp_to_byte.size() || alphabet.cp_to_byte[cp] < 0) return std::nullopt;
  return static_cast<uint8_t>(alphabet.cp_to_byte[cp]);
}

std::vector<std::string> pre_tokenize(std::string_view text, std::span<const SplitRule> rules,
                                      bool byte_encode) {
  const std::vector<uint32_t> cpts = codepoints_from_utf8(text);
  std::vector<uint16_t> flags(cpts.size());
  for (size_t i = 0; i < cpts.size(); ++i) flags[i] = codepoint_flags(cpts[i]);
  const SplitInput in{cpts, flags};

  // Piece lengths in code points; each rule refines every piece independently.
  std::vector<size_t> pieces = {cpts.size()};
  for (const SplitRule& rule : rules) {
    std::vector<size_t> next;
    next.reserve(pieces.size() * 2);
    size_t start = 0;
    for (const size_t len : pieces) {
      const size_t ini = start;
      const size_t end = start + len;
      start = end;
      if (len == 0) continue;
      switch (rule.kind) {
        case SplitRule::Kind::kGpt2: {
          Segment seg(in, ini, end, next);
          split_gpt2(seg, ini);
          break;
        }
        case SplitRule::Kind::kLlama3: {
          Segment seg(in, ini, end, next);
          split_llama3(seg, ini, rule.max_len);
          break;
        }
        case SplitRule::Kind::kClassRun:
          split_class_run(in, rule, ini, end, next);
          break;
      }
    }
    pieces = std::move(next);
  }

  std::vector<std::string> words;
  words.reserve(pieces.size());
  size_t start = 0;
  std::string utf8;
  for (const size_t len : pieces) {
    utf8.clear();
    for (size_t i = start; i < start + len; ++i) append_utf8(utf8, cpts[i]);
    start += len;
    if (!byte_encode) {
      words.push_back(utf8);
      continue;
    }
    std::string encoded;
    encoded.reserve(utf8.size() * 2);
    for (const char c : utf8) encoded += byte_to_bpe_text(static_cast<uint8_t>(c));
    words.push_back(std::move(encoded));
  }
  return words;
}

}  // namespace tessera::unicode
