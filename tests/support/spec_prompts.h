// Prompts for speculative-decoding tests and benchmarks: input-grounded ones (repeat or
// rewrite a passage of tests/fixtures/text, where prompt lookup finds its drafts) and free
// chat (where it rarely does).
#pragma once

#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "support/test_env.h"

namespace tessera::test {

// The sentences of the English fixture text, in order.
inline std::vector<std::string> fixture_sentences() {
  std::ifstream in(source_dir() / "tests/fixtures/text/perplexity-en.txt");
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string text = ss.str();
  std::vector<std::string> out;
  std::string cur;
  for (char c : text) {
    cur += c == '\n' ? ' ' : c;
    if (c == '.' && cur.size() > 20) {
      out.push_back(cur);
      cur.clear();
    }
  }
  return out;
}

// `count` chat-formatted prompts asking to copy or rewrite passages of 2-3 sentences.
inline std::vector<std::string> grounded_prompts(int count) {
  const auto sentences = fixture_sentences();
  const char* asks[] = {"Repeat the following text exactly.", "Rewrite the following text in plain words.",
                        "Copy this paragraph, fixing any typos.", "Summarize the following text."};
  std::vector<std::string> out;
  for (int i = 0; i < count; ++i) {
    std::string passage;
    for (int s = 0; s < 2 + i % 2; ++s) passage += sentences[(i * 2 + s) % sentences.size()];
    out.push_back("<|im_start|>user\n" + std::string(asks[i % 4]) + "\n\n" + passage +
                  "<|im_end|>\n<|im_start|>assistant\n");
  }
  return out;
}

inline std::vector<std::string> chat_prompts(int count) {
  const char* topics[] = {"the history of Rome", "how bees make honey", "a recipe for bread",
                          "the rules of chess", "why the sky is blue", "sorting algorithms",
                          "the water cycle", "how a bicycle works"};
  std::vector<std::string> out;
  for (int i = 0; i < count; ++i)
    out.push_back("<|im_start|>user\nTell me about " + std::string(topics[i % 8]) +
                  ".<|im_end|>\n<|im_start|>assistant\n");
  return out;
}

}  // namespace tessera::test
