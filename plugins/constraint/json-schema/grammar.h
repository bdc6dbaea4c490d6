// The grammar a constraint.json-schema spec compiles to: a graph of nodes (JSON values,
// literals, sequences, repetitions, free text) that the byte matcher (matcher.h) walks with a
// stack. Nodes refer to each other by index, so recursive schemas ($ref to an enclosing
// definition) are plain cycles.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <vector>

#include "regex.h"
#include "tessera/sdk/status.h"

namespace tessera::json_constraint {

enum class NodeKind : uint8_t {
  kAny,        // any JSON value (bounded nesting)
  kObject,     // properties in schema order, or any keys when `generic`
  kArray,      // items of one node, min/max count
  kString,     // a JSON string, min/max length in characters
  kNumber,     // a JSON number; `integer` for integers only
  kLiterals,   // one of several exact byte strings (enum, const, true/false, null)
  kAnyOf,      // one of several nodes
  kSequence,   // literals and nodes in order (tool-call wrappers)
  kRepeat,     // one node, min..max times, joined by a separator literal
  kFreeText,   // any bytes; dies if the output starts with `literal` (auto tool choice)
  kRegex,      // bytes the DFA `dfa` accepts (regex constraints, GBNF classes, bounded numbers)
};

struct Property {
  std::string key;     // JSON-encoded, quotes included: "\"name\""
  int32_t value = -1;  // node
  bool required = false;
};

struct SequenceItem {
  std::string literal;  // used when node < 0
  int32_t node = -1;
};

struct Node {
  NodeKind kind = NodeKind::kAny;
  // kObject
  std::vector<Property> properties;
  bool generic = false;  // any string keys, kAny values
  // kArray: item node (kAny when -1). kRepeat: element node. kString: length bounds.
  int32_t element = -1;
  int32_t min_count = 0;
  int32_t max_count = -1;  // -1: unbounded
  // kNumber
  bool integer = false;
  // kLiterals
  std::vector<std::string> literals;
  // kAnyOf
  std::vector<int32_t> alternatives;
  // kSequence
  std::vector<SequenceItem> items;
  // kRepeat: separator; kFreeText: the forbidden prefix
  std::string literal;
  // kRegex: the DFA (index into Grammar::dfas). kString: the `pattern` its decoded contents
  // must match, or -1.
  int32_t dfa = -1;
};

struct GrammarLimits {
  int32_t max_whitespace = 8;   // consecutive whitespace bytes between JSON tokens
  int32_t max_depth = 16;       // nesting of kAny objects and arrays
  int32_t max_int_digits = 15;  // digits before the point (and of integers)
  int32_t max_frac_digits = 15;
  int32_t max_exp_digits = 3;
};

struct Grammar {
  std::vector<Node> nodes;
  int32_t root = -1;
  GrammarLimits limits;
  // Built-in nodes every grammar has (compile() creates them first).
  int32_t any_node = -1;
  int32_t string_node = -1;
  int32_t number_node = -1;
  int32_t keyword_node = -1;  // true / false / null
  int32_t generic_object_node = -1;
  int32_t generic_array_node = -1;
  std::vector<ByteDfa> dfas;
};

// Which nodes can match the empty string (the matcher lets an output end, and a sequence move
// on, past them).
std::vector<bool> nullable_nodes(const Grammar& g);

// JSON Schema (the subset LangChain and Pydantic emit: type (also a list of types),
// properties, required, additionalProperties, items, minItems, maxItems, minLength,
// maxLength, enum, const, anyOf, oneOf (as anyOf), allOf of one schema, $ref to #/$defs/... or
// #/definitions/..., nullable) into a grammar. Properties are produced in schema order, each
// optional one possibly left out; no properties beyond the schema's are produced (every output
// still validates, as additional properties are allowed unless the schema says otherwise).
// Enforced besides: `pattern` on strings (regex.h, search semantics as JSON Schema has it),
// minimum / maximum / exclusiveMinimum / exclusiveMaximum on integers, and inclusive
// integer-valued minimum / maximum on numbers (other number bounds are refused: a regex cannot
// hold them exactly). Validation-only keywords with no effect on the grammar (format,
// multipleOf, title, description, default, examples, ...) are accepted and not enforced. Errors:
// kInvalidArgument "<path>: <problem>", path like "properties.address.type".
Status compile_json_schema(const nlohmann::ordered_json& schema, const GrammarLimits& limits, Grammar* out);
// Any JSON object (OpenAI json_object mode).
Status compile_json_object(const GrammarLimits& limits, Grammar* out);
// A regex that the whole output must match (guided_regex, guided_choice).
Status compile_regex_output(std::string_view pattern, const GrammarLimits& limits, Grammar* out);
// A GBNF grammar (llama.cpp's format; gbnf.cpp), its rule `root` the output. Errors:
// kInvalidArgument "<line>:<column>: <problem>".
Status compile_gbnf(std::string_view text, const GrammarLimits& limits, Grammar* out);
// The "tool_calls" spec of tessera/sdk/constraint.h.
Status compile_tool_calls(const nlohmann::ordered_json& spec, const GrammarLimits& limits, Grammar* out);

}  // namespace tessera::json_constraint
