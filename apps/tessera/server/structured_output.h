// Structured output and tool calls on /v1/chat/completions: `response_format` (text,
// json_object, json_schema), `tools` / `tool_choice` / `parallel_tool_calls`, assistant
// `tool_calls` and `role: "tool"` messages in the prompt, the constraint spec the engine's
// constraint plugin compiles (tessera/sdk/constraint.h), and the tool calls parsed back out of
// the generated text.
//
// Tools are rendered the way Hermes / Qwen2.5 templates do (and vLLM's hermes tool parser
// reads): a system prompt listing the tools as JSON inside <tools></tools>, each call as
// <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>, each tool result as a user
// turn <tool_response>\n...\n</tool_response>. Models whose chat template has no tools
// section (SmolLM2) get the same text through their ordinary roles.
#pragma once

#include <nlohmann/json.hpp>

#include <optional>
#include <string>
#include <vector>

#include "openai_protocol.h"
#include "tessera/chat_template.h"
#include "tessera/sdk/constraint.h"

namespace tessera::server {

inline constexpr const char* kToolCallBegin = "<tool_call>\n";
inline constexpr const char* kToolCallEnd = "\n</tool_call>";
inline constexpr const char* kToolCallSeparator = "\n";

struct ToolSpec {
  std::string name;
  std::string description;
  nlohmann::ordered_json parameters;  // null: any arguments object
};

enum class ToolChoice { kNone, kAuto, kRequired, kNamed };

struct StructuredOutput {
  // response_format
  std::string format = "text";  // text | json_object | json_schema
  std::string schema_name;
  nlohmann::ordered_json schema;
  bool strict = false;
  // tools
  std::vector<ToolSpec> tools;
  ToolChoice tool_choice = ToolChoice::kNone;
  std::string named_tool;
  bool parallel_tool_calls = true;

  // vLLM's guided_regex / guided_choice / guided_grammar / guided_json and structured_outputs
  // {regex, choice, grammar, json}, llama.cpp's grammar: the constraint kind and source
  // (tessera/sdk/constraint.h), and the field they came from ("guided_regex",
  // "structured_outputs.choice", ...).
  std::string guided_kind;
  std::string guided_source;
  std::string guided_param;

  bool uses_tools() const { return !tools.empty() && tool_choice != ToolChoice::kNone; }
  bool uses_guided() const { return !guided_kind.empty(); }
  bool constrained() const { return uses_tools() || uses_guided() || format != "text"; }
  // The request field a constraint error belongs to.
  std::string constraint_field() const {
    return uses_tools() ? "tools" : uses_guided() ? guided_param : "response_format";
  }
};

// Reads response_format, tools, tool_choice and parallel_tool_calls of a chat body, and the
// guided decoding fields of a chat or completions body (parsed with key order kept, so schema
// properties come out in the order the client wrote them).
std::optional<StructuredOutput> parse_structured_output(const nlohmann::ordered_json& body, ApiError* error);

// The constraint the request asks for (call only when constrained()).
ConstraintSpec constraint_spec(const StructuredOutput& so);

// A compile error of the constraint plugin, with the path turned into the request's field
// ("response_format.json_schema.schema.properties.x.type", "tools[0].function.parameters...").
ApiError constraint_error(const StructuredOutput& so, const std::string& message);

// The messages as the chat template gets them: the tools system prompt first (merged with the
// client's system message) when tools are in use, tool results as user turns (consecutive
// ones merged into one).
std::vector<ChatMessage> prepare_chat_messages(const std::vector<ChatMessage>& messages, const StructuredOutput& so);

// messages[i].tool_calls of an assistant message as the text the model would have produced,
// appended to *content. False (error filled) for a malformed call; `param` is its field path.
bool append_tool_call_text(const nlohmann::json& tool_calls, const std::string& param, std::string* content,
                           ApiError* error);

struct ParsedToolCall {
  std::string name;
  std::string arguments;  // JSON text
};

struct ParsedToolOutput {
  std::vector<ParsedToolCall> calls;  // the complete <tool_call> blocks the text starts with
  std::string rest;                   // what follows them (a block cut by max_tokens), or ""
};
// The tool calls at the start of `text`; std::nullopt when it does not start with a complete
// call (plain text, or the first call cut by max_tokens).
std::optional<ParsedToolOutput> parse_tool_calls(const std::string& text);

// Streams tool calls out of text as it is generated: holds back text that may still become a
// <tool_call>, releases plain text otherwise, and reports each call once its block is closed.
class ToolCallStream {
 public:
  struct Output {
    std::string content;                 // plain text to stream now
    std::vector<ParsedToolCall> calls;   // calls completed now
  };
  Output push(const std::string& text);
  Output flush();  // end of generation
  bool saw_calls() const { return num_calls_ > 0; }

 private:
  enum class Mode { kUndecided, kText, kCalls };
  Mode mode_ = Mode::kUndecided;
  std::string pending_;
  int num_calls_ = 0;
};

}  // namespace tessera::server
