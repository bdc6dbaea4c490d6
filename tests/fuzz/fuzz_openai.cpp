// Fuzz target: the OpenAI request parsing of `tessera serve`. The input is a request body:
// the bounded JSON parser (parse_json_body), then every reader of a parsed body (completions,
// chat, the messages of /tokenize). Nothing may throw. The parser is also checked against
// nlohmann's own json::parse: where ours accepts a body, json::parse gives the same value;
// where ours refuses one for anything but its depth limit, json::parse refuses it too.
#include <nlohmann/json.hpp>

#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "fuzz_support.h"

#include "server/json_body.h"
#include "server/openai_protocol.h"


extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace tessera::server;
  using nlohmann::json;
  const std::string_view body(reinterpret_cast<const char*>(data), size);
  JsonBodyError error;
  const auto parsed = parse_json_body(body, &error);
  const bool depth_refusal = !parsed && error.message.find("nested deeper than") != std::string::npos;
  if (!depth_refusal) {
    bool library_ok = true;
    json reference;
    try {
      reference = json::parse(body);
    } catch (const json::exception&) {
      library_ok = false;
    }
    FUZZ_CHECK(library_ok == parsed.has_value());
    if (parsed) FUZZ_CHECK(reference == *parsed);
  }
  if (!parsed) {
    FUZZ_CHECK(!error.message.empty());
    FUZZ_CHECK(error.message.size() < 1000);  // bounded, whatever the body
    return 0;
  }
  (void)describe_json(*parsed);
  if (!parsed->is_object()) return 0;
  for (ApiKind kind : {ApiKind::kCompletion, ApiKind::kChat}) {
    ApiError api_error;
    const auto spec = parse_generation_request(*parsed, kind, &api_error);
    if (!spec) {
      FUZZ_CHECK(!api_error.message.empty());
      // Messages start with the field they name.
      if (!api_error.param.empty()) FUZZ_CHECK(api_error.message.rfind(api_error.param, 0) == 0);
      continue;
    }
    FUZZ_CHECK(spec->n >= 1);
    if (kind == ApiKind::kCompletion) {
      FUZZ_CHECK(!spec->prompts.empty() && spec->prompts.size() <= static_cast<size_t>(kMaxPromptsPerRequest));
      for (const auto& p : spec->prompts) FUZZ_CHECK(p.text ? !p.text->empty() : !p.ids.empty());
    } else {
      FUZZ_CHECK(!spec->messages.empty());
    }
  }
  std::vector<tessera::ChatMessage> messages;
  ApiError api_error;
  (void)parse_chat_messages(*parsed, &messages, &api_error);
  return 0;
}
