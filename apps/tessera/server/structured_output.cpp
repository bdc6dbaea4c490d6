#include "structured_output.h"

#include <set>

#include "json_body.h"

namespace tessera::server {

using nlohmann::json;
using nlohmann::ordered_json;

namespace {

bool fail(ApiError* error, const std::string& param, const std::string& message) {
  error->param = param;
  error->message = param + ": " + message;
  return false;
}

std::string describe(const ordered_json& v) {
  // describe_json takes the unordered type; only scalars are converted (they print a value).
  if (v.is_object()) return describe_json(json::object());
  if (v.is_array()) return describe_json(json::array());
  return describe_json(json::parse(v.dump()));
}

const ordered_json* field(const ordered_json& obj, const char* key) {
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return nullptr;
  return &*it;
}

bool valid_tool_name(const std::string& name) {
  if (name.empty() || name.size() > 64) return false;
  for (char c : name)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-')) return false;
  return true;
}

bool parse_response_format(const ordered_json& body, StructuredOutput* so, ApiError* error) {
  const ordered_json* rf = field(body, "response_format");
  if (!rf) return true;
  if (!rf->is_object()) return fail(error, "response_format", "expected an object, got " + describe(*rf));
  const ordered_json* type = field(*rf, "type");
  if (!type || !type->is_string())
    return fail(error, "response_format.type", "expected one of text, json_object, json_schema");
  const std::string t = type->get<std::string>();
  if (t == "text" || t == "json_object") {
    so->format = t;
    return true;
  }
  if (t != "json_schema")
    return fail(error, "response_format.type", "expected one of text, json_object, json_schema, got \"" + t + "\"");
  so->format = t;
  const ordered_json* js = field(*rf, "json_schema");
  if (!js || !js->is_object())
    return fail(error, "response_format.json_schema", "expected an object with a schema");
  if (const ordered_json* name = field(*js, "name")) {
    if (!name->is_string()) return fail(error, "response_format.json_schema.name", "expected a string");
    so->schema_name = name->get<std::string>();
  }
  if (const ordered_json* strict = field(*js, "strict")) {
    if (!strict->is_boolean()) return fail(error, "response_format.json_schema.strict", "expected a boolean");
    so->strict = strict->get<bool>();
  }
  const ordered_json* schema = field(*js, "schema");
  if (!schema) return fail(error, "response_format.json_schema.schema", "required");
  if (!schema->is_object() && !schema->is_boolean())
    return fail(error, "response_format.json_schema.schema", "expected a JSON Schema object, got " + describe(*schema));
  so->schema = *schema;
  return true;
}

bool parse_tools(const ordered_json& body, StructuredOutput* so, ApiError* error) {
  const ordered_json* tools = field(body, "tools");
  if (tools) {
    if (!tools->is_array()) return fail(error, "tools", "expected a list of tools, got " + describe(*tools));
    if (tools->size() > 128) return fail(error, "tools", "at most 128 tools");
    std::set<std::string> names;
    for (size_t i = 0; i < tools->size(); ++i) {
      const ordered_json& t = (*tools)[i];
      const std::string param = "tools[" + std::to_string(i) + "]";
      if (!t.is_object()) return fail(error, param, "expected an object, got " + describe(t));
      const ordered_json* type = field(t, "type");
      if (!type || !type->is_string() || type->get<std::string>() != "function")
        return fail(error, param + ".type", "expected \"function\"");
      const ordered_json* fn = field(t, "function");
      if (!fn || !fn->is_object()) return fail(error, param + ".function", "expected an object");
      ToolSpec spec;
      const ordered_json* name = field(*fn, "name");
      if (!name || !name->is_string() || !valid_tool_name(name->get<std::string>()))
        return fail(error, param + ".function.name", "expected 1 to 64 letters, digits, '_' or '-'");
      spec.name = name->get<std::string>();
      if (!names.insert(spec.name).second)
        return fail(error, param + ".function.name", "\"" + spec.name + "\" is already the name of another tool");
      if (const ordered_json* d = field(*fn, "description")) {
        if (!d->is_string()) return fail(error, param + ".function.description", "expected a string");
        spec.description = d->get<std::string>();
      }
      if (const ordered_json* p = field(*fn, "parameters")) {
        if (!p->is_object())
          return fail(error, param + ".function.parameters", "expected a JSON Schema object, got " + describe(*p));
        spec.parameters = *p;
      }
      so->tools.push_back(std::move(spec));
    }
  }
  so->tool_choice = so->tools.empty() ? ToolChoice::kNone : ToolChoice::kAuto;
  if (const ordered_json* choice = field(body, "tool_choice")) {
    if (choice->is_string()) {
      const std::string c = choice->get<std::string>();
      if (c == "none") so->tool_choice = ToolChoice::kNone;
      else if (c == "auto") so->tool_choice = ToolChoice::kAuto;
      else if (c == "required") so->tool_choice = ToolChoice::kRequired;
      else return fail(error, "tool_choice", "expected none, auto, required or a function, got \"" + c + "\"");
    } else if (choice->is_object()) {
      const ordered_json* type = field(*choice, "type");
      const ordered_json* fn = field(*choice, "function");
      const ordered_json* name = fn && fn->is_object() ? field(*fn, "name") : nullptr;
      if (!type || *type != "function" || !name || !name->is_string())
        return fail(error, "tool_choice", "expected {\"type\": \"function\", \"function\": {\"name\": ...}}");
      so->tool_choice = ToolChoice::kNamed;
      so->named_tool = name->get<std::string>();
      bool found = false;
      for (const auto& t : so->tools) found |= t.name == so->named_tool;
      if (!found) return fail(error, "tool_choice.function.name", "no tool named \"" + so->named_tool + "\"");
    } else {
      return fail(error, "tool_choice", "expected a string or an object, got " + describe(*choice));
    }
    if (so->tools.empty() && so->tool_choice != ToolChoice::kNone)
      return fail(error, "tool_choice", "requires tools");
  }
  if (const ordered_json* p = field(body, "parallel_tool_calls")) {
    if (!p->is_boolean()) return fail(error, "parallel_tool_calls", "expected a boolean, got " + describe(*p));
    so->parallel_tool_calls = p->get<bool>();
  }
  return true;
}

// `text` as a regex (the constraint plugin's syntax, ECMAScript's) matching exactly it:
// ASCII punctuation escaped, control characters as \xHH.
std::string regex_literal(const std::string& text) {
  static const char* hex = "0123456789abcdef";
  std::string out;
  for (char c : text) {
    const auto u = static_cast<unsigned char>(c);
    if (u < 0x20 || u == 0x7f) {
      out += "\\x";
      out += hex[u >> 4];
      out += hex[u & 15];
      continue;
    }
    if (u < 0x80 && !std::isalnum(u)) out += '\\';
    out += c;
  }
  return out;
}

// One of the guided decoding fields.
bool parse_guided_field(const ordered_json& v, const std::string& param, const std::string& what,
                        StructuredOutput* so, ApiError* error) {
  if (what == "choice") {
    if (!v.is_array() || v.empty())
      return fail(error, param, "expected a non-empty list of strings, got " + describe(v));
    std::string pattern;
    for (size_t i = 0; i < v.size(); ++i) {
      if (!v[i].is_string())
        return fail(error, param + "[" + std::to_string(i) + "]", "expected a string, got " + describe(v[i]));
      pattern += (i ? "|" : "") + regex_literal(v[i].get<std::string>());
    }
    so->guided_kind = "regex";
    so->guided_source = "(?:" + pattern + ")";
  } else if (what == "json") {
    if (v.is_string()) {
      try {
        so->guided_source = ordered_json::parse(v.get<std::string>()).dump();
      } catch (const std::exception&) {
        return fail(error, param, "expected a JSON Schema (an object, or a string holding one)");
      }
    } else if (v.is_object() || v.is_boolean()) {
      so->guided_source = v.dump();
    } else {
      return fail(error, param, "expected a JSON Schema object, got " + describe(v));
    }
    so->guided_kind = "json_schema";
  } else {
    if (!v.is_string() || v.get<std::string>().empty())
      return fail(error, param, "expected a non-empty string, got " + describe(v));
    so->guided_kind = what;  // regex | grammar
    so->guided_source = v.get<std::string>();
  }
  so->guided_param = param;
  return true;
}

bool parse_guided(const ordered_json& body, StructuredOutput* so, ApiError* error) {
  // (field, kind of constraint) in the order a conflict is reported.
  std::vector<std::pair<std::string, const ordered_json*>> given;
  const std::pair<const char*, const char*> top[] = {
      {"guided_regex", "regex"}, {"guided_choice", "choice"}, {"guided_grammar", "grammar"},
      {"grammar", "grammar"},    {"guided_json", "json"}};
  std::vector<std::string> kinds;
  for (const auto& [name, what] : top)
    if (const ordered_json* v = field(body, name)) {
      given.push_back({name, v});
      kinds.push_back(what);
    }
  if (const ordered_json* so_field = field(body, "structured_outputs")) {
    if (!so_field->is_object())
      return fail(error, "structured_outputs", "expected an object, got " + describe(*so_field));
    for (const auto& [key, value] : so_field->items()) {
      if (value.is_null()) continue;
      if (key != "regex" && key != "choice" && key != "grammar" && key != "json")
        return fail(error, "structured_outputs." + key, "is not supported (expected regex, choice, grammar or json)");
      given.push_back({"structured_outputs." + key, &value});
      kinds.push_back(key);
    }
  }
  if (given.empty()) return true;
  if (given.size() > 1)
    return fail(error, given[1].first, "cannot be combined with " + given[0].first + " (one constraint per request)");
  if (so->format != "text")
    return fail(error, given[0].first, "cannot be combined with response_format " + so->format);
  if (so->uses_tools())
    return fail(error, given[0].first, "cannot be combined with tools unless tool_choice is \"none\"");
  return parse_guided_field(*given[0].second, given[0].first, kinds[0], so, error);
}

std::string tools_system_prompt(const std::vector<ToolSpec>& tools) {
  // Qwen2.5's (Hermes-style) tools section, word for word.
  std::string s =
      "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
      "You are provided with function signatures within <tools></tools> XML tags:\n<tools>";
  for (const auto& t : tools) {
    ordered_json fn = {{"name", t.name}};
    if (!t.description.empty()) fn["description"] = t.description;
    fn["parameters"] = t.parameters.is_null() ? ordered_json{{"type", "object"}} : t.parameters;
    s += '\n';
    s += ordered_json{{"type", "function"}, {"function", fn}}.dump(-1, ' ', false,
                                                                 ordered_json::error_handler_t::replace);
  }
  s += "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
       "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
       "<args-json-object>}\n</tool_call>";
  return s;
}

std::string call_text(const std::string& name, const ordered_json& arguments) {
  ordered_json call = {{"name", name}, {"arguments", arguments}};
  return kToolCallBegin + call.dump(-1, ' ', false, ordered_json::error_handler_t::replace) + kToolCallEnd;
}

}  // namespace

std::optional<StructuredOutput> parse_structured_output(const ordered_json& body, ApiError* error) {
  StructuredOutput so;
  if (!parse_response_format(body, &so, error)) return std::nullopt;
  if (!parse_tools(body, &so, error)) return std::nullopt;
  if (so.uses_tools() && so.format != "text")
    return fail(error, "response_format", "cannot be combined with tools unless tool_choice is \"none\""),
           std::nullopt;
  if (!parse_guided(body, &so, error)) return std::nullopt;
  return so;
}

ConstraintSpec constraint_spec(const StructuredOutput& so) {
  if (so.uses_tools()) {
    ordered_json tools = ordered_json::array();
    for (const auto& t : so.tools) {
      if (so.tool_choice == ToolChoice::kNamed && t.name != so.named_tool) continue;
      tools.push_back({{"name", t.name}, {"parameters", t.parameters}});
    }
    ordered_json spec = {{"begin", kToolCallBegin},
                         {"end", kToolCallEnd},
                         {"separator", kToolCallSeparator},
                         {"allow_text", so.tool_choice == ToolChoice::kAuto},
                         {"parallel", so.parallel_tool_calls},
                         {"tools", tools}};
    return {"tool_calls", spec.dump()};
  }
  if (so.uses_guided()) return {so.guided_kind, so.guided_source};
  if (so.format == "json_object") return {"json", ""};
  return {"json_schema", so.schema.dump()};
}

ApiError constraint_error(const StructuredOutput& so, const std::string& message) {
  std::string path = message.substr(0, message.find(": "));
  std::string rest = message.size() > path.size() ? message.substr(path.size()) : std::string();
  if (so.uses_guided()) {
    // A schema's errors start with its path; regex ("position N: ...") and grammar
    // ("line:column: ...") errors belong to the field as a whole.
    if (so.guided_kind == "json_schema" && path != "schema" && rest.size() > 2 &&
        path.find(' ') == std::string::npos && path.rfind("position", 0) != 0)
      return {so.guided_param + "." + path + rest, so.guided_param + "." + path};
    if (so.guided_kind == "json_schema" && path == "schema") return {so.guided_param + rest, so.guided_param};
    return {so.guided_param + ": " + message, so.guided_param};
  }
  if (so.uses_tools()) {
    // "tools[k].parameters..." where k counts the tools handed to the constraint.
    const auto close = path.find(']');
    if (path.rfind("tools[", 0) == 0 && close != std::string::npos) {
      size_t k = std::stoul(path.substr(6, close - 6));
      if (so.tool_choice == ToolChoice::kNamed)
        for (size_t i = 0; i < so.tools.size(); ++i)
          if (so.tools[i].name == so.named_tool) k = i;
      std::string tail = path.substr(close + 1);  // ".parameters..."
      path = "tools[" + std::to_string(k) + "].function" + tail;
    } else {
      path = "tools";
    }
  } else {
    const std::string base = "response_format.json_schema.schema";
    path = path == "schema" ? base : base + "." + path;
  }
  return {path + rest, path};
}

std::vector<ChatMessage> prepare_chat_messages(const std::vector<ChatMessage>& messages, const StructuredOutput& so) {
  std::vector<ChatMessage> out;
  size_t first = 0;
  if (so.uses_tools()) {
    std::string system = tools_system_prompt(so.tools);
    if (!messages.empty() && messages[0].role == "system") {
      system = messages[0].content + "\n\n" + system;
      first = 1;
    }
    out.push_back({"system", system});
  }
  bool last_was_tool = false;
  for (size_t i = first; i < messages.size(); ++i) {
    const ChatMessage& m = messages[i];
    if (m.role == "tool") {
      const std::string wrapped = "<tool_response>\n" + m.content + "\n</tool_response>";
      if (last_was_tool) {
        out.back().content += "\n" + wrapped;
      } else {
        out.push_back({"user", wrapped});
      }
      last_was_tool = true;
      continue;
    }
    out.push_back(m);
    last_was_tool = false;
  }
  return out;
}

bool append_tool_call_text(const json& tool_calls, const std::string& param, std::string* content, ApiError* error) {
  if (!tool_calls.is_array()) return fail(error, param, "expected a list of tool calls");
  for (size_t j = 0; j < tool_calls.size(); ++j) {
    const json& call = tool_calls[j];
    const std::string p = param + "[" + std::to_string(j) + "]";
    if (!call.is_object()) return fail(error, p, "expected an object");
    auto fn = call.find("function");
    if (fn == call.end() || !fn->is_object()) return fail(error, p + ".function", "expected an object");
    auto name = fn->find("name");
    if (name == fn->end() || !name->is_string()) return fail(error, p + ".function.name", "expected a string");
    ordered_json arguments = ordered_json::object();
    auto args = fn->find("arguments");
    if (args != fn->end() && args->is_string()) {
      try {
        arguments = ordered_json::parse(args->get<std::string>());
      } catch (const std::exception&) {
        return fail(error, p + ".function.arguments", "not valid JSON");
      }
    } else if (args != fn->end() && args->is_object()) {
      arguments = ordered_json::parse(args->dump());
    } else if (args != fn->end() && !args->is_null()) {
      return fail(error, p + ".function.arguments", "expected a JSON string");
    }
    if (!content->empty()) *content += kToolCallSeparator;
    *content += call_text(name->get<std::string>(), arguments);
  }
  return true;
}

std::optional<ParsedToolOutput> parse_tool_calls(const std::string& text) {
  const std::string begin = kToolCallBegin, end = kToolCallEnd, sep = kToolCallSeparator;
  ParsedToolOutput out;
  size_t pos = 0;
  while (text.compare(pos, begin.size(), begin) == 0) {
    const size_t close = text.find(end, pos + begin.size());
    if (close == std::string::npos) break;
    ordered_json call;
    try {
      call = ordered_json::parse(text.substr(pos + begin.size(), close - pos - begin.size()));
    } catch (const std::exception&) {
      break;
    }
    if (!call.is_object() || !call.contains("name") || !call["name"].is_string() || !call.contains("arguments") ||
        !call["arguments"].is_object())
      break;
    out.calls.push_back({call["name"].get<std::string>(),
                         call["arguments"].dump(-1, ' ', false, ordered_json::error_handler_t::replace)});
    pos = close + end.size();
    if (text.compare(pos, sep.size() + begin.size(), sep + begin) == 0) pos += sep.size();
  }
  if (out.calls.empty()) return std::nullopt;
  out.rest = text.substr(pos);
  return out;
}

ToolCallStream::Output ToolCallStream::push(const std::string& text) {
  Output out;
  pending_ += text;
  const std::string begin = kToolCallBegin, end = kToolCallEnd, sep = kToolCallSeparator;
  if (mode_ == Mode::kUndecided) {
    const size_t n = std::min(pending_.size(), begin.size());
    if (pending_.compare(0, n, begin, 0, n) != 0) {
      mode_ = Mode::kText;
    } else if (pending_.size() >= begin.size()) {
      mode_ = Mode::kCalls;
    } else {
      return out;  // may still become a call
    }
  }
  if (mode_ == Mode::kText) {
    out.content = std::move(pending_);
    pending_.clear();
    return out;
  }
  for (;;) {
    if (pending_.compare(0, sep.size(), sep) == 0 && num_calls_ > 0) pending_.erase(0, sep.size());
    if (pending_.compare(0, std::min(pending_.size(), begin.size()), begin, 0,
                         std::min(pending_.size(), begin.size())) != 0)
      break;
    const size_t close = pending_.find(end);
    if (close == std::string::npos) break;
    const std::string block = pending_.substr(0, close + end.size());
    auto parsed = parse_tool_calls(block);
    if (!parsed) break;
    for (auto& c : parsed->calls) out.calls.push_back(std::move(c));
    num_calls_ += static_cast<int>(parsed->calls.size());
    pending_.erase(0, block.size());
  }
  return out;
}

ToolCallStream::Output ToolCallStream::flush() {
  Output out;
  // Whatever did not become a complete call (cut by max_tokens) goes out as text.
  if (!(mode_ == Mode::kCalls && pending_ == kToolCallSeparator)) out.content = std::move(pending_);
  pending_.clear();
  return out;
}

}  // namespace tessera::server
