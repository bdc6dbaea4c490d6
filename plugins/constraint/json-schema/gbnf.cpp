// GBNF (llama.cpp's grammar format) into the constraint graph of grammar.h: a rule is a node
// whose alternatives are sequences of literals and nodes; character classes and `.` are
// one-character DFAs (regex.h); `* + ? {m,n}` are kRepeat nodes. Rule references are node
// indices, so recursion is a cycle, walked by the same pushdown matcher as JSON Schema.
//
// The syntax as llama.cpp's parser reads it (grammars/README.md there): `name ::= alternatives`,
// a rule ending at the end of its line unless inside parentheses or after `|`; literals
// "...", classes [...] and [^...] with escapes \x \u \U \t \r \n \\ \" \[ \] (and \- \^ in
// classes), `.`, grouping, comments from `#` to the end of the line. Refused, with the line
// and column: left recursion (which a top-down matcher cannot run), a repeated part that can
// match the empty string, references to undefined rules, a missing `root`, token syntax <...>.
#include <map>
#include <set>

#include "grammar.h"

namespace tessera::json_constraint {
namespace {

constexpr size_t kMaxGrammarBytes = 1 << 20;
constexpr size_t kMaxGbnfNodes = 1 << 16;
constexpr int32_t kMaxCount = 1 << 20;

bool is_word_char(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' || c == '_';
}

class GbnfParser {
 public:
  GbnfParser(std::string_view text, Grammar* g) : s_(text), g_(g) {}

  Status parse() {
    if (s_.size() > kMaxGrammarBytes) return invalid_argument("1:1: the grammar is larger than 1 MiB");
    skip_space(true);
    while (i_ < s_.size()) {
      if (!parse_rule()) return status_;
      skip_space(true);
    }
    for (const auto& [name, rule] : rules_)
      if (rule.defined_at == std::string::npos)
        return fail_status(rule.first_use, "undefined rule '" + name + "'");
    auto root = rules_.find("root");
    if (root == rules_.end()) return invalid_argument("1:1: the grammar has no rule 'root' (the output)");
    g_->root = root->second.node;
    if (!check_repeats() || !check_left_recursion()) return status_;
    return Status::ok();
  }

 private:
  struct Rule {
    int32_t node = -1;
    size_t defined_at = std::string::npos;
    size_t first_use = std::string::npos;
  };
  // An element of a sequence before literals are merged: a literal (node < 0) or a node.
  struct Element {
    std::string literal;
    int32_t node = -1;
    size_t pos = 0;
  };

  std::string where(size_t pos) const {
    size_t line = 1, col = 1;
    for (size_t k = 0; k < pos && k < s_.size(); ++k) {
      if (s_[k] == '\n') {
        ++line;
        col = 1;
      } else {
        ++col;
      }
    }
    return std::to_string(line) + ":" + std::to_string(col);
  }
  Status fail_status(size_t pos, const std::string& message) {
    status_ = invalid_argument(where(pos) + ": " + message);
    return status_;
  }
  bool fail(size_t pos, const std::string& message) {
    fail_status(pos, message);
    return false;
  }
  std::string got(size_t pos) const {
    if (pos >= s_.size()) return "the end of the grammar";
    const char c = s_[pos];
    if (c == '\n' || c == '\r') return "the end of the line";
    return std::string("'") + c + "'";
  }

  int32_t add(Node n) {
    g_->nodes.push_back(std::move(n));
    return static_cast<int32_t>(g_->nodes.size() - 1);
  }
  bool check_size(size_t pos) {
    return g_->nodes.size() <= kMaxGbnfNodes || fail(pos, "the grammar is too large");
  }

  void skip_space(bool newline_ok) {
    while (i_ < s_.size()) {
      const char c = s_[i_];
      if (c == '#') {
        while (i_ < s_.size() && s_[i_] != '\n' && s_[i_] != '\r') ++i_;
      } else if (c == ' ' || c == '\t' || (newline_ok && (c == '\n' || c == '\r'))) {
        ++i_;
      } else {
        break;
      }
    }
  }

  int32_t rule_node(const std::string& name, size_t pos) {
    auto [it, inserted] = rules_.try_emplace(name);
    if (inserted) {
      Node n;
      n.kind = NodeKind::kAnyOf;
      it->second.node = add(std::move(n));
      it->second.first_use = pos;
      rule_names_[it->second.node] = name;
    }
    return it->second.node;
  }

  bool parse_rule() {
    const size_t start = i_;
    std::string name;
    while (i_ < s_.size() && is_word_char(s_[i_])) name += s_[i_++];
    if (name.empty()) return fail(start, "expected a rule name, got " + got(start));
    skip_space(false);
    if (s_.substr(i_, 3) != "::=") return fail(i_, "expected '::=' after the rule name '" + name + "', got " + got(i_));
    i_ += 3;
    skip_space(true);
    const int32_t node = rule_node(name, start);
    Rule& rule = rules_[name];
    if (rule.defined_at != std::string::npos)
      return fail(start, "rule '" + name + "' is defined twice (first at " + where(rule.defined_at) + ")");
    rule.defined_at = start;
    int32_t body = -1;
    if (!parse_alternates(false, &body)) return false;
    g_->nodes[static_cast<size_t>(node)].alternatives = {body};
    if (i_ < s_.size()) {
      if (s_[i_] == '\r') {
        i_ += i_ + 1 < s_.size() && s_[i_ + 1] == '\n' ? 2 : 1;
      } else if (s_[i_] == '\n') {
        ++i_;
      } else {
        return fail(i_, "expected the end of the line or '|', got " + got(i_));
      }
    }
    return true;
  }

  bool parse_alternates(bool nested, int32_t* out) {
    Node alt;
    alt.kind = NodeKind::kAnyOf;
    while (true) {
      int32_t seq = -1;
      if (!parse_sequence(nested, &seq)) return false;
      alt.alternatives.push_back(seq);
      if (i_ < s_.size() && s_[i_] == '|') {
        ++i_;
        skip_space(true);
        continue;
      }
      break;
    }
    *out = alt.alternatives.size() == 1 ? alt.alternatives[0] : add(std::move(alt));
    return check_size(i_);
  }

  bool parse_hex(size_t digits, uint32_t* cp) {
    uint32_t v = 0;
    for (size_t k = 0; k < digits; ++k) {
      if (i_ >= s_.size()) return fail(i_, "expected " + std::to_string(digits) + " hex digits, got the end");
      const char h = s_[i_];
      const int d = h >= '0' && h <= '9' ? h - '0' : h >= 'a' && h <= 'f' ? h - 'a' + 10 : h >= 'A' && h <= 'F' ? h - 'A' + 10 : -1;
      if (d < 0) return fail(i_, "expected a hex digit, got " + got(i_));
      v = v * 16 + static_cast<uint32_t>(d);
      ++i_;
    }
    *cp = v;
    return true;
  }

  // One character of a literal or class, escapes decoded, UTF-8 read as a code point.
  bool parse_char(bool in_class, uint32_t* cp) {
    const size_t at = i_;
    if (i_ >= s_.size()) return fail(i_, "unexpected end of the grammar");
    const auto c = static_cast<uint8_t>(s_[i_]);
    if (c == '\\') {
      ++i_;
      if (i_ >= s_.size()) return fail(at, "a backslash at the end of the grammar");
      const char e = s_[i_++];
      switch (e) {
        case 'x': return parse_hex(2, cp);
        case 'u': return parse_hex(4, cp);
        case 'U': return parse_hex(8, cp) && (*cp <= 0x10FFFF || fail(at, "beyond U+10FFFF"));
        case 't': *cp = '\t'; return true;
        case 'r': *cp = '\r'; return true;
        case 'n': *cp = '\n'; return true;
        case '\\': case '"': case '[': case ']': *cp = static_cast<uint8_t>(e); return true;
        case '-': case '^':
          if (in_class) {
            *cp = static_cast<uint8_t>(e);
            return true;
          }
          [[fallthrough]];
        default: return fail(at, std::string("unknown escape '\\") + e + "' (expected \\x, \\u, \\U, \\t, \\r, \\n, \\\\, \\\", \\[ or \\])");
      }
    }
    const int n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
    if (n == 0 || i_ + static_cast<size_t>(n) > s_.size()) return fail(at, "not valid UTF-8");
    uint32_t v = n == 1 ? c : c & (0x7F >> n);
    for (int k = 1; k < n; ++k) {
      const auto b = static_cast<uint8_t>(s_[i_ + static_cast<size_t>(k)]);
      if ((b & 0xC0) != 0x80) return fail(at, "not valid UTF-8");
      v = (v << 6) | (b & 0x3F);
    }
    i_ += static_cast<size_t>(n);
    *cp = v;
    return true;
  }

  bool add_class(std::vector<std::pair<uint32_t, uint32_t>> ranges, bool negated, size_t pos, int32_t* out) {
    ByteDfa dfa;
    Status st = compile_char_class(std::move(ranges), negated, &dfa);
    if (!st.is_ok()) return fail(pos, st.message());
    Node n;
    n.kind = NodeKind::kRegex;
    n.dfa = static_cast<int32_t>(g_->dfas.size());
    g_->dfas.push_back(std::move(dfa));
    *out = add(std::move(n));
    return true;
  }

  bool parse_int(int32_t* out) {
    const size_t start = i_;
    int64_t v = 0;
    while (i_ < s_.size() && s_[i_] >= '0' && s_[i_] <= '9') {
      v = v * 10 + (s_[i_++] - '0');
      if (v > kMaxCount) return fail(start, "a repetition count above " + std::to_string(kMaxCount));
    }
    if (i_ == start) return fail(i_, "expected a number, got " + got(i_));
    *out = static_cast<int32_t>(v);
    return true;
  }

  bool parse_sequence(bool nested, int32_t* out) {
    std::vector<Element> elements;
    while (i_ < s_.size()) {
      const size_t at = i_;
      const char c = s_[i_];
      Element el;
      el.pos = at;
      if (c == '"') {
        ++i_;
        while (true) {
          if (i_ >= s_.size()) return fail(at, "a literal without its closing '\"'");
          if (s_[i_] == '"') break;
          uint32_t cp = 0;
          if (!parse_char(false, &cp)) return false;
          el.literal += utf8_encode(cp);
        }
        ++i_;
        if (el.literal.empty()) {
          skip_space(nested);
          continue;  // "" is nothing
        }
      } else if (c == '[') {
        ++i_;
        bool negated = false;
        if (i_ < s_.size() && s_[i_] == '^') {
          negated = true;
          ++i_;
        }
        std::vector<std::pair<uint32_t, uint32_t>> ranges;
        while (true) {
          if (i_ >= s_.size()) return fail(at, "a character class without its closing ']'");
          if (s_[i_] == ']') break;
          uint32_t lo = 0, hi = 0;
          if (!parse_char(true, &lo)) return false;
          hi = lo;
          if (i_ + 1 < s_.size() && s_[i_] == '-' && s_[i_ + 1] != ']') {
            ++i_;
            if (!parse_char(true, &hi)) return false;
            if (hi < lo) return fail(at, "a character range out of order");
          }
          ranges.push_back({lo, hi});
        }
        ++i_;
        if (!add_class(std::move(ranges), negated, at, &el.node)) return false;
      } else if (c == '.') {
        ++i_;
        if (!add_class({}, true, at, &el.node)) return false;
      } else if (is_word_char(c)) {
        std::string name;
        while (i_ < s_.size() && is_word_char(s_[i_])) name += s_[i_++];
        el.node = rule_node(name, at);
      } else if (c == '(') {
        ++i_;
        skip_space(true);
        if (!parse_alternates(true, &el.node)) return false;
        if (i_ >= s_.size() || s_[i_] != ')') return fail(at, "a '(' without its ')' (got " + got(i_) + ")");
        ++i_;
      } else if (c == '*' || c == '+' || c == '?' || c == '{') {
        if (elements.empty()) return fail(at, std::string("nothing before '") + c + "' to repeat");
        int32_t min = 0, max = -1;
        ++i_;
        if (c == '+') {
          min = 1;
        } else if (c == '?') {
          max = 1;
        } else if (c == '{') {
          skip_space(false);
          if (!parse_int(&min)) return false;
          skip_space(false);
          max = min;
          if (i_ < s_.size() && s_[i_] == ',') {
            ++i_;
            skip_space(false);
            max = -1;
            if (i_ < s_.size() && s_[i_] >= '0' && s_[i_] <= '9' && !parse_int(&max)) return false;
            skip_space(false);
          }
          if (i_ >= s_.size() || s_[i_] != '}') return fail(i_, "expected '}' to close {m,n}, got " + got(i_));
          ++i_;
          if (max >= 0 && max < min) return fail(at, "{m,n} with n below m");
        }
        Element& last = elements.back();
        int32_t element = last.node;
        if (element < 0) {
          Node lit;
          lit.kind = NodeKind::kLiterals;
          lit.literals = {last.literal};
          element = add(std::move(lit));
        }
        Node rep;
        rep.kind = NodeKind::kRepeat;
        rep.element = element;
        rep.min_count = min;
        rep.max_count = max;
        last.node = add(std::move(rep));
        last.literal.clear();
        repeats_.push_back({last.node, at});
        skip_space(nested);
        if (!check_size(at)) return false;
        continue;
      } else if (c == '<') {
        return fail(at, "token references (<...>, <[id]>) are not supported; write the text as a literal");
      } else {
        break;
      }
      elements.push_back(std::move(el));
      skip_space(nested);
      if (!check_size(at)) return false;
    }
    Node seq;
    seq.kind = NodeKind::kSequence;
    for (auto& el : elements) {
      if (el.node < 0 && !seq.items.empty() && seq.items.back().node < 0) {
        seq.items.back().literal += el.literal;  // adjacent literals are one
        continue;
      }
      seq.items.push_back({std::move(el.literal), el.node});
    }
    if (seq.items.size() == 1 && seq.items[0].node >= 0) {
      *out = seq.items[0].node;
      return true;
    }
    *out = add(std::move(seq));
    return true;
  }

  // x? of an x that can be empty is x; other repetitions of it would loop without input.
  bool check_repeats() {
    const std::vector<bool> nullable = nullable_nodes(*g_);
    for (const auto& [node, pos] : repeats_) {
      Node& n = g_->nodes[static_cast<size_t>(node)];
      if (!nullable[static_cast<size_t>(n.element)]) continue;
      if (n.max_count >= 0 && n.max_count <= 1) {
        const int32_t element = n.element;
        n = Node{};
        n.kind = NodeKind::kAnyOf;
        n.alternatives = {element};
        continue;
      }
      return fail(pos, "the repeated part can match the empty string; make it match at least one character");
    }
    return true;
  }

  // The nodes a node can start with (before consuming input).
  std::vector<int32_t> left_edges(int32_t id, const std::vector<bool>& nullable) const {
    const Node& n = g_->nodes[static_cast<size_t>(id)];
    std::vector<int32_t> out;
    switch (n.kind) {
      case NodeKind::kAnyOf: out = n.alternatives; break;
      case NodeKind::kRepeat: out = {n.element}; break;
      case NodeKind::kSequence:
        for (const auto& item : n.items) {
          if (item.node < 0) {
            if (!item.literal.empty()) break;
            continue;
          }
          out.push_back(item.node);
          if (!nullable[static_cast<size_t>(item.node)]) break;
        }
        break;
      default: break;
    }
    return out;
  }

  bool check_left_recursion() {
    const std::vector<bool> nullable = nullable_nodes(*g_);
    std::vector<uint8_t> color(g_->nodes.size(), 0);  // 0 new, 1 on the path, 2 done
    std::vector<int32_t> path;
    // Iterative depth-first search: stack of (node, next edge index).
    for (size_t start = 0; start < g_->nodes.size(); ++start) {
      if (color[start]) continue;
      std::vector<std::pair<int32_t, size_t>> stack{{static_cast<int32_t>(start), 0}};
      std::vector<std::vector<int32_t>> edges{left_edges(static_cast<int32_t>(start), nullable)};
      color[start] = 1;
      while (!stack.empty()) {
        auto& [node, k] = stack.back();
        if (k < edges.back().size()) {
          const int32_t next = edges.back()[k++];
          if (color[static_cast<size_t>(next)] == 1) {
            // A cycle: name a rule on it.
            std::string name;
            for (auto it = stack.rbegin(); it != stack.rend(); ++it) {
              if (auto r = rule_names_.find(it->first); r != rule_names_.end()) name = r->second;
              if (it->first == next) break;
            }
            if (auto r = rule_names_.find(next); r != rule_names_.end()) name = r->second;
            const size_t pos = rules_.count(name) ? rules_.at(name).defined_at : 0;
            return fail(pos, "rule '" + name + "' is left-recursive (it can reach itself before any input); "
                             "write the recursion with repetition, e.g. list ::= item (\",\" item)*");
          }
          if (color[static_cast<size_t>(next)] == 0) {
            color[static_cast<size_t>(next)] = 1;
            stack.push_back({next, 0});
            edges.push_back(left_edges(next, nullable));
          }
          continue;
        }
        color[static_cast<size_t>(node)] = 2;
        stack.pop_back();
        edges.pop_back();
      }
    }
    return true;
  }

  std::string_view s_;
  Grammar* g_;
  size_t i_ = 0;
  Status status_;
  std::map<std::string, Rule> rules_;
  std::map<int32_t, std::string> rule_names_;
  std::vector<std::pair<int32_t, size_t>> repeats_;
};

}  // namespace

Status compile_gbnf(std::string_view text, const GrammarLimits& limits, Grammar* out) {
  *out = Grammar{};
  out->limits = limits;
  GbnfParser parser(text, out);
  return parser.parse();
}

}  // namespace tessera::json_constraint
