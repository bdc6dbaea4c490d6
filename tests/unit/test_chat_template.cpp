// Chat template detection and formatting, checked against the outputs llama.cpp's
// llm_chat_apply_template produces (tests/test-chat-template.cpp in llama.cpp) and against
// SmolLM2's Jinja template rendered by hand.
#include <doctest/doctest.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "support/test_env.h"
#include "tessera/chat_template.h"

using tessera::apply_chat_template;
using tessera::ChatMessage;
using tessera::detect_chat_template;

namespace {

const std::vector<ChatMessage> kConversation = {
    {"system", "You are a helpful assistant"},
    {"user", "Hello"},
    {"assistant", "Hi there"},
    {"user", "Who are you"},
    {"assistant", "   I am an assistant   "},
    {"user", "Another question"},
};

// SmolLM2-135M-Instruct's tokenizer.chat_template, as stored in its GGUF.
const std::string kSmolLm2Template =
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}";

}  // namespace

TEST_CASE("chatml, and SmolLM2's default system prompt") {
  CHECK(detect_chat_template(kSmolLm2Template) == "chatml");

  // Without a system message the template's own default is inserted.
  CHECK(apply_chat_template(kSmolLm2Template, {{"user", "Hello"}}, true) ==
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n");
  // A caller's system message replaces it.
  CHECK(apply_chat_template(kSmolLm2Template, {{"system", "Be brief."}, {"user", "Hello"}}, false) ==
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n");
  // No messages, no default (the Jinja loop would not run).
  CHECK(apply_chat_template(kSmolLm2Template, {}, true) == "<|im_start|>assistant\n");

  // Same template with Jinja-escaped newlines (as written in tokenizer_config.json).
  const std::string escaped =
      "{% if messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\nYou are Qwen, created "
      "by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
      "{{ '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}";
  CHECK(apply_chat_template(escaped, {{"user", "Hi"}}, true) ==
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
        "assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");

  // Plain chatml has no default system prompt.
  const std::string chatml =
      "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
      "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
      "{{ '<|im_start|>assistant\\n' }}{% endif %}";
  CHECK(apply_chat_template(chatml, kConversation, true) ==
        "<|im_start|>system\nYou are a helpful assistant<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n"
        "<|im_start|>assistant\nHi there<|im_end|>\n<|im_start|>user\nWho are you<|im_end|>\n"
        "<|im_start|>assistant\n   I am an assistant   <|im_end|>\n<|im_start|>user\nAnother "
        "question<|im_end|>\n<|im_start|>assistant\n");
  CHECK(apply_chat_template("chatml", {{"user", "x"}}, false) == "<|im_start|>user\nx<|im_end|>\n");
}

TEST_CASE("llama2 family") {
  // mistralai/Mistral-7B-Instruct-v0.2 style: no <<SYS>>.
  const std::string mistral =
      "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != "
      "(loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate "
      "user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'user' %}"
      "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
      "{{ message['content'] + eos_token}}{% else %}{{ raise_exception('Only user and assistant "
      "roles are supported!') }}{% endif %}{% endfor %}";
  CHECK(detect_chat_template(mistral) == "llama2");
  CHECK(apply_chat_template(mistral, kConversation, true) ==
        "[INST] You are a helpful assistant\nHello [/INST]Hi there</s>[INST] Who are you "
        "[/INST]   I am an assistant   </s>[INST] Another question [/INST]");

  // Llama-2 chat with <<SYS>> and content.strip().
  const std::string llama2 =
      "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
      "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
      "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
      "{% if loop.index0 == 0 and system_message != false %}{% set content = '<<SYS>>\\n' + "
      "system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}{% else %}{% set content = "
      "message['content'] %}{% endif %}{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' "
      "+ content.strip() + ' [/INST]' }}{% elif message['role'] == 'assistant' %}{{ ' '  + "
      "content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}";
  CHECK(detect_chat_template(llama2) == "llama2-sys-strip");
  CHECK(apply_chat_template(llama2, kConversation, true) ==
        "[INST] <<SYS>>\nYou are a helpful assistant\n<</SYS>>\n\nHello [/INST]Hi there</s>"
        "[INST] Who are you [/INST]I am an assistant</s>[INST] Another question [/INST]");
}

TEST_CASE("llama3, gemma, phi3, zephyr") {
  const std::string llama3 =
      "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
      "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ "
      "message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = "
      "bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
      "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}";
  CHECK(detect_chat_template(llama3) == "llama3");
  CHECK(apply_chat_template(llama3, kConversation, true) ==
        "<|start_header_id|>system<|end_header_id|>\n\nYou are a helpful assistant<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHello<|eot_id|><|start_header_id|>"
        "assistant<|end_header_id|>\n\nHi there<|eot_id|><|start_header_id|>user<|end_header_id|>"
        "\n\nWho are you<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nI am an "
        "assistant<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nAnother question"
        "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n");

  const std::string gemma =
      "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role "
      "not supported') }}{% endif %}{% for message in messages %}{% if (message['role'] == "
      "'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}{% endif %}"
      "{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}"
      "{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\\n'}}{% endif %}";
  CHECK(detect_chat_template(gemma) == "gemma");
  CHECK(apply_chat_template(gemma, kConversation, true) ==
        "<start_of_turn>user\nYou are a helpful assistant\n\nHello<end_of_turn>\n<start_of_turn>"
        "model\nHi there<end_of_turn>\n<start_of_turn>user\nWho are you<end_of_turn>\n"
        "<start_of_turn>model\nI am an assistant<end_of_turn>\n<start_of_turn>user\nAnother "
        "question<end_of_turn>\n<start_of_turn>model\n");

  const std::string phi3 =
      "{{ bos_token }}{% for message in messages %}{{'<|' + message['role'] + '|>' + '\\n' + "
      "message['content'] + '<|end|>\\n' }}{% endfor %}{% if add_generation_prompt %}"
      "{{ '<|assistant|>\\n' }}{% else %}{{ eos_token }}{% endif %}";
  CHECK(detect_chat_template(phi3) == "phi3");
  CHECK(apply_chat_template(phi3, {{"user", "Hello"}}, true) ==
        "<|user|>\nHello<|end|>\n<|assistant|>\n");

  const std::string zephyr =
      "{% for message in messages %}\n{% if message['role'] == 'user' %}\n{{ '<|user|>\\n' + "
      "message['content'] + eos_token }}\n{% endif %}{% endfor %}<|endoftext|>";
  CHECK(detect_chat_template(zephyr) == "zephyr");
  CHECK(apply_chat_template(zephyr, {{"user", "Hello"}}, true) ==
        "<|user|>\nHello<|endoftext|>\n<|assistant|>\n");
}

TEST_CASE("unknown templates are rejected") {
  CHECK(detect_chat_template("{{ messages }}").empty());
  CHECK_THROWS_WITH_AS(apply_chat_template("{{ messages }}", {{"user", "x"}}, true),
                       "unsupported chat template", std::runtime_error);
}
