// Chat templates without a Jinja engine: like llama.cpp's legacy llm_chat_apply_template, the
// template family is detected from distinctive substrings of the model's Jinja text (or given
// by name: "chatml", "llama2", "llama3", "gemma", "phi3", "zephyr", ...) and formatted natively.
//
// Thread-safety: pure functions.
#pragma once

#include <string>
#include <vector>

namespace tessera {

struct ChatMessage {
  std::string role;
  std::string content;
};

// Formats `msgs` the way the model's template would. When the template text carries a default
// system prompt (SmolLM2's "You are a helpful AI assistant named SmolLM, ..."; Qwen2.5's) and
// the first message is not a system message, that prompt is inserted first, as the Jinja
// template does. With add_generation_prompt the assistant turn header is appended.
// Throws std::runtime_error("unsupported chat template") for an unrecognized template.
std::string apply_chat_template(const std::string& template_text,
                                const std::vector<ChatMessage>& msgs, bool add_generation_prompt);

// The detected family name ("chatml", "llama2-sys", "llama3", "gemma", ...) or "" if none.
std::string detect_chat_template(const std::string& template_text);

}  // namespace tessera
