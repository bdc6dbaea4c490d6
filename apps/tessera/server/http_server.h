// A small HTTP/1.1 server on Boost.Asio + Boost.Beast for `tessera serve`: keep-alive, many
// concurrent connections on one io_context thread, header and body size limits, deadlines
// for every phase of a connection (idle, headers, body, each write), chunked streaming
// responses, and disconnect detection while a response is being produced.
//
// Threading: everything here runs on the io_context's thread. The application gets each
// request through HttpHandler::handle() and answers through the ResponseChannel, from that
// thread too (work done elsewhere is posted back with channel->executor()).
#pragma once

#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/beast/http.hpp>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "tessera/config.h"

namespace tessera::server {

namespace http = boost::beast::http;
using HttpRequest = http::request<http::string_body>;
using HttpResponse = http::response<http::string_body>;

// The way back to one client for one request. Exactly one of respond() or a
// start_stream()/send_chunk()*/end_stream() sequence answers a request; after the connection
// closed (client gone, deadline, shutdown) every call is a no-op.
class ResponseChannel {
 public:
  virtual ~ResponseChannel() = default;
  virtual boost::asio::any_io_executor executor() = 0;
  virtual void respond(HttpResponse response) = 0;
  // Sends the status line and headers of a chunked response (e.g. text/event-stream), with
  // `headers` added.
  virtual void start_stream(http::status status, const std::string& content_type,
                            const std::vector<std::pair<std::string, std::string>>& headers = {}) = 0;
  virtual void send_chunk(std::string data) = 0;
  virtual void end_stream() = 0;
  // `fn` runs once if the connection goes away before the response was fully written: the
  // application cancels the work it started for this request.
  virtual void on_disconnect(std::function<void()> fn) = 0;
  virtual bool is_open() const = 0;
};

class HttpHandler {
 public:
  virtual ~HttpHandler() = default;
  virtual void handle(HttpRequest request, std::shared_ptr<ResponseChannel> channel) = 0;
  // A request the HTTP layer answered itself (413, 431, 400 for malformed HTTP), for metrics.
  // `target` is empty when the request line was not read.
  virtual void on_protocol_error(std::string_view target, int status) {
    (void)target;
    (void)status;
  }
};

class HttpSession;

class HttpServer {
 public:
  HttpServer(boost::asio::io_context& io, const ServerConfig& config, HttpHandler& handler);
  ~HttpServer();
  // Binds and starts accepting. Throws std::runtime_error naming the address on failure.
  void listen();
  uint16_t port() const { return bound_port_; }
  // Graceful shutdown, first half: no new connections, idle keep-alive connections close,
  // busy ones close once their response is written.
  void stop_accepting();
  // Second half: closes every connection now.
  void close_all();
  // Whether a connection still has response bytes queued or being written (a response the
  // service finished is not on the wire yet: closing now would cut it short).
  bool writes_pending() const;
  size_t num_connections() const { return sessions_->size(); }

 private:
  friend class HttpSession;
  void accept_next();

  boost::asio::io_context& io_;
  const ServerConfig& config_;
  HttpHandler& handler_;
  boost::asio::ip::tcp::acceptor acceptor_;
  uint16_t bound_port_ = 0;
  bool stopping_ = false;
  // Live sessions; each removes itself when destroyed. Shared with them, because a session
  // may be destroyed after the server: a handler holding it that never ran is destroyed with
  // the io_context.
  std::shared_ptr<std::set<HttpSession*>> sessions_ = std::make_shared<std::set<HttpSession*>>();
};

// Request framing that could be read two ways (by this server and by a proxy in front of it),
// i.e. a request-smuggling risk, is refused rather than interpreted.
struct FramingError {
  http::status status;  // 400, or 501 for a transfer coding this server does not implement
  std::string message;
};
// `header` is a request's raw header block (request line and fields, up to the blank line):
// a field line starting with a space or tab (obs-fold, a continuation of the previous line)
// is an error.
std::optional<FramingError> check_header_lines(std::string_view header);
// The parsed fields: Transfer-Encoding must be exactly "chunked" (one coding, applied once,
// HTTP/1.1 only) and never comes with Content-Length. (Beast itself refuses differing
// repeated Content-Length values and Transfer-Encoding after Content-Length.)
std::optional<FramingError> check_request_framing(const http::request_header<>& header);

// An OpenAI-style error body: {"error": {"message", "type", "param", "code"}}.
HttpResponse make_error_response(http::status status, const std::string& message, const std::string& type,
                                 const std::string& param = {}, const std::string& code = {});
HttpResponse make_json_response(http::status status, std::string body);

}  // namespace tessera::server
