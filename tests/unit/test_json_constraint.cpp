// constraint.json-schema's grammar compiler, byte matcher, vocabulary trie and token masks
// (plugins/constraint/json-schema), without a model: strings accepted and refused, masks
// against a brute-force check of every token, and random walks under the mask that must
// always end in JSON that parses and validates.
#include <doctest/doctest.h>

#include <nlohmann/json.hpp>

#include <random>
#include <set>
#include <string>
#include <vector>

#include "grammar.h"
#include "matcher.h"
#include "token_mask.h"

using namespace tessera;
using namespace tessera::json_constraint;
using ojson = nlohmann::ordered_json;

namespace {

ByteMatcher schema_matcher(const std::string& schema_text, GrammarLimits limits = {}) {
  Grammar g;
  Status st = compile_json_schema(ojson::parse(schema_text), limits, &g);
  REQUIRE_MESSAGE(st.is_ok(), st.message());
  return ByteMatcher(std::move(g));
}

// Whether `text` is a complete output: every byte accepted and the output may end.
bool accepts(const ByteMatcher& m, const std::string& text) {
  State s = m.initial();
  return m.feed_all(&s, text) && m.can_end(s);
}
// Whether `text` can still become an output (a prefix of one).
bool alive(const ByteMatcher& m, const std::string& text) {
  State s = m.initial();
  return m.feed_all(&s, text);
}

std::string compile_error(const std::string& schema_text) {
  Grammar g;
  Status st = compile_json_schema(ojson::parse(schema_text), {}, &g);
  return st.is_ok() ? std::string() : st.message();
}

const char* kPerson = R"({
  "type": "object",
  "properties": {
    "name": {"type": "string"},
    "age": {"type": "integer"},
    "tags": {"type": "array", "items": {"type": "string"}},
    "email": {"anyOf": [{"type": "string"}, {"type": "null"}]}
  },
  "required": ["name", "age"],
  "additionalProperties": false
})";

// A tiny validator for the schema subset the tests use: an independent check of the compiler.
bool validates(const nlohmann::json& v, const nlohmann::json& schema, const nlohmann::json& root) {
  if (schema.contains("$ref")) {
    const std::string ref = schema["$ref"];
    return validates(v, root.at(nlohmann::json::json_pointer(ref.substr(1))), root);
  }
  if (schema.contains("const")) return v == schema["const"];
  if (schema.contains("enum")) {
    for (const auto& e : schema["enum"])
      if (v == e) return true;
    return false;
  }
  if (schema.contains("anyOf")) {
    for (const auto& alt : schema["anyOf"])
      if (validates(v, alt, root)) return true;
    return false;
  }
  const std::string type = schema.value("type", "");
  if (type == "string") {
    if (!v.is_string()) return false;
    if (schema.contains("maxLength")) {
      // Characters, not bytes.
      size_t chars = 0;
      for (unsigned char c : v.get<std::string>()) chars += (c & 0xC0) != 0x80;
      if (chars > schema["maxLength"].get<size_t>()) return false;
    }
    return true;
  }
  if (type == "integer") return v.is_number_integer();
  if (type == "number") return v.is_number();
  if (type == "boolean") return v.is_boolean();
  if (type == "null") return v.is_null();
  if (type == "array") {
    if (!v.is_array()) return false;
    if (schema.contains("minItems") && v.size() < schema["minItems"].get<size_t>()) return false;
    if (schema.contains("maxItems") && v.size() > schema["maxItems"].get<size_t>()) return false;
    for (const auto& item : v)
      if (schema.contains("items") && !validates(item, schema["items"], root)) return false;
    return true;
  }
  if (type == "object") {
    if (!v.is_object()) return false;
    for (const auto& r : schema.value("required", nlohmann::json::array()))
      if (!v.contains(r.get<std::string>())) return false;
    for (const auto& [key, value] : v.items()) {
      if (schema.contains("properties") && schema["properties"].contains(key)) {
        if (!validates(value, schema["properties"][key], root)) return false;
      } else if (schema.value("additionalProperties", true) == false) {
        return false;
      }
    }
    return true;
  }
  return true;
}

// A small vocabulary shaped like a real one: every printable byte, multi-byte pieces that
// cross JSON token boundaries, whitespace runs, UTF-8 characters and lone UTF-8 bytes.
std::vector<std::string> small_vocab() {
  std::vector<std::string> v;
  for (int c = 0x20; c < 0x7f; ++c) v.push_back(std::string(1, static_cast<char>(c)));
  for (const char* piece :
       {"{\"", "\":", "\": \"", "\", \"", "\"}", "\"},", "\":\"", "name", "age", "tags", "email", " \"", "\",",
        "true", "false", "null", "nul", "123", "0.", ".5", "e+", "-1", "00", "\n", "\n  ", "  ", "    ", "\t",
        "[\"", "\"]", "],", "[]", "{}", "\\n", "\\\"", "\\u00", "e9", "Paris", " is", "<tool_call>", "<tool",
        "_call>\n", "\n</tool_call>", "</", "get_weather", "city", "\"arguments\": {", "\"name\": \""})
    v.push_back(piece);
  v.push_back("\xC3\xA9");   // é
  v.push_back("\xC3");       // a lone lead byte
  v.push_back("\xA9");       // a lone continuation byte
  v.push_back("\xE2\x82");   // two of the three bytes of €
  v.push_back("\xAC");
  v.push_back("\xFF");       // never valid UTF-8
  v.push_back("\x01");       // a control character
  v.push_back("");           // a control token (never allowed)
  v.push_back("");           // the end token (index eos below)
  return v;
}

std::vector<uint32_t> brute_force_mask(const ByteMatcher& m, const std::vector<std::string>& vocab, const State& s) {
  std::vector<uint32_t> mask((vocab.size() + 31) / 32, 0u);
  for (size_t t = 0; t < vocab.size(); ++t) {
    if (vocab[t].empty()) continue;
    State copy = s;
    if (m.feed_all(&copy, vocab[t])) mask[t >> 5] |= 1u << (t & 31);
  }
  return mask;
}

bool bit(const std::vector<uint32_t>& mask, size_t t) { return (mask[t >> 5] >> (t & 31)) & 1u; }

}  // namespace

TEST_CASE("an object schema: properties in order, required ones present, nothing else") {
  ByteMatcher m = schema_matcher(kPerson);
  CHECK(accepts(m, R"({"name":"Ada","age":36})"));
  CHECK(accepts(m, R"({"name": "Ada", "age": -3, "tags": ["x", "y"], "email": null})"));
  CHECK(accepts(m, "{\n  \"name\": \"Ada\",\n  \"age\": 0,\n  \"email\": \"a@b.c\"\n}"));
  CHECK(accepts(m, R"({"name":"","age":1,"tags":[]})"));
  CHECK_FALSE(accepts(m, R"({"name":"Ada"})"));             // age is required
  CHECK(alive(m, R"({"name":"Ada")"));                      // ... so it may still come
  CHECK_FALSE(alive(m, R"({"name":"Ada"})"));
  CHECK_FALSE(alive(m, R"({"age":3)"));                     // name comes first (schema order)
  CHECK_FALSE(alive(m, R"({"name":"Ada","age":3,"x")"));    // no additional properties
  CHECK_FALSE(alive(m, R"({"name":1)"));                    // wrong type
  CHECK_FALSE(alive(m, R"({"name":"Ada","age":3.5)"));      // integer
  CHECK_FALSE(alive(m, R"({"name":"Ada","age":3,})"));      // trailing comma
  CHECK_FALSE(alive(m, R"( {"name")"));                     // no leading whitespace
  CHECK_FALSE(alive(m, R"({"name":"Ada","age":3,"email":null,"tags":[])"));  // order
  // Complete once the closing brace is there: nothing but the end may follow.
  State s = m.initial();
  REQUIRE(m.feed_all(&s, R"({"name":"Ada","age":36})"));
  CHECK(m.is_complete(s));
  State partial = m.initial();
  REQUIRE(m.feed_all(&partial, R"({"name":"Ada","age":36)"));
  CHECK_FALSE(m.is_complete(partial));
  CHECK_FALSE(m.can_end(partial));
}

TEST_CASE("numbers, strings and escapes follow the JSON grammar") {
  ByteMatcher num = schema_matcher(R"({"type": "number"})");
  for (const char* ok : {"0", "-0", "12", "-0.5", "3.25e+10", "1E-3", "7e2"}) CHECK_MESSAGE(accepts(num, ok), ok);
  for (const char* bad : {"01", "1.", ".5", "-", "+1", "1e", "1.e3", "--1", "0x1"}) CHECK_MESSAGE(!accepts(num, bad), bad);
  State s = num.initial();
  REQUIRE(num.feed_all(&s, "12"));
  CHECK(num.can_end(s));             // "12" may end
  CHECK_FALSE(num.is_complete(s));   // or go on ("123")
  ByteMatcher str = schema_matcher(R"({"type": "string"})");
  for (const char* ok : {R"("")", R"("a b")", R"("\"\\\/\b\f\n\r\t")", R"("\u00e9\u20AC\ud7ff")", "\"\xC3\xA9\xE2\x82\xAC\""})
    CHECK_MESSAGE(accepts(str, ok), ok);
  for (const char* bad : {"\"a\nb\"", R"("\x")", R"("\u12G4")", "\"\xFF\"", "\"\xC3\"", "\"\xE0\x80\x80\"",
                          "\"\xED\xA0\x80\"", "\"a\"b", R"("\uD83D")", R"("\udc00")"})
    CHECK_MESSAGE(!accepts(str, bad), bad);
  ByteMatcher bounded = schema_matcher(R"({"type": "string", "minLength": 2, "maxLength": 3})");
  CHECK_FALSE(accepts(bounded, R"("a")"));
  CHECK(accepts(bounded, R"("ab")"));
  CHECK(accepts(bounded, "\"\xC3\xA9\\n\xC3\xA9\""));   // three characters, seven bytes
  CHECK_FALSE(alive(bounded, R"("abcd)"));
}

TEST_CASE("enum, const, anyOf, nullable types, $ref and recursion") {
  CHECK(accepts(schema_matcher(R"({"enum": ["red", "green", 3, null]})"), R"("green")"));
  CHECK(accepts(schema_matcher(R"({"enum": ["red", "green", 3, null]})"), "3"));
  CHECK_FALSE(accepts(schema_matcher(R"({"enum": ["red", "green"]})"), R"("blue")"));
  CHECK(accepts(schema_matcher(R"({"const": {"a": [1, true]}})"), R"({"a":[1,true]})"));
  ByteMatcher multi = schema_matcher(R"({"type": ["integer", "null"]})");
  CHECK(accepts(multi, "null"));
  CHECK(accepts(multi, "42"));
  CHECK_FALSE(accepts(multi, "\"x\""));
  // Pydantic's nested models: $defs and $ref, and a recursive tree.
  const char* tree = R"({
    "$defs": {"Node": {"type": "object",
                       "properties": {"v": {"type": "integer"},
                                      "kids": {"type": "array", "items": {"$ref": "#/$defs/Node"}}},
                       "required": ["v"]}},
    "$ref": "#/$defs/Node"})";
  ByteMatcher t = schema_matcher(tree);
  CHECK(accepts(t, R"({"v":1,"kids":[{"v":2},{"v":3,"kids":[{"v":4,"kids":[]}]}]})"));
  CHECK_FALSE(alive(t, R"({"v":1,"kids":[{"w")"));
  ByteMatcher bounded = schema_matcher(R"({"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 2})");
  CHECK_FALSE(accepts(bounded, "[]"));
  CHECK(accepts(bounded, "[true]"));
  CHECK(accepts(bounded, "[true, false]"));
  CHECK_FALSE(alive(bounded, "[true,false,"));
}

TEST_CASE("json_object mode takes any object, nested values included") {
  Grammar g;
  REQUIRE(compile_json_object({}, &g).is_ok());
  ByteMatcher m(std::move(g));
  CHECK(accepts(m, R"({"a": [1, {"b": null}, "x"], "c": -2.5e3, "d": {}})"));
  CHECK(accepts(m, "{}"));
  CHECK_FALSE(alive(m, "[1]"));  // an object, not any value
  CHECK_FALSE(alive(m, R"({"a": tru })"));
}

TEST_CASE("whitespace between tokens is bounded") {
  GrammarLimits limits;
  limits.max_whitespace = 2;
  ByteMatcher m = schema_matcher(R"({"type": "array", "items": {"type": "integer"}})", limits);
  CHECK(accepts(m, "[  1,  2  ]"));
  CHECK_FALSE(alive(m, "[   1"));
  limits.max_whitespace = 0;
  ByteMatcher compact = schema_matcher(R"({"type": "array"})", limits);
  CHECK(accepts(compact, "[1,2]"));
  CHECK_FALSE(alive(compact, "[ "));
}

TEST_CASE("tool calls: the Hermes block with a known name and its arguments, or text in auto mode") {
  const std::string spec = R"({"begin": "<tool_call>\n", "end": "\n</tool_call>", "separator": "\n",
    "parallel": true, "allow_text": false,
    "tools": [{"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                       "required": ["city"]}},
              {"name": "noop", "parameters": null}]})";
  Grammar g;
  REQUIRE(compile_tool_calls(ojson::parse(spec), {}, &g).is_ok());
  ByteMatcher m(std::move(g));
  const std::string call = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
  CHECK(accepts(m, call));
  CHECK(accepts(m, call + "\n<tool_call>\n{\"name\":\"noop\",\"arguments\":{}}\n</tool_call>"));
  CHECK_FALSE(alive(m, "<tool_call>\n{\"name\": \"get_time\""));
  CHECK_FALSE(alive(m, "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"town\""));
  CHECK_FALSE(alive(m, "Sure"));  // required: a call, no text
  auto auto_spec = ojson::parse(spec);
  auto_spec["allow_text"] = true;
  auto_spec["parallel"] = false;
  Grammar ga;
  REQUIRE(compile_tool_calls(auto_spec, {}, &ga).is_ok());
  ByteMatcher a(std::move(ga));
  CHECK(accepts(a, "Sure, it is sunny."));
  CHECK(accepts(a, ""));
  CHECK(accepts(a, call));
  CHECK(alive(a, "<tool"));  // text or a call
  CHECK_FALSE(alive(a, "<tool_call>\n{\"nam\":"));  // once the tag is complete it is a call
  CHECK_FALSE(alive(a, call + "\n<tool_call>"));     // parallel_tool_calls false: one call
  State one = a.initial();
  REQUIRE(a.feed_all(&one, call));
  CHECK(a.is_complete(one));  // ... so the output is complete after it
  State first = m.initial();
  REQUIRE(m.feed_all(&first, call));
  CHECK(m.can_end(first));
  CHECK_FALSE(m.is_complete(first));  // parallel: another call may follow
}

TEST_CASE("bad schemas are refused with the path of the offending part") {
  CHECK(compile_error(R"({"type": "strin"})").find("type: unknown type \"strin\"") == 0);
  CHECK(compile_error(R"({"type": "object", "properties": {"a": {"type": 3}}})")
            .find("properties.a.type: expected a type name") == 0);
  CHECK(compile_error(R"({"$ref": "#/$defs/Missing"})").find("$ref: \"#/$defs/Missing\" does not name") == 0);
  CHECK(compile_error(R"({"enum": []})").find("enum: expected a non-empty list") == 0);
  CHECK(compile_error(R"({"type": "array", "items": [{"type": "string"}]})").find("items: a list of schemas") == 0);
  CHECK(compile_error("false").find("schema: the schema false allows no value") == 0);
  CHECK(compile_error(R"({"type": "object", "required": ["x"], "additionalProperties": false})")
            .find("required: \"x\" is required but not allowed") == 0);
}

TEST_CASE("the vocabulary trie holds every non-empty token once, in preorder") {
  const std::vector<std::string> vocab = small_vocab();
  TokenTrie trie(vocab);
  std::multiset<TokenId> seen;
  for (size_t i = 0; i < trie.size(); ++i) {
    CHECK(trie.subtree_end(i) > i);
    CHECK(trie.subtree_end(i) <= trie.size());
    for (TokenId t : trie.tokens_at(i)) {
      seen.insert(t);
      // The bytes on the path to node i are the token's: node i is at depth |bytes| and its
      // byte is the last one.
      CHECK(trie.depth(i) == static_cast<int32_t>(vocab[static_cast<size_t>(t)].size()));
      CHECK(trie.byte(i) == static_cast<uint8_t>(vocab[static_cast<size_t>(t)].back()));
    }
  }
  size_t non_empty = 0;
  for (const auto& v : vocab) non_empty += !v.empty();
  CHECK(seen.size() == non_empty);
  for (TokenId t : seen) CHECK(seen.count(t) == 1);
}

TEST_CASE("masks equal a brute-force check of every token, and random walks under them end in valid JSON") {
  const std::vector<std::string> vocab = small_vocab();
  const TokenId eos = static_cast<TokenId>(vocab.size() - 1);
  auto trie = std::make_shared<const TokenTrie>(vocab);
  const char* schemas[] = {
      kPerson,
      R"({"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
          "temp": {"type": "number"}, "ok": {"type": "boolean"},
          "unit": {"enum": ["C", "F"]}}, "required": ["city", "ok"]})",
      R"({"type": "array", "items": {"anyOf": [{"type": "integer"}, {"type": "string"}]}, "maxItems": 4})",
  };
  std::mt19937 rng(7);
  int walks_completed = 0;
  for (const char* schema_text : schemas) {
    ByteMatcher m = schema_matcher(schema_text);
    MaskCache cache(trie, {eos}, 64);
    const nlohmann::json schema = nlohmann::json::parse(schema_text);
    for (int walk = 0; walk < 60; ++walk) {
      State s = m.initial();
      std::string text;
      bool ended = false;
      for (int step = 0; step < 80 && !ended; ++step) {
        std::vector<uint32_t> mask((vocab.size() + 31) / 32, 0u), cached(mask.size(), 0u);
        compute_token_mask(m, *trie, s, mask);
        CHECK(mask == brute_force_mask(m, vocab, s));
        cache.fill(m, s, cached);
        CHECK(bit(cached, eos) == m.can_end(s));
        cached[static_cast<size_t>(eos) >> 5] &= ~(1u << (eos & 31));
        CHECK(cached == mask);
        std::vector<TokenId> allowed;
        for (size_t t = 0; t < vocab.size(); ++t)
          if (bit(mask, t)) allowed.push_back(static_cast<TokenId>(t));
        // Never a dead end: something may always follow, or the output may end.
        REQUIRE((!allowed.empty() || m.can_end(s)));
        // Late in the walk, prefer the end and closing tokens so most walks finish.
        if (m.can_end(s) && (allowed.empty() || step > 40 || rng() % 4 == 0)) {
          ended = true;
          break;
        }
        // Half the time a token that closes or separates something, so walks make progress.
        std::vector<TokenId> closing;
        for (TokenId t : allowed)
          if (vocab[static_cast<size_t>(t)].find_first_of("\"]},:") != std::string::npos) closing.push_back(t);
        const std::vector<TokenId>& pool = !closing.empty() && rng() % 2 == 0 ? closing : allowed;
        const TokenId pick = pool[rng() % pool.size()];
        REQUIRE(m.feed_all(&s, vocab[static_cast<size_t>(pick)]));
        text += vocab[static_cast<size_t>(pick)];
        if (m.is_complete(s)) ended = true;
      }
      if (!ended) continue;
      ++walks_completed;
      nlohmann::json value;
      REQUIRE_NOTHROW_MESSAGE(value = nlohmann::json::parse(text), text);
      CHECK_MESSAGE(validates(value, schema, schema), text);
    }
  }
  // Most walks finish (the check above covers each one that does).
  CHECK(walks_completed > 60);
}
