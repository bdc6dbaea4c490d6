#include "openai_service.h"

#include "tessera/embedding/encoder_model.h"

#include <boost/asio/post.hpp>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <optional>
#include <random>

#include "dashboard.h"
#include "json_body.h"
#include "openai_protocol.h"
#include "stats.h"
#include "structured_output.h"
#include "tessera/chat_template.h"
#include "tessera/gateway/cache_key.h"
#include "tessera/tokenizer.h"

namespace tessera::server {

// A generation request parsed and admitted, on its way to a deployment (the router may still
// be choosing one on the embedding thread).
struct PendingGeneration {
  bool chat = false;
  GenerationSpec spec;
  std::string body;            // the request body (structured output is read from it in key order)
  std::string key_digest;      // a digest of the API key ("" without one)
  std::string semantic_text;   // what a router classifies and a semantic cache embeds
  std::vector<float> embedding;  // semantic_text's, when the router needed it
  Deployment* deployment = nullptr;
  bool routed = false;
};

using nlohmann::json;

namespace {

constexpr int kClientClosedRequest = 499;  // nginx's status for "client went away first"
constexpr int kCompletionDefaultMaxTokens = 16;  // OpenAI's default for /v1/completions

std::string dump(const json& j) {
  // Token pieces of byte-level vocabularies can be partial UTF-8: replace, never throw.
  return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

int64_t unix_now() {
  return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

std::string random_id(const char* prefix) {
  static thread_local std::mt19937_64 rng{std::random_device{}()};
  char buf[40];
  std::snprintf(buf, sizeof buf, "%s%016llx", prefix, static_cast<unsigned long long>(rng()));
  return buf;
}

// Compares without an early exit, so response timing does not reveal how much of a key
// matched (only whether the length did).
bool constant_time_equal(std::string_view a, std::string_view b) {
  if (a.size() != b.size() || a.empty()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

const char* finish_reason_text(FinishReason r) {
  switch (r) {
    case FinishReason::kStop: return "stop";
    case FinishReason::kLength: return "length";
    case FinishReason::kCancelled: return "abort";
    default: return "error";
  }
}

http::status status_for(const Status& st) {
  switch (st.code()) {
    case StatusCode::kInvalidArgument:
    case StatusCode::kOutOfRange: return http::status::bad_request;
    case StatusCode::kResourceExhausted:
    case StatusCode::kUnavailable: return http::status::service_unavailable;
    case StatusCode::kDeadlineExceeded: return http::status::gateway_timeout;
    case StatusCode::kFailedPrecondition: return http::status::bad_gateway;
    case StatusCode::kUnimplemented: return http::status::not_implemented;  // a capability this stack lacks
    default: return http::status::internal_server_error;
  }
}

// Engine messages start with the field they are about ("max_tokens: ...", "prompt: ...").
std::string param_of(const std::string& message) {
  const auto colon = message.find(':');
  if (colon == std::string::npos || colon > 32) return {};
  const std::string head = message.substr(0, colon);
  return head.find(' ') == std::string::npos ? head : std::string();
}

double ms_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t).count();
}

// A request path for the access log: no query string (it may carry secrets), at most 128
// bytes, anything but visible ASCII (and '"', '\\', '%') percent-encoded so a line cannot be
// forged or split.
std::string loggable_path(std::string_view target) {
  std::string_view path = target.substr(0, target.find('?'));
  std::string out;
  for (unsigned char c : path.substr(0, 128)) {
    if (c > 0x20 && c < 0x7f && c != '"' && c != '\\' && c != '%') {
      out += static_cast<char>(c);
    } else {
      char buf[4];
      std::snprintf(buf, sizeof buf, "%%%02X", c);
      out += buf;
    }
  }
  if (path.size() > 128) out += "...";
  return out.empty() ? "-" : out;
}

std::shared_ptr<spdlog::logger> access_logger() {
  static std::shared_ptr<spdlog::logger> logger = [] {
    auto l = spdlog::get("access");
    if (!l) l = spdlog::stderr_color_mt("access");
    // Its own level: the access log is not silenced by --log-level warn.
    l->set_level(spdlog::level::info);
    l->set_pattern("[%Y-%m-%d %H:%M:%S.%e] [access] %v");
    return l;
  }();
  return logger;
}

// echo: what each choice of a prompt starts with.
struct PromptEcho {
  std::string text;                 // the prompt text, prepended to each choice's text
  std::vector<TokenId> ids;
  std::vector<size_t> offsets;      // where each prompt token's text starts in `text`
  std::vector<SampledToken> logprobs;  // from the engine: entry i is prompt token i + 1
};

// The prompt text (as given, or the tokens' text for a token-id prompt) and where each
// prompt token's text starts in it. A BOS the tokenizer added to a text prompt has no text.
PromptEcho make_echo(const Tokenizer& tok, const std::vector<TokenId>& ids, const std::string* given_text) {
  PromptEcho echo;
  echo.ids = ids;
  StreamingDetokenizer detok(tok, /*render_special=*/true);
  std::string text;
  for (size_t i = 0; i < ids.size(); ++i) {
    echo.offsets.push_back(text.size());
    if (i == 0 && given_text && tok.add_bos() && ids[0] == tok.bos_id()) continue;
    text += detok.push(ids[i]);
  }
  text += detok.flush();
  echo.text = given_text ? *given_text : std::move(text);
  for (size_t& o : echo.offsets) o = std::min(o, echo.text.size());
  return echo;
}

}  // namespace

// One generation request from arrival to its last byte. Touched only on the io thread.
struct GenerationCall : std::enable_shared_from_this<GenerationCall> {
  struct TokenRecord {
    SampledToken token;
    size_t offset = 0;  // where its decoded text starts in the choice's text
  };
  struct Choice {
    std::unique_ptr<StreamingDetokenizer> detok;
    std::unique_ptr<StopStringFilter> filter;
    std::string text;               // released so far (all of it once finished)
    std::vector<TokenRecord> tokens;
    size_t decoded_bytes = 0;
    size_t tokens_reported = 0;     // logprob entries already streamed
    bool finished = false;          // no more output: the engine finished it or a stop string matched
    bool engine_finished = false;
    std::string finish_reason;
    std::string error;
    std::unique_ptr<ToolCallStream> tool_stream;  // streamed chat with tools
    int32_t num_tool_calls_sent = 0;
    std::string unsent_text;  // released while its prompt's echo waits for its logprobs
  };
  // An engine event, copied off the engine thread.
  struct Event {
    int32_t prompt = 0;  // which prompt of a batch
    int32_t choice = 0;  // which of its n samples
    int32_t cached_prompt_tokens = 0;
    std::vector<SampledToken> tokens;
    bool finished = false;
    FinishReason reason = FinishReason::kNone;
    std::string error;
    RequestTimings timings;  // only with finished
    std::vector<SampledToken> prompt_logprobs;
  };

  OpenAiService* service = nullptr;
  Deployment* deployment = nullptr;
  uint64_t serial = 0;
  GenerationSpec spec;
  StructuredOutput structured;  // response_format and tools (chat)
  std::string router, arm;    // set when a router chose the deployment
  ServedBy served;            // of prompt 0: the deployment, and the cache layer when it answered
  bool started = false;       // on_start heard (a stream's headers can go out)
  std::shared_ptr<ResponseChannel> channel;
  std::string endpoint;
  std::string id;
  int64_t created = 0;
  // Per prompt of the batch (one for chat): its engine request, its samples the engine has
  // not finished, its length and prefix-cache hits. Choice i belongs to prompt i / n.
  std::vector<std::unique_ptr<RequestHandle>> handles;
  std::vector<int32_t> open_per_prompt;
  std::vector<int32_t> prompt_tokens_each;
  std::vector<int32_t> cached_each;
  std::vector<Choice> choices;
  std::vector<PromptEcho> echoes;  // per prompt, with spec.echo
  // Streams with echo and logprobs: per prompt, its echo chunks went out. They wait for the
  // prompt's logprobs (the first engine event of the prompt), and its choices' text waits
  // for them.
  std::vector<char> echo_streamed;
  int32_t engine_open = 0;    // samples the engine has not finished, all prompts
  std::vector<char> cancel_sent;  // per prompt: its handle was cancelled
  bool responded = false;     // the answer is complete, or the client is gone
  AccessRecord access;
  double ttft_ms = -1;        // arrival to the first token on the io thread
  bool logged = false;

  const Tokenizer& tokenizer() const { return deployment->model().tokenizer(); }
  bool chat() const { return spec.kind == ApiKind::kChat; }

  // Tokens of a choice that belong to its output: all of them, or those starting before a
  // matched stop string.
  size_t kept_tokens(const Choice& c) const {
    if (!c.filter->matched()) return c.tokens.size();
    size_t n = 0;
    while (n < c.tokens.size() && c.tokens[n].offset < c.filter->released()) ++n;
    return n;
  }

  int64_t prompt_tokens() const {
    int64_t n = 0;
    for (int32_t p : prompt_tokens_each) n += p;
    return n;
  }

  // Who serves prompt `prompt`: a stream's headers say whether a cache answered.
  void on_start(int32_t prompt, const ServedBy& by) {
    if (prompt != 0) return;
    served = by;
    if (served.cache_consulted)
      service->metrics_.count_cache(served.deployment, served.is_cache_hit() ? "hit" : "miss",
                                    served.is_cache_hit() ? served.cache_tier : "");
    if (started) return;
    started = true;
    if (spec.stream && !responded) start_stream();
  }

  // Headers naming what answered: the cache (hit or miss, and the tier) and the router's arm.
  std::vector<std::pair<std::string, std::string>> gateway_headers() const {
    std::vector<std::pair<std::string, std::string>> h;
    if (served.cache_consulted)
      h.emplace_back("x-tessera-cache", served.is_cache_hit() ? "hit; layer=" + served.cache_layer +
                                                                      "; tier=" + served.cache_tier +
                                                                      "; similarity=" + similarity_text()
                                                                : "miss");
    if (!router.empty()) h.emplace_back("x-tessera-route", router + "=" + arm);
    return h;
  }

  // The body's note of a cache hit (an extra field the OpenAI clients keep and ignore).
  void add_cache_note(json& j) const {
    if (served.is_cache_hit())
      j["tessera_cache"] = {{"hit", true},
                            {"layer", served.cache_layer},
                            {"tier", served.cache_tier},
                            {"similarity", std::round(double(served.cache_similarity) * 1e4) / 1e4}};
  }

  // The hit's prompt similarity with 4 decimals ("1.0000" for an exact match).
  std::string similarity_text() const {
    char buf[16];
    std::snprintf(buf, sizeof buf, "%.4f", double(served.cache_similarity));
    return buf;
  }

  void on_event(Event ev) {
    const int32_t index = ev.prompt * spec.n + ev.choice;
    Choice& c = choices[static_cast<size_t>(index)];
    auto& cached = cached_each[static_cast<size_t>(ev.prompt)];
    cached = std::max(cached, ev.cached_prompt_tokens);
    if (ttft_ms < 0 && !ev.tokens.empty()) ttft_ms = ms_since(access.start);
    if (!ev.prompt_logprobs.empty() && spec.echo) {
      echoes[static_cast<size_t>(ev.prompt)].logprobs = std::move(ev.prompt_logprobs);
      if (streams_echo_logprobs() && !responded) stream_echo(static_cast<size_t>(ev.prompt));
    }
    std::string released;
    if (!c.finished) {
      for (const SampledToken& t : ev.tokens) {
        const std::string piece = c.detok->push(t.token);
        c.tokens.push_back({t, c.decoded_bytes});
        c.decoded_bytes += piece.size();
        released += c.filter->push(piece);
        if (c.filter->matched()) {
          c.finished = true;
          c.finish_reason = "stop";
          break;
        }
      }
      if (ev.finished && !c.finished) {
        const std::string rest = c.detok->flush();
        c.decoded_bytes += rest.size();
        released += c.filter->push(rest);
        if (!c.filter->matched()) released += c.filter->flush();
        c.finished = true;
        c.finish_reason = c.filter->matched() ? "stop" : finish_reason_text(ev.reason);
        if (ev.reason == FinishReason::kError) c.error = ev.error;
      }
      c.text += released;
      if (spec.stream && !responded) {
        if (streams_echo_logprobs() && !echo_streamed[static_cast<size_t>(ev.prompt)]) c.unsent_text += released;
        else stream_delta(index, released);
      }
    }
    if (ev.finished) {
      c.engine_finished = true;
      --engine_open;
      if (--open_per_prompt[static_cast<size_t>(ev.prompt)] == 0) {
        --service->in_flight_;
        service->metrics_.set_in_flight(service->in_flight_);
        // Nothing is left to cancel: let the prompt's handle go. A cache layer's or a
        // disaggregated deployment's handle holds their call, which holds this call's sink,
        // which holds this call: kept, that cycle leaked every such request (LeakSanitizer,
        // integration_embeddings).
        handles[static_cast<size_t>(ev.prompt)].reset();
      }
      // A cached answer's timings are not the model's: only model-served sequences count.
      if (!served.is_cache_hit()) {
        service->metrics_.observe_sequence(ev.timings, static_cast<int32_t>(kept_tokens(c)));
        service->metrics_.count_tokens(0, static_cast<int64_t>(ev.timings.token_times.size()));
        service->metrics_.observe_deployment(deployment->name(), ev.timings);
        if (!router.empty()) service->metrics_.observe_arm(router, arm, ev.timings);
      }
    }
    // Stop strings ended every sample of this prompt before the engine did: free its
    // sequences now, even while other prompts of the batch go on.
    if (prompt_done(ev.prompt)) cancel_prompt(static_cast<size_t>(ev.prompt), CancelReason::kOutputComplete);
    maybe_complete();
  }

  bool all_finished() const {
    for (const auto& c : choices)
      if (!c.finished) return false;
    return true;
  }

  // Frees the engine's sequences of every prompt still running. kOutputComplete: the answer
  // is whole (stop strings ended it), so a cache layer may keep it.
  void cancel_engine(CancelReason reason = CancelReason::kAbandoned) {
    for (size_t p = 0; p < handles.size(); ++p) cancel_prompt(p, reason);
  }
  void cancel_prompt(size_t p, CancelReason reason) {
    if (p >= handles.size() || open_per_prompt[p] <= 0 || cancel_sent[p] || !handles[p]) return;
    cancel_sent[p] = 1;
    handles[p]->cancel(reason);
  }
  bool prompt_done(int32_t p) const {
    for (int32_t j = 0; j < spec.n; ++j)
      if (!choices[static_cast<size_t>(p * spec.n + j)].finished) return false;
    return true;
  }

  AccessFigures figures() const {
    AccessFigures f;
    f.id = id;
    f.prompt_tokens = prompt_tokens();
    f.completion_tokens = completion_tokens();
    int64_t cached = 0;
    for (int32_t c : cached_each) cached += c;
    f.cached_tokens = cached;
    f.ttft_ms = ttft_ms;
    return f;
  }

  void log_done(int status) {
    if (logged) return;
    logged = true;
    const AccessFigures f = figures();
    service->log_access(access, status, &f);
  }

  // The whole answer (not a stream): counted in the metrics, logged, sent.
  void send_response(HttpResponse res) {
    const int status = static_cast<int>(res.result_int());
    service->metrics_.count_request(endpoint, status);
    log_done(status);
    channel->respond(std::move(res));
  }

  void maybe_complete() {
    if (!all_finished()) return;
    // Stop strings ended every sample before the engine did: free its sequences now.
    cancel_engine(CancelReason::kOutputComplete);
    if (responded) return;
    responded = true;
    if (spec.stream) {
      // A prompt that ended before its logprobs came (an error): its echo and text still go out.
      if (streams_echo_logprobs())
        for (size_t p = 0; p < echoes.size(); ++p) stream_echo(p);
      finish_stream();
    } else {
      respond_whole();
    }
  }

  // The client went away: stop generating for it.
  void client_gone() {
    if (responded) return;
    responded = true;
    service->metrics_.count_cancelled_by_client();
    // A stream was already counted with its 200.
    if (!spec.stream) service->metrics_.count_request(endpoint, kClientClosedRequest);
    log_done(kClientClosedRequest);
    cancel_engine();
  }

  void abort() { cancel_engine(); }

  // Shutdown after its grace: the engine did not end these samples in time (a step longer than
  // the grace). Each ends now as "abort" with what it produced, and the response completes, so
  // the client reads a whole stream (or a whole body) instead of a cut connection.
  void end_as_aborted() {
    if (responded) return;
    cancel_engine();  // abandoned: an aborted answer is nobody's to cache
    if (spec.stream && !started) {
      started = true;
      start_stream();
    }
    std::vector<int32_t> aborted;
    for (size_t i = 0; i < choices.size(); ++i) {
      Choice& c = choices[i];
      if (c.finished) continue;
      c.finished = true;
      c.finish_reason = "abort";
      aborted.push_back(static_cast<int32_t>(i));
    }
    if (spec.stream)
      for (int32_t i : aborted) {
        // A prompt whose echo still waits gets its choices' ends with the echo (maybe_complete).
        if (streams_echo_logprobs() && !echo_streamed[static_cast<size_t>(i / spec.n)]) continue;
        stream_delta(i, std::string());
      }
    maybe_complete();
  }

  // A failure of the server's own code while answering (never expected): the request ends
  // with a 500 (or an error event on a stream) and the engine work stops; the server goes on.
  void fail_internal(const std::string& what) {
    spdlog::error("serve: request {} failed: {}", id, what);
    abort();
    if (responded) return;
    responded = true;
    if (spec.stream) {
      send_event({{"error", {{"message", "internal error: " + what}, {"type", "server_error"},
                             {"param", nullptr}, {"code", nullptr}}}});
      channel->send_chunk("data: [DONE]\n\n");
      channel->end_stream();
      log_done(200);
    } else {
      send_response(make_error_response(http::status::internal_server_error, "internal error: " + what,
                                        "server_error"));
    }
  }

  int64_t completion_tokens() const {
    int64_t completion = 0;
    for (const auto& c : choices) completion += static_cast<int64_t>(kept_tokens(c));
    return completion;
  }

  json usage() const {
    const int64_t prompt = prompt_tokens(), completion = completion_tokens();
    int64_t cached = 0;
    for (int32_t c : cached_each) cached += c;
    return {{"prompt_tokens", prompt},
            {"completion_tokens", completion},
            {"total_tokens", prompt + completion},
            // Prompt tokens whose KV came from the prefix cache (OpenAI's field).
            {"prompt_tokens_details", {{"cached_tokens", cached}}}};
  }

  json token_text(TokenId id) const { return tokenizer().token_to_piece(id, false); }

  static json bytes_of(const std::string& s) {
    json b = json::array();
    for (unsigned char ch : s) b.push_back(static_cast<int>(ch));
    return b;
  }

  // Logprobs of tokens [from, to) of a choice, in the shape of the endpoint; with `echo`
  // (completions), the prompt's tokens come first, the first one with null (nothing
  // precedes it), and text offsets count from the start of the echoed prompt.
  json logprobs_json(const Choice& c, size_t from, size_t to, size_t text_base,
                     const PromptEcho* echo = nullptr) const {
    if (!spec.logprobs) return nullptr;
    if (chat()) {
      json content = json::array();
      for (size_t i = from; i < to; ++i) {
        const auto& t = c.tokens[i].token;
        const std::string piece = tokenizer().token_to_piece(t.token, false);
        json top = json::array();
        for (const auto& alt : t.top) {
          const std::string alt_piece = tokenizer().token_to_piece(alt.token, false);
          top.push_back({{"token", alt_piece}, {"logprob", alt.logprob}, {"bytes", bytes_of(alt_piece)}});
        }
        content.push_back({{"token", piece}, {"logprob", t.logprob}, {"bytes", bytes_of(piece)}, {"top_logprobs", top}});
      }
      return {{"content", content}, {"refusal", nullptr}};
    }
    json tokens = json::array(), token_logprobs = json::array(), top_logprobs = json::array(),
         offsets = json::array();
    if (echo) {
      for (size_t i = 0; i < echo->ids.size(); ++i) {
        tokens.push_back(tokenizer().token_to_piece(echo->ids[i], /*render_special=*/true));
        offsets.push_back(echo->offsets[i]);
        const SampledToken* lp = i > 0 && i <= echo->logprobs.size() ? &echo->logprobs[i - 1] : nullptr;
        token_logprobs.push_back(lp ? json(lp->logprob) : json(nullptr));
        json top = lp ? json::object() : json(nullptr);
        if (lp)
          for (const auto& alt : lp->top) top[tokenizer().token_to_piece(alt.token, true)] = alt.logprob;
        top_logprobs.push_back(top);
      }
      text_base += echo->text.size();
    }
    for (size_t i = from; i < to; ++i) {
      const auto& rec = c.tokens[i];
      tokens.push_back(token_text(rec.token.token));
      token_logprobs.push_back(rec.token.logprob);
      json top = json::object();
      for (const auto& alt : rec.token.top) top[tokenizer().token_to_piece(alt.token, false)] = alt.logprob;
      top_logprobs.push_back(top);
      offsets.push_back(text_base + rec.offset);
    }
    return {{"tokens", tokens}, {"token_logprobs", token_logprobs}, {"top_logprobs", top_logprobs},
            {"text_offset", offsets}};
  }

  void respond_whole() {
    for (const auto& c : choices) {
      if (!c.error.empty()) {
        send_response(make_error_response(http::status::internal_server_error, "generation failed: " + c.error,
                                          "server_error"));
        return;
      }
    }
    json out_choices = json::array();
    for (size_t i = 0; i < choices.size(); ++i) {
      const Choice& c = choices[i];
      const PromptEcho* echo = spec.echo ? &echoes[i / static_cast<size_t>(spec.n)] : nullptr;
      json lp = logprobs_json(c, 0, kept_tokens(c), 0, echo);
      if (chat()) {
        json message = {{"role", "assistant"}, {"content", c.text}};
        std::string finish = c.finish_reason;
        // Output produced under the tool-call grammar: its calls, in OpenAI's shape.
        if (auto parsed = structured.uses_tools() ? parse_tool_calls(c.text) : std::nullopt) {
          json list = json::array();
          for (size_t k = 0; k < parsed->calls.size(); ++k) list.push_back(tool_call_json(k, parsed->calls[k], true));
          // A block cut by max_tokens after complete calls stays visible as content.
          message["content"] = parsed->rest.empty() ? json(nullptr) : json(parsed->rest);
          message["tool_calls"] = std::move(list);
          if (finish == "stop") finish = "tool_calls";
        }
        out_choices.push_back({{"index", i}, {"message", message}, {"logprobs", lp}, {"finish_reason", finish}});
      } else {
        out_choices.push_back({{"index", i}, {"text", echo ? echo->text + c.text : c.text}, {"logprobs", lp},
                               {"finish_reason", c.finish_reason}});
      }
    }
    json body = {{"id", id},
                 {"object", chat() ? "chat.completion" : "text_completion"},
                 {"created", created},
                 {"model", deployment->name()},
                 {"choices", out_choices},
                 {"usage", usage()},
                 {"system_fingerprint", nullptr}};
    add_cache_note(body);
    HttpResponse res = make_json_response(http::status::ok, dump(body));
    for (const auto& [name, value] : gateway_headers()) res.set(name, value);
    send_response(std::move(res));
  }

  json chunk_base() const {
    json j = {{"id", id},
              {"object", chat() ? "chat.completion.chunk" : "text_completion"},
              {"created", created},
              {"model", deployment->name()},
              {"system_fingerprint", nullptr}};
    if (spec.include_usage) j["usage"] = nullptr;
    add_cache_note(j);
    return j;
  }

  void send_event(const json& j) { channel->send_chunk("data: " + dump(j) + "\n\n"); }

  // One entry of message.tool_calls (whole) or of delta.tool_calls (`whole` false: without
  // the arguments, which follow in their own delta).
  static json tool_call_json(size_t index, const ParsedToolCall& call, bool whole) {
    json j = {{"id", random_id("call_")},
              {"type", "function"},
              {"function", {{"name", call.name}, {"arguments", whole ? call.arguments : std::string()}}}};
    if (!whole) j["index"] = index;
    return j;
  }

  // Streamed chat with tools: text goes through the choice's ToolCallStream; completed calls
  // go out as delta.tool_calls (the call's id, type and name, then its arguments).
  void stream_tool_output(int32_t index, const std::string& text) {
    Choice& c = choices[static_cast<size_t>(index)];
    if (!c.tool_stream) c.tool_stream = std::make_unique<ToolCallStream>();
    ToolCallStream::Output out = c.tool_stream->push(text);
    if (c.finished) {
      ToolCallStream::Output rest = c.tool_stream->flush();
      out.content += rest.content;
      for (auto& call : rest.calls) out.calls.push_back(std::move(call));
    }
    for (const ParsedToolCall& call : out.calls) {
      const auto k = static_cast<size_t>(c.num_tool_calls_sent++);
      json head = chunk_base();
      head["choices"] = json::array({{{"index", index},
                                      {"delta", {{"tool_calls", json::array({tool_call_json(k, call, false)})}}},
                                      {"logprobs", nullptr},
                                      {"finish_reason", nullptr}}});
      send_event(head);
      json args = chunk_base();
      args["choices"] = json::array(
          {{{"index", index},
            {"delta", {{"tool_calls", json::array({{{"index", k}, {"function", {{"arguments", call.arguments}}}}})}}},
            {"logprobs", nullptr},
            {"finish_reason", nullptr}}});
      send_event(args);
    }
    if (c.finished && c.tool_stream->saw_calls() && c.finish_reason == "stop") c.finish_reason = "tool_calls";
    // Held-back text is no event (its logprobs go out with the next one).
    if (!out.content.empty() || c.finished) stream_text_delta(index, out.content);
  }

  // Streams what a choice released since the last chunk; with its finish reason when done.
  void stream_delta(int32_t index, const std::string& text) {
    if (chat() && structured.uses_tools()) return stream_tool_output(index, text);
    stream_text_delta(index, text);
  }

  void stream_text_delta(int32_t index, const std::string& text) {
    Choice& c = choices[static_cast<size_t>(index)];
    const size_t ready = c.finished ? kept_tokens(c) : [&] {
      size_t n = c.tokens_reported;
      while (n < c.tokens.size() && c.tokens[n].offset < c.filter->released()) ++n;
      return n;
    }();
    if (text.empty() && !c.finished && ready == c.tokens_reported) return;
    if (!c.error.empty()) {
      send_event({{"error", {{"message", "generation failed: " + c.error}, {"type", "server_error"},
                             {"param", nullptr}, {"code", nullptr}}}});
    }
    // With echo, offsets count from the start of the prompt's text, as in a whole response.
    const size_t text_base = spec.echo ? echoes[static_cast<size_t>(index / spec.n)].text.size() : 0;
    json lp = logprobs_json(c, c.tokens_reported, ready, text_base);
    c.tokens_reported = ready;
    json choice = {{"index", index}, {"logprobs", lp},
                   {"finish_reason", c.finished ? json(c.finish_reason) : json(nullptr)}};
    if (chat()) {
      choice["delta"] = text.empty() ? json::object() : json{{"content", text}};
    } else {
      choice["text"] = text;
    }
    json j = chunk_base();
    j["choices"] = json::array({choice});
    send_event(j);
  }

  void start_stream() {
    channel->start_stream(http::status::ok, "text/event-stream", gateway_headers());
    service->metrics_.count_request(endpoint, 200);
    if (!chat()) {
      // echo: each choice's stream opens with its prompt; with logprobs, once the prompt's
      // logprobs are computed (stream_echo).
      if (!spec.echo) return;
      if (streams_echo_logprobs()) {
        echo_streamed.assign(echoes.size(), 0);
        return;
      }
      for (size_t i = 0; i < choices.size(); ++i) {
        json j = chunk_base();
        j["choices"] = json::array({{{"index", i}, {"text", echoes[i / static_cast<size_t>(spec.n)].text},
                                     {"logprobs", nullptr}, {"finish_reason", nullptr}}});
        send_event(j);
      }
      return;
    }
    // Chat streams open each choice with the assistant role, as OpenAI does.
    for (size_t i = 0; i < choices.size(); ++i) {
      json j = chunk_base();
      j["choices"] = json::array(
          {{{"index", i}, {"delta", {{"role", "assistant"}, {"content", ""}}}, {"logprobs", nullptr},
            {"finish_reason", nullptr}}});
      send_event(j);
    }
  }

  bool streams_echo_logprobs() const { return spec.stream && spec.echo && spec.logprobs && !chat(); }

  // The echo chunk of each choice of prompt `p`, with the prompt's logprobs, then the text its
  // choices produced meanwhile. Once per prompt.
  void stream_echo(size_t p) {
    if (p >= echo_streamed.size() || echo_streamed[p]) return;
    echo_streamed[p] = 1;
    const PromptEcho& echo = echoes[p];
    for (int32_t k = 0; k < spec.n; ++k) {
      const auto index = static_cast<int32_t>(p) * spec.n + k;
      Choice& c = choices[static_cast<size_t>(index)];
      json j = chunk_base();
      j["choices"] = json::array({{{"index", index}, {"text", echo.text},
                                   {"logprobs", logprobs_json(c, 0, 0, 0, &echo)}, {"finish_reason", nullptr}}});
      send_event(j);
      if (!c.unsent_text.empty() || c.finished || c.tokens_reported < c.tokens.size())
        stream_delta(index, std::exchange(c.unsent_text, std::string()));
    }
  }

  void finish_stream() {
    if (spec.include_usage) {
      json j = chunk_base();
      j["choices"] = json::array();
      j["usage"] = usage();
      send_event(j);
    }
    channel->send_chunk("data: [DONE]\n\n");
    channel->end_stream();
    log_done(200);
  }
};

// Hands a deployment's callbacks (engine thread, cache worker) to the call on the io thread.
class CallSink : public RequestSink {
 public:
  CallSink(std::shared_ptr<GenerationCall> call, boost::asio::any_io_executor executor, int32_t prompt)
      : call_(std::move(call)), executor_(std::move(executor)), prompt_(prompt) {}

  // The engine thread (or a cache worker) usually drops the last reference to the sink, and
  // the call must not die there: it owns the HTTP session, whose destructor takes it out of
  // the server's session set, which only the io thread may touch (a data race TSan found in
  // integration_server_robustness; in a busy server, a torn std::set). The io thread drops it.
  ~CallSink() override {
    try {
      boost::asio::post(executor_, [call = std::move(call_)]() mutable { call.reset(); });
    } catch (...) {
      // Out of memory for the handler: nothing better than dropping it here.
    }
  }

  void on_start(const ServedBy& served) override {
    boost::asio::post(executor_, [call = call_, served, prompt = prompt_] {
      try {
        call->on_start(prompt, served);
      } catch (const std::exception& ex) {
        call->fail_internal(ex.what());
      }
    });
  }

  void on_event(const GenerationEvent& ev) override {
    // Copy what the io thread needs and hand it over.
    GenerationCall::Event e;
    e.prompt = prompt_;
    e.choice = ev.choice;
    e.cached_prompt_tokens = ev.num_cached_prompt_tokens;
    e.tokens = ev.tokens;
    e.finished = ev.finished;
    e.reason = ev.finish_reason;
    if (!ev.error.is_ok()) e.error = ev.error.message();
    if (ev.finished && ev.timings) e.timings = *ev.timings;
    e.prompt_logprobs = ev.prompt_logprobs;
    boost::asio::post(executor_, [call = call_, e = std::move(e)]() mutable {
      try {
        call->on_event(std::move(e));
      } catch (const std::exception& ex) {
        call->fail_internal(ex.what());
      }
    });
  }

 private:
  std::shared_ptr<GenerationCall> call_;
  boost::asio::any_io_executor executor_;
  int32_t prompt_;
};

OpenAiService::OpenAiService(Gateway& gateway, const ServerConfig& config, std::vector<std::string> api_keys)
    : gateway_(gateway), config_(config), api_keys_(std::move(api_keys)), created_(unix_now()) {}

OpenAiService::~OpenAiService() = default;

size_t OpenAiService::open_calls() const {
  size_t n = 0;
  for (const auto& [serial, weak] : calls_)
    if (auto call = weak.lock(); call && !call->responded) ++n;
  return n;
}

void OpenAiService::cancel_all() {
  for (const auto& [serial, weak] : calls_)
    if (auto call = weak.lock()) call->abort();
}

void OpenAiService::end_all_as_aborted() {
  for (const auto& [serial, weak] : calls_)
    if (auto call = weak.lock()) call->end_as_aborted();
}

bool OpenAiService::authorized(const HttpRequest& req) const {
  if (api_keys_.empty()) return true;
  const auto header = req[http::field::authorization];
  constexpr boost::beast::string_view kBearer = "Bearer ";
  if (header.size() <= kBearer.size() || !boost::beast::iequals(header.substr(0, kBearer.size()), kBearer))
    return false;
  const std::string_view presented(header.data() + kBearer.size(), header.size() - kBearer.size());
  bool ok = false;
  for (const auto& key : api_keys_) ok |= constant_time_equal(presented, key);
  return ok;
}

void OpenAiService::log_access(const AccessRecord& r, int status, const AccessFigures* f) const {
  if (!access_log_) return;
  const double duration = ms_since(r.start);
  if (!f) {
    access_logger()->info("method={} path={} status={} duration_ms={:.1f}", r.method, r.path, status, duration);
    return;
  }
  access_logger()->info(
      "method={} path={} status={} duration_ms={:.1f} id={} prompt_tokens={} completion_tokens={} "
      "cached_tokens={} ttft_ms={:.1f}",
      r.method, r.path, status, duration, f->id, f->prompt_tokens, f->completion_tokens, f->cached_tokens,
      f->ttft_ms);
}

void OpenAiService::reply(const std::shared_ptr<ResponseChannel>& channel, const std::string& endpoint,
                          HttpResponse res) {
  const int status = static_cast<int>(res.result_int());
  metrics_.count_request(endpoint, status);
  if (current_) {
    log_access(*current_, status);
    current_.reset();
  }
  channel->respond(std::move(res));
}

void OpenAiService::reply_error(const std::shared_ptr<ResponseChannel>& channel, const std::string& endpoint,
                                http::status status, const std::string& message, const std::string& type,
                                const std::string& param, const std::string& code) {
  reply(channel, endpoint, make_error_response(status, message, type, param, code));
}

json OpenAiService::model_card(const Deployment& d) const {
  return {{"id", d.name()},
          {"object", "model"},
          {"created", created_},
          {"owned_by", "tessera"},
          {"max_model_len", d.max_context()}};
}

json OpenAiService::router_card() const {
  return {{"id", gateway_.router_name()}, {"object", "model"}, {"created", created_}, {"owned_by", "tessera"},
          {"tessera_router", true}};
}

std::string OpenAiService::served_ids() const {
  std::string ids;
  for (size_t i = 0; i < gateway_.num_deployments(); ++i)
    ids += (ids.empty() ? "'" : ", '") + gateway_.deployment(i).name() + "'";
  if (gateway_.has_router()) ids += ", '" + gateway_.router_name() + "' (a router)";
  return ids;
}

void OpenAiService::reply_unknown_model(const std::shared_ptr<ResponseChannel>& channel, const std::string& endpoint,
                                        const std::string& model) {
  reply_error(channel, endpoint, http::status::not_found,
              "the model '" + model + "' does not exist; this server serves " + served_ids(), "invalid_request_error",
              "model", "model_not_found");
}

std::string OpenAiService::endpoint_label(std::string_view target) {
  std::string_view path = target.substr(0, target.find('?'));
  // Metric labels only for known routes: arbitrary paths must not grow the label set.
  static const char* kRoutes[] = {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health",
                                  "/metrics",        "/tokenize",            "/detokenize", "/v1/stats",
                                  "/dashboard",      "/v1/embeddings",       "/v1/route_feedback"};
  for (const char* r : kRoutes)
    if (path == r) return r;
  if (path.rfind("/v1/models/", 0) == 0) return "/v1/models";
  return "other";
}

void OpenAiService::handle(HttpRequest request, std::shared_ptr<ResponseChannel> channel) {
  const std::string_view target(request.target().data(), request.target().size());
  const std::string endpoint = endpoint_label(target);
  current_ = AccessRecord{std::string(request.method_string()), loggable_path(target),
                          std::chrono::steady_clock::now()};
  // Nothing a request does may end the server: whatever escapes the handlers is answered here
  // (a no-op when the request was answered already) and the server goes on.
  try {
    route(request, channel, endpoint);
  } catch (const json::exception& e) {
    // Reading a field the validation let through the wrong way is still the body's fault.
    reply_error(channel, endpoint, http::status::bad_request,
                std::string("the request body could not be read: ") + e.what(), "invalid_request_error");
  } catch (const std::exception& e) {
    spdlog::error("serve: {} {}: {}", std::string(request.method_string()), endpoint, e.what());
    reply_error(channel, endpoint, http::status::internal_server_error,
                std::string("internal error: ") + e.what(), "server_error");
  }
  current_.reset();
}

void OpenAiService::on_protocol_error(std::string_view target, int status) {
  metrics_.count_request(endpoint_label(target), status);
  log_access(AccessRecord{"-", loggable_path(target), std::chrono::steady_clock::now()}, status);
}

void OpenAiService::route(const HttpRequest& req, const std::shared_ptr<ResponseChannel>& channel,
                          const std::string& endpoint) {
  std::string path(req.target());
  if (auto q = path.find('?'); q != std::string::npos) path.resize(q);
  const bool get = req.method() == http::verb::get || req.method() == http::verb::head;
  const bool post = req.method() == http::verb::post;
  auto wrong_method = [&](const char* allowed) {
    auto res = make_error_response(http::status::method_not_allowed,
                                   std::string(req.method_string()) + " is not allowed on " + path + "; use " + allowed,
                                   "invalid_request_error");
    res.set(http::field::allow, allowed);
    reply(channel, endpoint, std::move(res));
  };

  if (path == "/health") {
    if (!get) return wrong_method("GET");
    if (draining_)
      return reply(channel, endpoint, make_json_response(http::status::service_unavailable, R"({"status":"shutting down"})"));
    return reply(channel, endpoint, make_json_response(http::status::ok, R"({"status":"ok"})"));
  }
  if (path == "/metrics") {
    if (!get) return wrong_method("GET");
    HttpResponse res{http::status::ok, 11};
    res.set(http::field::content_type, "text/plain; version=0.0.4; charset=utf-8");
    metrics_.set_in_flight(in_flight_);
    res.body() = metrics_.render(gateway_.engine(0).stats());
    std::vector<std::pair<std::string, EngineStats>> engines;
    for (size_t i = 0; i < gateway_.num_deployments(); ++i)
      engines.emplace_back(gateway_.deployment(i).name(), gateway_.engine(i).stats());
    ServerMetrics::render_deployment_engines(engines, &res.body());
    gateway_.render_cache_metrics(&res.body());
    gateway_.render_router_metrics(&res.body());
    gateway_.render_disaggregation_metrics(&res.body());
    gateway_.render_replica_metrics(&res.body());
    return reply(channel, endpoint, std::move(res));
  }
  if (stats_ && (path == "/v1/stats" || path == "/dashboard")) {
    if (!get) return wrong_method("GET");
    // The page is opened from a browser address bar, so it also takes its key as ?key=.
    bool ok = api_keys_.empty() || authorized(req);
    if (!ok && path == "/dashboard") {
      const std::string key = query_param(std::string_view(req.target().data(), req.target().size()), "key");
      for (const auto& k : api_keys_) ok |= constant_time_equal(key, k);
    }
    if (!ok) {
      auto res = make_error_response(http::status::unauthorized,
                                     path == "/dashboard" ? "missing or invalid API key: open /dashboard?key=<key>"
                                                          : "missing or invalid API key: send 'Authorization: Bearer <key>'",
                                     "invalid_request_error", "", "invalid_api_key");
      res.set(http::field::www_authenticate, "Bearer");
      return reply(channel, endpoint, std::move(res));
    }
    if (path == "/dashboard") return reply(channel, endpoint, dashboard_response());
    metrics_.set_in_flight(in_flight_);
    return reply(channel, endpoint,
                 stats_->respond(std::string_view(req.target().data(), req.target().size())));
  }
  const bool tokenizer_route = path == "/tokenize" || path == "/detokenize";
  const bool known = path == "/v1/completions" || path == "/v1/chat/completions" || path == "/v1/models" ||
                     path.rfind("/v1/models/", 0) == 0 || tokenizer_route || path == "/v1/embeddings" ||
                     path == "/v1/route_feedback";
  if (!known) {
    return reply_error(channel, endpoint, http::status::not_found, "no route for " + path,
                       "invalid_request_error", "", "unknown_url");
  }
  // Every route but /health and /metrics needs a key when keys are configured.
  if (!authorized(req)) {
    // The presented key is never logged or echoed.
    auto res = make_error_response(http::status::unauthorized,
                                   "missing or invalid API key: send 'Authorization: Bearer <key>'",
                                   "invalid_request_error", "", "invalid_api_key");
    res.set(http::field::www_authenticate, "Bearer");
    return reply(channel, endpoint, std::move(res));
  }
  if (path == "/v1/models") {
    if (!get) return wrong_method("GET");
    json data = json::array();
    for (size_t i = 0; i < gateway_.num_deployments(); ++i) data.push_back(model_card(gateway_.deployment(i)));
    if (gateway_.has_router()) data.push_back(router_card());
    if (gateway_.embedding_model()) data.push_back(embedding_model_card());
    json body = {{"object", "list"}, {"data", data}};
    return reply(channel, endpoint, make_json_response(http::status::ok, dump(body)));
  }
  if (path.rfind("/v1/models/", 0) == 0) {
    if (!get) return wrong_method("GET");
    const std::string id = path.substr(std::string("/v1/models/").size());
    if (gateway_.has_router() && id == gateway_.router_name())
      return reply(channel, endpoint, make_json_response(http::status::ok, dump(router_card())));
    if (gateway_.embedding_model() && id == gateway_.embedding_model()->name())
      return reply(channel, endpoint, make_json_response(http::status::ok, dump(embedding_model_card())));
    const Deployment* d = gateway_.find(id);
    if (!d) return reply_unknown_model(channel, endpoint, id);
    return reply(channel, endpoint, make_json_response(http::status::ok, dump(model_card(*d))));
  }
  if (!post) return wrong_method("POST");
  if (path == "/tokenize") return handle_tokenize(req, channel, endpoint);
  if (path == "/detokenize") return handle_detokenize(req, channel, endpoint);
  if (path == "/v1/embeddings") return handle_embeddings(req, channel, endpoint);
  if (path == "/v1/route_feedback") return handle_route_feedback(req, channel, endpoint);
  handle_generation(req, channel, endpoint, path == "/v1/chat/completions");
}

std::optional<json> OpenAiService::read_json_object(const HttpRequest& req,
                                                    const std::shared_ptr<ResponseChannel>& channel,
                                                    const std::string& endpoint) {
  JsonBodyError json_error;
  std::optional<json> body = parse_json_body(req.body(), &json_error);
  if (!body) {
    reply_error(channel, endpoint, http::status::bad_request, json_error.message, "invalid_request_error",
                json_error.param);
    return std::nullopt;
  }
  if (!body->is_object()) {
    reply_error(channel, endpoint, http::status::bad_request, "the request body must be a JSON object",
                "invalid_request_error");
    return std::nullopt;
  }
  return body;
}

// The tokenizer routes take "model" as vLLM does: optional (the first deployment), but when
// given it must name a deployment (a router's arms may tokenize differently).
Deployment* OpenAiService::tokenizer_deployment(const json& body, const std::shared_ptr<ResponseChannel>& channel,
                                                const std::string& endpoint) {
  auto m = body.find("model");
  if (m == body.end() || m->is_null()) return &gateway_.deployment(0);
  if (!m->is_string()) {
    reply_error(channel, endpoint, http::status::bad_request, "model: expected a string, got " + describe_json(*m),
                "invalid_request_error", "model");
    return nullptr;
  }
  const std::string& name = m->get_ref<const std::string&>();
  if (Deployment* d = gateway_.find(name)) return d;
  if (gateway_.has_router() && name == gateway_.router_name()) {
    reply_error(channel, endpoint, http::status::bad_request,
                "model: '" + name + "' is a router, whose arms may tokenize differently; name a deployment: " +
                    served_ids(),
                "invalid_request_error", "model");
    return nullptr;
  }
  reply_unknown_model(channel, endpoint, name);
  return nullptr;
}

// vLLM's POST /tokenize: {"prompt": text, "add_special_tokens": true} or the chat form
// {"messages": [...], "add_generation_prompt": true}; answers {"count", "max_model_len",
// "tokens", "token_strs"}. Tokens are what /v1/completions (or /v1/chat/completions) would
// feed the model for the same input.
void OpenAiService::handle_tokenize(const HttpRequest& req, const std::shared_ptr<ResponseChannel>& channel,
                                    const std::string& endpoint) {
  const auto bad_request = [&](const std::string& message, const std::string& param) {
    reply_error(channel, endpoint, http::status::bad_request, message, "invalid_request_error", param);
  };
  auto body = read_json_object(req, channel, endpoint);
  if (!body) return;
  const auto flag = [&](const char* key, bool fallback, bool* out) {
    auto it = body->find(key);
    if (it == body->end() || it->is_null()) {
      *out = fallback;
      return true;
    }
    if (!it->is_boolean()) {
      bad_request(std::string(key) + ": expected a boolean, got " + describe_json(*it), key);
      return false;
    }
    *out = it->get<bool>();
    return true;
  };
  Deployment* deployment = tokenizer_deployment(*body, channel, endpoint);
  if (!deployment) return;
  const Model& model = deployment->model();
  const Tokenizer& tok = model.tokenizer();
  bool return_strs = false, add_special = true, parse_special = true;
  if (!flag("return_token_strs", false, &return_strs)) return;
  std::vector<TokenId> ids;
  const bool chat = body->contains("messages") && !(*body)["messages"].is_null();
  if (chat) {
    if (body->contains("prompt") && !(*body)["prompt"].is_null())
      return bad_request("prompt: give either prompt or messages, not both", "prompt");
    ApiError error;
    std::vector<ChatMessage> messages;
    if (!parse_chat_messages(*body, &messages, &error)) return bad_request(error.message, error.param);
    bool add_generation_prompt = true;
    if (!flag("add_generation_prompt", true, &add_generation_prompt)) return;
    // Defaults as /v1/chat/completions tokenizes, so count equals its usage.prompt_tokens.
    if (!flag("add_special_tokens", true, &add_special)) return;
    if (model.chat_template().empty())
      return bad_request("this model has no chat template; tokenize a prompt instead", "messages");
    std::string text;
    try {
      text = apply_chat_template(model.chat_template(), prepare_chat_messages(messages, StructuredOutput{}),
                                 add_generation_prompt);
    } catch (const std::exception& e) {
      return reply_error(channel, endpoint, http::status::internal_server_error,
                         std::string("cannot apply the model's chat template: ") + e.what(), "server_error");
    }
    ids = tok.encode(text, add_special, /*parse_special=*/true);
  } else {
    auto p = body->find("prompt");
    if (p == body->end() || p->is_null()) return bad_request("prompt: required (or messages)", "prompt");
    if (!p->is_string()) return bad_request("prompt: expected a string, got " + describe_json(*p), "prompt");
    if (!flag("add_special_tokens", true, &add_special)) return;
    if (!flag("parse_special", true, &parse_special)) return;
    ids = tok.encode(p->get_ref<const std::string&>(), add_special, parse_special);
  }
  json out = {{"count", ids.size()}, {"max_model_len", deployment->max_context()}, {"tokens", ids},
              {"token_strs", nullptr}};
  if (return_strs) {
    json strs = json::array();
    for (TokenId id : ids) strs.push_back(tok.token_to_piece(id, /*render_special=*/true));
    out["token_strs"] = std::move(strs);
  }
  reply(channel, endpoint, make_json_response(http::status::ok, dump(out)));
}

// vLLM's POST /detokenize: {"tokens": [ids]} -> {"prompt": text}, special tokens rendered.
void OpenAiService::handle_detokenize(const HttpRequest& req, const std::shared_ptr<ResponseChannel>& channel,
                                      const std::string& endpoint) {
  const auto bad_request = [&](const std::string& message, const std::string& param) {
    reply_error(channel, endpoint, http::status::bad_request, message, "invalid_request_error", param);
  };
  auto body = read_json_object(req, channel, endpoint);
  if (!body) return;
  Deployment* deployment = tokenizer_deployment(*body, channel, endpoint);
  if (!deployment) return;
  const Tokenizer& tok = deployment->model().tokenizer();
  auto t = body->find("tokens");
  if (t == body->end() || t->is_null()) return bad_request("tokens: required", "tokens");
  if (!t->is_array()) return bad_request("tokens: expected a list of token ids, got " + describe_json(*t), "tokens");
  std::vector<int32_t> ids;
  ids.reserve(t->size());
  for (size_t i = 0; i < t->size(); ++i) {
    const json& v = (*t)[i];
    const std::string param = "tokens[" + std::to_string(i) + "]";
    if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() >= tok.vocab_size())
      return bad_request(param + ": expected a token id in 0.." + std::to_string(tok.vocab_size() - 1) + ", got " +
                             describe_json(v),
                         param);
    ids.push_back(static_cast<int32_t>(v.get<int64_t>()));
  }
  reply(channel, endpoint,
        make_json_response(http::status::ok, dump({{"prompt", tok.decode(ids, /*render_special=*/true)}})));
}

void OpenAiService::handle_generation(const HttpRequest& req, const std::shared_ptr<ResponseChannel>& channel,
                                      const std::string& endpoint, bool chat) {
  const auto bad_request = [&](const std::string& message, const std::string& param) {
    reply_error(channel, endpoint, http::status::bad_request, message, "invalid_request_error", param);
  };
  auto body = read_json_object(req, channel, endpoint);
  if (!body) return;
  ApiError error;
  apply_request_defaults(config_.defaults, chat ? ApiKind::kChat : ApiKind::kCompletion, &*body);
  auto spec = parse_generation_request(*body, chat ? ApiKind::kChat : ApiKind::kCompletion, &error);
  if (!spec) return bad_request(error.message, error.param);
  Deployment* deployment = gateway_.find(spec->model);
  const bool routed = !deployment && gateway_.has_router() && spec->model == gateway_.router_name();
  if (!deployment && !routed) return reply_unknown_model(channel, endpoint, spec->model);
  if (draining_)
    return reply_error(channel, endpoint, http::status::service_unavailable, "the server is shutting down",
                       "server_error", "", "shutting_down");
  // Each prompt of a batch is one engine request and counts against the queue limit.
  const int64_t num_prompts = chat ? 1 : static_cast<int64_t>(spec->prompts.size());
  if (num_prompts > config_.max_queued_requests)
    return bad_request("prompt: a batch of " + std::to_string(num_prompts) + " prompts exceeds the server's " +
                           std::to_string(config_.max_queued_requests) +
                           " queued requests (server.max_queued_requests); send smaller batches",
                       "prompt");
  if (in_flight_ + num_prompts > config_.max_queued_requests) {
    metrics_.count_rejected_full_queue();
    auto res = make_error_response(http::status::too_many_requests,
                                   "the server is at its limit of " + std::to_string(config_.max_queued_requests) +
                                       " queued requests; retry later",
                                   "rate_limit_error", "", "queue_full");
    res.set(http::field::retry_after, "1");
    return reply(channel, endpoint, std::move(res));
  }

  // Only a digest of the API key leaves here.
  std::string key_digest;
  if (const auto auth = req[http::field::authorization]; !auth.empty())
    key_digest = "key:" + std::to_string(std::hash<std::string_view>{}(std::string_view(auth.data(), auth.size())));
  // What a router classifies and a semantic cache embeds: the messages' contents, or the prompt.
  std::string semantic_text;
  if (chat) {
    for (const auto& m : spec->messages) semantic_text += m.content + "\n";
  } else if (!spec->prompts.empty() && spec->prompts[0].text) {
    semantic_text = *spec->prompts[0].text;
  }
  PendingGeneration g;
  g.chat = chat;
  g.spec = std::move(*spec);
  g.key_digest = std::move(key_digest);
  g.semantic_text = std::move(semantic_text);
  g.deployment = deployment;
  g.routed = routed;
  if (routed) {
    // Sticky per end user: the `user` field, else the API key.
    const std::string user = g.spec.user.empty() ? g.key_digest : g.spec.user;
    if (gateway_.router_needs_embedding() && !g.semantic_text.empty()) {
      // The router reads the prompt's embedding: a model forward, so it runs on the gateway's
      // embedding thread with the routing decision, and the request continues on this thread.
      g.body = req.body();
      const uint64_t request_id = next_call_++;
      const auto start = std::chrono::steady_clock::now();
      ++in_flight_;  // counted while it waits for the embedding, as an embeddings request is
      AccessRecord access = current_ ? *current_ : AccessRecord{};
      current_.reset();
      auto pending = std::make_shared<PendingGeneration>(std::move(g));
      auto executor = channel->executor();
      gateway_.post_embedding_job([this, pending, channel, endpoint, executor, access, user, request_id,
                                   start](EncoderModel& m) {
        try {
          pending->embedding = std::move(m.embed({m.encode(pending->semantic_text)})[0]);
        } catch (const std::exception& e) {
          // The router then decides without it (the classifier sends such a request to large).
          spdlog::warn("serve: embedding the prompt for the router failed: {}", e.what());
          pending->embedding.clear();
        }
        RouteRequest route;
        route.request_id = request_id;
        route.user = user;
        route.prompt = pending->semantic_text;
        route.embedding = pending->embedding;
        Status st = gateway_.route(route, &pending->deployment);
        const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        boost::asio::post(executor, [this, pending, channel, endpoint, access, st, seconds]() mutable {
          --in_flight_;
          current_ = access.path.empty() ? std::nullopt : std::optional<AccessRecord>(access);
          try {
            finish_routing(*pending, st, seconds, channel, endpoint);
          } catch (const std::exception& e) {
            spdlog::error("serve: POST {}: {}", endpoint, e.what());
            reply_error(channel, endpoint, http::status::internal_server_error,
                        std::string("internal error: ") + e.what(), "server_error");
          }
          current_.reset();
        });
      });
      return;
    }
    RouteRequest route;
    route.request_id = next_call_;
    route.user = user;
    route.prompt = g.semantic_text;
    const auto start = std::chrono::steady_clock::now();
    Status st = gateway_.route(route, &g.deployment);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    g.body = req.body();
    return finish_routing(g, st, seconds, channel, endpoint);
  }
  g.body = req.body();
  submit_generation(g, channel, endpoint);
}

void OpenAiService::finish_routing(PendingGeneration& g, const Status& st, double seconds,
                                   const std::shared_ptr<ResponseChannel>& channel, const std::string& endpoint) {
  if (!st.is_ok())
    return reply_error(channel, endpoint, http::status::internal_server_error,
                       "router '" + gateway_.router_name() + "': " + st.message(), "server_error");
  metrics_.observe_route_decision(gateway_.router_name(), seconds);
  metrics_.count_route(gateway_.router_name(), g.deployment->name());
  if (draining_)
    return reply_error(channel, endpoint, http::status::service_unavailable, "the server is shutting down",
                       "server_error", "", "shutting_down");
  submit_generation(g, channel, endpoint);
}

// The rest of a generation request once its deployment is known: structured output, the chat
// template and tokenization (with the chosen model's tokenizer), then submission.
void OpenAiService::submit_generation(PendingGeneration& g, const std::shared_ptr<ResponseChannel>& channel,
                                      const std::string& endpoint) {
  const auto bad_request = [&](const std::string& message, const std::string& param) {
    reply_error(channel, endpoint, http::status::bad_request, message, "invalid_request_error", param);
  };
  ApiError error;
  const bool chat = g.chat;
  const bool routed = g.routed;
  Deployment* deployment = g.deployment;
  std::optional<GenerationSpec> spec = std::move(g.spec);
  const std::string& key_digest = g.key_digest;
  const std::string& semantic_text = g.semantic_text;
  const std::string arm = routed ? deployment->name() : std::string();
  // response_format, tools (chat) and the guided decoding fields (both), read from the body
  // with its key order kept (schema properties are generated in the order the client wrote
  // them), compiled by the constraint plugin.
  StructuredOutput structured;
  std::shared_ptr<const CompiledConstraint> constraint;
  {
    nlohmann::ordered_json ordered;
    try {
      ordered = nlohmann::ordered_json::parse(g.body);  // already parsed once: valid, bounded depth
    } catch (const std::exception& e) {
      return bad_request(std::string("the body is not valid JSON: ") + e.what(), "");
    }
    auto so = parse_structured_output(ordered, &error);
    if (!so) return bad_request(error.message, error.param);
    structured = std::move(*so);
    if (structured.constrained()) {
      const std::string field = structured.constraint_field();
      Status st = deployment->compile_constraint(constraint_spec(structured), &constraint);
      if (st.code() == StatusCode::kInvalidArgument) {
        const ApiError e = constraint_error(structured, st.message());
        return bad_request(e.message, e.param);
      }
      if (st.code() == StatusCode::kUnimplemented)
        return bad_request(field + ": structured output needs a constraint plugin, and this deployment has none "
                           "(engine.constraint)", field);
      if (!st.is_ok())
        return reply_error(channel, endpoint, http::status::internal_server_error, field + ": " + st.message(),
                           "server_error");
    }
  }

  const Model& model = deployment->model();
  const Tokenizer& tok = model.tokenizer();
  std::vector<std::vector<TokenId>> prompts;
  std::vector<std::string> prompt_texts;  // what cache keys see
  if (chat) {
    if (model.chat_template().empty())
      return bad_request("this model has no chat template; use /v1/completions", "messages");
    std::string text;
    try {
      text = apply_chat_template(model.chat_template(), prepare_chat_messages(spec->messages, structured),
                                 /*add_generation_prompt=*/true);
    } catch (const std::exception& e) {
      return reply_error(channel, endpoint, http::status::internal_server_error,
                         std::string("cannot apply the model's chat template: ") + e.what(), "server_error");
    }
    // Templates spell control tokens as text.
    prompts.push_back(tok.encode(text, /*add_special=*/true, /*parse_special=*/true));
    prompt_texts.push_back(std::move(text));
  } else {
    for (const PromptInput& p : spec->prompts) {
      prompts.push_back(p.text ? tok.encode(*p.text, /*add_special=*/true, spec->parse_special) : p.ids);
      std::string key;
      if (p.text) {
        key = *p.text;
      } else {
        // Token ids cannot collide with text: no text prompt starts with a NUL byte.
        key = std::string(1, '\0') + "ids:";
        for (int32_t id : p.ids) key += std::to_string(id) + ",";
      }
      prompt_texts.push_back(std::move(key));
    }
  }
  const bool batch = prompts.size() > 1;

  auto call = std::make_shared<GenerationCall>();
  call->service = this;
  call->deployment = deployment;
  if (routed) {
    call->router = gateway_.router_name();
    call->arm = arm;
  }
  call->serial = next_call_++;
  call->channel = channel;
  call->endpoint = endpoint;
  call->id = random_id(chat ? "chatcmpl-" : "cmpl-");
  // Feedback may later name the deployment that should have answered (/v1/route_feedback).
  if (routed) route_ledger_.record(call->id, call->router, call->arm);
  call->created = unix_now();
  if (current_) call->access = *current_;
  call->choices.resize(prompts.size() * static_cast<size_t>(spec->n));
  for (auto& c : call->choices) {
    c.detok = std::make_unique<StreamingDetokenizer>(tok);
    c.filter = std::make_unique<StopStringFilter>(spec->stop);
  }
  call->spec = std::move(*spec);
  if (call->spec.echo)
    for (size_t p = 0; p < prompts.size(); ++p) {
      const PromptInput& in = call->spec.prompts[p];
      call->echoes.push_back(make_echo(tok, prompts[p], in.text ? &*in.text : nullptr));
    }
  call->structured = std::move(structured);

  auto executor = channel->executor();
  int64_t submitted_tokens = 0;
  // A cached answer stands for one sample of one prompt without logprobs (of the output or
  // the prompt) and without a constraint (its schema is not part of the key).
  const bool cacheable = prompts.size() == 1 && call->spec.n == 1 && !call->spec.logprobs &&
                         call->spec.prompt_logprobs < 0 && !constraint;
  std::string extra_params;
  if (!chat && !call->spec.parse_special) extra_params = "parse_special=0;";
  for (size_t p = 0; p < prompts.size(); ++p) {
    const int32_t prompt_len = static_cast<int32_t>(prompts[p].size());
    DeploymentRequest dreq;
    GenerationRequest& greq = dreq.generation;
    greq.prompt = std::move(prompts[p]);
    greq.params = call->spec.params;
    if (!call->spec.max_tokens_given) {
      // OpenAI: 16 for completions; chat runs until the context is full.
      greq.params.max_tokens =
          chat ? std::max(1, deployment->max_context() - prompt_len) : kCompletionDefaultMaxTokens;
    }
    greq.n = call->spec.n;
    greq.prompt_logprobs = call->spec.prompt_logprobs;
    greq.constraint = constraint;
    dreq.cacheable = cacheable;
    if (cacheable) {
      dreq.prompt_text = std::move(prompt_texts[p]);
      dreq.output_params = canonical_output_params(greq.params, call->spec.stop) + extra_params;
      dreq.reproducible = is_reproducible(greq.params);
      dreq.semantic_text = semantic_text;
      dreq.embedding = g.embedding;  // the router's, reused by the semantic cache
      // A semantic hit must never show one tenant another's answer: the key and the user both
      // separate caches.
      dreq.tenant = key_digest + "|" + call->spec.user;
    }
    auto sink = std::make_shared<CallSink>(call, executor, static_cast<int32_t>(p));
    std::unique_ptr<RequestHandle> handle;
    Status st = deployment->submit(std::move(dreq), std::move(sink), &handle);
    if (!st.is_ok()) {
      // The prompts already submitted are cancelled; their events find the call answered.
      call->responded = true;
      call->logged = true;
      call->cancel_engine();
      metrics_.set_in_flight(in_flight_);
      std::string message = st.message(), param = param_of(message);
      if (batch) {
        const std::string where = "prompt[" + std::to_string(p) + "]";
        if (param == "prompt") {
          message = where + message.substr(std::string("prompt").size());
          param = where;
        } else {
          message += " (" + where + ")";
        }
      }
      return reply_error(channel, endpoint, status_for(st), message,
                         status_for(st) == http::status::bad_request ? "invalid_request_error" : "server_error",
                         param);
    }
    call->handles.push_back(std::move(handle));
    call->open_per_prompt.push_back(call->spec.n);
    call->prompt_tokens_each.push_back(prompt_len);
    call->cached_each.push_back(0);
    call->cancel_sent.push_back(0);
    call->engine_open += call->spec.n;
    ++in_flight_;
    submitted_tokens += prompt_len;
  }
  metrics_.set_in_flight(in_flight_);
  metrics_.count_tokens(submitted_tokens, 0);
  calls_[call->serial] = call;
  // Forget finished calls so the registry stays small.
  for (auto it = calls_.begin(); it != calls_.end();) it = it->second.expired() ? calls_.erase(it) : std::next(it);
  std::weak_ptr<GenerationCall> weak = call;
  channel->on_disconnect([weak] {
    if (auto c = weak.lock()) c->client_gone();
  });
  // The call writes its own access line when it ends; a stream starts once the deployment
  // (or its cache) says who answers, so the headers can tell.
  current_.reset();
}

}  // namespace tessera::server
