#include "http_server.h"

#include <boost/asio/steady_timer.hpp>
#include <boost/asio/strand.hpp>
#include <boost/asio/write.hpp>
#include <boost/beast/core/flat_buffer.hpp>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include <cctype>
#include <chrono>
#include <deque>
#include <optional>
#include <sstream>

namespace tessera::server {

namespace net = boost::asio;
using tcp = net::ip::tcp;
using error_code = boost::system::error_code;

namespace {

std::chrono::steady_clock::duration seconds(double s) {
  return std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(s));
}

std::string serialize(HttpResponse& response) {
  response.prepare_payload();
  std::ostringstream os;
  os << response;
  return os.str();
}

bool is_token_char(char c) {
  // RFC 9110 tchar
  if ((c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')) return true;
  return std::string_view("!#$%&'*+-.^_`|~").find(c) != std::string_view::npos;
}

bool is_chunked(std::string_view coding) {
  constexpr std::string_view kChunked = "chunked";
  if (coding.size() != kChunked.size()) return false;
  for (size_t i = 0; i < coding.size(); ++i)
    if (std::tolower(static_cast<unsigned char>(coding[i])) != kChunked[i]) return false;
  return true;
}

std::string_view trim_ows(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

}  // namespace

std::optional<FramingError> check_header_lines(std::string_view header) {
  size_t line = header.find("\r\n");  // skip the request line
  while (line != std::string_view::npos && line + 2 < header.size()) {
    const char first = header[line + 2];
    if (first == ' ' || first == '\t')
      return FramingError{http::status::bad_request,
                          "malformed HTTP request: a header line starts with whitespace (obs-fold line folding is "
                          "not accepted)"};
    line = header.find("\r\n", line + 2);
  }
  return std::nullopt;
}

std::optional<FramingError> check_request_framing(const http::request_header<>& header) {
  std::string te;  // all Transfer-Encoding fields, as one list
  bool has_te = false;
  for (auto it = header.find(http::field::transfer_encoding);
       it != header.end() && it->name() == http::field::transfer_encoding; ++it) {
    if (has_te) te += ",";
    te += std::string(it->value());
    has_te = true;
  }
  if (!has_te) return std::nullopt;
  const auto bad = [&](const std::string& why) {
    return FramingError{http::status::bad_request, "malformed HTTP request: Transfer-Encoding \"" +
                                                       te.substr(0, 100) + "\": " + why};
  };
  if (header.count(http::field::content_length) > 0)
    return bad("not allowed together with Content-Length");
  if (header.version() < 11) return bad("not allowed in an HTTP/1.0 request");
  std::vector<std::string_view> codings;
  std::string_view rest(te);
  for (;;) {
    const size_t comma = rest.find(',');
    const std::string_view coding = trim_ows(rest.substr(0, comma));
    if (coding.empty()) return bad("an empty transfer coding");
    for (char c : coding)
      if (!is_token_char(c)) return bad("not a list of transfer codings");
    codings.push_back(coding);
    if (comma == std::string_view::npos) break;
    rest.remove_prefix(comma + 1);
  }
  size_t chunked = 0;
  for (auto c : codings) chunked += is_chunked(c) ? 1 : 0;
  // RFC 9112 6.3: without chunked as the final coding the body length cannot be known.
  if (!is_chunked(codings.back())) return bad("\"chunked\" must be the final transfer coding");
  if (chunked > 1) return bad("\"chunked\" may be applied only once");
  if (codings.size() > 1)
    return FramingError{http::status::not_implemented,
                        "Transfer-Encoding \"" + te.substr(0, 100) +
                            "\": this server implements only \"chunked\" request bodies"};
  return std::nullopt;
}

HttpResponse make_json_response(http::status status, std::string body) {
  HttpResponse res{status, 11};
  res.set(http::field::content_type, "application/json");
  res.body() = std::move(body);
  return res;
}

HttpResponse make_error_response(http::status status, const std::string& message, const std::string& type,
                                 const std::string& param, const std::string& code) {
  nlohmann::json err = {{"message", message},
                        {"type", type},
                        {"param", param.empty() ? nlohmann::json(nullptr) : nlohmann::json(param)},
                        {"code", code.empty() ? nlohmann::json(nullptr) : nlohmann::json(code)}};
  return make_json_response(status, nlohmann::json{{"error", err}}.dump(-1, ' ', false,
                                                                         nlohmann::json::error_handler_t::replace));
}

// One connection. Phases: waiting for the first byte of a request (idle deadline), reading
// headers (header deadline, so a client trickling bytes cannot hold a connection), reading
// the body (read deadline), then handling: the application answers through a channel while a
// read stays posted to notice a client that goes away. One timer enforces whichever deadline
// the current phase has; when it fires the socket closes and the pending operations end.
class HttpSession : public std::enable_shared_from_this<HttpSession> {
 public:
  // Response bytes queued or being written (HttpServer::writes_pending).
  bool writes_pending() const { return !closed_ && (writing_ || !outbox_.empty()); }

  HttpSession(tcp::socket socket, HttpServer& server)
      : socket_(std::move(socket)), deadline_(socket_.get_executor()), server_(server),
        config_(server.config_), sessions_(server.sessions_) {
    sessions_->insert(this);
  }
  ~HttpSession() { sessions_->erase(this); }

  void start() { wait_for_request(); }

  // Shutdown: an idle connection closes now; a busy one after its response.
  void drain() {
    draining_ = true;
    if (phase_ == Phase::kIdle) close();
  }
  void close() {
    if (closed_) return;
    closed_ = true;
    error_code ec;
    socket_.shutdown(tcp::socket::shutdown_both, ec);
    socket_.close(ec);
    deadline_.cancel();
    if (phase_ == Phase::kHandling && !response_done_) notify_disconnect();
  }

  // --- the ResponseChannel side (called through RequestChannel) --------------------------
  bool accepts(uint64_t serial) const {
    return !closed_ && phase_ == Phase::kHandling && serial == request_serial_ && !response_done_;
  }
  void respond(HttpResponse res) {
    res.version(11);
    res.keep_alive(keep_alive_ && !draining_);
    response_done_ = true;
    if (head_request_) {
      // HEAD: the headers a GET would get (Content-Length included), no body.
      res.prepare_payload();
      std::ostringstream os;
      os << res.base();
      return queue_write(os.str());
    }
    queue_write(serialize(res));
  }
  void start_stream(http::status status, const std::string& content_type,
                    const std::vector<std::pair<std::string, std::string>>& headers) {
    if (streaming_) return;
    streaming_ = true;
    http::response<http::empty_body> res{status, 11};
    res.set(http::field::content_type, content_type);
    for (const auto& [name, value] : headers) res.set(name, value);
    res.set(http::field::cache_control, "no-cache");
    res.keep_alive(keep_alive_ && !draining_);
    res.chunked(true);
    std::ostringstream os;
    os << res.base();
    queue_write(os.str());
  }
  void send_chunk(std::string data) {
    if (!streaming_ || data.empty()) return;
    std::ostringstream size;
    size << std::hex << data.size();
    queue_write(size.str() + "\r\n" + data + "\r\n");
  }
  void end_stream() {
    if (!streaming_) return;
    response_done_ = true;
    queue_write("0\r\n\r\n");
  }
  void set_disconnect_callback(std::function<void()> fn) { on_disconnect_ = std::move(fn); }
  uint64_t serial() const { return request_serial_; }

 private:
  enum class Phase { kIdle, kHeader, kBody, kHandling, kClosing };

  // Each arming gets a number, so a wait that completed just before being re-armed (its
  // handler already queued) cannot close the connection under the new deadline.
  void arm_deadline(double secs) {
    // A closed session arms nothing: a wait armed now would outlive the final poll at exit.
    if (closed_) return;
    const uint64_t armed = ++deadline_serial_;
    deadline_.expires_after(seconds(secs));
    deadline_.async_wait([self = shared_from_this(), armed](error_code ec) {
      if (!ec && armed == self->deadline_serial_) self->on_deadline();
    });
  }
  void disarm_deadline() {
    ++deadline_serial_;
    deadline_.cancel();
  }

  void on_deadline() {
    // The timer may have fired just as its operation finished and the phase moved on.
    if (closed_) return;
    if (phase_ == Phase::kHeader || phase_ == Phase::kBody)
      spdlog::debug("http: closing a connection whose request did not arrive in time");
    close();
  }

  // Waits for the first byte of the next request under the idle deadline; the header
  // deadline starts only once a request has begun.
  void wait_for_request() {
    phase_ = Phase::kIdle;
    if (draining_) return close();
    if (buffer_.size() > 0) return read_header();  // a pipelined request is already here
    arm_deadline(config_.idle_timeout);
    post_read_some();
  }

  // One read into buffer_. In the idle phase its completion starts a request; in the
  // handling phase it is the disconnect watch (data means a pipelined request, kept for later).
  void post_read_some() {
    read_posted_ = true;
    socket_.async_read_some(buffer_.prepare(4096), [self = shared_from_this()](error_code ec, size_t n) {
      self->read_posted_ = false;
      if (!ec) self->buffer_.commit(n);
      self->on_read_some(ec);
    });
  }

  void on_read_some(error_code ec) {
    if (ec) {
      // EOF, reset, or the socket closed by a deadline.
      close();
      return;
    }
    if (phase_ == Phase::kClosing) {
      buffer_.consume(buffer_.size());
      return post_read_some();
    }
    if (phase_ == Phase::kIdle) read_header();
    // In the handling phase the bytes wait in buffer_ for the next request.
  }

  void read_header() {
    phase_ = Phase::kHeader;
    parser_.emplace();
    parser_->header_limit(static_cast<uint32_t>(config_.max_header_bytes));
    parser_->body_limit(static_cast<uint64_t>(config_.max_body_bytes));
    arm_deadline(config_.header_timeout);
    buffer_header();
  }

  // Beast joins obs-fold continuation lines into the previous field's value, where a proxy
  // in front may read them another way, so the raw header lines are checked first. Beast
  // parses a header only once all of it is buffered anyway; this reads up to the blank line
  // (or past the header limit, which Beast then answers with 431) before handing over.
  void buffer_header() {
    const std::string_view data(static_cast<const char*>(buffer_.data().data()), buffer_.size());
    const size_t end = data.find("\r\n\r\n");
    if (end == std::string_view::npos && data.size() <= static_cast<size_t>(config_.max_header_bytes)) {
      socket_.async_read_some(buffer_.prepare(4096), [self = shared_from_this()](error_code ec, size_t n) {
        if (self->closed_) return;
        if (ec) return self->parse_header();  // Beast reports the partial request or closes
        self->buffer_.commit(n);
        self->buffer_header();
      });
      return;
    }
    if (end != std::string_view::npos) {
      if (auto problem = check_header_lines(data.substr(0, end + 2))) return reject(*problem, {});
    }
    parse_header();
  }

  void parse_header() {
    http::async_read_header(socket_, buffer_, *parser_, [self = shared_from_this()](error_code ec, size_t) {
      self->on_header(ec);
    });
  }

  void on_header(error_code ec) {
    if (closed_) return;
    if (ec) return reject_and_close(ec);
    if (auto problem = check_request_framing(parser_->get().base()))
      return reject(*problem, std::string(parser_->get().target()));
    phase_ = Phase::kBody;
    auto& req = parser_->get();
    // curl and others wait for this before sending a larger body.
    const auto expect = req[http::field::expect];
    if (!expect.empty() && boost::beast::iequals(expect, "100-continue") && !parser_->is_done()) {
      auto cont = std::make_shared<std::string>("HTTP/1.1 100 Continue\r\n\r\n");
      net::async_write(socket_, net::buffer(*cont), [self = shared_from_this(), cont](error_code ec, size_t) {
        if (ec) return self->close();
        self->read_body();
      });
      return;
    }
    read_body();
  }

  void read_body() {
    arm_deadline(config_.read_timeout);
    http::async_read(socket_, buffer_, *parser_, [self = shared_from_this()](error_code ec, size_t) {
      self->on_body(ec);
    });
  }

  void on_body(error_code ec) {
    if (closed_) return;
    if (ec) return reject_and_close(ec);
    disarm_deadline();
    phase_ = Phase::kHandling;
    ++request_serial_;
    response_done_ = false;
    streaming_ = false;
    on_disconnect_ = nullptr;
    HttpRequest req = parser_->release();
    parser_.reset();
    keep_alive_ = req.keep_alive();
    head_request_ = req.method() == http::verb::head;
    // Watch for the client going away while the answer is computed (only when no pipelined
    // request is buffered: then the watch would read into the middle of it).
    if (buffer_.size() == 0) post_read_some();
    server_.handler_.handle(std::move(req), make_channel());
  }

  // A request that could not be read: answer what HTTP allows, then close (the rest of the
  // stream cannot be trusted to start at a request boundary).
  void reject_and_close(error_code ec) {
    if (ec == http::error::end_of_stream || ec == net::error::eof || ec == net::error::operation_aborted ||
        ec == net::error::connection_reset) {
      return close();
    }
    std::optional<HttpResponse> res;
    if (ec == http::error::body_limit)
      res = make_error_response(http::status::payload_too_large,
                                "request body exceeds the server's limit of " +
                                    std::to_string(config_.max_body_bytes) + " bytes",
                                "invalid_request_error", "", "request_too_large");
    else if (ec == http::error::header_limit)
      res = make_error_response(http::status::request_header_fields_too_large,
                                "request headers exceed the server's limit of " +
                                    std::to_string(config_.max_header_bytes) + " bytes",
                                "invalid_request_error");
    else if (ec.category() == http::make_error_code(http::error::bad_method).category() || ec == http::error::partial_message)
      res = make_error_response(http::status::bad_request, "malformed HTTP request: " + ec.message(),
                                "invalid_request_error");
    if (!res) return close();
    std::string target;
    if (parser_ && parser_->is_header_done()) target = std::string(parser_->get().target());
    answer_and_close(std::move(*res), target);
  }

  void reject(const FramingError& problem, const std::string& target) {
    answer_and_close(make_error_response(problem.status, problem.message, "invalid_request_error"), target);
  }

  void answer_and_close(HttpResponse res, const std::string& target) {
    server_.handler_.on_protocol_error(target, static_cast<int>(res.result_int()));
    disarm_deadline();
    phase_ = Phase::kHandling;
    ++request_serial_;
    keep_alive_ = false;
    response_done_ = true;
    res.keep_alive(false);
    queue_write(serialize(res));
  }

  void queue_write(std::string data) {
    if (closed_) return;
    outbox_.push_back(std::move(data));
    if (!writing_) write_next();
  }

  void write_next() {
    writing_ = true;
    arm_deadline(config_.write_timeout);
    net::async_write(socket_, net::buffer(outbox_.front()), [self = shared_from_this()](error_code ec, size_t) {
      self->on_written(ec);
    });
  }

  void on_written(error_code ec) {
    writing_ = false;
    // A write that completed just before close(): nothing more to send or wait for.
    if (closed_) return;
    if (ec) return close();
    outbox_.pop_front();
    if (!outbox_.empty()) return write_next();
    disarm_deadline();
    if (!response_done_) return;  // a stream waiting for its next chunk
    if (!keep_alive_ || draining_) return linger_close();
    phase_ = Phase::kIdle;
    if (read_posted_) {
      // The disconnect watch becomes the wait for the next request.
      arm_deadline(config_.idle_timeout);
      return;
    }
    wait_for_request();
  }

  // Closing right away with unread request bytes makes the kernel reset the connection, and
  // the client may lose the answer it has not read yet (a 413 sent mid-body). So: stop
  // sending, read and drop what the client still sends until it closes or 2 s pass.
  void linger_close() {
    phase_ = Phase::kClosing;
    error_code ec;
    socket_.shutdown(tcp::socket::shutdown_send, ec);
    if (ec) return close();
    arm_deadline(2.0);
    if (!read_posted_) post_read_some();
  }

  void notify_disconnect() {
    if (auto fn = std::move(on_disconnect_)) {
      on_disconnect_ = nullptr;
      fn();
    }
  }

  std::shared_ptr<ResponseChannel> make_channel();

  tcp::socket socket_;
  net::steady_timer deadline_;
  HttpServer& server_;
  const ServerConfig& config_;
  std::shared_ptr<std::set<HttpSession*>> sessions_;
  boost::beast::flat_buffer buffer_;
  std::optional<http::request_parser<http::string_body>> parser_;
  std::deque<std::string> outbox_;
  std::function<void()> on_disconnect_;
  Phase phase_ = Phase::kIdle;
  uint64_t request_serial_ = 0;
  uint64_t deadline_serial_ = 0;
  bool read_posted_ = false;
  bool writing_ = false;
  bool streaming_ = false;
  bool response_done_ = false;
  bool keep_alive_ = true;
  bool head_request_ = false;
  bool draining_ = false;
  bool closed_ = false;
};

namespace {

// A channel is bound to one request of a session: calls made after that request was
// answered (or the connection closed) are ignored rather than written into the next one.
class RequestChannel : public ResponseChannel {
 public:
  RequestChannel(std::shared_ptr<HttpSession> session, net::any_io_executor ex)
      : session_(std::move(session)), serial_(session_->serial()), executor_(std::move(ex)) {}
  net::any_io_executor executor() override { return executor_; }
  void respond(HttpResponse response) override {
    if (session_->accepts(serial_)) session_->respond(std::move(response));
  }
  void start_stream(http::status status, const std::string& content_type,
                    const std::vector<std::pair<std::string, std::string>>& headers) override {
    if (session_->accepts(serial_)) session_->start_stream(status, content_type, headers);
  }
  void send_chunk(std::string data) override {
    if (session_->accepts(serial_)) session_->send_chunk(std::move(data));
  }
  void end_stream() override {
    if (session_->accepts(serial_)) session_->end_stream();
  }
  void on_disconnect(std::function<void()> fn) override {
    if (session_->accepts(serial_)) session_->set_disconnect_callback(std::move(fn));
  }
  bool is_open() const override { return session_->accepts(serial_); }

 private:
  std::shared_ptr<HttpSession> session_;
  uint64_t serial_;
  net::any_io_executor executor_;
};

}  // namespace

std::shared_ptr<ResponseChannel> HttpSession::make_channel() {
  return std::make_shared<RequestChannel>(shared_from_this(), socket_.get_executor());
}

HttpServer::HttpServer(net::io_context& io, const ServerConfig& config, HttpHandler& handler)
    : io_(io), config_(config), handler_(handler), acceptor_(io) {}

HttpServer::~HttpServer() { close_all(); }

void HttpServer::listen() {
  error_code ec;
  const auto address = net::ip::make_address(config_.host, ec);
  if (ec) throw std::runtime_error("server.host: '" + config_.host + "' is not an IP address");
  const tcp::endpoint endpoint(address, static_cast<uint16_t>(config_.port));
  const std::string where = config_.host + ":" + std::to_string(config_.port);
  acceptor_.open(endpoint.protocol(), ec);
  if (!ec) acceptor_.set_option(net::socket_base::reuse_address(true), ec);
  if (!ec) acceptor_.bind(endpoint, ec);
  if (!ec) acceptor_.listen(net::socket_base::max_listen_connections, ec);
  if (ec) throw std::runtime_error("cannot listen on " + where + ": " + ec.message());
  bound_port_ = acceptor_.local_endpoint().port();
  accept_next();
}

void HttpServer::accept_next() {
  acceptor_.async_accept(net::make_strand(io_), [this](error_code ec, tcp::socket socket) {
    if (stopping_) return;
    if (!ec) {
      error_code ignored;
      socket.set_option(tcp::no_delay(true), ignored);  // SSE chunks go out as produced
      std::make_shared<HttpSession>(std::move(socket), *this)->start();
    } else if (ec != net::error::operation_aborted) {
      // Out of file descriptors and similar: log and keep accepting.
      spdlog::warn("http: accept failed: {}", ec.message());
    }
    accept_next();
  });
}

void HttpServer::stop_accepting() {
  if (stopping_) return;
  stopping_ = true;
  error_code ec;
  acceptor_.close(ec);
  for (HttpSession* s : std::set<HttpSession*>(*sessions_)) s->drain();
}

bool HttpServer::writes_pending() const {
  for (const HttpSession* s : *sessions_)
    if (s->writes_pending()) return true;
  return false;
}

void HttpServer::close_all() {
  stopping_ = true;
  error_code ec;
  acceptor_.close(ec);
  for (HttpSession* s : std::set<HttpSession*>(*sessions_)) s->close();
}

}  // namespace tessera::server
