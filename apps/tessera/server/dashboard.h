// `GET /dashboard`: the operator dashboard, one self-contained HTML page (server/dashboard.html,
// compiled in) that polls /v1/stats and draws its series as SVG. No scripts, styles or fonts
// are fetched from anywhere; the page's only requests are to /v1/stats on the same server.
#pragma once


#include "http_server.h"

namespace tessera::server {

HttpResponse dashboard_response();

}  // namespace tessera::server
