// constraint.json-schema's regex engine, GBNF grammars and the JSON Schema keywords they
// enforce (plugins/constraint/json-schema: regex.cpp, gbnf.cpp, grammar.cpp), without a
// model: the DFA against std::regex on random patterns and strings, GBNF grammars of
// llama.cpp's published examples accepting and refusing strings, error positions, bounded
// numbers and patterns inside JSON strings, and random walks under the token mask that must
// end in output an independent check accepts.
#include <doctest/doctest.h>

#include <nlohmann/json.hpp>

#include <functional>
#include <cstring>
#include <random>
#include <regex>
#include <string>
#include <vector>

#include "grammar.h"
#include "matcher.h"
#include "regex.h"
#include "token_mask.h"

using namespace tessera;
using namespace tessera::json_constraint;
using ojson = nlohmann::ordered_json;

namespace {

ByteDfa dfa_of(const std::string& pattern, RegexMode mode = RegexMode::kFullMatch) {
  ByteDfa dfa;
  Status st = compile_regex(pattern, mode, RegexLimits{}, &dfa);
  REQUIRE_MESSAGE(st.is_ok(), pattern << ": " << st.message());
  return dfa;
}

std::string regex_error(const std::string& pattern) {
  ByteDfa dfa;
  Status st = compile_regex(pattern, RegexMode::kFullMatch, RegexLimits{}, &dfa);
  return st.is_ok() ? std::string() : st.message();
}

bool accepts(const ByteMatcher& m, const std::string& text) {
  State s = m.initial();
  return m.feed_all(&s, text) && m.can_end(s);
}

ByteMatcher gbnf_matcher(const std::string& text) {
  Grammar g;
  Status st = compile_gbnf(text, {}, &g);
  REQUIRE_MESSAGE(st.is_ok(), st.message());
  return ByteMatcher(std::move(g));
}

std::string gbnf_error(const std::string& text) {
  Grammar g;
  Status st = compile_gbnf(text, {}, &g);
  return st.is_ok() ? std::string() : st.message();
}

ByteMatcher schema_matcher(const std::string& schema_text) {
  Grammar g;
  Status st = compile_json_schema(ojson::parse(schema_text), {}, &g);
  REQUIRE_MESSAGE(st.is_ok(), st.message());
  return ByteMatcher(std::move(g));
}

std::string schema_error(const std::string& schema_text) {
  Grammar g;
  Status st = compile_json_schema(ojson::parse(schema_text), {}, &g);
  return st.is_ok() ? std::string() : st.message();
}

// A random pattern over a small alphabet with every construct the engine and std::regex share.
std::string random_pattern(std::mt19937& rng, int depth) {
  auto pick = [&](int n) { return static_cast<int>(rng() % static_cast<unsigned>(n)); };
  std::string out;
  const int atoms = 1 + pick(depth > 0 ? 2 : 3);
  for (int k = 0; k < atoms; ++k) {
    std::string atom;
    switch (depth > 1 ? pick(5) : pick(8)) {
      case 0: atom = "a"; break;
      case 1: atom = "b"; break;
      case 2: atom = "[a-c]"; break;
      case 3: atom = "[^a]"; break;
      case 4: atom = pick(2) ? "." : "\\d"; break;
      case 5: atom = "(" + random_pattern(rng, depth + 1) + ")"; break;
      case 6: atom = "(?:" + random_pattern(rng, depth + 1) + "|" + random_pattern(rng, depth + 1) + ")"; break;
      default: atom = "(" + random_pattern(rng, depth + 1) + ")"; break;
    }
    switch (pick(8)) {
      case 0: atom += "*"; break;
      case 1: atom += "+"; break;
      case 2: atom += "?"; break;
      case 3: atom += "{" + std::to_string(pick(3)) + "}"; break;
      case 4: atom += "{" + std::to_string(pick(2)) + "," + std::to_string(2 + pick(2)) + "}"; break;
      case 5: atom += "{1,}"; break;
      default: break;
    }
    out += atom;
  }
  if (pick(4) == 0) out += "|" + random_pattern(rng, depth + 1);
  return out;
}

}  // namespace

TEST_CASE("the regex DFA agrees with std::regex on random patterns and strings") {
  std::mt19937 rng(1234);
  const std::string alphabet = "abc1\n";
  int checked = 0, matched = 0, too_large = 0;
  for (int p = 0; p < 300; ++p) {
    const std::string pattern = random_pattern(rng, 0);
    const std::regex reference(pattern, std::regex::ECMAScript);
    // A few random patterns determinize into more states than the limit: refused, not wrong.
    ByteDfa full, search;
    if (!compile_regex(pattern, RegexMode::kFullMatch, RegexLimits{}, &full).is_ok() ||
        !compile_regex(pattern, RegexMode::kSearch, RegexLimits{}, &search).is_ok()) {
      ++too_large;
      continue;
    }
    for (int s = 0; s < 60; ++s) {
      std::string text;
      const int len = static_cast<int>(rng() % 8);
      for (int k = 0; k < len; ++k) text += alphabet[rng() % alphabet.size()];
      const bool want = std::regex_match(text, reference);
      CHECK_MESSAGE(full.matches(text) == want, "full match of /" << pattern << "/ on \"" << text << "\"");
      CHECK_MESSAGE(search.matches(text) == std::regex_search(text, reference),
                    "search of /" << pattern << "/ on \"" << text << "\"");
      matched += want;
      ++checked;
    }
  }
  CHECK(too_large < 15);
  // Both outcomes are exercised.
  CHECK(matched > checked / 20);
  CHECK(matched < checked - checked / 20);
}

TEST_CASE("classes, escapes, counts and anchors") {
  CHECK(dfa_of("\\d{3}-\\d{4}").matches("555-1234"));
  CHECK_FALSE(dfa_of("\\d{3}-\\d{4}").matches("555-123"));
  CHECK(dfa_of("[A-Z][a-z]+ \\w+").matches("Paris is_1"));
  CHECK(dfa_of("^(yes|no)$").matches("no"));
  CHECK(dfa_of("\\x41\\u00e9\\.").matches("A\xC3\xA9."));
  CHECK(dfa_of("\\s+").matches(" \t\n"));
  CHECK(dfa_of("\\S+\\W").matches("ab!"));
  CHECK(dfa_of("a{2,}").matches("aaaa"));
  CHECK_FALSE(dfa_of("a{2,}").matches("a"));
  CHECK(dfa_of("a+?b*?").matches("aab"));  // lazy quantifiers: the same strings
  // Classes and `.` take whole UTF-8 characters, and only well-formed ones.
  CHECK(dfa_of("[^a]").matches("\xE2\x82\xAC"));
  CHECK(dfa_of(".").matches("\xF0\x9F\x98\x80"));
  CHECK_FALSE(dfa_of(".").matches("\xC3"));
  CHECK_FALSE(dfa_of(".").matches("\xED\xA0\x80"));  // an encoded surrogate
  CHECK_FALSE(dfa_of(".").matches("\n"));
  CHECK(dfa_of("[é-ë]").matches("\xC3\xAA"));
  CHECK_FALSE(dfa_of("[é-ë]").matches("\xC3\xAC"));
  // Search semantics: an unanchored side matches anything.
  CHECK(dfa_of("abc", RegexMode::kSearch).matches("xxabcyy"));
  CHECK_FALSE(dfa_of("^abc", RegexMode::kSearch).matches("xabc"));
  CHECK(dfa_of("^a|b$", RegexMode::kSearch).matches("axx"));
  CHECK(dfa_of("^a|b$", RegexMode::kSearch).matches("xxb"));
  CHECK_FALSE(dfa_of("^a|b$", RegexMode::kSearch).matches("xbx"));
  // Every state leads to a match.
  const ByteDfa d = dfa_of("(ab|cd)e");
  for (int32_t s = 0; s < d.num_states(); ++s) CHECK((d.accepting(s) || d.has_next(s)));
}

TEST_CASE("bad patterns are refused with the position and the problem") {
  CHECK(regex_error("a(b") == "position 1: missing ')'");
  CHECK(regex_error("ab)") == "position 2: unmatched ')'");
  CHECK(regex_error("[a-") == "position 0: missing ']'");
  CHECK(regex_error("*a").find("position 0: nothing to repeat") == 0);
  CHECK(regex_error("a**").find("position 2: nothing to repeat") == 0);
  CHECK(regex_error("(a)\\1") == "position 3: backreferences are not supported");
  CHECK(regex_error("(?=a)").find("position 0: lookaround") == 0);
  CHECK(regex_error("a{3,1}") == "position 1: {m,n} with n below m");
  CHECK(regex_error("a^b").find("position 1: '^' is only supported") == 0);
  CHECK(regex_error("[z-a]") == "position 1: range out of order");
  CHECK(regex_error("\\q") == "position 0: unknown escape \\q");
  CHECK(regex_error("[^\\s\\S]") == "the pattern matches no string");
  CHECK(regex_error("(a{1000}){1000}").find("too large") != std::string::npos);
}

TEST_CASE("integer and number ranges as regexes are exact") {
  std::mt19937 rng(7);
  const std::vector<std::pair<int64_t, int64_t>> ranges = {
      {0, 0}, {0, 9}, {1, 100}, {-5, 5}, {-100, -3}, {17, 4321}, {-999, 1000}, {5, 5}, {99, 101}, {-1, 0}};
  for (const auto& [lo, hi] : ranges) {
    const ByteDfa dfa = dfa_of(integer_range_regex(lo, hi));
    for (int64_t v = lo - 50; v <= hi + 50; ++v)
      CHECK_MESSAGE(dfa.matches(std::to_string(v)) == (v >= lo && v <= hi), v << " in [" << lo << ", " << hi << "]");
    CHECK_FALSE(dfa.matches("-0"));
    CHECK_FALSE(dfa.matches("01"));
  }
  const ByteDfa number = dfa_of(number_range_regex(true, -2, true, 3, 999, 3));
  for (const char* yes : {"-2", "-2.0", "-1.999", "0", "0.5", "2.999", "3", "3.000", "-0.25"})
    CHECK_MESSAGE(number.matches(yes), yes);
  for (const char* no : {"-2.001", "3.001", "4", "-3", "1e2", "1.", "00.5", "0.1234"}) CHECK_MESSAGE(!number.matches(no), no);
}

TEST_CASE("JSON Schema: pattern, integer and number bounds are enforced") {
  const ByteMatcher m = schema_matcher(R"({
    "type": "object",
    "properties": {
      "code": {"type": "string", "pattern": "^[A-Z]{3}-\\d{2}$"},
      "word": {"type": "string", "pattern": "cat", "maxLength": 6},
      "age": {"type": "integer", "minimum": 18, "exclusiveMaximum": 65},
      "score": {"type": "number", "minimum": 0, "maximum": 1},
      "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 2}
    },
    "required": ["code", "word", "age", "score", "tags"]
  })");
  auto doc = [](const std::string& code, const std::string& word, const std::string& age, const std::string& score,
                const std::string& tags) {
    return "{\"code\": \"" + code + "\", \"word\": \"" + word + "\", \"age\": " + age + ", \"score\": " + score +
           ", \"tags\": " + tags + "}";
  };
  CHECK(accepts(m, doc("ABC-12", "a cat", "18", "0.5", "[\"x\"]")));
  CHECK(accepts(m, doc("XYZ-00", "cat", "64", "1", "[\"x\", \"y\"]")));
  CHECK(accepts(m, doc("XYZ-00", "\\\"cat", "64", "1.0", "[\"x\"]")));  // the pattern sees the decoded quote
  CHECK_FALSE(accepts(m, doc("ABC-123", "cat", "18", "0.5", "[\"x\"]")));
  CHECK_FALSE(accepts(m, doc("abc-12", "cat", "18", "0.5", "[\"x\"]")));
  CHECK_FALSE(accepts(m, doc("ABC-12", "dog", "18", "0.5", "[\"x\"]")));
  CHECK_FALSE(accepts(m, doc("ABC-12", "catcatc", "18", "0.5", "[\"x\"]")));  // maxLength with pattern
  CHECK_FALSE(accepts(m, doc("ABC-12", "cat", "17", "0.5", "[\"x\"]")));
  CHECK_FALSE(accepts(m, doc("ABC-12", "cat", "65", "0.5", "[\"x\"]")));
  CHECK_FALSE(accepts(m, doc("ABC-12", "cat", "30", "1.5", "[\"x\"]")));
  CHECK_FALSE(accepts(m, doc("ABC-12", "cat", "30", "-0.1", "[\"x\"]")));
  CHECK_FALSE(accepts(m, doc("ABC-12", "cat", "30", "0.5", "[]")));
  CHECK_FALSE(accepts(m, doc("ABC-12", "cat", "30", "0.5", "[\"x\", \"y\", \"z\"]")));
  // maxLength with a pattern: no character that leaves too little room to finish the match.
  const ByteMatcher room = schema_matcher(R"({"type": "string", "pattern": "[A-Z]{2}", "maxLength": 3})");
  State st = room.initial();
  CHECK(room.feed_all(&st, "\"a"));
  CHECK_FALSE(room.feed_all(&st, "b"));
  CHECK(accepts(room, "\"aXY\""));
  // Bounds that a regex cannot hold exactly are refused, naming the keyword.
  CHECK(schema_error(R"({"type": "number", "exclusiveMinimum": 0})").find("exclusiveMinimum: is not enforced exactly") == 0);
  CHECK(schema_error(R"({"type": "number", "maximum": 2.5})").find("maximum: is enforced on a number only when") == 0);
  CHECK(schema_error(R"({"type": "integer", "minimum": 5, "maximum": 4})").find("maximum: leaves no integer") == 0);
  CHECK(schema_error(R"({"type": "string", "pattern": "(a"})") == "pattern: position 0: missing ')'");
  CHECK(schema_error(R"({"properties": {"x": {"type": "string", "pattern": 3}}})") ==
        "properties.x.pattern: expected a regex string, got a number");
  // Integers take fractional and draft-4 boolean exclusive bounds.
  const ByteMatcher i = schema_matcher(R"({"type": "integer", "minimum": 2.5, "maximum": 10, "exclusiveMaximum": true})");
  CHECK_FALSE(accepts(i, "2"));
  CHECK(accepts(i, "3"));
  CHECK(accepts(i, "9"));
  CHECK_FALSE(accepts(i, "10"));
}

namespace {

// llama.cpp's example grammars (grammars/*.gbnf there), written out from the published syntax.
const char* kArithmetic = R"gbnf(root  ::= (expr "=" ws term "\n")+
expr  ::= term ([-+*/] term)*
term  ::= ident | num | "(" ws expr ")" ws
ident ::= [a-z] [a-z0-9_]*
num   ::= [0-9]+ ws
ws    ::= [ \t\n]*
)gbnf";

const char* kJson = R"gbnf(root   ::= object
value  ::= object | array | string | number | ("true" | "false" | "null") ws

object ::=
  "{" ws (
            string ":" ws value
    ("," ws string ":" ws value)*
  )? "}" ws

array  ::=
  "[" ws (
            value
    ("," ws value)*
  )? "]" ws

string ::=
  "\"" (
    [^"\\\x7F\x00-\x1F] |
    "\\" (["\\bfnrt] | "u" [0-9a-fA-F]{4}) # escapes
  )* "\"" ws

number ::= ("-"? ([0-9] | [1-9] [0-9]{0,15})) ("." [0-9]+)? ([eE] [-+]? [0-9] [1-7]{0,15})? ws

# Optional space: by convention, applied in this grammar after literal chars when allowed
ws ::= | " " | "\n" [ \t]{0,20}
)gbnf";

const char* kList = R"gbnf(root ::= item+

# Excludes various line break characters
item ::= "- " [^\r\n\x0b\x0c\x85\u2028\u2029]+ "\n"
)gbnf";

}  // namespace

TEST_CASE("GBNF: llama.cpp's arithmetic, JSON and list grammars") {
  const ByteMatcher arith = gbnf_matcher(kArithmetic);
  CHECK(accepts(arith, "1+2=3\n"));
  CHECK(accepts(arith, "(x1+2 )*y= 7\n"));
  CHECK(accepts(arith, "a=b\nc=d\n"));
  CHECK_FALSE(accepts(arith, "1+=3\n"));
  CHECK_FALSE(accepts(arith, "1+2=3"));
  CHECK_FALSE(accepts(arith, "A=1\n"));
  const ByteMatcher json = gbnf_matcher(kJson);
  CHECK(accepts(json, "{}"));
  CHECK(accepts(json, "{\"a\": [1, -2.5e3, true, null, \"x\\n\\u00e9\"], \"b\": {\"c\": \"\xC3\xA9\"}}"));
  CHECK_FALSE(accepts(json, "{\"a\": 01}"));
  CHECK_FALSE(accepts(json, "[1]"));
  CHECK_FALSE(accepts(json, "{\"a\": \"\x01\"}"));
  const ByteMatcher list = gbnf_matcher(kList);
  CHECK(accepts(list, "- milk\n- eggs \xE2\x82\xAC\n"));
  CHECK_FALSE(accepts(list, "- milk"));
  CHECK_FALSE(accepts(list, "- \n"));
  CHECK_FALSE(accepts(list, "- a\xE2\x80\xA8" "b\n"));  // U+2028 is excluded
}

TEST_CASE("GBNF: repetition counts, groups, '.', comments, and right recursion that does not grow the stack") {
  const ByteMatcher m = gbnf_matcher("root ::= \"<\" [a-c]{2,3} (\"|\" .)? \">\" # a comment\n");
  CHECK(accepts(m, "<ab>"));
  CHECK(accepts(m, "<abc|\xC3\xA9>"));
  CHECK_FALSE(accepts(m, "<a>"));
  CHECK_FALSE(accepts(m, "<abca>"));
  const ByteMatcher rec = gbnf_matcher("root ::= \"x\" root | \"y\"\n");
  CHECK(accepts(rec, std::string(500, 'x') + "y"));
  const ByteMatcher nested = gbnf_matcher("root ::= \"(\" root \")\" | \"\"\n");
  CHECK(accepts(nested, "((()))"));
  CHECK_FALSE(accepts(nested, "(()"));
  // `x?` of an x that can be empty is x.
  const ByteMatcher opt = gbnf_matcher("root ::= ws? \"a\"\nws ::= \" \"*\n");
  CHECK(accepts(opt, "  a"));
  CHECK(accepts(opt, "a"));
}

TEST_CASE("GBNF: errors name the line, the column and what was expected") {
  CHECK(gbnf_error("root ::= foo\n") == "1:10: undefined rule 'foo'");
  CHECK(gbnf_error("start ::= \"a\"\n") == "1:1: the grammar has no rule 'root' (the output)");
  CHECK(gbnf_error("root ::= \"a\"\nx = \"b\"\n") == "2:3: expected '::=' after the rule name 'x', got '='");
  CHECK(gbnf_error("root ::= \"a\n") == "1:10: a literal without its closing '\"'");
  CHECK(gbnf_error("root ::= [a-\n") .find("1:10: ") == 0);
  CHECK(gbnf_error("root ::= ( \"a\" \n") == "1:10: a '(' without its ')' (got the end of the grammar)");
  CHECK(gbnf_error("root ::= * \"a\"\n") == "1:10: nothing before '*' to repeat");
  CHECK(gbnf_error("root ::= \"a\" \"\\q\"\n").find("1:15: unknown escape '\\q'") == 0);
  CHECK(gbnf_error("root ::= root \"a\" | \"b\"\n").find("1:1: rule 'root' is left-recursive") == 0);
  CHECK(gbnf_error("root ::= x\nx ::= ws x \"a\" | \"b\"\nws ::= \" \"?\n").find("2:1: rule 'x' is left-recursive") == 0);
  CHECK(gbnf_error("root ::= (\"a\"?)*\n") == "1:16: the repeated part can match the empty string; make it match at "
                                              "least one character");
  CHECK(gbnf_error("root ::= \"a\"\nroot ::= \"b\"\n") == "2:1: rule 'root' is defined twice (first at 1:1)");
  CHECK(gbnf_error("root ::= \"a\" )\n") == "1:14: expected the end of the line or '|', got ')'");
  CHECK(gbnf_error("root ::= <[1]>\n").find("1:10: token references") == 0);
  CHECK(gbnf_error("root ::= \"a\"{2,1}\n") == "1:13: {m,n} with n below m");
}

namespace {

// A vocabulary of single characters and multi-byte pieces that cross grammar boundaries.
std::vector<std::string> walk_vocab() {
  std::vector<std::string> v;
  for (int c = 0x20; c < 0x7f; ++c) v.push_back(std::string(1, static_cast<char>(c)));
  for (const char* piece : {"\n", "\n- ", "- ", "12", "+(", ")*", "= ", "ab", "x_1", "\": ", "{\"", "\"}", "true", "null",
                            "\xC3\xA9", "\xC3", "\xA9", "\xE2\x80", "\xA8", "e+", "0.", ", \"", "]", "[\""})
    v.push_back(piece);
  // Every UTF-8 continuation byte, as byte-level vocabularies have them: a token that starts
  // a character can always be completed.
  for (int c = 0x80; c < 0xC0; ++c) v.push_back(std::string(1, static_cast<char>(c)));
  v.push_back("");  // the end token
  return v;
}

void skip_ws(const std::string& s, size_t* i) {
  while (*i < s.size() && (s[*i] == ' ' || s[*i] == '\n' || s[*i] == '\t' || s[*i] == '\r')) ++*i;
}

// JSON's grammar (RFC 8259), syntax only; `object_only` for the top level of kJson.
bool json_syntax_value(const std::string& s, size_t* i, bool object_only = false) {
  skip_ws(s, i);
  if (*i >= s.size()) return false;
  const char c = s[*i];
  if (object_only && c != '{') return false;
  if (c == '{' || c == '[') {
    const char close = c == '{' ? '}' : ']';
    ++*i;
    skip_ws(s, i);
    if (*i < s.size() && s[*i] == close) {
      ++*i;
      skip_ws(s, i);
      return true;
    }
    while (true) {
      if (c == '{') {
        skip_ws(s, i);
        if (*i >= s.size() || s[*i] != '"' || !json_syntax_value(s, i)) return false;
        skip_ws(s, i);
        if (*i >= s.size() || s[*i] != ':') return false;
        ++*i;
      }
      if (!json_syntax_value(s, i)) return false;
      skip_ws(s, i);
      if (*i < s.size() && s[*i] == ',') {
        ++*i;
        continue;
      }
      if (*i < s.size() && s[*i] == close) {
        ++*i;
        skip_ws(s, i);
        return true;
      }
      return false;
    }
  }
  if (c == '"') {
    for (++*i; *i < s.size(); ++*i) {
      const auto u = static_cast<unsigned char>(s[*i]);
      if (u < 0x20) return false;
      if (u == '"') {
        ++*i;
        skip_ws(s, i);
        return true;
      }
      if (u == '\\') {
        ++*i;
        if (*i >= s.size()) return false;
        if (s[*i] == 'u') {
          for (int k = 0; k < 4; ++k)
            if (++*i >= s.size() || !std::isxdigit(static_cast<unsigned char>(s[*i]))) return false;
        } else if (std::string("\"\\/bfnrt").find(s[*i]) == std::string::npos) {
          return false;
        }
      }
    }
    return false;
  }
  for (const char* kw : {"true", "false", "null"})
    if (s.compare(*i, std::strlen(kw), kw) == 0) {
      *i += std::strlen(kw);
      skip_ws(s, i);
      return true;
    }
  static const std::regex number("-?(0|[1-9][0-9]*)(\\.[0-9]+)?([eE][-+]?[0-9]+)?");
  size_t end = *i;
  while (end < s.size() && std::string("-+.eE0123456789").find(s[end]) != std::string::npos) ++end;
  if (!std::regex_match(s.substr(*i, end - *i), number)) return false;
  *i = end;
  skip_ws(s, i);
  return true;
}

// Walks under the mask from the start, picking allowed tokens at random, until the end token
// or `steps`; returns the text, or "" and fails when a mask allows a token the matcher refuses.
std::string random_walk(const ByteMatcher& m, const TokenTrie& trie, const std::vector<std::string>& vocab, TokenId eos,
                        std::mt19937& rng, int steps, bool* ended) {
  State s = m.initial();
  std::string text;
  *ended = false;
  for (int k = 0; k < steps; ++k) {
    std::vector<uint32_t> mask((vocab.size() + 31) / 32, 0u);
    compute_token_mask(m, trie, s, mask);
    std::vector<TokenId> allowed;
    for (size_t t = 0; t < vocab.size(); ++t)
      if (mask[t >> 5] >> (t & 31) & 1) allowed.push_back(static_cast<TokenId>(t));
    // End with some probability once allowed, always when nothing else is.
    if (m.can_end(s) && (allowed.empty() || rng() % 4 == 0)) {
      *ended = true;
      return text;
    }
    REQUIRE_MESSAGE(!allowed.empty(), "no token can continue \"" << text << "\"");
    const TokenId t = allowed[rng() % allowed.size()];
    REQUIRE(t != eos);
    REQUIRE_MESSAGE(m.feed_all(&s, vocab[static_cast<size_t>(t)]), "the mask allowed a dead token after " << text);
    text += vocab[static_cast<size_t>(t)];
  }
  return text;
}

}  // namespace

TEST_CASE("random walks under regex and GBNF masks end in text an independent check accepts") {
  const std::vector<std::string> vocab = walk_vocab();
  const TokenId eos = static_cast<TokenId>(vocab.size() - 1);
  const TokenTrie trie(vocab);
  std::mt19937 rng(99);
  struct Case {
    std::string name;
    Grammar grammar;
    std::function<bool(const std::string&)> check;
  };
  std::vector<Case> cases;
  {
    Grammar g;
    REQUIRE(compile_regex_output("[a-z]{1,6}( [a-z]{1,6}){0,3}\\.", {}, &g).is_ok());
    const std::regex re("[a-z]{1,6}( [a-z]{1,6}){0,3}\\.");
    cases.push_back({"regex", std::move(g), [re](const std::string& s) { return std::regex_match(s, re); }});
  }
  {
    Grammar g;
    REQUIRE(compile_gbnf(kList, {}, &g).is_ok());
    // Lines "- " + at least one character that is not a line break, each ended by "\n".
    cases.push_back({"list", std::move(g), [](const std::string& s) {
                       size_t i = 0;
                       if (s.empty()) return false;
                       while (i < s.size()) {
                         if (s.compare(i, 2, "- ") != 0) return false;
                         const size_t nl = s.find('\n', i + 2);
                         if (nl == std::string::npos || nl == i + 2) return false;
                         const std::string body = s.substr(i + 2, nl - i - 2);
                         if (body.find('\r') != std::string::npos || body.find("\xE2\x80\xA8") != std::string::npos)
                           return false;
                         i = nl + 1;
                       }
                       return true;
                     }});
  }
  {
    Grammar g;
    REQUIRE(compile_gbnf(kJson, {}, &g).is_ok());
    // A JSON syntax check of its own (parsers refuse exponents like 1e45121257, which JSON's
    // grammar and this one allow).
    cases.push_back({"json", std::move(g), [](const std::string& s) {
                       size_t i = 0;
                       return json_syntax_value(s, &i, true) && i == s.size();
                     }});
  }
  for (auto& c : cases) {
    const ByteMatcher m(std::move(c.grammar));
    int ended_walks = 0;
    for (int w = 0; w < 60; ++w) {
      bool ended = false;
      const std::string text = random_walk(m, trie, vocab, eos, rng, 300, &ended);
      if (!ended) continue;
      ++ended_walks;
      CHECK_MESSAGE(c.check(text), c.name << ": \"" << text << "\"");
    }
    CHECK_MESSAGE(ended_walks > 10, c.name);
  }
}

TEST_CASE("a whole-output regex's mask from its DFA, and from its byte classes, equals the matcher's walk, state by state") {
  std::vector<std::string> vocab = walk_vocab();
  vocab.pop_back();  // the end token is the caller's business in both walks
  for (const char* word : {"Hello", "hello", " world", "The", " the", "abc.", ", and", "yes", "no", " no", "Yes!",
                           "zzzzzzzzzzzzzzzz", "aaaaaaaaaaaaaaaaaaaaaaa", ".", "! ", "? The", "\xC3\xA9t\xC3\xA9"})
    vocab.push_back(word);
  const TokenTrie trie(vocab);
  std::mt19937 rng(5);
  // The constrained-decoding benchmark's default (thousands of DFA states), a choice whose
  // matches cannot go on (states with no next byte), a UTF-8 class and an anchored pattern.
  for (const char* pattern : {"([A-Z][a-z]{0,15}(,? [a-z]{1,15}){0,12}[.!?] )+", "(yes|no|Yes!)", "[^,]{1,8}\\.",
                              "^[a-z ]*(world|the)$"}) {
    INFO("pattern " << pattern);
    Grammar g;
    REQUIRE(compile_regex_output(pattern, {}, &g).is_ok());
    const ByteMatcher m(std::move(g));
    const DfaTokenIndex index(m.grammar().dfas[0], trie);
    CHECK(index.num_nodes() <= trie.size());
    int states_checked = 0;
    for (int walk = 0; walk < 20; ++walk) {
      State s = m.initial();
      for (int step = 0; step < 40 && !s.dead() && !m.is_complete(s); ++step) {
        const ByteDfa* dfa = nullptr;
        int32_t dfa_state = -1;
        REQUIRE(m.whole_output_regex(s, &dfa, &dfa_state));
        std::vector<uint32_t> by_dfa((vocab.size() + 31) / 32, 0u), by_matcher(by_dfa.size(), 0u);
        compute_token_mask(m, trie, s, by_dfa);
        compute_token_mask_by_matcher(m, trie, s, by_matcher);
        REQUIRE(by_dfa == by_matcher);
        std::vector<uint32_t> by_classes(by_dfa.size(), 0u);
        index.fill(dfa_state, by_classes);
        REQUIRE(by_classes == by_matcher);
        ++states_checked;
        std::vector<TokenId> allowed;
        for (size_t t = 0; t < vocab.size(); ++t)
          if (by_dfa[t >> 5] >> (t & 31) & 1) allowed.push_back(static_cast<TokenId>(t));
        if (allowed.empty()) break;
        REQUIRE(m.feed_all(&s, vocab[static_cast<size_t>(allowed[rng() % allowed.size()])]));
      }
    }
    CHECK(states_checked >= 20);
  }
  // Anything else (here a GBNF grammar whose root is a sequence) takes the matcher's walk.
  Grammar g;
  REQUIRE(compile_gbnf("root ::= \"a\" [0-9]+", {}, &g).is_ok());
  const ByteMatcher m(std::move(g));
  const ByteDfa* dfa = nullptr;
  int32_t dfa_state = -1;
  CHECK_FALSE(m.whole_output_regex(m.initial(), &dfa, &dfa_state));
}
