// The OpenAI request bodies `tessera serve` accepts, parsed and validated into a
// GenerationSpec, and the stop-string filter that keeps stop strings out of the output.
//
// Policy on fields (documented in docs/server.md): like OpenAI, unknown fields are ignored so
// that newer clients keep working; known fields with a wrong type or out of range are a 400
// naming the field; known fields whose feature this server lacks (logit_bias, functions,
// suffix, best_of > n) are a 400 too, rather than silently producing something the client
// did not ask for. response_format and tools are read by structured_output.h.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "tessera/chat_template.h"
#include "tessera/config.h"
#include "tessera/sdk/types.h"

namespace tessera::server {

enum class ApiKind { kCompletion, kChat };

// A request that failed validation: the message and the offending field for the error body.
struct ApiError {
  std::string message;
  std::string param;
};

// One completions prompt: text, or token ids as given.
struct PromptInput {
  std::optional<std::string> text;
  std::vector<int32_t> ids;
};

// A batch of prompts in one completions request is limited to this many.
inline constexpr int kMaxPromptsPerRequest = 256;

struct GenerationSpec {
  ApiKind kind = ApiKind::kCompletion;
  std::string model;
  // Completions: one or more prompts (choice index = prompt index * n + sample index, as at
  // OpenAI). Chat: the messages.
  std::vector<PromptInput> prompts;
  std::vector<ChatMessage> messages;
  // Completions: special-token text in the prompt ("<|im_start|>") becomes that token, as
  // llama.cpp's and vLLM's tokenizers do; false treats it as plain text.
  bool parse_special = true;
  SamplingParams params;
  bool max_tokens_given = false;  // otherwise the caller picks a default
  int32_t n = 1;
  std::vector<std::string> stop;
  bool stream = false;
  bool include_usage = false;    // stream_options.include_usage
  bool logprobs = false;         // report logprobs of chosen tokens
  int32_t top_logprobs = 0;      // and this many alternatives per token
  // Completions: the prompt is prepended to each choice's text (and, with logprobs, its
  // tokens to the logprobs: the first one with null, as at OpenAI).
  bool echo = false;
  // What the engine computes for each prompt (GenerationRequest::prompt_logprobs): -1 none,
  // else the alternatives per prompt token. Set with echo + logprobs, and for max_tokens 0.
  int32_t prompt_logprobs = -1;
  std::string user;              // the client's end-user id ("" when not given)
};

// server.defaults: each sampling field the body omits (absent or null) is set to the
// configured default, so it is validated and applied as if the client had sent it.
void apply_request_defaults(const RequestDefaults& defaults, ApiKind kind, nlohmann::json* body);

// Parses a JSON body already known to be an object. Returns std::nullopt and fills *error on
// the first problem found.
std::optional<GenerationSpec> parse_generation_request(const nlohmann::json& body, ApiKind kind, ApiError* error);

// The `messages` field of a chat body (also /tokenize's chat form).
bool parse_chat_messages(const nlohmann::json& body, std::vector<ChatMessage>* messages, ApiError* error);

// Holds back decoded text that could be the beginning of a stop string, and cuts the output
// at the first stop string (which is never released). Text is matched on the decoded string,
// so a stop string spanning several tokens is found.
class StopStringFilter {
 public:
  explicit StopStringFilter(std::vector<std::string> stops);
  // Appends `text`; returns what can be released now.
  std::string push(std::string_view text);
  // End of generation without a stop string: everything held back.
  std::string flush();
  bool matched() const { return matched_; }
  // Bytes released so far (the text before the stop string once matched).
  size_t released() const { return released_; }

 private:
  std::vector<std::string> stops_;
  size_t max_stop_len_ = 0;
  std::string pending_;
  size_t released_ = 0;
  bool matched_ = false;
};

// POST /v1/embeddings: `input` in completions' four prompt forms (at most max_inputs items;
// strings must not be empty), `model` required, `encoding_format` "float" (default) or
// "base64", `dimensions` (checked against the model by the caller), `user` (ignored).
struct EmbeddingsSpec {
  std::string model;
  std::vector<PromptInput> inputs;
  bool base64 = false;
  std::optional<int32_t> dimensions;
  std::string user;
};
std::optional<EmbeddingsSpec> parse_embeddings_request(const nlohmann::json& body, int max_inputs, ApiError* error);

}  // namespace tessera::server
