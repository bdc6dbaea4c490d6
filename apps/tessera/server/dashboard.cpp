#include "dashboard.h"

#include "dashboard_html.h"

namespace tessera::server {

HttpResponse dashboard_response() {
  HttpResponse res{http::status::ok, 11};
  res.set(http::field::content_type, "text/html; charset=utf-8");
  res.set(http::field::cache_control, "no-store");
  // Nothing but this page's own inline script and style, and requests back to this server.
  res.set("Content-Security-Policy",
          "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; img-src data:");
  res.set("X-Content-Type-Options", "nosniff");
  res.body() = std::string(kDashboardHtml);
  res.prepare_payload();
  return res;
}

}  // namespace tessera::server
