// The OpenAI request parser and the stop-string filter of `tessera serve`.
#include <doctest/doctest.h>

#include "server/http_server.h"
#include "server/json_body.h"
#include "server/openai_protocol.h"

using nlohmann::json;
using tessera::server::ApiError;
using tessera::server::ApiKind;
using tessera::server::parse_generation_request;
using tessera::server::StopStringFilter;

namespace {

std::string run_filter(StopStringFilter& f, const std::vector<std::string>& pieces, std::vector<std::string>* released) {
  std::string out;
  for (const auto& p : pieces) {
    std::string r = f.push(p);
    released->push_back(r);
    out += r;
    if (f.matched()) return out;
  }
  return out + f.flush();
}

}  // namespace

TEST_CASE("a stop string split across pieces is found, cut, and never released") {
  StopStringFilter f({"STOP"});
  std::vector<std::string> released;
  const std::string out = run_filter(f, {"Hello S", "T", "OP and more"}, &released);
  CHECK(out == "Hello ");
  CHECK(f.matched());
  // "S" and "ST" could begin the stop string, so they were held back, not streamed.
  CHECK(released[0] == "Hello ");
  CHECK(released[1].empty());
  CHECK(f.released() == 6);
}

TEST_CASE("held-back text that turns out not to be a stop string is released") {
  StopStringFilter f({"\n\n", "END"});
  std::vector<std::string> released;
  const std::string out = run_filter(f, {"a\n", "b E", "Nx", "!"}, &released);
  CHECK(out == "a\nb ENx!");
  CHECK_FALSE(f.matched());
  CHECK(released[0] == "a");       // "\n" may start "\n\n"
  CHECK(released[1] == "\nb ");    // "E" may start "END"
}

TEST_CASE("the earliest of several stop strings wins; no stops passes everything") {
  StopStringFilter f({"world", "lo"});
  std::vector<std::string> released;
  CHECK(run_filter(f, {"hello world"}, &released) == "hel");
  StopStringFilter none({});
  CHECK(none.push("abc") == "abc");
  CHECK(none.flush().empty());
}

TEST_CASE("completion requests: types, ranges and unsupported fields name the field") {
  ApiError e;
  auto ok = parse_generation_request(
      json::parse(R"({"model":"m","prompt":"hi","max_tokens":5,"temperature":0.5,"stop":"x","n":2,
                      "logprobs":3,"seed":-1,"unknown_field":{"a":1},"stream":true,
                      "stream_options":{"include_usage":true}})"),
      ApiKind::kCompletion, &e);
  REQUIRE(ok);
  CHECK(ok->params.max_tokens == 5);
  CHECK(ok->max_tokens_given);
  CHECK(ok->n == 2);
  CHECK(ok->stop == std::vector<std::string>{"x"});
  CHECK(ok->logprobs);
  CHECK(ok->top_logprobs == 3);
  CHECK(ok->params.has_seed);
  CHECK(ok->include_usage);

  struct Bad { const char* body; const char* param; };
  for (const Bad& b : {Bad{R"({"model":"m","prompt":"hi","max_tokens":"5"})", "max_tokens"},
                       Bad{R"({"model":"m","prompt":"hi","max_tokens":0})", "max_tokens"},
                       Bad{R"({"model":"m","prompt":"hi","temperature":9})", "temperature"},
                       Bad{R"({"model":"m","prompt":"hi","stop":[1]})", "stop"},
                       Bad{R"({"model":"m","prompt":"hi","n":0})", "n"},
                       Bad{R"({"model":"m","prompt":"hi","logprobs":true})", "logprobs"},
                       Bad{R"({"model":"m","prompt":"hi","echo":"yes"})", "echo"},
                       Bad{R"({"model":"m","prompt":"hi","echo":true,"max_tokens":-1})", "max_tokens"},
                       Bad{R"({"model":"m","prompt":"hi","stream_options":{"include_usage":true}})", "stream_options"},
                       Bad{R"({"model":"m","prompt":["a",1]})", "prompt[1]"},
                       Bad{R"({"model":"m","prompt":[[1],"a"]})", "prompt[1]"},
                       Bad{R"({"model":"m","prompt":["a",""]})", "prompt[1]"},
                       Bad{R"({"model":"m","prompt":[]})", "prompt"},
                       Bad{R"({"model":"m","prompt":[true]})", "prompt"},
                       Bad{R"({"model":"m","prompt":"hi","parse_special":1})", "parse_special"},
                       Bad{R"({"model":3,"prompt":"hi"})", "model"},
                       Bad{R"({"prompt":"hi"})", "model"}}) {
    CAPTURE(b.body);
    ApiError err;
    CHECK_FALSE(parse_generation_request(json::parse(b.body), ApiKind::kCompletion, &err));
    CHECK(err.param == b.param);
    CHECK(err.message.rfind(b.param, 0) == 0);
  }
}

TEST_CASE("echo + logprobs asks for prompt logprobs; max_tokens 0 only with echo") {
  ApiError e;
  auto lm_eval = parse_generation_request(
      json::parse(R"({"model":"m","prompt":[1,2,3],"max_tokens":0,"echo":true,"logprobs":1})"), ApiKind::kCompletion, &e);
  REQUIRE(lm_eval);
  CHECK(lm_eval->echo);
  CHECK(lm_eval->params.max_tokens == 0);
  CHECK(lm_eval->prompt_logprobs == 1);
  auto echo_only = parse_generation_request(json::parse(R"({"model":"m","prompt":"hi","max_tokens":0,"echo":true})"),
                                            ApiKind::kCompletion, &e);
  REQUIRE(echo_only);
  CHECK(echo_only->prompt_logprobs == 0);  // the engine evaluates the prompt, nothing is reported
  CHECK_FALSE(echo_only->logprobs);
  auto plain = parse_generation_request(json::parse(R"({"model":"m","prompt":"hi","logprobs":2})"),
                                        ApiKind::kCompletion, &e);
  REQUIRE(plain);
  CHECK(plain->prompt_logprobs == -1);  // no echo: no prompt logits are kept
  ApiError chat_err;
  CHECK_FALSE(parse_generation_request(
      json::parse(R"({"model":"m","messages":[{"role":"user","content":"x"}],"max_tokens":0})"), ApiKind::kChat,
      &chat_err));
  CHECK(chat_err.param == "max_tokens");
}

TEST_CASE("server.defaults fill only the fields a request omits") {
  tessera::RequestDefaults d;
  d.temperature = 0.0;
  d.max_tokens = 7;
  d.top_k = 5;
  json body = json::parse(R"({"model":"m","prompt":"hi","top_k":null,"temperature":0.9})");
  tessera::server::apply_request_defaults(d, ApiKind::kCompletion, &body);
  ApiError e;
  auto spec = parse_generation_request(body, ApiKind::kCompletion, &e);
  REQUIRE(spec);
  CHECK(spec->params.temperature == doctest::Approx(0.9));  // sent: kept
  CHECK(spec->params.max_tokens == 7);                      // omitted: the default
  CHECK(spec->max_tokens_given);
  CHECK(spec->params.top_k == 5);                           // null counts as omitted
  CHECK(spec->params.top_p == 1.0f);                        // no default configured: OpenAI's
  json chat = json::parse(R"({"model":"m","messages":[{"role":"user","content":"x"}],"max_completion_tokens":3})");
  tessera::server::apply_request_defaults(d, ApiKind::kChat, &chat);
  auto chat_spec = parse_generation_request(chat, ApiKind::kChat, &e);
  REQUIRE(chat_spec);
  CHECK(chat_spec->params.max_tokens == 3);
}

TEST_CASE("chat requests: messages, content parts, chat-style logprobs") {
  ApiError e;
  auto ok = parse_generation_request(
      json::parse(R"({"model":"m","messages":[{"role":"developer","content":"be brief"},
                      {"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}],
                      "max_completion_tokens":7,"logprobs":true,"top_logprobs":2})"),
      ApiKind::kChat, &e);
  REQUIRE(ok);
  REQUIRE(ok->messages.size() == 2);
  CHECK(ok->messages[0].role == "system");
  CHECK(ok->messages[1].content == "ab");
  CHECK(ok->params.max_tokens == 7);
  CHECK(ok->params.num_logprobs == 2);

  ApiError err;
  CHECK_FALSE(parse_generation_request(json::parse(R"({"model":"m","messages":[]})"), ApiKind::kChat, &err));
  CHECK(err.param == "messages");
  CHECK_FALSE(parse_generation_request(json::parse(R"({"model":"m","messages":[{"role":"user"}]})"),
                                       ApiKind::kChat, &err));
  CHECK(err.param == "messages[0].content");
  CHECK_FALSE(parse_generation_request(
      json::parse(R"({"model":"m","messages":[{"role":"user","content":"x"}],"top_logprobs":2})"), ApiKind::kChat,
      &err));
  CHECK(err.param == "top_logprobs");
}

TEST_CASE("request bodies: nesting is bounded and library errors name the field") {
  using tessera::server::JsonBodyError;
  using tessera::server::parse_json_body;
  JsonBodyError e;
  auto ok = parse_json_body(R"({"a": [1, {"b": [2.5, "x", null, true]}], "c": {}})", &e);
  REQUIRE(ok);
  CHECK(*ok == json::parse(R"({"a": [1, {"b": [2.5, "x", null, true]}], "c": {}})"));
  auto dup = parse_json_body(R"({"k": 1, "k": 2})", &e);
  REQUIRE(dup);
  CHECK((*dup)["k"] == 2);  // as json::parse: the last one wins

  // 64 levels are allowed, 65 are not; the top-level field is named.
  const auto nested = [](int depth) { return std::string(depth, '[') + std::string(depth, ']'); };
  CHECK(parse_json_body(nested(64), &e));
  CHECK_FALSE(parse_json_body(nested(65), &e));
  CHECK(e.param.empty());
  CHECK(e.message.find("nested deeper than 64") != std::string::npos);
  CHECK_FALSE(parse_json_body(R"({"model": "m", "prompt": )" + nested(300000) + "}", &e));
  CHECK(e.param == "prompt");
  CHECK(e.message.rfind("prompt: nested deeper than", 0) == 0);

  struct Case { const char* body; const char* param; };
  for (const Case& c : {Case{R"({"max_tokens": 1e400})", "max_tokens"},
                        Case{R"({"temperature": -1e400})", "temperature"},
                        Case{R"({"stop": ["a", 1e999]})", "stop[1]"},
                        Case{R"({"messages": [{"role": "user"}, {"content": 2E400}]})", "messages[1].content"},
                        Case{R"({"a": {"b": [[0, 1e400]]}})", "a.b[0][1]"}}) {
    CAPTURE(c.body);
    CHECK_FALSE(parse_json_body(c.body, &e));
    CHECK(e.param == c.param);
    CHECK(e.message.rfind(std::string(c.param) + ": the number", 0) == 0);
    CHECK(e.message.find("out of range") != std::string::npos);
  }
  CHECK_FALSE(parse_json_body("1e400", &e));
  CHECK(e.param.empty());
  CHECK(e.message.find("out of range") != std::string::npos);

  // Syntax errors: no field, a bounded message even for a huge bad token.
  for (const std::string body : {std::string(R"({"a": )"), std::string("[1, 2] x"), std::string(""),
                                 "{\"s\": \"" + std::string(100000, 'x')}) {
    CHECK_FALSE(parse_json_body(body, &e));
    CHECK(e.message.rfind("the request body is not valid JSON", 0) == 0);
    CHECK(e.message.size() < 400);
  }
}

TEST_CASE("HTTP framing: obs-fold and every Transfer-Encoding but plain chunked are refused") {
  using tessera::server::check_header_lines;
  using tessera::server::check_request_framing;
  namespace http = boost::beast::http;
  CHECK_FALSE(check_header_lines("POST / HTTP/1.1\r\nHost: x\r\nA: b\r\n"));
  auto fold = check_header_lines("POST / HTTP/1.1\r\nHost: x\r\nA: b\r\n c\r\n");
  REQUIRE(fold);
  CHECK(fold->status == http::status::bad_request);
  CHECK(fold->message.find("obs-fold") != std::string::npos);
  CHECK(check_header_lines("POST / HTTP/1.1\r\n\tHost: x\r\n"));  // whitespace before the first field

  const auto framing = [](std::vector<std::pair<http::field, std::string>> fields, unsigned version = 11) {
    http::request_header<> h;
    h.version(version);
    for (auto& [f, v] : fields) h.insert(f, v);
    return check_request_framing(h);
  };
  using F = http::field;
  CHECK_FALSE(framing({}));
  CHECK_FALSE(framing({{F::content_length, "5"}}));
  CHECK_FALSE(framing({{F::transfer_encoding, "chunked"}}));
  CHECK_FALSE(framing({{F::transfer_encoding, " Chunked "}}));
  struct Bad { std::vector<std::pair<http::field, std::string>> fields; http::status status; };
  for (const Bad& b : {Bad{{{F::transfer_encoding, "xchunked"}}, http::status::bad_request},
                       Bad{{{F::transfer_encoding, "chunked"}, {F::content_length, "3"}}, http::status::bad_request},
                       Bad{{{F::transfer_encoding, "chunked, gzip"}}, http::status::bad_request},
                       Bad{{{F::transfer_encoding, "chunked,chunked"}}, http::status::bad_request},
                       Bad{{{F::transfer_encoding, "chunked"}, {F::transfer_encoding, "chunked"}},
                           http::status::bad_request},
                       Bad{{{F::transfer_encoding, "chunked,"}}, http::status::bad_request},
                       Bad{{{F::transfer_encoding, "\"chunked\""}}, http::status::bad_request},
                       Bad{{{F::transfer_encoding, ""}}, http::status::bad_request},
                       Bad{{{F::transfer_encoding, "gzip, chunked"}}, http::status::not_implemented},
                       Bad{{{F::transfer_encoding, "gzip"}, {F::transfer_encoding, "chunked"}},
                           http::status::not_implemented}}) {
    auto problem = framing(b.fields);
    REQUIRE(problem);
    CHECK(problem->status == b.status);
    CHECK(problem->message.find("Transfer-Encoding") != std::string::npos);
  }
  auto http10 = framing({{F::transfer_encoding, "chunked"}}, 10);
  REQUIRE(http10);
  CHECK(http10->status == http::status::bad_request);
}

TEST_CASE("embeddings requests: the four input forms, encoding_format, and errors naming the field") {
  using tessera::server::parse_embeddings_request;
  ApiError err;
  auto one = parse_embeddings_request(json::parse(R"({"model":"m","input":"hello"})"), 8, &err);
  REQUIRE(one);
  CHECK(one->model == "m");
  REQUIRE(one->inputs.size() == 1);
  CHECK(*one->inputs[0].text == "hello");
  CHECK_FALSE(one->base64);
  auto ids = parse_embeddings_request(json::parse(R"({"model":"m","input":[101,7592,102],"encoding_format":"base64"})"),
                                      8, &err);
  REQUIRE(ids);
  CHECK(ids->inputs[0].ids == std::vector<int32_t>{101, 7592, 102});
  CHECK(ids->base64);
  auto batch = parse_embeddings_request(json::parse(R"({"model":"m","input":[[1,2],[3]],"dimensions":384})"), 8, &err);
  REQUIRE(batch);
  CHECK(batch->inputs.size() == 2);
  CHECK(*batch->dimensions == 384);
  struct Bad {
    const char* body;
    const char* param;
  };
  for (const Bad& b : {Bad{R"({"input":"x"})", "model"}, Bad{R"({"model":"m"})", "input"},
                       Bad{R"({"model":"m","input":""})", "input"}, Bad{R"({"model":"m","input":["a",""]})", "input[1]"},
                       Bad{R"({"model":"m","input":["a",2]})", "input[1]"}, Bad{R"({"model":"m","input":[1,-2]})", "input"},
                       Bad{R"({"model":"m","input":["a","b","c"]})", "input"},
                       Bad{R"({"model":"m","input":"x","encoding_format":"hex"})", "encoding_format"},
                       Bad{R"({"model":"m","input":"x","dimensions":0})", "dimensions"}}) {
    CAPTURE(b.body);
    CHECK_FALSE(parse_embeddings_request(json::parse(b.body), 2, &err));
    CHECK(err.param == b.param);
  }
}
