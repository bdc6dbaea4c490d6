// Fuzz target: how `tessera serve` reads a request's framing. The input is the raw bytes of
// a request as a client would send them. As HttpSession does: the raw header block is checked
// for obs-fold (check_header_lines), Beast parses the header, the framing is checked
// (check_request_framing), then the body is parsed. Nothing may throw, and where the server
// accepts the framing, Beast must frame the body the way the headers say: chunked exactly
// when Transfer-Encoding is present, else by Content-Length (or no body). A disagreement
// would let a proxy and this server split the byte stream into different requests.
#include <boost/asio/buffer.hpp>
#include <boost/beast/http.hpp>

#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "fuzz_support.h"

#include "server/http_server.h"


extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  namespace http = boost::beast::http;
  using namespace tessera::server;
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  const size_t end = bytes.find("\r\n\r\n");
  if (end != std::string_view::npos && check_header_lines(bytes.substr(0, end + 2))) return 0;

  http::request_parser<http::string_body> parser;
  parser.header_limit(16 << 10);
  parser.body_limit(1 << 20);
  parser.eager(true);
  boost::beast::error_code ec;
  size_t used = parser.put(boost::asio::buffer(bytes.data(), bytes.size()), ec);
  if (ec || !parser.is_header_done()) return 0;
  const auto& header = parser.get().base();
  if (check_request_framing(header)) return 0;
  // Accepted framing: Beast's reading of it is the one the headers state.
  const bool has_te = header.count(http::field::transfer_encoding) > 0;
  FUZZ_CHECK(parser.chunked() == has_te);
  if (has_te) FUZZ_CHECK(header.count(http::field::content_length) == 0);
  // The rest of the body, as the server would read it.
  while (!ec && !parser.is_done() && used < bytes.size()) {
    const size_t n = parser.put(boost::asio::buffer(bytes.data() + used, bytes.size() - used), ec);
    if (n == 0) break;
    used += n;
  }
  return 0;
}
