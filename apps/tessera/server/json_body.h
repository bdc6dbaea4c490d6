// Request bodies into JSON values without any step a hostile body can blow up: the nesting
// depth is bounded (so neither building nor later walking or printing a value recurses
// without bound), and every failure of the JSON library — syntax errors, numbers that do not
// fit a double (`1e400`) — comes back as an error naming where in the body it happened,
// never as an exception.
#pragma once

#include <nlohmann/json.hpp>

#include <optional>
#include <string>
#include <string_view>

namespace tessera::server {

// Arrays and objects nested deeper than this are refused. OpenAI request bodies need a
// handful of levels (JSON Schemas in tools or response_format perhaps a few dozen).
inline constexpr int kMaxJsonDepth = 64;

struct JsonBodyError {
  std::string message;  // starts with the field path when there is one
  std::string param;    // the field path ("max_tokens", "messages[0].content"), may be empty
};

// Parses `body` (strictly: one value, nothing after it). On failure returns std::nullopt and
// fills *error.
std::optional<nlohmann::json> parse_json_body(std::string_view body, JsonBodyError* error,
                                              int max_depth = kMaxJsonDepth);

// A short description of a value for error messages: its type, and for numbers and short
// strings the value. Never prints a whole array or object (which may be large).
std::string describe_json(const nlohmann::json& v);

}  // namespace tessera::server
