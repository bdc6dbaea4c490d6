// Chat template detection and formatting, after llama.cpp's src/llama-chat.cpp
// (llm_chat_detect_template / llm_chat_apply_template). Detection runs in llama.cpp's order,
// because several families share markers (e.g. phi3 and falcon3 both use "<|assistant|>").
#include "tessera/chat_template.h"

#include <algorithm>
#include <cctype>
#include <map>
#include <stdexcept>
#include <string_view>

namespace tessera {

namespace {

enum class Family {
  kUnknown, kChatml, kPhi4, kSmolvlm, kMistralV7, kMistralV7Tekken, kMistralV1, kMistralV3,
  kMistralV3Tekken, kLlama2, kLlama2Sys, kLlama2SysBos, kLlama2SysStrip, kPhi3, kChatglm4,
  kFalcon3, kGlmedge, kZephyr, kMonarch, kGemma, kOrion, kOpenchat, kVicuna, kVicunaOrca,
  kDeepseek, kCommandR, kLlama3, kChatglm3, kMinicpm, kDeepseek2, kDeepseek3, kExaone3,
  kExaone4, kRwkvWorld, kGranite, kGigachat, kMegrez, kYandex, kBailing, kLlama4, kDots1,
  kHunyuanMoe, kHunyuanDense, kKimiK2,
};

const std::map<std::string, Family, std::less<>>& families_by_name() {
  static const std::map<std::string, Family, std::less<>> kNames = {
      {"chatml", Family::kChatml},           {"llama2", Family::kLlama2},
      {"llama2-sys", Family::kLlama2Sys},    {"llama2-sys-bos", Family::kLlama2SysBos},
      {"llama2-sys-strip", Family::kLlama2SysStrip},
      {"mistral-v1", Family::kMistralV1},    {"mistral-v3", Family::kMistralV3},
      {"mistral-v3-tekken", Family::kMistralV3Tekken},
      {"mistral-v7", Family::kMistralV7},    {"mistral-v7-tekken", Family::kMistralV7Tekken},
      {"phi3", Family::kPhi3},               {"phi4", Family::kPhi4},
      {"falcon3", Family::kFalcon3},         {"zephyr", Family::kZephyr},
      {"monarch", Family::kMonarch},         {"gemma", Family::kGemma},
      {"orion", Family::kOrion},             {"openchat", Family::kOpenchat},
      {"vicuna", Family::kVicuna},           {"vicuna-orca", Family::kVicunaOrca},
      {"deepseek", Family::kDeepseek},       {"deepseek2", Family::kDeepseek2},
      {"deepseek3", Family::kDeepseek3},     {"command-r", Family::kCommandR},
      {"llama3", Family::kLlama3},           {"chatglm3", Family::kChatglm3},
      {"chatglm4", Family::kChatglm4},       {"glmedge", Family::kGlmedge},
      {"minicpm", Family::kMinicpm},         {"exaone3", Family::kExaone3},
      {"exaone4", Family::kExaone4},         {"rwkv-world", Family::kRwkvWorld},
      {"granite", Family::kGranite},         {"gigachat", Family::kGigachat},
      {"megrez", Family::kMegrez},           {"yandex", Family::kYandex},
      {"bailing", Family::kBailing},         {"llama4", Family::kLlama4},
      {"smolvlm", Family::kSmolvlm},         {"hunyuan-moe", Family::kHunyuanMoe},
      {"hunyuan-dense", Family::kHunyuanDense}, {"kimi-k2", Family::kKimiK2},
  };
  return kNames;
}

Family detect(const std::string& tmpl) {
  if (auto it = families_by_name().find(tmpl); it != families_by_name().end()) return it->second;
  auto has = [&](std::string_view s) { return tmpl.find(s) != std::string::npos; };

  if (has("<|im_start|>")) {
    if (has("<|im_sep|>")) return Family::kPhi4;
    // SmolVLM uses <|im_start|> as BOS, but it is not chatml.
    if (has("<end_of_utterance>")) return Family::kSmolvlm;
    return Family::kChatml;
  }
  if (tmpl.rfind("mistral", 0) == 0 || has("[INST]")) {
    if (has("[SYSTEM_PROMPT]")) return Family::kMistralV7;
    if (has("' [INST] ' + system_message") || has("[AVAILABLE_TOOLS]")) {
      if (has(" [INST]")) return Family::kMistralV1;
      if (has("\"[INST]\"")) return Family::kMistralV3Tekken;
      return Family::kMistralV3;
    }
    if (has("content.strip()")) return Family::kLlama2SysStrip;
    if (has("bos_token + '[INST]")) return Family::kLlama2SysBos;
    if (has("<<SYS>>")) return Family::kLlama2Sys;
    return Family::kLlama2;
  }
  if (has("<|assistant|>") && has("<|end|>")) return Family::kPhi3;
  if (has("[gMASK]<sop>")) return Family::kChatglm4;
  if (has("<|assistant|>") && has("<|user|>")) return has("</s>") ? Family::kFalcon3 : Family::kGlmedge;
  if (has("<|{{ item['role'] }}|>") && has("<|begin_of_image|>")) return Family::kGlmedge;
  if (has("<|user|>") && has("<|endoftext|>")) return Family::kZephyr;
  if (has("bos_token + message['role']")) return Family::kMonarch;
  if (has("<start_of_turn>")) return Family::kGemma;
  if (has("'\\n\\nAssistant: ' + eos_token")) return Family::kOrion;
  if (has("GPT4 Correct ")) return Family::kOpenchat;
  if (has("USER: ") && has("ASSISTANT: ")) return has("SYSTEM: ") ? Family::kVicunaOrca : Family::kVicuna;
  if (has("### Instruction:") && has("<|EOT|>")) return Family::kDeepseek;
  if (has("<|START_OF_TURN_TOKEN|>") && has("<|USER_TOKEN|>")) return Family::kCommandR;
  if (has("<|start_header_id|>") && has("<|end_header_id|>")) return Family::kLlama3;
  if (has("[gMASK]sop")) return Family::kChatglm3;
  if (has("<\xE7\x94\xA8\xE6\x88\xB7>")) return Family::kMinicpm;  // "<用户>"
  if (has("'Assistant: ' + message['content'] + eos_token")) return Family::kDeepseek2;
  if (has("<\xEF\xBD\x9C" "Assistant\xEF\xBD\x9C>") && has("<\xEF\xBD\x9C" "User\xEF\xBD\x9C>") &&
      has("<\xEF\xBD\x9C" "end\xE2\x96\x81of\xE2\x96\x81sentence\xEF\xBD\x9C>")) {
    return Family::kDeepseek3;
  }
  if (has("[|system|]") && has("[|assistant|]") && has("[|endofturn|]")) {
    return has("[|tool|]") ? Family::kExaone4 : Family::kExaone3;
  }
  if (has("rwkv-world") || has("{{- 'User: ' + message['content']|trim + '\\n\\n' -}}")) return Family::kRwkvWorld;
  if (has("<|start_of_role|>")) return Family::kGranite;
  if (has("message['role'] + additional_special_tokens[0] + message['content'] + additional_special_tokens[1]")) {
    return Family::kGigachat;
  }
  if (has("<|role_start|>")) return Family::kMegrez;
  if (has(" \xD0\x90\xD1\x81\xD1\x81\xD0\xB8\xD1\x81\xD1\x82\xD0\xB5\xD0\xBD\xD1\x82:")) return Family::kYandex;  // " Ассистент:"
  if (has("<role>ASSISTANT</role>") && has("'HUMAN'")) return Family::kBailing;
  if (has("<|header_start|>") && has("<|header_end|>")) return Family::kLlama4;
  if (has("<|endofuserprompt|>")) return Family::kDots1;
  if (has("<|startoftext|>") && has("<|extra_4|>")) return Family::kHunyuanMoe;
  if (has("<|im_assistant|>assistant<|im_middle|>")) return Family::kKimiK2;
  return Family::kUnknown;
}

std::string trim(const std::string& s) {
  size_t start = 0, end = s.size();
  while (start < end && std::isspace(static_cast<unsigned char>(s[start]))) start++;
  while (end > start && std::isspace(static_cast<unsigned char>(s[end - 1]))) end--;
  return s.substr(start, end - start);
}

// Finds a default system prompt written as a string literal in a chatml template, e.g.
//   {{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, ...<|im_end|>\n' }}
// The literal must hold fixed text between the system header and <|im_end|>; a header that is
// concatenated with messages[0]['content'] does not qualify.
std::string find_default_system_prompt(const std::string& tmpl) {
  static const std::string kHeader = "<|im_start|>system";
  static const std::string kEnd = "<|im_end|>";
  for (size_t pos = tmpl.find(kHeader); pos != std::string::npos; pos = tmpl.find(kHeader, pos + 1)) {
    if (pos == 0) continue;
    const char quote = tmpl[pos - 1];
    if (quote != '\'' && quote != '"') continue;
    size_t body = pos + kHeader.size();
    if (tmpl.compare(body, 1, "\n") == 0) {
      body += 1;
    } else if (tmpl.compare(body, 2, "\\n") == 0) {
      body += 2;
    } else {
      continue;
    }
    const size_t end = tmpl.find(kEnd, body);
    if (end == std::string::npos) continue;
    const std::string raw = tmpl.substr(body, end - body);
    // Unescape Jinja string escapes; an unescaped closing quote means the literal ended early.
    std::string text;
    bool ok = true;
    for (size_t i = 0; i < raw.size(); ++i) {
      const char c = raw[i];
      if (c == quote) { ok = false; break; }
      if (c != '\\' || i + 1 == raw.size()) { text.push_back(c); continue; }
      const char e = raw[++i];
      switch (e) {
        case 'n': text.push_back('\n'); break;
        case 't': text.push_back('\t'); break;
        case 'r': text.push_back('\r'); break;
        default: text.push_back(e); break;  // \\ \' \"
      }
    }
    if (!ok || text.empty() || text.find("{{") != std::string::npos || text.find("{%") != std::string::npos) {
      continue;
    }
    return text;
  }
  return {};
}

std::string format(Family family, const std::vector<ChatMessage>& chat, bool add_ass) {
  std::string ss;
  switch (family) {
    case Family::kChatml:
      for (const auto& m : chat) ss += "<|im_start|>" + m.role + "\n" + m.content + "<|im_end|>\n";
      if (add_ass) ss += "<|im_start|>assistant\n";
      break;
    case Family::kPhi4:
      for (const auto& m : chat) ss += "<|im_start|>" + m.role + "<|im_sep|>" + m.content + "<|im_end|>";
      if (add_ass) ss += "<|im_start|>assistant<|im_sep|>";
      break;
    case Family::kMistralV7:
    case Family::kMistralV7Tekken: {
      const std::string sp = family == Family::kMistralV7 ? " " : "";
      for (const auto& m : chat) {
        if (m.role == "system") ss += "[SYSTEM_PROMPT]" + sp + m.content + "[/SYSTEM_PROMPT]";
        else if (m.role == "user") ss += "[INST]" + sp + m.content + "[/INST]";
        else ss += sp + m.content + "</s>";
      }
      break;
    }
    case Family::kMistralV1:
    case Family::kMistralV3:
    case Family::kMistralV3Tekken: {
      const std::string leading = family == Family::kMistralV1 ? " " : "";
      const std::string trailing = family == Family::kMistralV3Tekken ? "" : " ";
      const bool trim_assistant = family == Family::kMistralV3;
      bool inside_turn = false;
      for (const auto& m : chat) {
        if (!inside_turn) {
          ss += leading + "[INST]" + trailing;
          inside_turn = true;
        }
        if (m.role == "system") {
          ss += m.content + "\n\n";
        } else if (m.role == "user") {
          ss += m.content + leading + "[/INST]";
        } else {
          ss += trailing + (trim_assistant ? trim(m.content) : m.content) + "</s>";
          inside_turn = false;
        }
      }
      break;
    }
    case Family::kLlama2:
    case Family::kLlama2Sys:
    case Family::kLlama2SysBos:
    case Family::kLlama2SysStrip: {
      const bool support_system = family != Family::kLlama2;
      const bool bos_inside_history = family == Family::kLlama2SysBos;
      const bool strip = family == Family::kLlama2SysStrip;
      bool inside_turn = true;  // no BOS before the first turn
      ss += "[INST] ";
      for (const auto& m : chat) {
        const std::string content = strip ? trim(m.content) : m.content;
        if (!inside_turn) {
          inside_turn = true;
          ss += bos_inside_history ? "<s>[INST] " : "[INST] ";
        }
        if (m.role == "system") {
          // Without <<SYS>> support the system text still leads the first turn.
          ss += support_system ? "<<SYS>>\n" + content + "\n<</SYS>>\n\n" : content + "\n";
        } else if (m.role == "user") {
          ss += content + " [/INST]";
        } else {
          ss += content + "</s>";
          inside_turn = false;
        }
      }
      break;
    }
    case Family::kPhi3:
      for (const auto& m : chat) ss += "<|" + m.role + "|>\n" + m.content + "<|end|>\n";
      if (add_ass) ss += "<|assistant|>\n";
      break;
    case Family::kFalcon3:
      for (const auto& m : chat) ss += "<|" + m.role + "|>\n" + m.content + "\n";
      if (add_ass) ss += "<|assistant|>\n";
      break;
    case Family::kZephyr:
      for (const auto& m : chat) ss += "<|" + m.role + "|>\n" + m.content + "<|endoftext|>\n";
      if (add_ass) ss += "<|assistant|>\n";
      break;
    case Family::kMonarch:
      for (size_t i = 0; i < chat.size(); ++i) {
        ss += (i == 0 ? "" : "<s>") + chat[i].role + "\n" + chat[i].content + "</s>\n";
      }
      if (add_ass) ss += "<s>assistant\n";
      break;
    case Family::kGemma: {
      // Gemma has no system role: the system text is merged into the next user turn.
      std::string system_prompt;
      for (const auto& m : chat) {
        if (m.role == "system") {
          system_prompt += trim(m.content);
          continue;
        }
        const std::string role = m.role == "assistant" ? "model" : m.role;
        ss += "<start_of_turn>" + role + "\n";
        if (!system_prompt.empty() && role != "model") {
          ss += system_prompt + "\n\n";
          system_prompt.clear();
        }
        ss += trim(m.content) + "<end_of_turn>\n";
      }
      if (add_ass) ss += "<start_of_turn>model\n";
      break;
    }
    case Family::kOpenchat:
      for (const auto& m : chat) {
        if (m.role == "system") {
          ss += m.content + "<|end_of_turn|>";
        } else {
          std::string role = m.role;
          if (!role.empty()) role[0] = static_cast<char>(std::toupper(static_cast<unsigned char>(role[0])));
          ss += "GPT4 Correct " + role + ": " + m.content + "<|end_of_turn|>";
        }
      }
      if (add_ass) ss += "GPT4 Correct Assistant:";
      break;
    case Family::kVicuna:
    case Family::kVicunaOrca:
      for (const auto& m : chat) {
        if (m.role == "system") {
          ss += family == Family::kVicunaOrca ? "SYSTEM: " + m.content + "\n" : m.content + "\n\n";
        } else if (m.role == "user") {
          ss += "USER: " + m.content + "\n";
        } else if (m.role == "assistant") {
          ss += "ASSISTANT: " + m.content + "</s>\n";
        }
      }
      if (add_ass) ss += "ASSISTANT:";
      break;
    case Family::kDeepseek:
      for (const auto& m : chat) {
        if (m.role == "system") ss += m.content;
        else if (m.role == "user") ss += "### Instruction:\n" + m.content + "\n";
        else if (m.role == "assistant") ss += "### Response:\n" + m.content + "\n<|EOT|>\n";
      }
      if (add_ass) ss += "### Response:\n";
      break;
    case Family::kCommandR:
      for (const auto& m : chat) {
        if (m.role == "system") ss += "<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>" + trim(m.content) + "<|END_OF_TURN_TOKEN|>";
        else if (m.role == "user") ss += "<|START_OF_TURN_TOKEN|><|USER_TOKEN|>" + trim(m.content) + "<|END_OF_TURN_TOKEN|>";
        else if (m.role == "assistant") ss += "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>" + trim(m.content) + "<|END_OF_TURN_TOKEN|>";
      }
      if (add_ass) ss += "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>";
      break;
    case Family::kLlama3:
      for (const auto& m : chat) {
        ss += "<|start_header_id|>" + m.role + "<|end_header_id|>\n\n" + trim(m.content) + "<|eot_id|>";
      }
      if (add_ass) ss += "<|start_header_id|>assistant<|end_header_id|>\n\n";
      break;
    case Family::kDeepseek2:
      for (const auto& m : chat) {
        if (m.role == "system") ss += m.content + "\n\n";
        else if (m.role == "user") ss += "User: " + m.content + "\n\n";
        else if (m.role == "assistant") ss += "Assistant: " + m.content + "<\xEF\xBD\x9C" "end\xE2\x96\x81of\xE2\x96\x81sentence\xEF\xBD\x9C>";
      }
      if (add_ass) ss += "Assistant:";
      break;
    case Family::kDeepseek3:
      for (const auto& m : chat) {
        if (m.role == "system") ss += m.content + "\n\n";
        else if (m.role == "user") ss += "<\xEF\xBD\x9C" "User\xEF\xBD\x9C>" + m.content;
        else if (m.role == "assistant") {
          ss += "<\xEF\xBD\x9C" "Assistant\xEF\xBD\x9C>" + m.content +
                "<\xEF\xBD\x9C" "end\xE2\x96\x81of\xE2\x96\x81sentence\xEF\xBD\x9C>";
        }
      }
      if (add_ass) ss += "<\xEF\xBD\x9C" "Assistant\xEF\xBD\x9C>";
      break;
    case Family::kExaone3:
      for (const auto& m : chat) {
        if (m.role == "system") ss += "[|system|]" + trim(m.content) + "[|endofturn|]\n";
        else if (m.role == "user") ss += "[|user|]" + trim(m.content) + "\n";
        else if (m.role == "assistant") ss += "[|assistant|]" + trim(m.content) + "[|endofturn|]\n";
      }
      if (add_ass) ss += "[|assistant|]";
      break;
    case Family::kGranite:
      for (const auto& m : chat) {
        ss += "<|start_of_role|>" + m.role + "<|end_of_role|>";
        if (m.role == "assistant_tool_call") ss += "<|tool_call|>";
        ss += m.content + "<|end_of_text|>\n";
      }
      if (add_ass) ss += "<|start_of_role|>assistant<|end_of_role|>\n";
      break;
    case Family::kLlama4:
      for (const auto& m : chat) {
        ss += "<|header_start|>" + m.role + "<|header_end|>\n\n" + trim(m.content) + "<|eot|>";
      }
      if (add_ass) ss += "<|header_start|>assistant<|header_end|>\n\n";
      break;
    case Family::kSmolvlm:
      ss += "<|im_start|>";
      for (const auto& m : chat) {
        if (m.role == "system") ss += m.content + "\n\n";
        else if (m.role == "user") ss += "User: " + m.content + "<end_of_utterance>\n";
        else ss += "Assistant: " + m.content + "<end_of_utterance>\n";
      }
      if (add_ass) ss += "Assistant:";
      break;
    default:
      throw std::runtime_error("unsupported chat template");
  }
  return ss;
}

const char* family_name(Family family) {
  for (const auto& [name, f] : families_by_name()) {
    if (f == family) return name.c_str();
  }
  return "";
}

}  // namespace

std::string detect_chat_template(const std::string& template_text) {
  return family_name(detect(template_text));
}

std::string apply_chat_template(const std::string& template_text,
                                const std::vector<ChatMessage>& msgs, bool add_generation_prompt) {
  const Family family = detect(template_text);
  if (family == Family::kUnknown) throw std::runtime_error("unsupported chat template");
  if (family == Family::kChatml && !msgs.empty() && msgs.front().role != "system") {
    const std::string default_system = find_default_system_prompt(template_text);
    if (!default_system.empty()) {
      std::vector<ChatMessage> with_system;
      with_system.reserve(msgs.size() + 1);
      with_system.push_back({"system", default_system});
      with_system.insert(with_system.end(), msgs.begin(), msgs.end());
      return format(family, with_system, add_generation_prompt);
    }
  }
  return format(family, msgs, add_generation_prompt);
}

}  // namespace tessera
