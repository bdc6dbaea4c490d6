#include "matcher.h"

#include <algorithm>
#include <cstring>

namespace tessera::json_constraint {
namespace {

bool is_ws(uint8_t c) { return c == ' ' || c == '\n' || c == '\t' || c == '\r'; }
bool is_digit(uint8_t c) { return c >= '0' && c <= '9'; }
bool is_hex(uint8_t c) { return is_digit(c) || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F'); }

// Object phases.
enum : int32_t { kObjStart = 0, kObjOpen, kObjKey, kObjAfterKey, kObjBeforeValue, kObjAfterComma, kObjAfterValue };
// Array phases.
enum : int32_t { kArrStart = 0, kArrOpen, kArrAfterComma, kArrAfterItem };
// String phases; a = characters so far (counted only when the node has bounds), b = bytes
// still to come of a UTF-8 character or \u escape (and, for a UTF-8 lead byte, the lead << 8).
enum : int32_t { kStrStart = 0, kStrBody, kStrEscape, kStrHex, kStrUtf8 };
// Number phases (2, 3, 5, 8 may end the number); a = digits of the current part.
enum : int32_t { kNumStart = 0, kNumMinus, kNumZero, kNumInt, kNumDot, kNumFrac, kNumExp, kNumExpSign, kNumExpDigits };

}  // namespace

ByteMatcher::ByteMatcher(Grammar grammar) : grammar_(std::move(grammar)), nullable_(nullable_nodes(grammar_)) {}

State ByteMatcher::initial() const {
  Thread t;
  t.size = 1;
  t.frames[0] = {grammar_.root, 0, 0, 0};
  State s;
  emit(t, &s);
  return s;
}

void ByteMatcher::load(const State& s, size_t* offset, Thread* t) {
  const int32_t* d = s.data.data() + *offset;
  t->ws = d[0];
  t->size = d[1];
  std::memcpy(t->frames, d + 2, sizeof(Frame) * static_cast<size_t>(t->size));
  *offset += 2 + 4 * static_cast<size_t>(t->size);
}

void ByteMatcher::emit(const Thread& t, State* out) const {
  // Identical threads are one.
  const size_t len = 2 + 4 * static_cast<size_t>(t.size);
  size_t off = 0;
  for (int32_t i = 0; i < out->num_threads; ++i) {
    const int32_t* d = out->data.data() + off;
    const size_t other = 2 + 4 * static_cast<size_t>(d[1]);
    if (other == len && d[0] == t.ws && std::memcmp(d + 2, t.frames, sizeof(Frame) * t.size) == 0) return;
    off += other;
  }
  if (out->num_threads >= kMaxThreads) return;
  out->data.push_back(t.ws);
  out->data.push_back(t.size);
  const auto* f = reinterpret_cast<const int32_t*>(t.frames);
  out->data.insert(out->data.end(), f, f + 4 * t.size);
  ++out->num_threads;
}

void ByteMatcher::feed(const State& in, uint8_t byte, State* out) const {
  out->data.clear();
  out->num_threads = 0;
  size_t off = 0;
  Thread t;
  for (int32_t i = 0; i < in.num_threads; ++i) {
    load(in, &off, &t);
    step(t, byte, out);
  }
}

bool ByteMatcher::whole_output_regex(const State& state, const ByteDfa** dfa, int32_t* dfa_state) const {
  // One thread [ws, size 1, frame (node, phase, a = DFA state, b)] at the root. Stepping it
  // is the DFA's step: an accepting state's "end here" alternative has no frame below it to go
  // on with, a state with no next byte pops to an empty stack that takes nothing more, and
  // whitespace is counted only between JSON tokens, never inside a regex frame.
  if (state.num_threads != 1 || state.data.size() != 6 || state.data[1] != 1) return false;
  const int32_t node_id = state.data[2];
  if (node_id != grammar_.root || node(node_id).kind != NodeKind::kRegex) return false;
  *dfa = &grammar_.dfas[static_cast<size_t>(node(node_id).dfa)];
  *dfa_state = state.data[4];
  return true;
}

bool ByteMatcher::feed_all(State* state, std::string_view bytes) const {
  State next;
  for (char ch : bytes) {
    feed(*state, static_cast<uint8_t>(ch), &next);
    std::swap(*state, next);
    if (state->dead()) return false;
  }
  return true;
}

bool ByteMatcher::endable(const Frame& f) const {
  const Node& n = node(f.node);
  switch (n.kind) {
    case NodeKind::kNumber:
      return f.phase == kNumZero || f.phase == kNumInt || f.phase == kNumFrac || f.phase == kNumExpDigits;
    // Before the first element only when no element is needed (a repeated node never matches
    // the empty string: gbnf.cpp refuses that).
    case NodeKind::kRepeat: return (f.phase == 1 && f.a >= n.min_count) || (f.phase == 0 && f.a == 0 && n.min_count == 0);
    case NodeKind::kFreeText: return true;
    case NodeKind::kRegex: return grammar_.dfas[static_cast<size_t>(n.dfa)].accepting(f.a);
    default: return false;
  }
}

bool ByteMatcher::sequence_rest_nullable(const Frame& f) const {
  const Node& n = node(f.node);
  if (f.b != 0) return false;  // inside a literal
  for (size_t k = static_cast<size_t>(f.a); k < n.items.size(); ++k) {
    const SequenceItem& item = n.items[k];
    if (item.node < 0 ? !item.literal.empty() : !nullable_[static_cast<size_t>(item.node)]) return false;
  }
  return true;
}

bool ByteMatcher::thread_can_end(Thread t) const {
  while (t.size > 0) {
    const Node& n = node(t.top().node);
    if (n.kind == NodeKind::kAnyOf) {  // not yet resolved: may one of the alternatives end?
      for (int32_t alt : n.alternatives) {
        Thread branch = t;
        branch.top() = {alt, 0, 0, 0};
        if (thread_can_end(branch)) return true;
      }
      return false;
    }
    // A sequence ends when the rest of it can be empty; in step() the nodes that are empty
    // do that themselves, once pushed.
    const bool ends = n.kind == NodeKind::kSequence ? sequence_rest_nullable(t.top()) : endable(t.top());
    if (!ends) return false;
    pop(t);
  }
  return true;
}

bool ByteMatcher::can_end(const State& s) const {
  size_t off = 0;
  Thread t;
  for (int32_t i = 0; i < s.num_threads; ++i) {
    load(s, &off, &t);
    if (thread_can_end(t)) return true;
  }
  return false;
}

bool ByteMatcher::is_complete(const State& s) const {
  if (s.num_threads == 0) return false;
  size_t off = 0;
  Thread t;
  for (int32_t i = 0; i < s.num_threads; ++i) {
    load(s, &off, &t);
    if (t.size > 0) return false;
  }
  return true;
}

bool ByteMatcher::push(Thread& t, int32_t id) const {
  if (t.size >= kMaxFrames) return false;
  t.frames[t.size++] = {id, 0, 0, 0};
  return true;
}

void ByteMatcher::pop(Thread& t) const {
  --t.size;
  // A sequence whose last item was this node is done too, and so is a repetition that has
  // had its most elements.
  while (t.size > 0) {
    const Frame& f = t.top();
    const Node& n = node(f.node);
    const bool sequence_done = n.kind == NodeKind::kSequence && f.a >= static_cast<int32_t>(n.items.size());
    const bool repeat_done = n.kind == NodeKind::kRepeat && f.phase == 1 && n.max_count >= 0 && f.a >= n.max_count;
    if (!sequence_done && !repeat_done) break;
    --t.size;
  }
}

bool ByteMatcher::whitespace(Thread& t, uint8_t c, State* out) const {
  if (!is_ws(c)) return false;
  if (t.ws < grammar_.limits.max_whitespace) {
    ++t.ws;
    emit(t, out);
  }
  return true;
}

void ByteMatcher::step(Thread& t, uint8_t c, State* out) const {
  if (t.size == 0) return;  // done: nothing more may follow
  // A frame that may end here also tries the byte on what follows it.
  if (endable(t.top())) {
    Thread ended = t;
    pop(ended);
    step(ended, c, out);
  }
  Frame& f = t.top();
  const Node& n = node(f.node);
  if (!is_ws(c)) t.ws = 0;
  switch (n.kind) {
    case NodeKind::kAny: {
      int32_t target = -1;
      const bool nest_ok = t.size <= grammar_.limits.max_depth;
      if (c == '{' && nest_ok) target = grammar_.generic_object_node;
      else if (c == '[' && nest_ok) target = grammar_.generic_array_node;
      else if (c == '"') target = grammar_.string_node;
      else if (c == '-' || is_digit(c)) target = grammar_.number_node;
      else if (c == 't' || c == 'f' || c == 'n') target = grammar_.keyword_node;
      if (target < 0) return;
      f = {target, 0, 0, 0};
      step(t, c, out);
      return;
    }
    case NodeKind::kAnyOf: {
      for (int32_t alt : n.alternatives) {
        Thread branch = t;
        branch.top() = {alt, 0, 0, 0};
        step(branch, c, out);
      }
      return;
    }
    case NodeKind::kObject: return step_object(t, c, out);
    case NodeKind::kArray: return step_array(t, c, out);
    case NodeKind::kString: return step_string(t, c, out);
    case NodeKind::kNumber: return step_number(t, c, out);
    case NodeKind::kLiterals: {
      if (f.phase == 0) {
        for (size_t i = 0; i < n.literals.size(); ++i) {
          const std::string& lit = n.literals[i];
          if (lit.empty() || static_cast<uint8_t>(lit[0]) != c) continue;
          Thread branch = t;
          if (lit.size() == 1) {
            pop(branch);
          } else {
            branch.top() = {f.node, 1, static_cast<int32_t>(i), 1};
          }
          emit(branch, out);
        }
        return;
      }
      const std::string& lit = n.literals[static_cast<size_t>(f.a)];
      if (static_cast<uint8_t>(lit[static_cast<size_t>(f.b)]) != c) return;
      if (++f.b == static_cast<int32_t>(lit.size())) pop(t);
      emit(t, out);
      return;
    }
    case NodeKind::kSequence: {
      // Empty literals are no items.
      while (f.a < static_cast<int32_t>(n.items.size()) && n.items[static_cast<size_t>(f.a)].node < 0 &&
             n.items[static_cast<size_t>(f.a)].literal.empty())
        ++f.a;
      if (f.a >= static_cast<int32_t>(n.items.size())) {
        pop(t);
        step(t, c, out);
        return;
      }
      const SequenceItem& item = n.items[static_cast<size_t>(f.a)];
      if (item.node >= 0) {
        if (f.a + 1 == static_cast<int32_t>(n.items.size())) {
          // The last item replaces the sequence (nothing of it is left to match): right
          // recursion in a grammar does not grow the stack.
          f = {item.node, 0, 0, 0};
        } else {
          ++f.a;
          if (!push(t, item.node)) return;
        }
        step(t, c, out);
        return;
      }
      if (static_cast<uint8_t>(item.literal[static_cast<size_t>(f.b)]) != c) return;
      if (++f.b == static_cast<int32_t>(item.literal.size())) {
        ++f.a;
        f.b = 0;
        if (f.a == static_cast<int32_t>(n.items.size())) pop(t);
      }
      emit(t, out);
      return;
    }
    case NodeKind::kRepeat: {
      const bool more = n.max_count < 0 || f.a < n.max_count;
      if (f.phase == 0) {
        f.phase = 1;
        // Unbounded: past the minimum the count no longer matters, and keeping it fixed lets
        // the same state (and its cached mask) come back at every element.
        if (n.max_count >= 0 || f.a < std::max(n.min_count, 1)) ++f.a;
        if (!push(t, n.element)) return;
        step(t, c, out);
        return;
      }
      if (f.phase == 1) {
        if (!more) return;
        if (n.literal.empty()) {
          f.phase = 0;
          step(t, c, out);
          return;
        }
        if (static_cast<uint8_t>(n.literal[0]) != c) return;
        if (n.literal.size() == 1) {
          f.phase = 0;
        } else {
          f.phase = 2;
          f.b = 1;
        }
        emit(t, out);
        return;
      }
      if (static_cast<uint8_t>(n.literal[static_cast<size_t>(f.b)]) != c) return;
      if (++f.b == static_cast<int32_t>(n.literal.size())) f.phase = 0;
      emit(t, out);
      return;
    }
    case NodeKind::kRegex: {
      const ByteDfa& dfa = grammar_.dfas[static_cast<size_t>(n.dfa)];
      const int32_t next = dfa.next(f.a, c);
      if (next < 0) return;
      f.a = next;
      if (!dfa.has_next(next)) pop(t);  // a match that cannot go on: done
      emit(t, out);
      return;
    }
    case NodeKind::kFreeText: {
      if (f.a >= 0) {
        if (static_cast<uint8_t>(n.literal[static_cast<size_t>(f.a)]) == c) {
          if (++f.a == static_cast<int32_t>(n.literal.size())) return;  // that is the other branch
        } else {
          f.a = -1;
        }
      }
      emit(t, out);
      return;
    }
  }
}

void ByteMatcher::spawn_keys(const Thread& t, int32_t from, State* out) const {
  const Frame& f = t.frames[t.size - 1];
  const Node& n = node(f.node);
  for (int32_t k = from; k < static_cast<int32_t>(n.properties.size()); ++k) {
    Thread branch = t;
    branch.top() = {f.node, kObjKey, k, 1};  // the key's opening quote matched
    emit(branch, out);
    if (n.properties[static_cast<size_t>(k)].required) break;  // later keys may not come first
  }
}

void ByteMatcher::step_object(Thread& t, uint8_t c, State* out) const {
  Frame& f = t.top();
  const Node& n = node(f.node);
  const auto num_props = static_cast<int32_t>(n.properties.size());
  auto required_left = [&](int32_t from) {
    for (int32_t k = from; k < num_props; ++k)
      if (n.properties[static_cast<size_t>(k)].required) return true;
    return false;
  };
  switch (f.phase) {
    case kObjStart:
      if (c != '{' || t.size > grammar_.limits.max_depth * 2 + 8) return;
      f.phase = kObjOpen;
      emit(t, out);
      return;
    case kObjOpen:
    case kObjAfterComma:
      if (whitespace(t, c, out)) return;
      if (c == '}' && f.phase == kObjOpen && (n.generic || !required_left(0))) {
        pop(t);
        emit(t, out);
        return;
      }
      if (c != '"') return;
      if (n.generic) {
        f.phase = kObjAfterKey;
        if (!push(t, grammar_.string_node)) return;
        step(t, c, out);
        return;
      }
      spawn_keys(t, f.a, out);
      return;
    case kObjKey: {
      const std::string& key = n.properties[static_cast<size_t>(f.a)].key;
      if (static_cast<uint8_t>(key[static_cast<size_t>(f.b)]) != c) return;
      if (++f.b == static_cast<int32_t>(key.size())) f.phase = kObjAfterKey;
      emit(t, out);
      return;
    }
    case kObjAfterKey:
      if (whitespace(t, c, out)) return;
      if (c != ':') return;
      f.phase = kObjBeforeValue;
      emit(t, out);
      return;
    case kObjBeforeValue: {
      if (whitespace(t, c, out)) return;
      int32_t value = grammar_.any_node;
      if (!n.generic) {
        value = n.properties[static_cast<size_t>(f.a)].value;
        ++f.a;
      } else if (n.element >= 0) {
        value = n.element;
      }
      f.phase = kObjAfterValue;
      if (!push(t, value)) return;
      step(t, c, out);
      return;
    }
    case kObjAfterValue:
      if (whitespace(t, c, out)) return;
      if (c == ',' && (n.generic || f.a < num_props)) {
        f.phase = kObjAfterComma;
        emit(t, out);
      } else if (c == '}' && (n.generic || !required_left(f.a))) {
        pop(t);
        emit(t, out);
      }
      return;
  }
}

void ByteMatcher::step_array(Thread& t, uint8_t c, State* out) const {
  Frame& f = t.top();
  const Node& n = node(f.node);
  const int32_t item = n.element >= 0 ? n.element : grammar_.any_node;
  switch (f.phase) {
    case kArrStart:
      if (c != '[' || t.size > grammar_.limits.max_depth * 2 + 8) return;
      f.phase = kArrOpen;
      emit(t, out);
      return;
    case kArrOpen:
      if (whitespace(t, c, out)) return;
      if (c == ']') {
        if (n.min_count > 0) return;
        pop(t);
        emit(t, out);
        return;
      }
      if (n.max_count == 0) return;
      [[fallthrough]];
    case kArrAfterComma:
      if (f.phase == kArrAfterComma && whitespace(t, c, out)) return;
      f.phase = kArrAfterItem;
      ++f.a;
      if (!push(t, item)) return;
      step(t, c, out);
      return;
    case kArrAfterItem:
      if (whitespace(t, c, out)) return;
      if (c == ',' && (n.max_count < 0 || f.a < n.max_count)) {
        f.phase = kArrAfterComma;
        emit(t, out);
      } else if (c == ']' && f.a >= n.min_count) {
        pop(t);
        emit(t, out);
      }
      return;
  }
}

void ByteMatcher::step_string(Thread& t, uint8_t c, State* out) const {
  Frame& f = t.top();
  const Node& n = node(f.node);
  const bool counted = n.min_count > 0 || n.max_count >= 0;
  const ByteDfa* pattern = n.dfa >= 0 ? &grammar_.dfas[static_cast<size_t>(n.dfa)] : nullptr;
  // With a maxLength, the characters left must still be enough to finish the pattern's match
  // (f.a counts the characters so far, this one included).
  auto room_for_match = [&](int32_t dfa_state) {
    return n.max_count < 0 || f.a + pattern->min_chars_to_accept(dfa_state) <= n.max_count;
  };
  // A new character starts: within maxLength? (Counted up to what the bounds need.)
  auto start_char = [&] {
    if (!counted) return true;
    if (n.max_count >= 0 && f.a >= n.max_count) return false;
    if (n.max_count >= 0 || f.a < n.min_count) ++f.a;
    return true;
  };
  switch (f.phase) {
    case kStrStart:
      if (c != '"') return;
      f.phase = kStrBody;
      emit(t, out);
      return;
    case kStrBody:
      if (c == '"') {
        if (f.a < n.min_count) return;
        if (pattern && !pattern->accepting(f.b)) return;
        pop(t);
        emit(t, out);
        return;
      }
      if (c < 0x20 || c == 0x7f) return;  // control characters must be escaped (and DEL is not wanted)
      if (pattern) {
        // The pattern's DFA sees the decoded characters and admits only well-formed UTF-8,
        // so it takes the raw bytes itself; b is its state.
        if ((c & 0xC0) != 0x80 && !start_char()) return;
        if (c == '\\') {
          // Only if some escape can continue the match: else a token ending in the backslash
          // would lead where no token can follow.
          bool any = false;
          for (uint8_t e : {'"', '\\', '/', '\b', '\f', '\n', '\r', '\t'}) {
            const int32_t next = pattern->next(f.b, e);
            any = any || (next >= 0 && room_for_match(next));
          }
          if (!any) return;
          f.phase = kStrEscape;
        } else {
          const int32_t next = pattern->next(f.b, c);
          if (next < 0 || !room_for_match(next)) return;
          f.b = next;
        }
        emit(t, out);
        return;
      }
      if (!start_char()) return;
      if (c == '\\') {
        f.phase = kStrEscape;
      } else if (c >= 0x80) {
        int32_t more = 0;
        if (c >= 0xC2 && c <= 0xDF) more = 1;
        else if (c >= 0xE0 && c <= 0xEF) more = 2;
        else if (c >= 0xF0 && c <= 0xF4) more = 3;
        else return;
        f.phase = kStrUtf8;
        f.b = more | (static_cast<int32_t>(c) << 8);
      }
      emit(t, out);
      return;
    case kStrEscape:
      if (pattern) {
        // \u escapes are not offered here: the model can write the character itself.
        uint8_t decoded = 0;
        switch (c) {
          case '"': case '\\': case '/': decoded = c; break;
          case 'b': decoded = '\b'; break;
          case 'f': decoded = '\f'; break;
          case 'n': decoded = '\n'; break;
          case 'r': decoded = '\r'; break;
          case 't': decoded = '\t'; break;
          default: return;
        }
        const int32_t next = pattern->next(f.b, decoded);
        if (next < 0 || !room_for_match(next)) return;
        f.b = next;
        f.phase = kStrBody;
        emit(t, out);
        return;
      }
      if (c == 'u') {
        f.phase = kStrHex;
        f.b = 4;
      } else if (c == '"' || c == '\\' || c == '/' || c == 'b' || c == 'f' || c == 'n' || c == 'r' || c == 't') {
        f.phase = kStrBody;
      } else {
        return;
      }
      emit(t, out);
      return;
    case kStrHex: {
      // No surrogate escapes (\uD800-\uDFFF): a lone one is not a character, and strict
      // parsers refuse it; characters beyond U+FFFF can be written as UTF-8.
      if (!is_hex(c)) return;
      const int32_t left = f.b & 0xff;
      const bool after_d = (f.b >> 8) != 0;
      if (after_d && left == 3 && ((c >= '8' && c <= '9') || (c | 0x20) >= 'a')) return;
      f.b = (left - 1) | (left == 4 && (c | 0x20) == 'd' ? 1 << 8 : 0);
      if (left == 1) f.phase = kStrBody;
      emit(t, out);
      return;
    }
    case kStrUtf8: {
      const int32_t lead = f.b >> 8;
      int32_t more = f.b & 0xff;
      uint8_t lo = 0x80, hi = 0xBF;
      if (lead != 0) {  // the first continuation byte: no overlong forms, surrogates or > U+10FFFF
        if (lead == 0xE0) lo = 0xA0;
        else if (lead == 0xED) hi = 0x9F;
        else if (lead == 0xF0) lo = 0x90;
        else if (lead == 0xF4) hi = 0x8F;
      }
      if (c < lo || c > hi) return;
      --more;
      f.b = more;
      if (more == 0) f.phase = kStrBody;
      emit(t, out);
      return;
    }
  }
}

void ByteMatcher::step_number(Thread& t, uint8_t c, State* out) const {
  Frame& f = t.top();
  const Node& n = node(f.node);
  const GrammarLimits& lim = grammar_.limits;
  auto go = [&](int32_t phase, int32_t digits) {
    f.phase = phase;
    f.a = digits;
    emit(t, out);
  };
  const bool exp_start = (c == 'e' || c == 'E') && !n.integer;
  switch (f.phase) {
    case kNumStart:
      if (c == '-') return go(kNumMinus, 0);
      [[fallthrough]];
    case kNumMinus:
      if (c == '0') return go(kNumZero, 1);
      if (c >= '1' && c <= '9') return go(kNumInt, 1);
      return;
    case kNumZero:
    case kNumInt:
      if (f.phase == kNumInt && is_digit(c) && f.a < lim.max_int_digits) return go(kNumInt, f.a + 1);
      if (c == '.' && !n.integer) return go(kNumDot, 0);
      if (exp_start) return go(kNumExp, 0);
      return;
    case kNumDot:
      if (is_digit(c)) return go(kNumFrac, 1);
      return;
    case kNumFrac:
      if (is_digit(c) && f.a < lim.max_frac_digits) return go(kNumFrac, f.a + 1);
      if (exp_start) return go(kNumExp, 0);
      return;
    case kNumExp:
      if (c == '+' || c == '-') return go(kNumExpSign, 0);
      [[fallthrough]];
    case kNumExpSign:
      if (is_digit(c)) return go(kNumExpDigits, 1);
      return;
    case kNumExpDigits:
      if (is_digit(c) && f.a < lim.max_exp_digits) return go(kNumExpDigits, f.a + 1);
      return;
  }
}

}  // namespace tessera::json_constraint
