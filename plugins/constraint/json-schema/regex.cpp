#include "regex.h"

#include <algorithm>
#include <climits>
#include <deque>
#include <map>

namespace tessera::json_constraint {
namespace {

constexpr uint32_t kMaxCodePoint = 0x10FFFF;

// Code point ranges, sorted and merged.
using Ranges = std::vector<std::pair<uint32_t, uint32_t>>;

Ranges normalize(Ranges r) {
  std::sort(r.begin(), r.end());
  Ranges out;
  for (const auto& [lo, hi] : r) {
    if (!out.empty() && lo <= out.back().second + 1) {
      out.back().second = std::max(out.back().second, hi);
    } else {
      out.push_back({lo, hi});
    }
  }
  return out;
}

Ranges complement(const Ranges& r) {
  Ranges n = normalize(r), out;
  uint32_t next = 0;
  for (const auto& [lo, hi] : n) {
    if (lo > next) out.push_back({next, lo - 1});
    next = hi + 1;
  }
  if (next <= kMaxCodePoint) out.push_back({next, kMaxCodePoint});
  return out;
}

struct ByteRange {
  uint8_t lo, hi;
};

int encoded_length(uint32_t cp) { return cp < 0x80 ? 1 : cp < 0x800 ? 2 : cp < 0x10000 ? 3 : 4; }

// The UTF-8 encodings of [lo, hi] (one encoded length, no surrogates) as byte-range
// sequences: split until every position's byte range is independent of the others (the
// standard construction, as in RE2 and Rust's regex-syntax).
void utf8_sequences(uint32_t lo, uint32_t hi, std::vector<std::vector<ByteRange>>* out) {
  if (lo > hi) return;
  // Surrogates are not characters.
  if (lo <= 0xDFFF && hi >= 0xD800) {
    if (lo < 0xD800) utf8_sequences(lo, 0xD7FF, out);
    if (hi > 0xDFFF) utf8_sequences(0xE000, hi, out);
    return;
  }
  for (uint32_t boundary : {0x7Fu, 0x7FFu, 0xFFFFu}) {
    if (lo <= boundary && hi > boundary) {
      utf8_sequences(lo, boundary, out);
      utf8_sequences(boundary + 1, hi, out);
      return;
    }
  }
  if (hi < 0x80) {
    out->push_back({{static_cast<uint8_t>(lo), static_cast<uint8_t>(hi)}});
    return;
  }
  const int n = encoded_length(lo);
  for (int i = 1; i < n; ++i) {
    const uint32_t m = (1u << (6 * i)) - 1;
    if ((lo & ~m) != (hi & ~m)) {
      if ((lo & m) != 0) {
        utf8_sequences(lo, lo | m, out);
        utf8_sequences((lo | m) + 1, hi, out);
        return;
      }
      if ((hi & m) != m) {
        utf8_sequences(lo, (hi & ~m) - 1, out);
        utf8_sequences(hi & ~m, hi, out);
        return;
      }
    }
  }
  const std::string a = utf8_encode(lo), b = utf8_encode(hi);
  std::vector<ByteRange> seq;
  for (size_t k = 0; k < a.size(); ++k) seq.push_back({static_cast<uint8_t>(a[k]), static_cast<uint8_t>(b[k])});
  out->push_back(std::move(seq));
}

// The parsed pattern.
struct Re {
  enum Kind { kEmpty, kSet, kConcat, kAlt, kRepeat } kind = kEmpty;
  Ranges set;
  std::vector<Re> kids;
  int32_t min = 0, max = -1;  // kRepeat; max -1: unbounded
};

Re set_of(Ranges r) {
  Re re;
  re.kind = Re::kSet;
  re.set = normalize(std::move(r));
  return re;
}

Re any_char() { return set_of({{0, kMaxCodePoint}}); }

Ranges digit_ranges() { return {{'0', '9'}}; }
Ranges word_ranges() { return {{'0', '9'}, {'A', 'Z'}, {'_', '_'}, {'a', 'z'}}; }
// As std::regex (and C's isspace) have it.
Ranges space_ranges() { return {{'\t', '\r'}, {' ', ' '}}; }

class Parser {
 public:
  Parser(std::string_view p, const RegexLimits& limits) : p_(p), limits_(limits) {}

  Status parse(RegexMode mode, Re* out) {
    Re alt;
    alt.kind = Re::kAlt;
    while (true) {
      bool anchored_start = false, anchored_end = false;
      if (i_ < p_.size() && p_[i_] == '^') {
        anchored_start = true;
        ++i_;
      }
      Re branch;
      if (!parse_concat(0, &branch, &anchored_end)) return status_;
      if (mode == RegexMode::kSearch) {
        Re wrapped;
        wrapped.kind = Re::kConcat;
        Re anything;
        anything.kind = Re::kRepeat;
        anything.kids = {any_char()};
        if (!anchored_start) wrapped.kids.push_back(anything);
        wrapped.kids.push_back(std::move(branch));
        if (!anchored_end) wrapped.kids.push_back(anything);
        branch = std::move(wrapped);
      }
      alt.kids.push_back(std::move(branch));
      if (i_ >= p_.size()) break;
      if (p_[i_] == ')') return fail("unmatched ')'");
      ++i_;  // '|'
    }
    *out = alt.kids.size() == 1 ? std::move(alt.kids[0]) : std::move(alt);
    return Status::ok();
  }

 private:
  bool fail_at(size_t pos, const std::string& message) {
    status_ = invalid_argument("position " + std::to_string(pos) + ": " + message);
    return false;
  }
  Status fail(const std::string& message) {
    fail_at(i_, message);
    return status_;
  }

  // Alternatives up to ')' (depth > 0) or the end.
  bool parse_alt(int depth, Re* out) {
    if (depth > 100) return fail_at(i_, "groups nested more than 100 deep");
    Re alt;
    alt.kind = Re::kAlt;
    while (true) {
      Re branch;
      if (!parse_concat(depth, &branch, nullptr)) return false;
      alt.kids.push_back(std::move(branch));
      if (i_ < p_.size() && p_[i_] == '|') {
        ++i_;
        continue;
      }
      break;
    }
    *out = alt.kids.size() == 1 ? std::move(alt.kids[0]) : std::move(alt);
    return true;
  }

  // Atoms with their quantifiers up to '|', ')' or the end. At the top level (anchored_end
  // given) a '$' may end the branch.
  bool parse_concat(int depth, Re* out, bool* anchored_end) {
    out->kind = Re::kConcat;
    while (i_ < p_.size()) {
      const char c = p_[i_];
      if (c == '|' || c == ')') break;
      if (c == '$') {
        const bool at_end = i_ + 1 == p_.size() || p_[i_ + 1] == '|';
        if (!anchored_end || !at_end)
          return fail_at(i_, "'$' is only supported at the end of the pattern (or of a top-level alternative)");
        *anchored_end = true;
        ++i_;
        break;
      }
      if (c == '^') return fail_at(i_, "'^' is only supported at the start of the pattern (or of a top-level alternative)");
      Re atom;
      if (!parse_atom(depth, &atom)) return false;
      if (!parse_quantifiers(&atom)) return false;
      out->kids.push_back(std::move(atom));
    }
    if (out->kids.empty()) out->kind = Re::kEmpty;
    return true;
  }

  bool parse_number(int32_t* value) {
    const size_t start = i_;
    int64_t v = 0;
    while (i_ < p_.size() && p_[i_] >= '0' && p_[i_] <= '9') {
      v = v * 10 + (p_[i_] - '0');
      if (v > limits_.max_repeat) return fail_at(start, "repetition count above " + std::to_string(limits_.max_repeat));
      ++i_;
    }
    if (i_ == start) return false;
    *value = static_cast<int32_t>(v);
    return true;
  }

  bool parse_quantifiers(Re* atom) {
    if (i_ >= p_.size()) return true;
    const char c = p_[i_];
    int32_t min = 0, max = -1;
    const size_t start = i_;
    if (c == '*') {
      ++i_;
    } else if (c == '+') {
      min = 1;
      ++i_;
    } else if (c == '?') {
      max = 1;
      ++i_;
    } else if (c == '{') {
      ++i_;
      if (!parse_number(&min)) return status_.is_ok() ? fail_at(start, "expected {m}, {m,} or {m,n}") : false;
      if (i_ < p_.size() && p_[i_] == ',') {
        ++i_;
        if (i_ < p_.size() && p_[i_] != '}' && !parse_number(&max))
          return status_.is_ok() ? fail_at(start, "expected {m}, {m,} or {m,n}") : false;
      } else {
        max = min;
      }
      if (i_ >= p_.size() || p_[i_] != '}') return fail_at(start, "expected {m}, {m,} or {m,n}");
      ++i_;
      if (max >= 0 && max < min) return fail_at(start, "{m,n} with n below m");
    } else {
      return true;
    }
    if (i_ < p_.size() && p_[i_] == '?') ++i_;  // lazy: the same strings match
    if (i_ < p_.size() && (p_[i_] == '*' || p_[i_] == '+' || p_[i_] == '?' || p_[i_] == '{'))
      return fail_at(i_, "nothing to repeat (a quantifier after a quantifier)");
    Re rep;
    rep.kind = Re::kRepeat;
    rep.min = min;
    rep.max = max;
    rep.kids.push_back(std::move(*atom));
    *atom = std::move(rep);
    return true;
  }

  // One UTF-8 character of the pattern.
  bool parse_literal_char(uint32_t* cp) {
    const auto b0 = static_cast<uint8_t>(p_[i_]);
    const int n = b0 < 0x80 ? 1 : (b0 >> 5) == 6 ? 2 : (b0 >> 4) == 14 ? 3 : (b0 >> 3) == 30 ? 4 : 0;
    if (n == 0 || i_ + static_cast<size_t>(n) > p_.size()) return fail_at(i_, "not valid UTF-8");
    uint32_t v = n == 1 ? b0 : b0 & (0x7F >> n);
    for (int k = 1; k < n; ++k) {
      const auto b = static_cast<uint8_t>(p_[i_ + static_cast<size_t>(k)]);
      if ((b & 0xC0) != 0x80) return fail_at(i_, "not valid UTF-8");
      v = (v << 6) | (b & 0x3F);
    }
    if (encoded_length(v) != n || v > kMaxCodePoint || (v >= 0xD800 && v <= 0xDFFF))
      return fail_at(i_, "not valid UTF-8");
    i_ += static_cast<size_t>(n);
    *cp = v;
    return true;
  }

  bool parse_hex(size_t digits, uint32_t* cp) {
    if (i_ + digits > p_.size()) return fail_at(i_, "expected " + std::to_string(digits) + " hex digits");
    uint32_t v = 0;
    for (size_t k = 0; k < digits; ++k) {
      const char h = p_[i_ + k];
      int d = h >= '0' && h <= '9' ? h - '0' : h >= 'a' && h <= 'f' ? h - 'a' + 10 : h >= 'A' && h <= 'F' ? h - 'A' + 10 : -1;
      if (d < 0) return fail_at(i_ + k, "expected a hex digit");
      v = v * 16 + static_cast<uint32_t>(d);
    }
    i_ += digits;
    *cp = v;
    return true;
  }

  // After a backslash: a character (*is_set false) or a class (\d, \w, \s and negations).
  bool parse_escape(Ranges* set, bool* is_set, uint32_t* cp) {
    const size_t at = i_ - 1;
    if (i_ >= p_.size()) return fail_at(at, "a trailing backslash");
    const char c = p_[i_];
    *is_set = false;
    auto class_of = [&](Ranges r, bool negate) {
      *set = negate ? complement(r) : std::move(r);
      *is_set = true;
      ++i_;
      return true;
    };
    switch (c) {
      case 'd': return class_of(digit_ranges(), false);
      case 'D': return class_of(digit_ranges(), true);
      case 'w': return class_of(word_ranges(), false);
      case 'W': return class_of(word_ranges(), true);
      case 's': return class_of(space_ranges(), false);
      case 'S': return class_of(space_ranges(), true);
      case 'n': *cp = '\n'; ++i_; return true;
      case 'r': *cp = '\r'; ++i_; return true;
      case 't': *cp = '\t'; ++i_; return true;
      case 'f': *cp = '\f'; ++i_; return true;
      case 'v': *cp = '\v'; ++i_; return true;
      case '0':
        if (i_ + 1 < p_.size() && p_[i_ + 1] >= '0' && p_[i_ + 1] <= '9')
          return fail_at(at, "octal escapes are not supported");
        *cp = 0;
        ++i_;
        return true;
      case 'x': ++i_; return parse_hex(2, cp);
      case 'u': ++i_; return parse_hex(4, cp) && ((*cp < 0xD800 || *cp > 0xDFFF) || fail_at(at, "a surrogate escape"));
      case 'b':
      case 'B': return fail_at(at, "word boundaries (\\b, \\B) are not supported");
      default: break;
    }
    if (c >= '1' && c <= '9') return fail_at(at, "backreferences are not supported");
    if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')) return fail_at(at, std::string("unknown escape \\") + c);
    return parse_literal_char(cp);  // escaped punctuation (or any other character) is itself
  }

  bool parse_class(Re* out) {
    const size_t open = i_ - 1;
    bool negated = false;
    if (i_ < p_.size() && p_[i_] == '^') {
      negated = true;
      ++i_;
    }
    Ranges set;
    while (true) {
      if (i_ >= p_.size()) return fail_at(open, "missing ']'");
      if (p_[i_] == ']') {
        ++i_;
        break;
      }
      // One class atom: a character or an escaped class.
      auto atom = [&](uint32_t* cp, bool* is_set, Ranges* sub) {
        if (p_[i_] == '\\') {
          ++i_;
          return parse_escape(sub, is_set, cp);
        }
        *is_set = false;
        return parse_literal_char(cp);
      };
      uint32_t lo = 0;
      bool lo_set = false;
      Ranges sub;
      const size_t at = i_;
      if (!atom(&lo, &lo_set, &sub)) return false;
      if (lo_set) {
        set.insert(set.end(), sub.begin(), sub.end());
        continue;
      }
      if (i_ + 1 < p_.size() && p_[i_] == '-' && p_[i_ + 1] != ']') {
        ++i_;
        uint32_t hi = 0;
        bool hi_set = false;
        if (!atom(&hi, &hi_set, &sub)) return false;
        if (hi_set) return fail_at(at, "a range cannot end in a class escape");
        if (hi < lo) return fail_at(at, "range out of order");
        set.push_back({lo, hi});
      } else {
        set.push_back({lo, lo});
      }
    }
    *out = set_of(negated ? complement(set) : set);
    return true;
  }

  bool parse_atom(int depth, Re* out) {
    const char c = p_[i_];
    if (c == '*' || c == '+' || c == '?' || c == '{') return fail_at(i_, std::string("nothing to repeat before '") + c + "'");
    if (c == '(') {
      const size_t open = i_;
      ++i_;
      if (i_ < p_.size() && p_[i_] == '?') {
        if (i_ + 1 < p_.size() && p_[i_ + 1] == ':') {
          i_ += 2;
        } else {
          return fail_at(open, "lookaround and named groups are not supported (only (...) and (?:...))");
        }
      }
      if (!parse_alt(depth + 1, out)) return false;
      if (i_ >= p_.size() || p_[i_] != ')') return fail_at(open, "missing ')'");
      ++i_;
      return true;
    }
    if (c == '[') {
      ++i_;
      return parse_class(out);
    }
    if (c == '.') {
      ++i_;
      // ECMAScript: any character but line terminators.
      *out = set_of(complement({{'\n', '\n'}, {'\r', '\r'}, {0x2028, 0x2029}}));
      return true;
    }
    uint32_t cp = 0;
    if (c == '\\') {
      ++i_;
      Ranges set;
      bool is_set = false;
      if (!parse_escape(&set, &is_set, &cp)) return false;
      *out = is_set ? set_of(set) : set_of({{cp, cp}});
      return true;
    }
    if (!parse_literal_char(&cp)) return false;
    *out = set_of({{cp, cp}});
    return true;
  }

  std::string_view p_;
  const RegexLimits& limits_;
  size_t i_ = 0;
  Status status_;
};

// Thompson NFA: each state has epsilon edges and at most one byte-range edge.
struct Nfa {
  struct State {
    std::vector<int32_t> eps;
    uint8_t lo = 0, hi = 0;
    int32_t next = -1;  // byte edge target, -1: none
  };
  std::vector<State> states;
  int32_t limit = 0;
  bool too_big = false;

  int32_t add() {
    if (static_cast<int32_t>(states.size()) >= limit) too_big = true;
    states.emplace_back();
    return static_cast<int32_t>(states.size() - 1);
  }
};

struct Frag {
  int32_t start, end;
};

Frag build(const Re& re, Nfa* nfa) {
  if (nfa->too_big) return {0, 0};
  switch (re.kind) {
    case Re::kEmpty: {
      const int32_t s = nfa->add();
      return {s, s};
    }
    case Re::kSet: {
      const int32_t s = nfa->add(), e = nfa->add();
      std::vector<std::vector<ByteRange>> seqs;
      for (const auto& [lo, hi] : re.set) utf8_sequences(lo, std::min(hi, kMaxCodePoint), &seqs);
      for (const auto& seq : seqs) {
        int32_t a = nfa->add();
        nfa->states[static_cast<size_t>(s)].eps.push_back(a);
        for (size_t k = 0; k < seq.size(); ++k) {
          const int32_t b = k + 1 == seq.size() ? e : nfa->add();
          auto& st = nfa->states[static_cast<size_t>(a)];
          st.lo = seq[k].lo;
          st.hi = seq[k].hi;
          st.next = b;
          a = b;
        }
        if (nfa->too_big) break;
      }
      return {s, e};
    }
    case Re::kConcat: {
      Frag f = build(re.kids[0], nfa);
      for (size_t k = 1; k < re.kids.size() && !nfa->too_big; ++k) {
        const Frag g = build(re.kids[k], nfa);
        nfa->states[static_cast<size_t>(f.end)].eps.push_back(g.start);
        f.end = g.end;
      }
      return f;
    }
    case Re::kAlt: {
      const int32_t s = nfa->add(), e = nfa->add();
      for (const Re& kid : re.kids) {
        if (nfa->too_big) break;
        const Frag g = build(kid, nfa);
        nfa->states[static_cast<size_t>(s)].eps.push_back(g.start);
        nfa->states[static_cast<size_t>(g.end)].eps.push_back(e);
      }
      return {s, e};
    }
    case Re::kRepeat: {
      // m copies, then either a loop (unbounded) or n - m optional copies.
      const int32_t s = nfa->add();
      Frag f{s, s};
      auto append = [&](Frag g) {
        nfa->states[static_cast<size_t>(f.end)].eps.push_back(g.start);
        f.end = g.end;
      };
      for (int32_t k = 0; k < re.min && !nfa->too_big; ++k) append(build(re.kids[0], nfa));
      if (re.max < 0) {
        const int32_t loop = nfa->add();
        const Frag g = build(re.kids[0], nfa);
        nfa->states[static_cast<size_t>(loop)].eps.push_back(g.start);
        nfa->states[static_cast<size_t>(g.end)].eps.push_back(loop);
        append({loop, loop});
      } else {
        for (int32_t k = re.min; k < re.max && !nfa->too_big; ++k) {
          const int32_t skip = nfa->add();
          const Frag g = build(re.kids[0], nfa);
          nfa->states[static_cast<size_t>(skip)].eps.push_back(g.start);
          const int32_t join = nfa->add();
          nfa->states[static_cast<size_t>(skip)].eps.push_back(join);
          nfa->states[static_cast<size_t>(g.end)].eps.push_back(join);
          append({skip, join});
        }
      }
      return f;
    }
  }
  return {0, 0};
}

}  // namespace

// Subset construction: a DFA state is the set of NFA states with a byte edge (plus the accept
// state) reachable by epsilon edges; afterwards states that cannot reach a match are removed.
class DfaBuilder {
 public:
  static Status build(const Nfa& nfa, int32_t accept, int32_t max_states, ByteDfa* out) {
    DfaBuilder b(nfa, accept);
    std::vector<int32_t> start = b.closure({0});
    b.intern(start);
    std::vector<int32_t> next;
    for (size_t s = 0; s < b.sets_.size(); ++s) {
      if (static_cast<int32_t>(b.sets_.size()) > max_states)
        return invalid_argument("the pattern needs more than " + std::to_string(max_states) +
                                " automaton states; simplify it (fewer or smaller {m,n} counts)");
      std::vector<std::vector<int32_t>> targets(256);
      for (int32_t q : b.sets_[s]) {
        const auto& st = nfa.states[static_cast<size_t>(q)];
        if (st.next < 0) continue;
        for (int c = st.lo; c <= st.hi; ++c) targets[static_cast<size_t>(c)].push_back(st.next);
      }
      std::map<std::vector<int32_t>, int32_t> local;
      for (int c = 0; c < 256; ++c) {
        auto& t = targets[static_cast<size_t>(c)];
        int32_t id = -1;
        if (!t.empty()) {
          if (auto it = local.find(t); it != local.end()) {
            id = it->second;
          } else {
            id = b.intern(b.closure(t));
            local.emplace(t, id);
          }
        }
        b.next_.push_back(id);
      }
    }
    const auto n = b.sets_.size();
    // Keep the states from which an accepting state can be reached.
    std::vector<uint8_t> live(n, 0);
    for (size_t s = 0; s < n; ++s) live[s] = b.accepting_[s];
    for (bool changed = true; changed;) {
      changed = false;
      for (size_t s = 0; s < n; ++s) {
        if (live[s]) continue;
        for (int c = 0; c < 256 && !live[s]; ++c) {
          const int32_t t = b.next_[s * 256 + static_cast<size_t>(c)];
          if (t >= 0 && live[static_cast<size_t>(t)]) live[s] = changed = true;
        }
      }
    }
    if (!live[0]) return invalid_argument("the pattern matches no string");
    std::vector<int32_t> renumber(n, -1);
    int32_t count = 0;
    for (size_t s = 0; s < n; ++s)
      if (live[s]) renumber[s] = count++;
    ByteDfa dfa;
    dfa.next_.assign(static_cast<size_t>(count) * 256, -1);
    dfa.accepting_.assign(static_cast<size_t>(count), 0);
    dfa.has_next_.assign(static_cast<size_t>(count), 0);
    for (size_t s = 0; s < n; ++s) {
      if (!live[s]) continue;
      const auto r = static_cast<size_t>(renumber[s]);
      dfa.accepting_[r] = b.accepting_[s];
      for (int c = 0; c < 256; ++c) {
        const int32_t t = b.next_[s * 256 + static_cast<size_t>(c)];
        const int32_t rt = t >= 0 ? renumber[static_cast<size_t>(t)] : -1;
        dfa.next_[r * 256 + static_cast<size_t>(c)] = rt;
        if (rt >= 0) dfa.has_next_[r] = 1;
      }
    }
    // Distances to a match by 0-1 breadth-first search over reversed edges (a continuation
    // byte costs nothing: it does not start a character).
    dfa.min_chars_.assign(static_cast<size_t>(count), INT32_MAX);
    std::vector<std::vector<std::pair<int32_t, int32_t>>> reverse(static_cast<size_t>(count));
    for (int32_t s = 0; s < count; ++s)
      for (int c = 0; c < 256; ++c)
        if (const int32_t t = dfa.next(s, static_cast<uint8_t>(c)); t >= 0)
          reverse[static_cast<size_t>(t)].push_back({s, (c & 0xC0) == 0x80 ? 0 : 1});
    std::deque<int32_t> queue;
    for (int32_t s = 0; s < count; ++s)
      if (dfa.accepting(s)) {
        dfa.min_chars_[static_cast<size_t>(s)] = 0;
        queue.push_back(s);
      }
    while (!queue.empty()) {
      const int32_t t = queue.front();
      queue.pop_front();
      for (const auto& [s, w] : reverse[static_cast<size_t>(t)]) {
        const int32_t d = dfa.min_chars_[static_cast<size_t>(t)] + w;
        if (d >= dfa.min_chars_[static_cast<size_t>(s)]) continue;
        dfa.min_chars_[static_cast<size_t>(s)] = d;
        if (w == 0) queue.push_front(s);
        else queue.push_back(s);
      }
    }
    *out = std::move(dfa);
    return Status::ok();
  }

 private:
  DfaBuilder(const Nfa& nfa, int32_t accept) : nfa_(nfa), accept_(accept), mark_(nfa.states.size(), 0) {}

  std::vector<int32_t> closure(const std::vector<int32_t>& from) {
    ++epoch_;
    std::vector<int32_t> stack(from), out;
    while (!stack.empty()) {
      const int32_t q = stack.back();
      stack.pop_back();
      if (mark_[static_cast<size_t>(q)] == epoch_) continue;
      mark_[static_cast<size_t>(q)] = epoch_;
      const auto& st = nfa_.states[static_cast<size_t>(q)];
      if (st.next >= 0 || q == accept_) out.push_back(q);
      for (int32_t e : st.eps) stack.push_back(e);
    }
    std::sort(out.begin(), out.end());
    return out;
  }

  int32_t intern(const std::vector<int32_t>& set) {
    if (auto it = ids_.find(set); it != ids_.end()) return it->second;
    const auto id = static_cast<int32_t>(sets_.size());
    ids_.emplace(set, id);
    sets_.push_back(set);
    accepting_.push_back(std::binary_search(set.begin(), set.end(), accept_) ? 1 : 0);
    return id;
  }

  const Nfa& nfa_;
  int32_t accept_;
  std::vector<uint32_t> mark_;
  uint32_t epoch_ = 0;
  std::map<std::vector<int32_t>, int32_t> ids_;
  std::vector<std::vector<int32_t>> sets_;
  std::vector<uint8_t> accepting_;
  std::vector<int32_t> next_;
};

namespace {

Status build_dfa(const Re& re, const RegexLimits& limits, ByteDfa* out) {
  Nfa nfa;
  nfa.limit = limits.max_nfa_states;
  nfa.add();  // state 0: the start, leading into the pattern
  const Frag f = build(re, &nfa);
  if (nfa.too_big)
    return invalid_argument("the pattern is too large (more than " + std::to_string(limits.max_nfa_states) +
                            " automaton states after expanding repetitions)");
  nfa.states[0].eps.push_back(f.start);
  return DfaBuilder::build(nfa, f.end, limits.max_states, out);
}

}  // namespace

bool ByteDfa::matches(std::string_view bytes) const {
  if (accepting_.empty()) return false;
  int32_t s = 0;
  for (char c : bytes) {
    s = next(s, static_cast<uint8_t>(c));
    if (s < 0) return false;
  }
  return accepting(s);
}

Status compile_regex(std::string_view pattern, RegexMode mode, const RegexLimits& limits, ByteDfa* out) {
  Parser parser(pattern, limits);
  Re re;
  Status st = parser.parse(mode, &re);
  if (!st.is_ok()) return st;
  return build_dfa(re, limits, out);
}

Status compile_char_class(std::vector<std::pair<uint32_t, uint32_t>> ranges, bool negated, ByteDfa* out) {
  for (const auto& [lo, hi] : ranges)
    if (lo > hi || hi > kMaxCodePoint) return invalid_argument("a character range out of order or beyond U+10FFFF");
  Re re = set_of(negated ? complement(ranges) : std::move(ranges));
  return build_dfa(re, RegexLimits{}, out);
}

std::string utf8_encode(uint32_t cp) {
  std::string s;
  if (cp < 0x80) {
    s += static_cast<char>(cp);
  } else if (cp < 0x800) {
    s += static_cast<char>(0xC0 | (cp >> 6));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    s += static_cast<char>(0xE0 | (cp >> 12));
    s += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    s += static_cast<char>(0xF0 | (cp >> 18));
    s += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    s += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  }
  return s;
}

namespace {

// Digit strings of one length, a <= b: a regex for the numbers between them (leading zeros
// allowed, as these are the tails of longer numbers).
std::string same_length_range(const std::string& a, const std::string& b) {
  const size_t n = a.size();
  auto digit_class = [](char lo, char hi) {
    return lo == hi ? std::string(1, lo) : "[" + std::string(1, lo) + "-" + std::string(1, hi) + "]";
  };
  auto any_digits = [](size_t k) { return k == 0 ? std::string() : "[0-9]{" + std::to_string(k) + "}"; };
  if (n == 1) return digit_class(a[0], b[0]);
  const std::string ta = a.substr(1), tb = b.substr(1);
  if (a[0] == b[0]) return std::string(1, a[0]) + "(?:" + same_length_range(ta, tb) + ")";
  const bool a_zero = ta.find_first_not_of('0') == std::string::npos;
  const bool b_nine = tb.find_first_not_of('9') == std::string::npos;
  std::vector<std::string> parts;
  char lo = a[0], hi = b[0];
  if (!a_zero) {
    parts.push_back(std::string(1, a[0]) + "(?:" + same_length_range(ta, std::string(n - 1, '9')) + ")");
    ++lo;
  }
  if (!b_nine) --hi;
  if (lo <= hi) parts.push_back(digit_class(lo, hi) + any_digits(n - 1));
  if (!b_nine) parts.push_back(std::string(1, b[0]) + "(?:" + same_length_range(std::string(n - 1, '0'), tb) + ")");
  std::string out;
  for (const auto& p : parts) out += (out.empty() ? "" : "|") + p;
  return out;
}

// 0 <= a <= b, canonical (no leading zeros).
std::string nonnegative_range(uint64_t a, uint64_t b) {
  std::string out;
  std::string sa = std::to_string(a);
  const std::string sb = std::to_string(b);
  while (sa.size() < sb.size()) {
    // [a, 99..9] of a's length, then go on with the next length.
    out += (out.empty() ? "" : "|") + same_length_range(sa, std::string(sa.size(), '9'));
    sa = "1" + std::string(sa.size(), '0');
  }
  out += (out.empty() ? "" : "|") + same_length_range(sa, sb);
  return "(?:" + out + ")";
}

}  // namespace

std::string integer_range_regex(int64_t lo, int64_t hi) {
  std::vector<std::string> parts;
  if (hi >= 0) parts.push_back(nonnegative_range(static_cast<uint64_t>(std::max<int64_t>(lo, 0)), static_cast<uint64_t>(hi)));
  if (lo < 0) {
    const int64_t ymin = hi < 0 ? -hi : 1;
    parts.push_back("-" + nonnegative_range(static_cast<uint64_t>(ymin), static_cast<uint64_t>(-lo)));
  }
  std::string out;
  for (const auto& p : parts) out += (out.empty() ? "" : "|") + p;
  return out;
}

std::string number_range_regex(bool has_lo, int64_t lo, bool has_hi, int64_t hi, int64_t max_abs,
                               int32_t max_frac_digits) {
  const std::string frac = "(?:\\.[0-9]{1," + std::to_string(max_frac_digits) + "})?";
  const std::string zeros = "(?:\\.0{1," + std::to_string(max_frac_digits) + "})?";
  std::vector<std::string> parts;
  // x >= 0: an integer part in range with any fraction, the upper bound itself with a zero one.
  if (!has_hi || hi >= 0) {
    const int64_t l = has_lo ? std::max<int64_t>(lo, 0) : 0;
    if (!has_hi) {
      parts.push_back(integer_range_regex(l, max_abs) + frac);
    } else {
      if (l <= hi - 1) parts.push_back(integer_range_regex(l, hi - 1) + frac);
      parts.push_back(integer_range_regex(hi, hi) + zeros);
    }
  }
  // x < 0, as -y: y's integer part from the bound nearest zero, the far bound with a zero fraction.
  if (!has_lo || lo < 0) {
    const int64_t ymin = has_hi && hi < 0 ? -hi : 0;
    if (!has_lo) {
      parts.push_back("-" + integer_range_regex(ymin, max_abs) + frac);
    } else {
      const int64_t ymax = -lo;
      if (ymin <= ymax - 1) parts.push_back("-" + integer_range_regex(ymin, ymax - 1) + frac);
      parts.push_back("-" + integer_range_regex(ymax, ymax) + zeros);
    }
  }
  std::string out;
  for (const auto& p : parts) out += (out.empty() ? "" : "|") + ("(?:" + p + ")");
  return out;
}

}  // namespace tessera::json_constraint
