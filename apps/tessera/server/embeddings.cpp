// POST /v1/embeddings: OpenAI's request and response shapes over the gateway's embedding
// model. The io thread only parses the body; tokenizing, the forwards and the response JSON
// run on the gateway's embedding thread, and the response is posted back to the io thread.
#include <boost/asio/post.hpp>

#include <cstring>

#include "openai_protocol.h"
#include "openai_service.h"
#include "tessera/embedding/encoder_model.h"

namespace tessera::server {

using nlohmann::json;

namespace {

std::string base64_encode(const void* data, size_t n) {
  static const char* kAlphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  const auto* p = static_cast<const uint8_t*>(data);
  std::string out;
  out.reserve((n + 2) / 3 * 4);
  for (size_t i = 0; i < n; i += 3) {
    const uint32_t v = (uint32_t(p[i]) << 16) | (i + 1 < n ? uint32_t(p[i + 1]) << 8 : 0) | (i + 2 < n ? p[i + 2] : 0);
    out += kAlphabet[(v >> 18) & 63];
    out += kAlphabet[(v >> 12) & 63];
    out += i + 1 < n ? kAlphabet[(v >> 6) & 63] : '=';
    out += i + 2 < n ? kAlphabet[v & 63] : '=';
  }
  return out;
}

}  // namespace

json OpenAiService::embedding_model_card() const {
  const EncoderModel& m = *gateway_.embedding_model();
  return {{"id", m.name()},   {"object", "model"},
          {"created", created_}, {"owned_by", "tessera"},
          {"max_model_len", m.max_tokens()}, {"embedding_dimension", m.dimension()}};
}

void OpenAiService::handle_embeddings(const HttpRequest& req, const std::shared_ptr<ResponseChannel>& channel,
                                      const std::string& endpoint) {
  EncoderModel* model = gateway_.embedding_model();
  auto body = read_json_object(req, channel, endpoint);
  if (!body) return;
  ApiError error;
  std::optional<EmbeddingsSpec> spec = parse_embeddings_request(*body, max_embedding_inputs_, &error);
  if (!spec) return reply_error(channel, endpoint, http::status::bad_request, error.message, "invalid_request_error",
                                error.param);
  if (!model || spec->model != model->name()) {
    const std::string served = model ? "'" + model->name() + "'" : "no embedding model (configure `embedding:`)";
    return reply_error(channel, endpoint, http::status::not_found,
                       "the embedding model '" + spec->model + "' does not exist; this server embeds with " + served,
                       "invalid_request_error", "model", "model_not_found");
  }
  if (spec->dimensions && *spec->dimensions != model->dimension())
    return reply_error(channel, endpoint, http::status::bad_request,
                       "dimensions: this model's embeddings have " + std::to_string(model->dimension()) +
                           " dimensions and cannot be shortened, got " + std::to_string(*spec->dimensions),
                       "invalid_request_error", "dimensions");
  if (draining_)
    return reply_error(channel, endpoint, http::status::service_unavailable, "the server is shutting down",
                       "server_error");

  // The rest is slow: the embedding thread does it, and the io thread only writes the answer.
  ++in_flight_;
  AccessRecord access = current_ ? *current_ : AccessRecord{};
  current_.reset();  // the access line is written when the answer is
  auto executor = channel->executor();
  gateway_.post_embedding_job([this, channel, endpoint, executor, access, spec = std::move(*spec)](EncoderModel& m) {
    HttpResponse res;
    try {
      std::vector<std::vector<int32_t>> ids;
      ids.reserve(spec.inputs.size());
      for (size_t i = 0; i < spec.inputs.size(); ++i) {
        const PromptInput& in = spec.inputs[i];
        const std::string param = spec.inputs.size() > 1 ? "input[" + std::to_string(i) + "]" : "input";
        if (in.text) {
          ids.push_back(m.encode(*in.text));  // truncated to the model's window, as sentence-transformers does
          continue;
        }
        if (in.ids.size() > static_cast<size_t>(m.max_tokens()))
          throw ApiError{param + ": " + std::to_string(in.ids.size()) + " tokens; the embedding model takes at most " +
                             std::to_string(m.max_tokens()),
                         param};
        for (int32_t id : in.ids)
          if (id >= m.tokenizer().vocab_size())
            throw ApiError{param + ": token id " + std::to_string(id) + " is outside the vocabulary [0, " +
                               std::to_string(m.tokenizer().vocab_size()) + ")",
                           param};
        ids.push_back(in.ids);
      }
      std::vector<std::vector<float>> vectors = m.embed(ids);
      json data = json::array();
      int64_t tokens = 0;
      for (size_t i = 0; i < vectors.size(); ++i) {
        tokens += static_cast<int64_t>(ids[i].size());
        json item = {{"object", "embedding"}, {"index", i}};
        if (spec.base64) item["embedding"] = base64_encode(vectors[i].data(), vectors[i].size() * sizeof(float));
        else item["embedding"] = vectors[i];
        data.push_back(std::move(item));
      }
      json out = {{"object", "list"},
                  {"data", std::move(data)},
                  {"model", m.name()},
                  {"usage", {{"prompt_tokens", tokens}, {"total_tokens", tokens}}}};
      res = make_json_response(http::status::ok, out.dump());
    } catch (const ApiError& e) {
      res = make_error_response(http::status::bad_request, e.message, "invalid_request_error", e.param);
    } catch (const std::exception& e) {
      res = make_error_response(http::status::internal_server_error, std::string("embedding failed: ") + e.what(),
                                "server_error");
    }
    boost::asio::post(executor, [this, channel, endpoint, access, res = std::move(res)]() mutable {
      --in_flight_;
      metrics_.set_in_flight(in_flight_);
      const int status = static_cast<int>(res.result_int());
      metrics_.count_request(endpoint, status);
      if (!access.path.empty()) log_access(access, status);
      channel->respond(std::move(res));
    });
  });
}

}  // namespace tessera::server
