// Structured output and tool calls in `tessera serve`, without a socket or a model:
// response_format / tools parsing and its errors, the prompt rendering of tools and tool
// messages, the constraint spec, compile errors mapped to request fields, and tool calls
// parsed back out of text, whole and streamed.
#include <doctest/doctest.h>

#include "server/openai_protocol.h"
#include "server/structured_output.h"

using nlohmann::json;
using nlohmann::ordered_json;
using namespace tessera;
using namespace tessera::server;

namespace {

const char* kTools = R"([
  {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
   "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
                  "required": ["city"]}}},
  {"type": "function", "function": {"name": "noop"}}])";

std::optional<StructuredOutput> parse(const std::string& body, ApiError* error) {
  return parse_structured_output(ordered_json::parse(body), error);
}

std::string error_param(const std::string& body) {
  ApiError e;
  CHECK_FALSE(parse(body, &e).has_value());
  CHECK(e.message.rfind(e.param + ": ", 0) == 0);
  return e.param;
}

}  // namespace

TEST_CASE("response_format and tools are read, with OpenAI's defaults") {
  ApiError e;
  auto none = parse("{}", &e);
  REQUIRE(none);
  CHECK_FALSE(none->constrained());
  auto schema = parse(R"({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "strict": true,
                          "schema": {"type": "object", "properties": {"z": {}, "a": {}}}}}})", &e);
  REQUIRE(schema);
  CHECK(schema->format == "json_schema");
  CHECK(schema->strict);
  const ConstraintSpec spec = constraint_spec(*schema);
  CHECK(spec.kind == "json_schema");
  CHECK(spec.source.find("\"z\"") < spec.source.find("\"a\""));  // key order kept
  auto tools = parse(std::string(R"({"tools": )") + kTools + "}", &e);
  REQUIRE(tools);
  CHECK(tools->tool_choice == ToolChoice::kAuto);  // the default with tools
  CHECK(tools->parallel_tool_calls);
  const ConstraintSpec t = constraint_spec(*tools);
  CHECK(t.kind == "tool_calls");
  const json source = json::parse(t.source);
  CHECK(source["allow_text"] == true);
  CHECK(source["tools"].size() == 2);
  auto named = parse(std::string(R"({"tool_choice": {"type": "function", "function": {"name": "noop"}},
                                     "parallel_tool_calls": false, "tools": )") + kTools + "}", &e);
  REQUIRE(named);
  const json n = json::parse(constraint_spec(*named).source);
  CHECK(n["tools"].size() == 1);
  CHECK(n["tools"][0]["name"] == "noop");
  CHECK(n["parallel"] == false);
  CHECK(n["allow_text"] == false);
  auto off = parse(std::string(R"({"tool_choice": "none", "tools": )") + kTools + "}", &e);
  REQUIRE(off);
  CHECK_FALSE(off->constrained());
}

TEST_CASE("bad response_format and tools name the field") {
  CHECK(error_param(R"({"response_format": {"type": "xml"}})") == "response_format.type");
  CHECK(error_param(R"({"response_format": {"type": "json_schema"}})") == "response_format.json_schema");
  CHECK(error_param(R"({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}})") ==
        "response_format.json_schema.schema");
  CHECK(error_param(R"({"tools": {}})") == "tools");
  CHECK(error_param(R"({"tools": [{"type": "function", "function": {"name": "a b"}}]})") == "tools[0].function.name");
  CHECK(error_param(R"({"tools": [{"type": "retrieval"}]})") == "tools[0].type");
  CHECK(error_param(std::string(R"({"tools": )") + kTools + R"(, "tool_choice": "always"})") == "tool_choice");
  CHECK(error_param(std::string(R"({"tools": )") + kTools +
                    R"(, "tool_choice": {"type": "function", "function": {"name": "nope"}}})") ==
        "tool_choice.function.name");
  CHECK(error_param(R"({"tool_choice": "required"})") == "tool_choice");
  CHECK(error_param(std::string(R"({"tools": )") + kTools + R"(, "response_format": {"type": "json_object"}})") ==
        "response_format");
  CHECK(error_param(R"({"tools": [{"type": "function", "function": {"name": "a"}},
                                  {"type": "function", "function": {"name": "a"}}]})") == "tools[1].function.name");
}

TEST_CASE("compile errors become request fields") {
  ApiError e;
  auto schema = parse(R"({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {}}}})", &e);
  REQUIRE(schema);
  ApiError a = constraint_error(*schema, "properties.age.type: unknown type \"int\"");
  CHECK(a.param == "response_format.json_schema.schema.properties.age.type");
  CHECK(a.message == "response_format.json_schema.schema.properties.age.type: unknown type \"int\"");
  CHECK(constraint_error(*schema, "schema: the schema false allows no value").param ==
        "response_format.json_schema.schema");
  auto named = parse(std::string(R"({"tool_choice": {"type": "function", "function": {"name": "noop"}}, "tools": )") +
                         kTools + "}",
                     &e);
  REQUIRE(named);
  // The constraint saw only the named tool (its index 0); the request's index is 1.
  CHECK(constraint_error(*named, "tools[0].parameters.type: unknown type \"x\"").param ==
        "tools[1].function.parameters.type");
}

TEST_CASE("tools and tool messages are rendered Hermes-style through ordinary roles") {
  ApiError e;
  auto so = parse(std::string(R"({"tools": )") + kTools + "}", &e);
  REQUIRE(so);
  std::vector<ChatMessage> msgs = {{"system", "Be brief."}, {"user", "Weather in Oslo?"},
                                   {"assistant", ""}, {"tool", "{\"t\": -3}"}, {"tool", "ok"}};
  json calls = json::parse(R"([{"id": "c1", "type": "function",
                               "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}])");
  REQUIRE(append_tool_call_text(calls, "messages[2].tool_calls", &msgs[2].content, &e));
  CHECK(msgs[2].content == "<tool_call>\n{\"name\":\"get_weather\",\"arguments\":{\"city\":\"Oslo\"}}\n</tool_call>");
  const auto out = prepare_chat_messages(msgs, *so);
  REQUIRE(out.size() == 4);
  CHECK(out[0].role == "system");
  CHECK(out[0].content.rfind("Be brief.\n\n# Tools", 0) == 0);
  CHECK(out[0].content.find("<tools>\n{\"type\":\"function\",\"function\":{\"name\":\"get_weather\"") !=
        std::string::npos);
  CHECK(out[3].role == "user");
  CHECK(out[3].content == "<tool_response>\n{\"t\": -3}\n</tool_response>\n<tool_response>\nok\n</tool_response>");
  // Without tools in use no tools prompt; tool messages still render.
  const auto plain = prepare_chat_messages(msgs, StructuredOutput{});
  CHECK(plain[0].content == "Be brief.");
  json bad = json::parse(R"([{"function": {"name": "f", "arguments": "{oops"}}])");
  std::string content;
  CHECK_FALSE(append_tool_call_text(bad, "messages[1].tool_calls", &content, &e));
  CHECK(e.param == "messages[1].tool_calls[0].function.arguments");
}

TEST_CASE("chat messages take the tool role and assistant tool_calls without content") {
  ApiError e;
  auto spec = parse_generation_request(json::parse(R"({"model": "m", "messages": [
      {"role": "user", "content": "hi"},
      {"role": "assistant", "content": null, "tool_calls": [{"id": "c", "type": "function",
                                                             "function": {"name": "f", "arguments": "{}"}}]},
      {"role": "tool", "tool_call_id": "c", "content": "42"}]})"),
                                       ApiKind::kChat, &e);
  REQUIRE_MESSAGE(spec, e.message);
  CHECK(spec->messages[1].content == "<tool_call>\n{\"name\":\"f\",\"arguments\":{}}\n</tool_call>");
  CHECK(spec->messages[2].role == "tool");
  CHECK_FALSE(parse_generation_request(
      json::parse(R"({"model": "m", "messages": [{"role": "tool", "content": "42"}]})"), ApiKind::kChat, &e));
  CHECK(e.param == "messages[0].tool_call_id");
  CHECK_FALSE(parse_generation_request(
      json::parse(R"({"model": "m", "prompt": "x", "tools": [{"type": "function"}]})"), ApiKind::kCompletion, &e));
  CHECK(e.param == "tools");
}

TEST_CASE("tool calls are parsed back out of the text, whole and streamed") {
  const std::string one = "<tool_call>\n{\"name\": \"a\", \"arguments\": {\"x\": 1}}\n</tool_call>";
  const std::string two = one + "\n<tool_call>\n{\"name\": \"b\", \"arguments\": {}}\n</tool_call>";
  auto p = parse_tool_calls(two);
  REQUIRE(p);
  REQUIRE(p->calls.size() == 2);
  CHECK(p->calls[0].name == "a");
  CHECK(p->calls[0].arguments == "{\"x\":1}");
  CHECK(p->calls[1].name == "b");
  CHECK(p->rest.empty());
  auto cut = parse_tool_calls(one + "\n<tool_call>\n{\"name\": \"b\", \"argu");
  REQUIRE(cut);
  CHECK(cut->calls.size() == 1);
  CHECK(cut->rest == "<tool_call>\n{\"name\": \"b\", \"argu");  // the separator went with the call
  CHECK_FALSE(parse_tool_calls("Sure! <tool_call>"));
  CHECK_FALSE(parse_tool_calls("<tool_call>\n{\"name\": \"a\""));

  // Streamed in small pieces: nothing until a block closes, then the call.
  ToolCallStream s;
  std::vector<ParsedToolCall> calls;
  std::string content;
  for (size_t i = 0; i < two.size(); i += 5) {
    auto out = s.push(two.substr(i, 5));
    content += out.content;
    for (auto& c : out.calls) calls.push_back(c);
  }
  auto rest = s.flush();
  CHECK((content + rest.content).empty());
  REQUIRE(calls.size() == 2);
  CHECK(calls[1].name == "b");
  CHECK(s.saw_calls());
  // Plain text is released as soon as it cannot be a call; a prefix of the tag is held.
  ToolCallStream text;
  CHECK(text.push("<to").content.empty());
  CHECK(text.push("o late").content == "<too late");
  CHECK(text.push(" indeed").content == " indeed");
  ToolCallStream cut_stream;
  CHECK(cut_stream.push("<tool").content.empty());
  CHECK(cut_stream.flush().content == "<tool");  // ended (max_tokens): what was held goes out
}

TEST_CASE("guided decoding fields: vLLM's guided_* and structured_outputs, llama.cpp's grammar") {
  ApiError e;
  auto regex = parse(R"({"guided_regex": "\\d+"})", &e);
  REQUIRE(regex);
  CHECK(regex->constrained());
  CHECK(regex->constraint_field() == "guided_regex");
  CHECK(constraint_spec(*regex).kind == "regex");
  CHECK(constraint_spec(*regex).source == "\\d+");
  // A choice is a regex of the strings, every punctuation character escaped.
  auto choice = parse(R"({"structured_outputs": {"choice": ["a.b", "c(d)?"]}})", &e);
  REQUIRE(choice);
  CHECK(constraint_spec(*choice).kind == "regex");
  CHECK(constraint_spec(*choice).source == "(?:a\\.b|c\\(d\\)\\?)");
  CHECK(choice->constraint_field() == "structured_outputs.choice");
  auto grammar = parse(R"({"grammar": "root ::= \"a\"\n"})", &e);
  REQUIRE(grammar);
  CHECK(constraint_spec(*grammar).kind == "grammar");
  auto js = parse(R"({"guided_json": "{\"type\": \"object\", \"properties\": {\"z\": {}, \"a\": {}}}"})", &e);
  REQUIRE(js);
  CHECK(constraint_spec(*js).kind == "json_schema");
  CHECK(constraint_spec(*js).source.find("\"z\"") < constraint_spec(*js).source.find("\"a\""));
  // Errors: the field, and the position or line:column of the plugin's message.
  CHECK(constraint_error(*regex, "position 1: missing ')'").message == "guided_regex: position 1: missing ')'");
  CHECK(constraint_error(*grammar, "1:10: undefined rule 'x'").param == "grammar");
  CHECK(constraint_error(*js, "properties.z.pattern: position 0: missing ')'").param == "guided_json.properties.z.pattern");
  CHECK(error_param(R"({"guided_regex": "a", "guided_choice": ["a"]})") == "guided_choice");
  CHECK(error_param(R"({"guided_choice": []})") == "guided_choice");
  CHECK(error_param(R"({"guided_choice": ["a", 1]})") == "guided_choice[1]");
  CHECK(error_param(R"({"guided_regex": 5})") == "guided_regex");
  CHECK(error_param(R"({"structured_outputs": {"yaml": "x"}})") == "structured_outputs.yaml");
  CHECK(error_param(R"({"guided_grammar": "root ::= \"a\"", "response_format": {"type": "json_object"}})") ==
        "guided_grammar");
  CHECK(error_param(std::string(R"({"guided_regex": "a", "tools": )") + kTools + "}") == "guided_regex");
}
