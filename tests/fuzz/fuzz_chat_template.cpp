// Fuzz target: chat template detection and rendering. The input is split at NUL bytes into a
// template text followed by (role, content) pairs; every known template family is also tried
// by name on the same messages. Only std::runtime_error ("unsupported chat template") may
// leave the renderer.
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "fuzz_support.h"
#include "tessera/chat_template.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::vector<std::string> parts(1);
  for (size_t i = 0; i < size; ++i) {
    if (data[i] == 0) parts.emplace_back();
    else parts.back().push_back(static_cast<char>(data[i]));
  }
  std::vector<tessera::ChatMessage> messages;
  for (size_t i = 1; i + 1 < parts.size(); i += 2) messages.push_back({parts[i], parts[i + 1]});
  static const char* kNames[] = {"", "chatml", "llama2", "llama2-sys", "llama3", "gemma",
                                 "phi3", "zephyr", "mistral-v7", "deepseek"};
  for (const char* name : kNames) {
    const std::string text = *name ? std::string(name) : parts[0];
    (void)tessera::detect_chat_template(text);
    try {
      const std::string plain = tessera::apply_chat_template(text, messages, false);
      const std::string prompted = tessera::apply_chat_template(text, messages, true);
      // The generation prompt is the assistant header appended after the same turns.
      FUZZ_CHECK(prompted.compare(0, plain.size(), plain) == 0);
    } catch (const std::runtime_error&) {
    }
  }
  return 0;
}
