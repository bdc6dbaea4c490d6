#include "openai_protocol.h"

#include "json_body.h"
#include "structured_output.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace tessera::server {

using nlohmann::json;

namespace {

constexpr int kMaxLogprobs = 20;
constexpr int kMaxStopStrings = 16;
constexpr int kMaxN = 128;

std::string describe(const json& v) { return describe_json(v); }

// Field readers: absent or null means "not given" (OpenAI clients send explicit nulls).
// Each returns false after filling *error when the value is present but wrong.
class Reader {
 public:
  Reader(const json& body, ApiError* error) : body_(body), error_(error) {}

  const json* find(const char* key) const {
    auto it = body_.find(key);
    if (it == body_.end() || it->is_null()) return nullptr;
    return &*it;
  }

  ApiError* error() const { return error_; }

  bool fail(const std::string& param, const std::string& message) {
    error_->param = param;
    error_->message = param + ": " + message;
    return false;
  }

  bool number(const char* key, double lo, double hi, float* out) {
    const json* v = find(key);
    if (!v) return true;
    if (!v->is_number()) return fail(key, "expected a number, got " + describe(*v));
    const double d = v->get<double>();
    if (!(d >= lo && d <= hi))
      return fail(key, "must be in [" + fmt(lo) + ", " + fmt(hi) + "], got " + v->dump());
    *out = static_cast<float>(d);
    return true;
  }

  bool integer(const char* key, int64_t lo, int64_t hi, int64_t* out, bool* given = nullptr) {
    const json* v = find(key);
    if (!v) return true;
    int64_t i = 0;
    if (v->is_number_integer()) {
      if (v->is_number_unsigned() && v->get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
        return fail(key, "must be at most " + std::to_string(hi) + ", got " + v->dump());
      i = v->get<int64_t>();
    } else if (v->is_number_float() && std::floor(v->get<double>()) == v->get<double>() &&
               std::fabs(v->get<double>()) < 9e15) {
      i = static_cast<int64_t>(v->get<double>());  // 16.0 is 16
    } else {
      return fail(key, "expected an integer, got " + describe(*v));
    }
    if (i < lo || i > hi)
      return fail(key, "must be in [" + std::to_string(lo) + ", " + std::to_string(hi) + "], got " + v->dump());
    *out = i;
    if (given) *given = true;
    return true;
  }

  bool boolean(const char* key, bool* out) {
    const json* v = find(key);
    if (!v) return true;
    if (!v->is_boolean()) return fail(key, "expected a boolean, got " + describe(*v));
    *out = v->get<bool>();
    return true;
  }

  bool string(const char* key, std::string* out) {
    const json* v = find(key);
    if (!v) return true;
    if (!v->is_string()) return fail(key, "expected a string, got " + describe(*v));
    *out = v->get<std::string>();
    return true;
  }

  static std::string fmt(double d) {
    json j = d;
    return j.dump();
  }

 private:
  const json& body_;
  ApiError* error_;
};

bool parse_stop(Reader& r, std::vector<std::string>* stops) {
  const json* v = r.find("stop");
  if (!v) return true;
  if (v->is_string()) {
    if (!v->get<std::string>().empty()) stops->push_back(v->get<std::string>());
    return true;
  }
  if (!v->is_array()) return r.fail("stop", "expected a string or a list of strings, got " + describe(*v));
  if (v->size() > kMaxStopStrings)
    return r.fail("stop", "at most " + std::to_string(kMaxStopStrings) + " stop strings, got " +
                              std::to_string(v->size()));
  for (size_t i = 0; i < v->size(); ++i) {
    const json& s = (*v)[i];
    if (!s.is_string())
      return r.fail("stop", "expected a list of strings, item " + std::to_string(i) + " is " + describe(s));
    if (!s.get<std::string>().empty()) stops->push_back(s.get<std::string>());
  }
  return true;
}

// `param` names the list for errors: "prompt" or "prompt[3]".
bool parse_token_list(Reader& r, const std::string& param, const json& list, std::vector<int32_t>* ids) {
  for (size_t i = 0; i < list.size(); ++i) {
    const json& t = list[i];
    if (!t.is_number_integer() || t.get<int64_t>() < 0 || t.get<int64_t>() > std::numeric_limits<int32_t>::max())
      return r.fail(param, "token list item " + std::to_string(i) + " is not a token id: " + describe(t));
    ids->push_back(static_cast<int32_t>(t.get<int64_t>()));
  }
  if (ids->empty()) return r.fail(param, "must not be empty");
  return true;
}

// A string, a list of token ids, a list of strings, or a list of token-id lists (OpenAI's
// four forms, of completions' `prompt` and embeddings' `input`); the last two are a batch.
bool parse_prompt_inputs(Reader& r, const std::string& key, int max_items, std::vector<PromptInput>* out) {
  const json* v = r.find(key.c_str());
  if (!v) return r.fail(key, "required");
  const char* expected = "expected a string, a list of token ids, a list of strings or a list of token-id lists";
  if (v->is_string()) {
    if (v->get_ref<const std::string&>().empty()) return r.fail(key, "must not be empty");
    out->push_back({v->get<std::string>(), {}});
    return true;
  }
  if (!v->is_array()) return r.fail(key, std::string(expected) + ", got " + describe(*v));
  if (v->empty()) return r.fail(key, "must not be empty");
  const json& first = (*v)[0];
  if (first.is_number()) {
    out->emplace_back();
    return parse_token_list(r, key, *v, &out->back().ids);
  }
  if (!first.is_string() && !first.is_array())
    return r.fail(key, std::string(expected) + "; item 0 is " + describe(first));
  if (v->size() > static_cast<size_t>(max_items))
    return r.fail(key, "at most " + std::to_string(max_items) + " items per request, got " + std::to_string(v->size()));
  for (size_t i = 0; i < v->size(); ++i) {
    const json& item = (*v)[i];
    const std::string param = key + "[" + std::to_string(i) + "]";
    if (first.is_string()) {
      if (!item.is_string())
        return r.fail(param, "expected a string (as item 0 is), got " + describe(item));
      if (item.get_ref<const std::string&>().empty()) return r.fail(param, "must not be empty");
      out->push_back({item.get<std::string>(), {}});
    } else {
      if (!item.is_array())
        return r.fail(param, "expected a list of token ids (as item 0 is), got " + describe(item));
      out->emplace_back();
      if (!parse_token_list(r, param, item, &out->back().ids)) return false;
    }
  }
  return true;
}

bool parse_content(Reader& r, const json& content, size_t index, std::string* out) {
  const std::string param = "messages[" + std::to_string(index) + "].content";
  if (content.is_string()) {
    *out = content.get<std::string>();
    return true;
  }
  if (content.is_array()) {
    for (size_t i = 0; i < content.size(); ++i) {
      const json& part = content[i];
      const std::string part_param = param + "[" + std::to_string(i) + "]";
      if (!part.is_object() || !part.contains("type") || !part["type"].is_string())
        return r.fail(part_param, "expected an object with a \"type\"");
      if (part["type"] != "text")
        return r.fail(part_param + ".type", "only \"text\" content parts are supported");
      if (!part.contains("text") || !part["text"].is_string())
        return r.fail(part_param + ".text", "expected a string");
      *out += part["text"].get<std::string>();
    }
    return true;
  }
  return r.fail(param, "expected a string or a list of content parts, got " + describe(content));
}

bool parse_messages(Reader& r, GenerationSpec* spec) {
  const json* v = r.find("messages");
  if (!v) return r.fail("messages", "required");
  if (!v->is_array()) return r.fail("messages", "expected a list of messages, got " + describe(*v));
  if (v->empty()) return r.fail("messages", "must contain at least one message");
  for (size_t i = 0; i < v->size(); ++i) {
    const json& m = (*v)[i];
    const std::string param = "messages[" + std::to_string(i) + "]";
    if (!m.is_object()) return r.fail(param, "expected an object, got " + describe(m));
    auto role = m.find("role");
    if (role == m.end() || !role->is_string()) return r.fail(param + ".role", "expected a string");
    std::string role_name = role->get<std::string>();
    if (role_name == "developer") role_name = "system";  // OpenAI's newer name for it
    if (role_name != "system" && role_name != "user" && role_name != "assistant" && role_name != "tool")
      return r.fail(param + ".role",
                    "expected one of system, developer, user, assistant, tool, got \"" + role_name + "\"");
    ChatMessage msg;
    msg.role = role_name;
    auto content = m.find("content");
    auto tool_calls = m.find("tool_calls");
    const bool has_tool_calls = role_name == "assistant" && tool_calls != m.end() && !tool_calls->is_null();
    if (content == m.end() || content->is_null()) {
      if (!has_tool_calls) return r.fail(param + ".content", "required");
    } else if (!parse_content(r, *content, i, &msg.content)) {
      return false;
    }
    // An assistant turn that called tools, as the model wrote it (structured_output.h).
    if (has_tool_calls && !append_tool_call_text(*tool_calls, param + ".tool_calls", &msg.content, r.error()))
      return false;
    if (role_name == "tool") {
      auto id = m.find("tool_call_id");
      if (id == m.end() || !id->is_string()) return r.fail(param + ".tool_call_id", "expected a string");
    }
    spec->messages.push_back(std::move(msg));
  }
  return true;
}

// Known fields this server does not implement: refusing them beats ignoring what the client
// explicitly asked for.
bool reject_unsupported(Reader& r, ApiKind kind, int32_t n) {
  if (const json* v = r.find("logit_bias"); v && !(v->is_object() && v->empty()))
    return r.fail("logit_bias", "is not supported");
  if (r.find("functions")) return r.fail("functions", "is not supported (use tools)");
  if (kind == ApiKind::kCompletion) {
    // Structured output and tools are chat features (structured_output.h).
    if (const json* v = r.find("tools"); v && !(v->is_array() && v->empty()))
      return r.fail("tools", "is only supported on /v1/chat/completions");
    if (const json* v = r.find("response_format")) {
      if (!v->is_object() || v->value("type", "") != "text")
        return r.fail("response_format", "only {\"type\": \"text\"} is supported on /v1/completions");
    }
    if (const json* v = r.find("suffix"); v && !(v->is_string() && v->get<std::string>().empty()))
      return r.fail("suffix", "is not supported");
    if (const json* v = r.find("best_of"); v && !(v->is_number_integer() && v->get<int64_t>() == n))
      return r.fail("best_of", "is not supported (other than equal to n)");
  }
  return true;
}

}  // namespace

std::optional<GenerationSpec> parse_generation_request(const json& body, ApiKind kind, ApiError* error) {
  Reader r(body, error);
  GenerationSpec spec;
  spec.kind = kind;
  // OpenAI's defaults; SamplingParams' own defaults match them except max_tokens.
  spec.params.temperature = 1.0f;
  const json* model = r.find("model");
  if (!model) return r.fail("model", "required"), std::nullopt;
  if (!model->is_string()) return r.fail("model", "expected a string, got " + describe(*model)), std::nullopt;
  spec.model = model->get<std::string>();

  if (kind == ApiKind::kCompletion) {
    if (!parse_prompt_inputs(r, "prompt", kMaxPromptsPerRequest, &spec.prompts)) return std::nullopt;
  } else {
    if (!parse_messages(r, &spec)) return std::nullopt;
  }

  int64_t i = 0;
  bool given = false;
  // Completions take 0 with echo: the prompt is only evaluated (lm-eval's loglikelihood).
  if (!r.integer("max_tokens", kind == ApiKind::kCompletion ? 0 : 1, 1 << 24, &i, &given)) return std::nullopt;
  if (given) spec.params.max_tokens = static_cast<int32_t>(i);
  if (kind == ApiKind::kChat) {
    bool completion_given = false;
    if (!r.integer("max_completion_tokens", 1, 1 << 24, &i, &completion_given)) return std::nullopt;
    if (completion_given) spec.params.max_tokens = static_cast<int32_t>(i);
    given = given || completion_given;
  }
  spec.max_tokens_given = given;

  if (!r.number("temperature", 0, 2, &spec.params.temperature)) return std::nullopt;
  if (!r.number("top_p", 0, 1, &spec.params.top_p)) return std::nullopt;
  if (spec.params.top_p == 0) return r.fail("top_p", "must be greater than 0"), std::nullopt;
  if (!r.integer("top_k", -1, 1 << 20, &i, &(given = false))) return std::nullopt;
  if (given) spec.params.top_k = i < 0 ? 0 : static_cast<int32_t>(i);  // -1 (vLLM) means off
  if (!r.number("min_p", 0, 1, &spec.params.min_p)) return std::nullopt;
  if (!r.number("presence_penalty", -2, 2, &spec.params.presence_penalty)) return std::nullopt;
  if (!r.number("frequency_penalty", -2, 2, &spec.params.frequency_penalty)) return std::nullopt;
  if (!r.number("repetition_penalty", 0.01, 10, &spec.params.repetition_penalty)) return std::nullopt;
  if (!r.integer("seed", std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::max(), &i,
                 &(given = false)))
    return std::nullopt;
  if (given) {
    spec.params.seed = static_cast<uint64_t>(i);
    spec.params.has_seed = true;
  }
  if (!r.integer("n", 1, kMaxN, &i, &(given = false))) return std::nullopt;
  if (given) spec.n = static_cast<int32_t>(i);
  if (!parse_stop(r, &spec.stop)) return std::nullopt;
  if (!r.boolean("stream", &spec.stream)) return std::nullopt;
  if (!r.boolean("ignore_eos", &spec.params.ignore_eos)) return std::nullopt;
  if (const json* so = r.find("stream_options")) {
    if (!so->is_object()) return r.fail("stream_options", "expected an object, got " + describe(*so)), std::nullopt;
    if (!spec.stream) return r.fail("stream_options", "is only allowed when stream is true"), std::nullopt;
    Reader sr(*so, error);
    if (!sr.boolean("include_usage", &spec.include_usage)) {
      error->param = "stream_options." + error->param;
      error->message = "stream_options." + error->message;
      return std::nullopt;
    }
  }
  // The end user: keeps an A/B router's arm sticky (ab-split); never logged.
  if (!r.string("user", &spec.user)) return std::nullopt;

  if (kind == ApiKind::kCompletion) {
    if (!r.boolean("parse_special", &spec.parse_special)) return std::nullopt;
    // Completions: `logprobs: N` asks for the chosen token's logprob and N alternatives.
    if (!r.integer("logprobs", 0, kMaxLogprobs, &i, &(given = false))) return std::nullopt;
    if (given) {
      spec.logprobs = true;
      spec.top_logprobs = static_cast<int32_t>(i);
    }
    if (!r.boolean("echo", &spec.echo)) return std::nullopt;
    if (spec.max_tokens_given && spec.params.max_tokens == 0 && !spec.echo)
      return r.fail("max_tokens", "0 is only allowed with echo: true (nothing would be returned)"), std::nullopt;
    if (spec.echo && spec.logprobs) spec.prompt_logprobs = spec.top_logprobs;
    else if (spec.max_tokens_given && spec.params.max_tokens == 0) spec.prompt_logprobs = 0;
  } else {
    // Chat: `logprobs: true` plus `top_logprobs: N`.
    if (!r.boolean("logprobs", &spec.logprobs)) return std::nullopt;
    if (!r.integer("top_logprobs", 0, kMaxLogprobs, &i, &(given = false))) return std::nullopt;
    if (given) {
      if (!spec.logprobs) return r.fail("top_logprobs", "requires logprobs to be true"), std::nullopt;
      spec.top_logprobs = static_cast<int32_t>(i);
    }
  }
  spec.params.num_logprobs = spec.top_logprobs;
  if (!reject_unsupported(r, kind, spec.n)) return std::nullopt;
  return spec;
}

void apply_request_defaults(const RequestDefaults& d, ApiKind kind, json* body) {
  const auto absent = [&](const char* key) {
    auto it = body->find(key);
    return it == body->end() || it->is_null();
  };
  const auto set = [&](const char* key, const auto& value) {
    if (value && absent(key)) (*body)[key] = *value;
  };
  set("temperature", d.temperature);
  set("top_p", d.top_p);
  set("top_k", d.top_k);
  set("min_p", d.min_p);
  set("presence_penalty", d.presence_penalty);
  set("frequency_penalty", d.frequency_penalty);
  set("repetition_penalty", d.repetition_penalty);
  // Chat's newer name for max_tokens counts as giving it.
  if (kind == ApiKind::kCompletion || absent("max_completion_tokens")) set("max_tokens", d.max_tokens);
}

bool parse_chat_messages(const json& body, std::vector<ChatMessage>* messages, ApiError* error) {
  Reader r(body, error);
  GenerationSpec spec;
  if (!parse_messages(r, &spec)) return false;
  *messages = std::move(spec.messages);
  return true;
}

StopStringFilter::StopStringFilter(std::vector<std::string> stops) : stops_(std::move(stops)) {
  for (const auto& s : stops_) max_stop_len_ = std::max(max_stop_len_, s.size());
}

std::string StopStringFilter::push(std::string_view text) {
  if (matched_) return {};
  pending_ += text;
  if (stops_.empty()) {
    std::string out = std::move(pending_);
    pending_.clear();
    released_ += out.size();
    return out;
  }
  // The earliest stop string wins.
  size_t cut = std::string::npos;
  for (const auto& s : stops_) cut = std::min(cut, pending_.find(s));
  if (cut != std::string::npos) {
    matched_ = true;
    std::string out = pending_.substr(0, cut);
    pending_.clear();
    released_ += out.size();
    return out;
  }
  // Hold back the longest tail that is the beginning of some stop string.
  size_t hold = 0;
  for (size_t k = std::min(pending_.size(), max_stop_len_ - 1); k > 0 && hold == 0; --k) {
    const std::string_view tail = std::string_view(pending_).substr(pending_.size() - k);
    for (const auto& s : stops_)
      if (s.size() > k && std::string_view(s).substr(0, k) == tail) {
        hold = k;
        break;
      }
  }
  std::string out = pending_.substr(0, pending_.size() - hold);
  pending_.erase(0, pending_.size() - hold);
  released_ += out.size();
  return out;
}

std::string StopStringFilter::flush() {
  if (matched_) return {};
  std::string out = std::move(pending_);
  pending_.clear();
  released_ += out.size();
  return out;
}

std::optional<EmbeddingsSpec> parse_embeddings_request(const json& body, int max_inputs, ApiError* error) {
  Reader r(body, error);
  EmbeddingsSpec spec;
  if (!r.find("model")) {
    r.fail("model", "required");
    return std::nullopt;
  }
  if (!r.string("model", &spec.model)) return std::nullopt;
  if (!parse_prompt_inputs(r, "input", max_inputs, &spec.inputs)) return std::nullopt;
  std::string format = "float";
  if (!r.string("encoding_format", &format)) return std::nullopt;
  if (format != "float" && format != "base64") {
    r.fail("encoding_format", "expected \"float\" or \"base64\", got " + json(format).dump());
    return std::nullopt;
  }
  spec.base64 = format == "base64";
  int64_t dimensions = 0;
  bool given = false;
  if (!r.integer("dimensions", 1, 1 << 20, &dimensions, &given)) return std::nullopt;
  if (given) spec.dimensions = static_cast<int32_t>(dimensions);
  if (!r.string("user", &spec.user)) return std::nullopt;
  return spec;
}

}  // namespace tessera::server
